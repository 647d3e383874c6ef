"""Images and audio in prompts and conversations: a model's projector (``Model(...,
mmproj=...)``), OpenAI content parts turned into media markers and decoded media, and the
KV cache brought to hold a prompt of text and media with the longest cached prefix reused. A
feature module: the native side is :mod:`.projector`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .context import Context
from .model import Model
from .projector import MEDIA_MARKER, Fetch, MediaChunk, Projector, b64

__all__ = ["load_mmproj", "projector_of", "split_media", "MediaPrompt", "prompt", "prefill"]

_ATTACHMENT = "multimodal.projector"  # Model.attachments key of the model's projector
_AUDIO_FORMATS = ("wav", "mp3", "flac")


def load_mmproj(model: Model, path: str | os.PathLike, **params: Any) -> Projector:
    """Load ``path`` as ``model``'s projector (replacing one loaded before); ``params`` as
    :class:`~llamabind.projector.Projector`'s (use_gpu, n_threads, image_min_tokens,
    image_max_tokens, warmup). Raises as that constructor does (FileNotFoundError, ValueError)."""
    old = model.attachments.pop(_ATTACHMENT, None)
    if old is not None:
        old.close()
    p = model.attachments[_ATTACHMENT] = Projector(model, path, **params)
    return p


def projector_of(model: Model) -> Projector | None:
    """The model's projector, or None."""
    p = model.attachments.get(_ATTACHMENT)
    return None if p is None or p.closed else p


def _is_media_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "input_audio", "image", "audio")


def split_media(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """Messages with each media content part replaced by a media marker part (as llama-server
    does), and the media sources in order. Media parts: ``{"type": "image_url", "image_url":
    {"url": ...}}`` (url: a data URL, ``file://`` URL, path, bytes or numpy array),
    ``{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"|"mp3"|"flac"}}``,
    and ``{"type": "image"|"audio", "image"|"audio": bytes | path | numpy array}``. ValueError
    for a malformed part; messages without media come back as they are."""
    out: list[dict] = []
    sources: list[Any] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list) or not any(_is_media_part(p) for p in content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_media_part(part):
                parts.append(part)
                continue
            sources.append(_source(part, f"messages[{i}].content[{j}]"))
            parts.append({"type": "media_marker", "text": MEDIA_MARKER})
        out.append({**msg, "content": parts})
    return out, sources


def _source(part: dict, where: str) -> Any:
    kind = part["type"]
    if kind in ("image", "audio"):
        if kind not in part:
            raise ValueError(f"{where}: a {kind!r} part needs the key {kind!r} (bytes, a path or a numpy array)")
        return part[kind]
    if kind == "image_url":
        v = part.get("image_url")
        url = v.get("url") if isinstance(v, dict) else v
        if url is None or (isinstance(url, str) and not url):
            raise ValueError(f"{where}: an 'image_url' part needs {{'image_url': {{'url': ...}}}}")
        return url
    v = part.get("input_audio")
    if not isinstance(v, dict) or not isinstance(v.get("data"), str):
        raise ValueError(f"{where}: an 'input_audio' part needs {{'input_audio': {{'data': base64, 'format': ...}}}}")
    fmt = v.get("format")
    if fmt is not None and fmt not in _AUDIO_FORMATS:
        raise ValueError(f"{where}: audio format {fmt!r} is not supported; expected one of {list(_AUDIO_FORMATS)}")
    return b64(v["data"], f"{where}: input_audio.data")


class MediaPrompt:
    """A tokenized prompt of token ids and :class:`~llamabind.projector.MediaChunk` s.

    keys: one int per KV cache position (a token id, or a media chunk's negative key);
    text_tokens: the token ids alone (what penalties and logits processors see); n_tokens: the
    tokens (KV cells) it takes: ``len(keys)`` but where an M-RoPE medium's n_tokens exceed its n_pos."""

    def __init__(self, pieces: list[int | MediaChunk]):
        self.pieces = pieces
        self.keys: list[int] = []
        self.text_tokens: list[int] = []
        self.n_tokens = 0
        for p in pieces:
            if isinstance(p, MediaChunk):
                self.keys += [p.key] * p.n_pos
                self.n_tokens += p.n_tokens
            else:
                self.keys.append(p)
                self.text_tokens.append(p)
                self.n_tokens += 1

    @property
    def media(self) -> list[MediaChunk]:
        return [p for p in self.pieces if isinstance(p, MediaChunk)]

    def __len__(self) -> int:
        return len(self.keys)


def prompt(
    projector: Projector,
    text: str,
    sources: Sequence[Any],
    *,
    fetch: Fetch | None = None,
    add_special: bool = True,
    parse_special: bool = True,
) -> MediaPrompt:
    """Decode ``sources`` (see :meth:`Projector.media`) and tokenize ``text``, which holds one
    :data:`~llamabind.projector.MEDIA_MARKER` per source."""
    media = [projector.media(s, fetch=fetch) for s in sources]
    return MediaPrompt(projector.tokenize(text, media, add_special=add_special, parse_special=parse_special))


def prefill(ctx: Context, p: MediaPrompt) -> int:
    """Bring sequence 0 of ``ctx``'s KV cache to hold ``p``, reusing the longest cached prefix
    that ends between pieces (a medium is evaluated whole); the last piece is always
    evaluated, for its logits. Returns the tokens (KV cells) reused. Token runs go through
    :meth:`Context.decode` (llama_decode), media through :meth:`Context.decode_media`
    (mtmd_helper_eval_chunk_single); raises as those do (ValueError: no room in n_ctx; LlamaError:
    the encoder or decode failed; KeyboardInterrupt on Ctrl-C)."""
    keys = p.keys
    cached = ctx.tokens
    if len(cached) != ctx.n_past:  # the record no longer mirrors the cache: nothing to reuse
        cached = []
    n, limit = 0, min(len(cached), len(keys) - 1)
    while n < limit and cached[n] == keys[n]:
        n += 1
    starts, pos = [], 0  # each piece's first position
    for piece in p.pieces:
        starts.append(pos)
        pos += piece.n_pos if isinstance(piece, MediaChunk) else 1
    first = 0  # the first piece to evaluate: the one holding position n (a token, or a medium from its start)
    while first + 1 < len(starts) and starts[first + 1] <= n:
        first += 1
    if isinstance(p.pieces[first], MediaChunk):
        n = starts[first]
    reused = n + sum(x.n_tokens - x.n_pos for x in p.pieces[:first] if isinstance(x, MediaChunk))
    if n == 0:
        ctx.clear()
    else:
        ctx.truncate(n)
    evaluate(ctx, p.pieces[first:])
    return reused


def evaluate(ctx: Context, pieces: Sequence[int | MediaChunk], seq_id: int = 0) -> None:
    """Decode ``pieces`` after what sequence ``seq_id`` holds: each run of token ids in one call
    (:meth:`Context.decode` for sequence 0, which keeps its token record; else
    :meth:`Context.decode_sequence`), each medium through :meth:`Context.decode_media`; the last
    piece keeps its logits. Raises as those do."""
    run: list[int] = []  # consecutive token ids, decoded together

    def flush() -> None:
        if run and seq_id == 0:
            ctx.decode(run)
        elif run:
            ctx.decode_sequence(run, seq_id)
        run.clear()

    for k, piece in enumerate(pieces):
        if isinstance(piece, MediaChunk):
            flush()
            ctx.decode_media(piece, logits_last=k == len(pieces) - 1, seq_id=seq_id)
        else:
            run.append(piece)
    flush()
