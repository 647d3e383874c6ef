"""The native-facing layer, context side: :class:`Context`, a llama.cpp context (KV cache,
compute buffers, threads) on a :class:`~llamabind.model.Model`, with what the feature modules
build on: decode/eval, prompt-prefix reuse (:meth:`Context.prefill`, :meth:`Context.truncate`),
the generation handle, embeddings and LoRA; what it does with the sequences of its KV cache (batches of
several sequences, span edits, saved state) it inherits from :class:`~llamabind.context_kv.KVCache`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from . import _core, _log
from ._validate import as_int, one_of
from .build import default_threads
from .context_kv import KVCache
from .model import LoraAdapter, Model

__all__ = ["Context", "release_threads"]


def release_threads() -> None:
    """Free the calling thread's CPU thread team (OpenMP builds: omp_pause_resource_all with
    omp_pause_soft). The feature modules call it when a generation or an embedding call ends:
    a team left behind by one thread makes libgomp stop spinning in every other thread's team
    once the process has more OpenMP threads than cores (a decode on another thread then ran
    7x slower on 2 cores). The next decode on this thread starts a new team (~0.1 ms)."""
    _core.release_threads()


KV_CACHE_TYPES = {
    "f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7,
}  # fmt: skip
"""KV cache element types (name -> ggml_type), the ones llama.cpp's tools accept."""


