"""Text generation over a Context (a feature module: public members of Context/Model only): the
sampling loop, streaming, stop strings, logprobs, timings; :func:`generate` is what
``Context.generate`` and ``Model.generate`` call."""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from . import _log, multimodal, speculative
from ._validate import as_int, prompt_tokens, stop_strings
from .context import Context, release_threads
from .model import Model, json_schema_to_grammar
from .sampling import Sampler, SamplingParams

R = TypeVar("R")

__all__ = ["GenerationResult", "Timings", "Stream", "SupersededError", "TokenLogprob", "generate", "run"]


@dataclass
class Timings:
    """Wall-clock timings of one generation. Times in milliseconds, rates in tokens/second.

    prompt_tokens: the prompt's tokens; prompt_reused: those whose KV cache entries were kept from
    the previous call (not evaluated again); prompt_ms: the time of the prompt's llama_decode calls;
    generated_tokens, generate_ms: the tokens generated and their time (sampling and decoding);
    context_shifts: times the KV cache was shifted to make room (``generate(context_shift=True)``).
    """

    prompt_tokens: int = 0
    prompt_reused: int = 0  # prompt tokens whose KV cache entries were kept from the previous call
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generate_ms: float = 0.0
    context_shifts: int = 0  # times the KV cache was shifted to make room (generate(context_shift=True))

    @property
    def prompt_tps(self) -> float:
        """Prompt processing speed (tokens/s): evaluated (not reused) prompt tokens / time of their llama_decode."""
        n = self.prompt_tokens - self.prompt_reused
        return n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def generated_tps(self) -> float:
        """Generation speed (tokens/s): generated tokens / time from the first sample to the end,
        sampling and detokenization included."""
        return self.generated_tokens / (self.generate_ms / 1e3) if self.generate_ms > 0 else 0.0

    def summary(self) -> str:
        """One line: prompt and generated token counts and their tokens/s (what the CLI prints)."""
        return (
            f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s | "
            f"generated: {self.generated_tokens} tokens, {self.generated_tps:.1f} tokens/s"
        )


@dataclass
class GenerationResult:
    """The outcome of a generation.

    text: the generated text (without the prompt, and without a matched stop string).
    tokens: generated token ids (an end-of-generation token is not included).
    finish_reason: ``"stop"`` (end-of-generation token or a stop string) or ``"length"``
    (max_tokens reached, or the context is full). prompt_tokens: the prompt's length in tokens.
    timings: the generation's :class:`Timings`. stop: the stop string that matched, if any.
    logprobs: one :class:`TokenLogprob` per generated token when ``logprobs`` was asked for, else None.
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop: str | None = None
    logprobs: list[TokenLogprob] | None = None


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability (natural log, from the raw logits: before
    temperature and filters) and the ``top`` most likely alternatives as (token id, text, logprob)."""

    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]]


