"""The commands that run a model: ``generate``, ``chat``, and ``info`` (the build)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import models
from ..generation import Stream
from ..projector import MEDIA_MARKER
from .common import (
    CommaList,
    HelpFormatter,
    add_ctx_size,
    add_flash_attn,
    add_hf,
    add_image_tokens,
    add_lora,
    add_model,
    add_ngl,
    add_threads,
    lora_specs,
)  # fmt: skip

DEFAULT_PROMPT = "The three most useful things to know about the Python programming language are"


def _model_kwargs(args) -> dict:
    """The Model(...) arguments the generate and chat commands share."""
    kw = dict(
        n_ctx=args.n_ctx, n_threads=args.threads, rpc=args.rpc, n_gpu_layers=args.n_gpu_layers, repack=args.repack,
        lora=lora_specs(args), flash_attn=args.flash_attn, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
    )  # fmt: skip
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


# llama.cpp's -n -1 (generate until the end of the text) and -2 (until the context is full): without context shift
# (these commands have none) both end at EOS or where the context is full
_UNTIL_THE_END = 1 << 30


def _generation_kwargs(args) -> dict:
    """The streamed generate()/chat() arguments the generate and chat commands share."""
    n = args.max_tokens
    if n < -2:
        raise ValueError(f"-n/--n-predict must be >= 0, -1 (until the end) or -2 (fill the context); got {n}")
    return dict(
        max_tokens=_UNTIL_THE_END if n in (-1, -2) else n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stream=True,
    )


def _proportions(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 3,1; got {text!r}") from None


def busy_cores(seconds: float = 0.2) -> float | None:
    """How many cores other work keeps busy now: the non-idle share of /proc/stat's CPU time over
    ``seconds``, in cores (None where there is no /proc/stat)."""
    import time

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # all, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError):
        return None
    return (1.0 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1)


def _busy_note(n_threads: int | None) -> str:
    """A note for the speed line when other work keeps a core busy and the threads ask for all of them:
    ggml's threads meet at every op, so one thread that waits for a busy core slows them all (measured on
    2 cores with one busy: 32 tokens/s with 2 threads, 69 with 1; llama-bench the same: 30 and 75)."""
    from ..build import default_threads

    cores = default_threads()
    n = n_threads or cores
    busy = busy_cores()
    if busy is None or busy < 0.5 or n <= cores - busy:
        return ""
    fewer = max(1, int(cores - busy + 0.5))
    if fewer >= n:  # the run already uses that few (-t 1 said to a run of -t 1 helped no one)
        return ""
    return f" | note: other work keeps {busy:.1f} of {cores} cores busy: -t {fewer} may be faster"


def _prompt_of(args) -> str | None:
    """The prompt: the positional one, ``--prompt`` or ``-f/--file``'s text (llama-cli's), one of them at most;
    ValueError for two, OSError for a file that cannot be read."""
    given = [x for x in (args.prompt, args.prompt_opt) if x is not None]
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            given.append(f.read())
    if len(given) > 1:
        raise ValueError("give the prompt once: as the argument, --prompt or -f/--file")
    return given[0] if given else None


def _generate(args) -> int:
    from ..api import Model

    given = _prompt_of(args)
    prompt = given if given is not None else DEFAULT_PROMPT
    media = [*(args.image or []), *(args.audio or [])]
    note = _busy_note(args.threads)  # before our own threads run
    with Model(args.model, **_model_kwargs(args)) as m:
        if media and MEDIA_MARKER not in prompt:  # as llama-mtmd-cli: the media before the prompt
            prompt = MEDIA_MARKER * len(media) + prompt
        stream = m.generate(prompt, media=media or None, **_generation_kwargs(args))
        assert isinstance(stream, Stream)
        out = sys.stdout
        if given is None or args.echo:
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
        print(f"[{name} | {m.description} | {r.timings.summary()} | finish: {r.finish_reason}{note}]", file=sys.stderr)
    return 0


CHAT_HELP = """commands:
  /help            this list
  /exit, /quit     leave (Ctrl-D too, or Ctrl-C twice at the prompt; Ctrl-C stops a reply)
  /reset           forget the conversation (the system prompt stays)
  /system TEXT     set the system prompt (/system alone shows it)
  /image FILE      attach an image to your next message (with --mmproj)
  /audio FILE      attach an audio clip to your next message (with --mmproj)
