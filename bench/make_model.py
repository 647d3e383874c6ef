#!/usr/bin/env python3
"""Write a llama-architecture GGUF of realistic size with random weights, for throughput work.

    python bench/make_model.py --size 1b --type q4_0 -o /tmp/llama-1b-q4_0.gguf

Sizes follow real llama shapes (135m: SmolLM2-135M's 576 x 30 layers, GQA 9/3, ffn 1536, tied
embeddings (no output.weight); 0.5b: 1536 x 16 layers; 1b: Llama-3.2-1B's 2048 x 16, GQA 32/8,
ffn 8192, untied; 8b: Llama-3-8B's 4096 x 32, GQA 32/8, ffn 14336) with SmolLM2's 49152-token tokenizer,
copied from the default model so prompts tokenize. Weights are N(0, 0.02) (norms 1), written by
the gguf package in F16, Q8_0 or Q4_0 (gguf's own quantizers); one random matrix is drawn per
shape and written for every layer (an 8B F16 file takes seconds plus the disk write, not minutes
of random numbers). The text is meaningless; the speed is a real model's.
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
}

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
    ap.add_argument("--type", choices=["f16", "q8_0", "q4_0"], default="q4_0")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer-from", default=None, help="a GGUF to copy tokenizer.* from (default: the default model)"
    )
    args = ap.parse_args()

    src = gguf.GGUFReader(args.tokenizer_from or models.resolve(models.DEFAULT))
    tok_fields = {k: f for k, f in src.fields.items() if k.startswith("tokenizer.")}
    n_vocab = len(tok_fields["tokenizer.ggml.tokens"].data)
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
    ftype = {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[args.type]
    w.add_file_type(ftype)
    for name, field in tok_fields.items():  # copy the tokenizer as stored
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), vtype)

    rng = np.random.default_rng(args.seed)
    qtype = {"f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[args.type]

    drawn: dict[tuple[int, int], np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int):
        if (rows, cols) not in drawn:
            x = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            drawn[rows, cols] = x.astype(np.float16) if qtype is None else quantize(x, qtype)
        if qtype is None:
            w.add_tensor(name, drawn[rows, cols])
        else:  # (rows, bytes): gguf derives the shape
            w.add_tensor(name, drawn[rows, cols], raw_dtype=qtype)

    def norm(name: str):
        w.add_tensor(name, np.ones(e, np.float32))

    d_kv = e // h * kv
    matrix("token_embd.weight", n_vocab, e)
    for i in range(L):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", e, e)
        matrix(f"blk.{i}.attn_k.weight", d_kv, e)
        matrix(f"blk.{i}.attn_v.weight", d_kv, e)
        matrix(f"blk.{i}.attn_output.weight", e, e)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ff, e)
        matrix(f"blk.{i}.ffn_up.weight", ff, e)
        matrix(f"blk.{i}.ffn_down.weight", e, ff)
        print(f"layer {i + 1}/{L}", file=sys.stderr, end="\r")
    norm("output_norm.weight")
    if args.size not in TIED:
        matrix("output.weight", n_vocab, e)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"\nwrote {args.output} ({Path(args.output).stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
