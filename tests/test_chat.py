"""Chat through common's jinja templates and parser; grammars and JSON schema; the sampler chain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import llamabind
from llamabind import SamplingParams, _core

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chatml(messages, system=DEFAULT_SYSTEM):
    """ChatML written out by hand (the format SmolLM2's GGUF template implements)."""
    out = "" if messages[0]["role"] == "system" else f"<|im_start|>system\n{system}<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Ünïcödé 日本語?"},
        ],
    ],
)
def test_template_renders_chatml(model, messages):
    assert model.chat_templates().render(messages) == chatml(messages)


def test_override_template(model):
    tpl = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert model.chat_templates(tpl).render(msgs) == "[user]a\n[assistant]b\n[user]c\n[assistant]"
    with pytest.raises(ValueError):
        model.chat_templates("{% for %}")


@pytest.mark.parametrize(
    "template, what, where",
    [
        ("line one\nline two {{ x | }}", "Unexpected token: }}", "line 2, column 17"),
        ("{% frobnicate %}", "Unknown statement: frobnicate", "line 1, column 4"),
        ("{% if %}", "Unexpected token: %}", "line 1, column 7"),
    ],
)
def test_a_broken_template_says_what_jinja_reported_and_where(model, template, what, where):
    """patch 0029: the message was "cannot parse the chat template: std::exception" (the rethrow
    in common_chat_templates_init sliced the parser's exception to its base)."""
    with pytest.raises(ValueError) as e:
        model.chat_templates(template)
    msg = str(e.value)
    assert "std::exception" not in msg and what in msg and where in msg, msg


