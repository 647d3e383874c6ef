"""An OpenAI-compatible HTTP server with continuous batching.

From a shell::

    python -m llamabind serve smollm2-135m-instruct --port 8080 --parallel 4

From Python::

    with llamabind.serve("model.gguf", port=0) as srv:     # port 0: any free port
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        client.chat.completions.create(model=srv.model_id, messages=[...])

The scheduler, the slots and the OpenAI layer are llama.cpp's own (``tools/server``'s
server_context and server_routes, from the same patched tree: :mod:`llamabind.server_context`);
this module is the HTTP front: an ASGI application (Starlette) served by uvicorn, which checks API
keys, body sizes, JSON and the model name, maps the named ``tool_choice`` that llama-server ignores,
bounds the requests in flight (503 beyond), and frees a slot when its client goes away.

Endpoints (llama-server's): ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``
(with ``embedding=True``), ``/v1/responses``, ``/tokenize``, ``/detokenize``, ``/apply-template``,
``/completion``, ``/infill``, ``/rerank``; ``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus
text), ``/slots``, ``/props``. Errors have OpenAI's shape ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from ._validate import as_int, is_loopback, tool_choice
from .server_context import ServerContext

__all__ = ["Server", "serve", "create_app", "DEFAULT_PORT", "MAX_BODY"]

DEFAULT_PORT = 8080  # llama-server's
MAX_BODY = 16 * 2**20  # bytes of a request body (413 beyond)
PUBLIC = frozenset({"/health", "/v1/health"})  # answered without an API key, as llama-server does
NO_KEY_WARNING = (
    "llamabind.serve on {host} without an API key: anyone who can reach it can use the model. "
    "Give api_key (--api-key) or bind it to 127.0.0.1 (the default)."
)
log = logging.getLogger("llamabind.server")


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: Any = None, param: str | None = None
) -> Any:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``; ``param`` names the request field."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _authorized(headers: Any, api_key: str) -> bool:
    given = headers.get("authorization", "")
    given = given[7:] if given[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), api_key.encode())


# sampling fields a request may carry, as llama-server reads them, and the range each must be in: a value
# outside it is a 400 naming the field (llama-server took temperature 1e308, top_p -3, min_p 7 and answered)
_REAL_FIELDS = {
    "temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "typical_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0), "repeat_penalty": (0.0, 100.0),
    "dynatemp_range": (0.0, 100.0), "xtc_probability": (0.0, 1.0), "xtc_threshold": (0.0, 1.0),
}  # fmt: skip
_INT_FIELDS: dict[str, tuple[int, int | None]] = {
    "top_k": (0, None),
    "top_logprobs": (0, 20),
    "n_probs": (0, 100),
    "repeat_last_n": (-1, None),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field_error(data: dict, path: str, n_vocab: int | None) -> tuple[str, str] | None:
    """What is wrong with a request's sampling fields: (message, the field), or None."""
    for key, (lo, hi) in _REAL_FIELDS.items():
        v = data.get(key)
        if v is not None and not (_is_number(v) and lo <= v <= hi):
            return f"'{key}' must be a number in [{lo:g}, {hi:g}]; got {v!r}", key
    for key, (first, last) in _INT_FIELDS.items():
        v = data.get(key)
        if v is not None and not (_is_int(v) and v >= first and (last is None or v <= last)):
            return f"'{key}' must be an integer in [{first}, {'...' if last is None else last}]; got {v!r}", key
    mirostat = data.get("mirostat")
    if mirostat is not None and not (_is_int(mirostat) and mirostat in (0, 1, 2)):
        return f"'mirostat' must be 0 (off), 1 or 2; got {mirostat!r}", "mirostat"
    for key in ("mirostat_tau", "mirostat_eta"):
        if data.get(key) is not None and not (_is_number(data[key]) and data[key] >= 0):
            return f"'{key}' must be a number >= 0; got {data[key]!r}", key
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            return f"'stop' must be a string or an array of strings; got {stop!r}", "stop"
    if data.get("seed") is not None and not _is_int(data["seed"]):
        return f"'seed' must be an integer; got {data['seed']!r}", "seed"
    if data.get("n_predict") is not None and not (_is_int(data["n_predict"]) and data["n_predict"] >= -1):
        return f"'n_predict' must be an integer >= -1 (-1: until the end); got {data['n_predict']!r}", "n_predict"
    lp = data.get("logprobs")
    if lp is not None and path.endswith("/chat/completions") and not isinstance(lp, bool):
        return f"'logprobs' must be true or false; got {lp!r}", "logprobs"
    if lp is not None and path == "/v1/completions" and not (_is_int(lp) and 0 <= lp <= 5):
        return f"'logprobs' must be an integer in [0, 5]; got {lp!r}", "logprobs"
    if "logit_bias" in data:
        return _logit_bias_error(data["logit_bias"], path.startswith("/v1/"), n_vocab)
    return None


