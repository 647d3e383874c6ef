"""How a training step runs (issue 42): the windows of a batch are sequences of one graph, each
attending only within itself (patch 0031); the forward, backward and optimizer graphs are built once
and kept while the shape stays (patch 0032); token_embd is trained (patch 0033); the profiler splits a
step into forward, backward and optimizer ops. On SmolLM2's F32 copy (its first blocks) and a
random-weight llama with an untied output matrix (bench/make_model.py tiny)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf_tensors
import numpy as np
import pytest
from conftest import CUT_LAYERS, GPU_BUILD, gpu_skip_reason, run_python

import llamabind
from llamabind import train
from llamabind.model import quantize

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def f32_path(smollm2_f32_cut):
    # SmolLM2's real weights with its tied embedding, cut to its first blocks (conftest): how a step
    # runs does not depend on the depth, and a step costs a fifth of the 30-block model's
    return smollm2_f32_cut


@pytest.fixture(scope="module")
def q4_0_path(f32_path, tmp_path_factory):
    """f32_path in Q4_0 (llama_model_quantize): QLoRA's frozen weights."""
    out = tmp_path_factory.mktemp("q4_0") / "smollm2-q4_0.gguf"
    quantize(f32_path, out, "Q4_0")
    return out


@pytest.fixture(scope="module")
def untied_f32(tiny_f32):
    return tiny_f32  # conftest: bench/make_model.py's tiny shape has an untied output matrix


@pytest.fixture(scope="module")
def wins(f32_path, vendor_dir):
    text = (vendor_dir / "docs" / "build.md").read_text(encoding="utf-8")
    with llamabind.Model(f32_path, vocab_only=True) as v:
        return train.windows(v.tokenize(text[:9000], add_special=True), 256, stride=256)[:4]


def _steps(path, wins, monkeypatch, reuse: bool, n: int = 3):
    if not reuse:
        monkeypatch.setenv("LLAMA_GRAPH_REUSE_DISABLE", "1")  # read when the context is made
    try:
        with llamabind.Model(path, use_mmap=False, n_threads=2) as m:
            with train.Trainer(m, batch_size=2, optimizer="adamw", lr=1e-4, n_threads=2) as t:
                before = t.evaluate(wins[2:4])[0]
                losses = [t.step(wins[:2])[0] for _ in range(n)]
                after = t.evaluate(wins[2:4])[0]
                return [before, *losses, after], t.stats()
    finally:
        monkeypatch.delenv("LLAMA_GRAPH_REUSE_DISABLE", raising=False)


def test_graphs_are_built_once_per_shape(f32_path, wins, monkeypatch):
    """patch 0032: N steps of one shape build the forward graph and ggml-opt's backward/optimizer
    graphs once; allocations happen when the graph changes (validation <-> training), not per step.
    Rebuilding every eval (LLAMA_GRAPH_REUSE_DISABLE=1, the pin's behaviour) gives the same losses."""
    kept, stats = _steps(f32_path, wins, monkeypatch, reuse=True)
    print(stats)
    assert stats["n_evals"] == 5
    assert stats["n_graph_builds"] == 1 and stats["n_opt_builds"] == 1, stats
    assert stats["n_graph_allocs"] == 3, stats  # validation, the 3 steps, validation
    rebuilt, stats2 = _steps(f32_path, wins, monkeypatch, reuse=False)
    assert stats2["n_graph_builds"] == 5 and stats2["n_opt_builds"] == 5 and stats2["n_graph_allocs"] == 5, stats2
    print("kept", kept, "rebuilt", rebuilt)
    np.testing.assert_allclose(kept, rebuilt, rtol=1e-6)
    assert kept[-1] < kept[0]  # and it trains


def _kept_run(path, flash: bool) -> tuple[list[float], dict]:
    rng = np.random.default_rng(7)
    w = [rng.integers(3, 200, size=(2, 257), dtype=np.int32) for _ in range(6)]
    lab = np.ascontiguousarray(w[3][:, 1:])
    lab[:, :100] = -1  # another layout: the labelled positions differ
    with llamabind.Model(path, use_mmap=False, n_threads=2) as m:
        with train.Trainer(m, batch_size=2, lr=1e-3, n_threads=2, flash_attn=flash) as t:
            out = [t.evaluate(w[0])[0], t.step(w[1])[0], t.step(w[2])[0], t.step(w[3], lab)[0]]
            out += [t.step(w[4])[0], t.evaluate(w[0])[0], t.step(w[5])[0], t.step(w[1])[0]]
            return out, t.stats()


@pytest.mark.parametrize("flash", [False, True])
def test_kept_batches_train_as_rebuilt_ones(untied_f32, flash, monkeypatch):
    """patch 0063: a training step whose windows have the last step's layout reuses its ubatch, memory
    state and KQ mask (only the tokens are written); steps with other windows, a validation pass between
    them (another graph allocation: the mask is written again) and a step with masked labels (another
    layout: the full path) give the same losses, bit for bit, as with LLAMA_OPT_KEEP_BATCH=0, which
    prepares every batch anew. Same process, same kernels on both sides."""
    kept, st = _kept_run(untied_f32, flash)
    monkeypatch.setenv("LLAMA_OPT_KEEP_BATCH", "0")
    fresh, st0 = _kept_run(untied_f32, flash)
    print(kept, st, st0)
    assert st["n_kept_batches"] >= 3 and st0["n_kept_batches"] == 0
    assert kept == fresh
    assert len(set(kept[1:5])) == 4  # the windows differed: each step its own loss


_RPC_STEPS = """
import json, sys, numpy as np, llamabind
from llamabind import ops, train
path, endpoint, wins = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
# on a GPU build every layer still goes to the RPC server's CPU (tensor_split: none for the local
# GPUs) and no op to a GPU: both runs are float32 on CPUs, equal to rounding (precision "f32": the RPC
# device counts as an offloaded output layer, whose default is "bf16", and a CPU with AVX512_BF16 takes it)
n_gpu = sum(d["type"] == "gpu" for d in ops.devices())
remote = dict(rpc=[endpoint], tensor_split=[0] * n_gpu + [1] if n_gpu else None)
kw = dict(remote if endpoint else dict(n_gpu_layers=0), op_offload=False, repack=False)
with llamabind.Model(path, use_mmap=False, n_threads=2, **kw) as m:
    with train.Trainer(m, batch_size=2, optimizer="adamw", lr=1e-3, n_threads=2, precision="f32") as t:
        out = [t.evaluate(wins[2:4])[0]] + [t.step(wins[:2])[0] for _ in range(2)] + [t.evaluate(wins[2:4])[0]]
        out += [t.step(wins[:2])[0]]
print(json.dumps(out))
"""


