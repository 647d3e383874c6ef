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
