#!/usr/bin/env python3
"""Where one fine-tuning step's GPU time goes, kernel by kernel (issue 56): the step is run under Nsight
Compute with one metric (gpu__time_duration.sum: each kernel's time on the GPU, without the launch and
synchronization that bench/train_profile.py's node-by-node profile adds), and the kernels are summed by
kind: cuBLAS products, the F32 -> BF16 conversions of the products' operands, flash attention forward and
backward, cross-entropy, AdamW, and the rest (element-wise, norms, copies) by kernel name.

    python bench/kernel_times.py --model F32.gguf [--ctx 2048] [--batch 4] [--mode bf16|lora|qlora] [--out FILE.json]
        [--lora-rank 8] [--lora-targets qv|all] [--trace FILE.json [--launches REGEX]]

The worker (the same script with --worker, started under `ncu --profile-from-start off`) times three
unprofiled steps after two warm-up steps (the median is printed as "step ms"), then runs one step between
cudaProfilerStart and cudaProfilerStop: only that step's kernels are measured. Nsight Compute serializes the
kernels it measures, so the kernels' sum is the step's GPU time without overlap (ggml runs one stream).
With --graph, ncu times the step's CUDA graph as one workload instead (--graph-profiling graph): the GPU time
of the step with the gaps between its kernels; beside the unprofiled step's wall time, llama_opt_get_stats' host
part (inputs set on the host; the eval: input copies, graph launch, the wait for the loss) and the SM clock and
power nvidia-smi sampled while the unprofiled steps ran, it says how much of a step is not kernels.
Needs `ncu` on PATH and a CUDA build of llamabind. Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import datetime
import io
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train import lora_targets  # noqa: E402 (bench/train.py's --lora-targets)

# kinds by kernel name, first match wins (cuBLAS's kernels on Hopper: nvjet_*, sm90_xmma_*, cutlass_*)
KINDS = (
    ("flash attention backward", r"fa_back"),
    ("flash attention forward", r"flash_attn|fattn|fa_fwd"),
    ("matrix products (cuBLAS)", r"gemm|nvjet|xmma|cutlass|sm\d\d_"),
    ("quantized products (MMQ, MMVQ), activations to Q8_1", r"mul_mat_q|mul_mat_vec_q|quantize_q8_1|quantize_mmq"),
    ("dequantization of quantized weights", r"dequantize|convert_unary\w*<block_|k_get_rows_q"),
    ("F32 -> BF16 conversions", r"convert_unary\w*<float, (__)?nv_bfloat16>"),
    ("cross-entropy", r"cross_entropy"),
    ("AdamW", r"adamw"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "element-wise, norms, copies"


def _cudart() -> ctypes.CDLL:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcudart not found")


def worker(args) -> dict:
    import numpy as np

    import llamabind
    from llamabind import train

    rng = np.random.default_rng(0)
    lora = args.mode in ("lora", "qlora")  # qlora: LoRA over --model as it is (a quantized GGUF)
    kw_model = dict(use_mmap=lora, repack=not lora, n_gpu_layers=99, n_threads=8)
    with llamabind.Model(args.model, **kw_model) as m:
        wins = rng.integers(3, m.n_vocab, size=(args.batch, args.ctx + 1), dtype=np.int32)
        kw = dict(ctx_size=args.ctx, batch_size=args.batch, lr=1e-5, n_threads=8)
        if lora:
            adapter = Path(tempfile.mkdtemp()) / "lora.gguf"
            train.lora_init(m, adapter, rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                            targets=lora_targets(args.lora_targets))  # fmt: skip
            kw.update(params="lora", adapter=m.load_lora(adapter), lr=1e-4)
        with train.Trainer(m, **kw) as t:
            for _ in range(2):
                t.step(wins)
            times = []
            s0 = t.stats()
            smi = _clock_sampler()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                t.step(wins)
                times.append(time.perf_counter() - t0)
            clocks = _clock_summary(smi)
            s1 = t.stats()
            if args.trace:
                traced = _traced_steps(t, wins, args.trace, launches=args.launches)
            else:
                rt = _cudart()
                rt.cudaDeviceSynchronize()
                rt.cudaProfilerStart()
                t.step(wins)
                rt.cudaDeviceSynchronize()
                rt.cudaProfilerStop()
    # llama_opt_get_stats: the host's part of a step (inputs set on the host) and the eval (the graph's input
    # copies, its launch and the wait for the loss), per step
    per = {k: (s1[k] - s0[k]) / args.steps for k in ("t_build_ms", "t_alloc_ms", "t_inputs_ms", "t_eval_ms")}
    return dict(step_ms=1e3 * statistics.median(times), step_ms_all=[round(1e3 * x, 3) for x in times],
                opt_stats_ms=per, clocks=clocks, **({"trace": traced} if args.trace else {}))  # fmt: skip


def _traced_steps(t, wins, path: str, n: int = 2, launches: str | None = None) -> list[dict]:
    """n steps traced by CUPTI through torch.profiler (it records every kernel, copy and CUDA runtime call of
    the process, ggml's included), the Chrome trace written to ``path``; per step: its wall time, the time the
    GPU was busy (the union of kernels, copies and memsets), the idle gaps over 0.2 ms (where, and the runtime
    call the host was in then) and the host's runtime calls by total time; with ``launches`` (a regular
    expression) also every launch of the kernels whose names match it, in order: its ms, grid and block, and the
    names of the kernels just before and after it (what it feeds or follows)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            with record_function(f"step{i}"):
                t.step(wins)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    ev = json.loads(Path(path).read_text())["traceEvents"]
    steps = sorted((e for e in ev if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step")),
                   key=lambda e: e["ts"])  # fmt: skip
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))  # fmt: skip
    api = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    out = []
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        busy, gaps, end = 0.0, [], a
        for g0, g1, _ in (g for g in gpu if g[1] > a and g[0] < b):
            g0, g1 = max(g0, a), min(g1, b)
            if g0 - end > 200:
                host = [x["name"] for x in api if x["ts"] <= g0 and x["ts"] + x["dur"] >= end]
                gaps.append(dict(at_ms=round((end - a) / 1e3, 2), ms=round((g0 - end) / 1e3, 2), host=host[:3]))
            busy += max(0.0, g1 - max(g0, end))
            end = max(end, g1)
        calls: dict[str, list] = {}
        for x in (x for x in api if a <= x["ts"] < b):
            c = calls.setdefault(x["name"], [0, 0.0])
            c[0] += 1
            c[1] += x["dur"] / 1e3
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]
        kev = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel" and a <= e["ts"] < b]
        kev.sort(key=lambda e: e["ts"])
        kernels = [(e["name"], e["dur"] / 1e3) for e in kev]
        step = dict(wall_ms=s["dur"] / 1e3, gpu_busy_ms=busy / 1e3, tail_idle_ms=max(0.0, b - end) / 1e3,
                    gaps=gaps, runtime_calls={k: [v[0], round(v[1], 2)] for k, v in top},
                    kernels=summarize(kernels))  # fmt: skip
        if launches:
            names = [e["name"] for e in kev]
            step["launches"] = [
                dict(ms=e["dur"] / 1e3, grid=e.get("args", {}).get("grid"), block=e.get("args", {}).get("block"),
                     before=names[i - 1] if i > 0 else None, after=names[i + 1] if i + 1 < len(names) else None)
                for i, e in enumerate(kev) if re.search(launches, e["name"])
            ]  # fmt: skip
        out.append(step)
    return out


