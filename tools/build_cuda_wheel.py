#!/usr/bin/env python3
"""Build llamabind's CUDA wheel: the portable build (shared ggml/llama, every CPU variant as a
module) with ggml-cuda as a backend module for the GPU architectures users have, depending on
NVIDIA's pip packages for the CUDA runtime and cuBLAS instead of bundling them.

    python tools/build_cuda_wheel.py [--archs "75-virtual;80;86;89;90;120-virtual"] [--out dist]
        [--cuda-major 13] [--no-build-isolation] [--repair]

The libraries are found at run time through the RUNPATH of ggml-cuda's module: LD_LIBRARY_PATH,
then site-packages/nvidia/cu13/lib (nvidia-cuda-runtime, nvidia-cublas), then the system's (a
CUDA toolkit install); the driver (libcuda.so.1) always comes from the system. The wheel gets
``Requires-Dist: nvidia-cuda-runtime==13.*, nvidia-cublas==13.*`` (``pip install --no-deps`` where
the toolkit is installed system-wide). Needs the CUDA toolkit (nvcc) and a C++ compiler; on CPython
>= 3.12 the wheel is cp312-abi3 (one wheel for every later Python). ``--repair`` runs auditwheel
(manylinux tag) excluding the CUDA libraries. Default architectures: real code for sm_80, 86, 89,
90 and PTX for sm_75 and sm_120 (JIT-compiled by the driver on first use), as llama.cpp's own
release builds mix real and virtual architectures.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARCHS = "75-virtual;80;86;89;90;120-virtual"


def add_requirements(wheel: Path, requirements: list[str]) -> None:
    """Add Requires-Dist lines to the wheel's METADATA and rewrite its RECORD (sha256, size)."""
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        for n in names:
            if n == record:
                continue
            data = src.read(n)
            if n.endswith(".dist-info/METADATA"):
                head, sep, body = data.decode("utf-8").partition("\n\n")
                head += "".join(f"\nRequires-Dist: {r}" for r in requirements)
                data = (head + sep + body).encode("utf-8")
            info = src.getinfo(n)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{n},sha256={digest},{len(data)}")
        rows.append(f"{record},,")
        dst.writestr(record, "\n".join(rows) + "\n")
    tmp.replace(wheel)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help=f"CMAKE_CUDA_ARCHITECTURES (default {DEFAULT_ARCHS})")
    ap.add_argument("--out", default="dist", help="where the wheel goes (default dist/)")
    ap.add_argument("--cuda-major", default="13", help="the CUDA major version of the pip packages (default 13)")
    ap.add_argument("--no-build-isolation", action="store_true", help="build with this environment's packages")
    ap.add_argument("--repair", action="store_true", help="auditwheel repair (manylinux tag), CUDA libraries excluded")
    a = ap.parse_args()
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        print("error: nvcc not found: the CUDA toolkit is needed to build the CUDA wheel", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(
        [
            env.get("CMAKE_ARGS", ""),
            "-DLLAMABIND_CUDA_WHEEL=ON",
            f"-DLLAMABIND_CUDA_MAJOR={a.cuda_major}",
            f"-DCMAKE_CUDA_ARCHITECTURES={a.archs}",
        ]
    ).strip()
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    env["LLAMABIND_BUILD_TOOLS"] = "OFF"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-w", tmp, "-v"]
        if a.no_build_isolation:
            cmd.append("--no-build-isolation")
        subprocess.run(cmd, env=env, check=True)
        (wheel,) = Path(tmp).glob("llamabind-*.whl")
        add_requirements(wheel, [f"nvidia-cuda-runtime=={a.cuda_major}.*", f"nvidia-cublas=={a.cuda_major}.*"])
        if a.repair:
            excl = [f"--exclude=lib{n}.so.{a.cuda_major}" for n in ("cudart", "cublas", "cublasLt")]
            subprocess.run(
                ["auditwheel", "repair", "--exclude=libcuda.so.1", *excl, "-w", str(out), str(wheel)], check=True
            )
        else:
            shutil.copy2(wheel, out / wheel.name)
    for w in sorted(out.glob("llamabind-*.whl"), key=lambda p: p.stat().st_mtime)[-1:]:
        print(f"{w} ({w.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