@pytest.mark.skipif(not getattr(llamabind._core, "HAS_RPC", False), reason="build without GGML_RPC")
def test_validation_then_steps_across_two_backends(untied_f32, tmp_path):
    """patch 0036: with the layers on a second backend (an RPC server's CPU, as a GPU would hold them)
    the scheduler copies the token, position and mask inputs from the CPU and points the kept graphs'
    forward nodes at its copies; a validation, training steps, a validation and a step again must
    read the inputs, not the copies freed by the graph split before (on CUDA: an abort in soft_max)."""
    from test_rpc import free_port

    from llamabind import rpc

    wins = np.array([np.arange(257) * (i + 3) % 4000 + 5 for i in range(4)], np.int32)
    np.save(tmp_path / "wins.npy", wins)
    run = lambda ep: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _RPC_STEPS, str(untied_f32), ep, str(tmp_path / "wins.npy")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    local = run("")
    assert local.returncode == 0, local.stderr[-2000:]
    with rpc.serve(port=free_port(), device="CPU", threads=2) as server:
        remote = run(server.endpoint)
    assert remote.returncode == 0, remote.stderr[-3000:]
    a, b = json.loads(local.stdout.splitlines()[-1]), json.loads(remote.stdout.splitlines()[-1])
    print("local", a, "over RPC", b)
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert b[3] < b[0]  # the steps trained


def test_windows_of_one_graph_attend_only_within_themselves(f32_path, wins):
    """patch 0031: two windows as two sequences of one ubatch give each window the loss it has
    alone: the loss of the pair is the mean of the two, and changing the second window leaves the
    first's loss as it was (masking the second's labels out)."""
    with llamabind.Model(f32_path, use_mmap=False, n_threads=2) as m:
        with train.Trainer(m, batch_size=2, optimizer="sgd", lr=1e-3, n_threads=2) as two:
            pair, _, n = two.evaluate(wins[:2])
            first_only = np.stack([wins[1, 1:], np.full(256, -1, np.int32)])  # labels: the second masked
            a = two.evaluate(wins[[1, 0]], first_only)[0]
            b = two.evaluate(wins[[1, 3]], first_only)[0]
        with train.Trainer(m, batch_size=1, optimizer="sgd", lr=1e-3, n_threads=2) as one:
            l0, l1 = one.evaluate(wins[:1])[0], one.evaluate(wins[1:2])[0]
    print(f"pair {pair:.6f}, alone {l0:.6f} {l1:.6f}; first with another second: {a:.6f} {b:.6f}")
    assert n == 512
    # a window attending to another moves its loss by 1e-2 and more; on a GPU the batch's shape moves the
    # TF32 products' sums (4e-5 on an H100), on the CPU the sums are the same to float32 rounding
    rel = 2e-4 if GPU_BUILD else 1e-5
    assert pair == pytest.approx((l0 + l1) / 2, rel=rel)
    assert a == pytest.approx(l1, rel=rel) and b == pytest.approx(l1, rel=rel)


def _tensor(path, name) -> np.ndarray:
    return np.asarray(gguf_tensors.read(path)[name].data, dtype=np.float64)  # tests/gguf_tensors.py


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_token_embd_is_trained(which, f32_path, untied_f32, wins, tmp_path):
    """patch 0033: a full fine-tune updates token_embd: with SGD, exactly the rows of the tokens
    the step read change (and with a tied output matrix, SmolLM2's, every row: the output's gradient
    reaches all); the model decodes with the trained matrix and saves it. train_embeddings=False
    leaves it as it was."""
    path = f32_path if which == "tied" else untied_f32
    w = wins[:1] if which == "tied" else np.array([np.arange(257) % 200 + 3], np.int32)
    w0 = _tensor(path, "token_embd.weight")

    def step(embeddings: bool, out):
        with llamabind.Model(path, use_mmap=False, n_threads=2) as m:
            with train.Trainer(m, optimizer="sgd", lr=1.0, train_embeddings=embeddings, n_threads=2) as t:
                t.step(w)
            m.save(out)
            return m.generate([1, 2, 3], max_tokens=4, temperature=0).tokens

    toks = step(True, tmp_path / "on.gguf")
    w1 = _tensor(tmp_path / "on.gguf", "token_embd.weight")
    changed = np.flatnonzero(np.abs(w1 - w0).max(axis=1) > 0)
    print(which, "rows changed:", len(changed), "of", len(w0))
    if which == "tied":
        assert len(changed) > 0.99 * len(w0)
    else:
        assert set(changed) == set(np.unique(w[0, :-1]).tolist())
    with llamabind.Model(tmp_path / "on.gguf", n_threads=2) as saved:
        assert saved.generate([1, 2, 3], max_tokens=4, temperature=0).tokens == toks  # decoded with the trained one
    step(False, tmp_path / "off.gguf")
    assert np.array_equal(_tensor(tmp_path / "off.gguf", "token_embd.weight"), w0)


@pytest.mark.parametrize("params", ["model", "lora"])
def test_forward_only_evaluation_gives_the_steps_own_losses(f32_path, params, tmp_path):
    """The forward-only graph (Trainer.evaluate: ggml-opt's forward graph, allocated alone, each activation freed
    after its last forward use) and a training step's forward pass (the same nodes in the gradient graph, the
    activations kept for the backward pass) compute the same loss on the same window, before the first step and
    after it: on this machine's CPU bit for bit; on a GPU within 1e-5 relative (where nothing keeps a residual
    input for a backward pass its ADD runs in place, and ggml-cuda may fuse it into the product: cuBLAS's beta = 1
    kernel may sum in another order). On an H200 a change whose steps trained as PyTorch's gave an evaluation loss
    of 11.23 where the step's was 11.20 (BF16 casts of the trained weights, dropped: bench/results/
    h200-2026-11-29-norm-w); this catches such a graph."""
    w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
    with llamabind.Model(f32_path, use_mmap=False, n_threads=2) as m:
        kw = {}
        if params == "lora":
            path = tmp_path / "init.gguf"
            train.lora_init(m, path, 8, 16.0, ("attn_q", "attn_v"), 0)
            kw = dict(params="lora", adapter=m.load_lora(path))
        with train.Trainer(m, batch_size=2, lr=1e-3, n_threads=2, **kw) as t:
            got = []
            for _ in range(2):
                got.append((t.evaluate(w)[0], t.step(w)[0]))
    print(got)
    for evaluated, stepped in got:
        np.testing.assert_allclose(evaluated, stepped, rtol=1e-5)
    assert got[1][0] != got[0][0]  # the second evaluation sees the first step's update


