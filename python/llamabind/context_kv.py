"""The native-facing layer, context side, part two: :class:`KVCache`, what a
:class:`~llamabind.context.Context` does with the sequences in its KV cache (positions, batches of
several sequences, removal and sharing of spans, the state saved and restored). Context inherits it;
nothing else uses it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["KVCache"]


class KVCache:
    """The KV-cache half of :class:`~llamabind.context.Context` (a base class, not made on its
    own): it reads the context's native handle and keeps sequence 0's token record (what
    prompt-prefix reuse compares), both set by Context's constructor."""

    _llama_context: Any  # llamabind._core.Context
    _tokens: list[int]  # the tokens of sequence 0 in the KV cache, while known

    @property
    def n_cells(self) -> int:
        """KV cache cells sequence 0 holds (what n_ctx bounds): :attr:`n_past`, plus the tokens an
        M-RoPE medium has beyond its positions (an image of h x w tokens takes max(h, w) positions)."""
        return self._llama_context.n_cells(0)

    def kv_cells(self, seq_id: int = 0) -> int:
        """:attr:`n_cells` of any sequence. ValueError for a seq_id outside [0, n_seq_max)."""
        return self._llama_context.n_cells(seq_id)

    # --- batches of several sequences and embeddings
    def pos(self, seq_id: int = 0) -> int:
        """The next position of a sequence (the number of its tokens in the KV cache; wraps
        llama_memory_seq_pos_max + 1, or past an M-RoPE medium's positions). ValueError for a
        seq_id outside [0, n_seq_max)."""
        return self._llama_context.pos(seq_id)

    def decode_sequence(self, tokens: Sequence[int], seq_id: int) -> None:
        """Evaluate token ids after what sequence seq_id holds, in n_batch chunks (wraps
        llama_decode); logits are kept for the last one. Sequence 0's token record is not kept by
        this call (use :meth:`decode` for it). Raises ValueError as :meth:`decode`, and for a
        seq_id outside [0, n_seq_max)."""
        if seq_id == 0:
            self._tokens = []  # no longer known: prefix reuse starts afresh
        self._llama_context.decode([int(t) for t in tokens], seq_id)

    def decode_batch(self, entries: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
        """Evaluate [(seq_id, token ids), ...] in one llama_batch (wraps llama_decode, or
        llama_encode for encoder-only models); returns, per entry, the batch position of its last
        token (for :meth:`Sampler.sample` and :meth:`embedding`). Sequence 0's token record is not
        kept (prefix reuse starts afresh). Raises ValueError for ids outside [0, n_vocab), a
        seq_id outside [0, n_seq_max), or more tokens than n_batch or the cache has room for."""
        self._tokens = []
        return self._llama_context.decode_batch([(s, [int(t) for t in toks]) for s, toks in entries])

    # --- KV cache and state
    def seq_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Remove positions [p0, p1) (p1 -1: to the end) of a sequence from the KV cache
        (wraps llama_memory_seq_rm)."""
        if not self._llama_context.seq_rm(seq_id, p0, p1):
            raise ValueError(
                f"llama.cpp cannot remove positions [{p0}, {p1}) of sequence {seq_id} (partial removal "
                "is not supported by this model's memory)"
            )
        if seq_id in (0, -1):
            # a hole leaves _tokens shorter than the cache: prefix reuse then starts afresh
            self._tokens = self._tokens[:p0]

    def seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Share positions [p0, p1) of sequence src with sequence dst (wraps llama_memory_seq_cp;
        no copy of the data with a unified KV cache)."""
        self._llama_context.seq_cp(src, dst, p0, p1)
        if dst == 0:
            self._tokens = []  # no longer known: prefix reuse starts afresh

    def save_state(self) -> bytes:
        """The context's state as bytes: the KV cache (llama_state_get_data; at this pin it holds
        no logits) and sequence 0's record (token ids, media keys, M-RoPE media). Restore with
        :meth:`load_state` on a context of the same model and parameters; generate() then
        re-evaluates only the last token."""
        spans = self._llama_context.media_spans(0)
        return self._llama_context.state_get() + _state_trailer(self._tokens, spans)

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`save_state` bytes. Raises ValueError (and empties the cache) for bytes
        that are not a state of this context."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes; got {type(data).__name__}")
        state, tokens, spans = _split_state(bytes(data))
        self._tokens = []
        self._llama_context.state_set(state)
        try:
            self._llama_context.set_media_spans(0, spans)
        except ValueError:
            self._llama_context.clear()  # a partial restore is not a state: start empty
            raise
        self._tokens = tokens

    def save_state_file(self, path: str | os.PathLike) -> None:
        """Write the state and sequence 0's tokens to a session file (llama_state_save_file).
        ValueError when sequence 0 holds images or audio (a session file holds token ids only:
        use :meth:`save_state`)."""
        if self._tokens and min(self._tokens) < 0:
            raise ValueError(
                "a session file (llama_state_save_file) holds token ids only and this context holds "
                "images or audio: use save_state()/load_state()"
            )
        self._llama_context.state_save_file(os.fspath(path), self._tokens)

    def load_state_file(self, path: str | os.PathLike) -> list[int]:
        """Restore a session file; returns its tokens (now sequence 0). Raises FileNotFoundError,
        ValueError (not a session of this context: the cache is emptied)."""
        self._tokens = []
        self._tokens = list(self._llama_context.state_load_file(os.fspath(path)))
        return list(self._tokens)


_TRAILER = b"LBTOKENS"  # the first format (int32 token ids); still read
_TRAILER2 = b"LBSTATE2"


def _state_trailer(tokens: list[int], spans: list[tuple[int, int, int]]) -> bytes:
    """[int64 record][int64 (p0, n_pos, n_tokens) per M-RoPE medium][u64 n][u64 n_spans]LBSTATE2
    (media keys are negative 64-bit ints; the first format, LBTOKENS, held int32 token ids)."""
    arr = np.asarray(tokens, dtype="<i8").tobytes() + np.asarray(spans, dtype="<i8").reshape(-1, 3).tobytes()
    return arr + len(tokens).to_bytes(8, "little") + len(spans).to_bytes(8, "little") + _TRAILER2


def _split_state(data: bytes) -> tuple[bytes, list[int], list[tuple[int, int, int]]]:
    bad = "not a llamabind state (from Context.save_state)"
    if len(data) >= 16 and data.endswith(_TRAILER):  # the first format: int32 token ids
        n = int.from_bytes(data[-16:-8], "little")
        if n * 4 + 16 > len(data):
            raise ValueError(bad + ": bad token count")
        return data[: -16 - 4 * n], np.frombuffer(data[-16 - 4 * n : -16], dtype="<i4").tolist(), []
    if len(data) < 24 or not data.endswith(_TRAILER2):
        raise ValueError(bad)
    n, k = int.from_bytes(data[-24:-16], "little"), int.from_bytes(data[-16:-8], "little")
    size = 8 * (n + 3 * k)
    if size + 24 > len(data):
        raise ValueError(bad + ": bad record size")
    body = np.frombuffer(data[-24 - size : -24], dtype="<i8")
    spans = [(int(a), int(b), int(c)) for a, b, c in body[n:].reshape(-1, 3)]
    return data[: -24 - size], body[:n].tolist(), spans
