"""Issue 83: preference tuning against TRL itself (tests/trl_reference.py in the side venv with trl 1.16), not a
hand-written copy of its formulas: the same rows in TRL's formats, tokenized by both, trained by both (every weight
of SmolLM2's F32 blocks, AdamW, TRL's linear decay, with and without TRL's global-norm clipping), on the CPU."""

from __future__ import annotations

import itertools
import json
import os
import subprocess

import numpy as np
import pytest
from conftest import reference_job

import llamabind
from llamabind import train

# the cases the issue names: a prompt ending in a space (TRL splits ' is'|' Paris'), an answer continuing the
# prompt's last word ('hel' + 'lo'), a special token's text inside an answer (TRL's tokenizer parses it)
TEXT = [
    {"prompt": "The capital of France is ", "chosen": "Paris.", "rejected": "a large banana."},
    {"prompt": "Say hel", "chosen": "lo to the world.", "rejected": "p me now.<|im_end|>"},
    {"prompt": "Water boils at", "chosen": " 100 degrees Celsius at sea level.", "rejected": " 12 degrees."},
]
CONVERSATIONS = [  # an explicit prompt
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "It is 5, I think."}]},
    {"prompt": [{"role": "user", "content": "Say hi"}], "chosen": [{"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]  # fmt: skip
IMPLICIT = [  # the prompt is what both conversations begin with
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "No."}]},
    {"chosen": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                  {"role": "assistant", "content": "I like trains."}]},
]  # fmt: skip
RUNS = [
    ("dpo", "text", TEXT),
    ("dpo", "implicit", IMPLICIT),
    ("orpo", "text", TEXT),
    ("orpo", "messages", CONVERSATIONS),
]
METRICS = {"loss": "loss", "rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
           "rewards/margins": "rewards_margins", "logps/chosen": "logps_chosen",
           "logps/rejected": "logps_rejected"}  # fmt: skip


