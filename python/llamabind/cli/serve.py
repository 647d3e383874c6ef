"""``serve``: the OpenAI-compatible HTTP server (llamabind.server)."""

from __future__ import annotations

import sys

from .. import models
from ..context import KV_CACHE_TYPES
from .common import (
    CommaList,
    HelpFormatter,
    add_ctx_size,
    add_flash_attn,
    add_hf,
    add_image_tokens,
    add_lora,
    add_ngl,
    add_threads,
    lora_specs,
)  # fmt: skip


def _serve(args) -> int:
    import signal

    from .. import server

    template = None
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    srv = server.serve(
        args.model_pos or args.model,
        host=args.host,
        port=args.port,
        parallel=args.parallel,
        ctx_size=args.n_ctx,
        api_key=args.api_key,
        embedding=args.embedding,
        pooling=args.pooling,
        n_gpu_layers=args.n_gpu_layers,
        n_threads=args.threads,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        rpc=args.rpc,
        alias=args.alias,
        chat_template=template,
        flash_attn=args.flash_attn,
        lora=lora_specs(args),
        max_body=args.max_body,
        max_pending=args.max_pending,
        access_log=args.verbose,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        mmproj=args.mmproj,
        mmproj_use_gpu=not args.no_mmproj_offload,
        image_min_tokens=args.image_min_tokens,
        image_max_tokens=args.image_max_tokens,
        media_path=args.media_path,
        model_draft=args.model_draft,
        draft_max=args.draft_max,
        draft_min=args.draft_min,
        context_shift=args.context_shift,
    )
    print(
        f"llamabind: serving {srv.model_id!r} at {srv.url} (OpenAI base URL {srv.url}/v1)", file=sys.stderr, flush=True
    )

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        srv.wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


def add_parsers(sub) -> None:
    """The serve subcommand."""
    s = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching (llama.cpp's server core)",
        formatter_class=HelpFormatter,
    )
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help="the model, as -m gives it")
    s.add_argument("--model", "-m", default=models.DEFAULT, help="model name or GGUF path")
    add_hf(s, mmproj=True)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed)")
    s.add_argument("--parallel", "-np", type=int, default=4, help="slots decoded together (default 4)")
    add_ctx_size(s, None, "KV cache tokens shared by the slots (default: the model's n_ctx_train)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or X-Api-Key)")
    s.add_argument("--embedding", action="store_true", help="serve /v1/embeddings (an embedding model)")
    s.add_argument("--pooling", choices=["mean", "cls", "last", "rank"], default=None, help="embedding pooling")
    add_ngl(s, server=True)
    add_threads(s)
    s.add_argument("--batch-size", "-b", type=int, default=None, help="logical batch size (n_batch)")
    s.add_argument("--ubatch-size", "-ub", type=int, default=None, help="physical batch size (n_ubatch)")
    s.add_argument(
        "--rpc", action=CommaList, default=None, metavar="HOST:PORT", help="also use this RPC server's devices (or a,b)"
    )
    s.add_argument("--alias", default=None, help="the model id clients send (default: the model's name)")
    s.add_argument("--chat-template-file", default=None, help="a jinja chat template replacing the model's")
    add_flash_attn(s, None)
    kv = sorted(KV_CACHE_TYPES)
    s.add_argument("--cache-type-k", "-ctk", choices=kv, default=None, help="KV cache type for K (default f16)")
    s.add_argument("--cache-type-v", "-ctv", choices=kv, default=None, help="KV cache type for V (quantized: -fa)")
    s.add_argument("--mmproj", "-mm", default=None, metavar="GGUF", help="a multimodal projector: images/audio in chat")
    s.add_argument("--no-mmproj-offload", action="store_true", help="run the projector's encoder on the CPU")
    add_image_tokens(s)
    s.add_argument("--media-path", default=None, metavar="DIR", help="directory file:// media URLs may read from")
    s.add_argument("--context-shift", action="store_true", help="a full context drops half and goes on")
    s.add_argument("--model-draft", "-md", default=None, metavar="GGUF", help="a draft model: speculative decoding")
    s.add_argument("--draft-max", type=int, default=None, help="tokens drafted per step (default 3)")
    s.add_argument("--draft-min", type=int, default=None, help="fewest drafted tokens used (default 0)")
    add_lora(s)
    s.add_argument("--max-body", type=int, default=16 * 2**20, help="request body limit in bytes (413 beyond)")
    s.add_argument("--max-pending", type=int, default=256, help="requests in flight before 503 (default 256)")
    s.add_argument("--verbose", "-v", action="store_true", help="log each request (uvicorn's access log)")
    s.set_defaults(fn=_serve)
