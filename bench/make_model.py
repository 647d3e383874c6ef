#!/usr/bin/env python3
"""Write a llama-architecture GGUF of realistic size with random weights, for throughput work.

    python bench/make_model.py --size 1b --type q4_0 -o /tmp/llama-1b-q4_0.gguf

Sizes follow real llama shapes (135m: SmolLM2-135M's 576 x 30 layers, GQA 9/3, ffn 1536, tied
embeddings (no output.weight); 0.5b: 1536 x 16 layers; 1b: Llama-3.2-1B's 2048 x 16, GQA 32/8,
ffn 8192, untied; 8b: Llama-3.1-8B's 4096 x 32, GQA 32/8, ffn 14336; 70b: Llama-3.1-70B's 8192 x 80,
GQA 64/8, ffn 28672) with SmolLM2's 49152-token tokenizer, copied from the default model so prompts
tokenize (``--vocab 128256``: Llama 3's vocabulary size, the tokenizer padded with unused tokens).
Weights are N(0, 0.02) (norms 1), one random matrix drawn per shape and written for every layer (an 8B
file takes seconds plus the disk write, not minutes of random numbers), in F16, Q8_0 or Q4_0 (gguf's
own quantizers), or a K-quant (ggml's quantizers, llamabind.ops.quantize): q4_k, q5_k, q6_k, or the mixes
llama-quantize makes as q4_k_m / q5_k_m (attn_v and ffn_down Q6_K in the first and last eighth of the
layers and every third between, output.weight Q6_K, the rest Q4_K / Q5_K). The text is meaningless; the
speed is a real model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SIZES = {  # n_embd, n_layer, n_head, n_head_kv, n_ff
    "micro": (64, 1, 2, 1, 128),
    "tiny": (256, 2, 4, 2, 512),
    "135m": (576, 30, 9, 3, 1536),
    "0.5b": (1536, 16, 12, 4, 4096),
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
    "70b": (8192, 80, 64, 8, 28672),
}
# --type: (the file type, the base tensor type, the type of the "more bits" tensors of a K mix)
TYPES = {
    "f16": ("MOSTLY_F16", "f16", None),
    "q8_0": ("MOSTLY_Q8_0", "q8_0", None),
    "q4_0": ("MOSTLY_Q4_0", "q4_0", None),
    "q4_k": ("MOSTLY_Q4_K_S", "q4_K", None),
    "q5_k": ("MOSTLY_Q5_K_S", "q5_K", None),
    "q6_k": ("MOSTLY_Q6_K", "q6_K", None),
    "q4_k_m": ("MOSTLY_Q4_K_M", "q4_K", "q6_K"),
    "q5_k_m": ("MOSTLY_Q5_K_M", "q5_K", "q6_K"),
}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quantize's rule for a _M mix's attn_v and ffn_down: the first and last eighth, every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


TIED = {"135m"}  # the output matrix is token_embd (no output.weight), as in SmolLM2


def n_params(n_vocab: int, size: str) -> int:
    e, L, h, kv, ff = SIZES[size]
    d_kv = e // h * kv
    per_layer = e * e * 2 + e * d_kv * 2 + 3 * e * ff + 2 * e
    return (1 if size in TIED else 2) * n_vocab * e + e + L * per_layer


def main() -> int:
    import gguf
    from gguf.quants import quantize

    from llamabind import models

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--vocab", type=int, default=None, help="pad the tokenizer to this many tokens (e.g. 128256)")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer-from", default=None, help="a GGUF to copy tokenizer.* from (default: the default model)"
    )
    args = ap.parse_args()

    src = gguf.GGUFReader(args.tokenizer_from or models.resolve(models.DEFAULT))
    tok_fields = {k: f for k, f in src.fields.items() if k.startswith("tokenizer.")}
    n_vocab = len(tok_fields["tokenizer.ggml.tokens"].data)
    pad = max(0, (args.vocab or n_vocab) - n_vocab)
    n_vocab += pad
    e, L, h, kv, ff = SIZES[args.size]
    print(f"{args.size}: {n_params(n_vocab, args.size) / 1e9:.2f} B parameters, {args.type}", file=sys.stderr)

    w = gguf.GGUFWriter(args.output, "llama")
    w.add_name(f"random-llama-{args.size}")
    w.add_context_length(8192)
    w.add_embedding_length(e)
    w.add_block_count(L)
    w.add_feed_forward_length(ff)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(e // h)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    file_type, base, more = TYPES[args.type]
    w.add_file_type(getattr(gguf.LlamaFileType, file_type))
    for name, field in tok_fields.items():  # copy the tokenizer as stored (padded with unused tokens: --vocab)
        vtype = field.types[0]
        value = field.contents()
        if pad and name == "tokenizer.ggml.tokens":
            value = value + [f"<|unused_{i}|>" for i in range(pad)]
        elif pad and name == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * pad
        elif pad and name == "tokenizer.ggml.scores":
            value = value + [0.0] * pad
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)

    rng = np.random.default_rng(args.seed)
    drawn: dict[tuple[int, int, str], np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int, t: str = base):
        if (rows, cols, t) not in drawn:
            x = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            if t == "f16":
                drawn[rows, cols, t] = x.astype(np.float16)
            elif t in ("q8_0", "q4_0"):
                drawn[rows, cols, t] = quantize(x, gguf.GGMLQuantizationType[t.upper()])
            else:  # the K-quants: ggml's own quantizer
                from llamabind import ops

                drawn[rows, cols, t] = ops.quantize(x, t).reshape(rows, -1)
        if t == "f16":
            w.add_tensor(name, drawn[rows, cols, t])
        else:  # (rows, bytes): gguf derives the shape
            w.add_tensor(name, drawn[rows, cols, t], raw_dtype=gguf.GGMLQuantizationType[t.upper()])

    def norm(name: str):
        w.add_tensor(name, np.ones(e, np.float32))

    d_kv = e // h * kv
    matrix("token_embd.weight", n_vocab, e)
    for i in range(L):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", e, e)
        matrix(f"blk.{i}.attn_k.weight", d_kv, e)
        matrix(f"blk.{i}.attn_v.weight", d_kv, e, more if more and use_more_bits(i, L) else base)
        matrix(f"blk.{i}.attn_output.weight", e, e)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ff, e)
        matrix(f"blk.{i}.ffn_up.weight", ff, e)
        matrix(f"blk.{i}.ffn_down.weight", e, ff, more if more and use_more_bits(i, L) else base)
        print(f"layer {i + 1}/{L}", file=sys.stderr, end="\r")
    norm("output_norm.weight")
    if args.size not in TIED:
        matrix("output.weight", n_vocab, e, more or base)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"\nwrote {args.output} ({Path(args.output).stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