def _print_launches(launches: list[dict], regex: str) -> None:
    """--launches: the matching launches grouped by (grid, block, the kernel after them), the costliest first."""
    groups: dict[tuple, list] = {}
    for x in launches:
        key = (str(x["grid"]), str(x["block"]), (x["after"] or "")[:70])
        groups.setdefault(key, []).append(x["ms"])
    print(f"\nlaunches of /{regex}/ in the last traced step: {len(launches)}, {sum(x['ms'] for x in launches):.2f} ms")
    print("| grid | block | launches | ms | mean us | the kernel after |")
    print("|---|---|---|---|---|---|")
    for (grid, block, after), ms in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:40]:
        print(f"| {grid} | {block} | {len(ms)} | {sum(ms):.2f} | {1e3 * sum(ms) / len(ms):.1f} | `{after}` |")


def _clock_sampler():
    """nvidia-smi sampling the SM clock and power every 100 ms while the timed steps run (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    q = "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    return subprocess.Popen([smi, q, "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)


def _clock_summary(p) -> dict | None:
    """Median SM clock (MHz), its maximum, power (W) and the throttle reasons seen over the samples."""
    if p is None:
        return None
    p.terminate()
    rows = []
    for line in p.communicate()[0].splitlines():
        f = [x.strip() for x in line.split(",")]
        try:
            rows.append((float(f[0]), float(f[1]), float(f[2]), float(f[3]), f[4]))
        except (ValueError, IndexError):
            continue
    if not rows:
        return None
    return dict(samples=len(rows), sm_mhz_median=statistics.median(r[0] for r in rows),
                sm_mhz_min=min(r[0] for r in rows), sm_mhz_max_rated=rows[0][1],
                power_w_median=statistics.median(r[2] for r in rows), temp_c_max=max(r[3] for r in rows),
                event_reasons=sorted({r[4] for r in rows}))  # fmt: skip


def parse_ncu_csv(text: str) -> list[tuple[str, float]]:
    """(kernel name, ms) per measured launch from `ncu --csv --print-units base` output."""
    start = text.find('"ID"')
    if start < 0:
        raise RuntimeError("no CSV table in ncu's output:\n" + text[-2000:])
    rows = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            name = row.get("Kernel Name") or row.get("Workload Name") or row.get("Function Name") or "?"
            rows.append((name, float(row["Metric Value"].replace(",", "")) / 1e6))
    return rows


def summarize(launches: list[tuple[str, float]]) -> dict:
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for name, ms in launches:
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        short = name.split("(")[0][:90]
        e = by_name.setdefault(short, [0, 0.0, kind])
        e[0] += 1
        e[1] += ms
    kernels = sorted(({"kernel": k, "launches": v[0], "ms": v[1], "kind": v[2]} for k, v in by_name.items()),
                     key=lambda r: -r["ms"])  # fmt: skip
    return dict(total_ms=sum(ms for _, ms in launches), launches=len(launches),
                by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), kernels=kernels)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an F32 GGUF (bench/make_model.py + train.to_f32)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--mode",
        default="bf16",
        choices=("bf16", "lora", "qlora"),
        help="full fine-tune or LoRA (qlora: over --model quantized), the defaults",
    )
    ap.add_argument("--top", type=int, default=30, help="kernels listed")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", default="qv", help="qv or all (every linear layer of a block), lora/qlora")
    ap.add_argument("--steps", type=int, default=5, help="unprofiled steps timed (after two warm-up steps)")
    ap.add_argument("--graph", action="store_true",
                    help="time the profiled step's CUDA graph as one workload (ncu --graph-profiling graph): its GPU "
                         "time with the gaps between its kernels, against the step's wall time")  # fmt: skip
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, metavar="FILE.json",
                    help="no Nsight Compute: trace two steps with CUPTI (torch.profiler), write the Chrome trace "
                         "to FILE and print where the GPU was idle")  # fmt: skip
    ap.add_argument("--launches", default=None, metavar="REGEX",
                    help="with --trace: every launch of the kernels matching REGEX (e.g. convert_unary), grouped by "
                         "grid, block and the kernel after it")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return 0
    if args.trace:
        res = worker(args)
        print(json.dumps({k: res[k] for k in ("step_ms", "opt_stats_ms", "clocks")}))
        for i, st in enumerate(res["trace"]):
            print(f"traced step {i}: wall {st['wall_ms']:.1f} ms, GPU busy {st['gpu_busy_ms']:.1f} ms, idle at the end "
                  f"{st['tail_idle_ms']:.1f} ms, {len(st['gaps'])} gaps > 0.2 ms")  # fmt: skip
            for g in st["gaps"][:25]:
                print(f"  idle {g['ms']:.2f} ms at {g['at_ms']:.2f} ms (host in {g['host']})")
            print("  runtime calls (count, ms):", st["runtime_calls"])
        last = res["trace"][-1]["kernels"]  # the last traced step's kernels, as CUPTI timed them (ggml's one stream)
        _print(dict(res, **last, mode=args.mode, ctx=args.ctx, batch=args.batch), args.top)
        if args.launches:
            _print_launches(res["trace"][-1]["launches"], args.launches)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(args=vars(args), result=res), indent=1))
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        ap.error("ncu (Nsight Compute) is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.csv"
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
               *(["--graph-profiling", "graph"] if args.graph else []), "--csv", "--print-units", "base",
               "--log-file", str(log), sys.executable, __file__, "--worker", "--model", args.model,
               "--ctx", str(args.ctx), "--batch", str(args.batch), "--mode", args.mode,
               "--steps", str(args.steps), "--lora-rank", str(args.lora_rank),
               "--lora-targets", args.lora_targets]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(lines[-1][len("RESULT ") :])
        if args.out:  # ncu's own table beside the JSON
            shutil.copy(log, Path(args.out).with_suffix(".ncu.csv"))
        res.update(summarize(parse_ncu_csv(log.read_text())))
    res.update(mode=args.mode, ctx=args.ctx, batch=args.batch, graph=args.graph)
    _print(res, args.top)
    doc = dict(host=socket.gethostname(), date=datetime.date.today().isoformat(), args=vars(args), result=res)
    out = Path(args.out) if args.out else HERE / "results" / f"kernel-times-{socket.gethostname()}-{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


def _print(r: dict, top: int) -> None:
    what = "CUDA graphs / workloads" if r.get("graph") else "kernels"
    print(f"\n{r['mode']} {r['ctx']}x{r['batch']}: step {r['step_ms']:.1f} ms unprofiled (median of "
          f"{len(r['step_ms_all'])}); {r['launches']} {what}, "
          f"{r['total_ms']:.1f} ms on the GPU (the kernels' sum)")  # fmt: skip
    print("per step, llama_opt_get_stats:", {k: round(v, 2) for k, v in r["opt_stats_ms"].items()})
    print("clocks while the unprofiled steps ran:", r.get("clocks"))
    print("\n| kind | ms per step | share |\n|---|---|---|")
    for k, ms in r["by_kind"].items():
        print(f"| {k} | {ms:.2f} | {100 * ms / r['total_ms']:.1f}% |")
    print("\n| kernel | kind | launches | ms |\n|---|---|---|---|")
    for e in r["kernels"][:top]:
        print(f"| `{e['kernel']}` | {e['kind']} | {e['launches']} | {e['ms']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
