#!/usr/bin/env python3
"""Image prefill: llamabind against upstream's llama-mtmd-cli on the same model, projector and image,
alternating in one run (target: llamabind's time <= 1/0.98 of the CLI's).

Both evaluate the image the same way: the projector's encoder (mtmd_encode_chunk; the CLI through
its batch API, one image per batch), then the image's embeddings through llama_decode
(mtmd_helper_decode_image_chunk). The CLI's time is what it logs for the two steps
("mtmd batch encoding done in N ms" and "image decoded (batch 1/1) in N ms", millisecond
resolution); llamabind's is the wall time of ``Context.decode_media`` on the chunk after the text
before it (and the same two lines, logged by libmtmd's helper in llamabind's process). Both are
the first image after loading, in a fresh process (the CLI runs once per image; both warm the
encoder up at load); a later image in the same process (warm) is reported beside. The projector
is a random-weight Gemma 3 vision projector (bench/make_mmproj.py) of the chosen size; the text
model SmolLM2-135M by default.

    .venv/bin/python bench/multimodal.py [--size base] [--rounds 3] [--model PATH] [--threads N] [--tag vm]
Writes bench/results/multimodal-<tag>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llamabind
from llamabind import multimodal

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "vendor" / "llama.cpp" / "tools" / "mtmd" / "test-1.jpeg"
PROMPT = "Describe the picture."


def _make_mmproj():
    spec = importlib.util.spec_from_file_location("make_mmproj", ROOT / "bench" / "make_mmproj.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli_ms(model: str, mmproj: str, threads: int, ngl: int) -> tuple[float, float]:
    cli = llamabind.tool_path("llama-mtmd-cli")
    if cli is None:
        sys.exit("llama-mtmd-cli is not built: install with LLAMABIND_BUILD_TOOLS=ON (./dev setup does)")
    cmd = [str(cli), "-m", model, "--mmproj", mmproj, "--image", str(IMAGE), "-p", PROMPT, "-n", "1", "--jinja"]
    cmd += ["-t", str(threads), "-ngl", str(ngl), "-c", "4096", "-lv", "4"]  # -lv 4: the helper's timing lines
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    enc = re.findall(r"mtmd batch encoding done in (\d+) ms", r.stderr)
    dec = re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", r.stderr)
    if not enc or not dec:
        sys.exit("could not find llama-mtmd-cli's timing lines:\n" + r.stderr[-2000:])
    return float(enc[0]), float(sum(int(x) for x in dec))


def ours_ms(m: llamabind.Model) -> float:
    content = [{"type": "image", "image": IMAGE}, {"type": "text", "text": PROMPT}]
    msgs, media = multimodal.split_media([{"role": "user", "content": content}])
    cp = m.chat_templates().apply(msgs)
    assert m.projector is not None
    p = multimodal.prompt(m.projector, cp.prompt, media)
    with m.context(n_ctx=4096) as ctx:
        k = next(i for i, x in enumerate(p.pieces) if not isinstance(x, int))
        ctx.decode(p.pieces[:k])
        t = time.perf_counter()
        ctx.decode_media(p.pieces[k], logits_last=False)
        return (time.perf_counter() - t) * 1e3


def ours_cold_ms(model: str, mmproj: str, threads: int, ngl: int) -> tuple[float, float, float]:
    """The first image after loading, in a fresh process (as the CLI's time is: warmup at load, then one
    image): wall ms of decode_media, and the encode and decode ms libmtmd's helper logs."""
    code = (  # libmtmd's own timing lines (the helper's, as the CLI logs them) go to stderr at INFO
        "import sys, logging, llamabind; sys.path.insert(0, sys.argv[1]); import multimodal as b; "
        "logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "m = llamabind.Model(sys.argv[2], mmproj=sys.argv[3], n_threads=int(sys.argv[4]), "
        "n_gpu_layers=int(sys.argv[5]), n_ctx=4096); print(b.ours_ms(m))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "bench"), model, mmproj, str(threads), str(ngl)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    enc = re.findall(r"image slice encoded in (\d+) ms", r.stderr)
    dec = re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", r.stderr)
    return (
        float(r.stdout.strip().splitlines()[-1]),
        float(enc[-1]) if enc else -1,
        float(sum(map(int, dec)) if dec else -1),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="text model GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--size", choices=["small", "base", "real"], default="base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-gpu-layers", "-ngl", type=int, default=99)
    ap.add_argument("--tag", default="vm", help="machine tag in the results file name")
    a = ap.parse_args()
    model = str(llamabind.models.resolve(a.model or llamabind.models.DEFAULT))
    threads = a.threads or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        mmproj = _make_mmproj().vision(os.path.join(d, "mmproj.gguf"), size=a.size)
        m = llamabind.Model(model, mmproj=mmproj, n_threads=threads, n_gpu_layers=a.n_gpu_layers, n_ctx=4096)
        ours_ms(m)  # the first encode after load allocates: leave it out, as the CLI's warmup does
        rows = []
        for _ in range(a.rounds):
            enc, dec = cli_ms(model, mmproj, threads, a.n_gpu_layers)
            cold, cold_enc, cold_dec = ours_cold_ms(model, mmproj, threads, a.n_gpu_layers)
            rows.append(
                {"cli_encode_ms": enc, "cli_decode_ms": dec, "cli_ms": enc + dec, "llamabind_ms": cold,
                 "llamabind_encode_ms": cold_enc, "llamabind_decode_ms": cold_dec, "llamabind_warm_ms": ours_ms(m)}
            )  # fmt: skip
        m.close()
    cli = statistics.median(r["cli_ms"] for r in rows)
    ours = statistics.median(r["llamabind_ms"] for r in rows)
    warm = statistics.median(r["llamabind_warm_ms"] for r in rows)
    print(f"image prefill, Gemma 3 projector '{a.size}' on {IMAGE.name}, {threads} threads, ngl {a.n_gpu_layers}")
    print("both first image after load in a fresh process (the CLI: one run each); warm: llamabind's later images")
    print(
        f"{'round':>5} {'cli encode':>11} {'cli decode':>11} {'cli total':>10} {'lb encode':>10} {'lb decode':>10} "
        f"{'llamabind':>10} {'warm':>9}"
    )
    for i, r in enumerate(rows):
        print(
            f"{i:>5} {r['cli_encode_ms']:>9.0f}ms {r['cli_decode_ms']:>9.0f}ms {r['cli_ms']:>8.0f}ms "
            f"{r['llamabind_encode_ms']:>8.0f}ms {r['llamabind_decode_ms']:>8.0f}ms "
            f"{r['llamabind_ms']:>8.1f}ms {r['llamabind_warm_ms']:>7.1f}ms"
        )
    ratio = cli / ours
    print(f"median: llama-mtmd-cli {cli:.0f} ms, llamabind {ours:.1f} ms: {ratio:.3f}x the CLI's speed (target 0.98)")
    print(f"llamabind warm (a later image in the same process): {warm:.1f} ms")
    res = {
        "bench": "multimodal image prefill",
        "host": platform.node(),
        "devices": [d["description"] for d in llamabind.devices()],
        "size": a.size,
        "threads": threads,
        "n_gpu_layers": a.n_gpu_layers,
        "rounds": rows,
        "median_cli_ms": cli,
        "median_llamabind_ms": ours,
        "median_llamabind_warm_ms": warm,
        "speed_ratio": ratio,
    }
    out = ROOT / "bench" / "results" / f"multimodal-{a.tag}-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
