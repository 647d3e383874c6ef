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
import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGESIZE") // 1024)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def heap_bytes() -> int:
    mi = _libc.mallinfo2()
    return mi.uordblks + mi.hblkhd


_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def smaps_rss_kib() -> dict[str, int]:
    """RSS by mapping: the file's name, [heap], [stack], or [anon]."""
    out: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                parts = line.split(maxsplit=5)
                name = os.path.basename(parts[5].strip()) if len(parts) > 5 and parts[5].strip() else "[anon]"
            elif line.startswith("Rss:"):
                out[name] = out.get(name, 0) + int(line.split()[1])
    return out


def worker(model: str, mode: str, ngl: int, cycles: int) -> dict:
    import llamabind

    def cycle():
        with llamabind.Model(model, n_ctx=64, n_threads=1, n_gpu_layers=ngl) as m:
            if mode == "gen":
                m.generate("Hi", max_tokens=2, temperature=0)

    for _ in range(10):
        cycle()
    rss0, heap0, maps0 = rss_kib(), heap_bytes(), smaps_rss_kib()
    trace = []
    for i in range(1, cycles + 1):
        cycle()
        if i % 25 == 0:
            trace.append([i, rss_kib(), heap_bytes()])
    rss1, heap1, maps1 = rss_kib(), heap_bytes(), smaps_rss_kib()
    _libc.malloc_trim(0)
    grew = {k: round((maps1.get(k, 0) - maps0.get(k, 0)) / 1024, 2) for k in set(maps0) | set(maps1)}
    return {"drift_rss_mb": round((rss1 - rss0) / 1024, 2), "drift_heap_mb": round((heap1 - heap0) / 2**20, 2),
            "drift_rss_after_trim_mb": round((rss_kib() - rss0) / 1024, 2), "trace": trace,
            "smaps_growth_mb": {k: v for k, v in sorted(grew.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.5}}


def build_native(build_dir: Path) -> Path:
    """Links tests/device/load_cycles.cpp against the static libraries of the llamabind build."""
    exe = Path("/tmp/load_cycles")
    libs = sorted(str(p) for p in (build_dir / "llama.cpp").rglob("lib*.a")
                  if p.name.startswith(("libllama.a", "libggml")))
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"
    cuda_libs = [f"-L{cuda}", f"-L{cuda}/stubs", "-lcudart", "-lcublas", "-lcublasLt", "-lcuda"] \
        if any("ggml-cuda" in lib for lib in libs) else []
    cmd = ["g++", "-O2", "-o", str(exe), str(ROOT / "tests/device/load_cycles.cpp"),
           f"-I{ROOT}/vendor/llama.cpp/include", f"-I{ROOT}/vendor/llama.cpp/ggml/include",
           "-Wl,--start-group", *libs, "-Wl,--end-group", *cuda_libs, "-fopenmp", "-lpthread", "-ldl", "-lrt"]
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
        procs[name] = (kind, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env={**os.environ, **env}))
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
        print(f"{name:18} {r.get('drift_rss_mb', float('nan')):12.2f} {r.get('drift_heap_mb', float('nan')):13.2f} "
              f"{r.get('drift_rss_after_trim_mb', float('nan')):14.2f}  {r.get('smaps_growth_mb', r.get('error', ''))}")
    if a.out:
        a.out.write_text(json.dumps({"cycles": a.cycles, "model": os.path.basename(a.model), "results": results},
                                    indent=1))


if __name__ == "__main__":
    main()
