"""Imported by the PyTorch reference scripts (train_reference.py, lora_reference.py) before they load
GGUFs through transformers: one parse per file and one model load per base GGUF in the process.
transformers parses a GGUF twice per from_pretrained (config, then weights), and gguf's reader spends
most of a load on the tokenizer's 49,152 tokens and merges; this replaces gguf.GGUFReader with a
cache of readers (per path, size and mtime), and ``load_model`` keeps each base model it loads and
hands out copies (tests/reference_worker.py runs many jobs over one base in one process)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import gguf

_parsed: dict[tuple, gguf.GGUFReader] = {}
_models: dict[tuple, object] = {}
_GGUFReader = gguf.GGUFReader


def _key(path) -> tuple:
    p = Path(path).resolve()
    st = os.stat(p)
    return str(p), st.st_size, st.st_mtime_ns


def _reader_once(path, *args, **kwargs):
    key = _key(path)
    if key not in _parsed:
        _parsed[key] = _GGUFReader(path, *args, **kwargs)
    return _parsed[key]


def forget_readers() -> None:
    """Drop the cached readers (their memory maps); the loaded models stay."""
    _parsed.clear()


def load_model(path, keep: bool = False):
    """transformers' LlamaForCausalLM (float32, train mode) from the GGUF at ``path``; ``keep``: load
    the file once in this process and return a deep copy of it each time (for a base model that
    several jobs start from; the copies are trained, the kept one never is)."""
    import torch
    from transformers import AutoModelForCausalLM

    def load():
        p = Path(path)
        return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).train()

    if not keep:
        return load()
    key = _key(path)
    if key not in _models:
        _models[key] = load()
    return copy.deepcopy(_models[key])


gguf.GGUFReader = _reader_once
