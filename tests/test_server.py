"""The OpenAI-compatible server (llamabind.serve, python -m llamabind serve) against real clients: the
`openai` package, LangChain's ChatOpenAI/OpenAIEmbeddings and raw httpx; outputs compared with
Model.chat/generate/embed in this process (the same tree's code paths without the server)."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from conftest import GPU_BUILD

import llamabind

pytestmark = pytest.mark.slow
# The comparisons with Model.chat/generate/embed below are exact (or at float32 rounding): on a GPU
# build they run with the model on the CPU on both sides ("exact" tests get the CPU model), where
# llama.cpp's kernels give the same logits whatever the batch holds; CUDA's depend on the batch shape
# (a prompt re-evaluated from the cache as one token, two prompts in one batch), which
# test_cuda_offloaded_server checks with tolerances instead.
CPU_ONLY = {"n_gpu_layers": 0, "op_offload": False} if GPU_BUILD else {}
# The server's embeddings against Model.embed, both on the CPU: equal to 2e-5 here; on the H100
# host's CPU (AMX: its kernels depend on the batch, which differs between the two) a cosine of
# 0.99903 was measured on 2026-11-25 (0.9957 against the model on the GPU, which the test no longer uses).
EMBED_COSINE = 0.998 if GPU_BUILD else 0.999

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


@pytest.fixture(scope="module")
def srv(model_path):
    with llamabind.serve(model_path, port=0, parallel=4, ctx_size=4096, max_body=1 << 20, **CPU_ONLY) as s:
        yield s


@pytest.fixture
def client(srv):
    """A client per test (its own connections): with max_retries=0, a keep-alive connection left idle
    by an earlier test can be closed by the server (uvicorn: after 5 s, as llama-server's httplib) just
    as it is reused (openai 3.57 + httpx2 in a cold CI run: "Server disconnected")."""
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _fresh_chat(model, messages, **kw):
    """Model.chat on a new context: the module-scoped model's default context keeps earlier tests'
    prompts, and a reused prefix (another chat template's system header) moved a near-tie of the
    greedy choice on an AVX2-only VM (tool arguments "Paris" vs "UTC"; bisected to the test order)."""
    with model.context() as ctx:
        return ctx.chat(messages, **kw)


def _chat(client, srv, content, **kw):
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=srv.model_id, messages=[{"role": "user", "content": content}], **kw)


def test_models_list_and_health(client, srv, model_path):
    assert [m.id for m in client.models.list()] == [srv.model_id]
    assert srv.model_id == model_path.stem  # a path: the file name; a known name: that name
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


@pytest.mark.exact
def test_chat_greedy_equals_model_chat(client, srv, model):
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(model=srv.model_id, messages=msgs, max_tokens=24, temperature=0)
    ref = model.chat(msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.content
    assert r.choices[0].finish_reason == ref.finish_reason
    # llama-server counts the end-of-generation token it sampled; Model.chat's tokens stop before it
    assert r.usage.completion_tokens == len(ref.generation.tokens) + (ref.finish_reason == "stop")
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"


def test_stream_deltas_join_to_the_non_streamed_text(client, srv):
    full = _chat(client, srv, "Say hello.")
    parts, usage, finish = [], None, None
    for ch in _chat(client, srv, "Say hello.", stream=True, stream_options={"include_usage": True}):
        assert ch.object == "chat.completion.chunk"
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    raw = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_sampling_fields_and_logprobs(client, srv):
    r = _chat(client, srv, "Count: 1, 2, 3,", max_tokens=6, logprobs=True, top_logprobs=3, stop=["5"])
    lp = r.choices[0].logprobs.content
    assert lp and all(len(t.top_logprobs) == 3 for t in lp)
    assert all(t.logprob <= 0 for t in lp)
    assert "5" not in r.choices[0].message.content
    a = _chat(client, srv, "Tell me a story.", temperature=1.0, seed=7, max_tokens=12)
    b = _chat(client, srv, "Tell me a story.", temperature=1.0, seed=7, max_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.fixture(scope="module")
def tool_srv(model_path, vendor_dir):
    """Qwen2.5's template: a tool-call format common parses (SmolLM2's own template has none)."""
    tpl = (vendor_dir / "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    with llamabind.serve(model_path, port=0, parallel=2, ctx_size=4096, chat_template=tpl, **CPU_ONLY) as s:
        yield s, tpl


@pytest.mark.exact
def test_named_tool_choice_forces_that_tool(tool_srv, model):
    """A named tool_choice (what LangChain's with_structured_output(method="function_calling") sends):
    the model must call that function, even when the question is about the other one."""
    s, tpl = tool_srv
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    # push the model towards "<tool_call>" ("<", "tool", "call"; 135M parameters rarely get there alone)
    toks = model.tokenize("<tool_call>", add_special=False)
    bias = {str(toks[0]): 8, str(toks[1]): 8, str(toks[3]): 8}
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(
        model=s.model_id,
        messages=msgs,
        tools=[WEATHER, TIME],
        tool_choice=named,
        temperature=0,
        max_tokens=48,
        logit_bias=bias,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(call.function.name == "get_time" for call in calls)
    assert set(json.loads(calls[0].function.arguments)) == {"tz"}
    # Model.chat takes the same named form and gives the same call
    ref = _fresh_chat(
        model,
        msgs,
        tools=[WEATHER, TIME],
        tool_choice=named,
        template=tpl,
        temperature=0,
        max_tokens=48,
        logit_bias={int(k): float(v) for k, v in bias.items()},
    )
    assert ref.tool_calls[0]["function"]["name"] == "get_time"
    assert json.loads(ref.tool_calls[0]["function"]["arguments"]) == json.loads(calls[0].function.arguments)
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        c.chat.completions.create(
            model=s.model_id,
            messages=msgs,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_json_schema_output_parses(client, srv):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = _chat(
        client,
        srv,
        "Describe a person as JSON.",
        max_tokens=96,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    r = _chat(client, srv, 'Reply with {"ok": true} as JSON.', max_tokens=256, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.exact
def test_completions_string_list_and_token_prompts(client, srv, model):
    ids = model.tokenize("The capital of France is", add_special=False)
    ref = model.generate(ids, max_tokens=8, temperature=0).text
    r = client.completions.create(model=srv.model_id, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == ref
    r = client.completions.create(
        model=srv.model_id, prompt=["The capital of France is", "One, two,"], max_tokens=8, temperature=0
    )
    assert len(r.choices) == 2 and r.choices[0].text == ref


@pytest.mark.exact
def test_tokenize_detokenize(srv, model):
    ids = httpx.post(srv.url + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == model.tokenize("Hello world", add_special=False)
    assert httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=1e308), "temperature"),
        (dict(top_p=-3), "top_p"),
        (dict(extra_body={"top_k": -10}), "top_k"),
        (dict(extra_body={"min_p": 7}), "min_p"),
        (dict(logprobs=True, top_logprobs=1000000), "top_logprobs"),
        (dict(extra_body={"n_probs": -1}), "n_probs"),
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(logit_bias={"99999999": 5}), "logit_bias"),
        (dict(extra_body={"logit_bias": 5}), "logit_bias"),
        (dict(extra_body={"logit_bias": {"abc": 1}}), "logit_bias"),
        (dict(extra_body={"logit_bias": {"10": "x"}}), "logit_bias"),
        (dict(extra_body={"stop": 5}), "stop"),
        (dict(extra_body={"mirostat": 7}), "mirostat"),
        (dict(extra_body={"logprobs": 3}), "logprobs"),
        (dict(extra_body={"seed": "x"}), "seed"),
        (dict(max_tokens=0), "max_tokens"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_out_of_range_sampling_fields_are_400s_naming_the_field(client, srv, kw, field):
    """Issues 59 and 86: llama-server answered 200 to these (temperature 1e308, top_p -3, a logit_bias id outside
    the vocabulary or a bare number, stop 5, mirostat 7, ...); through the openai client each is a 400
    (BadRequestError) in OpenAI's error shape, its message naming the field and what it takes, ``param`` the
    field."""
    kw = {"max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError, match=f"'{field}'") as e:
        _chat(client, srv, "Hi", **kw)
    body = e.value.body if isinstance(e.value.body, dict) else {}
    err = body.get("error", body)
    assert err.get("param") == field and err.get("type") == "invalid_request_error", body


def test_fields_llama_cpps_parser_rejects_have_the_same_error_shape(srv):
    """Issue 86: a field of the wrong type that llama.cpp's own JSON reading rejects ("Field 'n_keep':
    [json.exception.type_error.302] ...") is a 400 in the same shape as ours, ``param`` naming the field."""
    for field, value in (("n_keep", "x"), ("cache_prompt", "x"), ("ignore_eos", 3)):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        err = _error(r)
        assert err["param"] == field and err["type"] == "invalid_request_error" and "code" in err, err


def test_logit_bias_and_logprobs_of_llama_servers_routes(srv):
    """Issue 86: /v1/completions' logprobs is OpenAI's integer in [0, 5] (1000000 was a 200); /completion takes
    llama-server's logit_bias forms (token ids, [token, bias] pairs, text whose tokens take the bias, false for
    never) and refuses ids outside the vocabulary and biases that are not numbers, each a 400 naming the field."""
    url = srv.url
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1000000})
    assert r.status_code == 400 and _error(r)["param"] == "logprobs", r.text
    ok = [{"15": -1.5}, [[15, 2.0]], {"hello": -100}, [["hello", False]]]
    for bias in ok:
        r = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 2, "logit_bias": bias}, timeout=120)
        assert r.status_code == 200, (bias, r.text)
    for bias in ({"-3": 1}, [[srv.context.n_vocab, 1]], {"15": [1]}, [[15]], "x"):
        r = httpx.post(url + "/completion", json={"prompt": "Hi", "n_predict": 2, "logit_bias": bias})
        assert r.status_code == 400 and _error(r)["param"] == "logit_bias", (bias, r.text)


