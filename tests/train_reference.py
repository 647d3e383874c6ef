"""PyTorch reference for tests/test_train.py::test_matches_pytorch (runs in the side venv).

    python train_reference.py WORK

WORK/job.json: {"f32": GGUF, "sgd": GGUF after one SGD step (lr 1, no weight decay) in llamabind,
"adamw": GGUF after the AdamW steps in llamabind, "window": token ids (or a list of windows: a
batch, whose loss is the mean over all its positions), optionally "labels" (n_ctx ids of one window,
-1 = left out of the loss: ignore_index), "adamw_steps": n, "lr": x,
"weight_decay": w}. Every tensor is trained, the tied token embeddings too. transformers loads
each GGUF as LlamaForCausalLM in float32 (it undoes the
converter's Q/K row permutation), PyTorch computes the loss and gradients of the same window and runs
the same AdamW steps (torch.optim.AdamW, betas 0.9/0.999, eps 1e-8). Writes WORK/result.json: the
loss, and per tensor the gradient cosine (llamabind's from its SGD step: w0 - w1) and the relative
difference of the weights after the AdamW steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf_once import load_model  # one parse per GGUF file, one load per base (tests/gguf_once.py)


def loss_of(model, window: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    batch = window if window.ndim == 2 else window[None]  # (B, n_ctx + 1)
    logits = model(batch[:, :-1]).logits  # (B, n_ctx, n_vocab)
    if labels is not None:  # one window, n_ctx labels, -1 left out (ignore_index -100)
        lab = torch.where(labels < 0, -100, labels)
        return F.cross_entropy(logits[0], lab, ignore_index=-100, reduction="mean")
    # mean over the B * n_ctx positions (windows of one length: the mean of the windows' means)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="mean")


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    window = torch.tensor(job["window"], dtype=torch.long)
    labels = torch.tensor(job["labels"], dtype=torch.long) if job.get("labels") else None
    torch.manual_seed(0)
    # every parameter trained: the tied embed_tokens/lm_head is one tensor (patch 0033)
    model = load_model(job["f32"], keep=True)
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss = loss_of(model, window, labels)
    loss.backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}
    out: dict = {"loss": loss.item(), "grad_cosine": {}, "adamw_rel": {}, "adamw_losses": []}
    sgd = dict(load_model(job["sgd"]).named_parameters())
    for k, g in grads.items():
        ours = (w0[k] - sgd[k].detach()).double().flatten()  # lr 1: the gradient llamabind applied
        ref = g.double().flatten()
        out["grad_cosine"][k] = float(ours @ ref / (ours.norm() * ref.norm() + 1e-30))
    model.zero_grad()
    opt = torch.optim.AdamW(
        [v for v in model.parameters() if v.requires_grad],
        lr=job["lr"],
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=job["weight_decay"],
    )
    for _ in range(job["adamw_steps"]):
        opt.zero_grad()
        step_loss = loss_of(model, window, labels)
        step_loss.backward()
        opt.step()
        out["adamw_losses"].append(step_loss.item())
    ours = dict(load_model(job["adamw"]).named_parameters())
    for k, v in model.named_parameters():
        a, b = ours[k].detach().double(), v.detach().double()
        out["adamw_rel"][k] = float((a - b).norm() / b.norm())
        out.setdefault("update_cosine", {})[k] = float(
            ((a - w0[k].double()).flatten() @ (b - w0[k].double()).flatten())
            / ((a - w0[k].double()).norm() * (b - w0[k].double()).norm() + 1e-30)
        )
    (work / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
