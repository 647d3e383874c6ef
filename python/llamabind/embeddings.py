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


def _pooled_context(model: Model, pooling: str, n_ctx: int, n_seq_max: int) -> Context:
    """The model's embedding context (embed and rerank share it): kept in Model.attachments while
    the pooling and sizes stay the same, else replaced. n_batch = n_ubatch = n_ctx: every sequence
    in one ubatch, as non-causal encoders need."""
    key = (pooling, n_ctx, n_seq_max)
    held = model.attachments.get(_ATTACHMENT)
    if held is None or held[1].closed or held[0] != key:
        if held is not None:
            held[1].close()
        ctx = Context(
            model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=n_seq_max, embeddings=True, pooling=pooling,
            kv_unified=True, n_threads=model.context_params["n_threads"],
        )  # fmt: skip
        held = model.attachments[_ATTACHMENT] = (key, ctx)
    return held[1]


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
    ctx = _pooled_context(model, pooling, n_ctx, n_seq_max)
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


def rerank_tokens(model: Model, query: str, document: str) -> list[int]:
    """The tokens llama-server's /rerank evaluates for (query, document) (format_prompt_rerank): the
    GGUF's "rerank" template with {query} and {document} filled in, else BOS? query EOS? SEP?
    document EOS? (each as the vocabulary asks; EOS falls back to SEP)."""
    template = model.chat_template("rerank")
    if template is not None:
        prompt = template.replace("{query}", query).replace("{document}", document)
        return model.tokenize(prompt, add_special=False, parse_special=True)
    eos = model.token_eos if model.token_eos is not None else model.token_sep
    out: list[int] = []
    if model.add_bos and model.token_bos is not None:
        out.append(model.token_bos)
    out += model.tokenize(query, add_special=False)
    if model.add_eos and eos is not None:
        out.append(eos)
    if model.add_sep and model.token_sep is not None:
        out.append(model.token_sep)
    out += model.tokenize(document, add_special=False)
    if model.add_eos and eos is not None:
        out.append(eos)
    return out


def rerank(
    model: Model, query: str, documents: Sequence[str], *, top_n: int | None = None, n_seq_max: int = 16
) -> list[tuple[int, float]]:
    """Relevance of each document to ``query`` by a reranker model (a cross-encoder GGUF whose
    pooling is "rank": bge-reranker, jina-reranker, Qwen3-Reranker, ...), as llama-server's
    /rerank computes it: each (query, document) pair is one sequence (see :func:`rerank_tokens`),
    its score the classification head's first output (llama_get_embeddings_seq).

    Returns ``[(index, score), ...]`` sorted by score, highest first, the first ``top_n`` (None:
    all); scores are raw logits (float). Raises ValueError (no documents, a pair longer than the
    model's context, a model whose GGUF pooling is not "rank"), TypeError (not str).
    """
    _log.sync_level()
    if not isinstance(query, str) or isinstance(documents, str):
        raise TypeError("query must be a str and documents a sequence of str")
    docs = list(documents)
    if not docs:
        raise ValueError("documents must not be empty")
    if not all(isinstance(d, str) for d in docs):
        raise TypeError("documents must be str")
    if top_n is not None:
        as_int(top_n, "top_n", 1)
    as_int(n_seq_max, "n_seq_max", 1, 256)
    arch = model.metadata.get("general.architecture", "")
    if model.metadata.get(f"{arch}.pooling_type") != Context.POOLING["rank"] or model.n_cls_out < 1:
        raise ValueError(
            f"this model is not a reranker: its GGUF's {arch}.pooling_type is not 4 (rank), the pooling of "
            "cross-encoders converted with a classification head"
        )
    n_ctx = min(model.n_ctx_train or 512, 8192)
    ctx = _pooled_context(model, "rank", n_ctx, n_seq_max)
    tokens = [rerank_tokens(model, query, d) for d in docs]
    for i, t in enumerate(tokens):
        if len(t) > n_ctx:
            raise ValueError(f"query + documents[{i}] is {len(t)} tokens, more than the model's context ({n_ctx})")
    scores = [0.0] * len(docs)
    for group in pack([len(t) for t in tokens], n_ctx, n_seq_max):
        ctx.clear()
        ctx.decode_batch([(s, tokens[i]) for s, i in enumerate(group)])
        for s, i in enumerate(group):
            scores[i] = float(ctx.embedding(s, -1)[0])
    ctx.clear()
    release_threads()
    ranked = sorted(enumerate(scores), key=lambda x: -x[1])
    return ranked[:top_n] if top_n is not None else ranked
