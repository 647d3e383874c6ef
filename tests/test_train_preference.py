"""Issue 58, the part that is there: preference pairs read from TRL's formats (llamabind.train.read_pairs), the
log-probabilities of their answers (pair_logps) and DPO's / ORPO's losses and reward metrics
(preference_metrics), against PyTorch (transformers on the same F32 GGUF; the losses as TRL states them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import llamabind
from llamabind import train

ROWS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a large banana."},
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "It is 5, I think."}]},
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "No."}]},
]  # fmt: skip


def test_read_pairs_in_trls_formats(model_path, tmp_path):
    """A JSONL file of the three formats: text (the prompt with the vocabulary's BOS where it adds one, each
    answer tokenized on its own then EOS), conversational with an explicit prompt, and with the prompt implicit
    (the messages both conversations share): the prompt and an answer together are the chat template's
    rendering of the conversation with that answer, the prompt its rendering through the generation prompt."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    with llamabind.Model(model_path, vocab_only=True) as m:
        pairs = train.read_pairs(path, m)
        assert len(pairs) == 3
        text = pairs[0]
        assert text.prompt.tolist() == m.tokenize(ROWS[0]["prompt"], add_special=True)
        assert text.chosen.tolist() == m.tokenize(" Paris.", add_special=False) + [m.token_eos]
        tpl = m.chat_templates()
        for p, (prompt, chosen, rejected) in zip(pairs[1:], [
            (ROWS[1]["prompt"], ROWS[1]["chosen"], ROWS[1]["rejected"]),
            (ROWS[2]["chosen"][:1], ROWS[2]["chosen"][1:], ROWS[2]["rejected"][1:]),
        ]):  # fmt: skip
            assert m.detokenize(p.prompt.tolist(), unparse_special=True) == tpl.render(
                prompt, add_generation_prompt=True
            )
            for answer, toks in ((chosen, p.chosen), (rejected, p.rejected)):
                whole = m.detokenize(np.concatenate([p.prompt, toks]).tolist(), unparse_special=True)
                assert whole == tpl.render(prompt + answer, add_generation_prompt=False)
        assert [len(p.chosen) for p in train.read_pairs(ROWS, m)] == [len(p.chosen) for p in pairs]  # a list of dicts
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_list([ROWS[1], ROWS[1]])  # one format per dataset (Arrow's columns)
        assert [p.chosen.tolist() for p in train.read_pairs(ds, m)] == [pairs[1].chosen.tolist()] * 2


