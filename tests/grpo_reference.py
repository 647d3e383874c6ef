"""TRL's GRPOTrainer itself as the reference of llamabind's GRPO loss and gradient (tests/test_train_grpo.py; the side
venv with trl 1.16).

    python grpo_reference.py WORK

WORK/job.json: {"gguf": the model (F32 GGUF), "cases": [{"name", "prompt": token ids, "completions": [token ids],
"advantages", "old": per completion token log-probabilities or null, "ref": the same or null, "loss_type", "beta",
"epsilon", "epsilon_high", "max_completion_length", "use_bias_correction_kl", "temperature", "ours": the caller's
per completion token log-probabilities or null}]}. Each case builds a GRPOTrainer over transformers'
LlamaForCausalLM (float32, from the GGUF) with those settings and calls its own ``_compute_loss`` on the one prompt
and its completions (right-padded, TRL's completion mask), then backward.
Writes WORK/result.json, per case: the loss, TRL's per-token log-probabilities and the gradient of every weight
(by its GGUF name's transformers name, flattened). Where a case gives "ours", its old and reference log-probabilities
are shifted by TRL's own log-probabilities minus those, so that TRL's ratios and log-ratios to the reference are the
caller's (a BF16 caller's log-probabilities lie up to a few tenths of a nat from F32's, and the ratio carries that
error exponentially into each token's coefficient: matched, what remains is the gradient's own error)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from datasets import Dataset
from gguf_once import load_model
from trl_reference import main, plain

logging.disable(logging.WARNING)
# weights whose layout is the GGUF's (q and k are permuted by the converter): their gradients, element by element
GRADS = ("model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")


def run(base: Path, tokenizer, case: dict, tmp: Path) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    n = len(case["completions"])
    config = GRPOConfig(
        output_dir=str(tmp / case["name"]), per_device_train_batch_size=n, num_generations=n,
        max_completion_length=case["max_completion_length"], loss_type=case["loss_type"], beta=0.0,
        epsilon=case["epsilon"], epsilon_high=case["epsilon_high"], temperature=case["temperature"],
        use_bias_correction_kl=case["use_bias_correction_kl"], report_to=[], use_cpu=True, bf16=False,
        logging_steps=1, save_strategy="no",
    )  # fmt: skip
    model = plain(load_model(base, keep=True))
    data = Dataset.from_list([{"prompt": "x"}])
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                          train_dataset=data, processing_class=tokenizer)  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    # beta set after construction: with beta > 0 the trainer would load a reference model from a hub id; the
    # reference's log-probabilities come with the case (its inputs' ref_per_token_logps)
    trainer.beta = case["beta"]
    model = trainer.model
    model.train()
    T = max(len(c) for c in case["completions"])
    comp = torch.zeros(n, T, dtype=torch.long)
    mask = torch.zeros(n, T, dtype=torch.long)
    for i, c in enumerate(case["completions"]):
        comp[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = 1
    prompt = torch.tensor([case["prompt"]] * n)

    def per_token(x):
        if x is None:
            return None
        out = torch.zeros(n, T)
        for i, row in enumerate(x):
            out[i, : len(row)] = torch.tensor(row)
        return out

    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt, comp], 1), torch.cat([torch.ones_like(prompt), mask], 1), T
        )
    shift = 0.0 if case.get("ours") is None else (logps - per_token(case["ours"])) * mask
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": comp,
              "completion_mask": mask, "advantages": torch.tensor(case["advantages"], dtype=torch.float32),
              "num_items_in_batch": mask.sum()}  # fmt: skip
    if case["old"] is not None:
        inputs["old_per_token_logps"] = per_token(case["old"]) + shift
    if case["ref"] is not None:
        inputs["ref_per_token_logps"] = per_token(case["ref"]) + shift
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    params = dict(model.named_parameters())
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values() if p.grad is not None)).item()
    return {"loss": loss.item(), "logps": [logps[i, : len(c)].tolist() for i, c in enumerate(case["completions"])],
            "grads": {k: params[k].grad.flatten().tolist() for k in GRADS}, "grad_norm": norm}  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), run, "cases")