def test_profile_splits_a_step_into_forward_backward_and_optimizer(untied_f32):
    # the composed attention (flash_attn=False: on a GPU flash attention is the default, and its graph has no
    # SOFT_MAX; test_flash_attention_trains_without_an_attention_matrix covers that one)
    with llamabind.Model(untied_f32, use_mmap=False, n_threads=2) as m:
        with train.Trainer(m, batch_size=2, n_threads=2, profile=True, flash_attn=False) as t:
            w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
            loss = t.step(w)[0]
            rows = t.profile()
            assert t.profile() == []  # read and cleared
    by = {(r["phase"], r["op"]): r for r in rows}
    print(rows[:8])
    assert np.isfinite(loss)
    assert ("forward", "MUL_MAT") in by and ("backward", "OUT_PROD") in by
    assert by[("optimizer", "OPT_STEP_ADAMW")]["nodes"] == 21  # every trained tensor, token_embd included
    assert by[("forward", "SOFT_MAX")]["nodes"] == 2 and ("backward", "SOFT_MAX_BACK") in by  # one per layer
    assert all(r["ms"] >= 0 for r in rows)


def test_flash_attention_trains_without_an_attention_matrix(untied_f32):
    """Patches 0050 and 0052: with flash_attn=True the training graphs hold FLASH_ATTN_EXT (one per
    layer) and its backward FLASH_ATTN_BACK, and no soft_max of KQ (the n_kv x n_tokens matrices the
    composed attention keeps); the step's loss equals the composed attention's (F32 on the CPU: the
    order of the sums differs, 1e-5 relative) and so does the gradient's effect: a second step's
    loss equal to 1e-4 relative. Patch 0062: the gradients of Q, K and V through their split into one
    stream per window (views of the whole tensors) are reshapes, not ACC into a SCALE(x, 0) zero tensor."""
    w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
    losses, ops_of = {}, {}
    for flash in (True, False):
        with llamabind.Model(untied_f32, use_mmap=False, n_threads=2) as m:
            with train.Trainer(m, batch_size=2, n_threads=2, profile=True, flash_attn=flash, lr=1e-3) as t:
                losses[flash] = [t.step(w)[0], t.step(w)[0]]
                ops_of[flash] = {(r["phase"], r["op"]): r["nodes"] for r in t.profile()}
    print(losses, sorted(k for k in ops_of[True] if k[0] != "optimizer"))
    assert ops_of[True][("forward", "FLASH_ATTN_EXT")] == 2 * 2  # two layers, two steps
    assert ops_of[True][("backward", "FLASH_ATTN_BACK")] == 2 * 2
    assert not any(op.startswith("SOFT_MAX") for _, op in ops_of[True])
    assert ("backward", "SOFT_MAX_BACK") in ops_of[False] and ("forward", "FLASH_ATTN_EXT") not in ops_of[False]
    for flash in (True, False):
        assert ("backward", "ACC") not in ops_of[flash] and ("backward", "SCALE") not in ops_of[flash]
    np.testing.assert_allclose(losses[True][0], losses[False][0], rtol=1e-5)
    np.testing.assert_allclose(losses[True][1], losses[False][1], rtol=1e-4)


def _recompute_run(path, flash: bool, recompute: bool, out) -> tuple[list[float], dict, dict]:
    w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
    with llamabind.Model(path, use_mmap=False, n_threads=2) as m:
        kw = dict(flash_attn=flash, gradient_checkpointing=recompute, lr=1e-3, profile=True, n_threads=2)
        with train.Trainer(m, batch_size=2, **kw) as t:
            losses = [t.step(w)[0] for _ in range(3)]
            ops_of = {(r["phase"], r["op"]): r["nodes"] for r in t.profile()}
            stats = t.stats()
        m.save(out)
    return losses, ops_of, stats


@pytest.mark.parametrize("flash", [False, True])
def test_recomputed_activations_train_the_same_weights(untied_f32, flash, tmp_path):
    """Patch 0066: with gradient_checkpointing the backward pass reads recomputed copies of each layer's
    forward nodes, only the layers' outputs kept from the forward pass: the profile's backward phase holds
    6 of every layer's 7 weight products again (not ffn_down: its output only joins the residual stream, whose
    gradient needs no forward value) and its attention (FLASH_ATTN_EXT, or the composed attention's KQ and KQV
    products), the graphs' compute buffer is smaller,
    and three steps' losses and the trained weights equal the run that keeps the activations bit for bit
    (the same CPU kernels recompute the same values in the same order)."""
    kept = _recompute_run(untied_f32, flash, False, tmp_path / "kept.gguf")
    again = _recompute_run(untied_f32, flash, True, tmp_path / "recomputed.gguf")
    print(kept[0], again[0], kept[2]["compute_buffer_bytes"], again[2]["compute_buffer_bytes"])
    assert again[0] == kept[0]
    assert kept[0][2] < kept[0][0]  # and it trains
    a, b = gguf_tensors.read(tmp_path / "kept.gguf"), gguf_tensors.read(tmp_path / "recomputed.gguf")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(b[name].data), np.asarray(a[name].data), err_msg=name)
    n_layer, steps = 2, 3
    ops = ("MUL_MAT", "FLASH_ATTN_EXT")
    extra = {op: again[1].get(("backward", op), 0) - kept[1].get(("backward", op), 0) for op in ops}
    assert extra["MUL_MAT"] == (6 if flash else 8) * n_layer * steps, extra
    assert extra["FLASH_ATTN_EXT"] == (n_layer * steps if flash else 0), extra
    assert again[2]["compute_buffer_bytes"] < kept[2]["compute_buffer_bytes"]


_STEPS = """
import sys, numpy as np, llamabind
from llamabind import train
w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
with llamabind.Model(sys.argv[1], use_mmap=False) as m, train.Trainer(m, batch_size=2, lr=1e-3) as t:
    print(repr([t.step(w)[0] for _ in range(4)]))
"""


_CAST_STEPS = """
import json, sys, tempfile, numpy as np, llamabind
from pathlib import Path
from llamabind import train
w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
with llamabind.Model(sys.argv[1], use_mmap=False) as m:
    kw = {}
    if sys.argv[2] in ("lora", "qlora"):
        path = Path(tempfile.mkdtemp()) / "init.gguf"
        train.lora_init(m, path, 8, 16.0, ("attn_q", "attn_v"), 0)
        kw = dict(params="lora", adapter=m.load_lora(path))
    with train.Trainer(m, batch_size=2, lr=1e-3, profile=True, **kw) as t:
        losses = [t.step(w)[0] for _ in range(3)]
        cpy = sum(r["nodes"] for r in t.profile() if r["phase"] == "forward" and r["op"] == "CPY")
        print(json.dumps(dict(losses=losses, cpy=cpy, buf=t.stats()["compute_buffer_bytes"])))
"""


