"""Command line: ``python -m llamabind generate|chat|finetune|eval|fuse|serve|convert|rpc-server|info``,
one module per area (run: generate, chat, info; tune: finetune, eval, fuse; serve; convert)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import common, convert, run, serve, tune

__all__ = ["main"]


def main(argv=None) -> int:
    """Parse ``argv`` (default sys.argv[1:]) and run the command; 2 with ``error: ...`` on stderr
    for bad input (ValueError, TypeError, OSError)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rpc-server"]:  # its own parser (rpc.main): it never returns to Python while serving
        from .. import rpc

        return rpc.main(argv[1:])

    ap = parser()
    if not argv:  # a bare `python -m llamabind`: what there is to run
        ap.print_help()
        return 0
    args, extra = ap.parse_known_args(argv)
    if extra:  # the subcommand's usage (argparse's top-level one names no flag of it), and a hint where one helps
        ap.commands.choices[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}{_hint(args.cmd, extra)}")
    try:
        common.resolve_hf(args)
        return args.fn(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # FileNotFoundError, ConnectionError too
        print(f"error: {e}", file=sys.stderr)
        return 2


# llama-server's default-sampling flags: serve takes sampling per request (OpenAI's fields), as llamabind's server
# has no server-wide sampling defaults
_SAMPLING_FLAGS = {"--temp", "--top-k", "--top-p", "--min-p", "--seed", "-s", "-n", "--n-predict", "--predict"}


def _hint(cmd: str, extra: list[str]) -> str:
    """A sentence after argparse's error for the flags users bring from llama.cpp."""
    flags = sorted({e.split("=", 1)[0] for e in extra if e.split("=", 1)[0] in _SAMPLING_FLAGS})
    if cmd == "serve" and flags:
        return (
            f" ({', '.join(flags)}: serve samples per request: send temperature, top_p, seed, max_tokens ... in "
            "each request's body; llama-server's server-wide defaults are not taken)"
        )
    return ""


def version() -> str:
    """``--version``: the package, the pinned llama.cpp and the patch series."""
    from ..build import build_info

    info = build_info()
    return (
        f"llamabind {info['version']} (llama.cpp {info['upstream_release']}, commit {info['upstream_commit'][:12]}, "
        f"{len(info['patches'])} patches)"
    )


class _Version(argparse.Action):
    """--version, computed when asked for (it imports the extension)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse's parser without prefix abbreviations (``serve --batch 4`` became ``--batch-size 4`` silently):
    a flag is spelled whole, or it is an error naming it; the subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: Any = None  # the subcommands (add_subparsers' action), for their own usage in errors

    def add_subparsers(self, **kwargs) -> Any:
        self.commands = super().add_subparsers(**kwargs)
        return self.commands


def parser() -> _Parser:
    """The command line's parser, every subcommand's but rpc-server's (:func:`llamabind.rpc.parser`)."""
    ap = _Parser(prog="python -m llamabind", description="llamabind: llama.cpp from Python")
    ap.add_argument("--version", action=_Version, help="the package, the pinned llama.cpp and its patches")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    run.add_parsers(sub)
    tune.add_parsers(sub)
    serve.add_parsers(sub)
    convert.add_parsers(sub)
    sub.add_parser("rpc-server", help="serve this host's devices over ggml RPC (see rpc-server --help)")
    return ap
