"""Issue 56 item 3: products of F32 tensors in BF16 with F32 accumulation where the backend has them (patch 0055
on CPUs with AVX512_BF16, patch 0051 on CUDA), as mixed-precision training runs them: against float64, and the
training step at precision "bf16" against "f32"."""

from __future__ import annotations

import numpy as np
import pytest

import llamabind
from llamabind import ops, train

GPUS = [d["name"] for d in llamabind.devices() if d["type"] == "gpu"]
CPU_BF16 = "AVX512_BF16 = 1" in llamabind.build_info()["system_info"]

# NMSE of a float32 product of random normal operands against float64: ~1e-14; of a BF16 product (each operand
# rounded to 8 significant bits, relative error up to 2^-9, 2^-9/sqrt(3) on average): 2 x (2^-9)^2 / 3 ~ 2.5e-6
F32_LIMIT, BF16_LOW, BF16_HIGH = 1e-9, 5e-7, 2e-5


def _nmse(got, want) -> float:
    return float(np.sum((np.asarray(got, np.float64) - want) ** 2) / np.sum(want**2))


@pytest.mark.parametrize("backend", ["cpu", *GPUS])
# (40, 8288, 100): K over GGML_CPU_BF16_KC (4096) runs in three chunks; (64, 96, 40): tiles of 32 x 12 outputs cut
# at both edges (the 96 x 40 gradient of b, contracting over m = 64)
@pytest.mark.parametrize("m,k,n", [(64, 256, 48), (96, 512, 64), (64, 100, 40), (40, 8288, 100), (64, 96, 40)], ids=str)
def test_cpu_bf16_products_against_float64(backend, m, k, n):
    """ops.mul_mat and ops.out_prod with precision="bf16" (ggml_prec_set_src on both sources) and mul_mat's
    gradients (its backward OUT_PRODs inherit the hint: a's contracts over n, b's over m) against float64. On
    a CPU with AVX512_BF16, a product over a length tinyBLAS's BF16 kernel takes (a multiple of 32) must show
    BF16's rounding (NMSE in [5e-7, 2e-5]: the path ran), any other F32's (< 1e-9: the F32 kernels kept); on a
    CPU without it every product is F32's; a GPU's within BF16's (patch 0051 decides which take BF16 there)."""
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    w = rng.standard_normal((m, n)).astype(np.float32)
    a64, b64, w64 = (x.astype(np.float64) for x in (a, b, w))
    grads = ops.grad(lambda x, y: ops.sum(ops.mul(ops.mul_mat(x, y, precision="bf16"), w)), argnums=(0, 1),
                     backend=backend)(a, b)  # fmt: skip
    results = {  # name: (llamabind's, float64's, the length the product contracts)
        "mul_mat": (ops.mul_mat(a, b, precision="bf16", backend=backend), a64 @ b64, k),
        "out_prod": (ops.out_prod(a.T.copy(), b, precision="bf16", backend=backend), a64 @ b64, k),
        "grad a": (grads[0], w64 @ b64.T, n),
        "grad b": (grads[1], a64.T @ w64, m),
    }
    for name, (got, want, length) in results.items():
        e = _nmse(got, want)
        print(f"{backend} {name} {m}x{k}x{n}: NMSE {e:.2e}")
        if backend != "cpu":
            assert e < BF16_HIGH, (name, e)
        elif CPU_BF16 and length % 32 == 0:
            assert BF16_LOW < e < BF16_HIGH, (name, e)
        else:
            assert e < F32_LIMIT, (name, e)


def test_precision_bf16_refused_where_it_does_not_apply():
    q = ops.Blocks(ops.quantize(np.ones((32, 64), np.float32), "q8_0"), "q8_0", (32, 64))
    with pytest.raises(ValueError, match="precision='bf16' is for float32"):
        ops.mul_mat(q, np.ones((64, 2), np.float32), precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.mul_mat(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), precision="tf32")


@pytest.fixture(scope="module")
def text(vendor_dir):
    """Real text that ships with the pinned tree: its build documentation."""
    return (vendor_dir / "docs" / "build.md").read_text(encoding="utf-8")


def _tensors(path, names):
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: np.array(t.data, np.float64) for t in r.tensors if t.name in names}


def test_training_step_in_bf16_against_f32(smollm2_f32_cut, text, tmp_path):
    """A full fine-tune's SGD step on SmolLM2's F32 blocks (one window of 256 tokens) at precision "bf16" against
    "f32": the loss within 1e-2 relative and the weight update (the gradient) within NMSE 1e-3 (BF16 operands
    through every product and its backward, F32 accumulation and master weights); on a CPU without AVX512_BF16
    both run F32 and agree to float32 rounding (NMSE < 1e-9, losses within 1e-6)."""
    names = ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight")
    before = _tensors(smollm2_f32_cut, names)
    steps = {}
    for precision in ("f32", "bf16"):
        with llamabind.Model(smollm2_f32_cut, n_threads=2, use_mmap=False) as m:
            window = np.asarray(m.tokenize(text, add_special=True)[:257], np.int32)[None]
            with train.Trainer(m, ctx_size=256, optimizer="sgd", lr=1.0, precision=precision, n_threads=2) as t:
                loss = t.step(window)[0]
            m.save(tmp_path / f"{precision}.gguf")
        after = _tensors(tmp_path / f"{precision}.gguf", names)
        steps[precision] = (loss, {n: before[n] - after[n] for n in names})
    (l32, d32), (l16, d16) = steps["f32"], steps["bf16"]
    errs = {n: _nmse(d16[n], d32[n]) for n in names}
    print(f"loss f32 {l32:.6f}, bf16 {l16:.6f}; update NMSE {errs}")
    if CPU_BF16 or GPUS:
        assert abs(l16 - l32) <= 1e-2 * l32 and max(errs.values()) < 1e-3
        assert not CPU_BF16 or max(errs.values()) > 1e-9  # the BF16 products ran
    else:
        assert abs(l16 - l32) <= 1e-6 * l32 and max(errs.values()) < 1e-9