def test_chat_equals_generate_on_the_rendered_prompt(model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = model.chat(msgs, temperature=0, max_tokens=20)
    g = model.generate(chatml(msgs), temperature=0, max_tokens=20)
    assert r.generation.tokens == g.tokens
    assert r.message == {"role": "assistant", "content": g.text}
    assert r.finish_reason == g.finish_reason


@pytest.mark.exact
def test_second_turn_reuses_the_kv_cache_of_the_first(model):
    ctx = model.context(n_ctx=1024)
    first = [{"role": "user", "content": "Name a fruit."}]
    r1 = ctx.chat(first, temperature=0, max_tokens=12)
    second = first + [r1.message, {"role": "user", "content": "And a vegetable?"}]
    cached = ctx.tokens
    r2 = ctx.chat(second, temperature=0, max_tokens=12)
    new = model.tokenize(chatml(second), parse_special=True)
    common = next((i for i, (a, b) in enumerate(zip(cached, new)) if a != b), min(len(cached), len(new)))
    assert r2.generation.timings.prompt_reused == common > len(model.tokenize(chatml(first), parse_special=True)) - 2
    fresh = model.context(n_ctx=1024).chat(second, temperature=0, max_tokens=12)
    assert fresh.generation.tokens == r2.generation.tokens and fresh.generation.timings.prompt_reused == 0


@pytest.mark.exact
def test_stream_chat(model):
    msgs = [{"role": "user", "content": "Say hello."}]
    s = model.chat(msgs, temperature=0, max_tokens=16, stream=True)
    text = "".join(s)
    assert isinstance(s.result, llamabind.ChatResult) and s.result.text == text
    assert text == model.chat(msgs, temperature=0, max_tokens=16).text


def test_tool_call_parsing_with_a_tool_template(model, vendor_dir):
    """Qwen2.5's template (Hermes-style <tool_call>): common gives a grammar and a parser; text in
    that format parses into an OpenAI tool call."""
    tpl = (vendor_dir / "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    cp = model.chat_templates(tpl).apply(
        [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice="required"
    )
    assert "get_weather" in cp.prompt and cp.grammar and "tool" in cp.grammar
    msg = json.loads(cp.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'))
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # the grammar reaches the sampler: a forced generation stays inside it
    r = model.chat(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        template=tpl,
        temperature=0.8,
        seed=3,
        max_tokens=120,
        logit_bias={t: 8.0 for t in model.tokenize("<tool_call>", add_special=False)},
    )
    if r.finish_reason == "tool_calls":
        assert r.tool_calls[0]["function"]["name"] == "get_weather"
        json.loads(r.tool_calls[0]["function"]["arguments"])


@pytest.mark.parametrize(
    "bad",
    [
        "hello",
        [{"content": "no role"}],
        [1, 2],
        [],
    ],
)
def test_bad_messages(model, bad):
    with pytest.raises((TypeError, ValueError)):
        model.chat(bad, max_tokens=1)


def test_json_schema_output_always_parses(model):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    for seed in range(4):
        r = model.chat(
            [{"role": "user", "content": "Describe a person as JSON."}],
            seed=seed,
            temperature=1.0,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"schema": schema}},
        )
        assert r.finish_reason == "stop", r.text
        obj = json.loads(r.content)
        assert set(obj) == {"name", "age", "tags"}
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 20
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3


def test_json_object_and_generate_json_schema(model):
    # a prompt that asks for a small object: "Give me JSON." rambled past max_tokens on an AVX-512 machine
    for seed in range(3):
        r = model.chat(
            [{"role": "user", "content": "Give me a JSON object with a name and an age."}],
            response_format={"type": "json_object"},
            temperature=0.9,
            seed=seed,
            max_tokens=200,
        )
        assert r.finish_reason == "stop" and isinstance(json.loads(r.content), dict)
    g = model.generate(
        "Colors:",
        json_schema={"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        temperature=1.0,
        seed=2,
        max_tokens=40,
    )
    assert g.finish_reason == "stop" and all(c in ("red", "green", "blue") for c in json.loads(g.text))


def test_gbnf_grammar(model):
    for seed in range(3):
        r = model.generate(
            "Is the sky blue? Answer:", grammar='root ::= " yes" | " no"', temperature=1.5, seed=seed, max_tokens=10
        )
        assert r.text in (" yes", " no") and r.finish_reason == "stop"
    with pytest.raises(ValueError, match="grammar"):
        model.generate("x", grammar="root ::= (", max_tokens=1)
    with pytest.raises(ValueError):
        llamabind.json_schema_to_grammar("{not json")


CHAINS = [
    dict(temperature=0.9, typical_p=0.8),
    dict(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.1),
    dict(temperature=0.8, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2),
    dict(temperature=1.0, mirostat=1, mirostat_tau=4.0, mirostat_eta=0.2),
    dict(temperature=1.0, mirostat=2),
    dict(temperature=0.7, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, repeat_last_n=32),
    dict(temperature=1.2, top_n_sigma=1.5, top_k=0),
    dict(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.2, min_p=0.1),
]


@pytest.mark.exact
@pytest.mark.parametrize("params", CHAINS, ids=lambda p: "-".join(k for k in p if k != "temperature"))
def test_every_sampler_is_seed_deterministic(model, params):
    a = model.generate("Once upon a time", max_tokens=24, seed=42, **params)
    b = model.generate("Once upon a time", max_tokens=24, seed=42, **params)
    c = model.generate("Once upon a time", max_tokens=24, seed=43, **params)
    assert a.tokens == b.tokens
    assert len(a.tokens) > 0
    assert a.tokens != c.tokens or len(set(a.tokens)) <= 2  # the seed matters


def test_chain_contents(model):
    d = SamplingParams(temperature=0.7, typical_p=0.5, xtc_probability=0.3, dry_multiplier=0.5).build(model).description
    for name in ("typical", "xtc", "dry", "temp-ext", "dist"):
        assert name in d and f"?{name}" not in d, d
    m = SamplingParams(mirostat=2).build(model).description
    assert "mirostat-v2" in m


def test_logit_bias(model):
    greedy = model.generate("The capital of France is", max_tokens=4, temperature=0)
    first = greedy.tokens[0]
    banned = model.generate("The capital of France is", max_tokens=4, temperature=0, logit_bias={first: float("-inf")})
    assert banned.tokens[0] != first
    x = model.tokenize(" banana", add_special=False)[0]
    forced = model.generate("The capital of France is", max_tokens=4, temperature=0, logit_bias={x: 100.0})
    assert forced.tokens == [x] * 4


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(typical_p=0),
        dict(top_k=-1),
        dict(xtc_probability=2),
        dict(mirostat=3),
        dict(mirostat_eta=0),
        dict(repeat_penalty=0),
        dict(repeat_last_n=-2),
        dict(dry_base=0.5),
        dict(frequency_penalty=3),
        dict(seed=-1),
        dict(seed=2**32),
        dict(top_n_sigma=0),
        dict(temperature=float("nan")),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={0: float("nan")}),
        dict(logprobs=-1),
        dict(logprobs=101),
        dict(max_tokens=-1),
        dict(n_draft=0, lookup_ngram=2),
    ],
)
def test_out_of_range_raises_value_error(model, kw):
    with pytest.raises(ValueError):
        model.generate("x", **{"max_tokens": 1, **kw})


