"""The command line, logging, and model resolution."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
from conftest import run_python

import llamabind
from llamabind import models


def test_cli_generate_streams_and_reports_speed(model_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "llamabind",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--model",
            str(model_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    with llamabind.Model(model_path) as m:
        want = m.generate("The capital of France is", max_tokens=12, temperature=0).text
    assert p.stdout == want + "\n"
    last = p.stderr.strip().splitlines()[-1]
    assert "tokens/s" in last and "generated: 12 tokens" in last


def test_cli_info():
    p = subprocess.run([sys.executable, "-m", "llamabind", "info"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "b11312" in p.stdout and "0001-ggml-cpu-soft_max_back-dst-aliases-y.patch" in p.stdout


def test_cli_bad_model_is_an_error_not_a_crash(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "llamabind", "generate", "x", "--model", str(tmp_path / "none.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "error:" in p.stderr


def test_cli_split_options_reach_the_model(model_path):
    """-sm/-ts are parsed and passed on: a malformed split and one with more entries than this build
    has devices are clear errors (exit 2); a valid one generates."""

    def gen(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "llamabind",
                "generate",
                "Hi",
                "-n",
                "2",
                "--temp",
                "0",
                "-m",
                str(model_path),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad = gen("-ts", "3,x")
    assert bad.returncode == 2 and "comma-separated numbers" in bad.stderr
    too_many = gen("-ts", ",".join(["1"] * 257))  # llama_max_devices() is 16 at this pin
    assert too_many.returncode == 2 and "tensor_split has" in too_many.stderr
    assert gen("-sm", "bogus").returncode == 2
    ok = gen("-sm", "layer", "-ts", "1")
    assert ok.returncode == 0, ok.stderr


def test_quiet_by_default(model_path):
    r = run_python(f"""
import llamabind
with llamabind.Model({str(model_path)!r}, n_ctx=64) as m:
    m.generate("Hi", max_tokens=2)
""")
    assert r.returncode == 0
    assert r.stderr == "", r.stderr  # llama.cpp's load log would be hundreds of lines


def test_logs_reach_python_logging(model_path, caplog):
    with caplog.at_level(logging.INFO, logger="llamabind.native"):
        with llamabind.Model(model_path, vocab_only=True):
            pass
    native = [r for r in caplog.records if r.name == "llamabind.native"]
    assert native, "no llama.cpp log record reached logging"
    assert any("llama_model_loader" in r.getMessage() or "print_info" in r.getMessage() for r in native)


def test_load_error_carries_llama_cpp_reason(model_path, tmp_path):
    p = tmp_path / "t.gguf"
    with open(model_path, "rb") as f:
        p.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError) as e:
        llamabind.Model(p)
    assert "llama.cpp:" in str(e.value)  # the logged reason, not only "failed"


def test_an_abort_says_what_ggml_logged_before_it():
    """ggml logs why before it aborts (ggml_cuda_error: "CUDA error: out of memory", the device, the call, then
    GGML_ABORT("CUDA error")); with no logging configured those lines went to the NullHandler and the abort said
    only "ggml-cuda.cu:110: CUDA error" (an 80 GB H100 running out of memory under a 70B fine-tune). The
    abort callback prints the aborting thread's last warning/error lines first. The same calls ggml_cuda_error
    makes (_core._test_abort: through the installed log callback, then ggml_abort) in a child interpreter
    that then aborts; an INFO line is not printed."""
    r = run_python("""
import llamabind._core as core
core._test_abort([(2, "an info line"), (4, "CUDA error: out of memory"),
                  (4, "  current device: 0, in function alloc at ggml-cuda.cu:440")], "CUDA error")
