"""The native-facing layer, model side: :class:`Model` (a loaded GGUF: facts, tokenizer, chat
templates), :class:`LoraAdapter` and :class:`ChatTemplates`. Contexts are in :mod:`.context`;
what uses them (generation, chat, batches, embeddings) is in the feature modules above, and
:class:`llamabind.Model` (the face) adds their methods."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from . import _core, _log, models
from ._validate import as_int, endpoint, one_of
from ._validate import tool_choice as _tool_choice

__all__ = ["Model", "LoraAdapter", "ChatTemplates", "json_schema_to_grammar"]

_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}


def _progress_callback(progress, path: Path):
    """(callable for llama_model_params.progress_callback or None, the tqdm bar to close)."""
    if progress is False or progress is None:
        return None, None
    if callable(progress):
        return progress, None
    if progress is not True:
        raise TypeError(f"progress must be a bool or a callable(float); got {type(progress).__name__}")
    from tqdm.auto import tqdm

    bar = tqdm(total=100, desc=f"loading {path.name}", unit="%", leave=False)

    def update(p: float) -> None:
        bar.update(round(p * 100) - bar.n)

    return update, bar


# Over 300 lines by its documented constructor and one property per llama.cpp fact; nothing in it is a concern of its
# own to split out (the tokenizer is four one-line wrappers).
class Model:
    """A GGUF model loaded by llama.cpp (``llama_model_load_from_file``).

    Args:
        path: a GGUF file, a model name known to :mod:`llamabind.models`
            (e.g. ``"smollm2-135m-instruct"``, downloaded and verified on first use), or
            ``"hf://org/repo/file.gguf"`` (a Hugging Face repository's file; see also
            :meth:`from_pretrained`).
        n_gpu_layers: layers to offload to the GPU backend (-1: all; ignored on CPU-only builds).
        use_mmap: map the file instead of reading it into memory.
        vocab_only: load only the vocabulary (tokenize/detokenize work, generation does not).
        n_ctx: the context size of the contexts :meth:`generate` and :meth:`context` create
            (see :class:`Context` for this and the next seven).
        n_batch: their logical batch size.
        n_ubatch: their physical batch size.
        n_threads: their CPU threads (None: all cores available to the process).
        op_offload: their offload of large batches' ops to the GPU.
        type_k: their KV cache's K type.
        type_v: their KV cache's V type.
        flash_attn: their flash attention: "auto", "on" or "off".
        split_mode: with several GPUs, ``"none"`` (all on main_gpu), ``"layer"`` (layers and KV
            cache spread over the GPUs), ``"tensor"`` (llama.cpp's tensor parallelism: weight
            rows split across the GPUs, partial results all-reduced) or ``"row"`` (the older row
            split, for backends that still offer split buffers; CUDA at this pin does not, and
            loading raises ValueError "does not support split buffers").
        main_gpu: index of the GPU used for the whole model with split_mode "none" (and for
            intermediate results with "row").
        tensor_split: the fraction of the model per GPU, e.g. ``[3, 1]`` (normalized); None: by
            free memory.
        rpc: ``"host:port"`` endpoints of ggml RPC servers (``python -m llamabind rpc-server``,
            :func:`llamabind.rpc.serve`) whose devices take layers beside the local GPUs, after
            them in tensor_split's order (split_mode "layer"). ConnectionError if one cannot be
            reached; a server lost later makes decode raise LlamaError.
        repack: let the CPU backend keep weights in repacked layouts for its fastest kernels
            (llama_model_params.use_extra_bufts, llama-cli's ``--repack``/``--no-repack``): AMX
            tiles on Sapphire Rapids and later, interleaved Q4_0/IQ4_NL blocks on AVX2/ARM. False
            keeps the GGUF's layout (the results of the plain kernels, as an RPC server computes).
        progress: True shows a tqdm progress bar while loading; a callable(progress in [0, 1])
            is called instead (return False to cancel the load: ValueError).

    Raises:
        FileNotFoundError: no such file (or unknown model name).
        ValueError: not a GGUF file, or llama.cpp could not load it (corrupt, truncated,
            unsupported architecture); the message carries llama.cpp's reason.

    Use as a context manager, or call :meth:`close`, to free the weights deterministically.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_gpu_layers: int = -1,
        use_mmap: bool = True,
        vocab_only: bool = False,
        n_ctx: int = 4096,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        split_mode: str = "layer",
        main_gpu: int = 0,
        tensor_split: Sequence[float] | None = None,
        progress: bool | Callable[[float], Any] = False,
        op_offload: bool = True,
        rpc: Sequence[str] | None = None,
        repack: bool = True,
        type_k: str = "f16",
        type_v: str = "f16",
        flash_attn: str = "auto",
    ):
        _log.sync_level()
        n_gpu_layers = as_int(n_gpu_layers, "n_gpu_layers", -1, note=" (-1: all layers)")
        one_of(split_mode, "split_mode", _SPLIT_MODES)
        main_gpu = as_int(main_gpu, "main_gpu", 0)
        split = [float(x) for x in tensor_split] if tensor_split is not None else []
        if isinstance(rpc, str):
            rpc = [rpc]
        rpc = list(rpc or [])
        for ep in rpc:
            endpoint(ep)
        self.path = models.resolve(path)
        cb, bar = _progress_callback(progress, self.path)
        try:
            self._llama_model = _core.Model(
                str(self.path),
                n_gpu_layers,
                1 if use_mmap else 0,
                bool(vocab_only),
                _SPLIT_MODES[split_mode],
                main_gpu,
                split,
                cb,
                rpc,
                bool(repack),
            )
        finally:
            if bar is not None:
                bar.close()
        self.use_mmap = bool(use_mmap)
        """Whether the weights are mapped from the file (read-only pages: no full fine-tuning)."""
        self.repack = bool(repack)
        """Whether the CPU may keep weights in repacked layouts (the ``repack`` argument)."""
        self._context_params = dict(
            n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads, op_offload=op_offload,
            type_k=type_k, type_v=type_v, flash_attn=flash_attn,
        )  # fmt: skip
        self.attachments: dict[str, Any] = {}
        """Objects that feature modules keep for this model's lifetime (the default context of
        generate/chat, the embedding context); :meth:`close` drops them."""
        self._templates: ChatTemplates | None = None
        self._metadata: dict | None = None

    # --- lifetime
    def close(self) -> None:
        """Free the weights and every context on this model. Idempotent."""
        self.attachments.clear()
        self._llama_model.close()

    @property
    def closed(self) -> bool:
        """True after close() (then every other call raises ValueError)."""
        return self._llama_model.closed

    @classmethod
    def from_pretrained(
        cls,
        repo_id: str,
        filename: str | None = None,
        *,
        revision: str | None = None,
        mmproj: bool | str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load a GGUF model from Hugging Face repository ``repo_id`` ("org/name"), as
        llama-cpp-python's ``Llama.from_pretrained``: ``filename`` is a path or a glob naming one
        file (``"*Q4_K_M.gguf"``; None: llama.cpp's choice, Q4_K_M, then Q8_0, then the first
        model file), downloaded into huggingface_hub's cache (its token, ``HF_ENDPOINT``,
        ``HF_HUB_OFFLINE=1``) with every part of a split model; ``kwargs`` go to the
        constructor. Raises FileNotFoundError, ValueError (no file or several match: the
        repository's GGUF files are listed), ConnectionError, and the constructor's errors.
        ``mmproj``: True loads the repository's multimodal projector (llama.cpp's choice:
        :func:`llamabind.hub.pick_mmproj`; FileNotFoundError if it has none), a path or glob names
        one (``llamabind.Model`` takes it as ``mmproj=``). Wraps :func:`llamabind.hub.download`."""
        from . import hub

        path = hub.download(repo_id, filename, revision=revision)
        if mmproj is not None and mmproj is not False:
            proj = hub.download_mmproj(repo_id, None if mmproj is True else str(mmproj), revision=revision)
            if proj is None:
                raise FileNotFoundError(f"{repo_id} has no multimodal projector (no GGUF named *mmproj*)")
            kwargs["mmproj"] = proj
        return cls(path, **kwargs)

    def __enter__(self) -> Model:
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
        return self._llama_model.vocab_only

    @property
    def n_ctx_train(self) -> int:
        """Context length the model was trained with (tokens)."""
        return self._llama_model.n_ctx_train

    @property
    def n_vocab(self) -> int:
        """Tokens in the vocabulary (llama_vocab_n_tokens): the length of a logits row."""
        return self._llama_model.n_vocab

    @property
    def n_embd(self) -> int:
        """Embedding width (llama_model_n_embd)."""
        return self._llama_model.n_embd

    @property
    def n_layer(self) -> int:
        """Transformer layers (llama_model_n_layer): the most n_gpu_layers can offload, with the output layer."""
        return self._llama_model.n_layer

    @property
    def output_offloaded(self) -> bool:
        """Whether the output layer (the logits) runs on a GPU/RPC device: n_gpu_layers is -1 or
        above n_layer and the build has one (where backend sampling is on by default)."""
        return self._llama_model.output_offloaded

    @property
    def n_params(self) -> int:
        """Number of parameters."""
        return self._llama_model.n_params

    @property
    def size(self) -> int:
        """Size of the weights in bytes."""
        return self._llama_model.size

    @property
    def description(self) -> str:
        """llama_model_desc, e.g. ``"llama ?B Q4_1"``."""
        return self._llama_model.description

    @property
    def token_bos(self) -> int | None:
        """The beginning-of-sequence token id (llama_vocab_bos), or None if the vocabulary has none."""
        return cast("int | None", self._llama_model.token_bos)

    @property
    def token_eos(self) -> int | None:
        """The end-of-sequence token id (llama_vocab_eos), or None if the vocabulary has none."""
        return cast("int | None", self._llama_model.token_eos)

    @property
    def token_sep(self) -> int | None:
        """The separator token id (llama_vocab_sep; BERT's [SEP]), or None."""
        return cast("int | None", self._llama_model.token_sep)

    add_bos = property(lambda self: self._llama_model.add_bos, doc="Whether tokenize() adds BOS (the vocabulary's).")
    add_eos = property(lambda self: self._llama_model.add_eos, doc="Whether tokenize() adds EOS (the vocabulary's).")
    add_sep = property(
        lambda self: self._llama_model.add_sep, doc="Whether a pair is joined with SEP (the vocabulary's)."
    )
    n_cls_out = property(
        lambda self: self._llama_model.n_cls_out, doc="Outputs of the classification head (rerankers; 0: none)."
    )

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (wraps llama_vocab_is_eog)."""
        return self._llama_model.is_eog(token)

    # --- tokenizer
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (wraps llama_tokenize).

        add_special: add BOS/EOS if the model's vocabulary asks for them.
        parse_special: turn the text of special tokens (e.g. ``"<|im_start|>"``) into their ids;
        otherwise it is tokenized as plain text. Raises TypeError for non-str input (bytes too).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        return self._llama_model.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Text of token ids (wraps llama_detokenize); invalid UTF-8 becomes U+FFFD.

        Raises ValueError for an id outside [0, n_vocab).
        """
        return self._llama_model.detokenize(list(tokens), remove_special, unparse_special)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """UTF-8 bytes of one token (may be part of a character). Wraps llama_token_to_piece."""
        return self._llama_model.token_to_piece(token, special)

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF chat template (``tokenizer.chat_template``), or None."""
        return cast("str | None", self._llama_model.chat_template(name))

    @property
    def context_params(self) -> dict[str, Any]:
        """The parameters of the contexts this model makes by default (n_ctx, n_batch, n_ubatch,
        n_threads, op_offload, type_k, type_v, flash_attn), as given to the constructor (a copy)."""
        return dict(self._context_params)

    def chat_templates(self, template: str | None = None) -> ChatTemplates:
        """The model's chat templates (or ``template``, jinja source, instead of the GGUF's); wraps
        common_chat_templates_init. The GGUF's are parsed once and kept. Raises ValueError for a
        template that does not parse."""
        if template is not None:
            return ChatTemplates(self, template)
        if self._templates is None:
            self._templates = ChatTemplates(self)
        return self._templates

    def tensor_info(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, ggml type name, numpy shape)`` of every tensor in the model's GGUF file, read
        from its header with gguf_init_from_file (e.g. ``("blk.0.attn_q.weight", "q4_1", (576,
        576))``). Raises ValueError if the header cannot be read."""
        return [(n, t, tuple(reversed(ne))) for n, t, ne in _core.read_tensor_info(str(self.path))]

    def save(self, path: str | os.PathLike) -> None:
        """Write the weights as they are now (e.g. after :func:`llamabind.train.finetune`) and the
        model's metadata to a GGUF file. Wraps llama_model_save_to_file. Raises ValueError if the
        path cannot be written."""
        _core.model_save(self._llama_model, str(path))

    def load_lora(self, path: str | os.PathLike) -> LoraAdapter:
        """Load a LoRA adapter (GGUF) made for this model; apply it with :meth:`Context.set_lora`.

        Raises FileNotFoundError, ValueError (not an adapter for this model). Wraps llama_adapter_lora_init.
        """
        return LoraAdapter(self, path)


FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}
"""Target types of :func:`quantize` (llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q4_0, ...)."""


def quantize(src: str | os.PathLike, dst: str | os.PathLike, type: str, *, n_threads: int | None = None) -> None:
    """Convert the GGUF model ``src`` to ``dst`` with weights of ``type`` (a key of FILE_TYPES),
    dequantizing first where src is quantized (``"F32"`` makes a quantized model trainable).
    Wraps llama_model_quantize (allow_requantize). Raises FileNotFoundError, ValueError for an
    unknown type, LlamaError if llama.cpp fails."""
    one_of(type, "type", FILE_TYPES)
    src = models.resolve(src)
    _core.quantize_model(str(src), str(dst), FILE_TYPES[type], n_threads or 0)


def write_lora_gguf(path: str | os.PathLike, arch: str, alpha: float, tensors: Sequence[tuple[str, Any]]) -> None:
    """Write a LoRA adapter GGUF (general.type "adapter", adapter.type "lora",
    adapter.lora.alpha) with F32 tensors ``(name, array (rows, cols))``, names ending in
    ``.lora_a`` / ``.lora_b``, as llama_adapter_lora_init reads them (ggml's gguf writer)."""
    _core.lora_write(os.fspath(path), arch, float(alpha), list(tensors))


class LoraAdapter:
    """A LoRA adapter loaded on a :class:`Model` (``Model.load_lora``, which passes the ``model`` and the
    adapter GGUF's ``path``; llama_adapter_lora_init). ``close()`` frees it (LlamaError while a context
    still applies it); otherwise it is freed with the model."""

    def __init__(self, model: Model, path: str | os.PathLike):
        self.model = model
        self.path = Path(os.fspath(path))
        self._llama_adapter = _core.Lora(model._llama_model, str(self.path))

    @property
    def metadata(self) -> dict[str, str]:
        """The adapter's GGUF key/values (scalars, as str)."""
        return self._llama_adapter.metadata()

    def save(self, path: str | os.PathLike) -> None:
        """Write the adapter's A/B tensors as they are now (e.g. trained by
        :func:`llamabind.train.finetune`) as a LoRA adapter GGUF that ``Model.load_lora`` and
        upstream's tools (``--lora``) load (ggml_backend_tensor_get, gguf_write_to_file). F32
        adapters only (TypeError otherwise). Raises ValueError if the path cannot be written or
        the adapter is closed."""
        _core.lora_save(self._llama_adapter, str(path))

    def close(self) -> None:
        """Free the adapter (llama_adapter_lora_free). Raises LlamaError while a context applies it."""
        self._llama_adapter.close()

    @property
    def closed(self) -> bool:
        """True after close() or after the model was closed."""
        return self._llama_adapter.closed

    def __repr__(self) -> str:
        return f"<llamabind.LoraAdapter {self.path.name}{' (closed)' if self.closed else ''}>"


ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a conversation's messages may take (OpenAI's, which chat templates render)."""


class ChatTemplates:
    """A model's chat templates, or ``template`` (jinja source) instead of the GGUF's one.
    Wraps common_chat_templates_init; raises ValueError for a template that does not parse."""

    def __init__(self, model: Model, template: str | None = None):
        if template is not None and not isinstance(template, str):
            raise TypeError(f"template must be a str (jinja) or None; got {type(template).__name__}")
        self.model = model
        self._llama_templates = _core.ChatTemplates(model._llama_model, template or "")

    @property
    def source(self) -> str:
        """The jinja source in use."""
        return self._llama_templates.source

    def apply(
        self,
        messages: Sequence[dict],
        *,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict = "auto",
        parallel_tool_calls: bool = False,
        json_schema: dict | str | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> _core.ChatParams:
        """Render messages; the result has ``prompt`` (str), ``grammar`` (for tools or a schema),
        ``format`` (the parser common picked), ``additional_stops`` and ``parse(text, ...)``
        (common_chat_parse).

        messages: OpenAI-style dicts with ``role`` and ``content`` (str or a list of
        {"type": "text", "text"} parts), optionally ``tool_calls``/``tool_call_id``/``name``.
        tools: OpenAI-style [{"type": "function", "function": {"name", "description",
        "parameters"}}]. tool_choice: "auto", "none", "required", or OpenAI's named form
        ``{"type": "function", "function": {"name": ...}}`` (that tool must be called). json_schema: constrain the
        reply to JSON valid for this schema. parallel_tool_calls: let the reply call several tools at
        once. add_generation_prompt: end the prompt with the assistant turn's header (False: render the
        conversation as it is, e.g. for training). enable_thinking: let reasoning models think (the
        templates' ``enable_thinking``). template_kwargs: extra jinja variables (JSON values).
        Raises TypeError/ValueError for malformed messages (a role other than :data:`ROLES`), tools or schema.
        Wraps common_chat_templates_apply.
        """
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a sequence of dicts like {'role': 'user', 'content': '...'}")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] has no 'role' (str)")
            if m["role"] not in ROLES:
                raise ValueError(f"messages[{i}]['role'] must be one of {', '.join(ROLES)}; got {m['role']!r}")
        tools, tool_choice = _tool_choice(tools, tool_choice)
        schema = (
            None if json_schema is None else (json_schema if isinstance(json_schema, str) else json.dumps(json_schema))
        )
        kwargs = {str(k): json.dumps(v) for k, v in (template_kwargs or {}).items()}
        try:
            msgs = json.dumps(list(messages))
            tls = json.dumps(list(tools)) if tools else ""
        except TypeError as e:
            raise TypeError(f"messages and tools must be JSON-serializable: {e}") from None
        return self._llama_templates.apply(
            msgs,
            tls,
            bool(add_generation_prompt),
            schema or "",
            tool_choice,
            bool(parallel_tool_calls),
            bool(enable_thinking),
            kwargs,
        )

    def render(self, messages: Sequence[dict], **kwargs: Any) -> str:
        """The prompt text for messages (see :meth:`apply`)."""
        return self.apply(messages, **kwargs).prompt


def json_schema_to_grammar(schema: dict | str) -> str:
    """GBNF grammar text for a JSON schema (dict or JSON text), by llama.cpp common's
    json_schema_to_grammar. Raises ValueError for invalid JSON or an unsupported schema."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return _core.json_schema_to_grammar(text)