def test_unknown_sampling_argument(model):
    with pytest.raises(TypeError, match="tempurature"):
        model.generate("x", tempurature=0.5)
    with pytest.raises(ValueError):  # a token id outside the vocabulary, checked natively
        _core.Sampler(model._llama_model, {"logit_bias": {10**7: 1.0}}, None)


def test_chat_cli_repl(model_path):
    """python -m llamabind chat: an interactive loop with history, /exit ends it."""
    p = subprocess.run(
        [sys.executable, "-m", "llamabind", "chat", "-m", str(model_path), "--temp", "0", "-n", "8", "--no-progress"],
        input="Hi\nWhat did I just say?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    msgs = [{"role": "user", "content": "Hi"}]
    with llamabind.Model(model_path, n_ctx=4096) as m:
        r1 = m.chat(msgs, temperature=0, max_tokens=8)
        r2 = m.chat(
            msgs + [r1.message, {"role": "user", "content": "What did I just say?"}], temperature=0, max_tokens=8
        )
    assert r1.content.strip() in p.stdout and r2.content.strip() in p.stdout


def test_common_logs_do_not_reach_stderr(model_path):
    """llama.cpp common's own logger (chat templates, sampler) is silenced: stderr stays clean."""
    code = (
        f"import llamabind; m = llamabind.Model({str(model_path)!r}, n_ctx=256); "
        "print(m.chat_templates().render([{'role': 'user', 'content': [{'type': 'text', 'text': 'hi'}]}]))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "<|im_start|>user\nhi<|im_end|>" in p.stdout
    assert p.stderr == "", p.stderr


def _pty_chat(model_path, keys: list[bytes], env: dict) -> str:
    """python -m llamabind chat on a pseudo-terminal (stdin a tty: the interactive REPL), fed `keys`
    line by line as a user types them; everything it printed (stdout and stderr share the tty)."""
    import os
    import pty
    import select
    import time

    cmd = [sys.executable, "-m", "llamabind", "chat", "-m", str(model_path), "--temp", "0", "-n", "6", "--no-progress"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the REPL on the pty
        # as a terminal's shell starts it: SIGINT at its default. A runner started in the background by a
        # non-interactive shell (`bash -c '... &'`) ignores SIGINT, exec keeps that, and Python then installs no
        # KeyboardInterrupt handler: Ctrl-C did nothing (what failed this test in two detached cold CI runs)
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execvpe(cmd[0], cmd, env)
    out = b""

    def read_more(timeout: float) -> bool:
        nonlocal out
        r, _, _ = select.select([fd], [], [], timeout)
        if r:
            try:
                out += os.read(fd, 65536)
            except OSError:
                return False
        return True

    def wait_for_prompts(n: int, timeout: float = 120) -> None:
        end = time.time() + timeout
        while out.count(b"> ") < n and time.time() < end and read_more(0.5):
            pass

    wait_for_prompts(1)
    for i, k in enumerate(keys):
        n = out.count(b"> ")
        if k == b"\x03":  # a person's pause after the prompt: CPython's readline notices a SIGINT that lands between
            time.sleep(0.3)  # printing the prompt and its select() only when a line completes (cold CIs lost two so)
        os.write(fd, k)
        if k == b"\x03" and i < len(keys) - 1:
            wait_for_prompts(n + 1, timeout=10)
            if out.count(b"> ") == n:  # the SIGINT is pending in the REPL: Enter completes the line, as a person's
                os.write(fd, b"\r")  # next key would, and input() raises KeyboardInterrupt as it returns
        if k.endswith((b"\r", b"\x03")) and i < len(keys) - 1:  # wait for the next prompt (none after the last)
            wait_for_prompts(n + 1)
    end = time.time() + 10
    while time.time() < end and read_more(0.5):  # what it prints on the way out
        pass
    os.close(fd)
    os.waitpid(pid, 0)
    return out.decode(errors="replace")


def test_chat_repl_in_a_terminal(model_path, tmp_path):
    """The REPL as llama-cli's users expect it, through a pty: a banner naming the model, n_ctx and
    the commands; /help answered, not sent; an unknown /command refused; readline editing (the left
    arrow moves the cursor: "abc" + left + "X" is "abXc", not an escape code) with a history file;
    a speed line after each reply."""
    import os

    env = {**os.environ, "LLAMABIND_CACHE": str(tmp_path), "TERM": "xterm"}
    models_dir = Path(llamabind.models.cache_dir()) / "models"
    if models_dir.exists():  # the model stays where it is: the cache here holds only the history
        (tmp_path / "models").symlink_to(models_dir)
    keys = [b"/help\r", b"/frobnicate\r", b"/system Be brief.\r", b"abc\x1b[DX\r", b"/reset\r", b"\x04"]
    out = _pty_chat(model_path, keys, env)
    assert "n_ctx" in out and "/help for commands" in out, out
    assert "/reset" in out and "/system TEXT" in out, out  # the help text
    assert "unknown command /frobnicate" in out, out
    assert "[system prompt set (" in out and "[conversation cleared, the system prompt kept]" in out, out
    assert "generated: " in out and "tokens/s" in out, out  # the speed line of the reply
    assert out.rstrip(" ").endswith("> \r\n"), repr(out[-40:])  # Ctrl-D ended the prompt's line
    history = (tmp_path / "chat_history").read_text()
    assert "abXc" in history and "\x1b" not in history, history


def test_chat_repl_system_and_ctrl_c(model_path, tmp_path):
    """Issue 86 item 4: a bare /system shows the system prompt (none, then the one set) and its usage; Ctrl-C at
    the prompt asks for a second press (as llama-cli) and a second one in a row leaves, with no traceback; /help
    says so."""
    import os

    env = {**os.environ, "LLAMABIND_CACHE": str(tmp_path), "TERM": "xterm"}
    keys = [b"/help\r", b"/system\r", b"/system Be brief.\r", b"/system\r", b"\x03", b"\x03"]
    out = _pty_chat(model_path, keys, env)
    assert "Ctrl-C twice at the prompt" in out, out
    assert "[no system prompt (the template's default); /system TEXT sets it]" in out, out
    assert "[the system prompt: 'Be brief.'; /system TEXT sets it]" in out, out
    assert out.count("[Ctrl-C again, /exit or Ctrl-D to leave]") == 1 and "Traceback" not in out, out
    assert "unknown command" not in out, out


def test_two_chats_at_once_keep_each_others_history(tmp_path, monkeypatch):
    """Issue 59: each chat appends its own lines to the history file when it ends; rewriting the file
    with its whole in-memory history, the second chat to end dropped the lines the first had saved
    meanwhile (last writer wins). Here: a chat reads the file, another chat's line is appended while
    this one runs, this one ends: the file holds the old line, the other's and this one's."""
    readline = pytest.importorskip("readline")
    from llamabind.cli import run

    monkeypatch.setenv("LLAMABIND_CACHE", str(tmp_path))
    path = tmp_path / "chat_history"
    path.write_text("an old line\n")
    readline.clear_history()
    assert run._line_editing() == str(path)
    readline.add_history("this chat's line")
    with open(path, "a") as f:  # the other chat ended first
        f.write("the other chat's line\n")
    run._save_history(str(path))
    lines = path.read_text().splitlines()
    assert lines == ["an old line", "the other chat's line", "this chat's line"], lines
    readline.clear_history()


def test_a_role_templates_do_not_know_is_refused(model_path):
    """Issue 86 item 5: a message whose role is not OpenAI's (system, developer, user, assistant, tool) is a
    ValueError naming the message and the roles, before the template renders it (it rendered "banana")."""
    with llamabind.Model(model_path, vocab_only=True) as m:
        tpl = m.chat_templates()
        with pytest.raises(ValueError, match=r"messages\[1\]\['role'\] must be one of system, developer, user"):
            tpl.render([{"role": "user", "content": "hi"}, {"role": "banana", "content": "x"}])
        assert "hi" in tpl.render([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
