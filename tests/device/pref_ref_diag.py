"""Issue 83 on the GPU: where DPO's reference log-probabilities (forward-only evaluations of the preference graph)
part from the policy's at step 1 (the training graph's forward), so that step 1's loss is not ln 2. One process a
setting (the switches are read once a process): DPO over pairs of 7/8 ctx tokens (bench/preference.py's), one
step, LoRA and full; prints |loss - ln 2| and mean(log pi(c) - log ref(c)) (rewards/chosen / beta) per setting.

    python3 tests/device/pref_ref_diag.py MODEL.gguf [--ctx 512] [--pairs 8] [--settings "NAME:VAR=V,VAR=V ..."]
"""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SETTINGS = (
    "default: fa_keep_stats0:GGML_CUDA_FA_KEEP_STATS=0 fa_keep_bf16_0:GGML_CUDA_FA_KEEP_BF16=0 "
    "bf16_reuse0:GGML_CUDA_BF16_REUSE=0 gemm_add0:GGML_CUDA_FUSE_GEMM_ADD=0 no_fusion:GGML_CUDA_DISABLE_FUSION=1 "
    "no_graphs:GGML_CUDA_DISABLE_GRAPHS=1 bf16_inputs0:LLAMA_OPT_BF16_INPUTS=0 bf16_ffn0:LLAMA_OPT_BF16_FFN=0 "
    "bf16_frozen0:LLAMA_OPT_BF16_FROZEN=0 ce_bf16_0:GGML_CUDA_CE_BF16=0 tiles_once0:GGML_CUDA_FA_TILES_ONCE=0 "
    "fwd_q_f32_0:GGML_CUDA_FA_FWD_Q_F32=0 reuse_disable:LLAMA_GRAPH_REUSE_DISABLE=1 no_flash:@flash=0 "
    "f32:@precision=f32"
)


def one(args) -> None:
    """The child: one DPO step; prints a JSON line."""
    import numpy as np

    import llamabind
    from llamabind import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from preference import make_pairs

    pairs = [
        train.PreferencePair(*(np.asarray(x, np.int32) for x in p))
        for p in make_pairs(args.model, args.ctx, args.pairs)
    ]
    kw = dict(method="dpo", beta=0.1, ctx_size=args.ctx, batch_size=args.pairs, iters=1, val_split=0.0, shuffle=False,
              progress=False)  # fmt: skip
    if args.flash is not None:
        kw["flash_attn"] = bool(args.flash)
    if args.precision:
        kw["precision"] = args.precision
    lora = args.kind == "lora"
    with llamabind.Model(args.model, use_mmap=lora, repack=False, n_gpu_layers=-1) as m:
        decode = train.pair_logps(m, pairs)  # llama_decode's: another path to the reference's numbers
        r = train.preference(m, pairs, lora_rank=8 if lora else None, lr=1e-4 if lora else 1e-6, **kw)
    m0 = r.metrics[0]
    ref = m0.logps_chosen - m0.rewards_chosen / 0.1
    print(json.dumps(dict(loss=r.losses[0], dev=abs(r.losses[0] - math.log(2)), d_chosen=m0.rewards_chosen / 0.1,
                          d_rejected=m0.rewards_rejected / 0.1, policy=m0.logps_chosen, ref=ref,
                          decode=float(decode[:, 0].mean()))))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--settings", default=SETTINGS)
    ap.add_argument("--kinds", default="lora,full")
    ap.add_argument("--child", default=None)
    ap.add_argument("--flash", type=int, default=None)
    ap.add_argument("--precision", default=None)
    args = ap.parse_args()
    if args.child:
        args.kind = args.child
        return one(args)
    for spec in args.settings.split():
        name, _, assigns = spec.partition(":")
        env, extra = dict(os.environ), []
        for a in filter(None, assigns.split(",")):
            k, _, v = a.partition("=")
            if k.startswith("@"):
                extra += [f"--{k[1:]}", v]
            else:
                env[k] = v
        for kind in args.kinds.split(","):
            cmd = [
                sys.executable,
                __file__,
                args.model,
                "--ctx",
                str(args.ctx),
                "--pairs",
                str(args.pairs),
                "--child",
                kind,
                *extra,
            ]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            line = next((x for x in p.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(f"{name:16s} {kind:5s} failed rc={p.returncode}: {p.stderr[-400:]}", flush=True)
                continue
            r = json.loads(line)
            print(f"{name:16s} {kind:5s} loss {r['loss']:.6f} |loss - ln 2| {r['dev']:.2e} "
                  f"mean d logp chosen {r['d_chosen']:+.4f} rejected {r['d_rejected']:+.4f}; logp chosen: policy "
                  f"{r['policy']:.3f} ref {r['ref']:.3f} decode {r['decode']:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
