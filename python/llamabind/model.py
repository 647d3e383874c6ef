"""Model (a loaded GGUF) and Context (a KV cache + compute state on it)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from . import _core, _log, batch, chat, generation, models, speculative
from . import rpc as _rpc
from .generation import GenerationResult, SamplingParams, Stream, _int

__all__ = ["Model", "Context", "LoraAdapter", "json_schema_to_grammar"]

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


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class Model:
    """A GGUF model loaded by llama.cpp (``llama_model_load_from_file``).

    Args:
        path: a GGUF file, or a model name known to :mod:`llamabind.models`
            (e.g. ``"smollm2-135m-instruct"``, downloaded and verified on first use).
        n_gpu_layers: layers to offload to the GPU backend (-1: all; ignored on CPU-only builds).
        use_mmap: map the file instead of reading it into memory.
        vocab_only: load only the vocabulary (tokenize/detokenize work, generation does not).
        n_ctx, n_batch, n_ubatch, n_threads, op_offload: parameters of the contexts that
            :meth:`generate` and :meth:`context` create (see :class:`Context`); n_threads None
            means all cores available to the process.
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
        progress: True shows a tqdm progress bar while loading; a callable(progress in [0, 1])
            is called instead (return False to cancel the load: ValueError).

    Raises:
        FileNotFoundError: no such file (or unknown model name).
        ValueError: not a GGUF file, or llama.cpp could not load it (corrupt, truncated,
            unsupported architecture); the message carries llama.cpp's reason.

    Use as a context manager, or call :meth:`close`, to free the weights deterministically.
    """

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = -1, use_mmap: bool = True,
                 vocab_only: bool = False, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None, split_mode: str = "layer", main_gpu: int = 0,
                 tensor_split: Sequence[float] | None = None, progress: bool | Callable[[float], Any] = False,
                 op_offload: bool = True, rpc: Sequence[str] | None = None):
        _log.sync_level()
        n_gpu_layers = _int("n_gpu_layers", n_gpu_layers, -1, note=" (-1: all layers)")
        if split_mode not in _SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {sorted(_SPLIT_MODES)}; got {split_mode!r}")
        main_gpu = _int("main_gpu", main_gpu, 0)
        split = [float(x) for x in tensor_split] if tensor_split is not None else []
        if isinstance(rpc, str):
            rpc = [rpc]
        rpc = list(rpc or [])
        for ep in rpc:
            _rpc._endpoint(ep)
        self.path = models.resolve(path)
        cb, bar = _progress_callback(progress, self.path)
        try:
            self._m = _core.Model(str(self.path), n_gpu_layers, 1 if use_mmap else 0, bool(vocab_only),
                                  _SPLIT_MODES[split_mode], main_gpu, split, cb, rpc)
        finally:
            if bar is not None:
                bar.close()
        self._ctx_params = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads,
                                op_offload=op_offload)
        self._default_ctx: Context | None = None
        self._embed_ctx: Context | None = None
        self._templates = None
        self._metadata: dict | None = None

    # --- lifetime
    def close(self) -> None:
        """Free the weights and every context on this model. Idempotent."""
        self._default_ctx = self._embed_ctx = None
        self._m.close()

    @property
    def closed(self) -> bool:
        """True after close() (then every other call raises ValueError)."""
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
        """Tokens in the vocabulary (llama_vocab_n_tokens): the length of a logits row."""
        return self._m.n_vocab

    @property
    def n_embd(self) -> int:
        """Embedding width (llama_model_n_embd)."""
        return self._m.n_embd

    @property
    def n_layer(self) -> int:
        """Transformer layers (llama_model_n_layer): the most n_gpu_layers can offload, with the output layer."""
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
        """The beginning-of-sequence token id (llama_vocab_bos), or None if the vocabulary has none."""
        return self._m.token_bos

    @property
    def token_eos(self) -> int | None:
        """The end-of-sequence token id (llama_vocab_eos), or None if the vocabulary has none."""
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

        Uses one context per model, created on first use with the model's n_ctx/n_batch/n_threads;
        a prompt that shares a prefix with the previous call's tokens evaluates only the rest.
        """
        return self._context().generate(prompt, **kwargs)

    def chat(self, messages: Sequence[dict], **kwargs) -> "chat.ChatResult | Stream":
        """Answer a conversation; see :func:`llamabind.chat.chat` for the arguments."""
        return chat.chat(self._context(), messages, **kwargs)

    def chat_templates(self, template: str | None = None) -> "chat.ChatTemplates":
        """The model's chat templates (or ``template``, jinja source, instead of the GGUF's); wraps
        common_chat_templates_init. Raises ValueError for a template that does not parse."""
        return chat.ChatTemplates(self, template)

    def _chat_templates(self, template: str | None) -> "chat.ChatTemplates":
        if template is not None:
            return chat.ChatTemplates(self, template)
        if self._templates is None:
            self._templates = chat.ChatTemplates(self)
        return self._templates

    def embed(self, texts: str | Sequence[str], **kwargs) -> np.ndarray:
        """Embeddings of texts; see :func:`llamabind.batch.embed`."""
        return batch.embed(self, texts, **kwargs)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kwargs) -> list[GenerationResult]:
        """Generate for several prompts at once in one context; see :func:`llamabind.batch.generate_batch`."""
        return batch.generate_batch(self, prompts, **kwargs)

    def load_lora(self, path: str | os.PathLike) -> "LoraAdapter":
        """Load a LoRA adapter (GGUF) made for this model; apply it with :meth:`Context.set_lora`.

        Raises FileNotFoundError, ValueError (not an adapter for this model). Wraps llama_adapter_lora_init.
        """
        return LoraAdapter(self, path)


