"""Several sequences in one context: embeddings of many texts, and batched generation (one
llama_batch per step holding a token of every active sequence, one sampler chain per sequence)."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from . import _log
from .generation import GenerationResult, SamplingParams, Timings, _int, _normalize_stop, _TextState

if TYPE_CHECKING:
    from .model import Context, Model

__all__ = ["embed", "generate_batch"]


def _pack(lengths: Sequence[int], n_batch: int, n_seq: int) -> list[list[int]]:
    """Indices grouped so that each group's total length is <= n_batch and it has <= n_seq members."""
    groups: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(lengths):
        if groups[-1] and (total + n > n_batch or len(groups[-1]) >= n_seq):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return [g for g in groups if g]


def embed(model: "Model", texts: str | Sequence[str], *, pooling: str | None = None, normalize: bool = True,
          n_seq_max: int = 32) -> np.ndarray | list[np.ndarray]:
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
    from .model import Context

    _log.sync_level()
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
    if not items:
        raise ValueError("texts must not be empty")
    if not all(isinstance(t, str) for t in items):
        raise TypeError("texts must be a str or a sequence of str")
    if pooling not in Context.POOLING or pooling == "rank":
        raise ValueError(f"pooling must be None, 'none', 'mean', 'cls' or 'last'; got {pooling!r}")
    _int("n_seq_max", n_seq_max, 1, 256)
    n_ctx = min(model.n_ctx_train or 512, 8192)
    if pooling is None:  # the model's own (GGUF {arch}.pooling_type); mean for a model without one
        own = model.metadata.get(f"{model.metadata.get('general.architecture')}.pooling_type", 0)
        pooling = {1: "mean", 2: "cls", 3: "last"}.get(own, "mean")
    key = (pooling, n_ctx, n_seq_max)
    ctx = model._embed_ctx
    if ctx is None or ctx.closed or ctx._embed_key != key:
        if ctx is not None:
            ctx.close()
        ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=n_seq_max, embeddings=True,
                      pooling=pooling, kv_unified=True)
        ctx._embed_key = key
        model._embed_ctx = ctx
    tokens = [model.tokenize(t, add_special=True, parse_special=False) for t in items]
    for i, t in enumerate(tokens):
        if not t:
            raise ValueError(f"texts[{i}] tokenized to no tokens")
        if len(t) > n_ctx:
            raise ValueError(f"texts[{i}] has {len(t)} tokens, more than the model's context ({n_ctx})")
    native = ctx._c
    per_token = native.pooling == 0
    out: list[np.ndarray] = [None] * len(items)  # type: ignore[list-item]
    for group in _pack([len(t) for t in tokens], n_ctx, n_seq_max):
        ctx.clear()
        last = native.decode_batch([(s, tokens[i]) for s, i in enumerate(group)])
        for s, i in enumerate(group):
            if per_token:
                first = last[s] - len(tokens[i]) + 1
                out[i] = np.stack([native.embedding(0, j) for j in range(first, last[s] + 1)])
            else:
                out[i] = native.embedding(s, -1)
    ctx.clear()
    if normalize:
        out = [v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12) for v in out]
    if per_token:
        return out[0] if single else out
    arr = np.stack(out).astype(np.float32, copy=False)
    return arr[0] if single else arr


