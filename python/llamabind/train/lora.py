"""LoRA adapters to train (fresh A/B matrices in a GGUF) and F32 copies for full fine-tuning."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from .._validate import as_float, as_int, expect, one_of
from ..model import Model, quantize, write_lora_gguf

__all__ = ["LORA_TARGETS", "lora_init", "to_f32"]

LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""Names of the per-layer matrices a LoRA adapter can target (GGUF ``blk.N.NAME.weight``)."""


def to_f32(src: str | os.PathLike, dst: str | os.PathLike, *, n_threads: int | None = None) -> None:
    """Write ``src`` (any GGUF llama.cpp loads, or a model name) with F32 weights to ``dst``, for
    full fine-tuning (about 4 bytes per parameter), on ``n_threads`` threads (None: all cores). Wraps
    llama_model_quantize with ftype ALL_F32 (dequantizing). Raises FileNotFoundError, LlamaError if llama.cpp fails."""
    quantize(src, dst, "F32", n_threads=n_threads)


def lora_init(
    model: Model,
    path: str | os.PathLike,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ("attn_q", "attn_v"),
    seed: int = 0,
) -> None:
    """Write a fresh LoRA adapter GGUF for ``model`` to ``path``: for each matrix W (numpy shape
    (n_out, n_in)) of ``targets`` (e.g. "attn_q", "ffn_up") in every layer, A (rank, n_in) uniform in
    +-1/sqrt(n_in) (PEFT's default, drawn from ``seed``) and
    B (n_out, rank) zero, so the adapted model starts equal to the base. F32, alpha stored as
    ``adapter.lora.alpha`` (llama.cpp scales A/B by alpha / rank). Raises ValueError for an
    unknown target or rank <= 0."""
    rank = as_int(rank, "rank", 1)
    alpha = as_float(alpha, "alpha")
    targets = [targets] if isinstance(targets, str) else list(targets)
    for t in targets:
        one_of(t, "lora target", LORA_TARGETS)
    expect(len(targets) > 0, "lora targets: give at least one of " + ", ".join(LORA_TARGETS))
    rng = np.random.default_rng(seed)
    tensors = []
    for name, _, shape in model.tensor_info():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in targets and parts[3] == "weight" and len(shape) == 2:
            n_out, n_in = shape
            expect(rank <= min(n_out, n_in), f"rank {rank} exceeds the size of {name} {shape}")
            bound = 1 / math.sqrt(n_in)
            tensors.append((name + ".lora_a", rng.uniform(-bound, bound, (rank, n_in)).astype(np.float32)))
            tensors.append((name + ".lora_b", np.zeros((n_out, rank), np.float32)))
    expect(bool(tensors), f"the model has no matrices named {targets}")
    arch = str(model.metadata.get("general.architecture", ""))
    write_lora_gguf(path, arch, alpha, tensors)
