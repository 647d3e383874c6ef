"""TRL itself as the reference of llamabind's preference tuning (tests/test_train_trl.py; the side venv with trl).

    python trl_reference.py WORK

WORK/job.json: {"gguf": the base model (F32 GGUF), "runs": [{"name", "method": "dpo" | "orpo", "rows": TRL's
preference rows (text or conversational), "beta", "lr", "steps", "max_grad_norm", "lr_scheduler_type",
"ours": the GGUF llamabind wrote after its run of the same settings}]}. Each run trains a fresh copy of the base
(transformers' LlamaForCausalLM in float32 from the GGUF, every weight, AdamW) with TRL's own trainer, DPOTrainer
or ORPOTrainer (TRL 1.16: trl.experimental.orpo), on the rows as one batch for ``steps`` optimizer steps, its
tokenizer the GGUF's (transformers reads it from the file). Writes WORK/result.json, per run: the token ids TRL's
dataset processing made of each row (prompt / chosen / rejected as its trainer splits them), the logged
metrics of each step (loss, rewards/*, logps/*, grad_norm, nll_loss), and per tensor the distance between the
weights TRL trained and those of ``ours`` (loaded the same way) relative to the distance TRL's moved."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from gguf_once import load_model
from transformers import AutoTokenizer

logging.disable(logging.WARNING)
TRL_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected", "grad_norm", "nll_loss")  # fmt: skip


def token_ids(method: str, dataset) -> list[dict]:
    """[{prompt, chosen, rejected}] token ids of each processed row, split where TRL's trainer splits them."""
    out = []
    for r in dataset:
        if method == "dpo":
            out.append({"prompt": r["prompt_ids"], "chosen": r["chosen_ids"], "rejected": r["rejected_ids"]})
        else:  # ORPOTrainer: each sequence is prompt + answer, labels -100 over the prompt
            n = len(r["prompt_input_ids"])
            out.append({"prompt": r["prompt_input_ids"], "chosen": r["chosen_input_ids"][n:],
                        "rejected": r["rejected_input_ids"][n:]})  # fmt: skip
    return out


def plain(model):
    """The model transformers loaded from a GGUF as a plain float32 one: its weights are dequantized at load, but it
    keeps the GGUF "quantizer" as a mark, and transformers' Trainer refuses to train a quantized model in full."""
    model.hf_quantizer, model.is_quantized = None, False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # transformers makes the pad token's row (SmolLM2: <|im_end|>, also its EOS) nn.Embedding's padding_idx, which
    # takes no gradient from its lookups: a conversation's end-of-turn tokens would train only through the tied
    # output matrix. A GGUF has no such row; the reference computes the whole gradient.
    model.get_input_embeddings().padding_idx = None
    return model


def run(base: Path, tokenizer, spec: dict, tmp: Path) -> dict:
    torch.manual_seed(0)
    common = dict(
        output_dir=str(tmp / spec["name"]), per_device_train_batch_size=len(spec["rows"]), max_steps=spec["steps"],
        learning_rate=spec["lr"], lr_scheduler_type=spec["lr_scheduler_type"], max_grad_norm=spec["max_grad_norm"],
        beta=spec["beta"], logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=True, bf16=False,
        weight_decay=0.0, warmup_steps=0, dataloader_drop_last=False,
    )  # fmt: skip
    data = Dataset.from_list(spec["rows"])
    model = plain(load_model(base, keep=True))
    if spec["method"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        ref = plain(load_model(base, keep=True)).eval()  # the policy as it starts (TRL would load it from a path)
        trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(**common), train_dataset=data,
                             processing_class=tokenizer)  # fmt: skip
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=data, processing_class=tokenizer)
    ids = token_ids(spec["method"], trainer.train_dataset)
    trainer.train()
    steps = [{k: float(e[k]) for k in TRL_METRICS if k in e} for e in trainer.state.log_history if "loss" in e]
    theirs = {k: v.detach() for k, v in model.state_dict().items()}
    ours, start = load_model(spec["ours"]).state_dict(), load_model(base, keep=True).state_dict()
    rel = {}  # per tensor: how far llamabind's weights are from TRL's, relative to how far TRL's moved
    for k, v in theirs.items():
        rel[k] = (v - ours[k]).norm().item() / max((v - start[k]).norm().item(), 1e-30)
    return {"ids": ids, "steps": steps, "update_rel": rel}


def main(work: Path, run_one=run, key: str = "runs") -> None:
    """WORK/job.json's ``key`` entries, each run by ``run_one(base, tokenizer, spec, tmp)``, into WORK/result.json by
    name (tests/grpo_reference.py runs its cases through it too)."""
    job = json.loads((work / "job.json").read_text())
    base = Path(job["gguf"])
    tokenizer = AutoTokenizer.from_pretrained(base.parent, gguf_file=base.name)
    with tempfile.TemporaryDirectory() as tmp:
        result = {spec["name"]: run_one(base, tokenizer, spec, Path(tmp)) for spec in job[key]}
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