class LoraAdapter:
    """A LoRA adapter loaded on a :class:`Model` (``Model.load_lora``). ``close()`` frees it
    (LlamaError while a context still applies it); otherwise it is freed with the model."""

    def __init__(self, model: Model, path: str | os.PathLike):
        self.model = model
        self.path = Path(os.fspath(path))
        self._l = _core.Lora(model._m, str(self.path))

    @property
    def metadata(self) -> dict[str, str]:
        """The adapter's GGUF key/values (scalars, as str)."""
        return self._l.metadata()

    def close(self) -> None:
        """Free the adapter (llama_adapter_lora_free). Raises LlamaError while a context applies it."""
        self._l.close()

    @property
    def closed(self) -> bool:
        """True after close() or after the model was closed."""
        return self._l.closed

    def __repr__(self) -> str:
        return f"<llamabind.LoraAdapter {self.path.name}{' (closed)' if self.closed else ''}>"


class Context:
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

    Raises ValueError for out-of-range parameters, LlamaError if llama.cpp cannot create the
    context (e.g. out of memory). One context must not be used by two threads at once: the
    second gets a LlamaError. Use one context per thread.
    """

    POOLING = {None: -1, "none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: int | None = None, n_seq_max: int = 1, kv_unified: bool = True,
                 embeddings: bool = False, pooling: str | None = None, op_offload: bool = True):
        _log.sync_level()
        if not isinstance(model, Model):
            raise TypeError(f"model must be a llamabind.Model; got {type(model).__name__}")
        n_ctx = _int("n_ctx", n_ctx, 0, 1 << 24, " (0: the model's n_ctx_train)")  # 0 and >= 8: checked natively
        n_batch = _int("n_batch", n_batch, 1, 1 << 24)
        n_ubatch = _int("n_ubatch", n_ubatch, 1, 1 << 24)
        n_threads = _default_threads() if n_threads is None else _int("n_threads", n_threads, 1, 512)
        n_seq_max = _int("n_seq_max", n_seq_max, 1, 256)
        if pooling not in self.POOLING:
            raise ValueError(f"pooling must be one of {list(self.POOLING)}; got {pooling!r}")
        self.model = model
        self._generation = 0  # bumped by each generate(); an older stream then refuses to continue
        self._tokens: list[int] = []  # the tokens of sequence 0 in the KV cache (prompt-prefix reuse)
        self._loras: dict[LoraAdapter, float] = {}
        self._c = _core.Context(model._m, n_ctx, n_batch, n_ubatch, n_threads, n_threads, n_seq_max,
                                bool(embeddings), self.POOLING[pooling], bool(kv_unified), bool(op_offload))

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

    n_ctx = property(lambda self: self._c.n_ctx, doc="Context size in tokens (all sequences).")
    n_batch = property(lambda self: self._c.n_batch, doc="Most tokens per llama_decode.")
    n_ubatch = property(lambda self: self._c.n_ubatch, doc="Physical batch size.")
    n_threads = property(lambda self: self._c.n_threads, doc="CPU threads.")
    n_seq_max = property(lambda self: self._c.n_seq_max, doc="Sequences the KV cache holds.")

    @property
    def n_past(self) -> int:
        """Tokens of sequence 0 currently in the KV cache."""
        return self._c.pos(0)

    @property
    def tokens(self) -> list[int]:
        """The token ids of sequence 0 in the KV cache (a copy)."""
        return list(self._tokens)

    def decode(self, tokens: Sequence[int]) -> None:
        """Evaluate token ids after the tokens already in sequence 0 of the KV cache (wraps
        llama_decode, then llama_synchronize: the computation is finished when this returns).

        The GIL is released while llama.cpp computes; Ctrl-C raises KeyboardInterrupt and leaves
        the cache as it was before the interrupted chunk. Raises ValueError for ids outside
        [0, n_vocab), an empty list, or more tokens than n_ctx has room for.
        """
        tokens = [int(t) for t in tokens]
        n0 = self._c.pos(0)
        try:
            self._c.decode(tokens)
        except BaseException:
            self._track(n0, tokens)  # earlier chunks may have been kept
            raise
        if len(self._tokens) == n0:
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
        n0 = self._c.pos(0)
        try:
            return self._c.eval(tokens, 0, bool(copy))
        finally:
            self._track(n0, tokens)

    def _track(self, n0: int, tokens: list[int]) -> None:
        """Record tokens appended to sequence 0 at position n0 (while _tokens mirrors the cache)."""
        if len(self._tokens) == n0:
            self._tokens += tokens[: self._c.pos(0) - n0]

    def logits(self) -> np.ndarray:
        """Logits of the last decoded token: float32 array of shape (n_vocab,)."""
        return self._c.logits(-1)

    def clear(self) -> None:
        """Empty the KV cache (all sequences)."""
        self._c.clear()
        self._tokens = []

    def _truncate(self, n: int) -> None:
        """Keep the first n tokens of sequence 0 in the KV cache."""
        if not self._c.seq_rm(0, n, -1):
            self.clear()
            raise RuntimeError("llama.cpp could not truncate the KV cache; it was cleared")
        self._tokens = self._tokens[:n]

    # --- KV cache and state
    def seq_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Remove positions [p0, p1) (p1 -1: to the end) of a sequence from the KV cache
        (wraps llama_memory_seq_rm)."""
        if not self._c.seq_rm(seq_id, p0, p1):
            raise ValueError(f"llama.cpp cannot remove positions [{p0}, {p1}) of sequence {seq_id} (partial removal "
                             "is not supported by this model's memory)")
        if seq_id in (0, -1):
            # a hole leaves _tokens shorter than the cache: prefix reuse then starts afresh
            self._tokens = self._tokens[:p0]

    def seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Share positions [p0, p1) of sequence src with sequence dst (wraps llama_memory_seq_cp;
        no copy of the data with a unified KV cache)."""
        self._c.seq_cp(src, dst, p0, p1)
        if dst == 0:
            self._tokens = []  # no longer known: prefix reuse starts afresh

    def save_state(self) -> bytes:
        """The context's state as bytes: the KV cache (llama_state_get_data; at this pin it holds
        no logits) and sequence 0's tokens. Restore with :meth:`load_state` on a context of the
        same model and parameters; generate() then re-evaluates only the last token."""
        return self._c.state_get() + _state_trailer(self._tokens)

    def load_state(self, data: bytes) -> None:
        """Restore :meth:`save_state` bytes. Raises ValueError (and empties the cache) for bytes
        that are not a state of this context."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes; got {type(data).__name__}")
        state, tokens = _split_state(bytes(data))
        self._tokens = []
        self._c.state_set(state)
        self._tokens = tokens

    def save_state_file(self, path: str | os.PathLike) -> None:
        """Write the state and sequence 0's tokens to a session file (llama_state_save_file)."""
        self._c.state_save_file(os.fspath(path), self._tokens)

    def load_state_file(self, path: str | os.PathLike) -> list[int]:
        """Restore a session file; returns its tokens (now sequence 0). Raises FileNotFoundError,
        ValueError (not a session of this context: the cache is emptied)."""
        self._tokens = []
        self._tokens = list(self._c.state_load_file(os.fspath(path)))
        return list(self._tokens)

    # --- LoRA
    def set_lora(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Apply a LoRA adapter with a scale (0 disables it, 1 is full strength; any finite
        value). Wraps llama_set_adapters_lora. The KV cache is emptied (its entries were computed
        without the adapter)."""
        if not isinstance(adapter, LoraAdapter):
            raise TypeError(f"adapter must be a LoraAdapter (Model.load_lora); got {type(adapter).__name__}")
        loras = {**self._loras, adapter: float(scale)}
        self._c.set_loras([(a._l, s) for a, s in loras.items()])
        self._loras = loras
        self.clear()

    def remove_lora(self, adapter: LoraAdapter | None = None) -> None:
        """Stop applying an adapter (None: all). The KV cache is emptied."""
        loras = {} if adapter is None else {a: s for a, s in self._loras.items() if a is not adapter}
        self._c.set_loras([(a._l, s) for a, s in loras.items()])
        self._loras = loras
        self.clear()

    # --- generation
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, stop: str | Sequence[str] | None = None,
                 stream: bool = False, add_special: bool = True, parse_special: bool = True,
                 json_schema: dict | str | None = None, logprobs: int | None = None,
                 draft_model: Model | None = None, lookup_ngram: int | None = None, n_draft: int = 8,
                 **sampling) -> GenerationResult | Stream:
        """Generate a continuation of ``prompt`` through llama.cpp's sampler chain.

        Args:
            prompt: text, or token ids. Text is tokenized with ``add_special`` (BOS if the model
                wants one) and ``parse_special`` (special-token text becomes special tokens).
            max_tokens: most tokens to generate (>= 0).
            stop: string(s) that end the generation; the matched string is not included.
            stream: return a :class:`Stream` of text pieces instead of the finished result.
            json_schema: constrain the output to JSON that validates against this schema (a dict
                or JSON text), through common's json_schema_to_grammar; ``{}`` is any object.
            logprobs: also return, per generated token, its log-probability and this many top
                alternatives (0..100); computed from the last position's logits only.
            draft_model / lookup_ngram: speculative decoding with a small model of the same
                vocabulary, or with n-gram lookup in the context (n = lookup_ngram, 1..8); n_draft
                (1..64) tokens are proposed per step. The output is the same as without it.
            **sampling: fields of :class:`SamplingParams` (temperature, top_k, top_p, min_p,
                typical_p, xtc_*, dry_*, mirostat*, repeat/frequency/presence penalties,
                logit_bias, grammar, seed, ...).

        Returns a :class:`GenerationResult` (or a :class:`Stream` whose ``result`` is set at the
        end). The KV cache keeps the longest prefix shared with the previous call (timings
        show prompt_reused). Ctrl-C raises KeyboardInterrupt within one token.

        Raises ValueError (bad parameter, empty prompt, prompt longer than n_ctx, grammar or
        schema that does not parse), TypeError (unknown or mistyped argument).
        """
        params, rest = SamplingParams.split(sampling)
        if rest:
            raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(rest)}")
        if json_schema is not None:
            if params.grammar is not None:
                raise ValueError("give either grammar or json_schema, not both")
            params = dataclasses.replace(params, grammar=json_schema_to_grammar(json_schema))
        draft = speculative.make(self, draft_model, lookup_ngram, n_draft)
        if draft is not None and logprobs is not None:
            raise ValueError("logprobs are not available with speculative decoding")
        gen = generation.run(self, prompt, max_tokens, params, stop, add_special, parse_special,
                             logprobs=logprobs, draft=draft)
        if stream:
            return Stream(gen)
        return generation.collect(gen)

    def chat(self, messages: Sequence[dict], **kwargs) -> "chat.ChatResult | Stream":
        """Answer a conversation in this context; see :func:`llamabind.chat.chat`."""
        return chat.chat(self, messages, **kwargs)


def json_schema_to_grammar(schema: dict | str) -> str:
    """GBNF grammar text for a JSON schema (dict or JSON text), by llama.cpp common's
    json_schema_to_grammar. Raises ValueError for invalid JSON or an unsupported schema."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return _core.json_schema_to_grammar(text)


_TRAILER = b"LBTOKENS"


def _state_trailer(tokens: list[int]) -> bytes:
    arr = np.asarray(tokens, dtype="<i4").tobytes()
    return arr + len(tokens).to_bytes(8, "little") + _TRAILER


def _split_state(data: bytes) -> tuple[bytes, list[int]]:
    if len(data) < 16 or not data.endswith(_TRAILER):
        raise ValueError("not a llamabind state (from Context.save_state)")
    n = int.from_bytes(data[-16:-8], "little")
    if n * 4 + 16 > len(data):
        raise ValueError("not a llamabind state (from Context.save_state): bad token count")
    tokens = np.frombuffer(data[-16 - 4 * n:-16], dtype="<i4").tolist()
    return data[: -16 - 4 * n], tokens