anything else is sent to the model; arrow keys edit the line and browse the history"""


HISTORY_LINES = 1000  # kept in the chat's history file


def history_path() -> str:
    """The chat's history file: ``chat_history`` in the llamabind cache ($LLAMABIND_CACHE)."""
    return str(models.cache_dir() / "chat_history")


_history_start = 0  # readline's history length after the file was read: this session's lines follow


def _line_editing() -> str | None:
    """readline's line editing and a history file for an interactive chat (llama-cli's users expect
    both: without readline, input() echoes the arrow keys' escape codes). Returns the history file."""
    global _history_start
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline
        return None
    path = history_path()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    _history_start = readline.get_current_history_length()
    return path


def _save_history(path: str | None) -> None:
    """Append this session's lines to the history file (two chats at once each add theirs: rewriting the
    whole file, the last to leave dropped the other's), then keep its last HISTORY_LINES lines."""
    if path is None:
        return
    import readline

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            open(path, "a").close()
        readline.append_history_file(readline.get_current_history_length() - _history_start, path)
        readline.clear_history()
        readline.read_history_file(path)  # everyone's lines, then the file cut to the newest
        readline.set_history_length(HISTORY_LINES)
        readline.write_history_file(path)
    except OSError as err:
        print(f"[could not write the history file {path}: {err.strerror}]", file=sys.stderr)


def _history_command(cmd: str, history: list[dict]) -> list[dict]:
    """The chat's /reset, /system TEXT and bare /system (the system prompt now, and the usage): the new history."""
    system = [h for h in history if h["role"] == "system"]
    if cmd == "/reset":
        print("[conversation cleared" + (", the system prompt kept]" if system else "]"), file=sys.stderr)
        return system[:1]
    if cmd == "/system":
        now = f"the system prompt: {system[0]['content']!r}" if system else "no system prompt (the template's default)"
        print(f"[{now}; /system TEXT sets it]", file=sys.stderr)
        return history
    text = cmd[len("/system ") :]
    print(f"[system prompt set ({len(text)} characters)]", file=sys.stderr)
    return [{"role": "system", "content": text}] + [h for h in history if h["role"] != "system"]


