"""The serving core: llama.cpp's tools/server built from the same patched tree. ``server_context``
holds ``n_parallel`` slots in one llama_context and KV cache and schedules them with continuous
batching (a request joins the running batch at the next step, finishes on its own, frees its slot;
each slot reuses the KV cache of a shared prompt prefix); ``server_routes`` are llama-server's HTTP
handlers with its OpenAI layer (chat templates through common's jinja engine, tool calls, JSON
schemas, logprobs, embeddings). The native-facing layer of :mod:`llamabind.serve`, which puts an HTTP
server in front of it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence

from . import _core, models
from ._validate import as_int, endpoint, one_of
from .context import KV_CACHE_TYPES, Context

log = logging.getLogger("llamabind.server")

__all__ = ["ServerContext"]


class ServerContext:
    """llama.cpp's server core over one GGUF model.

    model: a model name (:mod:`llamabind.models`) or a GGUF path. n_parallel: slots (concurrent
    sequences). n_ctx: KV cache size in tokens for all slots together (None: the model's training
    context, fitted to free device memory, as llama-server does); with ``kv_unified`` (default) any
    slot may use all of it, else each gets n_ctx / n_parallel. n_batch/n_ubatch: logical/physical
    batch sizes. n_gpu_layers: layers to offload (None: llama-server's default, all that fit);
    op_offload=False keeps batches of CPU layers on the CPU (llama.cpp sends large ones to a GPU).
    embedding: serve /v1/embeddings instead of generation; pooling: "mean", "cls", "last", "none"
    or "rank" (None: the model's own; mean for a model whose GGUF names none, a causal LM, with a
    warning on the ``llamabind.server`` logger). alias: the model id clients name (default: the model's name,
    or the file name without .gguf). chat_template: a jinja template replacing the model's.
    flash_attn: "on", "off" or "auto". type_k, type_v: the KV cache's types (as :class:`Context`'s;
    None: f16). mmproj: a projector GGUF for images/audio in /v1/chat/completions (llama-server's
    ``--mmproj``; mmproj_use_gpu, image_min_tokens, image_max_tokens as there); media_path: the
    directory ``file://`` URLs may read from (llama-server's ``--media-path``; none by default).
    model_draft: a small model of the same vocabulary for speculative decoding (llama-server's
    ``-md`` with ``--spec-type draft-simple``; the output is the target's); draft_max/draft_min: the
    tokens drafted per step (``--spec-draft-n-max/-n-min``; llama.cpp's defaults 3 and 0);
    n_gpu_layers_draft: the draft's offload (-1: all). context_shift: a generation that fills its
    slot's context drops half of it after the request's ``n_keep`` tokens and goes on (llama-server's
    ``--context-shift``); else it stops with finish_reason "length".
    lora: [(path, scale)] adapters. rpc_servers: ["host:port"]
    RPC servers whose devices the model uses (as ``Model(rpc=...)``; devices other models connected
    are left out).

    Raises FileNotFoundError (no such model), TypeError/ValueError (bad option), LlamaError (the model
    failed to load). Wraps server_context::load_model and server_context::start_loop (on a thread of its
    own); :meth:`close` stops it.
    """

    # Long by its argument list (llama-server's flags, validated before common_params is filled); see serve().
    def __init__(
        self,
        model: str | os.PathLike,
        *,
        n_parallel: int = 4,
        n_ctx: int | None = None,
        n_batch: int | None = None,
        n_ubatch: int | None = None,
        n_gpu_layers: int | None = None,
        op_offload: bool = True,
        n_threads: int | None = None,
        embedding: bool = False,
        pooling: str | None = None,
        kv_unified: bool = True,
        alias: str | None = None,
        chat_template: str | None = None,
        flash_attn: str | None = None,
        seed: int | None = None,
        lora: Sequence[tuple[str, float]] | None = None,
        rpc_servers: Sequence[str] | None = None,
        type_k: str | None = None,
        type_v: str | None = None,
        mmproj: str | os.PathLike | None = None,
        mmproj_use_gpu: bool = True,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        media_path: str | os.PathLike | None = None,
        model_draft: str | os.PathLike | None = None,
        draft_max: int | None = None,
        draft_min: int | None = None,
        n_gpu_layers_draft: int | None = None,
        context_shift: bool = False,
    ):
        path = models.resolve(os.fspath(model))
        if alias is None:  # the name the user gave (a known model), else the file's name without .gguf
            alias = os.fspath(model) if os.fspath(model).lower() in models.KNOWN else path.stem
        opts: dict = {"model": str(path), "n_parallel": as_int(n_parallel, "n_parallel", 1, 256)}
        for name, value, lo in (
            ("n_ctx", n_ctx, 0),
            ("n_batch", n_batch, 1),
            ("n_ubatch", n_ubatch, 1),
            ("n_gpu_layers", n_gpu_layers, -2),
            ("n_threads", n_threads, 1),
            ("seed", seed, 0),
        ):
            if value is not None:
                opts[name] = as_int(value, name, lo)
        if flash_attn is not None:
            opts["flash_attn"] = one_of(flash_attn, "flash_attn", ("on", "off", "auto"))
        for key, text in (("alias", alias), ("chat_template", chat_template)):
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise TypeError(f"{key} must be a non-empty str")
                opts[key] = text
        opts["embedding"] = bool(embedding)
        opts["op_offload"] = bool(op_offload)
        one_of(pooling, "pooling", Context.POOLING)
        if embedding and pooling is None:
            md = _core.read_metadata(str(path))
            if md.get(f"{md.get('general.architecture', '')}.pooling_type", 0) in (0, -1):
                # a causal LM (its GGUF names no pooling): llama.cpp's "none" would answer every
                # /v1/embeddings with 400 "Pooling type 'none' is not OAI compatible"
                pooling = "mean"
                log.warning("%s names no pooling type: serving embeddings with mean pooling", path.name)
        opts["pooling"] = Context.POOLING[pooling]  # None: the model's
        opts["kv_unified"] = bool(kv_unified)
        for key, t in (("type_k", type_k), ("type_v", type_v)):
            if t is not None:
                opts[key] = KV_CACHE_TYPES[one_of(t, key, KV_CACHE_TYPES)]
        if type_v not in (None, "f16", "f32", "bf16") and flash_attn == "off":
            raise ValueError(f"a quantized V cache ({type_v}) needs flash attention: flash_attn='on' or 'auto'")
        if lora:
            opts["lora"] = [(os.fspath(p), float(s)) for p, s in lora]
            for p, _ in opts["lora"]:
                if not os.path.exists(p):
                    raise FileNotFoundError(f"LoRA adapter not found: {p}")
        if mmproj is not None:
            if not os.path.isfile(mmproj):
                raise FileNotFoundError(f"no such mmproj file: '{os.fspath(mmproj)}'")
            opts["mmproj"] = os.fspath(mmproj)
            opts["mmproj_use_gpu"] = bool(mmproj_use_gpu)
            for name, value in (("image_min_tokens", image_min_tokens), ("image_max_tokens", image_max_tokens)):
                if value is not None:
                    opts[name] = as_int(value, name, 1)
        if media_path is not None:
            if not os.path.isdir(media_path):
                raise NotADirectoryError(f"media_path must be a directory: '{os.fspath(media_path)}'")
            opts["media_path"] = os.path.join(
                os.path.abspath(media_path), ""
            )  # llama-server joins it to the URL's path
        opts["context_shift"] = bool(context_shift)
        if model_draft is not None:
            opts["model_draft"] = str(models.resolve(os.fspath(model_draft)))
            for name, value, lo in (
                ("draft_max", draft_max, 1),
                ("draft_min", draft_min, 0),
                ("n_gpu_layers_draft", n_gpu_layers_draft, -1),
            ):
                if value is not None:
                    opts[name] = as_int(value, name, lo)
            if draft_max is not None and draft_min is not None and draft_min > draft_max:
                raise ValueError(f"draft_min ({draft_min}) must be <= draft_max ({draft_max})")
        elif draft_max is not None or draft_min is not None:
            raise ValueError("draft_max/draft_min need a draft model (model_draft)")
        if rpc_servers:
            for e in rpc_servers:
                endpoint(e)  # TypeError/ValueError for a malformed one; connected natively
            opts["rpc"] = list(rpc_servers)
        self.path = path
        core = _core.ServerCore(opts)
        core.load()
        self._core: _core.ServerCore | None = core
        self.routes = frozenset(core.routes)
        models_json = json.loads(self.handle("GET", "/v1/models").body)
        first = models_json["data"][0]
        #: the model id clients send as "model", and the other names it answers to
        self.model_id: str = first["id"]
        self.model_names = frozenset([first["id"], *first.get("aliases", []), path.name, path.stem, str(path)])
        self.n_parallel: int = core.n_parallel
        #: the vocabulary's size (token ids are in [0, n_vocab)), as /v1/models reports it
        self.n_vocab: int | None = first.get("meta", {}).get("n_vocab")

    def request(
        self, method: str, path: str, body: bytes = b"", query: Mapping[str, str] | None = None
    ) -> _core.ServerResponse:
        """A request to llama-server's handler for ``method path`` (one of :attr:`routes`) with
        ``body`` (the request's JSON, bytes), not yet run: ``run()`` runs it (without the GIL) and
        returns when a non-streamed response is complete; a streamed one (``is_stream``) then yields its
        SSE chunks from ``next()``. ``close()``, from any thread, cancels it and frees its slot. Raises
        ValueError for an unknown route."""
        if self._core is None:
            raise ValueError("the server context is closed")
        return self._core.request(method, path, body, dict(query or {}))

    def handle(
        self, method: str, path: str, body: bytes = b"", query: Mapping[str, str] | None = None
    ) -> _core.ServerResponse:
        """:meth:`request` and run it."""
        r = self.request(method, path, body, query)
        r.run()
        return r

    def close(self) -> None:
        """Stop the scheduler thread (server_context::terminate) and free the model and its context
        (once no response refers to them). Idempotent; later requests raise ValueError."""
        core, self._core = self._core, None
        if core is not None:
            core.stop()

    def __enter__(self) -> ServerContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<llamabind.ServerContext {self.model_id!r} n_parallel={self.n_parallel}>"
