"""Imported by the PyTorch reference scripts (train_reference.py, lora_reference.py) before they load
GGUFs through transformers: one parse per file in the process. transformers parses a GGUF twice per
from_pretrained (config, then weights), and gguf's reader spends most of a load on the tokenizer's
49,152 tokens and merges; this replaces gguf.GGUFReader with a per-path cache of readers."""

from __future__ import annotations

from pathlib import Path

import gguf

_parsed: dict[str, gguf.GGUFReader] = {}
_GGUFReader = gguf.GGUFReader


def _reader_once(path, *args, **kwargs):
    key = str(Path(path).resolve())
    if key not in _parsed:
        _parsed[key] = _GGUFReader(path, *args, **kwargs)
    return _parsed[key]


gguf.GGUFReader = _reader_once
