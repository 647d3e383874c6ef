"""`python -m llamabind convert` (issue 31): a Hugging Face llama checkpoint written in the test with
transformers (random weights, safetensors, a SentencePiece tokenizer trained on pydoc text) goes
through upstream's convert_hf_to_gguf.py shipped in the wheel; the GGUF loads, tokenizes as the
SentencePiece model does, and its logits equal transformers' within the rounding of the output type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamabind
from llamabind import convert

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def checkpoint(reference_python, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    p = subprocess.run([str(reference_python), str(HERE / "embed" / "tiny_llama.py"), str(d)], capture_output=True,
                       text=True, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return d


def _nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.mark.parametrize("outtype, limit", [("f32", 1e-9), ("f16", 1e-5), ("q8_0", 1e-3)])
def test_converted_logits_equal_transformers(checkpoint, reference_python, tmp_path, outtype, limit):
    out = tmp_path / f"tiny-{outtype}.gguf"
    cmd = [sys.executable, "-m", "llamabind", "convert", str(checkpoint / "hf"), "-o", str(out), "--outtype", outtype,
           "--python", str(reference_python)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = np.load(checkpoint / "reference.npz")
    ids = [int(i) for i in ref["ids"]]
    # an F16 KV cache and the CPU flash-attention kernel (F16 inside) would add ~1e-6 to the f32 NMSE
    kv = {"type_k": "f32", "type_v": "f32", "flash_attn": "off"}
    with llamabind.Model(out, n_threads=2, n_gpu_layers=0) as m, m.context(n_ctx=256, n_batch=256, **kv) as ctx:
        assert m.metadata["general.architecture"] == "llama"
        text = "The with statement wraps the execution of a block with methods defined by a context manager."
        assert m.tokenize(text) == ids  # the GGUF's tokenizer is the SentencePiece model's (BOS added)
        logits = ctx.eval(ids)
    assert logits.shape == ref["logits"].shape
    nmse = _nmse(logits, ref["logits"])
    assert nmse <= limit, nmse
    assert (logits.argmax(-1) == ref["logits"].argmax(-1)).mean() >= 0.9


def test_convert_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        convert.convert_hf(tmp_path / "missing", tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert.convert_hf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="outtype"):
        convert.convert_hf(tmp_path, tmp_path / "x.gguf", outtype="q4_k")
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"]}')
    p = subprocess.run([sys.executable, "-m", "llamabind", "convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1 and "convert_hf_to_gguf.py failed" in p.stderr, p.stderr
    assert convert.converter_path().name == "convert_hf_to_gguf.py"
