"""PyTorch reference for tests/test_train.py::test_lora_matches_pytorch (runs in the side venv).

    python lora_reference.py WORK

WORK/job.json: {"f32": base GGUF (F32), "init"/"sgd"/"adamw": LoRA adapter GGUFs (before, after one
SGD step with lr 1, after the AdamW steps, all written by llamabind), "window", "adamw_steps", "lr",
"weight_decay", "scale"}. transformers loads the base as LlamaForCausalLM in float32, frozen; a
hand-written LoRA adds scale * B (A x) to the outputs of v_proj and o_proj (GGUF attn_v/attn_output:
rows in the same order on both sides), with A, B from the init adapter. Writes WORK/result.json: the
loss, per adapter tensor the gradient cosine (llamabind's from its SGD step) and the relative
difference after the AdamW steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf_once import load_model  # one parse per GGUF file, one load per base (tests/gguf_once.py)

HF = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}


def read_adapter(path: str) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {
        t.name: np.array(t.data, dtype=np.float32).reshape(list(reversed([int(n) for n in t.shape]))) for t in r.tensors
    }


def compare_adapters(params: dict, init: dict, loss: float, loss_of, job: dict, sgd_path: str, adamw_path: str) -> dict:
    """The comparison with llamabind's adapters, ``params`` (torch tensors, their gradients of the loss
    computed): per tensor the cosine of the gradient with llamabind's SGD step of lr 1 (init - sgd), then
    job["adamw_steps"] AdamW steps here (job["lr"], job["weight_decay"]; torch.optim.AdamW with ggml-opt's
    betas and eps) and the relative difference from llamabind's adapter after its own."""
    sgd = read_adapter(sgd_path)
    out: dict = {"loss": loss, "grad_cosine": {}, "adamw_rel": {}, "adamw_losses": []}
    for n, t in params.items():
        ours = torch.tensor(init[n] - sgd[n]).double().flatten()
        ref = t.grad.double().flatten()
        if ref.norm() > 0:
            out["grad_cosine"][n] = float(ours @ ref / (ours.norm() * ref.norm() + 1e-30))
        else:  # B = 0 at the start: no gradient reaches A on either side
            out["grad_cosine"][n] = 1.0 if ours.norm() == 0 else 0.0
    opt = torch.optim.AdamW(
        list(params.values()), lr=job["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=job["weight_decay"]
    )
    for _ in range(job["adamw_steps"]):
        opt.zero_grad()
        step_loss = loss_of()
        step_loss.backward()
        opt.step()
        out["adamw_losses"].append(step_loss.item())
    ours_after = read_adapter(adamw_path)
    for n, t in params.items():
        b = t.detach().double()
        out["adamw_rel"][n] = float((torch.tensor(ours_after[n]).double() - b).norm() / b.norm())
    return out


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    model = load_model(job["f32"], keep=True)
    for v in model.parameters():
        v.requires_grad_(False)
    init = read_adapter(job["init"])
    params: dict[str, torch.Tensor] = {n: torch.tensor(a, requires_grad=True) for n, a in init.items()}
    scale = job["scale"]
    for name in {n.rsplit(".", 1)[0] for n in params}:  # blk.N.attn_v.weight
        _, layer, kind, _ = name.split(".")
        mod = model.get_submodule(f"model.layers.{layer}.{HF[kind]}")
        a, b = params[name + ".lora_a"], params[name + ".lora_b"]
        mod.register_forward_hook(lambda m, inp, out, a=a, b=b: out + scale * (inp[0] @ a.T) @ b.T)
    window = torch.tensor(job["window"], dtype=torch.long)

    # "labels" (optional): n_ctx ids, -1 = left out of the loss (PyTorch's ignore_index -100)
    labels = torch.tensor(job["labels"], dtype=torch.long) if job.get("labels") else window[1:]
    labels = torch.where(labels < 0, -100, labels)

    def loss_of():
        return F.cross_entropy(model(window[None, :-1]).logits[0], labels, ignore_index=-100, reduction="mean")

    loss = loss_of()
    loss.backward()
    out = compare_adapters(params, init, loss.item(), loss_of, job, job["sgd"], job["adamw"])
    (work / "result.json").write_text(json.dumps(out))
    np.savez(work / "torch_adapter.npz", **{n: t.detach().numpy() for n, t in params.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
