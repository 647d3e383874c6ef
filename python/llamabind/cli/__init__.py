"""Command line: ``python -m llamabind generate|chat|finetune|eval|fuse|serve|convert|rpc-server|info``,
one module per area (run: generate, chat, info; tune: finetune, eval, fuse; serve; convert)."""

from __future__ import annotations

import argparse
import sys

from . import common, convert, run, serve, tune

__all__ = ["main"]


def main(argv=None) -> int:
    """Parse ``argv`` (default sys.argv[1:]) and run the command; 2 with ``error: ...`` on stderr
    for bad input (ValueError, TypeError, OSError)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rpc-server"]:  # its own parser (rpc.main): it never returns to Python while serving
        from .. import rpc

        return rpc.main(argv[1:])

    ap = argparse.ArgumentParser(prog="python -m llamabind", description="llamabind: llama.cpp from Python")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run.add_parsers(sub)
    tune.add_parsers(sub)
    serve.add_parsers(sub)
    convert.add_parsers(sub)
    sub.add_parser("rpc-server", help="serve this host's devices over ggml RPC (see rpc-server --help)")
    args = ap.parse_args(argv)
    try:
        common.resolve_hf(args)
        return args.fn(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # FileNotFoundError, ConnectionError too
        print(f"error: {e}", file=sys.stderr)
        return 2
