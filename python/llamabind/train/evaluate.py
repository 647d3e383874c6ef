"""Held-out loss and perplexity of a model (optionally with a LoRA adapter) on the same data and
masking rules as fine-tuning: JSONL examples count their completion / assistant tokens, text counts
every token. Computed from the logits (llama_decode) in float64, independently of the training
path's ggml cross-entropy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._validate import as_float, as_int, expect
from ..context import Context
from ..model import LoraAdapter, Model
from .data import Example, from_dataset, is_dataset

__all__ = ["EvalResult", "evaluate"]


@dataclass
class EvalResult:
    """Mean next-token cross-entropy in nats over the counted tokens (each counted token weighs
    the same), its perplexity exp(loss), the tokens counted and the windows evaluated."""

    loss: float
    perplexity: float
    tokens: int
    windows: int


def _pieces(model: Model, data, ctx_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, labels with -1 for uncounted) of each window: an example cut at ctx_size + 1
    tokens; text in consecutive windows of ctx_size + 1 tokens sharing one token, so every token
    but the first is predicted once."""
    if is_dataset(data):
        data = from_dataset(data, model)
    if isinstance(data, str):
        t = np.asarray(model.tokenize(data, add_special=True), np.int32)
        out = []
        for i in range(0, max(1, len(t) - 1), ctx_size):
            w = t[i : i + ctx_size + 1]
            if len(w) >= 2:
                out.append((w, w[1:]))
        return out
    if isinstance(data, Sequence) and len(data) and all(isinstance(e, Example) for e in data):
        labelled = [ex.labelled(ctx_size) for ex in data]
        return [(w, lab) for w, lab in labelled if (lab >= 0).any()]
    raise TypeError("data must be a str or a non-empty list of train.Example (see train.read_data)")


def evaluate(
    model: Model,
    data: str | Sequence[Example],
    *,
    ctx_size: int = 256,
    adapter: LoraAdapter | Sequence[tuple[LoraAdapter, float]] | None = None,
    scale: float = 1.0,
    n_threads: int | None = None,
    progress: bool = False,
) -> EvalResult:
    """Loss and perplexity of ``model`` (with ``adapter`` applied at ``scale``, or several adapters
    as (adapter, scale) pairs) on ``data``: text
    or examples (:func:`read_data`), windows of at most ``ctx_size + 1`` tokens as in training.
    The logits come from llama_decode (:meth:`Context.eval`, float32 (n, n_vocab) per window); the
    loss is in nats per counted token, the perplexity its exp. Runs in a context with a training
    context's parameters (F32 KV cache, no flash attention; ``n_threads``: None for all cores), so
    the loss is the one fine-tuning's validation reports for a single window, given a model loaded as training loads it
    (``repack=False``; a model whose CPU weights are repacked, e.g. for AMX, computes its products
    with other kernels and gives a loss that differs in the third decimal). ``progress``: a tqdm bar over the
    windows (on stderr), with the running loss. Raises TypeError for other data, ValueError for data with no
    counted token or ctx_size not a multiple of 256."""
    ctx_size = as_int(ctx_size, "ctx_size", 256)
    expect(ctx_size % 256 == 0, f"ctx_size must be a multiple of 256, as in training; got {ctx_size}")
    scale = as_float(scale, "scale")
    pieces = _pieces(model, data, ctx_size)
    if not pieces:
        raise ValueError("the data has no counted token to evaluate")
    total, n = 0.0, 0
    # a training context's parameters (F32 KV cache, no flash attention): the numbers fine-tuning's
    # validation loss is computed with
    with Context(model, n_ctx=ctx_size, n_batch=ctx_size, n_ubatch=ctx_size, n_threads=n_threads, training=True) as ctx:
        pairs = [(adapter, scale)] if isinstance(adapter, LoraAdapter) else list(adapter or [])
        for a, sc in pairs:
            ctx.set_lora(a, as_float(sc, "scale"))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pieces), desc="evaluating", unit="window", leave=False)
        for tokens, labels in pieces:
            ctx.clear()
            logits = ctx.eval(tokens[:-1].tolist()).astype(np.float64)
            keep = labels >= 0
            z = logits[keep]
            z -= z.max(axis=1, keepdims=True)
            nll = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(z)), labels[keep]]
            total += float(nll.sum())
            n += int(keep.sum())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{total / n:.4f}")
        if bar is not None:
            bar.close()
    loss = total / n
    return EvalResult(loss, math.exp(loss), n, len(pieces))
