"""Speculative decoding: a cheap proposer (a draft model, or n-gram lookup in the context) guesses
the next tokens; the target model evaluates them in one llama_decode with logits for every position
and the sampler accepts them while its own choice agrees (as common_sampler_sample_and_accept_n in
llama.cpp's speculative tools). Each accepted token is exactly what the sampler would have chosen
token by token, so the output equals non-speculative decoding with the same seed.

A feature module: it uses public members of Context/Model only."""

from __future__ import annotations

from ._validate import as_int
from .context import Context
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["Speculator", "make"]


class Speculator:
    """Proposes tokens and runs one verify step; ``last`` is a token sampled but not yet evaluated."""

    def __init__(self, n_draft: int):
        self.n_draft = n_draft
        self.last: int | None = None

    def propose(self, history: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the proposer holds (called when the generation ends)."""

    def step(self, ctx: Context, sampler: Sampler, remaining: int) -> list[int]:
        """Tokens to emit, in order; all of them are in ctx's KV cache when this returns."""
        tok = self.last if self.last is not None else sampler.sample(ctx)
        self.last = None
        if ctx.model.is_eog(tok):
            return [tok]  # the loop stops there: nothing to evaluate
        n0 = ctx.n_past
        k = max(0, min(self.n_draft, remaining - 1, ctx.n_ctx - n0 - 1, ctx.n_batch - 1))
        draft = self.propose(ctx.tokens + [tok], k) if k > 0 else []
        ctx.decode([tok] + draft, all_logits=True)  # logits for every position
        out = [tok]
        for i, d in enumerate(draft):
            t = sampler.sample(ctx, i)
            if t != d:
                self.last = t
                break
            out.append(t)
        else:
            self.last = sampler.sample(ctx, len(draft))
        if len(out) - 1 < len(draft):
            ctx.truncate(n0 + len(out))  # drop the rejected draft tokens from the KV cache
        return out


class _DraftModel(Speculator):
    """Greedy proposals from a smaller model with the same vocabulary."""

    def __init__(self, target: Context, draft: Model, n_draft: int):
        super().__init__(n_draft)
        if draft.n_vocab != target.model.n_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft.n_vocab} tokens) differs from the target's "
                f"({target.model.n_vocab})"
            )
        params = {
            **draft.context_params,
            "n_ctx": target.n_ctx,
            "n_batch": target.n_batch,
            "n_threads": target.n_threads,
        }
        self.ctx = Context(draft, **params)
        self.greedy = SamplingParams(temperature=0.0, top_k=1).build(draft)

    def close(self) -> None:
        self.greedy.close()
        self.ctx.close()

    def propose(self, history: list[int], k: int) -> list[int]:
        self.ctx.prefill(history)
        out: list[int] = []
        for _ in range(k):
            t = self.greedy.sample(self.ctx)
            if self.ctx.model.is_eog(t):
                break
            out.append(t)
            if len(out) < k:
                self.ctx.decode([t])
        return out


class _NgramLookup(Speculator):
    """Proposals from the context itself: the tokens that followed the most recent earlier
    occurrence of the last n tokens (prompt lookup decoding)."""

    def __init__(self, n: int, n_draft: int):
        super().__init__(n_draft)
        self.n = n

    def propose(self, history: list[int], k: int) -> list[int]:
        n = self.n
        if len(history) <= n:
            return []
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == key:
                return history[start + n : start + n + k]
        return []


def make(ctx: Context, draft_model: Model | None, lookup_ngram: int | None, n_draft: int) -> Speculator | None:
    """The speculator for generate's arguments, or None."""
    if draft_model is None and lookup_ngram is None:
        return None
    if draft_model is not None and lookup_ngram is not None:
        raise ValueError("give either draft_model or lookup_ngram, not both")
    as_int(n_draft, "n_draft", 1, 64)
    if lookup_ngram is not None:
        return _NgramLookup(as_int(lookup_ngram, "lookup_ngram", 1, 8), n_draft)
    if not isinstance(draft_model, Model):
        raise TypeError(f"draft_model must be a llamabind.Model; got {type(draft_model).__name__}")
    return _DraftModel(ctx, draft_model, n_draft)