def test_detokenize_refuses_ids_outside_the_vocabulary(srv):
    """Issue 59: /detokenize with ids -5 and 10**9 answered 400 with llama.cpp's raw C++ message
    (vector::_M_range_check ...); now the 400 names the id, its position and the vocabulary's range."""
    for bad, pos in (([1, -5], 1), ([10**9], 0), ([1, "x"], 1)):
        r = httpx.post(srv.url + "/detokenize", json={"tokens": bad})
        assert r.status_code == 400, r.text
        msg = _error(r)["message"]
        assert (
            f"'tokens'[{pos}] must be a token id in [0, {srv.context.n_vocab})" in msg and "_M_range_check" not in msg
        )


def test_metrics_are_prometheus_text(srv, client):
    _chat(client, srv, "Hi", max_tokens=2)
    text = httpx.get(srv.url + "/metrics").text
    assert "llamacpp:prompt_tokens_total" in text and "# TYPE" in text


@pytest.fixture(scope="module")
def embed_srv(model_path):
    with llamabind.serve(
        model_path, port=0, parallel=2, ctx_size=2048, embedding=True, pooling="mean", **CPU_ONLY
    ) as s:
        yield s


@pytest.mark.exact
def test_embedding_server_of_a_causal_lm_pools_by_mean(model_path, model, caplog):
    """SmolLM2's GGUF names no pooling type: `serve --embedding` without --pooling used llama.cpp's
    "none" and answered every /v1/embeddings with 400 "Pooling type 'none' is not OAI compatible";
    now mean pooling, said in the log."""
    with caplog.at_level("WARNING", logger="llamabind.server"):
        s = llamabind.serve(model_path, port=0, parallel=1, ctx_size=1024, embedding=True, **CPU_ONLY)
    with s:
        assert "mean pooling" in caplog.text
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        got = np.array(c.embeddings.create(model=s.model_id, input=["The cat sat on the mat."]).data[0].embedding)
        ref = model.embed(["The cat sat on the mat."], pooling="mean")[0]
        assert float(got @ ref) > EMBED_COSINE  # both L2-normalized: the cosine


