"""Speculative decoding: a cheap proposer (a draft model, or n-gram lookup in the context) guesses
the next tokens; the target model evaluates them in one llama_decode with logits for every position
and the sampler accepts them while its own choice agrees (as common_sampler_sample_and_accept_n in
llama.cpp's speculative tools). Each accepted token is exactly what the sampler would have chosen
token by token, so the output equals non-speculative decoding with the same seed."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _core
from .generation import _int

if TYPE_CHECKING:
    from .model import Context, Model


class _Speculator:
    """Proposes tokens and runs one verify step; ``last`` is a token sampled but not yet evaluated."""

    def __init__(self, n_draft: int):
        self.n_draft = n_draft
        self.last: int | None = None

    def propose(self, history: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the proposer holds (called when the generation ends)."""

    def step(self, ctx: "Context", sampler: _core.Sampler, remaining: int) -> list[int]:
        """Tokens to emit, in order; all of them are in ctx's KV cache when this returns."""
        native = ctx._c
        tok = self.last if self.last is not None else sampler.sample(native)
        self.last = None
        if ctx.model.is_eog(tok):
            return [tok]  # the loop stops there: nothing to evaluate
        n0 = native.pos(0)
        k = max(0, min(self.n_draft, remaining - 1, native.n_ctx - n0 - 1, native.n_batch - 1))
        draft = self.propose(ctx._tokens + [tok], k) if k > 0 else []
        native.decode([tok] + draft, 0, True)  # logits for every position
        ctx._track(n0, [tok] + draft)
        out = [tok]
        for i, d in enumerate(draft):
            t = sampler.sample(native, i)
            if t != d:
                self.last = t
                break
            out.append(t)
        else:
            self.last = sampler.sample(native, len(draft))
        if len(out) - 1 < len(draft):
            ctx._truncate(n0 + len(out))  # drop the rejected draft tokens from the KV cache
        return out


class _DraftModel(_Speculator):
    """Greedy proposals from a smaller model with the same vocabulary."""

    def __init__(self, target: "Context", draft: "Model", n_draft: int):
        super().__init__(n_draft)
        if draft.n_vocab != target.model.n_vocab:
            raise ValueError(f"the draft model's vocabulary ({draft.n_vocab} tokens) differs from the target's "
                             f"({target.model.n_vocab})")
        self.ctx = draft.context(n_ctx=target.n_ctx, n_batch=target.n_batch, n_threads=target.n_threads)
        self.greedy = _core.Sampler(draft._m, {"temperature": 0.0, "top_k": 1}, None)

    def close(self) -> None:
        self.greedy.close()
        self.ctx.close()

    def propose(self, history: list[int], k: int) -> list[int]:
        from .generation import _prefill

        _prefill(self.ctx, history)
        out: list[int] = []
        for _ in range(k):
            t = self.greedy.sample(self.ctx._c)
            if self.ctx.model.is_eog(t):
                break
            out.append(t)
            if len(out) < k:
                self.ctx.decode([t])
        return out


class _NgramLookup(_Speculator):
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
            if history[start:start + n] == key:
                return history[start + n:start + n + k]
        return []


def make(ctx: "Context", draft_model: "Model | None", lookup_ngram: int | None, n_draft: int) -> _Speculator | None:
    """The speculator for Context.generate's arguments, or None."""
    if draft_model is None and lookup_ngram is None:
        return None
    if draft_model is not None and lookup_ngram is not None:
        raise ValueError("give either draft_model or lookup_ngram, not both")
    _int("n_draft", n_draft, 1, 64)
    if lookup_ngram is not None:
        return _NgramLookup(_int("lookup_ngram", lookup_ngram, 1, 8), n_draft)
    from .model import Model

    if not isinstance(draft_model, Model):
        raise TypeError(f"draft_model must be a llamabind.Model; got {type(draft_model).__name__}")
    return _DraftModel(ctx, draft_model, n_draft)

