"""Neural-network ops: normalization, softmax, RoPE, attention, sorting, generators."""

from __future__ import annotations

import numpy as np

from .eager import apply
from .graph import F16, F32, I32, Graph, Tensor, as_float, as_int, expect, expect_dtype, resolve_device, shape_to_ne

# ---- normalization over the last axis


def _norm_like(name: str):
    def build(g: Graph, a: Tensor, eps: float) -> Tensor:
        expect_dtype(name, "a", a, (F32,), g.device)
        return g.op(name, [a], floats=[eps], shape=a.shape)

    return build


_norm, _rms_norm, _l2_norm = _norm_like("norm"), _norm_like("rms_norm"), _norm_like("l2_norm")


def _eps(eps) -> float:
    e = as_float(eps, "eps")
    expect(e >= 0, f"eps must be >= 0; got {e}")
    return e


def norm(a, eps: float = 1e-5, *, backend: str | None = None):
    """``(a - mean) / sqrt(var + eps)`` over the last axis (wraps ggml_norm). a: float32."""
    return apply(_norm, (a,), {"eps": _eps(eps)}, backend)


def rms_norm(a, eps: float = 1e-5, *, backend: str | None = None):
    """``a / sqrt(mean(a**2) + eps)`` over the last axis (wraps ggml_rms_norm). a: float32."""
    return apply(_rms_norm, (a,), {"eps": _eps(eps)}, backend)


def l2_norm(a, eps: float = 1e-12, *, backend: str | None = None):
    """``a / max(||a||_2, eps)`` over the last axis (wraps ggml_l2_norm). a: float32."""
    return apply(_l2_norm, (a,), {"eps": _eps(eps)}, backend)


def _rms_norm_back(g: Graph, dz: Tensor, x: Tensor, eps: float) -> Tensor:
    for n, t in (("dz", dz), ("x", x)):
        expect_dtype("rms_norm_back", n, t, (F32,), g.device)
    expect(dz.shape == x.shape, f"rms_norm_back: dz {dz.shape} and x {x.shape} must have the same shape")
    return g.op("rms_norm_back", [dz, x], floats=[eps], shape=x.shape)


def rms_norm_back(dz, x, eps: float = 1e-5, *, backend: str | None = None):
    """Gradient of rms_norm at x for the output gradient dz (wraps ggml_rms_norm_back).
    dz, x: float32, same shape; the last axis is normalized; eps as rms_norm's."""
    return apply(_rms_norm_back, (dz, x), {"eps": _eps(eps)}, backend)


def _group_norm(g: Graph, a: Tensor, n_groups: int, eps: float) -> Tensor:
    expect_dtype("group_norm", "a", a, (F32,), g.device)
    expect(a.ndim >= 3, f"group_norm: a must be (N, C, H, W) or (C, H, W); got shape {a.shape}")
    c = a.shape[-3]
    expect(1 <= n_groups <= c and c % n_groups == 0, f"group_norm: n_groups ({n_groups}) must divide C ({c})")
    return g.op("group_norm", [a], ints=[n_groups], floats=[eps], shape=a.shape)


def group_norm(a, n_groups: int, eps: float = 1e-6, *, backend: str | None = None):
    """Normalize groups of channels: a (N, C, H, W) or (C, H, W), C split into n_groups, each
    normalized over its channels and H, W (wraps ggml_group_norm), ``eps`` added to the variance. float32."""
    return apply(_group_norm, (a,), {"n_groups": as_int(n_groups, "n_groups", 1), "eps": _eps(eps)}, backend)


# ---- softmax