def generate(
    ctx: Context,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    stream: bool = False,
    add_special: bool = True,
    parse_special: bool = True,
    json_schema: dict | str | None = None,
    logprobs: int | None = None,
    draft_model: Model | None = None,
    lookup_ngram: int | None = None,
    n_draft: int = 8,
    logits_processor: LogitsProcessor | Sequence[LogitsProcessor] | None = None,
    media: Sequence[Any] | None = None,
    context_shift: bool = False,
    n_keep: int = 0,
    **sampling: Any,
) -> GenerationResult | Stream[GenerationResult]:
    """Generate a continuation of ``prompt`` in ``ctx`` through llama.cpp's sampler chain.

    Args:
        prompt: text, or token ids. Text is tokenized with ``add_special`` (BOS if the model
            wants one) and ``parse_special`` (special-token text becomes special tokens).
        max_tokens: most tokens to generate (>= 0).
        stop: string(s) that end the generation; the matched string is not included.
        stream: return a :class:`Stream` of text pieces instead of the finished result.
        json_schema: constrain the output to JSON that validates against this schema (a dict
            or JSON text), through common's json_schema_to_grammar; ``{}`` is any object.
        logprobs: also return, per generated token, its log-probability and this many top
            alternatives (0..100); computed from the last position's logits only.
        draft_model: speculative decoding with a small model of the same vocabulary: n_draft
            (1..64) tokens are proposed per step. The output is the same as without it.
        lookup_ngram: speculative decoding with n-gram lookup in the context instead (n =
            lookup_ngram, 1..8), n_draft tokens proposed per step; the same output.
        logits_processor: a function or a list of them (llama-cpp-python's and transformers'
            convention), called before each token as ``f(input_ids, logits)``: input_ids int32
            (n,), the prompt and the tokens generated so far (read-only), logits float32
            (n_vocab,) of the next token (a copy it may change in place); returns the logits to
            use (or None: changed in place). The sampler chain (penalties, top-k, grammar, ...)
            then samples from them. -inf forbids a token; NaN, +inf or no finite value is a
            ValueError. Not with speculative decoding or backend_sampling.
        media: images or audio clips (see :meth:`~llamabind.projector.Projector.media`: bytes,
            paths, data URLs, numpy arrays) for a model with a projector; the text prompt holds
            one ``llamabind.MEDIA_MARKER`` ("<__media__>") per item, where each goes.
        context_shift: when the context is full, keep going (llama-server's ``--context-shift``):
            keep the first ``n_keep`` tokens (-1: the whole prompt; plus BOS where the model adds
            one; at most n_ctx - 4, clamped with a warning on the ``llamabind`` logger as
            llama-server clamps it), drop half of the rest from the KV cache and move the remainder down
            (:meth:`Context.shift`), as llama-server does; without it generation stops there with
            finish_reason "length". Not with prompts holding media, nor speculative decoding.
        **sampling: fields of :class:`~llamabind.SamplingParams` (temperature, top_k, top_p, min_p,
            typical_p, xtc_*, dry_*, mirostat*, repeat/frequency/presence penalties,
            logit_bias, grammar, seed, ...).

    Returns a :class:`GenerationResult` (or a :class:`Stream` whose ``result`` is set at the
    end). The KV cache keeps the longest prefix shared with the previous call (timings
    show prompt_reused). Ctrl-C raises KeyboardInterrupt within one token.

    Raises ValueError (bad parameter, empty prompt, prompt longer than n_ctx, grammar or
    schema that does not parse), TypeError (unknown or mistyped argument).
    """
    params = SamplingParams.from_kwargs(sampling, "generate")
    if json_schema is not None:
        if params.grammar is not None:
            raise ValueError("give either grammar or json_schema, not both")
        params = dataclasses.replace(params, grammar=json_schema_to_grammar(json_schema))
    draft = speculative.make(ctx, draft_model, lookup_ngram, n_draft)
    if draft is not None and logprobs is not None:
        raise ValueError("logprobs are not available with speculative decoding")
    procs = logits_processors(logits_processor)
    mp: multimodal.MediaPrompt | None = None
    if media is not None:
        projector = multimodal.projector_of(ctx.model)
        if projector is None:
            raise ValueError("media need a projector: Model(path, mmproj='mmproj.gguf') or model.load_mmproj(path)")
        if not isinstance(prompt, str):
            raise TypeError("with media, the prompt must be text holding one MEDIA_MARKER per medium")
        mp = multimodal.prompt(projector, prompt, list(media), add_special=add_special, parse_special=parse_special)
    if draft is not None and procs:
        raise ValueError("logits processors are not available with speculative decoding")
    if context_shift and (draft is not None or mp is not None):
        raise ValueError("context_shift cannot be used with speculative decoding or media")
    keep = as_int(n_keep, "n_keep", -1) if context_shift else None
    gen = run(
        ctx, mp if mp is not None else prompt, max_tokens, params, stop, add_special, parse_special,
        logprobs=logprobs, draft=draft, processors=procs, n_keep=keep,
    )  # fmt: skip
    return Stream(gen) if stream else collect(gen)


