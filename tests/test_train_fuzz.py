"""Issue 60: no input reachable from the fine-tuning surface kills the process or trains on garbage.
Hypothesis draws settings of every field of :class:`llamabind.train.TrainingArgs` (values of each type
and of wrong types) and rows of training data (JSON objects of the formats' keys with values of any
type); each is either accepted or refused with a TypeError/ValueError naming what is wrong, and the
rows are read in a subprocess, which must exit normally (a native abort would end it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabind import train

FIELDS = [f.name for f in dataclasses.fields(train.TrainingArgs)]
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-3, 3), max_size=3), st.just(("attn_q", "attn_v")),
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_training_args_accept_or_name_the_field(settings_):
    """TrainingArgs.of either returns settings that pass their own check again or raises TypeError /
    ValueError whose message names one of the fields given (never another exception, never a value
    of the wrong type kept: booleans are bools, counts are ints)."""
    try:
        a = train.TrainingArgs.of(**settings_)
    except (TypeError, ValueError) as e:
        assert any(name in str(e) for name in settings_) or "batch_size" in str(e), (settings_, e)
        return
    assert a.checked() == a
    for name in ("shuffle", "train_embeddings", "progress", "gradient_checkpointing"):
        assert isinstance(getattr(a, name), bool)
    for name in ("ctx_size", "batch_size", "grad_accum", "epochs", "seed", "warmup"):
        assert isinstance(getattr(a, name), int) and not isinstance(getattr(a, name), bool)
    assert a.ctx_size % 256 == 0 and a.batch_size % a.grad_accum == 0 and a.lr > 0
    assert a.loss_chunk_tokens is None or (type(a.loss_chunk_tokens) is int and a.loss_chunk_tokens >= 0)


MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "banana", 3])},
    optional={"content": st.one_of(st.none(), st.text(max_size=20), st.integers(), st.lists(st.text(max_size=5)))},
)
ROW = st.one_of(
    st.fixed_dictionaries({"text": st.one_of(st.text(max_size=40), st.none(), st.integers())}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=20), st.none()), "completion": st.text(max_size=20)}),
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}),
    st.dictionaries(st.sampled_from(["text", "messages", "prompt", "completion", "tools", "x"]), ANY, max_size=3),
)

READER = r"""
import json, sys, llamabind
from llamabind import train
rows = json.loads(open(sys.argv[2]).read())
out = []
with llamabind.Model(sys.argv[1], vocab_only=True) as m:
    for i, row in enumerate(rows):
        path = sys.argv[3] + f"/row{i}.jsonl"
        open(path, "w").write(json.dumps(row) + "\n")
        try:
            exs = train.read_data(path, m)
            out.append(["ok", len(exs), int(sum(e.counted[1:].sum() for e in exs))])
        except (TypeError, ValueError) as e:
            out.append(["refused", type(e).__name__, str(e)])
print(json.dumps(out))
"""


def test_rows_of_any_shape_are_read_or_refused_naming_the_line(model_path, tmp_path):
    """300 rows drawn by hypothesis, read in one subprocess (it must exit normally): each is either
    examples with at least one counted token, or a ValueError/TypeError naming the file's line 1."""
    rows: list = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(ROW)
    def collect(row):
        rows.append(row)

    collect()
    (tmp_path / "rows.json").write_text(json.dumps(rows, default=str))
    p = subprocess.run(
        [sys.executable, "-c", READER, str(model_path), str(tmp_path / "rows.json"), str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    outcomes = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(outcomes) == len(rows)
    for row, (kind, *rest) in zip(rows, outcomes):
        if kind == "ok":
            assert rest[1] > 0 or "text" in row, (row, rest)  # a conversation trains on its answers
        else:
            assert ".jsonl:1:" in rest[1] or "empty" in rest[1], (row, rest)
    print(f"{sum(k == 'ok' for k, *_ in outcomes)} read, {sum(k == 'refused' for k, *_ in outcomes)} refused")


@pytest.mark.parametrize("bad", [dict(batch_size=4, grad_accum=3), dict(iters=0), dict(ctx_size=100)])
def test_impossible_runs_are_refused_before_any_model_work(bad):
    with pytest.raises((TypeError, ValueError)):
        train.TrainingArgs.of(**bad)


def test_finetune_and_trainer_end_to_end_never_abort(tiny_q8):
    """Issue 60 item 4: tests/fuzz/train_e2e.py draws finetune and Trainer calls on the tiny model (data,
    valid, settings, checkpoints; windows and labels of any shape, dtype and range) in a subprocess, where
    a native abort would end the process: it must exit 0 after every case either ran or raised
    TypeError/ValueError/LlamaError with a message, and the cases must include both (the draw reaches
    training, not only refusals). LLAMABIND_FUZZ_EXAMPLES sets the cases per function (CI: 40)."""
    import os
    from pathlib import Path

    n = os.environ.get("LLAMABIND_FUZZ_EXAMPLES", "40")
    script = Path(__file__).parent / "fuzz" / "train_e2e.py"
    r = subprocess.run([sys.executable, str(script), str(tiny_q8), n], capture_output=True, text=True, timeout=1500)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0 and "FUZZ DONE" in r.stdout, f"exit {r.returncode}; the last cases:\n{tail}"
    outcomes = [line.strip() for line in r.stdout.splitlines() if line.startswith("  -> ")]
    assert any(o == "-> ok" for o in outcomes), tail
    assert any(o.startswith("-> ValueError") for o in outcomes), tail
