"""Context shift (issue 31): a generation that fills n_ctx keeps going by dropping half of the
context after n_keep tokens, as llama-server's --context-shift does; greedy tokens equal upstream's
llama-server from the same build, and llamabind's own server with context_shift=True."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

import httpx
import pytest
from conftest import GPU_BUILD, require_tool

import llamabind

CPU_ONLY = {"n_gpu_layers": 0, "op_offload": False} if GPU_BUILD else {}
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter one:"
N_CTX, N_PREDICT = 256, 420  # the context fills at least twice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama_server_tokens(model_path, n_keep: int) -> list[int]:
    server = require_tool("llama-server")
    port = _free_port()
    ngl = ["-ngl", "0"] if GPU_BUILD else []
    cmd = [str(server), "-m", str(model_path), "-c", str(N_CTX), "-np", "1", "--context-shift", "-t", "2"]
    p = subprocess.Popen([*cmd, *ngl, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "n_keep": n_keep,
                "return_tokens": True}  # fmt: skip
        req = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return json.loads(urllib.request.urlopen(req, timeout=600).read())["tokens"]
    finally:
        p.terminate()
        p.wait(30)


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
    with model.context(n_ctx=N_CTX) as ctx:
        want = ctx.generate(PROMPT, max_tokens=N_PREDICT, temperature=0, ignore_eos=True, context_shift=True)
        # without context shift the generation stops when the context is full
        cut = ctx.generate(PROMPT, max_tokens=N_PREDICT, temperature=0, ignore_eos=True)
    # the cache fills to n_ctx; the token sampled from its last position is the last one
    assert cut.finish_reason == "length" and cut.prompt_tokens + len(cut.tokens) == N_CTX + 1
    assert cut.tokens == want.tokens[: len(cut.tokens)]
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=N_CTX, context_shift=True, **CPU_ONLY) as s:
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        got = httpx.post(s.url + "/completion", json=body, timeout=600).json()["tokens"]
    assert got == want.tokens


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