def _soft_max(g: Graph, a: Tensor, mask: Tensor | None, scale: float, max_bias: float) -> Tensor:
    expect_dtype("soft_max", "a", a, (F32,), g.device)
    expect(a.ndim >= 1, "soft_max: a must have at least one axis")
    if mask is not None:
        expect_dtype("soft_max", "mask", mask, (F32, F16), g.device)
        expect(mask.ndim <= a.ndim, f"soft_max: mask {mask.shape} has more axes than a {a.shape}")
        ms = (1,) * (a.ndim - mask.ndim) + mask.shape
        expect(ms[-1] == a.shape[-1], f"soft_max: mask's last axis ({ms[-1]}) must equal a's ({a.shape[-1]})")
        if a.ndim >= 2:
            expect(ms[-2] == a.shape[-2], f"soft_max: mask rows ({ms[-2]}) must equal a's ({a.shape[-2]})")
        for i in range(a.ndim - 2):
            expect(a.shape[i] % ms[i] == 0, f"soft_max: mask axis {i} ({ms[i]}) must divide a's ({a.shape[i]})")
    if max_bias > 0:
        expect(a.ndim >= 3, "soft_max: max_bias (ALiBi) needs a with a head axis: (..., n_head, rows, cols)")
    return g.op("soft_max_ext", [a, mask], floats=[scale, max_bias], shape=a.shape)


def soft_max(a, mask=None, scale: float = 1.0, max_bias: float = 0.0, *, backend: str | None = None):
    """``softmax(a * scale + mask + alibi)`` over the last axis (wraps ggml_soft_max_ext).

    a: float32 (..., rows, cols). mask: float32/float16 broadcastable to a (same last two axes),
    added before the softmax (use -inf to mask). max_bias > 0 adds ALiBi slopes per head
    (axis -3). Returns float32 of a's shape."""
    mb = as_float(max_bias, "max_bias")
    expect(mb >= 0, f"max_bias must be >= 0; got {mb}")
    return apply(_soft_max, (a, mask), {"scale": as_float(scale, "scale"), "max_bias": mb}, backend)


def _soft_max_back(g: Graph, dy: Tensor, y: Tensor, scale: float) -> Tensor:
    for n, t in (("dy", dy), ("y", y)):
        expect_dtype("soft_max_back", n, t, (F32,), g.device)
    expect(dy.shape == y.shape, f"soft_max_back: dy {dy.shape} and y {y.shape} must have the same shape")
    return g.op("soft_max_ext_back", [dy, y], floats=[scale, 0.0], shape=y.shape)


def soft_max_back(dy, y, scale: float = 1.0, *, backend: str | None = None):
    """Gradient of softmax: ``scale * y * (dy - sum(y * dy))`` over the last axis, y the softmax
    output (wraps ggml_soft_max_ext_back). dy, y: float32, same shape."""
    return apply(_soft_max_back, (dy, y), {"scale": as_float(scale, "scale")}, backend)


def _labels_node(op: str, g: Graph, logits: Tensor, labels: Tensor) -> Tensor:
    """The labels as ggml takes them: float32 of logits' shape, or int32 classes of shape logits.shape[:-1]
    reshaped to (..., 1) (ggml_cross_entropy_loss's class form: ggml's I32 [1, rows])."""
    expect_dtype(op, "logits", logits, (F32,), g.device)
    expect_dtype(op, "labels", labels, (F32, I32), g.device)
    expect(logits.ndim >= 1, f"{op}: logits must have at least one axis (..., classes); got {logits.shape}")
    if labels.dtype == I32:
        expect(
            labels.shape == logits.shape[:-1],
            f"{op}: int32 labels (the class of each row) must have shape logits.shape[:-1] = {logits.shape[:-1]};"
            f" got {labels.shape}",
        )
        shape = (*labels.shape, 1)
        return g.op("reshape_4d", [labels], ints=shape_to_ne(shape), shape=shape)
    expect(
        logits.shape == labels.shape,
        f"{op}: logits {logits.shape} and float32 labels {labels.shape} must have one shape (..., classes)",
    )
    return labels


def _cross_entropy_loss(g: Graph, logits: Tensor, labels: Tensor) -> Tensor:
    y = _labels_node("cross_entropy_loss", g, logits, labels)
    return g.op("cross_entropy_loss", [logits, y], shape=())


