"""Model (a loaded GGUF) and Context (a KV cache + compute state on it)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import _core, _log, generation, models
from .generation import GenerationResult, SamplingParams, Stream

__all__ = ["Model", "Context"]


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None, note: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}{note}; got {value}")
    return int(value)


class Model:
    """A GGUF model loaded by llama.cpp (``llama_model_load_from_file``).

    Args:
        path: a GGUF file, or a model name known to :mod:`llamabind.models`
            (e.g. ``"smollm2-135m-instruct"``, downloaded and verified on first use).
        n_gpu_layers: layers to offload to the GPU backend (-1: all; ignored on CPU-only builds).
        use_mmap: map the file instead of reading it into memory.
        vocab_only: load only the vocabulary (tokenize/detokenize work, generation does not).
        n_ctx, n_batch, n_ubatch, n_threads: parameters of the context that :meth:`generate`
            uses (see :class:`Context`); n_threads None means all cores available to the process.

    Raises:
        FileNotFoundError: no such file (or unknown model name).
        ValueError: not a GGUF file, or llama.cpp could not load it (corrupt, truncated,
            unsupported architecture); the message carries llama.cpp's reason.

    Use as a context manager, or call :meth:`close`, to free the weights deterministically.
    """

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = -1, use_mmap: bool = True,
                 vocab_only: bool = False, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None):
        _log.sync_level()
        n_gpu_layers = _check_int("n_gpu_layers", n_gpu_layers, -1, note=" (-1: all layers)")
        self.path = models.resolve(path)
        self._m = _core.Model(str(self.path), n_gpu_layers, 1 if use_mmap else 0, bool(vocab_only))
        self._ctx_params = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads)
        self._default_ctx: Context | None = None
        self._metadata: dict | None = None

    # --- lifetime
    def close(self) -> None:
        """Free the weights and every context on this model. Idempotent."""
        self._default_ctx = None
        self._m.close()

    @property
    def closed(self) -> bool:
        return self._m.closed

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"<llamabind.Model {self.path.name} (closed)>"
        return f"<llamabind.Model {self.path.name}: {self.description}, n_vocab={self.n_vocab}>"

    # --- facts
    @property
    def metadata(self) -> dict[str, Any]:
        """GGUF key/values, typed (int, float, bool, str, list), read with ggml's gguf reader."""
        if self._metadata is None:
            self._metadata = _core.read_metadata(str(self.path))
        return self._metadata

    @property
    def vocab_only(self) -> bool:
        """True if only the vocabulary was loaded (no weights: tokenizer only)."""
        return self._m.vocab_only

    @property
    def n_ctx_train(self) -> int:
        """Context length the model was trained with (tokens)."""
        return self._m.n_ctx_train

    @property
    def n_vocab(self) -> int:
        return self._m.n_vocab

    @property
    def n_embd(self) -> int:
        return self._m.n_embd

    @property
    def n_layer(self) -> int:
        return self._m.n_layer

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return self._m.n_params

    @property
    def size(self) -> int:
        """Size of the weights in bytes."""
        return self._m.size

    @property
    def description(self) -> str:
        """llama_model_desc, e.g. ``"llama ?B Q4_1"``."""
        return self._m.description

    @property
    def token_bos(self) -> int | None:
        return self._m.token_bos

    @property
    def token_eos(self) -> int | None:
        return self._m.token_eos

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (wraps llama_vocab_is_eog)."""
        return self._m.is_eog(token)

    # --- tokenizer
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (wraps llama_tokenize).

        add_special: add BOS/EOS if the model's vocabulary asks for them.
        parse_special: turn the text of special tokens (e.g. ``"<|im_start|>"``) into their ids;
        otherwise it is tokenized as plain text. Raises TypeError for non-str input (bytes too).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        return self._m.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of token ids (wraps llama_detokenize); invalid UTF-8 becomes U+FFFD.

        Raises ValueError for an id outside [0, n_vocab).
        """
        return self._m.detokenize(list(tokens), remove_special, unparse_special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """UTF-8 bytes of one token (may be part of a character). Wraps llama_token_to_piece."""
        return self._m.token_to_piece(token, special)

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF chat template (``tokenizer.chat_template``), or None."""
        return self._m.chat_template(name)

    # --- generation
    def context(self, **params) -> "Context":
        """A new :class:`Context` on this model (params override the model's context params)."""
        return Context(self, **{**self._ctx_params, **params})

    def _context(self) -> "Context":
        if self._default_ctx is None or self._default_ctx.closed:
            self._default_ctx = self.context()
        return self._default_ctx

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult | Stream:
        """Generate a continuation of ``prompt``; see :meth:`Context.generate` for the arguments.

        Uses one context per model, created on first use with the model's n_ctx/n_batch/n_threads.
        """
        return self._context().generate(prompt, **kwargs)


class Context:
    """A llama.cpp context on a :class:`Model`: the KV cache, compute buffers and threads.

    Args:
        model: the Model.
        n_ctx: context size in tokens (0: the model's n_ctx_train); >= 8. llama.cpp rounds it
            up to a multiple of 256; :attr:`n_ctx` gives the size in effect.
        n_batch: most tokens passed to one llama_decode (prompts are split into n_batch chunks).
        n_ubatch: physical batch size (<= n_batch).
        n_threads: CPU threads for generation and batch processing (None: all available cores).

    Raises ValueError for out-of-range parameters, LlamaError if llama.cpp cannot create the
    context (e.g. out of memory). One context must not be used by two threads at once: the
    second gets a LlamaError. Use one context per thread.
    """

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None):
        _log.sync_level()
        if not isinstance(model, Model):
            raise TypeError(f"model must be a llamabind.Model; got {type(model).__name__}")
        n_ctx = _check_int("n_ctx", n_ctx, 0, 1 << 24, " (0: the model's n_ctx_train)")
        if n_ctx == 0:
            n_ctx = model.n_ctx_train
        if 0 < n_ctx < 8:
            raise ValueError(f"n_ctx must be >= 8 tokens (or 0 for the model's n_ctx_train); got {n_ctx}")
        n_batch = _check_int("n_batch", n_batch, 1, 1 << 24)
        n_ubatch = _check_int("n_ubatch", n_ubatch, 1, 1 << 24)
        n_threads = _default_threads() if n_threads is None else _check_int("n_threads", n_threads, 1, 512)
        self.model = model
        self._generation = 0  # bumped by each generate(); an older stream then refuses to continue
        self._c = _core.Context(model._m, n_ctx, n_batch, n_ubatch, n_threads, n_threads)

    def close(self) -> None:
        """Free the KV cache and compute buffers. Idempotent."""
        self._c.close()

    @property
    def closed(self) -> bool:
        return self._c.closed

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def n_ctx(self) -> int:
        return self._c.n_ctx

    @property
    def n_batch(self) -> int:
        return self._c.n_batch

    @property
    def n_ubatch(self) -> int:
        return self._c.n_ubatch

    @property
    def n_threads(self) -> int:
        return self._c.n_threads

    @property
    def n_past(self) -> int:
        """Tokens currently in the KV cache."""
        return self._c.n_past

    def decode(self, tokens: Sequence[int]) -> None:
        """Evaluate token ids after the n_past tokens already in the KV cache (wraps llama_decode,
        then llama_synchronize: the computation is finished when this returns, on any backend).

        The GIL is released while llama.cpp computes; Ctrl-C raises KeyboardInterrupt and leaves
        the cache as it was before the interrupted chunk. Raises ValueError for ids outside
        [0, n_vocab), an empty list, or more tokens than n_ctx has room for.
        """
        self._c.decode(list(tokens))

    def logits(self) -> np.ndarray:
        """Logits of the last decoded token: float32 array of shape (n_vocab,)."""
        return self._c.logits()

    def clear(self) -> None:
        """Empty the KV cache."""
        self._c.clear()

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stream: bool = False, add_special: bool = True, parse_special: bool = True
                 ) -> GenerationResult | Stream:
        """Generate a continuation of ``prompt`` through llama.cpp's sampler chain.

        Args:
            prompt: text, or token ids. Text is tokenized with ``add_special`` (BOS if the model
                wants one) and ``parse_special`` (special-token text becomes special tokens).
            max_tokens: most tokens to generate (>= 0).
            temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed: the sampler
                chain (see :class:`llamabind.generation.SamplingParams`); temperature 0 is greedy.
            stop: string(s) that end the generation; the matched string is not included.
            stream: return a :class:`Stream` of text pieces instead of the finished result.

        Returns a :class:`GenerationResult` (or a :class:`Stream` whose ``result`` is set at the
        end). The KV cache is cleared first. Ctrl-C raises KeyboardInterrupt within one token.

        Raises ValueError (bad parameter, empty prompt, prompt longer than n_ctx), TypeError.
        """
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
        gen = generation.run(self, prompt, max_tokens, sampling, stop, add_special, parse_special)
        if stream:
            return Stream(gen)
        return generation.collect(gen)