class Context(KVCache):
    """A llama.cpp context on a :class:`Model`: the KV cache, compute buffers and threads.

    Args:
        model: the Model.
        n_ctx: context size in tokens (0: the model's n_ctx_train); >= 8. llama.cpp rounds it
            up to a multiple of 256; :attr:`n_ctx` gives the size in effect.
        n_batch: most tokens passed to one llama_decode (prompts are split into n_batch chunks).
        n_ubatch: physical batch size (<= n_batch).
        n_threads: CPU threads for generation and batch processing (None: all available cores).
        n_seq_max: independent sequences the KV cache holds (batched generation), 1..256.
        op_offload: with weights in host memory (n_gpu_layers below the layer count), let llama.cpp
            run large batches' ops on the GPU anyway (llama_context_params.op_offload, default
            True); False keeps every op of CPU-resident layers on the CPU.
        kv_unified: one KV buffer shared by all sequences (each may use all of n_ctx); False
            gives each sequence n_ctx / n_seq_max cells.
        embeddings: output embeddings instead of logits (see :func:`llamabind.batch.embed`).
        pooling: with embeddings, ``None`` (the model's), ``"none"``, ``"mean"``, ``"cls"``,
            ``"last"`` or ``"rank"``.
        training: a context for llama_opt_init (:class:`llamabind.train.Trainer` makes them): F32
            KV cache, no flash attention, n_ctx == n_batch == n_ubatch; n_seq_max windows of
            n_ctx / n_seq_max tokens (a multiple of 256), one sequence each, in one ubatch. Not for
            generation.
        training_profile: with training, time every node of the training graphs (the
            scheduler's eval callback; slower steps: :meth:`llamabind.train.Trainer.profile`).
        packed: with training, one window of n_ctx tokens (one KV stream) that holds up to n_seq_max
            documents, each attending only to itself with its positions from 0 (sequence packing:
            :meth:`llamabind.optimizer.Optimizer.eval`'s ``segments``; llama_opt_set_segments, patch 0096).
        type_k: the KV cache's K element type (llama_context_params.type_k, llama.cpp's
            ``--cache-type-k``): "f16" (default), "f32", "bf16", "q8_0", "q4_0", "q4_1",
            "iq4_nl", "q5_0", "q5_1"; q8_0 halves the cache's memory.
        type_v: the V element type (``--cache-type-v``), of the same types. A quantized V cache
            needs flash attention (ValueError with flash_attn="off").
        flash_attn: "auto" (llama.cpp's choice per device, default), "on" or "off".

    Raises ValueError for out-of-range parameters, LlamaError if llama.cpp cannot create the
    context (e.g. out of memory). One context must not be used by two threads at once: the
    second gets a LlamaError. Use one context per thread.
    """

    POOLING = {None: -1, "none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
    KV_CACHE_TYPES = KV_CACHE_TYPES

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        embeddings: bool = False,
        pooling: str | None = None,
        op_offload: bool = True,
        training: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
        flash_attn: str = "auto",
        training_profile: bool = False,
        packed: bool = False,
    ):
        _log.sync_level()
        if not isinstance(model, Model):
            raise TypeError(f"model must be a llamabind.Model; got {type(model).__name__}")
        n_ctx = as_int(n_ctx, "n_ctx", 0, 1 << 24, " (0: the model's n_ctx_train)")  # 0 and >= 8: checked natively
        n_batch = as_int(n_batch, "n_batch", 1, 1 << 24)
        n_ubatch = as_int(n_ubatch, "n_ubatch", 1, 1 << 24)
        n_threads = default_threads() if n_threads is None else as_int(n_threads, "n_threads", 1, 512)
        n_seq_max = as_int(n_seq_max, "n_seq_max", 1, 256)
        one_of(pooling, "pooling", self.POOLING)
        tk = KV_CACHE_TYPES[one_of(type_k, "type_k", KV_CACHE_TYPES)]
        tv = KV_CACHE_TYPES[one_of(type_v, "type_v", KV_CACHE_TYPES)]
        fa = {"auto": -1, "off": 0, "on": 1}[one_of(flash_attn, "flash_attn", ("auto", "off", "on"))]
        self.model = model
        self._generation = 0  # bumped by start_generation(); an older generation then refuses to continue
        self._tokens: list[int] = []  # the tokens of sequence 0 in the KV cache (prompt-prefix reuse)
        self._loras: dict[LoraAdapter, float] = {}
        self._llama_context = _core.Context(
            model._llama_model,
            n_ctx,
            n_batch,
            n_ubatch,
            n_threads,
            n_threads,
            n_seq_max,
            bool(embeddings),
            self.POOLING[pooling],
            bool(kv_unified),
            bool(op_offload),
            bool(training),
            tk,
            tv,
            fa,
            bool(training_profile),
            bool(packed),
        )

    def close(self) -> None:
        """Free the KV cache and compute buffers. Idempotent."""
        self._llama_context.close()

    @property
    def closed(self) -> bool:
        return self._llama_context.closed

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    n_ctx = property(lambda self: self._llama_context.n_ctx, doc="Context size in tokens (all sequences).")
    n_batch = property(lambda self: self._llama_context.n_batch, doc="Most tokens per llama_decode.")
    n_ubatch = property(lambda self: self._llama_context.n_ubatch, doc="Physical batch size.")
    n_threads = property(lambda self: self._llama_context.n_threads, doc="CPU threads.")
    n_seq_max = property(lambda self: self._llama_context.n_seq_max, doc="Sequences the KV cache holds.")

    @property
    def n_past(self) -> int:
        """The next position of sequence 0: the tokens it holds, where a medium of an M-RoPE model
        (Qwen2-VL ...) counts its n_pos positions, not its n_tokens (see :attr:`n_cells`)."""
        return self._llama_context.pos(0)

    @property
    def tokens(self) -> list[int]:
        """The token ids of sequence 0 in the KV cache (a copy)."""
        return list(self._tokens)

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Evaluate token ids after the tokens already in sequence 0 of the KV cache (wraps
        llama_decode, then llama_synchronize: the computation is finished when this returns).
        Logits are kept for the last token, or with all_logits for every token (positions
        0..len(tokens)-1 of :meth:`Sampler.sample`, e.g. to verify speculative drafts).

        The GIL is released while llama.cpp computes; Ctrl-C raises KeyboardInterrupt and leaves
        the cache as it was before the interrupted chunk. Raises ValueError for ids outside
        [0, n_vocab), an empty list, or more tokens than n_ctx has room for.
        """
        tokens = [int(t) for t in tokens]
        n0 = self._llama_context.pos(0)
        try:
            self._llama_context.decode(tokens, 0, bool(all_logits))
        except BaseException:
            self._track(n0, tokens)  # earlier chunks may have been kept
            raise
        if len(self._tokens) == n0:  # the per-token path: no second call into llama.cpp
            self._tokens += tokens

    def eval(self, tokens: Sequence[int], *, copy: bool = True) -> np.ndarray:
        """Evaluate tokens after sequence 0's cache and return the logits of every one of them:
        float32, shape (n_tokens, n_vocab); row i predicts the token after tokens[i].

        copy=False returns a read-only view of llama.cpp's output buffer (no copy) when the tokens
        fit in one batch (n_batch); while such a view is alive, decode/eval/clear/close on this
        context raise LlamaError (delete the view, or ``.copy()`` it, first). Wraps llama_decode
        with an output for every token, and llama_get_logits.
        """
        tokens = [int(t) for t in tokens]
        n0 = self._llama_context.pos(0)
        try:
            return cast(np.ndarray, self._llama_context.eval(tokens, 0, bool(copy)))
        finally:
            self._track(n0, tokens)

    def _track(self, n0: int, tokens: list[int]) -> None:
        """Record tokens appended to sequence 0 at position n0 (while _tokens mirrors the cache)."""
        if len(self._tokens) == n0:
            self._tokens += tokens[: self._llama_context.pos(0) - n0]

    def logits(self, idx: int = -1) -> np.ndarray:
        """Logits at a position of the last batch (-1: its last output; decode_batch returns
        each entry's): a float32 copy, shape (n_vocab,). Wraps llama_get_logits_ith. ValueError
        before any decode or for a position without logits."""
        return self._llama_context.logits(as_int(idx, "idx", -1))

    def set_logits(self, logits: np.ndarray, idx: int = -1) -> None:
        """Overwrite the logits at a position of the last batch with ``logits`` (float32-castable,
        shape (n_vocab,)): the buffer llama_get_logits_ith returns, which the next
        ``Sampler.sample(ctx, idx)`` reads (how ``logits_processor`` works). ValueError for a
        wrong shape, no logits at idx, or while an ``eval(copy=False)`` view lives."""
        arr = np.ascontiguousarray(logits, dtype=np.float32)
        if arr.ndim != 1:
            raise ValueError(f"logits must have shape (n_vocab,); got {arr.shape}")
        self._llama_context.set_logits(as_int(idx, "idx", -1), arr)

    def clear(self) -> None:
        """Empty the KV cache (all sequences)."""
        self._llama_context.clear()
        self._tokens = []

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of sequence 0 in the KV cache (wraps llama_memory_seq_rm).
        Raises RuntimeError (and empties the cache) where the model's memory cannot drop a tail
        (recurrent models)."""
        n = as_int(n, "n", 0)
        if not self._llama_context.seq_rm(0, n, -1):
            self.clear()
            raise RuntimeError("llama.cpp could not truncate the KV cache; it was cleared")
        self._tokens = self._tokens[:n]

    def shift(self, n_keep: int, n_discard: int) -> None:
        """Context shift of sequence 0, as llama-server's: drop the positions [n_keep, n_keep +
        n_discard) from the KV cache (llama_memory_seq_rm) and move the rest down by n_discard
        (llama_memory_seq_add; the keys' RoPE is updated at the next decode). ValueError for spans
        outside the cache or a model whose memory cannot shift (recurrent models)."""
        n_keep, n_discard = as_int(n_keep, "n_keep", 0), as_int(n_discard, "n_discard", 1)
        n = self.n_past
        if n_keep + n_discard > n:
            raise ValueError(f"n_keep + n_discard ({n_keep} + {n_discard}) exceeds the {n} positions in the cache")
        if not self._llama_context.can_shift:
            raise ValueError("this model's KV cache cannot shift positions (llama_memory_can_shift: false)")
        if not self._llama_context.seq_rm(0, n_keep, n_keep + n_discard):
            self.clear()
            raise RuntimeError("llama.cpp could not remove the span from the KV cache; it was cleared")
        self._llama_context.seq_add(0, n_keep + n_discard, n, -n_discard)
        known = len(self._tokens) == n
        self._tokens = self._tokens[:n_keep] + self._tokens[n_keep + n_discard :] if known else []

    def decode_media(self, chunk: Any, *, logits_last: bool = True, seq_id: int = 0) -> None:
        """Evaluate an image or audio chunk (a :class:`~llamabind.projector.MediaChunk` of
        ``Projector.tokenize``) after what sequence ``seq_id`` holds: its encoder runs, then its
        embeddings go through llama_decode in n_batch pieces (libmtmd's
        mtmd_helper_eval_chunk_single). In sequence 0 its positions show as ``chunk.key`` in
        :attr:`tokens`. Raises ValueError when n_ctx has no room for it or for a seq_id outside
        [0, n_seq_max), LlamaError when the encoder or decode fails; Ctrl-C rolls it back."""
        n0 = self.pos(seq_id)
        chunk.native_eval(self._llama_context, bool(logits_last), seq_id)
        if seq_id == 0 and len(self._tokens) == n0:
            self._tokens += [chunk.key] * (self.n_past - n0)

    def prefill(self, tokens: Sequence[int]) -> int:
        """Bring sequence 0 of the KV cache to hold exactly ``tokens``, reusing the longest prefix
        it already holds (at least the last token is evaluated, for its logits): llama_memory_seq_rm
        of the differing tail, then llama_decode of the rest. Returns the number of tokens reused.
        Raises as :meth:`decode`."""
        tokens = list(tokens)
        cached = self._tokens if len(self._tokens) == self.n_past else []
        n = 0
        limit = min(len(cached), len(tokens) - 1)
        while n < limit and cached[n] == tokens[n]:
            n += 1
        if n == 0:
            self.clear()
        else:
            self.truncate(n)
        self.decode(tokens[n:])
        return n

    # --- the generation handle: one generation at a time owns sequence 0
    @property
    def generation(self) -> int:
        """The id of the latest generation started on this context (:meth:`start_generation`)."""
        return self._generation

    def start_generation(self) -> int:
        """Start a new generation on sequence 0 and return its id; a generation started earlier
        (an abandoned stream) sees :attr:`generation` change and must stop."""
        self._generation += 1
        return self._generation

    @property
    def pooling(self) -> int:
        """The pooling in effect (llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank)."""
        return self._llama_context.pooling

    def embedding(self, seq_id: int = 0, idx: int = -1) -> np.ndarray:
        """float32 (n_embd,): the pooled embedding of seq_id, or with pooling "none" the
        embedding at batch position idx (llama_get_embeddings_seq / _ith)."""
        return self._llama_context.embedding(seq_id, idx)

    def token_logprob(self, idx: int, token: int, n_top: int) -> tuple[float, list[int], list[float]]:
        """(log-probability of token, the n_top most likely ids, their log-probabilities) from the
        raw logits at batch position idx (-1: the last)."""
        return self._llama_context.logprobs(idx, token, n_top)

    # --- LoRA
    def set_lora(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Apply a LoRA adapter with a scale (0 disables it, 1 is full strength; any finite
        value). Wraps llama_set_adapters_lora. The KV cache is emptied (its entries were computed
        without the adapter)."""
        if not isinstance(adapter, LoraAdapter):
            raise TypeError(f"adapter must be a LoraAdapter (Model.load_lora); got {type(adapter).__name__}")
        loras = {**self._loras, adapter: float(scale)}
        self._llama_context.set_loras([(a._llama_adapter, s) for a, s in loras.items()])
        self._loras = loras
        self.clear()

    def remove_lora(self, adapter: LoraAdapter | None = None) -> None:
        """Stop applying an adapter (None: all). The KV cache is emptied."""
        loras = {} if adapter is None else {a: s for a, s in self._loras.items() if a is not adapter}
        self._llama_context.set_loras([(a._llama_adapter, s) for a, s in loras.items()])
        self._loras = loras
        self.clear()
