"""``convert``: a Hugging Face checkpoint to GGUF (llamabind.convert, upstream's converter)."""

from __future__ import annotations

import sys

from ..convert import OUTTYPES
from .common import HelpFormatter


def _convert(args) -> int:
    from ..convert import convert_hf

    try:
        out = convert_hf(args.hf_dir, args.output, outtype=args.outtype, python=args.python)
    except RuntimeError as e:  # the converter's own failure, its last lines included
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"llamabind: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    """The convert subcommand."""
    c = sub.add_parser(
        "convert",
        help="a Hugging Face model directory (safetensors) to GGUF (convert_hf_to_gguf.py)",
        formatter_class=HelpFormatter,
    )
    c.add_argument("hf_dir", metavar="HF_DIR", help="config.json, the weights and the tokenizer files")
    c.add_argument("--outfile", "-o", dest="output", required=True, metavar="OUT.gguf", help="the GGUF to write")
    c.add_argument("--outtype", choices=OUTTYPES, default="f16", help="weight type")
    c.add_argument(
        "--python", default=None, metavar="PY", help="run the converter with this interpreter (it needs torch etc.)"
    )
    c.set_defaults(fn=_convert)