def _logit_bias_error(bias: Any, openai: bool, n_vocab: int | None) -> tuple[str, str] | None:
    """'logit_bias': OpenAI's object of token ids (as strings) to biases, or llama-server's array of [token, bias]
    pairs; on llama-server's own routes a key may also be text (its tokens take the bias). A bias is a number, or
    false (the token never sampled)."""
    if bias is None:
        return None
    vocab = f"[0, {n_vocab if n_vocab is not None else 'n_vocab'})"
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, list) and all(isinstance(x, list) and len(x) == 2 for x in bias):
        items = [(k, v) for k, v in bias]
    else:
        return f"'logit_bias' must be an object of token ids to biases; got {bias!r}", "logit_bias"
    for key, value in items:
        tok = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        if _is_int(tok):
            if tok < 0 or (n_vocab is not None and tok >= n_vocab):
                return f"'logit_bias' has token id {key!r} outside the vocabulary {vocab}", "logit_bias"
        elif openai or not isinstance(tok, str) or not tok:
            return f"'logit_bias' keys must be token ids in {vocab}; got {key!r}", "logit_bias"
        if not (_is_number(value) or value is False):
            return f"'logit_bias'[{key!r}] must be a number (or false: never); got {value!r}", "logit_bias"
    return None


def _token_error(data: dict, n_vocab: int | None) -> tuple[str, str] | None:
    """/detokenize: 'tokens' must be token ids of this vocabulary (llama.cpp answered a raw C++ range error)."""
    ids = data.get("tokens")
    if not isinstance(ids, list):
        return "'tokens' must be an array of token ids", "tokens"
    for i, t in enumerate(ids):
        if not _is_int(t) or t < 0 or (n_vocab is not None and t >= n_vocab):
            vocab = n_vocab if n_vocab is not None else "n_vocab"
            return f"'tokens'[{i}] must be a token id in [0, {vocab}); got {t!r}", "tokens"
    return None


def _openai_error_body(status: int, body: bytes) -> bytes:
    """llama.cpp's error body (status >= 400) in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``,
    param the field its JSON parser names ("Field 'seed': [json.exception.type_error.302] ...") or null; other
    bodies as they are."""
    if status < 400:
        return body
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return body
    field = re.match(r"\s*Field '([^']+)'", err["message"])
    err.setdefault("param", field.group(1) if field else None)
    err.setdefault("type", "invalid_request_error")
    err.setdefault("code", None)
    return json.dumps({"error": err}).encode()


