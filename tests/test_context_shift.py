"""Context shift (issue 31): a generation that fills n_ctx keeps going by dropping half of the
context after n_keep tokens, as llama-server's --context-shift does; greedy tokens equal upstream's
llama-server from the same build, and llamabind's own server with context_shift=True."""

from __future__ import annotations

import httpx
import pytest
from conftest import GPU_BUILD, llama_server, post_json

import llamabind

CPU_ONLY = {"n_gpu_layers": 0, "op_offload": False} if GPU_BUILD else {}
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter one:"
N_CTX, N_PREDICT = 256, 420  # the context fills at least twice


def _llama_server_tokens(model_path, n_keep: int) -> list[int]:
    args = ["-c", str(N_CTX), "-np", "1", "--context-shift", "-t", "2", *(["-ngl", "0"] if GPU_BUILD else [])]
    with llama_server(model_path, *args) as url:
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "n_keep": n_keep,
                "return_tokens": True}  # fmt: skip
        return post_json(url + "/completion", body)["tokens"]


@pytest.mark.exact
@pytest.mark.parametrize("n_keep", [0, 8])
def test_greedy_tokens_equal_llama_server_with_context_shift(model, model_path, n_keep):
    with model.context(n_ctx=N_CTX) as ctx:
        r = ctx.generate(
            PROMPT, max_tokens=N_PREDICT, temperature=0, ignore_eos=True, context_shift=True, n_keep=n_keep
        )
    assert len(r.tokens) == N_PREDICT and r.finish_reason == "length"
    assert r.timings.context_shifts >= 2
    assert r.tokens == _llama_server_tokens(model_path, n_keep)


@pytest.mark.exact
def test_llamabind_server_context_shift_and_the_default_stop(model, model_path):
    msgs = [{"role": "user", "content": PROMPT}]
    with model.context(n_ctx=N_CTX) as ctx:
        want = ctx.generate(PROMPT, max_tokens=N_PREDICT, temperature=0, ignore_eos=True, context_shift=True)
        reply = ctx.chat(msgs, max_tokens=N_PREDICT, temperature=0, ignore_eos=True, context_shift=True)
        # without context shift the generation stops when the context is full
        cut = ctx.generate(PROMPT, max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
    assert reply.generation.timings.context_shifts >= 1 and len(reply.generation.tokens) == N_PREDICT
    # the cache fills to n_ctx; the token sampled from its last position is the last one
    assert cut.finish_reason == "length" and cut.prompt_tokens + len(cut.tokens) == N_CTX + 1
    # up to the shift: cut's last token comes from the full cache's last position, which the shifting
    # generation never evaluates (it shifts first); they part there at a near tie (seen on an H100 host)
    assert cut.tokens[:-1] == want.tokens[: len(cut.tokens) - 1]
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=N_CTX, context_shift=True, **CPU_ONLY) as s:
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        got = httpx.post(s.url + "/completion", json=body, timeout=600).json()["tokens"]
        body = {"messages": msgs, "max_tokens": N_PREDICT, "temperature": 0, "ignore_eos": True}
        chat = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=600).json()
    assert got == want.tokens
    assert chat["choices"][0]["message"]["content"] == reply.content


def test_context_shift_errors(model):
    with pytest.raises(ValueError, match="n_keep"):
        model.generate("Hi", max_tokens=2, context_shift=True, n_keep=-2)
    with model.context(n_ctx=N_CTX) as ctx:
        ctx.decode(model.tokenize("one two three"))
        with pytest.raises(ValueError, match="exceeds"):
            ctx.shift(2, ctx.n_past)
        n = ctx.n_past
        toks = ctx.tokens
        ctx.shift(1, 1)
        assert ctx.n_past == n - 1 and ctx.tokens == toks[:1] + toks[2:]


def test_n_keep_past_the_context_is_clamped_with_a_warning(model, caplog):
    """An n_keep larger than the context (issue 40's rough edge) is clamped to n_ctx - 4, as llama-server
    clamps it, and said on the llamabind logger; the generation shifts and goes on."""
    import logging

    with model.context(n_ctx=N_CTX) as ctx, caplog.at_level(logging.WARNING, logger="llamabind"):
        r = ctx.generate("Once upon a time", max_tokens=N_CTX + 40, context_shift=True, n_keep=1000, ignore_eos=True)
    assert len(r.tokens) == N_CTX + 40 and r.finish_reason == "length"
    assert any("exceeds n_ctx - 4 = 252" in m for m in caplog.messages), caplog.messages