def test_dpo_and_orpo_equal_trls_trainers(smollm2_f32_cut, reference_python, tmp_path):
    """TRL 1.16's DPOTrainer and ORPOTrainer (trl.experimental.orpo) against train.preference on the same rows: text
    (the three tokenization cases of issue 83), conversations with an explicit and with an implicit prompt. Each run
    trains every weight of SmolLM2's F32 blocks (CPU, F32 on both sides) on all its pairs as one batch for three
    AdamW steps, lr 1e-5 with TRL's linear decay, beta 0.1, without clipping, and (DPO text, ORPO conversations)
    with TRL's max_grad_norm 1.0 (patch 0094; these batches' norms are 7-50, so every step clips).

    - token ids: llamabind's pairs are TRL's processed rows, prompt and answers split where TRL splits them;
    - each step's loss and TRL's logged metrics (rewards/chosen, rejected, margins, logps/chosen, rejected) within
      2e-5 relative (+1e-5 absolute), and grad_norm where clipped: the same F32 sums in another order;
    - the weights after the three steps: each tensor's distance from TRL's at most 2e-2 of the distance TRL's
      moved, the median tensor 1e-3 (measured 1e-4 median, 1.2e-3 the largest on AVX-512: AdamW moves an element
      by about lr whatever its gradient's size, so an element whose gradient is at F32 rounding's level, an
      embedding row of a token the batch does not hold, moves by about lr either way in the two programs).

    The reference makes transformers' pad token row (SmolLM2's <|im_end|>) an ordinary embedding row: with its
    nn.Embedding padding_idx a conversation's end-of-turn tokens take no gradient from their lookups."""
    if os.environ.get("LLAMABIND_REFERENCE_PYTHON") and subprocess.run([str(reference_python), "-c", "import trl"],
                                                                      capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("the reference Python given by LLAMABIND_REFERENCE_PYTHON has no trl (carry its wheel)")
    job = {"gguf": str(smollm2_f32_cut), "runs": []}
    ours = {}
    # every run unclipped; clipped, one text and one conversational run (CI's time: each TRL run ~12 s on 2 cores)
    clipped = {("dpo", "text"), ("orpo", "messages")}
    for (method, fmt, rows), max_grad_norm in itertools.product(RUNS, (None, 1.0)):
        if max_grad_norm and (method, fmt) not in clipped:
            continue
        name = f"{method}-{fmt}-{'clipped' if max_grad_norm else 'unclipped'}"
        with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, use_mmap=False, n_gpu_layers=0) as m:
            pairs = train.read_pairs(rows, m, method=method)
            r = train.preference(
                m, pairs, method=method, beta=0.1, lr=1e-5, batch_size=len(rows), iters=3, val_split=0.0,
                shuffle=False, lr_schedule="linear", max_grad_norm=max_grad_norm, progress=False, n_threads=2,
                log=tmp_path / f"{name}.jsonl",
            )  # fmt: skip
            m.save(tmp_path / f"{name}.gguf")
        logged = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        ids = [
            {"prompt": p.prompt.tolist(), "chosen": p.chosen.tolist(), "rejected": p.rejected.tolist()} for p in pairs
        ]
        ours[name] = (ids, r.metrics, [row.get("grad_norm") for row in logged] if max_grad_norm else None)
        job["runs"].append(dict(name=name, method=method, rows=rows, beta=0.1, lr=1e-5, steps=3,
                                max_grad_norm=max_grad_norm or 0.0, lr_scheduler_type="linear",
                                ours=str(tmp_path / f"{name}.gguf")))  # fmt: skip
    theirs = reference_job(reference_python, "trl_reference.py", tmp_path, job)
    for name, (ids, metrics, norms) in ours.items():
        t = theirs[name]
        rel = np.array(list(t["update_rel"].values()))
        print(f"{name}: losses llamabind {[round(m.loss, 6) for m in metrics]}, TRL "
              f"{[round(s['loss'], 6) for s in t['steps']]}; grad_norm {norms} / "
              f"{[s.get('grad_norm') for s in t['steps']]}; "
              f"weights {np.median(rel):.1e} median, {rel.max():.1e} largest")  # fmt: skip
        assert ids == t["ids"], name
        assert len(t["steps"]) == len(metrics) == 3
        for mine, step in zip(metrics, t["steps"]):
            for trl_name, field in METRICS.items():
                assert getattr(mine, field) == pytest.approx(step[trl_name], rel=2e-5, abs=1e-5), (name, trl_name)
        if norms is not None:
            np.testing.assert_allclose(norms, [s["grad_norm"] for s in t["steps"]], rtol=2e-5, err_msg=name)
        assert np.median(rel) <= 1e-3 and rel.max() <= 2e-2, (
            name,
            sorted(t["update_rel"].items(), key=lambda kv: -kv[1])[:3],
        )


def test_pairs_are_tokenized_as_trl_splits_them(model_path):
    """The token ids themselves for the three cases of issue 83 (no side venv: TRL's rule applied by hand to
    llama_tokenize's ids, which the TRL test above checks against TRL's own): the prompt and answer tokenized as
    one text and split where they leave the prompt's tokens; a special token's text parsed to its id (DPO does not
    append another EOS after it); ORPO puts the vocabulary's BOS first and EOS after a conversation's end of turn."""
    with llamabind.Model(model_path, vocab_only=True) as m:
        tok = lambda s: m.tokenize(s, add_special=False, parse_special=True)  # noqa: E731
        dpo = train.read_pairs(TEXT, m, method="dpo")
        assert m.detokenize(dpo[0].prompt.tolist()) == "The capital of France is"
        assert dpo[0].chosen.tolist() == tok(" Paris.") + [m.token_eos]
        assert m.detokenize(dpo[1].prompt.tolist()) == "Say"
        assert dpo[1].chosen.tolist() == tok(" hello to the world.") + [m.token_eos]
        assert dpo[1].rejected.tolist() == tok(" help me now.") + [m.token_eos]  # parsed, not appended again
        orpo = train.read_pairs(TEXT, m, method="orpo")
        assert orpo[0].prompt.tolist() == [m.token_bos, *dpo[0].prompt.tolist()] and m.token_bos != m.token_eos
        conv = train.read_pairs(CONVERSATIONS, m, method="orpo")
        assert conv[0].chosen.tolist()[-3:] == [m.token_eos, *tok("\n"), m.token_eos]
        assert train.read_pairs(CONVERSATIONS, m, method="dpo")[0].chosen.tolist()[-2:] == [m.token_eos, *tok("\n")]
        with pytest.raises(ValueError, match="method must be 'dpo' or 'orpo'"):
            train.read_pairs(TEXT, m, method="kto")