def _cast_steps(params: str, f32_path: Path, request) -> str:
    """_CAST_STEPS for "model" and "lora" over f32_path, "qlora" (LoRA r8) over its Q4_0 copy."""
    code = _CAST_STEPS.replace("sys.argv[2]", repr(params))
    if params == "qlora":  # (QLoRA reads the weights in the GGUF's layout)
        code = code.replace("use_mmap=False", "use_mmap=False, repack=False")
        return code.replace("sys.argv[1]", repr(str(request.getfixturevalue("q4_0_path"))))
    return code.replace("sys.argv[1]", repr(str(f32_path)))


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
@pytest.mark.parametrize("params", ["model", "lora", "qlora"])
def test_bf16_product_inputs_train_the_same_steps(f32_path, params, request):
    """Patch 0068 (CUDA): in a mixed-precision training graph (bf16, every layer on the GPU) the F32 input
    of each F32 weight's product is cast to BF16 once (ggml_cast: 4 per layer and the output layer's, the
    Q/K/V products of one input reading one cast) and the backward pass keeps the cast rather than the F32
    input. The products read the values the BF16 product rounded the F32 input to before, with the same
    cuBLAS calls, so three steps (full fine-tune, and LoRA r8 on attn_q/attn_v) give the same losses bit
    for bit as without them (the default against LLAMA_OPT_BF16_INPUTS=0; both with the FFN's activations
    in F32, LLAMA_OPT_BF16_FFN=0: those round the values, see the next test), and the graphs'
    compute buffer is smaller (the F32 inputs freed after their casts). Each run its own process, the flash
    attention backward in its fixed order (GGML_CUDA_FA_BACK_DETERMINISTIC=1: its atomics' order would
    change the later steps' last bits). Patch 0077: QLoRA over Q4_0 the same (ggml-cuda's BF16 product of a
    quantized weight, 512 columns here, converted its F32 input with the cast's rounding)."""
    runs = {}
    for cast in ("1", "0"):
        code = _cast_steps(params, f32_path, request)
        env = {**os.environ, "LLAMA_OPT_BF16_FFN": "0", "GGML_CUDA_FA_BACK_DETERMINISTIC": "1"}
        env["LLAMA_OPT_BF16_INPUTS"] = cast
        p = run_python(code, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[cast] = json.loads(p.stdout.strip().splitlines()[-1])
    print(runs)
    assert runs["1"]["losses"] == runs["0"]["losses"]
    assert runs["1"]["cpy"] - runs["0"]["cpy"] == 3 * (4 * CUT_LAYERS + 1)  # three steps' casts
    assert runs["1"]["buf"] < runs["0"]["buf"]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
@pytest.mark.parametrize("params", ["model", "lora", "qlora"])
def test_bf16_ffn_activations_train_as_f32_ones_within_bf16_rounding(f32_path, params, request):
    """Patch 0069 (CUDA): a mixed-precision training graph keeps the FFN's gate and up activations in BF16
    (two casts a layer, SwiGLU and its backward on BF16, the down product's input SwiGLU's BF16 result), as
    autocast's Linear returns them. Three runs, each its own process, the flash backward in fixed order:
    the default (ggml-cuda writes the gate and up products in BF16 through cuBLAS, the SwiGLU backward one
    kernel over BF16 g and u), the same graph with ggml-cuda's fusions off (GGML_CUDA_DISABLE_FUSION=1: F32
    products, the CPY kernel's rounding, SILU_BACK over a BF16 g, MUL of F32 by BF16: other kernels for the
    same arithmetic) and the FFN in F32 (LLAMA_OPT_BF16_FFN=0). The fused and unfused runs' losses agree to
    2e-4 relative (the products' rounding points are the same; cuBLAS may sum in another order for a BF16
    result); against F32 activations each step's loss within 2e-3 relative (BF16 keeps 8 significant bits,
    2^-9 relative per value, averaged over thousands in each logit) and it trains (the third loss below the
    first). The casts add two CPY nodes a layer to each forward pass and take away patch 0068's cast of the down
    product's input (SwiGLU's result is BF16): one CPY node more a layer; the compute buffer is smaller.
    Patch 0077: QLoRA over Q4_0 the same (the quantized gate and up products written in BF16)."""
    runs = {}
    for name, extra in (
        ("bf16", {}),
        ("unfused", {"GGML_CUDA_DISABLE_FUSION": "1"}),
        ("f32", {"LLAMA_OPT_BF16_FFN": "0"}),
    ):
        code = _cast_steps(params, f32_path, request)
        env = {**os.environ, "GGML_CUDA_FA_BACK_DETERMINISTIC": "1", **extra}
        p = run_python(code, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[name] = json.loads(p.stdout.strip().splitlines()[-1])
    print(runs)
    bf16, unfused, f32 = (np.array(runs[k]["losses"]) for k in ("bf16", "unfused", "f32"))
    np.testing.assert_allclose(bf16, unfused, rtol=2e-4)
    np.testing.assert_allclose(bf16, f32, rtol=2e-3)
    assert not np.array_equal(bf16, f32)  # the activations were rounded: the path ran
    assert bf16[2] < bf16[0]
    # three steps: two casts a layer, less the down product's input cast (SwiGLU's result is BF16 already)
    assert runs["bf16"]["cpy"] - runs["f32"]["cpy"] == 3 * (2 - 1) * CUT_LAYERS
    assert runs["bf16"]["buf"] < runs["f32"]["buf"]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
def test_adamw_four_values_a_thread_trains_the_same_steps(f32_path, request):
    """Patch 0087 (CUDA): OPT_STEP_ADAMW moves four values a thread (16-byte loads and stores of the weight, its
    gradient and both moments) where a tensor is 4 * k floats, 16-byte aligned; GGML_CUDA_ADAMW_VEC=0: one a thread.
    Each value's arithmetic is the same, so three full fine-tuning steps (every weight of SmolLM2's 4-layer cut
    trained, AdamW) give the same losses bit for bit, each run its own process. A moment swapped, a value left out
    or updated twice in the vector kernel would change the second and third losses."""
    runs = {}
    for vec in ("1", "0"):
        env = {**os.environ, "GGML_CUDA_ADAMW_VEC": vec, "GGML_CUDA_FA_BACK_DETERMINISTIC": "1"}
        p = run_python(_cast_steps("model", f32_path, request), timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        runs[vec] = json.loads(p.stdout.strip().splitlines()[-1])["losses"]
    print(runs)
    assert runs["1"] == runs["0"]
    assert runs["1"][2] < runs["1"][0]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
def test_swiglu_backward_four_elements_a_thread_trains_the_same_steps(f32_path):
    """Patch 0089 (CUDA): the fused SwiGLU backward of a mixed-precision step (dy in F32, the gate and up activations
    in BF16, dg and du written in F32 and as BF16 copies) moves four elements a thread where the tensors allow (the
    4-layer cut's 1536 x 512 at batch 2) and says so once at INFO; GGML_CUDA_GLU_VEC=0: one a thread (and patch
    0080's forward gated kernel one value a thread, which gives the same bits too), no such line. Each element's
    arithmetic is the same, so three full fine-tuning steps (AdamW) give the same losses bit for bit, each run its
    own process with the flash backward in its fixed order. An element's gate read from its neighbour, a copy
    written for the wrong tensor or a tail left out would change the second and third losses."""
    _assert_switch_trains_the_same_steps(
        f32_path, "model", "GGML_CUDA_GLU_VEC", "SwiGLU backward four elements a thread"
    )


def _run_each_setting(code: str, var: str, settings: tuple[str, ...]) -> dict[str, tuple]:
    """code run once per setting of the environment variable var ("default": unset), each its own process with
    the flash backward in its fixed order: {setting: (the JSON its last stdout line holds, its stderr)}."""
    out = {}
    for value in settings:
        env = {k: v for k, v in os.environ.items() if k != var}
        env["GGML_CUDA_FA_BACK_DETERMINISTIC"] = "1"
        if value != "default":
            env[var] = value
        p = run_python(code, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        out[value] = (json.loads(p.stdout.strip().splitlines()[-1]), p.stderr)
    return out


def _assert_switch_trains_the_same_steps(f32_path, params: str, var: str, line: str) -> None:
    """Three AdamW steps (lr 1e-3, _FUSE_STEPS) with var=1 and var=0, each its own process with the flash backward in
    its fixed order: the same losses bit for bit, line logged with 1 only, and the loss going down."""
    code = _FUSE_STEPS.replace("sys.argv[1]", repr(str(f32_path))).replace("sys.argv[2]", repr(params))
    code = code.replace("sys.argv[3]", repr("adamw")).replace("float(sys.argv[4])", "1e-3")
    out = _run_each_setting(code, var, ("1", "0"))
    losses = {k: r for k, (r, _) in out.items()}
    logged = {k: line in err for k, (_, err) in out.items()}
    print(losses, logged)
    assert logged == {"1": True, "0": False}
    assert losses["1"] == losses["0"]
    assert losses["1"][2] < losses["1"][0]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
def test_bf16_copies_of_frozen_weights_train_the_same_lora_steps(f32_path):
    """Patch 0070 (CUDA, by default; LLAMA_OPT_BF16_FROZEN=0: off): LoRA over an F32 model converts each frozen
    weight matrix to BF16 once, at llama_opt_init, with the converter the BF16 products use on every step (the
    forward product and the backward pass's dX product each converted it before), and the training graphs
    multiply the copies: three LoRA r8 steps give the same losses bit for bit as without them (each run its
    own process, the flash backward in fixed order), and llama_opt_init logs one copy per attention and FFN
    matrix of the 4-layer cut (7 each) and the output matrix (the tied token_embd, frozen in LoRA)."""
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + _CAST_STEPS.replace(
        "sys.argv[1]", repr(str(f32_path))
    ).replace("sys.argv[2]", repr("lora"))
    out = _run_each_setting(code, "LLAMA_OPT_BF16_FROZEN", ("default", "0"))
    runs = {k: r for k, (r, _) in out.items()}
    logs = {k: re.findall(r"BF16 copies of (\d+) frozen weights", err) for k, (_, err) in out.items()}
    print(runs, logs)
    assert logs == {"default": [str(7 * CUT_LAYERS + 1)], "0": []}
    assert runs["default"]["losses"] == runs["0"]["losses"]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
def test_bf16_copies_reused_within_a_step_change_nothing(f32_path):
    """Patch 0057 (CUDA): the BF16 products of a mixed-precision step convert an activation once for the
    products that read it one after another (the Q/K/V products of one input, a MUL_MAT's two backward
    OUT_PRODs of one gradient); the copy is the conversion's own result, so four steps (bf16, flash attention,
    fully offloaded) give the same losses, bit for bit, as with every conversion made anew
    (GGML_CUDA_BF16_REUSE=0, each run its own process: the variable is read once; the flash attention
    backward in its fixed order, GGML_CUDA_FA_BACK_DETERMINISTIC=1). A copy reused after its source was
    overwritten, or across steps, would change them. Patch 0083: the SwiGLU backward writes the BF16 copies of
    its dG and dU itself (for the gate and up products after it; none with GGML_CUDA_BF16_REUSE=0): a copy
    rounded otherwise, or kept for the wrong tensor, would change them too."""
    losses = {}
    for reuse in ("1", "0"):
        env = {**os.environ, "GGML_CUDA_BF16_REUSE": reuse, "GGML_CUDA_FA_BACK_DETERMINISTIC": "1"}
        p = run_python(_STEPS.replace("sys.argv[1]", repr(str(f32_path))), timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        losses[reuse] = p.stdout.strip().splitlines()[-1]
    print(losses)
    assert losses["1"] == losses["0"]


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
@pytest.mark.parametrize("params", ["model", "lora"])
def test_cross_entropy_backward_writes_the_bf16_copy_the_products_read(f32_path, params):
    """Patch 0091 (CUDA): in a mixed-precision step the cross-entropy's backward writes the logits' gradient in BF16
    beside its F32 result (one of the BF16 copy slots, over their 256 MiB limit where it must be), and the output
    layer's backward products (dX, and dW in a full fine-tune) read that copy instead of converting the gradient each;
    it says so once at INFO. GGML_CUDA_CE_BF16=0: the products convert it, no such line. The copy is rounded as the
    converter rounds, so three steps (AdamW) give the same losses bit for bit, each run its own process with the
    flash backward in its fixed order; a copy of another row, a stale copy of the last step or a product that missed
    it and read the slot's other contents would change the second and third."""
    _assert_switch_trains_the_same_steps(
        f32_path, params, "GGML_CUDA_CE_BF16", "the gradient's BF16 copy written with it"
    )


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
@pytest.mark.parametrize(
    ("var", "line"),
    [
        ("GGML_CUDA_FA_KEEP_BF16", "Q, K and V in BF16 as the forward kept them"),
        ("GGML_CUDA_FA_FWD_Q_F32", "Q converted to BF16 by the kernel as it loads it"),
        ("GGML_CUDA_FA_TILES_ONCE", "the mask's tile classes copied from the first layer that read it"),
    ],
)
def test_flash_attention_forward_keeps_what_its_backward_and_next_layers_read(f32_path, var, line):
    """Patch 0092 (CUDA), each switch on by default and logged once at INFO, 0 turning it off (no such line): the
    training forward keeps the BF16 Q, K and V its kernel read past its result, and the backward reads them rather
    than converting Q, K and V again (GGML_CUDA_FA_KEEP_BF16); the forward kernel reads Q's F32 rows and rounds them
    itself (GGML_CUDA_FA_FWD_Q_F32); the first layer's forward classifies the mask's tiles and the three layers after
    it copy its classes (GGML_CUDA_FA_TILES_ONCE). Each gives the values the conversions and the classification gave,
    so three full fine-tuning steps (AdamW, the 4-layer cut, two 256-token windows) give the same losses bit for bit,
    each run its own process with the flash backward in its fixed order. A backward that read another layer's or the
    last step's Q, K or V, a row rounded otherwise or left out, or tile classes copied from a stale or another mask
    would change the second and third losses."""
    _assert_switch_trains_the_same_steps(f32_path, "model", var, line)


_CLASS_STEPS = """
import json, logging, sys, numpy as np, llamabind
from llamabind import train
logging.basicConfig(level=logging.INFO)
w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
lab = w[:, 1:].copy()
lab[0, :100] = -1  # masked positions: fewer logits rows than tokens
with llamabind.Model(sys.argv[1], use_mmap=False) as m:
    with train.Trainer(m, batch_size=2, optimizer="adamw", lr=1e-3) as t:
        steps = [t.step(w) for _ in range(2)] + [t.step(w, lab) for _ in range(2)]
        print(json.dumps(dict(steps=steps, val=t.evaluate(w, lab))))
"""


def test_label_classes_train_the_same_steps_as_one_hot_labels(f32_path):
    """Patch 0090: the training loss's labels are the class of each logits row (ggml_cross_entropy_loss's I32 form,
    one int32 a row set from the host) where the loss's backend takes them (the CPU, CUDA), which ggml-opt says once
    at INFO; LLAMA_OPT_LABEL_CLASSES=0: one-hot rows of n_vocab floats as before, no such line. The backward is the
    same arithmetic in both (softmax, less 1 at the class), so four full fine-tuning steps (AdamW; the last two with
    masked labels, fewer rows than tokens) and a validation pass give the same accuracy and token counts and the
    same losses: bit for bit on the CPU (its forward adds the class's log-probability to zeros), within 1e-6 on a
    GPU (CUDA's forward takes x_c - max directly where the one-hot form sums (x - max) * y while the max moves). A
    label row shifted by one, or a class set for a masked position, would change the accuracy and the later losses."""
    code = _CLASS_STEPS.replace("sys.argv[1]", repr(str(f32_path)))
    out = _run_each_setting(code, "LLAMA_OPT_LABEL_CLASSES", ("default", "0"))
    runs = {k: r for k, (r, _) in out.items()}
    logged = {k: "the cross-entropy's labels: the class of each row (I32)" in err for k, (_, err) in out.items()}
    print(runs, logged)
    assert logged == {"default": True, "0": False}
    a, b = runs["default"], runs["0"]
    assert [s[1:] for s in a["steps"]] == [s[1:] for s in b["steps"]] and a["val"][1:] == b["val"][1:]
    assert a["steps"][2][2] == 2 * 256 - 100  # the masked step's labelled tokens
    losses = lambda r: [s[0] for s in r["steps"]] + [r["val"][0]]  # noqa: E731
    if GPU_BUILD:
        np.testing.assert_allclose(losses(a), losses(b), rtol=1e-6)
    else:
        assert losses(a) == losses(b)
    assert a["steps"][3][0] < a["steps"][2][0]  # it trains (the first AdamW step at lr 1e-3 overshoots)


def test_training_frees_the_kv_cache_it_does_not_read(f32_path):
    """Patch 0103: the training graph's attention reads the K/V of its ubatch (patch 0031), so llama_opt_init frees
    the context's KV cache buffers, which llama.cpp allocated at creation ("KV buffer size = N MiB"), and says so at
    INFO with the same size; LLAMA_OPT_KV_RELEASE=0 keeps them (no such line). The graphs are the same, so four full
    fine-tuning steps (AdamW, two with masked labels) and a validation pass give the same losses and counts, bit
    for bit on the CPU (within 1e-6 on a GPU); a graph that read the freed K/V would read no data (NULL) or, were
    the buffers kept in another's place, other values."""
    code = _CLASS_STEPS.replace("sys.argv[1]", repr(str(f32_path)))
    out = _run_each_setting(code, "LLAMA_OPT_KV_RELEASE", ("default", "0"))
    runs = {k: r for k, (r, _) in out.items()}

    def mib(err, pattern):
        return sum(float(x) for x in re.findall(pattern, err))

    kv = {k: mib(err, r"KV buffer size = +([0-9.]+) MiB") for k, (_, err) in out.items()}
    freed = {k: mib(err, r"the KV cache's buffers released \(([0-9.]+) MiB\)") for k, (_, err) in out.items()}
    print(runs, kv, freed)
    assert kv["default"] > 0 and kv["default"] == kv["0"]
    assert freed == {"default": pytest.approx(kv["default"], abs=0.02), "0": 0}
    a, b = runs["default"], runs["0"]
    assert [s[1:] for s in a["steps"]] == [s[1:] for s in b["steps"]] and a["val"][1:] == b["val"][1:]
    losses = lambda r: [s[0] for s in r["steps"]] + [r["val"][0]]  # noqa: E731
    if GPU_BUILD:
        np.testing.assert_allclose(losses(a), losses(b), rtol=1e-6)
    else:
        assert losses(a) == losses(b)
    assert a["steps"][3][0] < a["steps"][2][0]


def test_a_training_context_without_its_kv_data_refuses_state_io(f32_path, tmp_path):
    """Patch 0103: once llama_opt_init has freed a training context's KV buffers, saving its state is a clear
    error naming why (bytes: LlamaError; a file: ValueError; the cache's state_write throws, llama_state_* return
    0 or false) and restoring one a ValueError, the cache cleared (a no-op on the empty buffers); the interpreter
    does not abort, and the context still trains afterwards."""
    w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
    with llamabind.Model(f32_path, use_mmap=False, n_threads=2) as m:
        with train.Trainer(m, batch_size=2, optimizer="sgd", lr=1e-3, n_threads=2) as t:
            first = t.step(w)[0]
            with pytest.raises(llamabind.LlamaError, match="(?s)llama_state_get_data failed.*holds no K/V data"):
                t.context.save_state()
            with pytest.raises(ValueError, match="(?s)cannot save the state.*holds no K/V data"):
                t.context.save_state_file(tmp_path / "state.bin")
            with m.context(n_ctx=512, n_batch=512) as c:
                c.decode(w[0, :8].tolist())
                state = c.save_state()  # a real state of an inference context of the same model
            with pytest.raises(ValueError, match="(?s)not a state of this context.*holds no K/V data"):
                t.context.load_state(state)
            assert np.isfinite(t.step(w)[0]) and first > 0


def _chunked_run(path, chunk, **kw) -> tuple[list, list, dict, int]:
    """Three AdamW steps (lr 1e-3; the last two with 100 positions masked: 412 logits rows of 512) and a validation
    pass with loss_chunk_tokens=chunk: the steps, the validation, {(phase, op): nodes} of the profile, the compute
    buffer's bytes."""
    w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
    lab = w[:, 1:].copy()
    lab[0, :100] = -1
    with llamabind.Model(path, use_mmap=False, n_threads=2) as m:
        kw = dict(batch_size=2, lr=1e-3, loss_chunk_tokens=chunk, profile=True, n_threads=2, **kw)
        with train.Trainer(m, **kw) as t:
            steps = [t.step(w)] + [t.step(w, lab) for _ in range(2)]
            val = t.evaluate(w, lab)
            ops_of = {(r["phase"], r["op"]): r["nodes"] for r in t.profile()}
            return steps, val, ops_of, t.stats()["compute_buffer_bytes"]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_cross_entropy_trains_the_same_steps_as_the_whole(f32_path, checkpointing):
    """Patch 0098: with loss_chunk_tokens=100 the output product, the cross-entropy and the accuracy run in chunks of
    100 logits rows (6 chunks of the 512 rows, 5 of 412), each chunk's logits recomputed for its backward pass: the
    profile's forward pass has a CROSS_ENTROPY_LOSS, ARGMAX and COUNT_EQUAL per chunk (6 + 5 + 5 steps, 5 for the
    validation) and its backward pass a product per chunk (the recomputed logits; the whole has none there: its
    backward products are OUT_PRODs), and the compute buffer is smaller (the 512 x 49,152 logits and their gradient
    are not kept whole). SmolLM2's tied embedding (the output weight trained through both its uses), full fine-tune,
    with and without gradient checkpointing (patch 0066's checkpoints and the chunks recomputed in one graph). Three
    steps and the validation give the same labelled-token counts, the same accuracies (on a GPU the first step's, the
    later ones within 3 of the 412 rows: a near tie of BF16 logits may go either way) and the same losses to rtol
    2e-6 on the CPU, in F32 (measured 1e-7: the chunked mean sums the rows per chunk, then the chunks' shares, and
    the weight's gradient is summed over chunks; the same kernels otherwise), 2e-3 on a GPU (BF16 products: AdamW's
    normalized steps carry the sums' roundings into weights that BF16 rounds; the flash backward's atomics). A
    chunk's rows taken from another chunk, a share not scaled by its rows, or a gradient of one chunk left out would
    change the losses by far more (the masked steps' chunks hold different numbers of labelled rows).
    loss_chunk_tokens=None (automatic, run without checkpointing) leaves these 100 MB of logits whole: the same nodes
    as 0."""
    whole = _chunked_run(f32_path, 0, gradient_checkpointing=checkpointing)
    chunked = _chunked_run(f32_path, 100, gradient_checkpointing=checkpointing)
    print(whole[:2], chunked[:2], whole[3], chunked[3])
    if not checkpointing:
        assert _chunked_run(f32_path, None)[2] == whole[2]
    assert [s[2] for s in chunked[0]] == [s[2] for s in whole[0]] == [512, 412, 412]
    accuracies = lambda r: [s[1] for s in r[0]] + [r[1][1]]  # noqa: E731
    assert chunked[1][2] == whole[1][2] and accuracies(chunked)[0] == accuracies(whole)[0]
    np.testing.assert_allclose(accuracies(chunked), accuracies(whole), atol=3 / 412 if GPU_BUILD else 0)
    losses = lambda r: [s[0] for s in r[0]] + [r[1][0]]  # noqa: E731
    np.testing.assert_allclose(losses(chunked), losses(whole), rtol=2e-3 if GPU_BUILD else 2e-6)
    assert whole[0][2][0] < whole[0][1][0]  # it trains
    n_train, n_val = 6 + 5 + 5, 5
    for op in ("CROSS_ENTROPY_LOSS", "ARGMAX", "COUNT_EQUAL"):
        assert chunked[2][("forward", op)] - whole[2][("forward", op)] == n_train + n_val - 4, op  # 4 evals whole
    assert chunked[2][("backward", "CROSS_ENTROPY_LOSS_BACK")] == n_train
    assert chunked[2].get(("backward", "MUL_MAT"), 0) - whole[2].get(("backward", "MUL_MAT"), 0) == n_train
    assert chunked[3] < whole[3]


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (-(2**40), ValueError), (1.5, TypeError), ("8", TypeError)]
)
def test_loss_chunk_tokens_out_of_range_is_refused(value, error):
    """loss_chunk_tokens: None, 0 or a positive int; others raise naming it (before any model work)."""
    with pytest.raises(error, match="loss_chunk_tokens"):
        train.TrainingArgs.of(loss_chunk_tokens=value)


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
def test_cross_entropy_forward_keeps_the_argmax_of_the_accuracy(f32_path):
    """Patch 0093 (CUDA): the cross-entropy forward finds each logits row's argmax as it reads the row (the last
    maximum, as ARGMAX's kernel), and the ARGMAX that ggml-opt counts the accuracy with copies it rather than reading
    the logits again; it says so once at INFO. GGML_CUDA_CE_ARGMAX=0: ARGMAX's own kernel, no such line. Four steps
    (the last two with masked labels) and a validation pass give the same accuracies and the same losses bit for bit,
    each run its own process; the accuracy is not zero here (the windows repeat), so an argmax of the wrong row or
    column, or one kept from the last step, would change it."""
    code = _CLASS_STEPS.replace("sys.argv[1]", repr(str(f32_path)))
    out = _run_each_setting(code, "GGML_CUDA_CE_ARGMAX", ("default", "0"))
    runs = {k: r for k, (r, _) in out.items()}
    logged = {k: "the argmax the cross-entropy computed" in err for k, (_, err) in out.items()}
    print(runs, logged)
    assert logged == {"default": True, "0": False}
    assert runs["default"] == runs["0"]
    assert max(s[1] for s in runs["default"]["steps"]) > 0.0


_FUSE_STEPS = """
import json, logging, sys, tempfile, numpy as np, llamabind
from pathlib import Path
from llamabind import train
logging.basicConfig(level=logging.INFO)
w = np.array([np.arange(257) % 200 + 3, np.arange(257) % 100 + 7], np.int32)
with llamabind.Model(sys.argv[1], use_mmap=False) as m:
    kw = {}
    if sys.argv[2] == "lora":
        path = Path(tempfile.mkdtemp()) / "init.gguf"
        train.lora_init(m, path, 8, 16.0, ("attn_q", "attn_v"), 0)
        kw = dict(params="lora", adapter=m.load_lora(path))
    with train.Trainer(m, batch_size=2, optimizer=sys.argv[3], lr=float(sys.argv[4]), **kw) as t:
        print(json.dumps([t.step(w)[0] for _ in range(3)]))
"""


_FUSIONS = {  # ggml-cuda's training fusions with their own switch: the variable, and the lines logged when they run
    "gemm_add": ("GGML_CUDA_FUSE_GEMM_ADD", [r"\((?:MUL_MAT|OUT_PROD)\) added to .+ in place by cuBLAS"]),
    "norm_back": ("GGML_CUDA_FUSE_NORM_BACK", [r"MUL, RMS_NORM_BACK and ADD of .+ in one pass"]),
    # a full fine-tune's norms: the weight's gradient too (patch 0086), with the residual's ADD and without (the
    # output norm)
    "norm_back_w": (
        "GGML_CUDA_FUSE_NORM_BACK",
        [r"MUL, MUL, REPEAT_BACK, RMS_NORM_BACK and ADD of .+ in one pass", r"MUL, MUL, REPEAT_BACK, RMS_NORM_BACK of"],
    ),
}


@pytest.mark.skipif(not GPU_BUILD, reason=gpu_skip_reason())
@pytest.mark.parametrize(
    "fusion,params", [("gemm_add", "model"), ("gemm_add", "lora"), ("norm_back", "lora"), ("norm_back_w", "model")]
)
def test_training_fusions_train_as_before(f32_path, params, fusion):
    """Patch 0083 (CUDA), gemm_add: a BF16 product followed by the ADD that adds it in place to another tensor (an
    input's gradient summed over its Q, K, V and LoRA A products, over the FFN's gate and up; LoRA's B product
    added to the frozen weight's) runs as one cuBLAS call that adds the product as it writes it (beta = 1), the
    product's F32 result never written. Also patch 0083, norm_back: the MUL by the norm's weight, RMS_NORM_BACK and the
    ADD of the residual's gradient run as one pass over the rows (LoRA: a full fine-tune has the norm weight's own
    gradient, MUL and REPEAT_BACK, between them); patch 0086, norm_back_w: those five nodes of a full fine-tune (four at
    the output norm, no residual) as one pass and a fixed-order sum of the blocks' column sums for the weight's
    gradient (each form logs its own line). Three steps, each run its own process, the flash backward in its fixed
    order, against the fusion's variable at 0. gemm_add with AdamW, 1e-6 relative (the same sums, each rounded to F32
    once as unfused; cuBLAS may pick another kernel for beta = 1, another order within a dot product). The norm
    fusions sum a row's products (and the weight's column sums) in another order than the unfused kernels, and the
    mixed-precision step rounds the gradients after them to BF16 for its products: a last-bit difference in F32
    flips a value's BF16 rounding (2^-9 relative) here and there, and the next steps carry that. With AdamW (whose
    first steps move an entry by about lr * sign(g) whatever its size) the full fine-tune's second loss differed by
    2.4e-4 relative on an H200; they train with SGD (lr 1e-3 full, 1e-2 LoRA), where the H200 gave 1.0e-4 (full)
    and 2.0e-4 (LoRA) at the second step (bench/results/h200-2026-11-29-norm-w): 1e-3 relative is 5x that. A wrong
    row, residual or weight gradient is caught to 1e-10 NMSE against float64 by tests/test_ops_backends.py (the
    fused kernels' own values); here the fused path runs in a training graph and trains as the unfused one does.
    ggml-cuda logs the fusions in the default run only."""
    var, logged = _FUSIONS[fusion]
    opt = ("adamw", "1e-3") if fusion == "gemm_add" else ("sgd", "1e-3" if params == "model" else "1e-2")
    code = _FUSE_STEPS.replace("sys.argv[1]", repr(str(f32_path))).replace("sys.argv[2]", repr(params))
    code = code.replace("sys.argv[3]", repr(opt[0])).replace("float(sys.argv[4])", opt[1])
    losses, logs = {}, {}
    for on in ("1", "0"):
        env = {**os.environ, var: on, "GGML_CUDA_FA_BACK_DETERMINISTIC": "1"}
        p = run_python(code, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        losses[on] = json.loads(p.stdout.strip().splitlines()[-1])
        logs[on] = [re.findall(r, p.stderr) for r in logged]
    print(losses, logs)
    assert all(logs["1"]) and not any(logs["0"])
    np.testing.assert_allclose(losses["1"], losses["0"], rtol=1e-6 if fusion == "gemm_add" else 1e-3)
    assert losses["1"][2] < losses["1"][0]


def test_forward_as_training_drops_its_gradients(f32_path, wins):
    """Patch 0095: with ggml_opt_set_forward_as_training, a forward-only evaluation between optimizer steps runs the
    training graph (its backward pass computed, then dropped): the evaluation's loss is the step's own forward loss
    (on this CPU bit for bit, as the plain forward graph's), and the steps around such evaluations, with gradient
    accumulation over two micro-batches, take the same weights as without them, bit for bit (a gradient it left in
    the accumulators, or a moved accumulation period, would change the next step)."""
    runs = []
    for on in (False, True):
        with llamabind.Model(f32_path, use_mmap=False, n_threads=2) as m:
            with train.Trainer(m, batch_size=4, grad_accum=2, optimizer="adamw", lr=1e-4, n_threads=2) as t:
                t.optimizer.forward_as_training(on)
                got = [t.evaluate(wins[2:4])[0]]
                for _ in range(2):
                    got.append(t.step(wins)[0])
                    got.append(t.evaluate(wins[2:4])[0])
                runs.append(got)
    print(runs)
    assert runs[0] == runs[1]
    assert runs[0][2] != runs[0][0]  # the evaluation sees the steps' updates
