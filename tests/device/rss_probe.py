"""Where host memory grows over CUDA model load / generate / close cycles (issue 6).

test_reliability.py::test_no_leak_over_load_generate_close_cycles saw RSS grow 10.5 MB and 52.4 MB over 200
cycles with full offload on an H200 (CPU: flat). This runs the same cycle in several configurations at once,
each in its own process, and reports per configuration: RSS drift, glibc heap in use (mallinfo2) drift, RSS
after malloc_trim(0), and (Python runs) which mappings of /proc/self/smaps grew:

  py-gen-ngl-1      the test's cycle through llamabind, full offload
  py-load-ngl-1     only Model(...) / close, full offload
  py-gen-ngl0       the test's cycle, weights on the CPU (the CUDA device still exists)
  py-gen-nographs   full offload with GGML_CUDA_DISABLE_GRAPHS=1
  c-gen-ngl99       the same cycle in llama.h alone (tests/device/load_cycles.cpp, same tree)
  c-load-ngl99      load / free only, llama.h alone
  c-gen-ngl0        llama.h alone, weights on the CPU

    python3 tests/device/rss_probe.py MODEL --build-dir build/cp312-cp312-linux_x86_64 --cycles 200 --out rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from memory import growth, malloc_trim, rss_kib, snapshot  # noqa: E402


def worker(model: str, mode: str, ngl: int, cycles: int) -> dict:
    import llamabind

    def cycle():
        with llamabind.Model(model, n_ctx=64, n_threads=1, n_gpu_layers=ngl) as m:
            if mode == "gen":
                m.generate("Hi", max_tokens=2, temperature=0)

    for _ in range(10):
        cycle()
    start = snapshot()
    trace = []
    for i in range(1, cycles + 1):
        cycle()
        if i % 25 == 0:
            trace.append([i, rss_kib()])
    g = growth(start, snapshot())
    malloc_trim()
    return {
        "drift_rss_mb": g["rss_mb"],
        "drift_heap_mb": g["heap_mb"],
        "smaps_growth_mb": g["maps_mb"],
        "drift_rss_after_trim_mb": round((rss_kib() - start["rss_kib"]) / 1024, 2),
        "trace": trace,
    }


def build_native(build_dir: Path, source: str = "load_cycles.cpp") -> Path:
    """Links tests/device/SOURCE with the libraries CMake linked _core with (build.ninja)."""
    exe = Path("/tmp") / Path(source).stem
    lines = (build_dir / "build.ninja").read_text().split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith("build _core"))
    libs = next(ln for ln in lines[start:] if ln.strip().startswith("LINK_LIBRARIES")).split("=", 1)[1].split()
    libs = [
        str(build_dir / x) if x.endswith(".a") and not x.startswith("/") else x for x in libs if "nanobind" not in x
    ]
    cmd = [
        "g++",
        "-O2",
        "-o",
        str(exe),
        str(ROOT / "tests/device" / source),
        f"-I{ROOT}/vendor/llama.cpp/include",
        f"-I{ROOT}/vendor/llama.cpp/ggml/include",
        "-Wl,--start-group",
        *libs,
        "-Wl,--end-group",
        "-lpthread",
        "-ldl",
    ]
    subprocess.run(cmd, check=True)
    return exe


def parse_native(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=1800)
    lines = out.strip().split("\n")
    if p.returncode != 0 or not lines[-1].startswith("drift_rss_mb"):
        return {"error": f"rc={p.returncode}: {err[-400:]}"}
    last = dict(zip(*[iter(lines[-1].split())] * 2))
    trace = [[int(w[1]), int(w[3]), int(w[5])] for w in (ln.split() for ln in lines) if w and w[0] == "cycle"]
    return {"drift_rss_mb": float(last["drift_rss_mb"]), "drift_heap_mb": float(last["drift_heap_mb"]), "trace": trace}


CONFIGS = {
    "py-gen-ngl-1": ("py", "gen", -1, {}),
    "py-load-ngl-1": ("py", "load", -1, {}),
    "py-gen-ngl0": ("py", "gen", 0, {}),
    "py-gen-nographs": ("py", "gen", -1, {"GGML_CUDA_DISABLE_GRAPHS": "1"}),
    "c-gen-ngl99": ("c", "gen", 99, {}),
    "c-load-ngl99": ("c", "load", 99, {}),
    "c-gen-ngl0": ("c", "gen", 0, {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--build-dir", type=Path, help="the llamabind CMake build dir (for the llama.h-only program)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "NGL", "NAME"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.model, a.worker[0], int(a.worker[1]), a.cycles)))
        return
    exe = build_native(a.build_dir) if a.build_dir else None
    procs = {}
    for name, (kind, mode, ngl, env) in CONFIGS.items():  # all at once, each in its own process
        if kind == "py":
            cmd = [sys.executable, __file__, a.model, "--cycles", str(a.cycles), "--worker", mode, str(ngl), name]
        elif exe:
            cmd = [str(exe), a.model, str(a.cycles), str(ngl), mode]
        else:
            continue
        procs[name] = (
            kind,
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}),
        )
    results = {}
    for name, (kind, p) in procs.items():
        if kind == "c":
            results[name] = parse_native(p)
            continue
        out, err = p.communicate(timeout=1800)
        try:
            results[name] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            results[name] = {"error": f"rc={p.returncode}: {err[-400:]}"}
    print(f"{'config':18} {'RSS drift MB':>12} {'heap drift MB':>13} {'RSS after trim':>14}  grew (MB)")
    for name, r in results.items():
        print(
            f"{name:18} {r.get('drift_rss_mb', float('nan')):12.2f} {r.get('drift_heap_mb', float('nan')):13.2f} "
            f"{r.get('drift_rss_after_trim_mb', float('nan')):14.2f}  {r.get('smaps_growth_mb', r.get('error', ''))}"
        )
    if a.out:
        a.out.write_text(
            json.dumps({"cycles": a.cycles, "model": os.path.basename(a.model), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