def run(
    ctx: Context,
    prompt: str | Sequence[int] | multimodal.MediaPrompt,
    max_tokens: int,
    sampling: SamplingParams,
    stop: str | Sequence[str] | None,
    add_special: bool,
    parse_special: bool,
    *,
    logprobs: int | None = None,
    chat: Any = None,
    draft: speculative.Speculator | None = None,
    processors: Sequence[LogitsProcessor] = (),
    n_keep: int | None = None,
) -> Generator[str, None, GenerationResult]:
    """Validate everything, then return the generation loop: a generator of text pieces whose
    return value is the GenerationResult. ``chat``: a rendered chat prompt (ChatTemplates.apply)
    whose grammar and additional stops apply."""
    _log.sync_level()
    model = ctx.model
    as_int(max_tokens, "max_tokens", 0)
    if logprobs is not None:
        as_int(logprobs, "logprobs", 0, 100, note=" (top alternatives per token)")
    stops = stop_strings(stop)
    if chat is not None:
        stops += [s for s in chat.additional_stops if s and s not in stops]
    media = prompt if isinstance(prompt, multimodal.MediaPrompt) else None
    if media is not None:
        if draft is not None:
            raise ValueError("speculative decoding does not take prompts with images or audio")
        tokens, text_tokens = media.keys, media.text_tokens
    else:
        tokens = text_tokens = prompt_tokens(
            prompt,
            lambda text: model.tokenize(text, add_special=add_special, parse_special=parse_special),
            model.n_vocab,
        )
    n_ctx = ctx.n_ctx
    n_prompt = media.n_tokens if media is not None else len(tokens)
    if n_prompt >= n_ctx:
        raise ValueError(
            f"the prompt has {n_prompt} tokens, which leaves no room in n_ctx ({n_ctx}); "
            "use a larger n_ctx or a shorter prompt"
        )
    on_device = _backend_sampling(model, sampling, chat, logprobs, draft, bool(processors), media is not None)
    sampler = sampling.build(model, chat)
    proc = Processing(processors, text_tokens) if processors else None
    keep = None
    if n_keep is not None:  # context shift: llama-server's n_keep (-1: the prompt), + BOS, at most n_ctx - 4
        want = (len(tokens) if n_keep < 0 else n_keep) + (1 if model.add_bos else 0)
        keep = min(n_ctx - 4, want)
        if keep < want:  # llama-server clamps it the same way and says so
            _log.logger.warning(
                "context shift: n_keep %d (with BOS) exceeds n_ctx - 4 = %d; keeping %d tokens", want, n_ctx - 4, keep
            )
    return _loop(ctx, tokens, max_tokens, sampler, stops, logprobs, draft, on_device, proc, media, keep)


def _backend_sampling(
    model: Model,
    sampling: SamplingParams,
    chat: Any,
    logprobs: int | None,
    draft: speculative.Speculator | None,
    processors: bool = False,
    media: bool = False,
) -> bool:
    """Whether the chain runs in the decode graph (SamplingParams.backend_sampling)."""
    why_not = (
        "a prompt with images or audio"
        if media
        else "a grammar or JSON schema"
        if sampling.grammar is not None or (chat is not None and chat.grammar)
        else "logprobs"
        if logprobs is not None
        else "a logits processor"
        if processors
        else "speculative decoding"
        if draft is not None
        else None
    )
    if sampling.backend_sampling and why_not:
        raise ValueError(f"backend_sampling=True cannot be used with {why_not} (they need the logits on the host)")
    if sampling.backend_sampling is None:  # greedy only (SamplingParams.backend_sampling says why)
        return why_not is None and model.output_offloaded and sampling.temperature <= 0
    return sampling.backend_sampling


