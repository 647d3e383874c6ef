"""Tokenizer: round trips on SmolLM2, and upstream's expected ids for its vocab-only GGUFs."""

from __future__ import annotations

import pytest
from conftest import VENDOR

import llamabind

SEP = "\n__ggml_vocab_test__\n"  # the separator of upstream's tests/test-tokenizer-0 inputs


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        " leading space and  double  spaces\tand tabs\n\nnewlines",
        "accents: café naïve façade Ångström über",
        "CJK: 日本語のテキスト 中文文本 한국어",
        "emoji: 🎉🦙👩‍👩‍👧‍👦 and flags 🇫🇷",
        "code: def f(x):\n    return x ** 2  # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    ],
)
def test_round_trip(model, text):
    ids = model.tokenize(text, add_special=False)
    assert ids and all(0 <= t < model.n_vocab for t in ids)
    assert model.detokenize(ids) == text
    # piece by piece, the bytes add up to the same UTF-8
    assert b"".join(model.token_to_piece(t) for t in ids).decode("utf-8") == text


def test_special_tokens(model):
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = model.tokenize(text, add_special=False, parse_special=True)
    plain = model.tokenize(text, add_special=False, parse_special=False)
    start = model.metadata["tokenizer.ggml.tokens"].index("<|im_start|>")
    assert parsed[0] == start and start not in plain
    assert len(parsed) < len(plain)
    assert model.detokenize(parsed, unparse_special=True) == text
    assert model.detokenize(plain) == text
    assert model.detokenize(parsed, unparse_special=False) == "user\nHi"


def test_tokenize_rejects_bytes_and_bad_ids(model):
    with pytest.raises(TypeError):
        model.tokenize(b"bytes are not text")
    with pytest.raises(ValueError, match="n_vocab"):
        model.detokenize([1, model.n_vocab])
    with pytest.raises(ValueError, match="out of range"):
        model.detokenize([-1])
    with pytest.raises(ValueError):
        model.token_to_piece(10**6)
    assert model.tokenize("") == ([model.token_bos] if model._llama_model.add_bos else [])


def _vocab_cases():
    names = sorted(
        p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in (VENDOR / "models").glob("ggml-vocab-*.gguf.inp")
    )
    return names


@pytest.mark.parametrize("name", _vocab_cases() or ["llama-bpe", "llama-spm", "gpt-2", "qwen2"])
def test_upstream_tokenizer_vectors(name):
    base = VENDOR / "models" / f"ggml-vocab-{name}.gguf"
    raw = base.with_name(base.name + ".inp").read_text(encoding="utf-8")
    # as upstream's tests/test-tokenizer-0.cpp reads them: inputs end with SEP, one .out line each
    inputs = raw.split(SEP)
    if raw.endswith(SEP):
        inputs = inputs[:-1]
    expected = base.with_name(base.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(inputs) == len(expected) and len(inputs) > 10
    with llamabind.Model(base, vocab_only=True) as vocab:
        for text, out in zip(inputs, expected):
            want = [int(t) for t in out.split()]
            got = vocab.tokenize(text, add_special=False, parse_special=False)
            assert got == want, f"{name}: {text!r}"


def test_the_four_named_vocabularies_are_covered():
    assert {"llama-bpe", "llama-spm", "gpt-2", "qwen2"} <= set(_vocab_cases())
