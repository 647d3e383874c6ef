"""Issue 58 on the GPU: what rebuilding the training graphs every step costs a preference loss (patch 0054 rebuilds
them for every ubatch; the cross-entropy keeps them, patch 0032). The same 16 windows of 512 tokens (8 pairs) of
the 1B shape with LoRA r8 under the cross-entropy (answer labels) and under DPO: the median step, and
llama_opt_get_stats' build / alloc / eval milliseconds per step.

    python3 tests/device/pref_rebuild.py MODEL.gguf [--ctx 512] [--pairs 8] [--steps 8]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from preference import make_pairs  # noqa: E402

import llamabind  # noqa: E402
from llamabind import train  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--ctx", type=int, default=512)
ap.add_argument("--pairs", type=int, default=8)
ap.add_argument("--steps", type=int, default=8)
a = ap.parse_args()
with llamabind.Model(a.model, repack=False, n_gpu_layers=-1) as m, tempfile.TemporaryDirectory() as tmp:
    raw = make_pairs(Path(a.model), a.ctx, a.pairs)
    pairs = [train.PreferencePair(*(np.asarray(x, np.int32) for x in p)) for p in raw]
    win, lab, _, _ = train.pair_windows(pairs, a.ctx, 0)
    refs = np.zeros(a.pairs)
    for loss in ("cross_entropy", "dpo"):
        train.lora_init(m, f"{tmp}/{loss}.gguf", 8, 16.0, ["attn_q", "attn_v"])
        adapter = m.load_lora(f"{tmp}/{loss}.gguf")
        with train.Trainer(m, ctx_size=a.ctx, batch_size=len(win), params="lora", adapter=adapter, lr=1e-4,
                           loss=loss) as t:  # fmt: skip
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                t.optimizer.reset()
                t.optimizer.eval(win, True, lab, refs if loss == "dpo" else None)
                t.optimizer.result(True)
                times.append(time.perf_counter() - t0)
            s = t.stats()
        n = s["n_evals"]
        per = {k: s[f"t_{k}_ms"] / n for k in ("build", "alloc", "inputs", "eval")}
        print(
            f"{loss:13s}: median step {1e3 * statistics.median(times[1:]):7.1f} ms; per step: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in per.items())
            + f"; graph builds {s['n_graph_builds']}, opt builds {s['n_opt_builds']}, allocs {s['n_graph_allocs']}"
            + f" over {n} evals"
        )