def _prepare(
    path: str, body: bytes, model_names: frozenset[str], model_id: str, n_vocab: int | None = None
) -> tuple[bytes, Any]:
    """(body, None) to hand to llama.cpp, or (b"", an error response): the body must be a JSON
    object, name a model this server has (OpenAI routes), ask for at least one token, and a named
    tool_choice becomes that one tool, required (llama-server reads tool_choice as a string only)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        return b"", _error(400, f"the request body is not valid JSON: {e}")
    except RecursionError:  # json's C scanner recurses per nesting level (100,000 '[' reach it)
        return b"", _error(400, "the request body nests JSON deeper than the parser's recursion limit")
    if not isinstance(data, dict):
        return b"", _error(400, "the request body must be a JSON object")
    if path.startswith("/v1/") and "model" in data:
        model = data["model"]
        if not isinstance(model, str):
            return b"", _error(400, "'model' must be a string", param="model")
        if model not in model_names:
            msg = f"the model {model!r} does not exist; this server has {model_id!r}"
            return b"", _error(404, msg, code="model_not_found", param="model")
    if path.endswith("/chat/completions") and (not isinstance(data.get("messages"), list) or not data["messages"]):
        return b"", _error(400, "'messages' must be a non-empty array", param="messages")
    for key in ("max_tokens", "max_completion_tokens"):
        v = data.get(key)
        if v is not None and not (_is_int(v) and v >= 1):
            return b"", _error(400, f"'{key}' must be an integer >= 1; got {v!r}", param=key)
    problem = _token_error(data, n_vocab) if path == "/detokenize" else _field_error(data, path, n_vocab)
    if problem is not None:
        return b"", _error(400, problem[0], param=problem[1])
    if isinstance(data.get("tool_choice"), dict):
        try:
            data["tools"], data["tool_choice"] = tool_choice(data.get("tools"), data["tool_choice"])
        except (TypeError, ValueError) as e:
            return b"", _error(400, str(e), param="tool_choice")
        body = json.dumps(data).encode()
    return body, None


# One route table: its 101 lines are the OpenAI routes, each a few lines over ServerContext; split, they would be read
# apart from the middleware they share.
def create_app(core: ServerContext, *, api_key: str | None = None, max_body: int = MAX_BODY, max_pending: int = 256):
    """The ASGI application (Starlette) in front of ``core``: llama-server's routes, API-key check
    (``Authorization: Bearer KEY`` or ``X-Api-Key``; /health is public), bodies up to ``max_body``
    bytes (413), at most ``max_pending`` requests in flight (503), OpenAI-shaped errors (404 for an
    unknown route or model, 405, 400 for malformed JSON). Streams are SSE (``text/event-stream``)."""
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {"pending": 0, "limiter": None}
    inflight: set = set()  # responses not yet finished (Server.stop closes them)

    def limiter() -> anyio.CapacityLimiter:
        if state["limiter"] is None:  # created in the event loop; one worker thread per request in flight
            state["limiter"] = anyio.CapacityLimiter(max_pending + 8)
        return state["limiter"]

    async def run(r: Any, request: Any) -> None:
        """r.run() on a worker thread; if the client goes away meanwhile, close r (frees its slot)."""
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    await anyio.sleep(0.25)
                    if await request.is_disconnected():
                        r.close()
                        return

            tg.start_soon(watch)
            await anyio.to_thread.run_sync(r.run, limiter=limiter())
            tg.cancel_scope.cancel()

    async def endpoint(request: Any) -> Any:
        path, method = request.url.path, request.method
        if api_key is not None and path not in PUBLIC and not _authorized(request.headers, api_key):
            return _error(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
        body = b""
        if method == "POST":
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > max_body:
                return _error(413, f"the request body is larger than {max_body} bytes")
            chunks, n = [], 0
            async for c in request.stream():
                n += len(c)
                if n > max_body:
                    return _error(413, f"the request body is larger than {max_body} bytes")
                chunks.append(c)
            body, err = _prepare(path, b"".join(chunks), core.model_names, core.model_id, core.n_vocab)
            if err is not None:
                return err
            # the work; GETs (health, metrics, slots, models) are always answered
            if state["pending"] >= max_pending:
                msg = f"the server is overloaded ({max_pending} requests in flight); retry later"
                return _error(503, msg, "server_error")
        counted = method == "POST"
        state["pending"] += counted
        r = core.request(method, path, body, dict(request.query_params))
        inflight.add(r)

        def release() -> None:  # frees the request's native state (and its slot, if unfinished)
            r.close()
            inflight.discard(r)
            state["pending"] -= counted

        try:
            await run(r, request)
            headers, body = dict(r.headers), b"" if r.is_stream else _openai_error_body(r.status, r.body)
            whole = None if r.is_stream else Response(body, r.status, headers, media_type=r.content_type or None)
        except BaseException:
            release()
            raise
        if whole is not None:
            release()
            return whole

        async def stream_body() -> Any:
            try:
                while (chunk := await anyio.to_thread.run_sync(r.next, limiter=limiter())) is not None:
                    if chunk:
                        yield chunk
            finally:
                release()  # also when the client went away: its tasks are cancelled, its slot freed

        headers["Cache-Control"] = "no-cache"
        return StreamingResponse(stream_body(), r.status, headers, media_type=r.content_type)

    async def http_error(request: Any, exc: Any) -> Any:
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed on {request.url.path}")
        return _error(exc.status_code, f"no route {request.method} {request.url.path}", code="not_found")

    by_path: dict[str, list[str]] = {}
    for route in sorted(core.routes):
        m, p = route.split(" ", 1)
        by_path.setdefault(p, []).append(m)
    routes = [Route(p, endpoint, methods=ms) for p, ms in by_path.items()]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.inflight = inflight
    return app


class Server:
    """A running server (uvicorn on a thread of this process); a context manager that stops it.

    url: ``"http://HOST:PORT"`` (the OpenAI base URL is ``url + "/v1"``). model_id: the model name
    clients send. context: the :class:`~llamabind.server_context.ServerContext` behind it.
    """

    def __init__(self, uv: Any, thread: threading.Thread, context: ServerContext, host: str, port: int, app: Any):
        self._uv, self._thread, self._app = uv, thread, app
        self.context = context
        self.host, self.port = host, port
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.model_id = context.model_id

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C raises KeyboardInterrupt here)."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, cancel those in flight (streams end, waiting requests return within
        about a second), stop the scheduler (server_context::terminate). ``timeout``: seconds to wait for
        the HTTP thread before forcing it, then again after. Idempotent."""
        self._uv.should_exit = True
        for r in list(self._app.state.inflight):
            r.close()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._uv.force_exit = True
            self._thread.join(timeout)
        self.context.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<llamabind.Server {self.url} {self.model_id!r} {'running' if self.running else 'stopped'}>"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


