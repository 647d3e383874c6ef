"""Logits of a prompt under tensor split (2 GPUs) vs the whole model on one GPU, each configuration
in a fresh process with its own environment: ggml-cuda's default all-reduce (NCCL when the build found
it, else its own), GGML_CUDA_AR_BF16_THRESHOLD=0 (F32 wire; read only by ggml-cuda's own all-reduce), and
GGML_CUDA_ALLREDUCE=none (the meta backend's butterfly);
and, for scale, one GPU vs the CPU. Prints NMSE per configuration (tests/test_multi_gpu.py's bounds).

    python3 tests/device/split_nmse.py MODEL [--out split-nmse.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

PROMPT = "The three primary colors are"


def logits(model: str, kw: dict) -> np.ndarray:
    import llamabind

    with llamabind.Model(model, n_ctx=512, **kw) as m, m.context(n_ctx=512) as c:
        return c.eval(m.tokenize(PROMPT))


def main() -> None:
    if sys.argv[1] == "--worker":
        np.save(sys.argv[4], logits(sys.argv[2], json.loads(sys.argv[3])))
        return
    model = sys.argv[1]
    runs = {
        "one GPU": ({"n_gpu_layers": -1, "split_mode": "none"}, {}),
        "CPU": ({"n_gpu_layers": 0, "op_offload": False}, {}),
        "tensor, default all-reduce": ({"n_gpu_layers": -1, "split_mode": "tensor", "tensor_split": [1, 1]}, {}),
        "tensor, AR_BF16_THRESHOLD=0": (
            {"n_gpu_layers": -1, "split_mode": "tensor", "tensor_split": [1, 1]},
            {"GGML_CUDA_AR_BF16_THRESHOLD": "0"},
        ),
        "tensor, butterfly": (
            {"n_gpu_layers": -1, "split_mode": "tensor", "tensor_split": [1, 1]},
            {"GGML_CUDA_ALLREDUCE": "none"},
        ),
        "layer split": ({"n_gpu_layers": -1, "split_mode": "layer"}, {}),
    }
    out = {}
    for name, (kw, env) in runs.items():
        path = f"/tmp/split-{len(out)}.npy"
        subprocess.run(
            [sys.executable, __file__, "--worker", model, json.dumps(kw), path], check=True, env={**os.environ, **env}
        )
        out[name] = np.load(path).astype(np.float64)
    ref = out["one GPU"]
    res = {name: float(np.sum((x - ref) ** 2) / np.sum(ref**2)) for name, x in out.items() if name != "one GPU"}
    for name, v in res.items():
        print(f"NMSE vs one GPU: {name:28} {v:.3e}")
    if len(sys.argv) > 3 and sys.argv[2] == "--out":
        with open(sys.argv[3], "w") as f:
            json.dump({"prompt": PROMPT, "nmse_vs_one_gpu": res}, f, indent=1)


if __name__ == "__main__":
    main()
