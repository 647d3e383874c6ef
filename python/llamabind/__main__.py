"""Command line: ``python -m llamabind generate|chat|finetune|eval|fuse|serve|rpc-server|info``."""

from __future__ import annotations

import argparse
import json
import sys

from .generation import Stream

DEFAULT_PROMPT = "The three most useful things to know about the Python programming language are"


def _model_kwargs(args) -> dict:
    """The Model(...) arguments the generate and chat commands share."""
    kw = dict(
        n_ctx=args.n_ctx, n_threads=args.threads, rpc=args.rpc, n_gpu_layers=args.n_gpu_layers, repack=args.repack
    )
    if args.split_mode is not None:
        kw["split_mode"] = args.split_mode
    if args.tensor_split is not None:
        kw["tensor_split"] = args.tensor_split
    return kw


def _generation_kwargs(args) -> dict:
    """The streamed generate()/chat() arguments the generate and chat commands share."""
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stream=True,
    )


def _proportions(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 3,1; got {text!r}") from None


def _generate(args) -> int:
    from . import Model, models

    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    with Model(args.model, **_model_kwargs(args)) as m:
        stream = m.generate(prompt, **_generation_kwargs(args))
        assert isinstance(stream, Stream)
        out = sys.stdout
        if args.prompt is None or args.echo:
            out.write(prompt)
        try:
            for piece in stream:
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            print("[interrupted]", file=sys.stderr)
            return 130
        out.write("\n")
        out.flush()
        r = stream.result
        assert r is not None
        name = args.model if args.model in models.KNOWN else str(m.path)
        print(f"[{name} | {m.description} | {r.timings.summary()} | finish: {r.finish_reason}]", file=sys.stderr)
    return 0


def _chat(args) -> int:
    """An interactive chat: each line is a user turn; the history is kept (and its KV cache
    reused). Commands: /exit (or EOF) ends, /reset clears the history, /system TEXT sets it."""
    from . import Model

    interactive = sys.stdin.isatty()
    with Model(args.model, progress=args.progress and interactive, **_model_kwargs(args)) as m:
        history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:
                print()
                break
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                history = history[:1] if args.system else []
                continue
            if cmd.startswith("/system "):
                history = [{"role": "system", "content": cmd[8:]}] + [h for h in history if h["role"] != "system"]
                continue
            if not cmd:
                continue
            history.append({"role": "user", "content": line})
            stream = m.chat(history, **_generation_kwargs(args))
            assert isinstance(stream, Stream)
            try:
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                print("\n[interrupted]", file=sys.stderr)
                history.pop()
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            assert stream.result is not None
            history.append(stream.result.message)
    return 0


def _info(args) -> int:
    from . import build_info

    info = build_info()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"llamabind {info['version']}")
    print(f"llama.cpp {info['upstream_release']} ({info['upstream_commit']})")
    print("patches:  " + (", ".join(info["patches"]) or "none"))
    print("backends: " + ", ".join(info["backends"]))
    for d in info["devices"]:
        mem = f", {d['memory_total'] / 2**30:.1f} GiB" if d["memory_total"] else ""
        print(f"  device {d['name']}: {d['description']} ({d['type']}{mem})")
    print("flags:    " + " ".join(f"{k}={v}" for k, v in info["compile_flags"].items()))
    print("system:   " + info["system_info"].strip())
    print(f"tools:    {'built (llamabind/bin)' if info['tools'] else 'not built'}")
    return 0


