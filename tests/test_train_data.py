"""Fine-tuning data (llamabind.train.data, issue 28): JSONL examples rendered with the chat template
as Model.chat renders them, the loss mask on the assistant / completion tokens, clear errors for
bad files, and a QLoRA run on chat JSONL made from Python's own documentation (pydoc_data) whose
held-out answer loss falls."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import llamabind
from llamabind import train

CONVERSATION = [
    {"role": "user", "content": "What does the `with` statement do in Python?"},
    {"role": "assistant", "content": "It wraps a block with the methods of a context manager."},
    {"role": "user", "content": "And `pass`?"},
    {"role": "assistant", "content": "Nothing: it is a null operation."},
]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


@pytest.mark.parametrize("template", ["gguf", "qwen2.5"])
def test_chat_example_is_the_chat_rendering_with_the_assistant_turns_counted(template, model_path, vendor_dir):
    """The tokens are the tokenization of ChatTemplates.render of the whole conversation (as
    Model.chat tokenizes a prompt: special tokens parsed), and the counted tokens are exactly two
    runs, each an assistant reply followed by the template's end-of-turn marker (SmolLM2's own
    template and Qwen2.5's, both ChatML)."""
    with llamabind.Model(model_path, vocab_only=True) as m:
        qwen = vendor_dir / "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
        src = None if template == "gguf" else qwen.read_text()
        tpl = m.chat_templates(src)
        ex = train.chat_example(m, CONVERSATION, templates=tpl)
        whole = tpl.render(CONVERSATION, add_generation_prompt=False)
        assert ex.tokens.tolist() == m.tokenize(whole, add_special=True, parse_special=True)
        runs = _runs(ex.counted)
        assert len(runs) == 2, runs
        for (a, b), reply in zip(runs, [CONVERSATION[1]["content"], CONVERSATION[3]["content"]]):
            text = m.detokenize(ex.tokens[a:b].tolist(), unparse_special=True)
            assert text.startswith(reply) and re.fullmatch(r"<\|im_end\|>\n?", text[len(reply) :]), text
        prompt_text = m.detokenize(ex.tokens[~ex.counted].tolist(), unparse_special=True)
        assert CONVERSATION[0]["content"] in prompt_text and "<|im_start|>assistant" in prompt_text
        everything = train.chat_example(m, CONVERSATION, templates=tpl, train_on_prompt=True)
        assert everything.counted.all() and everything.tokens.tolist() == ex.tokens.tolist()