def _assert_same_embeddings(got: np.ndarray, ref: np.ndarray) -> None:
    """Rows of L2-normalized embeddings: equal to 2e-5 here; on a GPU build's host (AMX) by cosine."""
    if GPU_BUILD:  # the H100 host's CPU: up to 0.01 apart, the batch differing between the two sides
        assert np.all(np.sum(got * ref, axis=1) > EMBED_COSINE), np.sum(got * ref, axis=1)
    else:
        np.testing.assert_allclose(got, ref, atol=2e-5)


@pytest.mark.exact
def test_embeddings_float_and_base64_equal_model_embed(embed_srv, model):
    c = openai.OpenAI(base_url=embed_srv.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The cat sat on the mat.", "Quantum chromodynamics"]
    ref = model.embed(texts, pooling="mean")  # L2-normalized, as the server's
    f = c.embeddings.create(model=embed_srv.model_id, input=texts, encoding_format="float")
    got = np.array([d.embedding for d in f.data], dtype=np.float32)
    _assert_same_embeddings(got, ref)
    b = httpx.post(
        embed_srv.url + "/v1/embeddings",
        json={"input": texts, "encoding_format": "base64", "model": embed_srv.model_id},
    ).json()
    dec = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32) for d in b["data"]])
    np.testing.assert_array_equal(dec, got)
    # the openai client asks for base64 by default and decodes it itself
    d = c.embeddings.create(model=embed_srv.model_id, input="The cat sat on the mat.")
    _assert_same_embeddings(np.array([d.data[0].embedding]), ref[:1])
    tok = c.embeddings.create(model=embed_srv.model_id, input=[model.tokenize("The cat sat on the mat.")])
    _assert_same_embeddings(np.array([tok.data[0].embedding]), ref[:1])