def cross_entropy_loss(logits, labels, *, backend: str | None = None):
    """Cross-entropy of ``softmax(logits)`` against ``labels``, averaged over the rows:
    ``-sum(labels * log_softmax(logits)) / rows``, the softmax over the last axis (wraps
    ggml_cross_entropy_loss, the loss llama.cpp's training minimizes).

    logits: float32 (..., classes). labels: float32 of logits' shape, each row a distribution over the
    classes; or int32 of shape logits.shape[:-1], the class of each row (as PyTorch's class-index targets:
    the same loss as its one-hot rows, without them; a class outside [0, classes) counts as a row of
    zeros). Returns float32 of shape (). Differentiable with respect to logits
    (:func:`cross_entropy_loss_back`); a gradient with respect to labels raises TypeError. ValueError for
    mismatched shapes, TypeError for other dtypes."""
    return apply(_cross_entropy_loss, (logits, labels), {}, backend)


def _cross_entropy_loss_back(g: Graph, grad: Tensor, logits: Tensor, labels: Tensor) -> Tensor:
    expect_dtype("cross_entropy_loss_back", "grad", grad, (F32,), g.device)
    expect(
        int(np.prod(grad.shape)) == 1,
        f"cross_entropy_loss_back: grad must hold one value (the loss's gradient); got {grad.shape}",
    )
    y = _labels_node("cross_entropy_loss_back", g, logits, labels)
    return g.op("cross_entropy_loss_back", [grad, logits, y], shape=logits.shape)


def cross_entropy_loss_back(grad, logits, labels, *, backend: str | None = None):
    """Gradient of :func:`cross_entropy_loss` with respect to the logits:
    ``(softmax(logits) - labels) * grad / rows`` (wraps ggml_cross_entropy_loss_back).

    grad: float32 holding one value (the loss's gradient, shape () or (1,)); logits: float32
    (..., classes); labels: as :func:`cross_entropy_loss` takes them (float32 of logits' shape or int32
    classes of shape logits.shape[:-1]). Returns float32 of logits' shape. ValueError for a grad of more
    than one value or mismatched shapes, TypeError for other dtypes."""
    return apply(_cross_entropy_loss_back, (grad, logits, labels), {}, backend)


# ---- rotary position embedding

ROPE_MODES = {"normal": 0, "neox": 2, "mrope": 8, "vision": 24, "imrope": 40}