""")
    assert r.returncode != 0
    err = r.stderr
    assert "CUDA error: out of memory" in err and "current device: 0" in err, err
    assert err.index("out of memory") < err.index("ggml-cuda.cu:110: CUDA error"), err
    assert "an info line" not in err, err


def test_model_names_resolve_to_verified_files(model_path):
    assert models.resolve(models.DEFAULT) == model_path
    assert models.resolve(str(model_path)) == model_path
    src = models.KNOWN[models.DEFAULT]
    assert model_path.stat().st_size == src.size
    assert models._sha256(model_path) == src.sha256
    with pytest.raises(FileNotFoundError, match="known model name"):
        models.resolve("no-such-model")


def test_cache_dir_is_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMABIND_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        models.resolve(models.DEFAULT, download=False)


def test_model_facts(model):
    assert model.n_vocab == 49152 and model.n_ctx_train == 8192
    assert 130e6 < model.n_params < 140e6
    assert 0 < model.size < model.path.stat().st_size
    md = model.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.context_length"] == 8192
    assert len(md["tokenizer.ggml.tokens"]) == model.n_vocab
    assert model.chat_template() == md["tokenizer.chat_template"]


def _all_parsers() -> dict:
    """Every subcommand's argparse parser, rpc-server's included."""
    import argparse

    from llamabind import cli, rpc

    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {**{n: p for n, p in sub.choices.items() if n != "rpc-server"}, "rpc-server": rpc.parser()}


def test_one_vocabulary_across_the_subcommands():
    """Issue 59: a flag means one thing in every subcommand that has it (the same destination: -t was
    the temperature in generate/chat and the thread count in serve); every option says what it does;
    llama.cpp's spellings: -t/--threads, -c/--ctx-size, -n/--n-predict, --temp, --lora and
    --lora-scaled wherever a model is loaded, -m/--model everywhere a model is given."""
    import argparse

    parsers = _all_parsers()
    dests: dict[str, set] = {}
    for name, p in parsers.items():
        for act in p._actions:
            if not act.option_strings or isinstance(act, argparse._HelpAction) or act.help == argparse.SUPPRESS:
                continue
            assert act.help, f"{name} {act.option_strings[0]} has no help text"
            for opt in act.option_strings:
                dests.setdefault(opt, set()).add(act.dest)
    clashes = {opt: sorted(d) for opt, d in dests.items() if len(d) > 1}
    assert not clashes, clashes
    for name, p in parsers.items():  # a default said once: not "(default 1e-5) (default: 1e-05)"
        text = " ".join(p.format_help().split())
        assert not re.search(r"\(default [^)]*\) \(default:", text), (
            name,
            re.findall(r"\(default [^)]*\) \(default:[^)]*\)", text),
        )
        assert "(default: None)" not in text, name

    def dest(cmd, opt):
        return next(a.dest for a in parsers[cmd]._actions if opt in a.option_strings)

    for cmd in ("generate", "chat", "serve", "finetune", "eval", "fuse", "rpc-server"):
        assert dest(cmd, "-t") == "threads", cmd
    for cmd in ("generate", "chat", "serve", "finetune", "eval"):
        assert dest(cmd, "-c") == dest(cmd, "--ctx-size") == "n_ctx", cmd
        assert dest(cmd, "-m") == "model", cmd
    for cmd in ("generate", "chat", "serve", "eval"):
        assert dest(cmd, "--lora") == "lora" and dest(cmd, "--lora-scaled") == "lora_scaled", cmd
    for cmd in ("generate", "chat"):
        assert dest(cmd, "-n") == dest(cmd, "--n-predict") == dest(cmd, "--max-tokens") == "max_tokens"
        assert dest(cmd, "--temp") == "temperature" and dest(cmd, "--min-p") == "min_p"
    assert dest("chat", "--system-prompt") == "system" and dest("chat", "--chat-template-file")


def test_version_and_a_bare_command():
    """--version names the package, the pin and the patch count; a bare `python -m llamabind` lists the
    commands (it answered "the following arguments are required: cmd")."""
    from llamabind import build_info

    v = subprocess.run([sys.executable, "-m", "llamabind", "--version"], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stderr
    n = len(build_info()["patches"])
    assert v.stdout.startswith("llamabind ") and "b11312" in v.stdout and f"{n} patches" in v.stdout, v.stdout
    bare = subprocess.run([sys.executable, "-m", "llamabind"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0 and "generate" in bare.stdout and "finetune" in bare.stdout, bare.stdout + bare.stderr


def test_busy_core_note(monkeypatch):
    """The speed line's note (generate, chat, eval) appears only when other work keeps a core busy and the
    threads ask for the cores it holds, and never suggests the thread count a run already uses; busy_cores
    itself reads /proc/stat into a count within [0, cores]."""
    from llamabind.build import default_threads
    from llamabind.cli import run

    cores = default_threads()
    measured = run.busy_cores(0.05)
    if measured is not None:
        assert -0.01 <= measured <= (__import__("os").cpu_count() or 1) + 0.01
    monkeypatch.setattr(run, "busy_cores", lambda seconds=0.2: 0.0)
    assert run._busy_note(None) == ""
    monkeypatch.setattr(run, "busy_cores", lambda seconds=0.2: None)
    assert run._busy_note(None) == ""
    monkeypatch.setattr(run, "busy_cores", lambda seconds=0.2: 1.0)
    note = run._busy_note(None)
    assert f"1.0 of {cores} cores busy" in note and f"-t {max(1, cores - 1)}" in note
    assert run._busy_note(max(1, cores - 1)) == ""  # already leaves the busy core alone
    # issue 86 item 4: all but 0.4 of the cores busy: -t 1 said to a run of -t 2 or more, never to one of -t 1
    monkeypatch.setattr(run, "busy_cores", lambda seconds=0.2: cores - 0.4)
    assert run._busy_note(1) == ""
    if cores >= 2:
        assert "-t 1 may be faster" in run._busy_note(None)


def test_flags_are_spelled_whole(capsys):
    """Issue 86 item 2: ``-t 0`` and ``-t -1`` are all the cores, as llama.cpp's; argparse's prefix abbreviations
    are off (``serve --batch 4`` was taken as ``--batch-size 4``, ``finetune --lora-r 4`` as ``--lora-rank 4``): a
    flag spelled in part is an error naming it."""
    from llamabind import cli

    ap = cli.parser()
    assert ap.parse_args(["serve", "m.gguf", "--batch-size", "4"]).batch_size == 4
    for t, want in (("0", None), ("-1", None), ("3", 3)):  # llama.cpp's -t 0 / -1: all the cores
        assert ap.parse_args(["generate", "x", "-t", t]).threads == want
    partial = (["serve", "m.gguf", "--batch", "4"], ["finetune", "-m", "m", "--data", "d", "-o", "o", "--lora-r", "4"])
    for argv in partial:
        with pytest.raises(SystemExit) as e:
            ap.parse_args(argv)
        assert e.value.code == 2 and f"unrecognized arguments: {argv[-2]}" in capsys.readouterr().err


def test_ngl_auto_and_all_as_llama_cpp(capsys):
    """Issue 86 item 2: ``-ngl`` takes llama.cpp's ``auto`` and ``all`` (and ``--gpu-layers``): for the commands
    that load a Model every layer (its -1; Model has no memory fit), for ``serve`` llama-server's meanings (auto,
    -1: the layers that fit, passed as its default None; all: -2); below that an error naming the flag."""
    from llamabind import cli

    ap = cli.parser()
    for cmd in (
        ["generate", "x"],
        ["chat"],
        ["finetune", "-m", "m", "--data", "d", "-o", "o"],
        ["eval", "--data", "d"],
    ):
        for v, want in (("all", -1), ("auto", -1), ("-1", -1), ("0", 0), ("12", 12)):
            assert ap.parse_args([*cmd, "-ngl", v]).n_gpu_layers == want, (cmd, v)
        assert ap.parse_args([*cmd, "--gpu-layers", "3"]).n_gpu_layers == 3
    for v, want in (("auto", None), ("-1", None), ("all", -2), ("-2", -2), ("7", 7)):
        assert ap.parse_args(["serve", "m.gguf", "-ngl", v]).n_gpu_layers == want
    assert ap.parse_args(["serve", "m.gguf"]).n_gpu_layers is None
    for argv in (["generate", "x", "-ngl", "-2"], ["serve", "m.gguf", "-ngl", "-3"], ["chat", "-ngl", "most"]):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(argv)
        assert e.value.code == 2 and "-ngl" in capsys.readouterr().err


def test_llama_cpp_prompt_and_finetune_spellings(model_path, tmp_path, capsys):
    """Issue 86 item 2: generate takes llama-cli's ``--prompt`` and ``-f/--file`` (the same greedy text as the
    prompt given as the argument; two of them: an error line; ``-p`` stays rpc-server's port, one meaning a flag),
    ``--predict`` as ``-n``; finetune takes
    llama-finetune's ``-lr/--learning-rate``, ``-wd``, ``-epochs``, ``-opt`` and ``-val-split``."""
    from llamabind import cli

    base = ["generate", "--model", str(model_path), "-c", "256", "-t", "2", "--temp", "0", "--predict", "8"]
    (tmp_path / "p.txt").write_text("Once upon a time", encoding="utf-8")
    outs = []
    for form in (["Once upon a time"], ["--prompt", "Once upon a time"], ["-f", str(tmp_path / "p.txt")]):
        assert cli.main([*base, *form]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] and outs[1] == outs[2] == outs[0], outs
    assert cli.main([*base, "Once", "--prompt", "upon"]) == 2
    assert "give the prompt once" in capsys.readouterr().err
    f = cli.parser().parse_args(
        [
            "finetune",
            "--data",
            "d",
            "-o",
            "o",
            "-lr",
            "3e-4",
            "-wd",
            "0.1",
            "-epochs",
            "3",
            "-opt",
            "sgd",
            "-val-split",
            "0.2",
        ]
    )
    assert (f.lr, f.weight_decay, f.epochs, f.optimizer, f.val_split) == (3e-4, 0.1, 3, "sgd", 0.2)
    assert cli.parser().parse_args(["finetune", "--data", "d", "-o", "o", "--learning-rate", "2e-5"]).lr == 2e-5


