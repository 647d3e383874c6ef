"""Embeddings of texts (a feature module: public members of Context/Model only): a context with
embeddings=True per model, kept for reuse, llama_encode for encoder-only models (BERT) and
llama_decode otherwise, several texts per batch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _log
from ._validate import as_int
from .batch import pack
from .context import Context, release_threads
from .model import Model

__all__ = ["embed"]

_ATTACHMENT = "embeddings.context"  # Model.attachments[_ATTACHMENT] = ((pooling, n_ctx, n_seq_max), Context)


def embed(
    model: Model, texts: str | Sequence[str], *, pooling: str | None = None, normalize: bool = True, n_seq_max: int = 32
) -> np.ndarray | list[np.ndarray]:
    """Embeddings of texts through llama.cpp (a context with embeddings=True; llama_encode for
    encoder-only models such as BERT, llama_decode otherwise).

    Args:
        texts: a str or a sequence of str; each is tokenized with the model's special tokens
            (e.g. [CLS] ... [SEP]) and must fit the model's n_ctx_train.
        pooling: None (the model's own, from the GGUF; "mean" for a model without one), "mean",
            "cls", "last", or "none" (one vector per token).
        normalize: divide each vector by its L2 norm (cosine similarity becomes a dot product).
        n_seq_max: texts evaluated together in one batch.

    Returns float32 of shape (n_texts, n_embd) (a 1-D (n_embd,) for a single str); with
    pooling "none", a list of (n_tokens_i, n_embd) arrays. Raises ValueError (empty text list,
    a text longer than n_ctx_train tokens, bad pooling), TypeError.
    """
    _log.sync_level()
    single = isinstance(texts, str)
    items: list[str] = [texts] if isinstance(texts, str) else list(texts)
    if not items:
        raise ValueError("texts must not be empty")
    if not all(isinstance(t, str) for t in items):
        raise TypeError("texts must be a str or a sequence of str")
    if pooling not in Context.POOLING or pooling == "rank":
        raise ValueError(f"pooling must be None, 'none', 'mean', 'cls' or 'last'; got {pooling!r}")
    as_int(n_seq_max, "n_seq_max", 1, 256)
    n_ctx = min(model.n_ctx_train or 512, 8192)
    if pooling is None:  # the model's own (GGUF {arch}.pooling_type); mean for a model without one
        own = model.metadata.get(f"{model.metadata.get('general.architecture')}.pooling_type", 0)
        pooling = {1: "mean", 2: "cls", 3: "last"}.get(own, "mean")
    key = (pooling, n_ctx, n_seq_max)
    held = model.attachments.get(_ATTACHMENT)
    if held is None or held[1].closed or held[0] != key:
        if held is not None:
            held[1].close()
        ctx = Context(
            model,
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            n_seq_max=n_seq_max,
            embeddings=True,
            pooling=pooling,
            kv_unified=True,
            n_threads=model.context_params["n_threads"],
        )
        held = model.attachments[_ATTACHMENT] = (key, ctx)
    ctx = held[1]
    tokens = [model.tokenize(t, add_special=True, parse_special=False) for t in items]
    for i, t in enumerate(tokens):
        if not t:
            raise ValueError(f"texts[{i}] tokenized to no tokens")
        if len(t) > n_ctx:
            raise ValueError(f"texts[{i}] has {len(t)} tokens, more than the model's context ({n_ctx})")
    per_token = ctx.pooling == 0
    out: list[np.ndarray] = [np.empty(0, np.float32)] * len(items)
    for group in pack([len(t) for t in tokens], n_ctx, n_seq_max):
        ctx.clear()
        last = ctx.decode_batch([(s, tokens[i]) for s, i in enumerate(group)])
        for s, i in enumerate(group):
            if per_token:
                first = last[s] - len(tokens[i]) + 1
                out[i] = np.stack([ctx.embedding(0, j) for j in range(first, last[s] + 1)])
            else:
                out[i] = ctx.embedding(s, -1)
    ctx.clear()
    release_threads()
    if normalize:
        out = [v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12) for v in out]
    if per_token:
        return out[0] if single else out
    arr = np.stack(out).astype(np.float32, copy=False)
    return arr[0] if single else arr