# (over 100 lines by its docstring alone: one table row for each of its 33 arguments, what the API reference renders;
# the body is the argument checks and uvicorn's start)
# Long by its argument list (one per llama-server flag) and their documentation; a ServerArgs dataclass shared with
# ServerContext and the CLI would shorten it (a change of the public surface no issue has asked for yet).
def serve(
    model: str | os.PathLike = "smollm2-135m-instruct",
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    parallel: int = 4,
    ctx_size: int | None = None,
    api_key: str | None = None,
    embedding: bool = False,
    pooling: str | None = None,
    n_gpu_layers: int | None = None,
    op_offload: bool = True,
    n_threads: int | None = None,
    n_batch: int | None = None,
    n_ubatch: int | None = None,
    rpc: Sequence[str] | None = None,
    alias: str | None = None,
    chat_template: str | None = None,
    flash_attn: str | None = None,
    lora: Sequence[tuple[str, float]] | None = None,
    max_body: int = MAX_BODY,
    max_pending: int = 256,
    access_log: bool = False,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
    mmproj: str | os.PathLike | None = None,
    mmproj_use_gpu: bool = True,
    image_min_tokens: int | None = None,
    image_max_tokens: int | None = None,
    media_path: str | os.PathLike | None = None,
    model_draft: str | os.PathLike | None = None,
    draft_max: int | None = None,
    draft_min: int | None = None,
    context_shift: bool = False,
) -> Server:
    """Start an OpenAI-compatible server for ``model`` and return once it answers; :meth:`Server.stop` (or
    leaving the ``with`` block) ends it. Built on :class:`~llamabind.server_context.ServerContext` (llama.cpp's
    server core); the llama-server flag of each argument is in docs/server.md.

    Args:
        model: a GGUF path or a model name of :mod:`llamabind.models`.
        host: the address to listen on; a host other than loopback without ``api_key`` warns.
        port: the port; 0: any free port (``Server.url`` has it).
        parallel: slots decoded together (continuous batching).
        ctx_size: KV cache tokens for all slots, any slot may use all of them (None: the model's training
            context, fitted to free memory).
        api_key: require ``Authorization: Bearer KEY`` (or ``X-Api-Key``); None: no key.
        embedding: serve /v1/embeddings (an embedding model).
        pooling: the embeddings' pooling, "mean", "cls", "last" or "rank" (None: the model's, or mean if its
            GGUF names none, as for a causal LM).
        n_gpu_layers: layers to offload (None: all that fit, llama-server's default; -2: every layer).
        op_offload: False keeps the batches of CPU layers on the CPU (llama.cpp sends large ones to a GPU).
        n_threads: CPU threads (None: the cores there are).
        n_batch: the logical batch size (None: llama.cpp's, 2048).
        n_ubatch: the physical batch size (None: llama.cpp's, 512).
        rpc: ["host:port"] RPC servers whose devices the model uses (as ``Model(rpc=...)``).
        alias: the model id clients name (None: the model's name, or the file name without .gguf).
        chat_template: jinja source replacing the model's chat template.
        flash_attn: "on", "off" or "auto" (None: auto).
        lora: [(path, scale)] LoRA adapters applied to every request.
        max_body: the request body limit in bytes (413 beyond).
        max_pending: requests in flight before a 503.
        access_log: log each request (uvicorn's access log).
        cache_type_k: the KV cache's K type ("f16", "q8_0", ...; llama-server's --cache-type-k; None: f16).
        cache_type_v: the V type (a quantized one needs flash attention; None: f16).
        mmproj: a projector GGUF: /v1/chat/completions then takes ``image_url`` and ``input_audio`` content
            parts (llama-server's --mmproj; /props lists the modalities).
        mmproj_use_gpu: run the projector's encoder on the GPU backend.
        image_min_tokens: the fewest tokens an image becomes where the projector's resolution is dynamic.
        image_max_tokens: the most tokens an image becomes (None: the projector's own bounds).
        media_path: the directory ``file://`` media URLs may read (None: none may).
        model_draft: a draft model's GGUF for speculative decoding (llama-server's ``-md``).
        draft_max: tokens drafted per step (None: 3).
        draft_min: the fewest drafted tokens used (None: 0).
        context_shift: a generation that fills its slot drops half of it and goes on (``--context-shift``).

    Raises FileNotFoundError, TypeError/ValueError (bad argument), OSError (the port is taken),
    LlamaError (the model failed to load).
    """
    as_int(port, "port", 0, 65535)
    as_int(max_body, "max_body", 1)
    as_int(max_pending, "max_pending", 1)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty str")
    if not is_loopback(host) and api_key is None:
        warnings.warn(NO_KEY_WARNING.format(host=host), UserWarning, stacklevel=2)
    import uvicorn

    sock = _bind(host, port)  # before loading: a taken port fails at once
    try:
        core = ServerContext(
            model,
            n_parallel=parallel,
            n_ctx=ctx_size,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_gpu_layers=n_gpu_layers,
            op_offload=op_offload,
            n_threads=n_threads,
            embedding=embedding,
            pooling=pooling,
            alias=alias,
            chat_template=chat_template,
            flash_attn=flash_attn,
            lora=lora,
            rpc_servers=rpc,
            type_k=cache_type_k,
            type_v=cache_type_v,
            mmproj=mmproj,
            mmproj_use_gpu=mmproj_use_gpu,
            image_min_tokens=image_min_tokens,
            image_max_tokens=image_max_tokens,
            media_path=media_path,
            model_draft=model_draft,
            draft_max=draft_max,
            draft_min=draft_min,
            context_shift=context_shift,
        )
    except BaseException:
        sock.close()
        raise
    app = create_app(core, api_key=api_key, max_body=max_body, max_pending=max_pending)
    config = uvicorn.Config(
        app,
        log_level="info" if access_log else "warning",
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="llamabind-server", daemon=True)
    thread.start()
    while not uv.started and thread.is_alive():
        time.sleep(0.01)
    sock_port = sock.getsockname()[1]
    srv = Server(uv, thread, core, host, sock_port, app)
    if not thread.is_alive():
        core.close()
        raise OSError(f"the HTTP server on {host}:{sock_port} stopped while starting")
    log.info("serving %s at %s", core.model_id, srv.url)
    return srv
