"""Hugging Face checkpoints (safetensors or PyTorch, with their tokenizer) to GGUF, through upstream's
``convert_hf_to_gguf.py`` from the pinned tree (shipped in the wheel with the gguf-py it was written
against). The converter needs torch, transformers and sentencepiece: ``pip install llamabind[convert]``,
or name another interpreter that has them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ._validate import one_of

__all__ = ["convert_hf", "OUTTYPES", "converter_path"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0", "auto")


def converter_path() -> Path:
    """The shipped ``convert_hf_to_gguf.py`` (FileNotFoundError in a build without it)."""
    p = Path(__file__).resolve().parent / "_converter" / "convert_hf_to_gguf.py"
    if not p.exists():
        raise FileNotFoundError(f"this build of llamabind ships no converter ({p} is missing)")
    return p


def convert_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    outtype: str = "f16",
    python: str | os.PathLike | None = None,
    extra_args: list[str] | None = None,
) -> Path:
    """Convert the Hugging Face model directory ``hf_dir`` (config.json, weights, tokenizer files) to
    the GGUF ``out`` with upstream's converter: ``outtype`` one of f32, f16, bf16, q8_0, tq1_0, tq2_0,
    auto (its ``--outtype``). ``python``: the interpreter to run it with (default: this one; it needs
    torch, transformers, sentencepiece: the ``convert`` extra). Returns ``out``.

    Raises FileNotFoundError (no such directory, no config.json), ValueError (bad outtype), and
    RuntimeError carrying the converter's own error (an unsupported architecture, a missing
    dependency, an unrecognized tokenizer) when it fails.
    """
    one_of(outtype, "outtype", OUTTYPES)
    src = Path(os.fspath(hf_dir))
    if not src.is_dir():
        raise FileNotFoundError(f"no such model directory: '{src}'")
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"'{src}' has no config.json: not a Hugging Face model directory")
    dst = Path(os.fspath(out))
    cmd = [os.fspath(python or sys.executable), str(converter_path()), str(src), "--outfile", str(dst)]
    cmd += ["--outtype", outtype, *(extra_args or [])]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the shipped gguf-py, not PyPI's
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0 or not dst.exists():
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        hint = (
            " (install the converter's dependencies: pip install 'llamabind[convert]')" if "No module" in tail else ""
        )
        raise RuntimeError(f"convert_hf_to_gguf.py failed{hint}:\n{tail}")
    return dst
