"""Text generation over a Context: the sampling loop, streaming, stop strings, timings."""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from . import _core, _log

if TYPE_CHECKING:
    from .model import Context

__all__ = ["GenerationResult", "Timings", "Stream", "SamplingParams", "SupersededError", "TokenLogprob"]


def _num(name: str, v, lo: float | None = None, hi: float | None = None, lo_open=False, note="") -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number; got {type(v).__name__}")
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite; got {v}")
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        lb = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {lb}{lo}, {hi if hi is not None else 'inf'}]{note}; got {v}")
    return v


def _int(name: str, value, lo: int, hi: int | None = None, note: str = "") -> int:
    """value as an int in [lo, hi]: TypeError for a non-int (bool too), ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}{note}; got {value}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Parameters of llama.cpp's sampler chain (common_sampler: logit_bias -> penalties -> DRY ->
    top_n_sigma -> top_k -> typical_p -> top_p -> min_p -> XTC -> temperature -> dist; or
    mirostat). Every probability is in [0, 1]; out-of-range values raise ValueError.

    temperature: >= 0; 0 is greedy decoding (argmax). dynatemp_range >= 0 (0: off), dynatemp_exponent > 0.
    top_k: >= 0 tokens, 0 disables. top_p: (0, 1], 1 disables. min_p: [0, 1], 0 disables.
    typical_p: (0, 1], 1 disables. top_n_sigma: -1 disables, else > 0 (standard deviations).
    xtc_probability: [0, 1], 0 disables; xtc_threshold: [0, 1] (> 0.5 disables).
    repeat_penalty: > 0, 1 disables; frequency_penalty, presence_penalty: [-2, 2], 0 disables;
    all three over the last repeat_last_n tokens (0 disables, -1: the whole context).
    dry_multiplier: >= 0, 0 disables DRY; dry_base: >= 1; dry_allowed_length: >= 0 tokens;
    dry_penalty_last_n: -1 (whole context), 0 (off) or a number of tokens; dry_sequence_breakers.
    mirostat: 0 off, 1 (v1) or 2 (v2), with mirostat_tau (target surprise, > 0) and mirostat_eta
    (learning rate, (0, 1]). logit_bias: {token id: additive bias}, ``-inf`` bans a token.
    ignore_eos: never stop at an end-of-generation token. min_keep: >= 0 tokens every filter keeps.
    grammar: a GBNF grammar that every generated token must follow (see also json_schema in
    :meth:`Context.generate`). seed: 32-bit unsigned; None draws a random seed.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    min_keep: int = 0
    grammar: str | None = None
    seed: int | None = None

    FIELDS = ()  # set below

    def __post_init__(self):
        _num("temperature", self.temperature, 0.0, note=" (0: greedy)")
        _num("dynatemp_range", self.dynatemp_range, 0.0)
        _num("dynatemp_exponent", self.dynatemp_exponent, 0.0, lo_open=True)
        _int("top_k", self.top_k, 0, note=" (0 disables)")
        _num("top_p", self.top_p, 0.0, 1.0, lo_open=True, note=" (1 disables)")
        _num("min_p", self.min_p, 0.0, 1.0, note=" (0 disables)")
        _num("typical_p", self.typical_p, 0.0, 1.0, lo_open=True, note=" (1 disables)")
        if _num("top_n_sigma", self.top_n_sigma) != -1.0 and self.top_n_sigma <= 0:
            raise ValueError(f"top_n_sigma must be > 0, or -1 to disable; got {self.top_n_sigma}")
        _num("xtc_probability", self.xtc_probability, 0.0, 1.0)
        _num("xtc_threshold", self.xtc_threshold, 0.0, 1.0)
        _num("repeat_penalty", self.repeat_penalty, 0.0, lo_open=True, note=" (1 disables)")
        _int("repeat_last_n", self.repeat_last_n, -1, note=" (-1: whole context, 0 disables)")
        _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _num("dry_multiplier", self.dry_multiplier, 0.0, note=" (0 disables)")
        _num("dry_base", self.dry_base, 1.0)
        _int("dry_allowed_length", self.dry_allowed_length, 0)
        _int("dry_penalty_last_n", self.dry_penalty_last_n, -1)
        if isinstance(self.dry_sequence_breakers, str) or not all(isinstance(b, str) and b for b in self.dry_sequence_breakers):
            raise TypeError("dry_sequence_breakers must be a sequence of non-empty str")
        _int("mirostat", self.mirostat, 0, 2, note=" (0 off, 1 or 2)")
        _num("mirostat_tau", self.mirostat_tau, 0.0, lo_open=True)
        _num("mirostat_eta", self.mirostat_eta, 0.0, 1.0, lo_open=True)
        _int("min_keep", self.min_keep, 0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError("logit_bias must be a dict {token id: bias}")
            for k, v in self.logit_bias.items():
                _int("logit_bias token", k, 0)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v == float("inf"):
                    raise ValueError(f"logit_bias values must be finite numbers or -inf; got {v!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise TypeError(f"grammar must be a str (GBNF); got {type(self.grammar).__name__}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 0xFFFFFFFF:
                raise ValueError(f"seed must be an int in [0, 2**32 - 1] or None; got {self.seed!r}")

    def build(self, model: _core.Model, chat: _core.ChatParams | None = None) -> _core.Sampler:
        """The native sampler chain (common_sampler_init). Raises ValueError for a grammar that
        does not parse."""
        d = {f: getattr(self, f) for f in SamplingParams.FIELDS}
        d["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        d["logit_bias"] = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        return _core.Sampler(model, d, chat)

    @classmethod
    def split(cls, kwargs: dict) -> tuple["SamplingParams", dict]:
        """(SamplingParams from the sampling keys of kwargs, the other keys)."""
        mine = {k: kwargs[k] for k in kwargs if k in cls.FIELDS}
        return cls(**mine), {k: v for k, v in kwargs.items() if k not in cls.FIELDS}


SamplingParams.FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass
class Timings:
    """Wall-clock timings of one generation. Times in milliseconds, rates in tokens/second."""

    prompt_tokens: int = 0
    prompt_reused: int = 0  # prompt tokens whose KV cache entries were kept from the previous call
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generate_ms: float = 0.0

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
        return (f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s | "
                f"generated: {self.generated_tokens} tokens, {self.generated_tps:.1f} tokens/s")


@dataclass
class GenerationResult:
    """The outcome of a generation.

    text: the generated text (without the prompt, and without a matched stop string).
    tokens: generated token ids (an end-of-generation token is not included).
    finish_reason: ``"stop"`` (end-of-generation token or a stop string) or ``"length"``
    (max_tokens reached, or the context is full). stop: the stop string that matched, if any.
    """

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop: str | None = None
    logprobs: list[TokenLogprob] | None = None


def _normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a str or a sequence of str; got an element of type {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must not be empty")
        out.append(s)
    return out


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


def run(ctx: "Context", prompt: str | Sequence[int], max_tokens: int, sampling: SamplingParams,
        stop: str | Sequence[str] | None, add_special: bool, parse_special: bool, *, logprobs: int | None = None,
        chat=None, draft=None) -> Iterator[str]:
    """Validate everything, then return the generation loop: a generator of text pieces whose
    return value is the GenerationResult."""
    _log.sync_level()
    model = ctx.model
    _int("max_tokens", max_tokens, 0)
    if logprobs is not None:
        _int("logprobs", logprobs, 0, 100, note=" (top alternatives per token)")
    stops = _normalize_stop(stop)
    if chat is not None:
        stops += [s for s in chat.additional_stops if s and s not in stops]
    if isinstance(prompt, str):
        tokens = model.tokenize(prompt, add_special=add_special, parse_special=parse_special)
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be a str or a sequence of token ids, not bytes; decode it first")
    else:
        tokens = [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty: it tokenized to no tokens (this model adds no BOS)")
    n_ctx = ctx.n_ctx
    if len(tokens) >= n_ctx:
        raise ValueError(f"the prompt has {len(tokens)} tokens, which leaves no room in n_ctx ({n_ctx}); "
                         "use a larger n_ctx or a shorter prompt")
    for t in tokens:
        if not 0 <= t < model.n_vocab:
            raise ValueError(f"token id {t} in the prompt is out of range: expected 0 <= id < n_vocab ({model.n_vocab})")
    sampler = sampling.build(model._m, chat)
    return _loop(ctx, model, tokens, max_tokens, sampler, stops, logprobs, draft)


class _TextState:
    """Incremental detokenization of one sequence: whole UTF-8 characters only, stop strings
    matched across token boundaries and never emitted (nor a prefix of one that may still match)."""

    def __init__(self, model, stops: list[str]):
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
            piece, self.emitted = self.text[self.emitted:safe], safe
            return piece
        return ""

    def finish(self) -> str:
        """The rest of the text (an incomplete character becomes U+FFFD)."""
        if self.matched is None:
            self.text += self.decoder.decode(b"", final=True)
        piece, self.emitted = self.text[self.emitted:], len(self.text)
        return piece


def _logprob(model, native, idx: int, tok: int, n: int) -> TokenLogprob:
    def text(t: int) -> str:
        return model.token_to_piece(t, special=True).decode("utf-8", "replace")

    lp, ids, tlp = native.logprobs(idx, tok, n)
    return TokenLogprob(tok, text(tok), lp, [(i, text(i), v) for i, v in zip(ids, tlp)])


class SupersededError(RuntimeError):
    """A stream was resumed after a newer generate() call reused its context."""


def _prefill(ctx: "Context", tokens: list[int]) -> int:
    """Bring sequence 0 of the KV cache to hold ``tokens``, reusing the longest prefix it already
    holds (at least the last token is evaluated, for its logits). Returns the reused count."""
    cached = ctx._tokens if len(ctx._tokens) == ctx.n_past else []
    n = 0
    limit = min(len(cached), len(tokens) - 1)
    while n < limit and cached[n] == tokens[n]:
        n += 1
    if n == 0:
        ctx.clear()
    else:
        ctx._truncate(n)
    ctx.decode(tokens[n:])
    return n


def _loop(ctx: "Context", model, tokens: list[int], max_tokens: int, sampler, stops: list[str],
          n_logprobs: int | None, draft) -> Iterator[str]:
    ctx._generation += 1
    me = ctx._generation
    native = ctx._c
    n_ctx = native.n_ctx
    timings = Timings(prompt_tokens=len(tokens))

    out = _TextState(model, stops)
    generated: list[int] = []
    lps: list[TokenLogprob] | None = [] if n_logprobs is not None else None
    finish = "length"
    pending: list[int] = []  # tokens sampled ahead by speculative decoding, not yet emitted
    t0 = t1 = time.perf_counter()
    try:
        timings.prompt_reused = _prefill(ctx, tokens)
        t1 = time.perf_counter()
        timings.prompt_ms = (t1 - t0) * 1e3
        sampler.accept(tokens)  # penalties see the prompt, as in llama.cpp's tools
        while len(generated) < max_tokens:
            if ctx._generation != me:
                raise SupersededError("a newer generate() call on this context replaced this stream's KV cache; "
                                      "use one context per concurrent stream (Model.context())")
            if pending:
                tok = pending.pop(0)
            elif draft is not None:
                batch = draft.step(ctx, sampler, max_tokens - len(generated))
                tok, pending = batch[0], batch[1:]
            else:
                tok = sampler.sample(native)
            if lps is not None:
                lps.append(_logprob(model, native, -1, tok, n_logprobs))
            if model.is_eog(tok):
                finish = "stop"
                break
            generated.append(tok)
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
            if native.pos(0) >= n_ctx:
                break  # the context is full: finish_reason "length"
            if draft is None:
                ctx.decode([tok])
        piece = out.finish()
        if piece:
            yield piece
    finally:
        timings.generated_tokens = len(generated)
        timings.generate_ms = (time.perf_counter() - t1) * 1e3
        sampler.close()
        if draft is not None:
            draft.close()
        if pending:  # speculative tokens evaluated but not used: drop them from the cache
            ctx._truncate(len(ctx._tokens) - len(pending))
    return GenerationResult(text=out.text, tokens=generated, finish_reason=finish, prompt_tokens=len(tokens),
                            timings=timings, stop=out.matched, logprobs=lps)


class Stream:
    """Text pieces of a streaming generation, each a whole number of UTF-8 characters.

    Iterate to receive ``str`` pieces; afterwards :attr:`result` holds the GenerationResult.
    ``close()`` stops the generation early.
    """

    def __init__(self, gen: Iterator[str]):
        self._gen = gen
        self.result: GenerationResult | None = None

    def __iter__(self) -> "Stream":
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

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def collect(gen: Iterator[str]) -> GenerationResult:
    """Run a generation to its end and return its result."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value