def test_prompt_completion_and_text_lines(model_path, tmp_path):
    """{prompt, completion} becomes a user/assistant exchange with the completion counted;
    {text} counts every token; windows pad with EOS, not counted, and label the next token."""
    path = tmp_path / "d.jsonl"
    lines = [{"prompt": "2 + 2 =", "completion": "4"}, {"text": "plain words here"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    with llamabind.Model(model_path, vocab_only=True) as m:
        exs = train.load_jsonl(path, m)
        assert len(exs) == 2
        pc, tx = exs
        counted = m.detokenize(pc.tokens[pc.counted].tolist(), unparse_special=True)
        assert counted.startswith("4<|im_end|>"), counted
        assert tx.counted.all() and tx.tokens.tolist() == m.tokenize("plain words here", add_special=True)
        win, lab, cut = train.example_windows(exs, 256, m.token_eos)
        assert win.shape == (2, 257) and lab.shape == (2, 256) and cut == 0
        n = len(pc)
        assert (win[0, n:] == m.token_eos).all() and (lab[0, n - 1 :] == -1).all()
        want = np.where(pc.counted[1:], pc.tokens[1:], -1)
        assert lab[0, : n - 1].tolist() == want.tolist()
        assert train.read_data(path, m) is not None
        (tmp_path / "t.txt").write_text("just text\n")
        assert train.read_data(tmp_path / "t.txt", m) == "just text\n"


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"text": "a"}\n{"text": "b"\n', r"d\.jsonl:2: not valid JSON"),
        ('{"text": "a"}\n[1, 2]\n', r"d\.jsonl:2: a line must be a JSON object"),
        ('{"question": "a"}\n', r"d\.jsonl:1: a line needs 'text'"),
        ('{"prompt": "a"}\n', r"d\.jsonl:1: field 'completion' must be a str"),
        ('{"text": 3}\n', r"d\.jsonl:1: field 'text' must be a str"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"d\.jsonl:1: .*no assistant turn"),
        ('{"messages": [{"content": "hi"}]}\n', r"d\.jsonl:1: messages\[0\] must be an object with a 'role'"),
        ('{"messages": "hi"}\n', r"d\.jsonl:1: field 'messages' must be a list"),
        ("\n\n", r"empty"),
    ],
)
def test_bad_jsonl_is_a_clear_error(content, match, model_path, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with llamabind.Model(model_path, vocab_only=True) as m:
        with pytest.raises(ValueError, match=match):
            train.read_data(path, m)
        with pytest.raises(FileNotFoundError):
            train.load_jsonl(tmp_path / "missing.jsonl", m)


def _pydoc_chat(path, topics: list[str]) -> None:
    """Chat JSONL from Python's own documentation: "What does `X` do in Python?" -> the topic's
    first paragraph after its title."""
    import pydoc_data.topics

    with open(path, "w", encoding="utf-8") as f:
        for t in topics:
            body = pydoc_data.topics.topics[t].split("\n\n")
            paras = [p for p in body[1:] if len(p) > 80 and not p.startswith(" ")]
            if not paras:  # a topic of grammar rules and tables only
                continue
            para = paras[0].replace("\n", " ")
            msgs = [
                {"role": "user", "content": f"What does `{t}` do in Python?"},
                {"role": "assistant", "content": para[:400]},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def test_cli_qlora_on_chat_jsonl_lowers_the_held_out_answer_loss(model_path, tmp_path):
    """`python -m llamabind finetune --data train.jsonl --valid valid.jsonl --lora-rank 8` over the
    Q4_1 model as it is (QLoRA): the validation loss (answer tokens only) after training is below
    the one before, the adapter loads; a bad line fails before training, writing nothing.

    One question, one answer (issue 55): `finetune --test` and `eval --adapter` print the same loss.
    Both load the file alike (repack=False: on an AMX host a repacked Q4_1 takes AMX's kernels and
    gave 3.1389 against 3.1359), the adapter is written and read as F32, both run 2 threads, and
    ggml's CPU kernels compute each output element on one thread in a fixed order: the same logits,
    the same float64 sum, the same printed digits. The base's loss by `eval` (float64 from the logits)
    and finetune's "validation loss before" (ggml's F32 cross-entropy in the training graph) are two
    summations of one model function: within 1e-4 relative, as test_evaluate_agrees_with_the_training_
    paths_loss holds them on a window, plus 1e-4 for the two prints' rounding to 4 decimals."""
    import pydoc_data.topics

    topics = sorted(pydoc_data.topics.topics)
    _pydoc_chat(tmp_path / "train.jsonl", topics[:-8])
    _pydoc_chat(tmp_path / "valid.jsonl", topics[-8:])
    out = tmp_path / "adapter.gguf"
    cmd = [sys.executable, "-m", "llamabind", "finetune", "-m", str(model_path)]
    cmd += ["--data", str(tmp_path / "train.jsonl")]
    cmd += ["--valid", str(tmp_path / "valid.jsonl"), "--lora-rank", "8", "--lr", "1e-3", "--iters", "12"]
    cmd += ["--threads", "2", "--no-progress", "-o", str(out)]
    p = subprocess.run([*cmd, "--test", str(tmp_path / "valid.jsonl")], capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    before = float(re.search(r"validation loss before: ([\d.]+)", p.stdout).group(1))
    after = float(re.search(r"validation loss ([\d.]+), ", p.stdout).group(1))
    print(p.stdout[-600:])
    assert after < before - 0.05, (before, after)
    ev = [sys.executable, "-m", "llamabind", "eval", "-m", str(model_path), "--data", str(tmp_path / "valid.jsonl")]
    ev += ["--threads", "2"]
    losses = []
    for extra in ([], ["--adapter", str(out)]):
        e = subprocess.run([*ev, *extra], capture_output=True, text=True, timeout=600)
        assert e.returncode == 0, e.stderr[-2000:]
        losses.append(float(re.search(r"loss ([\d.]+), perplexity", e.stdout).group(1)))
    print("eval: base", losses[0], "tuned", losses[1])
    assert losses[1] < losses[0] - 0.05, losses  # the tuned model beats the base on held-out answers
    test_loss = float(re.search(r"test loss ([\d.]+), perplexity", p.stdout).group(1))
    assert test_loss == losses[1], (test_loss, losses)  # --test: eval of the tuned adapter, the same digits
    assert abs(before - losses[0]) <= 1e-4 * before + 1e-4, (before, losses)  # the base, two summations
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    bad = subprocess.run([*cmd[:6], "--data", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "bad.jsonl:1" in bad.stderr and not (tmp_path / "x.gguf").exists(), bad.stderr


def test_schedules_against_their_closed_forms():
    """lr 1, min_lr 0.1, 2 warmup steps, 12 steps: warmup 0.5, 1.0; then cosine / linear from 1.0 at
    step 2 towards 0.1 at step 12 (the half-way step 7: 0.55 for both), constant stays 1."""
    import math

    lr = lambda s, kind: train.lr_at(s, 12, 1.0, kind, warmup=2, min_lr=0.1)  # noqa: E731
    for kind in train.SCHEDULES:
        assert (lr(0, kind), lr(1, kind)) == (0.5, 1.0)
        assert lr(2, kind) == 1.0
    assert all(lr(s, "constant") == 1.0 for s in range(2, 12))
    assert lr(7, "cosine") == pytest.approx(0.55) and lr(7, "linear") == pytest.approx(0.55)
    assert lr(11, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    assert lr(11, "linear") == pytest.approx(1.0 - 0.9 * 0.9)
    assert lr(5, "cosine") > lr(5, "linear")  # cosine decays slower at first
    assert train.lr_at(9, 10, 1e-3, "cosine") > 0  # min_lr 0 is never reached within the run


def test_finetune_logs_steps_lr_and_validation(model_path, tmp_path, capsys):
    """finetune(log=, steps_per_eval=, steps_per_report=, lr_schedule=): one JSONL row per step with
    the scheduled lr, validation rows every 2 steps and at the end, report lines on stderr; bad
    schedule arguments are errors before any training."""
    exs = [train.Example(np.arange(1, 200, dtype=np.int32) + k, np.ones(199, bool)) for k in range(6)]
    log = tmp_path / "log.jsonl"
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        r = train.finetune(m, exs[:4], valid=exs[4:], lora_rank=2, iters=4, lr=1e-3, lr_schedule="cosine",
                           warmup=1, steps_per_eval=2, steps_per_report=2, log=log, progress=False)  # fmt: skip
        rows = [json.loads(x) for x in log.read_text().splitlines()]
        steps = [x for x in rows if "loss" in x]
        assert [x["step"] for x in steps] == [1, 2, 3, 4]
        assert [x["lr"] for x in steps] == pytest.approx([train.lr_at(s, 4, 1e-3, "cosine", 1) for s in range(4)])
        assert [x["step"] for x in rows if "val_loss" in x] == [2, 4, 4]
        assert [s for s, _ in r.evals] == [2, 4] and r.steps == 4
        err = capsys.readouterr().err
        assert "step 2/4: loss" in err and "step 4: validation loss" in err
        for kw, match in [
            (dict(lr_schedule="exp"), "lr_schedule"),
            (dict(min_lr=1.0), "min_lr"),
            (dict(warmup=-1), "warmup"),
            (dict(steps_per_eval=0), "steps_per_eval"),
        ]:
            with pytest.raises(ValueError, match=match):
                train.finetune(m, exs, lora_rank=2, iters=1, lr=1e-3, progress=False, log=tmp_path / "no.jsonl", **kw)
        assert not (tmp_path / "no.jsonl").exists()


def _random_adapter(m, path, rank=4):
    """A LoRA adapter on attn_q/attn_v/ffn_down with a nonzero B (lora_init starts B at zero), so
    it changes the model."""
    from llamabind.model import write_lora_gguf

    train.lora_init(m, path, rank, 2.0 * rank, ["attn_q", "attn_v", "ffn_down"], seed=3)
    import gguf

    rng = np.random.default_rng(4)
    r = gguf.GGUFReader(path)
    tensors = []
    for t in r.tensors:
        a = np.array(t.data).reshape([int(n) for n in reversed(t.shape)]).astype(np.float32)
        tensors.append((t.name, rng.normal(0, 0.05, a.shape).astype(np.float32) if t.name.endswith("lora_b") else a))
    write_lora_gguf(path, "llama", 2.0 * rank, sorted(tensors))


def test_fuse_equals_the_base_with_the_adapter(model_path, tmp_path):
    """train.fuse / `python -m llamabind fuse`: the fused GGUF's logits equal the base's with the
    adapter applied at scale 1 (NMSE against the change the adapter makes), its greedy tokens too;
    --quantize Q8_0 gives a model that loads in upstream's llama-simple; bad adapters are errors."""
    from conftest import require_tool

    prompt = "The `with` statement in Python"
    adapter = tmp_path / "a.gguf"
    # an F32 base for the exact comparison (a Q4_1 base's unmerged products quantize x to Q8_1)
    base = tmp_path / "f32.gguf"
    train.to_f32(model_path, base)
    with llamabind.Model(base, n_threads=2) as m:
        _random_adapter(m, adapter)
        ids = m.tokenize(prompt)
        with m.context(n_ctx=256) as c:
            plain = c.eval(ids)
        lora = m.load_lora(adapter)
        with m.context(n_ctx=256) as c:
            c.set_lora(lora, 1.0)
            want = c.eval(ids)
            want_text = c.generate(prompt, max_tokens=12, temperature=0).tokens
    fused = train.fuse(base, adapter, tmp_path / "fused.gguf")
    with llamabind.Model(fused, n_threads=2) as f, f.context(n_ctx=256) as c:
        got = c.eval(ids)
        got_text = c.generate(prompt, max_tokens=12, temperature=0).tokens
    change = float(np.mean((want - plain) ** 2))
    err = float(np.mean((got - want) ** 2))
    print(f"adapter's change {change:.3e}, fused vs base+adapter {err:.3e}")
    assert change > 1e-2 and err < 1e-3 * change, (change, err)
    assert got_text == want_text
    out = tmp_path / "fused-q8.gguf"
    cmd = [sys.executable, "-m", "llamabind", "fuse", "-m", str(model_path), "--adapter", str(adapter)]
    p = subprocess.run([*cmd, "-o", str(out), "--quantize", "Q8_0"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    exe = require_tool("llama-simple")
    s = subprocess.run([str(exe), "-m", str(out), "-n", "4", prompt], capture_output=True, timeout=300)
    assert s.returncode == 0, s.stderr.decode(errors="replace")[-2000:]
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        train.fuse(model_path, model_path, tmp_path / "x.gguf")
    from llamabind.model import write_lora_gguf

    zeros = [("blk.99.attn_q.weight.lora_a", (4, 576)), ("blk.99.attn_q.weight.lora_b", (576, 4))]
    write_lora_gguf(tmp_path / "other.gguf", "llama", 8.0, [(n, np.zeros(s, np.float32)) for n, s in zeros])
    with pytest.raises(ValueError, match="blk.99"):
        train.fuse(model_path, tmp_path / "other.gguf", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_evaluate_agrees_with_the_training_paths_loss(model_path):
    """train.evaluate (numpy log-softmax over llama_decode's logits) and llama.cpp's training-path
    cross-entropy (ggml, forward only, patch 0027's masked labels) give the same loss on one
    example window; perplexity is exp(loss)."""
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        ex = train.chat_example(m, CONVERSATION)
        r = train.evaluate(m, [ex], ctx_size=256)
        win, lab, _ = train.example_windows([ex], 256, m.token_eos)
        kw = dict(optimizer="sgd", lr=0.1, params="lora", adapter=train_adapter(m), n_threads=2)
        with train.Trainer(m, **kw) as t:
            loss = t.evaluate(win[:1], lab[:1])[0]
    assert r.tokens == int(ex.counted[1:].sum()) and r.windows == 1
    assert abs(r.loss - loss) <= 1e-4 * loss, (r.loss, loss)
    assert r.perplexity == pytest.approx(np.exp(r.loss))
    with pytest.raises(TypeError):
        train.evaluate(m, 42)


def train_adapter(m):
    """A zero-effect adapter (lora_init's B = 0), so a training context can be set up on a
    quantized model (params='lora') without changing its outputs."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    train.lora_init(m, d / "z.gguf", 2, 4.0, ["attn_q"])
    return m.load_lora(d / "z.gguf")


def test_bad_settings_and_rows_are_refused_before_training(model_path, tmp_path):
    """Issue 60: settings of the wrong type or meaning, and rows that would train on garbage, are
    errors naming the setting, the row or the field, raised before the first step (nothing trains):
    TrainingArgs's checks (a truthy string for a bool, a float seed, a str of targets, alpha 0, an empty
    or file checkpoint_dir), a batch larger than the data, steps_per_eval without validation data, and
    conversations with an empty answer, an unknown role, or two formats in one row."""
    text = "The quick brown fox jumps over the lazy dog. " * 300
    (tmp_path / "a-file").write_text("x")
    bad_settings = [
        (TypeError, "train_embeddings must be True or False", dict(train_embeddings="false")),
        (TypeError, "seed must be an int", dict(seed=1.5)),
        (TypeError, "lora_targets must be a sequence", dict(lora_rank=4, lora_targets="attn_q")),
        (ValueError, "lora_alpha must be > 0", dict(lora_rank=4, lora_alpha=0)),
        (ValueError, "checkpoint_dir must name a directory", dict(checkpoint_dir="")),
        (ValueError, "is a file, not a directory", dict(checkpoint_dir=tmp_path / "a-file")),
        (ValueError, "batch_size 64 is larger than the", dict(batch_size=64)),
        (ValueError, "steps_per_eval needs validation windows", dict(val_split=0.0, steps_per_eval=1)),
        (TypeError, "unknown training setting", dict(learning_rate=1e-3)),
    ]
    rows = [
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}, "has no content"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, "has no content"),
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]}, "has no content"),
        ({"messages": [{"role": "banana", "content": "x"}, {"role": "assistant", "content": "a"}]}, "role must be"),
        ({"text": "t", "messages": [{"role": "assistant", "content": "a"}]}, "'text' and 'messages'"),
    ]
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        for err, match, kw in bad_settings:
            with pytest.raises(err, match=match):
                train.finetune(m, text, lora_rank=kw.pop("lora_rank", 8), iters=1, progress=False, **kw)
        for k, (row, match) in enumerate(rows):
            path = tmp_path / f"bad{k}.jsonl"
            path.write_text(
                json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                + "\n"
                + json.dumps(row)
            )
            with pytest.raises(ValueError, match=f"bad{k}.jsonl:2: .*{match}"):
                train.read_data(path, m)


def test_what_is_not_training_data_says_so(model_path, tmp_path):
    """Issue 60: messages that name the argument and what was expected: a .jsonl path or a Hub id given to
    finetune as a str (it trained on the name's few tokens), an empty or too short valid (named as such), a
    DatasetDict, Example tokens and mask of different lengths, a file that is not UTF-8, a Trainer used after
    close()."""
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "x.bin").write_bytes(b"\x00\xff\xfe" * 100)
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        for name, kind in ((str(tmp_path / "d.jsonl"), "a file"), ("HuggingFaceH4/no_robots", "a Hub dataset"),
                           (str(tmp_path), "a directory")):  # fmt: skip
            with pytest.raises(ValueError, match=f"names {kind}: .*train.read_data"):
                train.finetune(m, name, lora_rank=4, progress=False)
        with llamabind.Model(model_path, vocab_only=True) as v, pytest.raises(ValueError, match="vocab_only=True"):
            train.finetune(v, "word " * 2000, lora_rank=4, progress=False)  # issue 86: it said "load with repack=False"
        for empty in ("", "  \n "):  # issue 86 item 5: "" was taken for a file's name
            with pytest.raises(ValueError, match="data is an empty string"):
                train.finetune(m, empty, lora_rank=4, progress=False)
        with pytest.raises(ValueError, match="valid is empty"):
            train.finetune(m, "word " * 2000, valid=[], lora_rank=4, progress=False)
        with pytest.raises(ValueError, match=r"^valid: the data has \d+ tokens"):  # found by tests/fuzz/train_e2e.py
            train.finetune(m, "word " * 2000, valid="hi", lora_rank=4, progress=False)
        with pytest.raises(ValueError, match="shape of tokens"):
            train.Example(np.arange(5), np.ones(4, bool))
        with pytest.raises(ValueError, match="x.bin: not UTF-8 text"):
            train.read_data(tmp_path / "x.bin", m)
        datasets = pytest.importorskip("datasets")
        dd = datasets.DatasetDict(train=datasets.Dataset.from_list([{"text": "x"}]))
        with pytest.raises(ValueError, match=r"DatasetDict of splits \['train'\]: give one split"):
            train.finetune(m, dd, lora_rank=4, progress=False)
        t = train.Trainer(m, params="lora", adapter=train_adapter(m), n_threads=2)
        t.close()
        for call in (
            lambda: t.step(np.zeros((1, 257), np.int32)),
            lambda: t.set_lr(1e-4),
            t.state,
            t.stats,
            lambda: t.set_state(1, []),
        ):  # issue 86: state/set_lr said "call opt_init first"
            with pytest.raises(ValueError, match="Trainer is closed"):
                call()


def test_cli_finetune_says_what_it_does_and_prints_no_nan(model_path, tmp_path):
    """Issue 86 item 4: finetune (and eval) on the command line say that they read and check the data and what the
    validation pass before the first step is (its loss on stderr before the epoch's bar), and with --val-split 0
    (no validation windows) prints no validation loss at all (it printed "nan" twice)."""
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i}+{i}?", "completion": f" {2 * i}."}) + "\n" for i in range(30))
    )
    base = [sys.executable, "-m", "llamabind", "finetune", "-m", str(model_path), "--data", str(data), "-o",
            str(tmp_path / "a.gguf"), "--lora-rank", "2", "--iters", "1", "-c", "256", "-t", "2"]  # fmt: skip
    for split in ("0.2", "0"):
        p = subprocess.run([*base, "--val-split", split], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert f"reading and checking {data}" in p.stderr, p.stderr[-2000:]
        if split == "0":
            assert "nan" not in p.stdout + p.stderr and "validation" not in p.stdout + p.stderr, p.stdout
        else:
            line = re.search(r"validation before training: (\d+) window\(s\) \.\.\. loss ([\d.]+)", p.stderr)
            assert line and int(line.group(1)) >= 1, p.stderr[-2000:]
            assert p.stderr.index("validation before training") < p.stderr.index("epoch 1/1"), p.stderr[-2000:]
            assert f"validation loss before: {line.group(2)}" in p.stdout, p.stdout
    # eval says what it reads and evaluates before its result line (it was silent until the end), and with
    # --progress (default where stderr is a terminal) a bar over the windows with the running loss, the same result
    ev = [sys.executable, "-m", "llamabind", "eval", "-m", str(model_path), "--data", str(data), "-c", "256", "-t", "2"]
    p = subprocess.run(ev, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"reading and checking {data}" in p.stderr and "evaluating 30 examples in windows of 256" in p.stderr
    assert re.search(r"^loss [\d.]+, perplexity", p.stdout, re.M), p.stdout
    assert "window/s" not in p.stderr and "windows/s" not in p.stderr  # no bar: stderr is no terminal here
    bar = subprocess.run([*ev, "--progress"], capture_output=True, text=True, timeout=300)
    # the result line alike (a line after it reports the cores kept busy, a measurement that varies run to run)
    assert bar.returncode == 0 and bar.stdout.splitlines()[0] == p.stdout.splitlines()[0], bar.stderr[-2000:]
    assert re.search(r"evaluating:\s+\d+%.*\d+/30 ", bar.stderr), bar.stderr[-2000:]  # tqdm's state, as it last drew


def test_all_linear_targets_every_matrix_of_a_block():
    """lora_targets="all-linear" (peft's name, and finetune --lora-targets all-linear) is the seven matrices of a
    block; another string is still refused (a str is a sequence of letters, not of names)."""
    from llamabind.cli.tune import _targets

    assert train.TrainingArgs(lora_rank=4, lora_targets="all-linear").checked().lora_targets == (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    )  # fmt: skip
    assert _targets("attn_q,ffn_down") == ("attn_q", "ffn_down")
    with pytest.raises(TypeError, match="lora_targets must be a sequence"):
        train.TrainingArgs(lora_rank=4, lora_targets="all").checked()
