"""Bad input gives a Python exception and the interpreter survives."""

from __future__ import annotations

import math

import pytest
from conftest import run_python

import llamabind


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        llamabind.Model("/nonexistent/model.gguf")


def test_directory_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        llamabind.Model(tmp_path)  # exists, but a directory
    f = tmp_path / "notes.gguf"
    f.write_text("this is not a model\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llamabind.Model(f)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llamabind.Model(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [4, 24, 4096, 1 << 20, 90_000_000])
def test_truncated_gguf(model_path, tmp_path, keep):
    """Cut inside the header, the KV section, the tensor infos, and the tensor data."""
    with open(model_path, "rb") as f:
        data = f.read(keep)
    p = tmp_path / "truncated.gguf"
    p.write_bytes(data)
    with pytest.raises(ValueError, match="GGUF"):
        llamabind.Model(p)
    with pytest.raises(ValueError):
        llamabind.Model(p, vocab_only=True) if keep < 4096 else _raise(ValueError)


def _raise(e):
    raise e("")


def test_truncated_gguf_does_not_kill_the_interpreter(model_path, tmp_path):
    p = tmp_path / "t.gguf"
    with open(model_path, "rb") as f:
        p.write_bytes(f.read(50_000_000))
    r = run_python(f"""
import llamabind
try:
    llamabind.Model({str(p)!r})
except ValueError as e:
    print("ValueError:", str(e).splitlines()[0])
print("alive")
""")
    assert r.returncode == 0, r.stderr
    assert "ValueError" in r.stdout and "alive" in r.stdout


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(temperature=math.nan), ValueError),
        (dict(top_p=0.0), ValueError),
        (dict(top_p=1.5), ValueError),
        (dict(min_p=-0.1), ValueError),
        (dict(top_k=-1), ValueError),
        (dict(repeat_penalty=0.0), ValueError),
        (dict(max_tokens=-1), ValueError),
        (dict(seed=-1), ValueError),
        (dict(seed=2**32), ValueError),
        (dict(stop=[""]), ValueError),
        (dict(stop=[1]), TypeError),
    ],
)
def test_bad_generation_parameters(model, kw, exc):
    with pytest.raises(exc):
        model.generate("Hi", **kw)
    with pytest.raises(exc):
        model.generate("Hi", stream=True, **kw)  # raised at the call, not at the first piece


def test_bad_prompts_and_tokens(model):
    with pytest.raises(TypeError):
        model.generate(b"bytes")
    with pytest.raises(ValueError, match="n_vocab"):
        model.generate([1, model.n_vocab + 5])
    with model.context(n_ctx=16) as ctx:  # llama.cpp pads n_ctx up to a multiple of 256
        with pytest.raises(ValueError, match="n_ctx"):
            ctx.generate("word " * (ctx.n_ctx + 10))
        with pytest.raises(ValueError, match="empty"):
            ctx.decode([])
        with pytest.raises(ValueError, match="no logits"):
            ctx.logits()
        with pytest.raises(ValueError, match="full"):
            ctx.decode([1] * (ctx.n_ctx + 1))
        assert ctx.n_past == 0


@pytest.mark.parametrize(
    "kw", [dict(n_ctx=-1), dict(n_ctx=4), dict(n_batch=0), dict(n_ubatch=0), dict(n_threads=0), dict(n_threads=10**6)]
)
def test_bad_context_parameters(model, kw):
    with pytest.raises(ValueError):
        model.context(**kw)


def test_bad_model_parameters(model_path):
    with pytest.raises(ValueError):
        llamabind.Model(model_path, n_gpu_layers=-2)
    with pytest.raises(TypeError):
        llamabind.Model(model_path, n_gpu_layers="all")


def test_closed_model_and_context(model_path):
    m = llamabind.Model(model_path, n_ctx=64)
    ctx = m.context()
    m.close()
    assert m.closed and ctx.closed
    with pytest.raises(ValueError, match="closed"):
        m.tokenize("x")
    with pytest.raises(ValueError, match="closed"):
        ctx.decode([1])
    with pytest.raises(ValueError, match="closed"):
        m.generate("x")
    m.close()  # idempotent


def test_vocab_only_model_cannot_generate(model_path):
    with llamabind.Model(model_path, vocab_only=True) as v:
        assert v.tokenize("Hello")
        with pytest.raises(ValueError, match="vocab_only"):
            v.generate("Hello")


def test_a_context_in_use_by_another_thread_gives_an_exception(model_path):
    """Two threads on one context: a clear LlamaError, never a crash, and nothing freed under it."""
    import threading

    m = llamabind.Model(model_path, n_threads=2)
    ids = (m.tokenize("Threads share the model but not the context. ") * 300)[:2000]
    ctx = m.context(n_ctx=2048, n_batch=2048)
    in_decode, errors, worker_error = threading.Event(), [], []

    def work():
        try:
            in_decode.set()
            ctx.decode(ids)
        except Exception as e:  # noqa: BLE001 - reported below
            worker_error.append(e)

    t = threading.Thread(target=work)
    t.start()
    in_decode.wait()
    # While the worker is (very likely) inside llama_decode, try everything that would race with it.
    for call in (lambda: ctx.decode([1]), ctx.clear, ctx.close, m.close):
        try:
            call()
        except llamabind.LlamaError as e:
            errors.append(str(e))
    t.join()
    if not errors:
        m.close()
        pytest.skip("the decode was not running when the other thread got in (fast machine)")
    assert len(errors) == 4, errors  # once one call saw it busy, the decode was still running
    assert all("in use" in e for e in errors), errors
    assert not worker_error and ctx.n_past == len(ids) and not m.closed
    m.close()