@pytest.mark.parametrize(
    "row,match",
    [
        ({"prompt": "a", "chosen": "x", "rejected": "x"}, "'chosen' and 'rejected' are the same answer"),
        ({"prompt": "a", "chosen": "x"}, "missing field 'rejected'"),
        ({"prompt": "a", "chosen": "  ", "rejected": "y"}, "field 'chosen' is empty"),
        ({"prompt": 1, "chosen": "x", "rejected": "y"}, "field 'prompt' must be a string; got int"),
        ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
         "must begin with the same messages"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "the chosen answer must begin with an assistant"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": "b"}, "field 'chosen' must be a"),
        ([1, 2], "a pair must be a JSON object; got list"),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_line_and_field(row, match, model_path, tmp_path):
    """Issue 58 item 7: a bad row is a ValueError naming the file, line and field; nothing is returned."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with llamabind.Model(model_path, vocab_only=True) as m:
        with pytest.raises(ValueError, match=f"pairs.jsonl:2: .*{match}"):
            train.read_pairs(path, m)
        path.write_text("\n\n")
        with pytest.raises(ValueError, match="pairs.jsonl: no preference pairs"):
            train.read_pairs(path, m)
        with pytest.raises(FileNotFoundError):
            train.read_pairs(tmp_path / "none.jsonl", m)


def test_pair_logps_and_losses_match_pytorch(smollm2_f32_cut, reference_python, tmp_path):
    """The answers' log-probabilities of SmolLM2's F32 copy cut to a few blocks equal transformers' on the
    same GGUF (F32 on both sides, sums of 1-12 tokens' log-softmax in float64: within 2e-3 nats, the
    order of the products' sums differing; offloaded to a GPU, cuBLAS's TF32 products: 2e-3 relative, 7e-4
    measured on an H100), and DPO's and ORPO's loss and reward metrics equal the reference's formulas on
    the same log-probs (float64 both: 1e-9)."""
    with llamabind.Model(smollm2_f32_cut, repack=False, n_threads=2) as m:
        pairs = train.read_pairs(ROWS, m)
        ours = train.pair_logps(m, pairs)
        m_on_gpu = any(d["type"] == "gpu" for d in llamabind.devices())
    rng = np.random.default_rng(0)
    reference = ours + rng.normal(0, 2, ours.shape)  # a reference model's log-probs: any other numbers
    lengths = np.array([[len(p.chosen), len(p.rejected)] for p in pairs])
    job = {
        "gguf": str(smollm2_f32_cut),
        "pairs": [[p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()] for p in pairs],
        "policy": ours.tolist(), "reference": reference.tolist(), "lengths": lengths.tolist(), "beta": 0.3,
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    script = Path(__file__).parent / "preference_reference.py"
    r = subprocess.run([str(reference_python), str(script), str(tmp_path)], capture_output=True, text=True, timeout=600,
                       cwd=script.parent)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "result.json").read_text())
    print("log-probs, llamabind / PyTorch:", ours.round(4).tolist(), np.round(ref["logps"], 4).tolist())
    if m_on_gpu:  # cuBLAS runs F32 products in TF32 (operands rounded to 10 mantissa bits, 4.9e-4 relative):
        np.testing.assert_allclose(ours, ref["logps"], rtol=2e-3)  # H100: 7e-4 relative on these sums
    else:
        np.testing.assert_allclose(ours, ref["logps"], atol=2e-3, rtol=0)
    got = {
        "dpo": train.preference_metrics(ours, reference, beta=0.3),
        "orpo": train.preference_metrics(ours, method="orpo", lengths=lengths, beta=0.3),
    }
    for method, mine in got.items():
        for field, want in ref[method].items():
            assert getattr(mine, field) == pytest.approx(want, rel=1e-9, abs=1e-12), (method, field)


def test_preference_metrics_refuse_what_they_cannot_compute():
    lp = np.array([[-1.0, -2.0]])
    for kw, match in [
        (dict(beta=0), "beta must be > 0"),
        (dict(beta=0.1), "DPO needs reference_logps"),
        (dict(reference_logps=np.zeros((2, 2))), r"reference_logps must be \(1, 2\)"),
        (dict(method="orpo"), "ORPO needs the answers' lengths"),
        (dict(method="kto", reference_logps=lp), "method must be 'dpo' or 'orpo'"),
    ]:
        with pytest.raises(ValueError, match=match):
            train.preference_metrics(lp, **kw)


def test_cli_eval_pairs_prints_trls_metrics(model_path, tmp_path, capsys):
    """``eval --pairs`` (issue 58 item 3, the metrics half): ORPO's numbers are preference_metrics' on
    pair_logps of the model; DPO of an adapter whose B is zero (lora_init: the policy is the base) has the
    rewards 0 and the loss log 2 exactly; without an adapter DPO is refused, as are --data and --pairs
    together, each with one error line."""
    from llamabind import cli

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        pairs = train.read_pairs(path, m)
        lengths = [[len(p.chosen), len(p.rejected)] for p in pairs]
        want = train.preference_metrics(train.pair_logps(m, pairs), method="orpo", lengths=lengths, beta=0.2)
        train.lora_init(m, tmp_path / "zero.gguf", 2, 4.0, ["attn_q"])
    base = ["eval", "-m", str(model_path), "--pairs", str(path), "-t", "2"]
    assert cli.main([*base, "--method", "orpo", "--beta", "0.2"]) == 0
    out = capsys.readouterr().out
    assert f"orpo over 3 pairs: loss {want.loss:.4f}" in out and f"rewards/margins {want.rewards_margins:.4f}" in out
    assert cli.main([*base, "--lora", str(tmp_path / "zero.gguf")]) == 0
    out = capsys.readouterr().out
    assert f"loss {np.log(2):.4f}, rewards/chosen 0.0000, rewards/rejected 0.0000" in out, out
    for extra, match in [([], "give --lora"), (["--data", str(path)], "one of them")]:
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err
