"""Text generation over a Context: the sampling loop, streaming, stop strings, timings."""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from . import _core, _log

if TYPE_CHECKING:
    from .model import Context

__all__ = ["GenerationResult", "Timings", "Stream", "SamplingParams", "SupersededError"]


@dataclass(frozen=True)
class SamplingParams:
    """Parameters of llama.cpp's sampler chain, in the chain's order.

    temperature: >= 0; 0 (or less) means greedy decoding (argmax). top_k: >= 0, 0 disables.
    top_p: in (0, 1], 1 disables. min_p: in [0, 1], 0 disables. repeat_penalty: > 0, 1 disables;
    applied over the last ``repeat_last_n`` tokens (-1: the whole context). seed: 32-bit
    unsigned; None draws a random seed.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def build(self, model: _core.Model) -> _core.Sampler:
        seed = 0xFFFFFFFF if self.seed is None else self.seed  # LLAMA_DEFAULT_SEED: random
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= 0xFFFFFFFF:
            raise ValueError(f"seed must be an int in [0, 2**32 - 1] or None; got {self.seed!r}")
        return _core.Sampler(model, float(self.temperature), int(self.top_k), float(self.top_p),
                             float(self.min_p), float(self.repeat_penalty), int(self.repeat_last_n),
                             float(self.frequency_penalty), float(self.presence_penalty), seed)


@dataclass
class Timings:
    """Wall-clock timings of one generation. Times in milliseconds, rates in tokens/second."""

    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    generated_tokens: int = 0
    generate_ms: float = 0.0

    @property
    def prompt_tps(self) -> float:
        """Prompt processing speed (tokens/s): prompt tokens / time of their llama_decode."""
        return self.prompt_tokens / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def generated_tps(self) -> float:
        """Generation speed (tokens/s): generated tokens / time from the first sample to the end,
        sampling and detokenization included."""
        return self.generated_tokens / (self.generate_ms / 1e3) if self.generate_ms > 0 else 0.0

    def summary(self) -> str:
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


def run(ctx: "Context", prompt: str | Sequence[int], max_tokens: int, sampling: SamplingParams,
        stop: str | Sequence[str] | None, add_special: bool, parse_special: bool) -> Iterator[str]:
    """Validate everything, then return the generation loop: a generator of text pieces whose
    return value is the GenerationResult."""
    _log.sync_level()
    model = ctx.model
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an int >= 0; got {max_tokens!r}")
    stops = _normalize_stop(stop)
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
    sampler = sampling.build(model._m)
    return _loop(ctx, model, tokens, max_tokens, sampler, stops)


class SupersededError(RuntimeError):
    """A stream was resumed after a newer generate() call reused its context."""


def _loop(ctx: "Context", model, tokens: list[int], max_tokens: int, sampler, stops: list[str]) -> Iterator[str]:
    ctx._generation += 1
    me = ctx._generation
    native = ctx._c
    n_ctx = native.n_ctx
    timings = Timings(prompt_tokens=len(tokens))

    native.clear()
    t0 = time.perf_counter()
    native.decode(tokens)
    timings.prompt_ms = (time.perf_counter() - t0) * 1e3
    sampler.accept(model._m, tokens)  # penalties see the prompt, as in llama.cpp's tools

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    emitted = 0
    generated: list[int] = []
    finish = "length"
    matched = None
    t1 = time.perf_counter()
    try:
        while len(generated) < max_tokens:
            if ctx._generation != me:
                raise SupersededError("a newer generate() call on this context replaced this stream's KV cache; "
                                      "use one context per concurrent stream (Model.context())")
            tok = sampler.sample(native)
            if model.is_eog(tok):
                finish = "stop"
                break
            generated.append(tok)
            before = len(text)
            text += decoder.decode(model.token_to_piece(tok))
            if stops:
                hit = None
                for s in stops:
                    i = text.find(s, max(0, before - len(s) + 1))
                    if i >= 0 and (hit is None or i < hit[0]):
                        hit = (i, s)
                if hit is not None:
                    text = text[: hit[0]]
                    finish, matched = "stop", hit[1]
                    break
            safe = len(text) - _held_back(text, stops)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if len(generated) >= max_tokens:
                break
            if native.n_past >= n_ctx:
                break  # the context is full: finish_reason "length"
            native.decode([tok])
        if finish != "stop" or matched is None:
            text += decoder.decode(b"", final=True)
        if len(text) > emitted:
            yield text[emitted:]
    finally:
        timings.generated_tokens = len(generated)
        timings.generate_ms = (time.perf_counter() - t1) * 1e3
        sampler.close()
    return GenerationResult(text=text, tokens=generated, finish_reason=finish, prompt_tokens=len(tokens),
                            timings=timings, stop=matched)


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
