"""PyTorch reference for tests/test_train_preference.py (runs in the side venv).

    python preference_reference.py WORK

WORK/job.json: {"gguf": F32 GGUF, "pairs": [[prompt ids, chosen ids, rejected ids], ...], "policy": (n, 2)
log-probs, "reference": (n, 2), "lengths": (n, 2), "beta": b}. transformers loads the GGUF as
LlamaForCausalLM in float32; each answer's log-probability is the sum of log_softmax(logits) at its tokens
given the prompt and the answer's earlier tokens. DPO's sigmoid loss and ORPO's loss with TRL's reward
metrics are computed in torch from the given log-probs, written from the papers' formulas as TRL's
DPOTrainer.dpo_loss and ORPOTrainer.odds_ratio_loss state them. Writes WORK/result.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf_once import load_model


def answer_logp(model, prompt: list[int], answer: list[int]) -> float:
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[0].double(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
    return float(logp[pos, torch.tensor(answer)].sum())


def metrics(chosen_rewards, rejected_rewards, losses, pc, pr) -> dict:
    return {
        "loss": float(losses.mean()), "rewards_chosen": float(chosen_rewards.mean()),
        "rewards_rejected": float(rejected_rewards.mean()),
        "rewards_accuracies": float((chosen_rewards > rejected_rewards).double().mean()),
        "rewards_margins": float((chosen_rewards - rejected_rewards).mean()),
        "logps_chosen": float(pc.mean()), "logps_rejected": float(pr.mean()),
    }  # fmt: skip


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    model = load_model(job["gguf"])
    model.eval()
    logps = [[answer_logp(model, p, c), answer_logp(model, p, r)] for p, c, r in job["pairs"]]
    beta = job["beta"]
    pol, ref = torch.tensor(job["policy"], dtype=torch.float64), torch.tensor(job["reference"], dtype=torch.float64)
    # DPO (Rafailov et al. 2023, eq. 7), the sigmoid loss: pi_logratios - ref_logratios
    logits = (pol[:, 0] - pol[:, 1]) - (ref[:, 0] - ref[:, 1])
    dpo = metrics(beta * (pol[:, 0] - ref[:, 0]), beta * (pol[:, 1] - ref[:, 1]), -F.logsigmoid(beta * logits),
                  pol[:, 0], pol[:, 1])  # fmt: skip
    # ORPO (Hong et al. 2024, eq. 6-7): mean token log-probs, the log odds ratio, the chosen answers' nll
    n = torch.tensor(job["lengths"], dtype=torch.float64)
    mc, mr = pol[:, 0] / n[:, 0], pol[:, 1] / n[:, 1]
    log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
    nll = -pol[:, 0].sum() / n[:, 0].sum()
    orpo = metrics(beta * mc, beta * mr, nll - beta * F.logsigmoid(log_odds), mc, mr)
    (work / "result.json").write_text(json.dumps({"logps": logps, "dpo": dpo, "orpo": orpo}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
