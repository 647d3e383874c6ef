"""Python logits processors (generate/chat/generate_batch ``logits_processor=``): what they see
(the input ids so far, the next token's logits), that the sampler samples from what they return
(checked against argmax over the allowed set of llama_decode's own logits, teacher-forced), bad
returns as clear errors, and lm-format-enforcer's llama.cpp integration through a small facade."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

PROMPT = "The three primary colors are"


def _only(allowed):
    def f(ids, logits):
        mask = np.full_like(logits, -np.inf)
        mask[allowed] = 0.0
        return logits + mask

    return f


@pytest.mark.exact
def test_a_processor_that_allows_a_set_decides_every_token(model):
    allowed = sorted(set(model.tokenize(" red green blue yellow and", add_special=False)))
    seen = []

    def record(ids, logits):
        assert ids.dtype == np.int32 and not ids.flags.writeable and logits.dtype == np.float32
        seen.append(ids.copy())

    r = model.generate(PROMPT, max_tokens=12, temperature=0, logits_processor=[record, _only(allowed)])
    assert len(r.tokens) == 12 and set(r.tokens) <= set(allowed), r.text
    prompt = model.tokenize(PROMPT)
    assert [s.tolist() for s in seen] == [prompt + r.tokens[:k] for k in range(12)]
    # teacher-forced: llama_decode's logits of prompt + generated, argmax over the allowed set
    with model.context(n_ctx=256) as ctx:
        logits = ctx.eval(prompt + r.tokens[:-1])[len(prompt) - 1 :]
    ref = [allowed[int(np.argmax(row[allowed]))] for row in logits]
    assert r.tokens == ref
    plain = model.generate(PROMPT, max_tokens=12, temperature=0)
    assert plain.tokens != r.tokens  # the processor changed the text


def test_in_place_sampling_chat_and_batch(model):
    yes_no = sorted(set(model.tokenize(" yes no", add_special=False)))

    def in_place(ids, logits):
        keep = logits[yes_no].copy()
        logits[:] = -np.inf
        logits[yes_no] = keep  # returns None: changed in place

    r = model.generate("Is the sky blue?", max_tokens=8, temperature=0.9, seed=3, logits_processor=in_place)
    assert set(r.tokens) <= set(yes_no) and len(r.tokens) == 8
    c = model.chat([{"role": "user", "content": "Is the sky blue?"}], max_tokens=4, logits_processor=in_place)
    assert set(c.generation.tokens) <= set(yes_no)
    seen: dict[int, list[list[int]]] = {}

    def per_sequence(ids, logits):
        seen.setdefault(int(ids[0]) if len(ids) else -1, []).append(ids.tolist())
        return _only(yes_no)(ids, logits)

    prompts = ["Hello there", "Is it raining"]
    outs = model.generate_batch(prompts, max_tokens=5, temperature=0, logits_processor=per_sequence)
    for p, o in zip(prompts, outs):
        assert set(o.tokens) <= set(yes_no) and len(o.tokens) == 5
    calls = [c for v in seen.values() for c in v]
    for p, o in zip(prompts, outs):  # each sequence's own ids, growing by its own tokens
        toks = model.tokenize(p)
        assert [toks + o.tokens[:k] for k in range(5)] == [c for c in calls if c[: len(toks)] == toks]


@pytest.mark.parametrize(
    "proc, err, match",
    [
        (lambda ids, lg: lg * np.nan, ValueError, "NaN or \\+inf"),
        (lambda ids, lg: np.full_like(lg, np.inf), ValueError, "NaN or \\+inf"),
        (lambda ids, lg: np.full_like(lg, -np.inf), ValueError, "forbade every token"),
        (lambda ids, lg: lg[:10], ValueError, "shape \\(10,\\)"),
        (5, TypeError, "logits_processor must be"),
        ([print, "x"], TypeError, "logits_processor must be"),
    ],
)
def test_bad_processors_are_clear_errors(model, proc, err, match):
    with pytest.raises(err, match=match):
        model.generate(PROMPT, max_tokens=2, logits_processor=proc)
    assert model.generate(PROMPT, max_tokens=2, temperature=0).tokens  # the model keeps working


def test_a_processor_that_raises_stops_the_generation_and_nothing_breaks(model):
    def boom(ids, logits):
        if len(ids) > len(model.tokenize(PROMPT)) + 1:
            raise RuntimeError("processor failed")

    with pytest.raises(RuntimeError, match="processor failed"):
        model.generate(PROMPT, max_tokens=8, logits_processor=boom)
    with pytest.raises(ValueError, match="speculative"):
        model.generate(PROMPT, max_tokens=2, lookup_ngram=2, logits_processor=boom)
    assert model.generate(PROMPT, max_tokens=3, temperature=0).tokens


def _llama_cpp_facade(model):
    """What lm-format-enforcer's llama.cpp integration reads of a llama_cpp.Llama, over a
    llamabind Model: tokenize(bytes), detokenize(ids) -> bytes, n_vocab(), token_bos/eos()."""

    class Llama:
        def tokenize(self, text: bytes, add_bos=True, special=False):
            return model.tokenize(text.decode("utf-8"), add_special=add_bos, parse_special=special)

        def detokenize(self, ids):
            return b"".join(model.token_to_piece(int(t)) for t in ids)

        def n_vocab(self):
            return model.n_vocab

        def token_bos(self):
            return model.token_bos

        def token_eos(self):
            return model.token_eos

    return Llama()


def test_lm_format_enforcer_json_schema(model, monkeypatch):
    """lm-format-enforcer's integrations/llamacpp.py (its processor takes (input_ids, scores), as
    ours are called) constrains a chat reply to a JSON schema. The module imports llama_cpp at
    import time: a stand-in module provides the two names it imports."""
    lmfe = pytest.importorskip("lmformatenforcer")
    stub = types.ModuleType("llama_cpp")
    stub.Llama, stub.LogitsProcessor = type("Llama", (), {}), object
    monkeypatch.setitem(sys.modules, "llama_cpp", stub)
    monkeypatch.delitem(sys.modules, "lmformatenforcer.integrations.llamacpp", raising=False)
    from lmformatenforcer.integrations.llamacpp import (
        build_llamacpp_logits_processor,
        build_token_enforcer_tokenizer_data,
    )

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["name", "year"],
    }
    data = build_token_enforcer_tokenizer_data(_llama_cpp_facade(model))
    proc = build_llamacpp_logits_processor(data, lmfe.JsonSchemaParser(schema))
    msgs = [{"role": "user", "content": "Name a programming language and the year it appeared, as JSON."}]
    r = model.chat(msgs, max_tokens=64, temperature=0, logits_processor=[proc])
    obj = json.loads(r.message["content"])
    assert set(obj) == {"name", "year"} and isinstance(obj["year"], int) and isinstance(obj["name"], str), obj
