"""The native-facing layer for images and audio: :class:`Projector`, a multimodal projector
(mmproj GGUF: a vision or audio encoder and its projection into the text model's embeddings)
loaded by llama.cpp's libmtmd on a :class:`~llamabind.model.Model`, the media it reads, and the
chunks of a prompt with media. Conversations with media are :mod:`.multimodal`'s."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlparse

import numpy as np

from . import _core, _log
from ._validate import as_int
from .model import Model

__all__ = ["Projector", "MediaChunk", "MEDIA_MARKER"]

MEDIA_MARKER = "<__media__>"
"""The text that stands for one image or audio clip in a prompt (libmtmd's default marker)."""

Fetch = Callable[[str], bytes]


@dataclass(frozen=True)
class MediaChunk:
    """An image or audio clip of a tokenized prompt: ``n_pos`` KV cache positions whose
    embeddings the projector computes. ``key`` (negative) stands for each of its positions in
    :attr:`Context.tokens`, the same for the same media content (its SHA-256), so a
    conversation that shows the same image again reuses its KV cache."""

    kind: str  # "image" or "audio"
    n_tokens: int
    n_pos: int
    id: str
    key: int
    native: Any = field(repr=False)
    projector: Any = field(repr=False)

    def native_eval(self, llama_context: Any, logits_last: bool, seq_id: int = 0) -> None:
        """Context.decode_media's call into libmtmd (mtmd_helper_eval_chunk_single after what
        sequence seq_id holds)."""
        self.projector.eval_media(llama_context, self.native, seq_id, logits_last)


def _key(media_id: str) -> int:
    return -1 - int(hashlib.sha256(media_id.encode()).hexdigest()[:15], 16)


class Projector:
    """A multimodal projector on ``model`` (wraps libmtmd's ``mtmd_init_from_file``).

    Args:
        model: the text model the projector was made for (its n_embd must match the
            projector's output width).
        path: the mmproj GGUF file.
        use_gpu: run the encoder on the model's GPU backend (ignored on CPU-only builds).
        n_threads: CPU threads of the encoder (None: the model's n_threads, else all cores).
        image_min_tokens: the fewest tokens an image becomes, for projectors with dynamic
            resolution (None: the projector's own).
        image_max_tokens: the most tokens an image becomes (None: the projector's own).
        warmup: run one encode at load time (allocates the compute buffers up front).

    Raises FileNotFoundError (no file), ValueError (not a projector libmtmd reads, or one made
    for a text model of another n_embd: the message carries libmtmd's reason).
    """

    def __init__(
        self,
        model: Model,
        path: str | os.PathLike,
        *,
        use_gpu: bool = True,
        n_threads: int | None = None,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        warmup: bool = True,
        _capture: Sequence[str] = (),
    ):
        _log.sync_level()
        if n_threads is None:
            n_threads = model.context_params.get("n_threads") or len(os.sched_getaffinity(0))
        n_threads = as_int(n_threads, "n_threads", 1)
        lo = -1 if image_min_tokens is None else as_int(image_min_tokens, "image_min_tokens", 1)
        hi = -1 if image_max_tokens is None else as_int(image_max_tokens, "image_max_tokens", 1)
        self.model = model
        self.path = Path(os.fspath(path))
        self._native = _core.Projector(
            model._llama_model, str(self.path), bool(use_gpu), n_threads, lo, hi, bool(warmup), MEDIA_MARKER,
            list(_capture),
        )  # fmt: skip

    vision = property(lambda self: self._native.vision, doc="Whether it takes images.")
    audio = property(lambda self: self._native.audio, doc="Whether it takes audio.")
    audio_sample_rate = property(
        lambda self: self._native.audio_sample_rate, doc="Sample rate (Hz) of audio arrays it takes; -1 without audio."
    )
    closed = property(lambda self: self._native.closed, doc="True after close() or the model's close().")

    @property
    def modalities(self) -> list[str]:
        """``["vision"]``, ``["audio"]`` or both."""
        return [m for m in ("vision", "audio") if getattr(self, m)]

    def close(self) -> None:
        """Free the encoder (also done by the model's close()). Idempotent."""
        self._native.close()

    # --- media
    def media(self, source: Any, *, fetch: Fetch | None = None) -> Any:
        """Decode one image or audio clip for this projector.

        ``source``: bytes of an image (JPEG, PNG, BMP, GIF, ...) or audio file (WAV, MP3, FLAC);
        a local path or ``file://`` URL; a ``data:image/...;base64,...`` or
        ``data:audio/...;base64,...`` URL; a numpy uint8 array (height, width, 3) of RGB pixels;
        a numpy float32 array (n_samples,) of mono PCM at :attr:`audio_sample_rate`. An
        ``http(s)://`` URL only through ``fetch(url) -> bytes`` (nothing is fetched by default).

        Raises TypeError (another type), ValueError (unreadable or corrupt media, a remote URL
        without fetch, a bad data URL), FileNotFoundError (no such file).
        """
        if isinstance(source, np.ndarray):
            return self._array(source)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return self._native.media_from_bytes(bytes(source))
        if isinstance(source, os.PathLike):
            return self._native.media_from_bytes(_read(Path(source)))
        if not isinstance(source, str):
            raise TypeError(
                "media must be bytes, a path, a data:/file:// URL or a numpy array; got " + type(source).__name__
            )
        if source.startswith("data:"):
            return self._native.media_from_bytes(_data_url(source))
        if source.startswith(("http://", "https://")):
            if fetch is None:
                raise ValueError(
                    f"remote media are not fetched by default: {source[:80]!r}; pass fetch=callable(url) -> bytes, "
                    "or download it and give the bytes or a path"
                )
            data = fetch(source)
            if not isinstance(data, (bytes, bytearray)):
                raise TypeError(f"fetch must return bytes; got {type(data).__name__}")
            return self._native.media_from_bytes(bytes(data))
        if source.startswith("file://"):
            return self._native.media_from_bytes(_read(Path(unquote(urlparse(source).path))))
        return self._native.media_from_bytes(_read(Path(source)))

    def _array(self, a: np.ndarray) -> Any:
        if a.ndim == 3:
            if a.dtype != np.uint8 or a.shape[2] != 3:
                raise ValueError(f"an image array must be uint8 (height, width, 3); got {a.dtype} {a.shape}")
            a = np.ascontiguousarray(a)
            return self._native.media_from_rgb(a, _digest(a))
        if a.ndim == 1:
            if a.dtype != np.float32:
                raise ValueError(f"an audio array must be float32 (n_samples,) mono PCM; got {a.dtype}")
            if not self.audio:
                raise ValueError("this projector takes images, not audio")
            if not np.isfinite(a).all():
                raise ValueError("an audio array must be finite")
            a = np.ascontiguousarray(a)
            return self._native.media_from_pcm(a, _digest(a))
        raise ValueError(f"a media array must be (height, width, 3) uint8 or (n_samples,) float32; got shape {a.shape}")

    # --- prompts
    def tokenize(
        self, text: str, media: Sequence[Any], *, add_special: bool = True, parse_special: bool = True
    ) -> list[int | MediaChunk]:
        """Tokenize ``text`` holding one :data:`MEDIA_MARKER` per item of ``media`` (from
        :meth:`media`) into token ids and :class:`MediaChunk` s, in order (wraps mtmd_tokenize:
        the projector's own begin/end-of-image text around each). add_special: add the text model's
        BOS/EOS as its vocabulary asks; parse_special: turn the text of special tokens into their ids
        (as :meth:`Model.tokenize`). ValueError when the markers and
        media differ in number, a medium is of a kind the projector does not take, or the
        projector's layout needs special tokens the text model's vocabulary lacks."""
        out: list[int | MediaChunk] = []
        for ch in self._native.tokenize(text, list(media), bool(add_special), bool(parse_special)):
            if ch.type == "text":
                if min(ch.tokens, default=0) < 0:  # libmtmd's lookup of a token the vocabulary lacks
                    raise ValueError(
                        "the projector's image layout needs special tokens (e.g. SmolVLM's "
                        "<fake_token_around_image>) that this model's vocabulary lacks: it was made for another model"
                    )
                out += ch.tokens
            else:
                out.append(MediaChunk(ch.type, ch.n_tokens, ch.n_pos, ch.id, _key(ch.id), ch, self._native))
        return out

    def encode(self, chunk: MediaChunk) -> np.ndarray:
        """The projector's output for one media chunk: float32 (n_tokens, n_embd), the
        embeddings the text model reads in its place (wraps mtmd_encode_chunk, then
        mtmd_get_output_embd). Raises ValueError for a text chunk or a closed projector, LlamaError
        when the encoder fails."""
        return cast(np.ndarray, self._native.encode(chunk.native))


def _read(path: Path) -> bytes:
    if not path.exists():
        raise FileNotFoundError(f"no such media file: '{path}'")
    if not path.is_file():
        raise ValueError(f"media path '{path}' is not a file")
    return path.read_bytes()


def _data_url(url: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.startswith(("data:image/", "data:audio/")) or not head.endswith(";base64"):
        raise ValueError("a data URL must be data:image/...;base64,... or data:audio/...;base64,...")
    return b64(body, "the data URL")


def b64(text: str, what: str) -> bytes:
    """Decode base64 text (ValueError naming ``what`` when it is not base64)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not valid base64") from None


def _digest(a: np.ndarray) -> str:
    h = hashlib.sha256(str((a.dtype.str, a.shape)).encode())
    h.update(a.tobytes())
    return h.hexdigest()
