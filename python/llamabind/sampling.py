"""The sampler chain: :class:`SamplingParams` (validated, frozen) and :class:`Sampler`, llama.cpp
common's sampler built from them (common_sampler_init: the chain llama-cli and llama-server use)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from . import _core
from ._validate import as_float, as_int, sampling_kwargs

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

__all__ = ["SamplingParams", "Sampler"]


@dataclass(frozen=True)
class SamplingParams:
    """Parameters of llama.cpp's sampler chain (common_sampler: logit_bias -> penalties -> DRY ->
    top_n_sigma -> top_k -> typical_p -> top_p -> min_p -> XTC -> temperature -> dist; or
    mirostat). Every probability is in [0, 1]; an out-of-range value raises ValueError.

    Attributes:
        temperature: 0 is greedy decoding (argmax); any value >= 0.
        top_k: keep the k most likely tokens, >= 0; 0 disables.
        top_p: nucleus sampling, (0, 1]; 1 disables.
        min_p: drop tokens below this fraction of the likeliest's, [0, 1]; 0 disables.
        typical_p: locally typical sampling, (0, 1]; 1 disables.
        top_n_sigma: keep tokens within this many standard deviations of the top logit, > 0; -1 disables.
        xtc_probability: XTC's chance to exclude the top choices, [0, 1]; 0 disables.
        xtc_threshold: XTC's probability threshold, [0, 1] (> 0.5 disables).
        dynatemp_range: dynamic temperature's range, >= 0 (0: off).
        dynatemp_exponent: dynamic temperature's exponent, > 0.
        repeat_penalty: > 0, 1 disables; over the last repeat_last_n tokens.
        repeat_last_n: the tokens the three penalties look back over (0 disables, -1: the whole context).
        frequency_penalty: [-2, 2], 0 disables.
        presence_penalty: [-2, 2], 0 disables.
        dry_multiplier: DRY's multiplier, >= 0; 0 disables DRY.
        dry_base: DRY's base, >= 1.
        dry_allowed_length: repeated tokens DRY lets pass, >= 0.
        dry_penalty_last_n: the tokens DRY looks back over: -1 (the whole context), 0 (off) or a count.
        dry_sequence_breakers: strings that end a repeated sequence for DRY.
        mirostat: 0 off, 1 (v1) or 2 (v2); it replaces the chain's filters.
        mirostat_tau: mirostat's target surprise, > 0.
        mirostat_eta: mirostat's learning rate, (0, 1].
        logit_bias: {token id: additive bias}; ``-inf`` bans a token.
        ignore_eos: never stop at an end-of-generation token.
        min_keep: >= 0 tokens every filter keeps.
        grammar: a GBNF grammar that every generated token must follow (see also json_schema in
            :meth:`Context.generate`).
        seed: 32-bit unsigned; None draws a random seed.
        backend_sampling: run the chain inside the decode graph on the output layer's device
            (llama_set_sampler, experimental upstream; llama-server's ``backend_sampling``): only the
            sampled token is copied back instead of n_vocab logits, and the samplers with ggml versions
            (logit bias, penalties, top_k, top_p, min_p, temperature, greedy/dist) run there; a sampler
            without one (DRY, typical_p, XTC, top_n_sigma, mirostat) and those after it run on the CPU
            over the surviving candidates. ``None`` (default): on for greedy decoding (temperature 0) when
            the model's output layer is on a GPU and the generation allows it (no grammar or JSON schema,
            no logprobs, no speculative decoding); ``True``: required (ValueError where not allowed), also
            with temperature > 0; ``False``: never. Greedy decoding gives the same tokens either way. With
            temperature > 0 the device draws from the same distribution (on the CPU backend, the same
            tokens for a seed); on an H100 two calls with the same seed gave different first tokens, not
            separated from the GPU's prompt-reuse rounding (which moved a CPU-sampled draw on Vulkan
            too), so it is not on by default there.
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
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    min_keep: int = 0
    grammar: str | None = None
    seed: int | None = None
    backend_sampling: bool | None = None

    FIELDS: ClassVar[tuple[str, ...]] = ()  # set below

    def __post_init__(self):
        as_float(self.temperature, "temperature", 0.0, note=" (0: greedy)")
        as_float(self.dynatemp_range, "dynatemp_range", 0.0)
        as_float(self.dynatemp_exponent, "dynatemp_exponent", 0.0, lo_open=True)
        as_int(self.top_k, "top_k", 0, note=" (0 disables)")
        as_float(self.top_p, "top_p", 0.0, 1.0, lo_open=True, note=" (1 disables)")
        as_float(self.min_p, "min_p", 0.0, 1.0, note=" (0 disables)")
        as_float(self.typical_p, "typical_p", 0.0, 1.0, lo_open=True, note=" (1 disables)")
        if as_float(self.top_n_sigma, "top_n_sigma") != -1.0 and self.top_n_sigma <= 0:
            raise ValueError(f"top_n_sigma must be > 0, or -1 to disable; got {self.top_n_sigma}")
        as_float(self.xtc_probability, "xtc_probability", 0.0, 1.0)
        as_float(self.xtc_threshold, "xtc_threshold", 0.0, 1.0)
        as_float(self.repeat_penalty, "repeat_penalty", 0.0, lo_open=True, note=" (1 disables)")
        as_int(self.repeat_last_n, "repeat_last_n", -1, note=" (-1: whole context, 0 disables)")
        as_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        as_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        as_float(self.dry_multiplier, "dry_multiplier", 0.0, note=" (0 disables)")
        as_float(self.dry_base, "dry_base", 1.0)
        as_int(self.dry_allowed_length, "dry_allowed_length", 0)
        as_int(self.dry_penalty_last_n, "dry_penalty_last_n", -1)
        if isinstance(self.dry_sequence_breakers, str) or not all(
            isinstance(b, str) and b for b in self.dry_sequence_breakers
        ):
            raise TypeError("dry_sequence_breakers must be a sequence of non-empty str")
        as_int(self.mirostat, "mirostat", 0, 2, note=" (0 off, 1 or 2)")
        as_float(self.mirostat_tau, "mirostat_tau", 0.0, lo_open=True)
        as_float(self.mirostat_eta, "mirostat_eta", 0.0, 1.0, lo_open=True)
        as_int(self.min_keep, "min_keep", 0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError("logit_bias must be a dict {token id: bias}")
            for k, v in self.logit_bias.items():
                as_int(k, "logit_bias token", 0)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v == float("inf"):
                    raise ValueError(f"logit_bias values must be finite numbers or -inf; got {v!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise TypeError(f"grammar must be a str (GBNF); got {type(self.grammar).__name__}")
        if self.backend_sampling is not None and not isinstance(self.backend_sampling, bool):
            raise TypeError(f"backend_sampling must be True, False or None; got {self.backend_sampling!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= 0xFFFFFFFF:
                raise ValueError(f"seed must be an int in [0, 2**32 - 1] or None; got {self.seed!r}")

    def build(self, model: Model, chat: Any = None) -> Sampler:
        """The native sampler chain for ``model`` (common_sampler_init); ``chat``: a rendered chat
        prompt (:meth:`ChatTemplates.apply`) whose grammar and triggers to apply. Raises ValueError
        for a grammar that does not parse."""
        d = {f: getattr(self, f) for f in SamplingParams.FIELDS if f != "backend_sampling"}
        d["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        d["logit_bias"] = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        return Sampler(_core.Sampler(model._llama_model, d, chat))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], caller: str) -> SamplingParams:
        """SamplingParams from keyword arguments; TypeError naming ``caller`` for an unknown name."""
        return cls(**sampling_kwargs(cls.FIELDS, kwargs, caller))


SamplingParams.FIELDS = tuple(f.name for f in fields(SamplingParams))


def sample_many(
    samplers: Sequence[Sampler], ctx: Context, idxs: Sequence[int], n_threads: int | None = None
) -> list[int]:
    """The next token of each chain, chain k from batch position ``idxs[k]`` of ``ctx``'s last batch, accepted into
    it: what ``samplers[k].sample(ctx, idxs[k])`` gives for each in turn, with the chains without a grammar sampled
    over ``n_threads`` threads (default: ``ctx``'s n_threads) with the GIL released (the candidates of every token,
    the chain, its token: common_sampler_sample's work, here for many sequences of one llama_decode at once).
    Chains attached to ``ctx`` (:meth:`Sampler.attach`) read the token their sequence's decode sampled.

    samplers: N chains, each once; idxs: N batch positions (ints, as :meth:`Context.decode_batch` returns them).
    Returns N token ids (a list of int), in the samplers' order. Wraps llama_get_logits_ith, llama_sampler_apply
    over common_sampler_get's chain and common_sampler_accept (common_sampler_sample for chains with a grammar).
    Raises ValueError for lengths that differ, a sampler given twice, a position not in the last batch (checked
    before any chain samples), a context without logits, n_threads outside [1, 512]; LlamaError when a chain
    fails."""
    if len(samplers) != len(idxs):
        raise ValueError(f"sample_many: {len(samplers)} samplers and {len(idxs)} positions; one position a sampler")
    threads = ctx.n_threads if n_threads is None else n_threads
    natives = [s._llama_sampler for s in samplers]
    return _core.sample_many(natives, ctx._llama_context, [int(i) for i in idxs], int(threads))


class Sampler:
    """A sampler chain in use (:meth:`SamplingParams.build`): it keeps state (penalty history,
    grammar position, mirostat, the RNG), so use one per generation and :meth:`close` it after.
    ``native``: the extension's chain (llama_sampler), which :meth:`SamplingParams.build` makes."""

    def __init__(self, native: _core.Sampler):
        self._llama_sampler = native

    def sample(self, ctx: Context, idx: int = -1) -> int:
        """The next token id from the logits of ``ctx``'s last batch at position idx (-1: the last
        output), accepted into the chain (common_sampler_sample + common_sampler_accept). Raises
        ValueError when ctx has no logits or idx is not a position of its last batch."""
        return self._llama_sampler.sample(ctx._llama_context, idx)

    def attach(self, ctx: Context, seq_id: int = 0) -> bool:
        """Run this chain inside ``ctx``'s decode graph for sequence ``seq_id`` (llama_set_sampler): the
        next decodes sample that sequence's outputs on the output device and :meth:`sample` reads the token
        (a chain a sequence: G completions decoded together each sample on the device). Returns False
        when llama.cpp cannot offload the chain's first sampler (sampling stays on the CPU).
        Until :meth:`detach` (or :meth:`close`), ``ctx`` gives no logits (ValueError). Raises
        ValueError for a chain with a grammar, one attached before, or a seq_id outside [0, n_seq_max)."""
        return self._llama_sampler.attach(ctx._llama_context, int(seq_id))

    def detach(self) -> None:
        """Take the chain out of the decode graph it was attached to (llama_set_sampler with no
        sampler; no-op if none); the context's last decode then has no logits until the next one.
        Raises LlamaError while another thread decodes on that context."""
        self._llama_sampler.detach()

    def accept(self, tokens: Sequence[int]) -> None:
        """Feed tokens (e.g. the prompt) to the chain's state: penalties see them; the grammar does
        not (common_sampler_accept with accept_grammar false). ValueError for an id out of range."""
        self._llama_sampler.accept(list(tokens))

    @property
    def description(self) -> str:
        """The chain, as common_sampler_print shows it (e.g. "logits -> ... -> dist")."""
        return self._llama_sampler.description

    @property
    def seed(self) -> int:
        """The RNG seed in use (drawn at random when SamplingParams.seed is None)."""
        return self._llama_sampler.seed

    def close(self) -> None:
        """Free the chain (common_sampler_free). Idempotent."""
        self._llama_sampler.close()

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