def generate_batch(model: "Model", prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 128,
                   stop: str | Sequence[str] | None = None, n_ctx: int | None = None, add_special: bool = True,
                   parse_special: bool = True, **sampling) -> list[GenerationResult]:
    """Generate a continuation of every prompt together: one context with a KV cache sequence
    per prompt, one llama_decode per step for all active sequences (llama_batch), and one sampler
    chain per sequence (seeded ``seed + i`` for prompt i when a seed is given).

    Args:
        prompts: texts or token-id lists (1..256 of them).
        max_tokens, stop, add_special, parse_special, **sampling: as :meth:`Context.generate`.
        n_ctx: the shared KV cache size (default: room for every prompt plus max_tokens).

    Returns one :class:`GenerationResult` per prompt, in order. With temperature 0 each result
    equals ``Model.generate`` of that prompt alone. Raises ValueError/TypeError as generate().
    """
    from .model import Context

    _log.sync_level()
    params, rest = SamplingParams.split(sampling)
    if rest:
        raise TypeError(f"generate_batch() got unexpected keyword argument(s): {', '.join(rest)}")
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a sequence of prompts (a list of str)")
    prompts = list(prompts)
    if not 1 <= len(prompts) <= 256:
        raise ValueError(f"prompts must hold 1..256 prompts; got {len(prompts)}")
    _int("max_tokens", max_tokens, 0)
    stops = _normalize_stop(stop)
    toks = []
    for i, p in enumerate(prompts):
        t = model.tokenize(p, add_special=add_special, parse_special=parse_special) if isinstance(p, str) else [int(x) for x in p]
        if not t:
            raise ValueError(f"prompts[{i}] is empty")
        toks.append(t)
    need = sum(len(t) + max_tokens for t in toks)
    n_ctx = _int("n_ctx", n_ctx, 8) if n_ctx is not None else max(256, need)
    base = model._ctx_params
    ctx = Context(model, n_ctx=n_ctx, n_batch=base["n_batch"], n_ubatch=base["n_ubatch"], n_threads=base["n_threads"],
                  n_seq_max=len(toks), kv_unified=True)
    samplers = []
    try:
        for i in range(len(toks)):
            seed = None if params.seed is None else (params.seed + i) & 0xFFFFFFFF
            samplers.append(dataclasses.replace(params, seed=seed).build(model._m))
        return _run_batch(ctx, model, toks, max_tokens, samplers, stops)
    finally:
        for s in samplers:
            s.close()
        ctx.close()


def _run_batch(ctx: "Context", model, toks: list[list[int]], max_tokens: int, samplers, stops) -> list[GenerationResult]:
    native = ctx._c
    n_batch, n_ctx = native.n_batch, native.n_ctx
    n = len(toks)
    timings = [Timings(prompt_tokens=len(t)) for t in toks]
    states = [_TextState(model, stops) for _ in toks]
    generated: list[list[int]] = [[] for _ in toks]
    finish = ["length"] * n
    nxt: dict[int, int] = {}  # sequence -> sampled token, to evaluate in the next step
    t0 = time.perf_counter()
    # prompts: all but the last token in n_batch chunks per sequence, then the last tokens packed
    heads = [t[:-1] for t in toks]
    for i, h in enumerate(heads):
        if h:
            native.decode(h, i)
    for group in _pack([1] * n, n_batch, n):
        idx = native.decode_batch([(i, [toks[i][-1]]) for i in group])
        for k, i in enumerate(group):
            samplers[i].accept(toks[i])
            nxt[i] = samplers[i].sample(native, idx[k])
    prompt_ms = (time.perf_counter() - t0) * 1e3
    for t in timings:
        t.prompt_ms = prompt_ms
    t1 = time.perf_counter()
    active = set(range(n)) if max_tokens > 0 else set()
    while active:
        step = []
        for i in sorted(active):
            tok = nxt.pop(i)
            if model.is_eog(tok):
                finish[i] = "stop"
                active.discard(i)
                continue
            generated[i].append(tok)
            states[i].feed(tok)
            if states[i].matched is not None:
                finish[i] = "stop"
                active.discard(i)
            elif len(generated[i]) >= max_tokens or native.pos(i) + 1 >= n_ctx:
                active.discard(i)
            else:
                step.append(i)
        for group in _pack([1] * len(step), n_batch, len(step) or 1):
            seqs = [step[k] for k in group]
            idx = native.decode_batch([(i, [generated[i][-1]]) for i in seqs])
            for k, i in enumerate(seqs):
                nxt[i] = samplers[i].sample(native, idx[k])
    gen_ms = (time.perf_counter() - t1) * 1e3
    out = []
    for i in range(n):
        states[i].finish()
        timings[i].generated_tokens = len(generated[i])
        timings[i].generate_ms = gen_ms
        out.append(GenerationResult(text=states[i].text, tokens=generated[i], finish_reason=finish[i],
                                    prompt_tokens=len(toks[i]), timings=timings[i], stop=states[i].matched))
    return out