class TextState:
    """Incremental detokenization of one sequence: whole UTF-8 characters only, stop strings
    matched across token boundaries and never emitted (nor a prefix of one that may still match)."""

    def __init__(self, model: Model, stops: list[str]):
        self.model = model
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None

    def feed(self, tok: int) -> str:
        """Add a token; returns the text now safe to emit (sets ``matched`` on a stop string)."""
        before = len(self.text)
        self.text += self.decoder.decode(self.model.token_to_piece(tok))
        hit = None
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            self.text = self.text[: hit[0]]
            self.matched = hit[1]
        safe = len(self.text) - (0 if self.matched else _held_back(self.text, self.stops))
        if safe > self.emitted:
            piece, self.emitted = self.text[self.emitted : safe], safe
            return piece
        return ""

    def finish(self) -> str:
        """The rest of the text (an incomplete character becomes U+FFFD)."""
        if self.matched is None:
            self.text += self.decoder.decode(b"", final=True)
        piece, self.emitted = self.text[self.emitted :], len(self.text)
        return piece


def _logprob(ctx: Context, idx: int, tok: int, n: int) -> TokenLogprob:
    model = ctx.model

    def text(t: int) -> str:
        return model.token_to_piece(t, special=True).decode("utf-8", "replace")

    lp, ids, tlp = ctx.token_logprob(idx, tok, n)
    return TokenLogprob(tok, text(tok), lp, [(i, text(i), v) for i, v in zip(ids, tlp)])


LogitsProcessor = Callable[[np.ndarray, np.ndarray], Any]
"""``f(input_ids: int32 (n,), logits: float32 (n_vocab,)) -> float32 (n_vocab,) | None``."""


def logits_processors(value: Any) -> list[LogitsProcessor]:
    """A logits_processor argument as a list: None, one callable, or a sequence of them
    (TypeError otherwise)."""
    if value is None:
        return []
    fns = [value] if callable(value) else value
    if isinstance(fns, (str, bytes)) or not isinstance(fns, Sequence) or not all(callable(f) for f in fns):
        raise TypeError("logits_processor must be a function f(input_ids, logits) or a list of them")
    return list(fns)


class Processing:
    """One sequence's logits processors and its input ids (prompt + generated, int32)."""

    def __init__(self, fns: Sequence[LogitsProcessor], tokens: Sequence[int]):
        self.fns = fns
        self.ids = np.empty(max(64, 2 * len(tokens)), np.int32)
        self.n = len(tokens)
        self.ids[: self.n] = tokens

    def push(self, tok: int) -> None:
        if self.n == len(self.ids):
            self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
        self.ids[self.n] = tok
        self.n += 1

    def apply(self, ctx: Context, idx: int = -1) -> None:
        """Run the processors on the logits at batch position idx and write the result back
        (Context.set_logits), where the sampler reads them."""
        logits = ctx.logits(idx)
        ids = self.ids[: self.n]
        ids.flags.writeable = False
        for f in self.fns:
            out = f(ids, logits)
            if out is not None:
                logits = out
        arr = np.asarray(logits)
        if arr.shape != (ctx.model.n_vocab,):
            raise ValueError(f"a logits processor returned shape {arr.shape}; expected ({ctx.model.n_vocab},)")
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        top = arr.max()  # NaN if any value is NaN: one pass per token checks NaN, +inf and all -inf
        if np.isnan(top) or top == np.inf:
            raise ValueError("a logits processor returned NaN or +inf logits (use -inf to forbid a token)")
        if top == -np.inf:
            raise ValueError("the logits processors forbade every token (all logits are -inf)")
        ctx.set_logits(arr, idx)


class SupersededError(RuntimeError):
    """A stream was resumed after a newer generate() call reused its context."""


def _check_current(ctx: Context, me: int) -> None:
    if ctx.generation != me:
        raise SupersededError(
            "a newer generate() call on this context replaced this stream's KV cache; "
            "use one context per concurrent stream (Model.context())"
        )


