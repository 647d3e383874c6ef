"""bench/make_model.py writes the model it claims (a small size, loaded by llama.cpp)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import ROOT

import llamabind


def test_make_model_writes_a_loadable_llama(tmp_path):
    out = tmp_path / "tiny.gguf"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "make_model.py"), "--size", "tiny", "--type", "q8_0", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "bench" / "make_model.py")
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    with llamabind.Model(out, n_ctx=64) as m:
        assert m.metadata["general.architecture"] == "llama"
        assert m.n_params == mm.n_params(m.n_vocab, "tiny")
        assert m.n_layer == mm.SIZES["tiny"][1] and m.n_embd == mm.SIZES["tiny"][0]
        r = m.generate("Hello", max_tokens=4, temperature=0)
        assert len(r.tokens) == 4


def test_make_model_writes_a_k_quant_mix_with_llama_3s_vocabulary(tmp_path):
    """--type q4_k_m --vocab 128256 (issue 88's shapes): llama-quantize's Q4_K_M mix (attn_v and ffn_down Q6_K where
    its use_more_bits rule says, output.weight Q6_K, the rest Q4_K, ggml's own quantizers), the tokenizer padded to
    Llama 3's 128,256 tokens; llama.cpp loads it as "Q4_K - Medium" and a QLoRA step over it runs on the CPU."""
    from llamabind import train

    out = tmp_path / "tiny-q4_k_m.gguf"
    cmd = [sys.executable, str(ROOT / "bench" / "make_model.py"), "--size", "tiny", "--type", "q4_k_m", "--vocab",
           "128256", "-o", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with llamabind.Model(out, n_threads=2, repack=False, n_gpu_layers=0) as m:
        assert m.n_vocab == 128256 and "Q4_K - Medium" in m.description
        types = {name: t for name, t, _ in m.tensor_info()}
        assert types["blk.0.attn_v.weight"] == "q4_K" and types["blk.1.attn_v.weight"] == "q6_K"
        assert types["blk.1.ffn_down.weight"] == "q6_K" and types["output.weight"] == "q6_K"
        assert types["blk.0.attn_q.weight"] == "q4_K" and types["token_embd.weight"] == "q4_K"
        r = train.finetune(m, "The quick brown fox jumps over the lazy dog. " * 40, lora_rank=4, lr=1e-3, iters=2,
                           val_split=0, progress=False, n_threads=2)  # fmt: skip
        assert len(r.losses) == 2 and r.losses[1] < r.losses[0]
