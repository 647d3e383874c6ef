"""Batched generation: several prompts in one context (one llama_batch per step holding a token of
every active sequence, one sampler chain per sequence). A feature module: it uses public members
of Context/Model only."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from . import _log
from ._validate import as_int, prompt_tokens, stop_strings
from .context import Context, release_threads
from .generation import GenerationResult, Processing, TextState, Timings, logits_processors
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["generate_batch", "pack"]


def pack(lengths: Sequence[int], n_batch: int, n_seq: int) -> list[list[int]]:
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


def generate_batch(
    model: Model,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    n_ctx: int | None = None,
    add_special: bool = True,
    parse_special: bool = True,
    logits_processor: Any = None,
    **sampling: Any,
) -> list[GenerationResult]:
    """Generate a continuation of every prompt together: one context with a KV cache sequence
    per prompt, one llama_decode per step for all active sequences (llama_batch), and one sampler
    chain per sequence (seeded ``seed + i`` for prompt i when a seed is given).

    Args:
        prompts: texts or token-id lists (1..256 of them).
        max_tokens, stop, add_special, parse_special, **sampling: as :meth:`Context.generate`.
        n_ctx: the shared KV cache size (default: room for every prompt plus max_tokens).
        logits_processor: as :meth:`Context.generate`'s, called for every sequence with that
            sequence's input ids and logits.

    Returns one :class:`GenerationResult` per prompt, in order. With temperature 0 each result
    equals ``Model.generate`` of that prompt alone. Raises ValueError/TypeError as generate().
    """
    _log.sync_level()
    params = SamplingParams.from_kwargs(sampling, "generate_batch")
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a sequence of prompts (a list of str)")
    prompts = list(prompts)
    if not 1 <= len(prompts) <= 256:
        raise ValueError(f"prompts must hold 1..256 prompts; got {len(prompts)}")
    as_int(max_tokens, "max_tokens", 0)
    stops = stop_strings(stop)
    fns = logits_processors(logits_processor)

    def tokenize(text: str) -> list[int]:
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)

    toks = [prompt_tokens(p, tokenize, model.n_vocab, f"prompts[{i}]") for i, p in enumerate(prompts)]
    need = sum(len(t) + max_tokens for t in toks)
    n_ctx = as_int(n_ctx, "n_ctx", 8) if n_ctx is not None else max(256, need)
    base = model.context_params
    ctx = Context(
        model,
        n_ctx=n_ctx,
        n_batch=base["n_batch"],
        n_ubatch=base["n_ubatch"],
        n_threads=base["n_threads"],
        n_seq_max=len(toks),
        kv_unified=True,
        type_k=base["type_k"],
        type_v=base["type_v"],
        flash_attn=base["flash_attn"],
    )
    samplers: list[Sampler] = []
    try:
        for i in range(len(toks)):
            seed = None if params.seed is None else (params.seed + i) & 0xFFFFFFFF
            samplers.append(dataclasses.replace(params, seed=seed).build(model))
        procs = [Processing(fns, t) if fns else None for t in toks]
        return _run_batch(ctx, toks, max_tokens, samplers, stops, procs)
    finally:
        for s in samplers:
            s.close()
        ctx.close()
        release_threads()


def _run_batch(
    ctx: Context,
    toks: list[list[int]],
    max_tokens: int,
    samplers: list[Sampler],
    stops: list[str],
    procs: list[Processing | None],
) -> list[GenerationResult]:

    def sample(i: int, idx: int) -> int:
        p = procs[i]
        if p is not None:
            p.apply(ctx, idx)
        return samplers[i].sample(ctx, idx)

    model = ctx.model
    n_batch, n_ctx = ctx.n_batch, ctx.n_ctx
    n = len(toks)
    timings = [Timings(prompt_tokens=len(t)) for t in toks]
    states = [TextState(model, stops) for _ in toks]
    generated: list[list[int]] = [[] for _ in toks]
    finish = ["length"] * n
    nxt: dict[int, int] = {}  # sequence -> sampled token, to evaluate in the next step
    t0 = time.perf_counter()
    # prompts: all but the last token in n_batch chunks per sequence, then the last tokens packed
    heads = [t[:-1] for t in toks]
    for i, h in enumerate(heads):
        if h:
            ctx.decode_sequence(h, i)
    for group in pack([1] * n, n_batch, n):
        idx = ctx.decode_batch([(i, [toks[i][-1]]) for i in group])
        for k, i in enumerate(group):
            samplers[i].accept(toks[i])
            nxt[i] = sample(i, idx[k])
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
            p = procs[i]
            if p is not None:
                p.push(tok)
            states[i].feed(tok)
            if states[i].matched is not None:
                finish[i] = "stop"
                active.discard(i)
            elif len(generated[i]) >= max_tokens or ctx.pos(i) + 1 >= n_ctx:
                active.discard(i)
            else:
                step.append(i)
        for group in pack([1] * len(step), n_batch, len(step) or 1):
            seqs = [step[k] for k in group]
            idx = ctx.decode_batch([(i, [generated[i][-1]]) for i in seqs])
            for k, i in enumerate(seqs):
                nxt[i] = sample(i, idx[k])
    gen_ms = (time.perf_counter() - t1) * 1e3
    out = []
    for i in range(n):
        states[i].finish()
        timings[i].generated_tokens = len(generated[i])
        timings[i].generate_ms = gen_ms
        out.append(
            GenerationResult(
                text=states[i].text,
                tokens=generated[i],
                finish_reason=finish[i],
                prompt_tokens=len(toks[i]),
                timings=timings[i],
                stop=states[i].matched,
            )
        )
    return out