@pytest.mark.exact
def test_langchain_chat_and_embeddings(srv, embed_srv, model):
    lc = pytest.importorskip("langchain_openai")

    def chat_model(max_tokens):
        # no prompt reuse from earlier tests' requests on the module's server (see _fresh_chat)
        return lc.ChatOpenAI(
            base_url=srv.url + "/v1",
            api_key="unused",
            model=srv.model_id,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"cache_prompt": False},
        )

    chat = chat_model(16)
    msg = chat.invoke("Name three colors.")
    assert (
        msg.content
        == _fresh_chat(model, [{"role": "user", "content": "Name three colors."}], max_tokens=16, temperature=0).content
    )
    assert "".join(c.content for c in chat.stream("Name three colors.")) == msg.content
    schema = {
        "title": "Person",
        "description": "a person",
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    out = chat_model(96).with_structured_output(schema, method="json_schema").invoke("Describe a person.")
    assert set(out) == {"name", "age"}
    emb = lc.OpenAIEmbeddings(
        base_url=embed_srv.url + "/v1", api_key="unused", model=embed_srv.model_id, check_embedding_ctx_length=False
    )
    v = emb.embed_query("The cat sat on the mat.")
    np.testing.assert_allclose(v, model.embed("The cat sat on the mat.", pooling="mean"), atol=2e-5)


def _greedy_tokens(client, srv, prompt):
    r = _chat(client, srv, prompt, max_tokens=12, logprobs=True, top_logprobs=5, extra_body={"cache_prompt": False})
    return [(t.token, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]


def _parts_only_at_near_ties(alone, together, gap):
    """Each reply of `together` equals the one in `alone` or parts from it at a token the lone run had
    among its top 5 within `gap` (nats) of its choice; returns how many are identical."""
    same = 0
    for a, b in zip(alone, together):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        if k is None:
            assert len(a) == len(b)
            same += 1
            continue
        alternatives = dict(a[k][1])  # the lone run's top 5 at the parting token
        assert b[k][0] in alternatives and a[k][1][0][1] - alternatives[b[k][0]] < gap, (k, a[k], b[k])
    return same


def test_concurrent_requests_batch_without_crossing(srv, client):
    """32 requests over 4 slots at once: each reply is the reply its prompt gets alone. Decoding 4
    sequences in one batch takes other CPU kernels than one (AMX/gemm vs gemv: other rounding), so a
    reply may part from the lone one, but only at a near tie among the lone run's top tokens; a
    reply crossed with another request's would part at the number, far from a tie."""
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    alone = [_greedy_tokens(client, srv, p) for p in prompts]
    with ThreadPoolExecutor(32) as ex:
        together = list(ex.map(lambda p: _greedy_tokens(client, srv, p), prompts))
    same = _parts_only_at_near_ties(alone, together, 0.5)
    assert same >= 4  # measured here: 14 to 20 of 32 identical to the last token
    slots = httpx.get(srv.url + "/slots").json()
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"]["message"], str), body
    return body["error"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b"[1, 2]", 400),
        ("/v1/chat/completions", b"[" * 100_000, 400),  # json's recursion limit: was a 500
        ("/v1/completions", b'{"prompt": ' + b"[" * 100_000, 400),
        ("/v1/chat/completions", json.dumps({"messages": 5}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": [], "max_tokens": 4}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"max_tokens": 4}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"model": "gpt-4", "messages": []}).encode(), 404),
        ("/v1/chat/completions", json.dumps({"model": 7, "messages": []}).encode(), 400),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
            400,
        ),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "x " * 5000, "max_tokens": 4}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": [-5, 10**9], "max_tokens": 4}).encode(), 400),
        ("/v1/embeddings", json.dumps({"input": "x"}).encode(), 501),
        ("/v1/nope", b"{}", 404),
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(srv, client, path, body, status):
    r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    _error(r)
    assert _chat(client, srv, "Hi", max_tokens=2).choices[0].message.content


def test_body_limit_method_and_context_errors(srv):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    r = httpx.post(srv.url + "/v1/completions", content=big)
    assert r.status_code == 413 and "larger than" in _error(r)["message"]
    r = httpx.get(srv.url + "/v1/chat/completions")
    assert r.status_code == 405
    _error(r)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x " * 5000, "max_tokens": 4})
    assert "context" in _error(r)["message"]


def test_api_key(model_path):
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=1024, api_key="s3cret") as s:
        assert httpx.get(s.url + "/health").status_code == 200  # public, as llama-server's
        assert httpx.get(s.url + "/v1/models").status_code == 401
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [s.model_id]
        assert httpx.get(s.url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200


def test_non_loopback_without_key_warns_and_bad_arguments(model_path):
    with pytest.warns(UserWarning, match="without an API key"):
        with llamabind.serve(model_path, host="0.0.0.0", port=0, parallel=1, ctx_size=512) as s:
            assert s.running
    with pytest.raises(FileNotFoundError):
        llamabind.serve("/no/such/model.gguf", port=0)
    with pytest.raises(ValueError, match="parallel"):
        llamabind.serve(model_path, port=0, parallel=0)
    with pytest.raises(ValueError, match="port"):
        llamabind.serve(model_path, port=70000)


def _slots_idle(url: str, timeout: float = 5.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if not any(s["is_processing"] for s in httpx.get(url + "/slots").json()):
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise AssertionError("a slot stayed busy after its client went away")


def test_overload_503_and_disconnect_frees_the_slot(model_path):
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=2048, max_pending=1) as s:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 4000,
            "ignore_eos": True,  # long enough on any device for the client to give up first
            "stream": True,
        }
        with httpx.Client(timeout=30) as h, h.stream("POST", s.url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert any(s_["is_processing"] for s_ in httpx.get(s.url + "/slots").json())
            over = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert over.status_code == 503 and "overloaded" in _error(over)["message"]
        # the client went away mid-stream: its slot is freed (within a step, measured here in wall time)
        _slots_idle(s.url)
        # a non-streamed request whose client gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
        _slots_idle(s.url)
        ok = httpx.post(
            s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        )
        assert ok.status_code == 200


def test_stop_with_requests_in_flight(model_path):
    """stop() while a stream and a waiting non-streamed request run: both end, nothing hangs or aborts."""
    s = llamabind.serve(model_path, port=0, parallel=2, ctx_size=1024)
    assert "running" in repr(s)
    before = threading.active_count()
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 800}
    results = []

    def call(stream):
        try:
            with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60) as r:
                results.append(sum(1 for _ in r.iter_lines()))
        except httpx.HTTPError as e:
            results.append(e)

    threads = [threading.Thread(target=call, args=(st,)) for st in (True, False)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    s.stop()
    s.stop()  # idempotent
    for t in threads:
        t.join(30)
    assert time.perf_counter() - t0 < 10 and len(results) == 2
    assert not s.running and threading.active_count() <= before
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")


@pytest.mark.skipif(not GPU_BUILD, reason="a GPU build: the server with every layer on the GPU")
def test_cuda_offloaded_server(model_path, model):
    """Fully offloaded (n_gpu_layers default): streams equal the non-streamed text for the same batch
    shapes (cache_prompt off), embeddings match Model.embed on the GPU by cosine, and 16 requests over 4
    slots are not crossed (CUDA's logits move by up to ~0.5 nats with the batch shape, so the lone and
    the batched greedy text may part at any flat spot: the check uses prompts whose continuation is
    never in doubt)."""
    with llamabind.serve(model_path, port=0, parallel=4, ctx_size=4096) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        kw = {"max_tokens": 24, "extra_body": {"cache_prompt": False}}
        full = _chat(c, s, "Say hello.", **kw).choices[0].message.content
        parts = [ch.choices[0].delta.content or "" for ch in _chat(c, s, "Say hello.", stream=True, **kw) if ch.choices]
        assert full and "".join(parts) == full
        # no crossing: 16 prompts that each repeat one word, 4 slots; each reply goes on with its own word
        words = ["tiger", "piano", "lemon", "rocket", "garden", "silver", "candle", "desert",
                 "marble", "thunder", "violet", "copper", "dragon", "meadow", "harbor", "cloud"]  # fmt: skip

        def repeat(w):
            r = c.completions.create(model=s.model_id, prompt=" ".join([w] * 12), max_tokens=8, temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(16) as ex:
            replies = list(ex.map(repeat, words))
        for w, text in zip(words, replies):
            assert not any(o in text for o in words if o != w), (w, text)  # nothing of another request
        assert sum(w in text for w, text in zip(words, replies)) >= 12, replies  # 16 of 16 on the CPU here
    with llamabind.serve(model_path, port=0, parallel=2, ctx_size=2048, embedding=True, pooling="mean") as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        texts = ["The cat sat on the mat.", "Quantum chromodynamics"]
        got = np.array([d.embedding for d in c.embeddings.create(model=s.model_id, input=texts).data])
        ref = model.embed(texts, pooling="mean")
        assert np.all(np.sum(got * ref, axis=1) > 0.999)  # both L2-normalized: the cosine


def test_speculative_decoding_with_a_draft_model_gives_the_same_text(model_path):
    """serve --model-draft (llama-server's -md, draft-simple): SmolLM2 drafting for itself, greedy;
    the text equals the server's without a draft, and the draft was used (llama-server's timings
    count drafted and accepted tokens)."""
    prompt = "List the planets of the solar system in order from the Sun:"
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0}
    texts, timings = [], []
    for draft in ({}, {"model_draft": model_path, "draft_max": 8, "draft_min": 1}):
        with llamabind.serve(model_path, port=0, parallel=1, ctx_size=1024, **draft, **CPU_ONLY) as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            r = httpx.post(
                s.url + "/completion", json={"prompt": prompt, "n_predict": 48, "temperature": 0}, timeout=300
            )
            timings.append(r.json()["timings"])
    assert texts[0] == texts[1] and texts[0]
    assert timings[1].get("draft_n", 0) > 0 and timings[1].get("draft_n_accepted", 0) > 0, timings[1]
    with pytest.raises(ValueError, match="need a draft model"):
        llamabind.serve(model_path, port=0, draft_max=4)
