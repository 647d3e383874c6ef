"""KV cache types (Context/Model type_k/type_v, serve --cache-type-k/-v; llama_context_params.type_k/v):
logits against the f16 cache's by NMSE, the cache's memory (llama_state's size), generation through
the default context and batches, the server, and bad types as errors."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from conftest import GPU_BUILD

import llamabind


@pytest.fixture
def window(model, vendor_dir):
    return model.tokenize((vendor_dir / "docs" / "build.md").read_text(encoding="utf-8"))[:400]


def _nmse(a, ref):
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    return float(((a - ref) ** 2).mean() / (ref**2).mean())


@pytest.mark.exact
def test_quantized_kv_cache_logits_and_memory(model, window):
    out = {}
    for tk, tv in [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("q4_0", "q4_0"), ("f32", "f32")]:
        with model.context(n_ctx=512, type_k=tk, type_v=tv) as c:
            out[tk, tv] = (c.eval(window), len(c.save_state()))
    ref, size = out["f16", "f16"]
    got = {k: (_nmse(v[0], ref), v[1] / size) for k, v in out.items()}
    print({f"{k[0]}/{k[1]}": f"NMSE {n:.1e}, state {r:.2f}x" for k, (n, r) in got.items()})
    # measured on the 2-core VM: q8_0 4.7e-4 (0.53x), q4_0 6.8e-3 (0.28x), f32 ~1e-7 (1.9x)
    assert got["q8_0", "q8_0"][0] < 2e-3 and got["q8_0", "q8_0"][1] < 0.6
    assert got["q8_0", "f16"][0] < 2e-3 and 0.6 < got["q8_0", "f16"][1] < 0.85
    assert got["q4_0", "q4_0"][0] < 3e-2 and got["q4_0", "q4_0"][1] < 0.35
    assert got["f32", "f32"][0] < 1e-4 and got["f32", "f32"][1] > 1.8
    # the same tokens through a q8_0 cache: greedy text of the default context and of a batch
    with llamabind.Model(model.path, n_threads=2, n_gpu_layers=0 if GPU_BUILD else -1, type_k="q8_0",
                         type_v="q8_0") as q:  # fmt: skip
        assert q.context_params["type_k"] == "q8_0"
        a = q.generate("The three primary colors are", max_tokens=12, temperature=0)
        (b,) = q.generate_batch(["The three primary colors are"], max_tokens=12, temperature=0)
        assert a.tokens == b.tokens and len(a.tokens) == 12


def test_bad_kv_cache_types_are_errors(model):
    with pytest.raises(ValueError, match="quantized V cache \\(q8_0\\) needs flash attention"):
        model.context(n_ctx=256, type_v="q8_0", flash_attn="off")
    with pytest.raises(ValueError, match="type_k must be one of"):
        model.context(n_ctx=256, type_k="q3_K")
    with pytest.raises(ValueError, match="flash_attn must be one of"):
        model.context(n_ctx=256, flash_attn="yes")
    with pytest.raises(ValueError, match="needs flash attention"):
        llamabind.serve(model.path, port=0, cache_type_v="q4_0", flash_attn="off")
    with model.context(n_ctx=256, type_k="q8_0", flash_attn="off") as c:  # a quantized K alone needs no FA
        assert c.eval(model.tokenize("Hello"))[-1].shape == (model.n_vocab,)


def test_server_with_a_q8_0_cache_answers(model_path):
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=1024, cache_type_k="q8_0",
                         cache_type_v="q8_0") as s:  # fmt: skip
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=s.model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert r.choices[0].message.content
