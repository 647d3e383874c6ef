"""The commands that run a model: ``generate``, ``chat``, and ``info`` (the build)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import models
from ..generation import Stream
from ..projector import MEDIA_MARKER
from .common import add_hf, add_image_tokens

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
    if args.mmproj is not None:
        kw.update(mmproj=args.mmproj, image_min_tokens=args.image_min_tokens, image_max_tokens=args.image_max_tokens)
    elif args.image or args.audio:
        raise SystemExit("llamabind: --image/--audio need a projector: --mmproj MMPROJ.gguf")
    return kw


def _media_parts(images, audio) -> list[dict]:
    """Content parts for media files given on the command line (read by the projector)."""
    return [{"type": "image", "image": f} for f in images or []] + [{"type": "audio", "audio": f} for f in audio or []]


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
    from ..api import Model

    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    media = [*(args.image or []), *(args.audio or [])]
    with Model(args.model, **_model_kwargs(args)) as m:
        if media and MEDIA_MARKER not in prompt:  # as llama-mtmd-cli: the media before the prompt
            prompt = MEDIA_MARKER * len(media) + prompt
        stream = m.generate(prompt, media=media or None, **_generation_kwargs(args))
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


CHAT_HELP = """commands:
  /help            this list
  /exit, /quit     leave (Ctrl-D too; Ctrl-C stops a reply)
  /reset           forget the conversation (the system prompt stays)
  /system TEXT     set the system prompt
  /image FILE      attach an image to your next message (with --mmproj)
  /audio FILE      attach an audio clip to your next message (with --mmproj)
anything else is sent to the model; arrow keys edit the line and browse the history"""


def _line_editing() -> str | None:
    """readline's line editing and a history file for an interactive chat (llama-cli's users expect
    both: without readline, input() echoes the arrow keys' escape codes). Returns the history file."""
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        return None
    path = str(models.cache_dir() / "chat_history")
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return path


def _save_history(path: str | None) -> None:
    if path is None:
        return
    import readline

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        readline.write_history_file(path)
    except OSError as err:
        print(f"[could not write the history file {path}: {err.strerror}]", file=sys.stderr)


def _chat(args) -> int:
    """An interactive chat: each line is a user turn; the history is kept (and its KV cache
    reused). Commands (/help lists them): /exit (or EOF) ends, /reset clears the history, /system
    TEXT sets it, /image FILE and /audio FILE attach media to the next turn (with --mmproj). In a
    terminal: a banner, readline editing with a history file, a speed line per reply on stderr."""
    from ..api import Model

    interactive = sys.stdin.isatty()
    with Model(args.model, progress=args.progress and interactive, **_model_kwargs(args)) as m:
        name = args.model if args.model in models.KNOWN else os.path.basename(str(m.path))
        history_file = None
        if interactive:
            history_file = _line_editing()
            n_ctx = m.context_params["n_ctx"]
            print(f"[{name} | {m.description} | n_ctx {n_ctx} | /help for commands, /exit to leave]", file=sys.stderr)
        history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        pending = _media_parts(args.image, args.audio)  # media for the next user turn
        try:
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
                if cmd == "/help":
                    print(CHAT_HELP, file=sys.stderr)
                    continue
                if cmd == "/reset":
                    history = history[:1] if args.system else []
                    continue
                if cmd.startswith("/system "):
                    history = [{"role": "system", "content": cmd[8:]}] + [h for h in history if h["role"] != "system"]
                    continue
                if cmd.startswith(("/image ", "/audio ")):
                    kind, path = cmd[1:6], cmd[7:].strip()
                    if m.projector is None:
                        print("[/image and /audio need --mmproj]", file=sys.stderr)
                    elif not os.path.isfile(path):
                        print(f"[no such file: {path}]", file=sys.stderr)
                    else:
                        pending.append({"type": kind, kind: path})
                        print(f"[{kind} {path} goes with your next message]", file=sys.stderr)
                    continue
                if cmd.startswith("/") and cmd[1:2].isalpha():  # a command, not a message: never sent
                    print(f"[unknown command {cmd.split()[0]}: /help lists them]", file=sys.stderr)
                    continue
                if not cmd:
                    continue
                content = [*pending, {"type": "text", "text": line}] if pending else line
                history.append({"role": "user", "content": content})
                pending = []
                try:
                    stream = m.chat(history, **_generation_kwargs(args))
                    assert isinstance(stream, Stream)
                    for piece in stream:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                except KeyboardInterrupt:
                    print("\n[interrupted]", file=sys.stderr)
                    history.pop()
                    continue
                except ValueError as e:  # media the projector cannot read, a prompt too long for n_ctx
                    print(f"[{e}]", file=sys.stderr)
                    history.pop()
                    continue
                sys.stdout.write("\n")
                sys.stdout.flush()
                r = stream.result
                assert r is not None
                print(f"[{r.generation.timings.summary()} | finish: {r.finish_reason}]", file=sys.stderr)
                history.append(r.message)
        finally:
            _save_history(history_file)
    return 0


def _info(args) -> int:
    from ..build import build_info

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
    print("multimodal: libmtmd (images and audio through a projector: --mmproj)")
    return 0


def _model_and_sampling(p, max_tokens: int) -> None:
    """The model, offload and sampling options generate and chat share."""
    p.add_argument("--model", "-m", default=models.DEFAULT, help=f"model name or GGUF path (default {models.DEFAULT})")
    add_hf(p, mmproj=True)
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
    p.add_argument("--mmproj", "-mm", default=None, metavar="GGUF", help="a multimodal projector for this model")
    p.add_argument("--image", action="append", default=None, metavar="FILE", help="an image (repeatable; --mmproj)")
    p.add_argument("--audio", action="append", default=None, metavar="FILE", help="a WAV/MP3/FLAC clip (--mmproj)")
    add_image_tokens(p)


def add_parsers(sub) -> None:
    """The generate, chat and info subcommands."""
    g = sub.add_parser("generate", help="stream a continuation of PROMPT")
    g.add_argument("prompt", nargs="?", help="the prompt (default: a short example prompt)")
    _model_and_sampling(g, 128)
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.set_defaults(fn=_generate)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template (history kept)")
    _model_and_sampling(c, 512)
    c.add_argument("--system", default=None, help="system message (default: the template's)")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no loading progress bar")
    c.set_defaults(fn=_chat)
    i = sub.add_parser("info", help="print build_info()")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
