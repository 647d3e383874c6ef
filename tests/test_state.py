"""Logits, logprobs, KV cache and state, prompt-prefix reuse, batched generation, LoRA,
speculative decoding, embeddings pooling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamabind
from llamabind import LlamaError

PROMPT = "The three primary colors are"


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture()
def ctx(model):
    with model.context(n_ctx=512, n_batch=64) as c:
        yield c


@pytest.mark.exact
def test_eval_rows_match_one_token_at_a_time(model, ctx):
    toks = model.tokenize(PROMPT)
    full = ctx.eval(toks)
    assert full.shape == (len(toks), model.n_vocab) and full.dtype == np.float32 and full.flags.writeable
    with model.context(n_ctx=512) as one:
        for i, t in enumerate(toks):
            one.decode([t])
            np.testing.assert_allclose(one.logits(), full[i], rtol=0, atol=2e-2 * np.abs(full[i]).max())
            assert one.logits().argmax() == full[i].argmax()


def test_eval_view_is_zero_copy_and_guarded(model, ctx):
    toks = model.tokenize(PROMPT)
    ref = ctx.eval(toks)
    ctx.clear()
    view = ctx.eval(toks, copy=False)
    assert not view.flags.writeable and not view.flags.owndata
    np.testing.assert_array_equal(view, ref)
    with pytest.raises(LlamaError, match="copy=False"):
        ctx.decode([1])
    with pytest.raises(LlamaError):
        ctx.close()
    del view
    ctx.decode([1])  # allowed again
    long = model.tokenize(PROMPT * 30)  # > n_batch (64): chunked, copied
    ctx.clear()
    big = ctx.eval(long, copy=False)
    assert big.flags.writeable and big.shape == (len(long), model.n_vocab)  # a copy
    ctx.clear()
    np.testing.assert_array_equal(ctx.eval(long), big)  # the same chunking: the same numbers


@pytest.mark.exact
def test_logprobs_are_log_softmax_of_the_logits(model, ctx):
    r = model.generate(PROMPT, max_tokens=6, temperature=0, logprobs=5)
    toks = model.tokenize(PROMPT) + r.tokens
    lsm = log_softmax(ctx.eval(toks))
    n = len(model.tokenize(PROMPT))
    for k, lp in enumerate(r.logprobs):
        row = lsm[n - 1 + k]
        assert lp.token == r.tokens[k] == row.argmax()  # greedy: the top token
        assert lp.logprob == pytest.approx(row[lp.token], abs=0.05)
        assert [t for t, _, _ in lp.top] == list(np.argsort(-row, kind="stable")[:5])
        assert all(a[2] >= b[2] for a, b in zip(lp.top, lp.top[1:]))
        assert lp.text == model.token_to_piece(lp.token, special=True).decode("utf-8", "replace")


@pytest.mark.exact
def test_prefix_reuse_evaluates_only_new_tokens(model):
    with model.context(n_ctx=512) as c:
        a = c.generate(PROMPT, max_tokens=8, temperature=0)
        longer = PROMPT + " red, yellow and blue. The secondary colors are"
        c._llama_context.perf_reset()
        b = c.generate(longer, max_tokens=8, temperature=0)
        new = model.tokenize(longer)
        cached = model.tokenize(PROMPT) + a.tokens[:-1]
        common = next(i for i, (x, y) in enumerate(zip(cached + [-1], new)) if x != y)
        assert b.timings.prompt_reused == common >= len(model.tokenize(PROMPT)) - 1
        perf = c._llama_context.perf()
        assert perf["n_p_eval"] == len(new) - common  # llama.cpp's own count of prompt tokens evaluated
    with model.context(n_ctx=512) as fresh:
        assert fresh.generate(longer, max_tokens=8, temperature=0).tokens == b.tokens


def test_state_roundtrip_bytes_and_file(model, tmp_path):
    p = model.tokenize(PROMPT)
    with model.context(n_ctx=512) as c:
        ref = c.generate(PROMPT, max_tokens=10, temperature=0)
    with model.context(n_ctx=512) as c:
        c.decode(p)
        state = c.save_state()
        c.decode(model.tokenize(" and something else entirely"))
        c.load_state(state)
        assert c.tokens == p and c.n_past == len(p)
        with pytest.raises(ValueError, match="no logits"):
            c.logits()  # a state holds the KV cache, not the outputs
        r = c.generate(PROMPT, max_tokens=10, temperature=0)
        assert r.tokens == ref.tokens and r.timings.prompt_reused == len(p) - 1
        c.load_state(state)
        c.save_state_file(tmp_path / "session.bin")
    with model.context(n_ctx=512) as d:
        d.load_state(state)
        assert d.generate(PROMPT, max_tokens=10, temperature=0).tokens == ref.tokens
        # a state in the first format (int32 token ids, "LBTOKENS"), as earlier releases wrote it
        raw = state[: len(state) - 24 - 8 * len(p)]  # the KV cache alone
        d.load_state(raw + np.asarray(p, "<i4").tobytes() + len(p).to_bytes(8, "little") + b"LBTOKENS")
        assert d.tokens == p and d.generate(PROMPT, max_tokens=10, temperature=0).tokens == ref.tokens
    with model.context(n_ctx=512) as e:
        assert e.load_state_file(tmp_path / "session.bin") == p
        r = e.generate(PROMPT, max_tokens=10, temperature=0)
        assert r.tokens == ref.tokens and r.timings.prompt_reused == len(p) - 1


def test_bad_state_raises_and_context_stays_usable(model, tmp_path):
    with model.context(n_ctx=512) as c:
        good = c.generate(PROMPT, max_tokens=5, temperature=0).tokens
        c.decode(model.tokenize(" x"))
        with pytest.raises(ValueError):
            c.load_state(b"garbage")
        with pytest.raises(ValueError):
            c.load_state(b"\x00" * 100 + b"\x00" * 8 + b"LBTOKENS")
        with pytest.raises(ValueError):  # the second format: a record longer than the bytes
            c.load_state(b"\x00" * 100 + (10**6).to_bytes(8, "little") + b"\x00" * 8 + b"LBSTATE2")
        bad = tmp_path / "bad.bin"
        bad.write_bytes(b"ggsn" + b"\xff" * 64)
        with pytest.raises(ValueError):
            c.load_state_file(bad)
        with pytest.raises(FileNotFoundError):
            c.load_state_file(tmp_path / "missing.bin")
        assert c.n_past == 0
        assert c.generate(PROMPT, max_tokens=5, temperature=0).tokens == good


@pytest.mark.exact
def test_seq_copy_and_remove(model):
    a, b = model.tokenize(" red"), model.tokenize(" blue")
    p = model.tokenize(PROMPT)
    with model.context(n_ctx=512, n_seq_max=2) as c:
        c.decode(p)
        c.seq_copy(0, 1)
        c._llama_context.decode(b, 1)
        lb = c._llama_context.logits(-1)
        c._llama_context.decode(a, 0)
        la = c._llama_context.logits(-1)
        assert c._llama_context.pos(0) == c._llama_context.pos(1) == len(p) + 1
        c.seq_remove(1, len(p))
        assert c._llama_context.pos(1) == len(p)
    with model.context(n_ctx=512) as ref:
        np.testing.assert_allclose(ref.eval(p + b)[-1], lb, atol=2e-2 * np.abs(lb).max())
        ref.clear()
        np.testing.assert_allclose(ref.eval(p + a)[-1], la, atol=2e-2 * np.abs(la).max())


@pytest.mark.exact
def test_generate_batch_equals_one_by_one(model):
    prompts = [PROMPT, "Paris is the capital of", "def fibonacci(n):", "Once upon a time"]
    batch = model.generate_batch(prompts, max_tokens=12, temperature=0)
    for p, r in zip(prompts, batch):
        with model.context(n_ctx=512) as c:
            assert c.generate(p, max_tokens=12, temperature=0).tokens == r.tokens
    again = model.generate_batch(prompts, max_tokens=12, temperature=0.9, seed=5)
    assert [r.tokens for r in again] == [
        r.tokens for r in model.generate_batch(prompts, max_tokens=12, temperature=0.9, seed=5)
    ]
    with pytest.raises(ValueError):
        model.generate_batch([], max_tokens=1)
    with pytest.raises(TypeError):
        model.generate_batch("one string", max_tokens=1)


def write_lora(path, model, rank=4, scale_b=1.0, seed=0):
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    n = model.n_embd
    for i in range(model.n_layer):
        w.add_tensor(f"blk.{i}.attn_q.weight.lora_a", rng.standard_normal((rank, n)).astype(np.float32) * 0.1)
        w.add_tensor(f"blk.{i}.attn_q.weight.lora_b", rng.standard_normal((n, rank)).astype(np.float32) * 0.1 * scale_b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_lora_scale_and_remove(model, tmp_path):
    toks = model.tokenize(PROMPT)
    with llamabind.Model(model.path, n_ctx=256) as m, m.context(n_ctx=256) as c:
        base = c.eval(toks)[-1]
        zero_b = m.load_lora(write_lora(tmp_path / "zero.gguf", m, scale_b=0.0))
        c.set_lora(zero_b, 1.0)
        np.testing.assert_allclose(c.eval(toks)[-1], base, atol=1e-4)  # B = 0: the adapter adds nothing
        c.remove_lora(zero_b)
        lora = m.load_lora(write_lora(tmp_path / "lora.gguf", m))
        assert lora.metadata["adapter.type"] == "lora"
        c.set_lora(lora, 0.0)
        np.testing.assert_allclose(c.eval(toks)[-1], base, atol=1e-4)
        c.set_lora(lora, 1.0)
        changed = c.eval(toks)[-1]
        assert np.abs(changed - base).max() > 0.1
        with pytest.raises(LlamaError):
            lora.close()  # applied to a context
        c.remove_lora()
        np.testing.assert_allclose(c.eval(toks)[-1], base, atol=1e-4)
        lora.close()
        with pytest.raises(ValueError):
            c.set_lora(lora, 1.0)
        with pytest.raises(ValueError):
            m.load_lora(model.path)  # a model, not an adapter
        with pytest.raises(FileNotFoundError):
            m.load_lora(tmp_path / "nope.gguf")


@pytest.mark.exact
@pytest.mark.parametrize("kw", [dict(lookup_ngram=2, n_draft=6), dict(lookup_ngram=1, n_draft=3), "draft"])
def test_speculative_equals_plain_decoding(model, kw):
    prompt = "Repeat: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
    with model.context(n_ctx=512) as c:
        plain = c.generate(prompt, max_tokens=40, temperature=0)
    with model.context(n_ctx=512) as c:
        if kw == "draft":
            with llamabind.Model(model.path, n_ctx=512) as d:
                spec = c.generate(prompt, max_tokens=40, temperature=0, draft_model=d, n_draft=4)
        else:
            spec = c.generate(prompt, max_tokens=40, temperature=0, **kw)
        assert spec.tokens == plain.tokens and spec.text == plain.text
        # the KV cache holds exactly prompt + generated (minus the last, never evaluated)
        assert c.tokens == model.tokenize(prompt) + spec.tokens[: c.n_past - len(model.tokenize(prompt))]
        seeded = [c.generate(prompt, max_tokens=20, temperature=0.8, seed=9, lookup_ngram=2).tokens for _ in range(2)]
    with model.context(n_ctx=512) as c:
        assert seeded[0] == seeded[1] == c.generate(prompt, max_tokens=20, temperature=0.8, seed=9).tokens


def test_embeddings_pooling_on_a_decoder_model(model):
    texts = ["hello world", "a completely different sentence about cats", "hello world"]
    e = model.embed(texts)
    assert e.shape == (3, model.n_embd) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(e[0], e[2], atol=1e-5)  # batched together: same text, same vector
    assert e[0] @ e[1] < 0.999
    raw = model.embed(texts[1], normalize=False)
    per_token = model.embed(texts[1], pooling="none", normalize=False)
    assert per_token.shape == (len(model.tokenize(texts[1])), model.n_embd)
    np.testing.assert_allclose(per_token.mean(axis=0), raw, rtol=1e-4, atol=1e-5)  # mean pooling is the mean
    last = model.embed(texts[1], pooling="last", normalize=False)
    np.testing.assert_allclose(last, per_token[-1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        model.embed([])
    with pytest.raises(ValueError):
        model.embed("x", pooling="max")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    record=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8),
    spans=st.lists(st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * 3), max_size=3),
    small=st.lists(st.tuples(*[st.integers(-2, 300)] * 3), max_size=3),
)
def test_any_state_trailer_is_loaded_or_refused(model, record, spans, small):
    """A state's trailer (the record and the M-RoPE media spans) from anywhere: loaded, or a
    ValueError with the cache emptied; the context decodes afterwards or raises, never aborts."""
    with model.context(n_ctx=256) as c:
        c.decode(model.tokenize("Hello"))
        kv = c.save_state()[: -24 - 8 * len(c.tokens)]
        for sp in (spans, small):
            body = np.asarray(record, "<i8").tobytes() + np.asarray(sp, "<i8").reshape(-1, 3).tobytes()
            data = kv + body + len(record).to_bytes(8, "little") + len(sp).to_bytes(8, "little") + b"LBSTATE2"
            try:
                c.load_state(data)
            except ValueError:
                assert c.n_past == 0
                continue
            try:
                c.decode(model.tokenize(" world"))
            except (ValueError, LlamaError):
                pass