def _chat(args) -> int:
    """An interactive chat: each line is a user turn; the history is kept (and its KV cache
    reused). Commands (/help lists them): /exit (or EOF) ends, /reset clears the history, /system
    TEXT sets it, /image FILE and /audio FILE attach media to the next turn (with --mmproj). In a
    terminal: a banner, readline editing with a history file, a speed line per reply on stderr."""
    from ..api import Model

    interactive = sys.stdin.isatty()
    note = _busy_note(args.threads)  # before our own threads run
    template = None
    if args.chat_template_file is not None:
        with open(args.chat_template_file, encoding="utf-8") as f:  # OSError: a clear error, before the model loads
            template = f.read()
    with Model(args.model, progress=args.progress and interactive, **_model_kwargs(args)) as m:
        name = args.model if args.model in models.KNOWN else os.path.basename(str(m.path))
        history_file = None
        if interactive:
            history_file = _line_editing()
            n_ctx = m.context_params["n_ctx"]
            loras = "".join(f" | LoRA {os.path.basename(str(a.path))} x{sc:g}" for a, sc in m.loras)
            print(f"[{name} | {m.description} | n_ctx {n_ctx}{loras} | /help for commands, /exit to leave]",
                  file=sys.stderr)  # fmt: skip
        history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        pending = _media_parts(args.image, args.audio)  # media for the next user turn
        interrupted = False  # the last key at the prompt was Ctrl-C
        try:
            while True:
                try:
                    line = input("> " if interactive else "")
                except EOFError:  # Ctrl-D: end the prompt's line, so the shell's next one starts clean
                    if interactive:
                        print(file=sys.stderr)
                    break
                except KeyboardInterrupt:  # as llama-cli: a second Ctrl-C in a row leaves
                    print()
                    if not interactive or interrupted:
                        break
                    interrupted = True
                    print("[Ctrl-C again, /exit or Ctrl-D to leave]", file=sys.stderr)
                    continue
                interrupted = False
                cmd = line.strip()
                if cmd in ("/exit", "/quit"):
                    break
                if cmd == "/help":
                    print(CHAT_HELP, file=sys.stderr)
                    continue
                if cmd == "/reset" or cmd == "/system" or cmd.startswith("/system "):
                    history = _history_command(cmd, history)
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
                    stream = m.chat(history, template=template, **_generation_kwargs(args))
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
                print(f"[{r.generation.timings.summary()} | finish: {r.finish_reason}{note}]", file=sys.stderr)
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
    """The model, offload and sampling options generate and chat share (llama.cpp's spellings)."""
    add_model(p)
    add_hf(p, mmproj=True)
    p.add_argument(
        "--n-predict", "-n", "--predict", "--max-tokens", dest="max_tokens", type=int, default=max_tokens,
        help="tokens to generate at most; -1: until the end of the text, -2: until the context is full (llama.cpp's)",
    )  # fmt: skip
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: the smallest set of this mass")
    p.add_argument("--min-p", type=float, default=0.05, help="drop tokens below this fraction of the likeliest's")
    p.add_argument("--seed", "-s", type=int, default=None, help="sampling seed (default: a random one)")
    add_ctx_size(p, 4096)
    add_threads(p)
    p.add_argument("--batch-size", "-b", type=int, default=2048, help="logical batch size (n_batch)")
    p.add_argument("--ubatch-size", "-ub", type=int, default=512, help="physical batch size (n_ubatch)")
    add_flash_attn(p, "auto")
    add_lora(p)
    p.add_argument(
        "--rpc",
        action=CommaList,
        default=None,
        metavar="HOST:PORT",
        help="also use the devices of this RPC server (repeatable; see rpc-server)",
    )
    add_ngl(p)
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
    g = sub.add_parser("generate", help="stream a continuation of PROMPT", formatter_class=HelpFormatter)
    g.add_argument("prompt", nargs="?", help="the prompt (default: a short example prompt)")
    # not -p: rpc-server's port (as llama.cpp's rpc-server), and a flag means one thing in every subcommand
    g.add_argument("--prompt", dest="prompt_opt", default=None, metavar="TEXT", help="the prompt (llama-cli's)")
    g.add_argument("--file", "-f", default=None, metavar="FILE", help="read the prompt from this file (llama-cli's -f)")
    _model_and_sampling(g, 128)
    g.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    g.set_defaults(fn=_generate)
    c = sub.add_parser(
        "chat", help="interactive chat with the model's chat template (history kept)",
        description="An interactive chat; /help lists its commands. In a terminal, readline edits the line and "
        f"keeps a history of your lines in {history_path()} (the last {HISTORY_LINES}; $LLAMABIND_CACHE moves it).",
        formatter_class=HelpFormatter,
    )  # fmt: skip
    _model_and_sampling(c, 512)
    c.add_argument(
        "--system-prompt", "-sys", "--system", dest="system", default=None,
        help="system message (default: the template's)",
    )  # fmt: skip
    c.add_argument("--chat-template-file", default=None, help="a jinja chat template instead of the GGUF's")
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no loading progress bar")
    c.set_defaults(fn=_chat)
    i = sub.add_parser("info", help="print build_info()", formatter_class=HelpFormatter)
    i.add_argument("--json", action="store_true", help="as JSON")
    i.set_defaults(fn=_info)