def _loop(
    ctx: Context,
    tokens: list[int],
    max_tokens: int,
    sampler: Sampler,
    stops: list[str],
    n_logprobs: int | None,
    draft: speculative.Speculator | None,
    on_device: bool = False,
    proc: Processing | None = None,
    media: multimodal.MediaPrompt | None = None,
    keep: int | None = None,
) -> Generator[str, None, GenerationResult]:
    model = ctx.model
    me = ctx.start_generation()
    n_ctx = ctx.n_ctx
    timings = Timings(prompt_tokens=media.n_tokens if media is not None else len(tokens))

    out = TextState(model, stops)
    generated: list[int] = []
    lps: list[TokenLogprob] | None = [] if n_logprobs is not None else None
    finish = "length"
    pending: list[int] = []  # tokens sampled ahead by speculative decoding, not yet emitted
    t0 = t1 = time.perf_counter()
    try:
        sampler.accept(
            media.text_tokens if media is not None else tokens
        )  # penalties see the prompt, as llama.cpp's tools
        if on_device:
            sampler.attach(ctx)  # False: llama.cpp keeps it on the CPU
        # on the device, the prefill samples the first token
        timings.prompt_reused = multimodal.prefill(ctx, media) if media is not None else ctx.prefill(tokens)
        t1 = time.perf_counter()
        timings.prompt_ms = (t1 - t0) * 1e3
        while len(generated) < max_tokens:
            _check_current(ctx, me)
            if pending:
                tok = pending.pop(0)
            elif draft is not None:
                batch = draft.step(ctx, sampler, max_tokens - len(generated))
                tok, pending = batch[0], batch[1:]
            else:
                if proc is not None:
                    proc.apply(ctx)
                tok = sampler.sample(ctx)
            if lps is not None and n_logprobs is not None:
                lps.append(_logprob(ctx, -1, tok, n_logprobs))
            if model.is_eog(tok):
                finish = "stop"
                break
            generated.append(tok)
            if proc is not None:
                proc.push(tok)
            piece = out.feed(tok)
            if piece:
                yield piece
            if out.matched is not None:
                finish = "stop"
                break
            if len(generated) >= max_tokens:
                break
            if pending:
                continue  # speculative decoding already evaluated it
            if keep is not None and ctx.n_cells + 1 >= n_ctx:  # context shift, as llama-server's pre_decode
                n_left = ctx.n_past - keep
                ctx.shift(keep, max(0, min(n_left // 2, n_left - 1)))
                timings.context_shifts += 1
            elif ctx.n_cells >= n_ctx:
                break  # the context is full: finish_reason "length"
            if draft is None:
                _check_current(ctx, me)  # resumed after a yield: a newer generation may own the cache
                ctx.decode([tok])
        piece = out.finish()
        if piece:
            yield piece
    finally:
        timings.generated_tokens = len(generated)
        timings.generate_ms = (time.perf_counter() - t1) * 1e3
        sampler.close()  # detaches it first
        if draft is not None:
            draft.close()
        if pending:  # speculative tokens evaluated but not used: drop them from the cache
            ctx.truncate(ctx.n_past - len(pending))
        release_threads()
    return GenerationResult(
        text=out.text,
        tokens=generated,
        finish_reason=finish,
        prompt_tokens=timings.prompt_tokens,
        timings=timings,
        stop=out.matched,
        logprobs=lps,
    )


class Stream(Generic[R]):
    """Text pieces of a streaming generation, each a whole number of UTF-8 characters.

    Iterate to receive ``str`` pieces; afterwards :attr:`result` holds the GenerationResult (a
    ChatResult for chat). ``close()`` stops the generation early. Made by generate/chat with
    ``stream=True``, around ``gen``: a generator of the pieces that returns the result.
    """

    def __init__(self, gen: Generator[str, None, R]):
        self._gen = gen
        self.result: R | None = None

    def __iter__(self) -> Stream[R]:
        return self

    def __next__(self) -> str:
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            raise StopIteration from None

    def close(self) -> None:
        """Stop the generation early; :attr:`result` stays None. The context keeps what was decoded."""
        self._gen.close()

    def __enter__(self) -> Stream[R]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def collect(gen: Generator[str, None, R]) -> R:
    """Run a generation to its end and return its result."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value
