"""PyTorch reference for tests/test_train_preference.py::test_dpo_and_orpo_step_match_pytorch (side venv).

    python preference_train_reference.py WORK

WORK/job.json: {"f32": base GGUF (F32), "windows": (2n, T + 1) token ids, window 2i pair i's prompt and chosen
answer, 2i + 1 its rejected one, "labels": (2n, T) ids, -1 outside the answers, "refs": (n,) DPO's reference
log-ratios, "beta", "scale", "lr", "weight_decay", "adamw_steps", and per method ("dpo", "orpo") the LoRA
adapters llamabind wrote: "init", "sgd" (after one SGD step with lr 1), "adamw" (after the AdamW steps)}.
transformers loads the base as LlamaForCausalLM in float32, frozen; a hand-written LoRA adds
scale * B (A x) to v_proj's and o_proj's outputs. Each window's log-likelihood is the sum of log_softmax at its
labels; the losses are written from the papers' formulas as TRL states them: DPO (Rafailov et al. 2023, eq. 7)
``-log sigmoid(beta ((lc - lr) - ref))``, mean over pairs; ORPO (Hong et al. 2024, eq. 6-7) the chosen
answers' pooled token nll plus beta x the mean of ``-log sigmoid(log odds ratio)`` of the mean token log-probs.
Writes WORK/result.json: per method the loss, the gradient cosine per adapter tensor (llamabind's from its
SGD step), the AdamW step losses and the adapters' relative difference after them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf_once import load_model
from lora_reference import HF, compare_adapters, read_adapter


def preference_loss(method: str, logps: torch.Tensor, n: torch.Tensor, refs: torch.Tensor, beta: float):
    lc, lr = logps[0::2], logps[1::2]
    if method == "dpo":
        return -F.logsigmoid(beta * ((lc - lr) - refs)).mean()
    nc, nr = n[0::2], n[1::2]
    mc, mr = lc / nc, lr / nr
    log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
    return -lc.sum() / nc.sum() - beta * F.logsigmoid(log_odds).mean()


def run_method(model, job: dict, method: str) -> dict:
    adapters = job[method]
    init = read_adapter(adapters["init"])
    params = {name: torch.tensor(a, requires_grad=True) for name, a in init.items()}
    hooks = []
    for name in {k.rsplit(".", 1)[0] for k in params}:  # blk.N.attn_v.weight
        _, layer, kind, _ = name.split(".")
        mod = model.get_submodule(f"model.layers.{layer}.{HF[kind]}")
        a, b = params[name + ".lora_a"], params[name + ".lora_b"]
        hooks.append(mod.register_forward_hook(lambda m, i, out, a=a, b=b: out + job["scale"] * (i[0] @ a.T) @ b.T))
    windows = torch.tensor(job["windows"], dtype=torch.long)
    labels = torch.tensor(job["labels"], dtype=torch.long)
    mask = labels >= 0
    n = mask.sum(dim=1).double()
    refs = torch.tensor(job["refs"], dtype=torch.float64)

    def loss_of():
        logp = F.log_softmax(model(windows[:, :-1]).logits.double(), dim=-1)
        picked = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return preference_loss(method, (picked * mask).sum(dim=1), n, refs, job["beta"])

    loss = loss_of()
    loss.backward()
    out = compare_adapters(params, init, loss.item(), loss_of, job, adapters["sgd"], adapters["adamw"])
    for h in hooks:
        h.remove()
    return out


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    model = load_model(job["f32"], keep=True)
    for v in model.parameters():
        v.requires_grad_(False)
    result = {method: run_method(model, job, method) for method in ("dpo", "orpo")}
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
