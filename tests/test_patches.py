"""Fixes carried in patches/ (and upstream fixes we rely on), tested through the real build."""

from __future__ import annotations

import numpy as np
import pytest

from llamabind import _core


def _softmax64(a):
    a = a.astype(np.float64)
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("rows,n,scale", [(1, 8, 1.0), (3, 8, 1.0), (4, 33, 0.5), (2, 1024, 2.0)])
def test_soft_max_back_dst_aliases_y(rows, n, scale):
    """patches/0001: ggml_gallocr places dx on y; CPU soft_max_back must still be right.

    Unpatched b11312 returns (dy - dot)^2 * scale here (y is overwritten by dy before the
    multiply): off by 3.46 for the (3, 8) case below, against 2e-8 with the patch.
    """
    rng = np.random.default_rng(rows * 1000 + n)
    a = rng.standard_normal((rows, n)).astype(np.float32)
    dy = rng.standard_normal((rows, n)).astype(np.float32)
    dx, aliased = _core._testing.soft_max_back_graph(dy, a, scale)
    assert aliased, "the allocator did not place dx on y: this test no longer reaches the aliasing path"
    y = _softmax64(a)
    ref = scale * y * (dy - (y * dy).sum(axis=-1, keepdims=True))
    assert dx.shape == (rows, n) and dx.dtype == np.float32
    np.testing.assert_allclose(dx, ref, rtol=1e-5, atol=1e-6)


def test_soft_max_back_helper_validates_shapes():
    a = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="same shape"):
        _core._testing.soft_max_back_graph(np.zeros((2, 5), np.float32), a, 1.0)
    with pytest.raises(TypeError):
        _core._testing.soft_max_back_graph(np.zeros(8, np.float32), a, 1.0)  # 1-D: wrong ndim


def test_prompt_batch_on_the_cpu_amx_path(model_path):
    """patches/0013: on a CPU with AMX (Sapphire Rapids and later), a prompt batch of a Q4_1 model
    runs ggml-cpu's AMX mul_mat, whose tile config the compiler left half-written at the pin: the
    process died with SIGSEGV in ldtilecfg (seen on this project's CI machines). In a subprocess: it
    must survive, and the batch's last logits must equal those of the same prompt fed one token at a
    time (vector kernels, no AMX)."""
    import json

    from conftest import run_python

    code = f"""
import json, numpy as np, llamabind
info = llamabind.build_info()["system_info"]
with llamabind.Model({str(model_path)!r}, n_ctx=512, n_threads=2, n_gpu_layers=0, op_offload=False) as m:
    ids = m.tokenize("<|im_start|>user\\nWhat is the capital of France? Answer in one word, thank you.<|im_end|>\\n"
                     "<|im_start|>assistant\\n", parse_special=True)
    batch = m.context(n_ctx=512).eval(ids)[-1].astype(np.float64)
    c = m.context(n_ctx=512)
    for t in ids:
        c.decode([t])
    one = c.logits().astype(np.float64)
print(json.dumps({{"n": len(ids), "amx": "AMX_INT8 = 1" in info,
                  "nmse": float(((batch - one) ** 2).mean() / (one ** 2).mean())}}))
"""
    r = run_python(code, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\nAMX on this CPU: {out['amx']}; {out['n']} prompt tokens; NMSE batch vs one at a time {out['nmse']:.2e}")
    assert out["n"] >= 24 and out["nmse"] < 1e-6


def test_a_buffer_over_the_memory_limit_is_an_error_not_a_kill(model_path):
    """patches/0097: a host buffer larger than the RAM and swap the process may use (or its cgroup's limit)
    fails in ggml_aligned_malloc. Before, posix_memalign refused it only where the kernel's overcommit is
    heuristic and the machine the process's own (this 24 GiB VM); where it overcommits always (the GPU
    machine's 128 GiB VM: patch 0053's test was killed there after minutes) or in a cgroup-limited container
    it succeeded and the OOM killer ended the process with SIGKILL at the first touch. A context of 2^24
    tokens (llama.cpp's largest n_ctx) with an F32 KV cache asks for ~770 GB for SmolLM2 (30 layers x 2 x
    192 values a token), more than these machines may use: an exception, ggml's log giving both sizes, the
    model usable after it. In a subprocess (a kill must not take the suite)."""
    from conftest import run_python

    code = f"""
import logging, llamabind
logging.basicConfig(level=logging.ERROR)
with llamabind.Model({str(model_path)!r}, n_ctx=256, n_threads=2, n_gpu_layers=0) as m:
    try:
        m.context(n_ctx=1 << 24, type_k="f32", type_v="f32")
        print("no error")
    except (llamabind.LlamaError, ValueError, MemoryError) as err:
        print("error:", type(err).__name__, err)
    print("after:", len(m.generate("The capital of France is", max_tokens=2, temperature=0).tokens))
"""
    r = run_python(code, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "error:" in r.stdout and "after: 2" in r.stdout, r.stdout[-2000:]
    # the message of this patch (posix_memalign's own failure says "insufficient memory" without the limit)
    assert "of RAM and swap this process may use" in r.stderr, r.stderr[-3000:]
