"""Batched generation: several prompts in one context (one llama_batch per step holding a token of
every active sequence, one sampler chain per sequence). A feature module: it uses public members
of Context/Model only."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from . import _log, multimodal
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
    media: Sequence[Sequence[Any] | None] | None = None,
    fetch: multimodal.Fetch | None = None,
    **sampling: Any,
) -> list[GenerationResult]:
    """Generate a continuation of every prompt together: one context with a KV cache sequence
    per prompt, one llama_decode per step for all active sequences (llama_batch), and one sampler
    chain per sequence (seeded ``seed + i`` for prompt i when a seed is given).

    Args:
        prompts: texts or token-id lists (1..256 of them).
        max_tokens: as :meth:`Context.generate`'s.
        stop: as :meth:`Context.generate`'s.
        add_special: as :meth:`Context.generate`'s.
        parse_special: as :meth:`Context.generate`'s.
        **sampling: the sampling fields, as :meth:`Context.generate` takes them.
        n_ctx: the shared KV cache size (default: room for every prompt plus max_tokens).
        logits_processor: as :meth:`Context.generate`'s, called for every sequence with that
            sequence's input ids and logits.
        media: one list of images/audio per prompt (None or [] for a text prompt), each for a
            :data:`~llamabind.projector.MEDIA_MARKER` in that prompt, as ``generate(media=)``
            takes them (the model needs a projector; ``fetch`` as there). A prompt with media
            ends in text (a chat template's prompt does).

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

    if media is not None and len(media) != len(prompts):
        raise ValueError(f"media must hold one list per prompt ({len(prompts)}); got {len(media)}")
    mps: list[multimodal.MediaPrompt | None] = [None] * len(prompts)
    for i, sources in enumerate(media or []):
        if sources:
            projector = multimodal.projector_of(model)
            if projector is None:
                raise ValueError("media need a projector: Model(..., mmproj=...) or model.load_mmproj(...)")
            text = prompts[i]
            if not isinstance(text, str):
                raise TypeError(f"prompts[{i}] has media: it must be a str with one MEDIA_MARKER per medium")
            mp = multimodal.prompt(
                projector, text, list(sources), fetch=fetch, add_special=add_special, parse_special=parse_special
            )
            if not isinstance(mp.pieces[-1], int):
                raise ValueError(f"prompts[{i}] ends in a medium: a prompt with media must end in text")
            mps[i] = mp
    toks = [
        mp.text_tokens if mp is not None else prompt_tokens(p, tokenize, model.n_vocab, f"prompts[{i}]")
        for i, (p, mp) in enumerate(zip(prompts, mps))
    ]
    sizes = [mp.n_tokens if mp is not None else len(t) for mp, t in zip(mps, toks)]
    need = sum(n + max_tokens for n in sizes)
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
        return _run_batch(ctx, toks, max_tokens, samplers, stops, procs, mps)
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
    mps: list[multimodal.MediaPrompt | None],
) -> list[GenerationResult]:

    def sample(i: int, idx: int) -> int:
        p = procs[i]
        if p is not None:
            p.apply(ctx, idx)
        return samplers[i].sample(ctx, idx)

    model = ctx.model
    n_batch, n_ctx = ctx.n_batch, ctx.n_ctx
    n = len(toks)
    timings = [Timings(prompt_tokens=mp.n_tokens if mp is not None else len(t)) for mp, t in zip(mps, toks)]
    states = [TextState(model, stops) for _ in toks]
    generated: list[list[int]] = [[] for _ in toks]
    finish = ["length"] * n
    nxt: dict[int, int] = {}  # sequence -> sampled token, to evaluate in the next step
    t0 = time.perf_counter()
    # prompts: all but the last token in n_batch chunks per sequence (media through libmtmd), then
    # the last tokens packed
    for i, (ids, mp) in enumerate(zip(toks, mps)):
        if mp is None:
            if len(ids) > 1:
                ctx.decode_sequence(ids[:-1], i)
            continue
        multimodal.evaluate(ctx, mp.pieces[:-1], seq_id=i)
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
            elif len(generated[i]) >= max_tokens or ctx.kv_cells(i) + 1 >= n_ctx:
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
                prompt_tokens=timings[i].prompt_tokens,
                timings=timings[i],
                stop=states[i].matched,
            )
        )
    return out