def _eval(args) -> int:
    from pathlib import Path

    from . import Model, models, train

    for flag, f in (
        ("--data", args.data),
        ("--adapter", args.adapter),
        ("--chat-template-file", args.chat_template_file),
    ):
        if f is not None and not Path(f).is_file():
            raise FileNotFoundError(f"{flag}: no such file: {f}")
    template = Path(args.chat_template_file).read_text(encoding="utf-8") if args.chat_template_file else None
    kw = dict(n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
    with Model(models.resolve(args.model), **kw) as m:
        data = train.read_data(args.data, m, chat_template=template, train_on_prompt=args.train_on_prompt)
        adapter = m.load_lora(args.adapter) if args.adapter else None
        r = train.evaluate(m, data, ctx_size=args.ctx_size, adapter=adapter, n_threads=args.threads)
    print(f"loss {r.loss:.4f}, perplexity {r.perplexity:.3f} over {r.tokens} tokens in {r.windows} windows")
    return 0


def _fuse(args) -> int:
    from . import train

    out = train.fuse(args.model, args.adapter, args.output, scale=args.scale, quantize_to=args.quantize,
                     n_threads=args.threads)  # fmt: skip
    print(f"wrote {out}" + (f" ({args.quantize})" if args.quantize else ""))
    return 0


def _finetune(args) -> int:
    import os
    import tempfile
    from pathlib import Path

    from . import Model, models, train

    for flag, f in (("--data", args.data), ("--valid", args.valid), ("--chat-template-file", args.chat_template_file)):
        if f is not None and not Path(f).is_file():
            raise FileNotFoundError(f"{flag}: no such file: {f}")
    template = Path(args.chat_template_file).read_text(encoding="utf-8") if args.chat_template_file else None
    out = Path(args.output)
    try:  # fail now, not after the training, if the output cannot be written
        existed = out.exists()
        with open(out, "ab"):
            pass
        if not existed:
            out.unlink()
    except OSError as err:
        raise ValueError(f"-o: cannot write {out}: {err.strerror}") from None
    src = models.resolve(args.model)
    lora = args.lora_rank is not None
    with tempfile.TemporaryDirectory(dir=out.resolve().parent) as tmp:
        with Model(src, vocab_only=True) as probe:
            f32 = all(t == "f32" for _, t, _ in probe.tensor_info())
        if not f32 and not lora:
            print(f"converting {src.name} to F32 weights for full fine-tuning (llama_model_quantize)", file=sys.stderr)
            train.to_f32(src, os.path.join(tmp, "f32.gguf"), n_threads=args.threads)
            src = Path(tmp) / "f32.gguf"
        kw = dict(use_mmap=lora, repack=False, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
        with Model(src, **kw) as m:
            # JSONL examples or text, read and checked in full before the training starts
            read = dict(chat_template=template, train_on_prompt=args.train_on_prompt)
            data = train.read_data(args.data, m, **read)
            valid = train.read_data(args.valid, m, **read) if args.valid else None
            if not isinstance(data, str):
                print(f"{len(data)} examples from {args.data}", file=sys.stderr)
            res = train.finetune(
                m,
                data,
                valid=valid,
                ctx_size=args.ctx_size,
                epochs=args.epochs,
                iters=args.iters,
                lr=args.lr,
                optimizer=args.optimizer,
                weight_decay=args.weight_decay,
                val_split=args.val_split,
                batch_size=args.batch,
                seed=args.seed,
                n_threads=args.threads,
                progress=not args.no_progress,
                lora_rank=args.lora_rank,
                lora_alpha=args.lora_alpha,
                lora_targets=args.lora_targets.split(","),
                lr_schedule=args.lr_schedule,
                warmup=args.warmup,
                min_lr=args.min_lr,
                steps_per_eval=args.steps_per_eval,
                steps_per_report=args.steps_per_report,
                log=args.log,
            )
            print(f"validation loss before: {res.val_loss_before:.4f}")
            print(f"{res.steps} optimizer steps of {args.batch} window(s) of {args.ctx_size} tokens")
            for e in res.epochs:
                print(
                    f"epoch {e.epoch}: train loss {e.train_loss:.4f}, validation loss {e.val_loss:.4f}, "
                    f"{e.tokens_per_s:.1f} tokens/s, {e.seconds:.1f} s"
                )
            if res.interrupted:
                print(f"interrupted after {res.steps} steps; saving what was trained", file=sys.stderr)
            if res.adapter is not None:
                res.adapter.save(out)
            else:
                m.save(out)
    print(f"wrote {out}" + (" (a LoRA adapter: load it with --lora / Model.load_lora)" if lora else ""))
    return 0


def _serve(args) -> int:
    import signal

    from . import server

    template = None
    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    srv = server.serve(
        args.model_pos or args.model,
        host=args.host,
        port=args.port,
        parallel=args.parallel,
        ctx_size=args.ctx_size,
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
        lora=[(p, 1.0) for p in args.lora or []],
        max_body=args.max_body,
        max_pending=args.max_pending,
        access_log=args.verbose,
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


def main(argv=None) -> int:
    from . import models

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rpc-server"]:  # its own parser (rpc.main): it never returns to Python while serving
        from . import rpc

        return rpc.main(argv[1:])

    ap = argparse.ArgumentParser(prog="python -m llamabind", description="llamabind: llama.cpp from Python")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def model_and_sampling(p, max_tokens: int):
        p.add_argument(
            "--model", "-m", default=models.DEFAULT, help=f"model name or GGUF path (default {models.DEFAULT})"
        )
        p.add_argument("--max-tokens", "-n", type=int, default=max_tokens)
        p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy")
        p.add_argument("--top-k", type=int, default=40)
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--seed", "-s", type=int, default=None)
        p.add_argument("--n-ctx", type=int, default=4096)
        p.add_argument("--threads", type=int, default=None)
        p.add_argument(
            "--rpc",
            action="append",
            default=None,
            metavar="HOST:PORT",
            help="also use the devices of this RPC server (repeatable; see rpc-server)",
        )
        p.add_argument("--n-gpu-layers", "-ngl", type=int, default=-1, help="layers to offload (-1: all)")
        p.add_argument(
            "--split-mode",
            "-sm",
            choices=["none", "layer", "row", "tensor"],
            default=None,
            help="how several devices share the model (default: layer)",
        )
        p.add_argument(
            "--tensor-split",
            "-ts",
            type=_proportions,
            default=None,
            metavar="P0,P1,...",
            help="share of the model per device, in the order `info` lists GPUs then RPC devices",
        )
        p.add_argument(
            "--no-repack",
            "-nr",
            dest="repack",
            action="store_false",
            help="keep the GGUF's weight layout on the CPU (no AMX/interleaved repacking), as llama-cli's -nr",
        )

    g = sub.add_parser("generate", help="stream a continuation of PROMPT")
    g.add_argument("prompt", nargs="?", help="the prompt (default: a short example prompt)")
    model_and_sampling(g, 128)
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.set_defaults(fn=_generate)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template (history kept)")
    model_and_sampling(c, 512)
    c.add_argument("--system", default=None, help="system message (default: the template's)")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no loading progress bar")
    c.set_defaults(fn=_chat)
    f = sub.add_parser(
        "finetune", help="fine-tune a GGUF model (full, or LoRA) on JSONL examples or text (llama_opt_*)"
    )
    f.add_argument(
        "--model", "-m", default=models.DEFAULT, help="model name or GGUF path (full: converted to F32 if needed)"
    )
    f.add_argument(
        "--data",
        required=True,
        help="JSONL ({text} / {prompt, completion} / {messages[, tools]} per line) or a UTF-8 text file",
    )
    f.add_argument("--valid", default=None, help="held-out file of the same kinds (instead of --val-split)")
    f.add_argument("--train-on-prompt", action="store_true", help="count the loss on every token, not only the answers")
    f.add_argument("--chat-template-file", default=None, help="jinja chat template instead of the GGUF's")
    f.add_argument("--output", "-o", required=True, help="the tuned model's GGUF path (the adapter's, with LoRA)")
    f.add_argument("--lora-rank", type=int, default=None, help="train a LoRA adapter of this rank instead")
    f.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    f.add_argument(
        "--lora-targets", default="attn_q,attn_v", help="comma-separated matrices (attn_q,attn_k,attn_v,...)"
    )
    f.add_argument("--epochs", type=int, default=1)
    f.add_argument("--iters", type=int, default=None, help="optimizer steps in all (instead of --epochs)")
    f.add_argument("--lr", type=float, default=1e-5, help="learning rate (default 1e-5)")
    f.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"], default="constant")
    f.add_argument("--warmup", type=int, default=0, help="steps of linear warmup (default 0)")
    f.add_argument("--min-lr", type=float, default=0.0, help="where cosine/linear decay heads (default 0)")
    f.add_argument("--steps-per-eval", type=int, default=None, help="validate every N steps too")
    f.add_argument("--steps-per-report", type=int, default=None, help="print loss, lr, tokens/s, ETA every N steps")
    f.add_argument("--log", default=None, help="JSONL file: one line per step and per validation")
    f.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    f.add_argument("--weight-decay", type=float, default=0.0)
    f.add_argument("--ctx-size", "-c", type=int, default=256, help="tokens per window, a multiple of 256")
    f.add_argument("--val-split", type=float, default=0.1, help="fraction of windows held out (default 0.1)")
    f.add_argument("--batch", "-b", type=int, default=1, help="windows per optimizer step (gradient accumulation)")
    f.add_argument("--seed", "-s", type=int, default=0, help="shuffling seed")
    f.add_argument("--threads", type=int, default=None)
    f.add_argument("--n-gpu-layers", "-ngl", type=int, default=-1, help="layers to offload (-1: all)")
    f.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    f.set_defaults(fn=_finetune)
    ev = sub.add_parser("eval", help="loss and perplexity on JSONL examples or text (the finetune masking rules)")
    ev.add_argument("--model", "-m", default=models.DEFAULT, help="model name or GGUF path")
    ev.add_argument("--adapter", default=None, help="a LoRA adapter GGUF to apply (scale 1)")
    ev.add_argument("--data", required=True, help="JSONL (as finetune --data) or a UTF-8 text file")
    ev.add_argument("--ctx-size", "-c", type=int, default=256, help="tokens per window")
    ev.add_argument("--train-on-prompt", action="store_true", help="count every token, not only the answers")
    ev.add_argument("--chat-template-file", default=None, help="jinja chat template instead of the GGUF's")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--n-gpu-layers", "-ngl", type=int, default=-1, help="layers to offload (-1: all)")
    ev.set_defaults(fn=_eval)
    fu = sub.add_parser("fuse", help="merge a LoRA adapter into its base model: one GGUF")
    fu.add_argument("--model", "-m", default=models.DEFAULT, help="the base model (name or GGUF path)")
    fu.add_argument("--adapter", required=True, help="the LoRA adapter GGUF (from finetune --lora-rank)")
    fu.add_argument("--output", "-o", required=True, help="the fused GGUF")
    fu.add_argument("--scale", type=float, default=1.0, help="the adapter's scale (default 1)")
    fu.add_argument("--quantize", default=None, help="requantize the result: F16, Q8_0, Q4_0, Q4_1, ...")
    fu.add_argument("--threads", type=int, default=None)
    fu.set_defaults(fn=_fuse)
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching (llama.cpp's server core)"
    )
    s.add_argument("model_pos", nargs="?", metavar="MODEL", help=f"model name or GGUF path (default {models.DEFAULT})")
    s.add_argument("--model", "-m", default=models.DEFAULT, help=argparse.SUPPRESS)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed)")
    s.add_argument("--parallel", "-np", type=int, default=4, help="slots decoded together (default 4)")
    s.add_argument("--ctx-size", "-c", type=int, default=None, help="KV cache tokens shared by the slots")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or X-Api-Key)")
    s.add_argument("--embedding", action="store_true", help="serve /v1/embeddings (an embedding model)")
    s.add_argument("--pooling", choices=["mean", "cls", "last", "rank"], default=None, help="embedding pooling")
    s.add_argument("--n-gpu-layers", "-ngl", type=int, default=None, help="layers to offload (default: all that fit)")
    s.add_argument("--threads", "-t", type=int, default=None)
    s.add_argument("--batch-size", "-b", type=int, default=None, help="logical batch size (n_batch)")
    s.add_argument("--ubatch-size", "-ub", type=int, default=None, help="physical batch size (n_ubatch)")
    s.add_argument(
        "--rpc", action="append", default=None, metavar="HOST:PORT", help="also use this RPC server's devices"
    )
    s.add_argument("--alias", default=None, help="the model id clients send (default: the model's name)")
    s.add_argument("--chat-template-file", default=None, help="a jinja chat template replacing the model's")
    s.add_argument("--flash-attn", "-fa", choices=["on", "off", "auto"], default=None)
    s.add_argument("--lora", action="append", default=None, metavar="GGUF", help="apply this LoRA adapter")
    s.add_argument("--max-body", type=int, default=16 * 2**20, help="request body limit in bytes (413 beyond)")
    s.add_argument("--max-pending", type=int, default=256, help="requests in flight before 503 (default 256)")
    s.add_argument("--verbose", "-v", action="store_true", help="log each request (uvicorn's access log)")
    s.set_defaults(fn=_serve)
    sub.add_parser("rpc-server", help="serve this host's devices over ggml RPC (see rpc-server --help)")
    i = sub.add_parser("info", help="print build_info()")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, OSError) as e:  # FileNotFoundError, ConnectionError too
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