def test_lora_and_rpc_take_comma_lists_as_llama_cpp():
    """Issue 86 item 2: ``--lora a.gguf,b.gguf`` and ``--rpc h1:1,h2:2`` are lists, as llama.cpp's, and repeat as
    before; ``--lora-scaled FILE:SCALE`` too, as llama.cpp's (a comma list, repeatable; the scale after the last
    colon), and the old two-argument spelling an error naming the format."""
    from llamabind import cli
    from llamabind.cli.common import lora_specs

    ap = cli.parser()
    a = ap.parse_args(
        ["generate", "x", "--lora", "a.gguf,b.gguf", "--lora", "c.gguf", "--lora-scaled", "d.gguf:0.5,C:\\e.gguf:2",
         "--lora-scaled", "f.gguf:-1"]
    )  # fmt: skip
    assert lora_specs(a) == [
        ("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 1.0), ("d.gguf", 0.5), ("C:\\e.gguf", 2.0), ("f.gguf", -1.0)
    ]  # fmt: skip
    for bad in (["d.gguf", "0.5"], ["d.gguf:x"], [":0.5"], [","]):
        with pytest.raises(SystemExit):
            ap.parse_args(["generate", "x", "--lora-scaled", *bad])
    assert ap.parse_args(["chat", "--rpc", "h1:50052,h2:50052", "--rpc", "h3:1"]).rpc == [
        "h1:50052",
        "h2:50052",
        "h3:1",
    ]
    assert ap.parse_args(["serve", "m.gguf", "--rpc", "h:1,"]).rpc == ["h:1"]
    assert ap.parse_args(["eval", "--data", "d", "--lora", "x.gguf"]).lora == ["x.gguf"]
    assert ap.parse_args(["generate", "x"]).rpc is None


def test_cli_n_predict_minus_one_and_two_as_llama_cpp(model_path, capsys):
    """Issue 86 item 2: ``-n -1`` (until the end) and ``-n -2`` (until the context is full) mean what they mean in
    llama-cli: here, without context shift, both run to EOS or the full context (256 tokens: the prompt's 4 and 252
    generated ones decoded, then a 253rd sampled: finish "length"); below -2 is an error line naming the flag."""
    from llamabind import cli

    base = ["generate", "Once upon a time", "--model", str(model_path), "-c", "256", "-t", "2", "--temp", "0"]
    for n in ("-1", "-2"):
        assert cli.main([*base, "-n", n]) == 0
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "finish: length" in last and "prompt: 4 tokens" in last and "generated: 253 tokens" in last, last
    assert cli.main([*base, "-n", "-3"]) == 2
    assert "-n/--n-predict must be >= 0, -1 (until the end) or -2" in capsys.readouterr().err


def test_flash_attn_and_batch_flags_as_llama_cpp(model_path, capsys):
    """Issue 86 item 2: generate and chat take llama-cli's ``-fa on|off|auto`` (and its truthy/falsy/auto
    spellings: 1/0/-1, enabled/disabled, true/false) and ``-b/-ub``, passed to the Model (its n_batch, n_ubatch,
    flash_attn, read back from Model.context_params); serve's -fa reads the same; a bad value is an error naming
    the flag."""
    from llamabind import cli
    from llamabind.cli import run

    ap = cli.parser()
    for text, want in (("on", "on"), ("1", "on"), ("enabled", "on"), ("off", "off"), ("false", "off"), ("-1", "auto")):
        assert ap.parse_args(["chat", "-fa", text]).flash_attn == want, text
        assert ap.parse_args(["serve", "m.gguf", "--flash-attn", text]).flash_attn == want, text
    a = ap.parse_args(["generate", "x"])
    assert (a.flash_attn, a.batch_size, a.ubatch_size) == ("auto", 2048, 512)  # llama.cpp's defaults
    with pytest.raises(SystemExit):
        ap.parse_args(["generate", "x", "-fa", "maybe"])
    assert "-fa" in capsys.readouterr().err
    a = ap.parse_args(["generate", "x", "-m", str(model_path), "-fa", "off", "-b", "256", "-ub", "128", "-c", "512"])
    with llamabind.Model(**run._model_kwargs(a), path=a.model) as m:
        p = m.context_params
    assert (p["flash_attn"], p["n_batch"], p["n_ubatch"]) == ("off", 256, 128), p


def test_an_unknown_flag_prints_its_subcommands_usage():
    """Issue 86 item 2: an unknown flag is an error with the subcommand's usage (argparse's top-level usage named
    none of its flags), and llama-server's sampling defaults given to serve (``serve --temp 0``) say where sampling
    goes instead; the ``0`` after --temp is not taken for the model (nothing is loaded: exit 2 at once)."""
    for argv, words in (
        (["generate", "--foo", "x"], ["usage: python -m llamabind generate", "unrecognized arguments: --foo"]),
        (["serve", "--temp", "0"], ["usage: python -m llamabind serve", "--temp: serve samples per request"]),
        (["finetune", "--data", "d", "-o", "o", "--bogus=1"], ["python -m llamabind finetune: error", "--bogus=1"]),
    ):
        r = subprocess.run([sys.executable, "-m", "llamabind", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and all(w in r.stderr for w in words), (argv, r.stderr)
        assert "Traceback" not in r.stderr and "no such" not in r.stderr, r.stderr
