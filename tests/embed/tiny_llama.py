"""Run in the side virtual environment (torch, transformers, sentencepiece; see tests/test_convert.py):
writes a small Hugging Face llama checkpoint with random weights (safetensors) and a SentencePiece
tokenizer trained on Python's own documentation, then transformers' float32 logits for token ids.

    python tiny_llama.py OUT_DIR   (writes OUT_DIR/hf/ and OUT_DIR/reference.npz)
"""

import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main(out: str) -> None:
    out_dir = Path(out)
    hf = out_dir / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    import pydoc_data.topics

    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(pydoc_data.topics.topics.values()))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(hf / "tokenizer"), vocab_size=512, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, minloglevel=2,
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than the default 0.02 init: logits that differ clearly
            p.normal_(0, 0.1) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(hf, safe_serialization=True)
    sp = spm.SentencePieceProcessor(model_file=str(hf / "tokenizer.model"))
    ids = [1] + sp.encode(
        "The with statement wraps the execution of a block with methods defined by a context manager."
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    np.savez(out_dir / "reference.npz", ids=np.array(ids), logits=logits)


if __name__ == "__main__":
    main(*sys.argv[1:])