def _rope_common(
    g: Graph, op: str, x: Tensor, pos: Tensor, ff: Tensor | None, n_dims: int, mode: str, sections
) -> tuple[list, int]:
    expect_dtype(op, "x", x, (F32, F16), g.device)
    expect(mode in ROPE_MODES, f"{op}: mode must be one of {sorted(ROPE_MODES)}; got {mode!r}")
    expect(
        x.ndim in (3, 4),
        f"{op}: x must be (n_tokens, n_head, head_dim) or (batch, n_tokens, n_head, head_dim); got {x.shape}",
    )
    head_dim, n_tokens = x.shape[-1], x.shape[-3]
    expect(0 < n_dims <= head_dim and n_dims % 2 == 0, f"{op}: n_dims must be even and in [2, head_dim={head_dim}]")
    expect_dtype(op, "pos", pos, (I32,), g.device)
    multi = ROPE_MODES[mode] >= 8
    expect(
        pos.ndim == 1 and pos.shape[0] == (4 * n_tokens if multi else n_tokens),
        f"{op}: pos must be int32 of shape ({'4 * ' if multi else ''}n_tokens,) = "
        f"({(4 if multi else 1) * n_tokens},); got {pos.shape}",
    )
    if ff is not None:
        expect_dtype(op, "freq_factors", ff, (F32,), g.device)
        # ggml's CPU cache reads freq_factors[i/2] for every i < head_dim (more than it asserts)
        expect(ff.ndim == 1 and ff.shape[0] >= head_dim // 2, f"{op}: freq_factors must be float32 (>= head_dim/2,)")
    if multi:
        expect(sections is not None and len(sections) == 4, f"{op}: mode {mode!r} needs sections: 4 ints")
        secs = [as_int(s, "sections[i]", 0, 1 << 16) for s in sections]
        expect(any(v > 0 for v in secs[:3]), f"{op}: one of sections[0..2] must be > 0")
        expect(sum(secs) <= head_dim, f"{op}: sum(sections) ({sum(secs)}) must be <= head_dim ({head_dim})")
        if mode == "vision":
            expect(n_dims == head_dim // 2, f"{op}: mode 'vision' needs n_dims == head_dim/2 ({head_dim // 2})")
        return secs, ROPE_MODES[mode]
    expect(sections is None, f"{op}: sections are for the multi modes (mrope, vision, imrope)")
    return [], ROPE_MODES[mode]


def _rope_builder(back: bool):
    def build(
        g: Graph,
        x: Tensor,
        pos: Tensor,
        freq_factors: Tensor | None,
        n_dims: int,
        mode: str,
        sections,
        n_ctx_orig: int,
        freq_base: float,
        freq_scale: float,
        ext_factor: float,
        attn_factor: float,
        beta_fast: float,
        beta_slow: float,
    ) -> Tensor:
        op = "rope_back" if back else "rope"
        secs, m = _rope_common(g, op, x, pos, freq_factors, n_dims, mode, sections)
        floats = [freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow]
        if secs:
            name = "rope_multi_back" if back else "rope_multi"
            return g.op(name, [x, pos, freq_factors], ints=[n_dims, m, n_ctx_orig] + secs, floats=floats, shape=x.shape)
        name = "rope_ext_back" if back else "rope_ext"
        return g.op(name, [x, pos, freq_factors], ints=[n_dims, m, n_ctx_orig], floats=floats, shape=x.shape)

    return build


_rope, _rope_back = _rope_builder(False), _rope_builder(True)


def _rope_params(
    n_dims, mode, sections, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
) -> dict:
    base = as_float(freq_base, "freq_base")
    expect(base > 0, f"freq_base must be > 0; got {base}")
    fs = as_float(freq_scale, "freq_scale")
    expect(fs > 0, f"freq_scale must be > 0; got {fs}")
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str; got {type(mode).__name__}")
    return {
        "n_dims": as_int(n_dims, "n_dims", 2, 1 << 16),
        "mode": mode,
        "sections": None if sections is None else tuple(sections),
        "n_ctx_orig": as_int(n_ctx_orig, "n_ctx_orig", 0),
        "freq_base": base,
        "freq_scale": fs,
        "ext_factor": as_float(ext_factor, "ext_factor"),
        "attn_factor": as_float(attn_factor, "attn_factor"),
        "beta_fast": as_float(beta_fast, "beta_fast"),
        "beta_slow": as_float(beta_slow, "beta_slow"),
    }


def rope(
    x,
    pos,
    n_dims: int,
    mode: str = "normal",
    *,
    freq_base: float = 10000.0,
    freq_scale: float = 1.0,
    n_ctx_orig: int = 0,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    freq_factors=None,
    sections=None,
    backend: str | None = None,
):
    """Rotary position embedding (wraps ggml_rope_ext, or ggml_rope_multi for the multi modes).

    x: float32/float16 (n_tokens, n_head, head_dim) or (batch, n_tokens, n_head, head_dim).
    pos: int32 (n_tokens,) positions; (4 * n_tokens,) for the multi modes.
    n_dims: rotated dimensions (even, <= head_dim). mode: "normal" (adjacent pairs), "neox"
    (halves), or the multi modes "mrope", "vision", "imrope" with ``sections`` (4 ints).
    freq_base, freq_scale: theta_i = pos * freq_scale * freq_base^(-2i/n_dims).
    YaRN: n_ctx_orig, ext_factor (> 0 enables), attn_factor, beta_fast, beta_slow.
    freq_factors: optional float32 (n_dims/2,) dividing each frequency.
    Returns x's shape and dtype."""
    params = _rope_params(
        n_dims, mode, sections, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
    )
    return apply(_rope, (x, pos, freq_factors), params, backend)


def rope_back(
    dy,
    pos,
    n_dims: int,
    mode: str = "normal",
    *,
    freq_base: float = 10000.0,
    freq_scale: float = 1.0,
    n_ctx_orig: int = 0,
    ext_factor: float = 0.0,
    attn_factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    freq_factors=None,
    sections=None,
    backend: str | None = None,
):
    """Gradient of :func:`rope` for the output gradient dy: the inverse rotation (wraps
    ggml_rope_ext_back / ggml_rope_multi_back). pos, n_dims, mode, freq_base, freq_scale, n_ctx_orig,
    ext_factor, attn_factor, beta_fast, beta_slow, freq_factors, sections: as rope's."""
    params = _rope_params(
        n_dims, mode, sections, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow
    )
    return apply(_rope_back, (dy, pos, freq_factors), params, backend)


# ---- attention


def _flash_attn(
    g: Graph, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, max_bias: float, logit_softcap: float
) -> Tensor:
    expect_dtype("flash_attn_ext", "q", q, (F32,), g.device)
    expect_dtype("flash_attn_ext", "k", k, (F16, F32), g.device)
    expect(v.dtype == k.dtype, "flash_attn_ext: k and v must have the same dtype")
    for n, t in (("q", q), ("k", k), ("v", v)):
        expect(t.ndim == 4, f"flash_attn_ext: {n} must be (batch, n_head, n, head_dim); got {t.shape}")
    b, h, nq, d = q.shape
    bk, hk, nkv, dk = k.shape
    bv, hv, nv, dv = v.shape
    expect(dk == d, f"flash_attn_ext: q and k head_dim differ ({d} vs {dk})")
    expect(bk == b and bv == b, "flash_attn_ext: q, k, v must have the same batch")
    expect(hv == hk and nv == nkv, "flash_attn_ext: k and v must have the same n_head and length")
    expect(h % hk == 0, f"flash_attn_ext: n_head of q ({h}) must be a multiple of k's ({hk})")
    if mask is not None:
        expect_dtype("flash_attn_ext", "mask", mask, (F16,), g.device)
        expect(mask.shape == (nq, nkv), f"flash_attn_ext: mask must be float16 ({nq}, {nkv}); got {mask.shape}")
    # numpy (B, H, N, D) -> ggml ne [D, N, H, B] is the layout ggml wants: no permute needed
    out = g.op("flash_attn_ext", [q, k, v, mask], floats=[scale, max_bias, logit_softcap], shape=(b, nq, h, dv))
    # ggml's result is (B, Nq, H, Dv); return the usual (B, H, Nq, Dv)
    return g.op("permute", [out], ints=[0, 2, 1, 3], shape=(b, h, nq, dv), contiguous_srcs=False)


def flash_attn_ext(
    q,
    k,
    v,
    mask=None,
    scale: float | None = None,
    max_bias: float = 0.0,
    logit_softcap: float = 0.0,
    *,
    backend: str | None = None,
):
    """Attention ``softmax(scale * q k^T + mask) v`` in one fused op (wraps ggml_flash_attn_ext,
    F32 accumulation).

    q: float32 (batch, n_head, n_q, head_dim); k, v: float16 or float32 (batch, n_head_kv, n_kv,
    head_dim / head_dim_v), n_head a multiple of n_head_kv (grouped-query attention). mask:
    optional float16 (n_q, n_kv), added to the scores. scale defaults to 1/sqrt(head_dim).
    max_bias > 0 adds ALiBi's per-head slopes times the mask. logit_softcap > 0 applies
    ``softcap * tanh(scores / softcap)``. Returns float32
    (batch, n_head, n_q, head_dim_v)."""
    if scale is None:
        d = np.shape(q)[-1] if not isinstance(q, Tensor) else q.shape[-1]
        scale = 1.0 / float(np.sqrt(d))
    return apply(
        _flash_attn,
        (q, k, v, mask),
        {
            "scale": as_float(scale, "scale"),
            "max_bias": as_float(max_bias, "max_bias"),
            "logit_softcap": as_float(logit_softcap, "logit_softcap"),
        },
        backend,
    )


# ---- sorting, generators


def _argsort(g: Graph, a: Tensor, descending: bool) -> Tensor:
    expect_dtype("argsort", "a", a, (F32,), g.device)
    expect(a.ndim >= 1, "argsort: a must have at least one axis")
    t = g.op("argsort", [a], ints=[1 if descending else 0], shape=a.shape)
    t.bound = a.shape[-1]
    return t


def argsort(a, descending: bool = False, *, backend: str | None = None):
    """Indices that sort each row (last axis): int32, a's shape (wraps ggml_argsort). a: float32.
    descending: largest first."""
    return apply(_argsort, (a,), {"descending": bool(descending)}, backend)


def _top_k(g: Graph, a: Tensor, k: int) -> Tensor:
    expect_dtype("top_k", "a", a, (F32,), g.device)
    expect(a.ndim >= 1, "top_k: a must have at least one axis")
    expect(k <= a.shape[-1], f"top_k: k ({k}) must be <= the last axis ({a.shape[-1]})")
    t = g.op("top_k", [a], ints=[k], shape=a.shape[:-1] + (k,))
    t.bound = a.shape[-1]
    return t


def top_k(a, k: int, *, backend: str | None = None):
    """Indices of the k largest elements of each row (last axis), int32 (..., k), in no
    guaranteed order (wraps ggml_top_k). a: float32."""
    return apply(_top_k, (a,), {"k": as_int(k, "k", 1)}, backend)


def _arange(g: Graph, start: float, stop: float, step: float) -> Tensor:
    return g.op("arange", [], floats=[start, stop, step], ndim=1)  # length as ggml computes it (float32)


def arange(start: float, stop: float, step: float = 1.0, *, backend: str | None = None):
    """float32 ``[start, start + step, ...)`` below stop (wraps ggml_arange). Needs stop > start
    and step > 0."""
    # ggml receives float32: check what it will see
    s0, s1, st = (float(np.float32(as_float(v, n))) for v, n in ((start, "start"), (stop, "stop"), (step, "step")))
    expect(s1 > s0, f"arange: stop ({s1}) must be > start ({s0}) in float32")
    expect(st > 0, f"arange: step must be > 0 in float32; got {st}")
    with np.errstate(all="ignore"):
        n = np.ceil(np.float32(np.float32(s1 - s0) / np.float32(st)))
    expect(n < 2**31, "arange: too many elements")
    return apply(_arange, (), {"start": s0, "stop": s1, "step": st}, backend)


def _timestep_embedding(g: Graph, t: Tensor, dim: int, max_period: int) -> Tensor:
    expect_dtype("timestep_embedding", "timesteps", t, (F32,), g.device)
    expect(t.ndim == 1, f"timestep_embedding: timesteps must be 1-D; got {t.shape}")
    return g.op("timestep_embedding", [t], ints=[dim, max_period], shape=(t.shape[0], dim))


def timestep_embedding(timesteps, dim: int, max_period: int = 10000, *, backend: str | None = None):
    """Sinusoidal embeddings of diffusion timesteps: float32 (n, dim) with
    ``[cos(t f_j), sin(t f_j)]``, f_j = max_period^(-j / (dim // 2)) (wraps ggml_timestep_embedding).
    timesteps: float32 (n,)."""
    return apply(
        _timestep_embedding,
        (timesteps,),
        {"dim": as_int(dim, "dim", 1, 1 << 20), "max_period": as_int(max_period, "max_period", 1)},
        backend,
    )


__all__ = [
    "norm",
    "rms_norm",
    "l2_norm",
    "rms_norm_back",
    "group_norm",
    "soft_max",
    "soft_max_back",
    "cross_entropy_loss",
    "cross_entropy_loss_back",
    "rope",
    "rope_back",
    "flash_attn_ext",
    "argsort",
    "top_k",
    "arange",
    "timestep_embedding",
    "ROPE_MODES",
]
_ = resolve_device  # re-exported through ops for convenience
