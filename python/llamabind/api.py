"""The face of the package: :class:`Model` and :class:`Context` as users meet them, the
native-facing classes (:mod:`.model`, :mod:`.context`) plus the methods of the feature modules
(generation, chat, batches, embeddings). This is the only module besides ``__init__`` and
``__main__`` that imports the feature modules; nothing below imports it."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import batch, chat, context, embeddings, generation, model, multimodal
from .chat import ChatResult
from .generation import GenerationResult, Stream
from .projector import Projector

__all__ = ["Model", "Context"]

_DEFAULT_CONTEXT = "api.context"  # Model.attachments key of generate()/chat()'s context


class Context(context.Context):
    __doc__ = context.Context.__doc__

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult | Stream[GenerationResult]:
        """Generate a continuation of ``prompt`` in this context; see :func:`llamabind.generation.generate`
        for the arguments (max_tokens, stop, stream, json_schema, logprobs, draft_model,
        lookup_ngram, logits_processor, and the sampling fields of :class:`~llamabind.SamplingParams`)."""
        return generation.generate(self, prompt, **kwargs)

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> ChatResult | Stream[ChatResult]:
        """Answer a conversation in this context: ``messages`` (OpenAI-style dicts) and ``kwargs`` as
        :func:`llamabind.chat.chat` takes them."""
        return chat.chat(self, messages, **kwargs)


# the parameters this class adds to model.Model's, as rows of its docstring's Args section
_MODEL_ARGS = """        mmproj: a projector GGUF for this model (llama.cpp's ``--mmproj``), loaded as a
            :class:`~llamabind.projector.Projector`; :meth:`chat` then takes image and audio content
            parts (or call :meth:`load_mmproj` later).
        mmproj_use_gpu: run the projector's encoder on the GPU backend (Projector's use_gpu).
        image_min_tokens: the fewest tokens an image becomes (Projector's; None: the projector's own).
        image_max_tokens: the most tokens an image becomes (Projector's; None: the projector's own).
        lora: LoRA adapters (paths, scale 1, or (path, scale) pairs: llama.cpp's ``--lora`` and
            ``--lora-scaled``) loaded with the model (:meth:`load_lora`) and applied to every context
            it makes, the one :meth:`generate` and :meth:`chat` use included. FileNotFoundError,
            ValueError (not an adapter of this model), TypeError (not a path or pair).
"""


class Model(model.Model):
    __doc__ = (model.Model.__doc__ or "").replace("\n\n    Raises:\n", "\n" + _MODEL_ARGS + "\n    Raises:\n", 1)

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        mmproj: str | os.PathLike | None = None,
        mmproj_use_gpu: bool = True,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        lora: Sequence[str | os.PathLike | tuple[str | os.PathLike, float]] | None = None,
        **params: Any,
    ):
        super().__init__(path, **params)
        self.loras: list[tuple[model.LoraAdapter, float]] = []
        """The adapters of ``lora``, loaded, with their scales: applied to every context made."""
        try:
            for spec in lora or ():
                p, scale = spec if isinstance(spec, tuple) else (spec, 1.0)
                if (
                    not isinstance(p, (str, os.PathLike))
                    or isinstance(scale, bool)
                    or not isinstance(scale, (int, float))
                ):
                    raise TypeError(f"lora: a path or a (path, scale) pair; got {spec!r}")
                self.loras.append((self.load_lora(p), float(scale)))
            if mmproj is not None:
                self.load_mmproj(
                    mmproj, use_gpu=mmproj_use_gpu, image_min_tokens=image_min_tokens, image_max_tokens=image_max_tokens
                )
        except BaseException:
            self.close()
            raise

    def load_mmproj(self, path: str | os.PathLike, **params: Any) -> Projector:
        """Load the multimodal projector GGUF at ``path`` (an mmproj file) for this model, replacing one
        loaded before; ``params``: use_gpu, n_threads, image_min_tokens, image_max_tokens, warmup (see
        :class:`~llamabind.projector.Projector`). Raises FileNotFoundError, or ValueError for a file
        libmtmd cannot load or one made for a text model of another n_embd."""
        return multimodal.load_mmproj(self, path, **params)

    @property
    def projector(self) -> Projector | None:
        """The loaded projector (None without one): ``.modalities``, ``.media()``, ``.encode()``."""
        return multimodal.projector_of(self)

    def context(self, **params: Any) -> Context:
        """A new :class:`Context` on this model, with the model's ``lora`` adapters applied; ``params``
        (n_ctx, n_batch, n_ubatch, n_threads, n_seq_max, kv_unified, embeddings, pooling, op_offload,
        type_k, type_v, flash_attn) override :attr:`context_params`."""
        ctx = Context(self, **{**self.context_params, **params})
        for adapter, scale in self.loras:
            ctx.set_lora(adapter, scale)
        return ctx

    def _default_context(self) -> Context:
        ctx = self.attachments.get(_DEFAULT_CONTEXT)
        if ctx is None or ctx.closed:
            ctx = self.attachments[_DEFAULT_CONTEXT] = self.context()
        return ctx

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult | Stream[GenerationResult]:
        """Generate a continuation of ``prompt``; see :func:`llamabind.generation.generate` for the arguments.

        Uses one context per model, created on first use with the model's n_ctx/n_batch/n_threads;
        a prompt that shares a prefix with the previous call's tokens evaluates only the rest.
        """
        return generation.generate(self._default_context(), prompt, **kwargs)

    def chat(self, messages: Sequence[dict], **kwargs: Any) -> ChatResult | Stream[ChatResult]:
        """Answer a conversation (in the context generate() uses): ``messages`` (OpenAI-style dicts) and
        ``kwargs`` as :func:`llamabind.chat.chat` takes them."""
        return chat.chat(self._default_context(), messages, **kwargs)

    def embed(self, texts: str | Sequence[str], **kwargs: Any) -> np.ndarray | list[np.ndarray]:
        """Embeddings of texts; see :func:`llamabind.embeddings.embed`."""
        return embeddings.embed(self, texts, **kwargs)

    def rerank(self, query: str, documents: Sequence[str], **kwargs: Any) -> list[tuple[int, float]]:
        """[(index, score)] of documents by relevance to query, for reranker models; see
        :func:`llamabind.embeddings.rerank`."""
        return embeddings.rerank(self, query, documents, **kwargs)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs: Any) -> list[GenerationResult]:
        """Generate for several prompts at once in one context; see :func:`llamabind.batch.generate_batch`."""
        return batch.generate_batch(self, prompts, **kwargs)

    def __enter__(self) -> Model:
        return self


def _full_signature(sub: Any, base: Any) -> inspect.Signature:
    """``sub``'s signature with the keyword arguments it passes on through ``**params`` spelled out from
    ``base``'s (names, annotations, defaults): what help(), IDEs and the API reference show for Model(...)."""
    own = inspect.signature(sub)
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    passed = [p.replace(kind=kw) for p in inspect.signature(base).parameters.values() if p.name not in {"self", *names}]
    return own.replace(parameters=params + passed)


Model.__init__.__signature__ = _full_signature(Model.__init__, model.Model.__init__)  # type: ignore[attr-defined]
