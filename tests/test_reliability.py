"""Reliability: no crash on any input (GGUF fuzzing, property tests of the generation API), no leaks,
threads, interrupts. The longer fuzz run and the sanitizer run are in docs/reliability.md."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, VENDOR, run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memory import growth, malloc_trim, rss_kib, snapshot

import llamabind
from llamabind import ops

sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
import gguf_fuzz  # noqa: E402

CRASHES = ROOT / "tests" / "fuzz" / "crashes"


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "micro.gguf"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "make_model.py"), "--size", "micro", "--type", "q8_0", "-o", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


# ---- GGUF fuzzing


def test_fuzz_regressions_load_as_errors(tmp_path):
    """Every crashing input the fuzzer ever found is kept and must now be a clean ValueError."""
    cases = sorted(CRASHES.glob("*.gguf.gz"))
    assert cases
    paths = []
    for c in cases:
        p = tmp_path / c.name[:-3]
        p.write_bytes(gzip.decompress(c.read_bytes()))
        paths.append(str(p))
    r = run_python(
        f"""
import llamabind
for p in {paths!r}:
    try:
        m = llamabind.Model(p, vocab_only="-vocab-" in p, n_ctx=64)
        if not m.vocab_only:
            m.generate("Hi", max_tokens=2)
        print("loaded", p)
    except ValueError as e:
        print("ValueError", " / ".join(str(e).splitlines())[:600])
""",
        env=dict(os.environ, GGML_NO_BACKTRACE="1"),
    )
    assert r.returncode == 0, r.stderr[-1500:]
    assert r.stdout.count("ValueError") == len(paths), r.stdout
    assert "invalid vocabulary" in r.stdout  # patches/0008's message, not an abort


def test_duplicate_token_texts_are_an_error(tmp_path):
    """patches/0008: a vocabulary with the same token text twice (written by the gguf package)."""
    import gguf

    src = gguf.GGUFReader(VENDOR / "models" / "ggml-vocab-llama-spm.gguf")
    w = gguf.GGUFWriter(tmp_path / "dup.gguf", "llama")
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        value = f.contents()
        if name == "tokenizer.ggml.tokens":
            value = list(value)
            value[300] = value[301]  # two ids with the same text
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="invalid vocabulary"):
        llamabind.Model(tmp_path / "dup.gguf", vocab_only=True)


def test_fuzz_bounded_run(micro_model):
    """A bounded run of the GGUF fuzzer (full loads of a small llama and vocab-only loads of
    upstream's vocab GGUFs): no crash, no hang, no unexpected exception type."""
    n = int(os.environ.get("LLAMABIND_FUZZ_ITERATIONS", "600"))
    stats = gguf_fuzz.run(n, seed=12345, model=micro_model, keep=Path(os.environ.get("LLAMABIND_FUZZ_KEEP", "/tmp")))
    assert stats["tried"] == n
    assert stats["crash"] == 0 and stats["hang"] == 0 and stats["unexpected"] == 0, stats["crashes"]
    assert stats["error"] > n // 3 and stats["ok"] > 0  # the mutations do reach both outcomes


# ---- property tests of the generation API


GEN = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@GEN
@given(
    n_ctx=st.integers(-5, 300),
    n_batch=st.integers(-2, 600),
    n_ubatch=st.integers(-2, 600),
    n_threads=st.one_of(st.none(), st.integers(-1, 5)),
)
def test_context_parameters_never_crash(model, n_ctx, n_batch, n_ubatch, n_threads):
    try:
        with model.context(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=n_threads) as ctx:
            ctx.decode(model.tokenize("Hello"))
            assert ctx.n_past > 0
    except (ValueError, TypeError, llamabind.LlamaError):
        pass


@GEN
@given(
    tokens=st.lists(st.integers(-3, 49160), min_size=0, max_size=40),
    max_tokens=st.integers(-2, 40),
    temperature=st.one_of(st.floats(-1, 3), st.just(float("nan"))),
    top_k=st.integers(-2, 100),
    top_p=st.floats(-0.5, 1.5),
    seed=st.one_of(st.none(), st.integers(-5, 2**33)),
    stop=st.one_of(st.none(), st.text(max_size=3)),
)
def test_generate_parameters_never_crash(model, tokens, max_tokens, temperature, top_k, top_p, seed, stop):
    try:
        with model.context(n_ctx=64) as ctx:
            r = ctx.generate(
                tokens, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop
            )
            assert r.finish_reason in ("stop", "length")
    except (ValueError, TypeError, llamabind.LlamaError):
        pass


@GEN
@given(text=st.text(max_size=200), special=st.booleans(), ids=st.lists(st.integers(-10, 60000), max_size=20))
def test_tokenizer_never_crashes(model, text, special, ids):
    toks = model.tokenize(text, add_special=special, parse_special=special)
    assert all(0 <= t < model.n_vocab for t in toks)
    try:
        model.detokenize(ids)
    except ValueError:
        assert any(not 0 <= i < model.n_vocab for i in ids)


# ---- leaks

rss_meaningful = pytest.mark.skipif(
    os.environ.get("LLAMABIND_SANITIZED") == "1",
    reason="under ASan the quarantine keeps freed memory resident: RSS says nothing",
)


@rss_meaningful
def test_no_leak_over_load_generate_close_cycles(model_path):
    """200 load / generate / close cycles: heap in use and RSS (after malloc_trim) grow under 10 MB."""

    def cycle():
        with llamabind.Model(model_path, n_ctx=64, n_threads=1) as m:
            m.generate("Hi", max_tokens=2, temperature=0)

    for _ in range(10):
        cycle()
    malloc_trim()
    start = snapshot()
    for _ in range(200):
        cycle()
    before_trim = growth(start, snapshot())
    # After a full CUDA suite the [heap] mapping kept ~55 MB more resident pages over these cycles
    # with 0.0 MB more in use (H200): freed memory glibc had not returned, not a leak. So the test
    # measures what is in use (mallinfo2) and what stays resident once malloc_trim gives free pages
    # back; a real leak (malloc'ed or mapped, and kept) grows both.
    malloc_trim()
    g = growth(start, snapshot())
    msg = f"over 200 cycles: {g}; before malloc_trim: {before_trim}"
    assert g["heap_mb"] < 10, "heap in use grew " + msg
    assert g["rss_mb"] < 10, "RSS grew " + msg


@rss_meaningful
def test_no_leak_over_op_calls():
    """10,000 eager op calls (a few shapes, so graphs are cached and reused): RSS drift under 10 MB."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, n)).astype(np.float32) for n in (16, 32, 64)]
    for x in xs:
        ops.soft_max(ops.add(x, x))
    start = rss_kib()
    for i in range(5000):
        x = xs[i % 3]
        ops.soft_max(ops.add(x, x))
    drift = (rss_kib() - start) / 1024
    assert drift < 10, f"RSS grew by {drift:.1f} MB over 10,000 op calls"


# ---- threads


def test_four_threads_four_contexts_one_model(model):
    prompt = "The history of the printing press"
    want = model.generate(prompt, max_tokens=16, temperature=0).tokens
    results, errors = [None] * 4, []

    def work(i):
        try:
            with model.context(n_ctx=256, n_threads=1) as ctx:
                results[i] = ctx.generate(prompt, max_tokens=16, temperature=0).tokens
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert all(r == want for r in results), results


def _n_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(
    llamabind.build_info()["compile_flags"].get("GGML_OPENMP") != "ON" or not os.path.isdir("/proc/self/task"),
    reason="an OpenMP build on Linux",
)
def test_a_generation_leaves_no_openmp_team_behind(model):
    """Issue 20: a thread that decoded kept an OpenMP team of n_threads - 1 idle threads; with
    teams of other threads alive, libgomp stopped spinning and decodes on other threads ran 7x
    slower (bench/threads.py). When generate/generate_batch/embed return, the calling thread's
    team is freed: a live thread that generated leaves no extra threads in the process."""
    prompt = "The history of the printing press"
    want = model.generate(prompt, max_tokens=8, temperature=0).tokens
    ready, done, counts, results = threading.Event(), threading.Event(), [], []

    def work():
        try:
            with model.context(n_ctx=256, n_threads=3) as ctx:
                counts.append(_n_threads())
                results.append(ctx.generate(prompt, max_tokens=8, temperature=0).tokens)
                counts.append(_n_threads())  # the team is gone although this thread lives on
                results.append(model.generate_batch([prompt], max_tokens=8, temperature=0)[0].tokens)
                counts.append(_n_threads())
        finally:
            ready.set()
        done.wait(30)

    t = threading.Thread(target=work)
    t.start()
    ready.wait(60)
    try:
        assert results == [want, want]
        assert counts[1] == counts[0] and counts[2] == counts[0], counts
    finally:
        done.set()
        t.join()


# ---- interrupts


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_during_a_long_op_and_ops_still_work():
    """SIGINT while a graph computes (GIL released): KeyboardInterrupt once the graph returns."""
    a = np.random.default_rng(0).standard_normal((1536, 1536)).astype(np.float32)
    ops.mul_mat(a, a)  # compile and warm up
    timer = threading.Timer(0.05, lambda: signal.raise_signal(signal.SIGINT))
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(200):  # far longer than the timer
            ops.mul_mat(a, a)
    timer.join()
    assert time.perf_counter() - t0 < 60
    np.testing.assert_allclose(ops.mul_mat(a[:4, :4], a[:4, :4]), a[:4, :4] @ a[:4, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_id,name", [(26, "i32"), (2, "q4_0"), (24, "i8")])
def test_weight_types_are_checked(micro_model, tmp_path, type_id, name):
    """patches/0009 + 0010: a norm weight declared int32/int8 or quantized used to load and then
    abort in ggml-cpu's binary_op at the first decode; now the load fails with ValueError."""
    data = bytearray(micro_model.read_bytes())
    lay = gguf_fuzz.parse(bytes(data))
    names = []
    for t in lay.tensors:
        n = int.from_bytes(data[t["name_len"] : t["name_len"] + 8], "little")
        names.append(bytes(data[t["name_len"] + 8 : t["name_len"] + 8 + n]).decode())
    t = lay.tensors[names.index("blk.0.attn_norm.weight")]  # 64 float32 values: 256 bytes of data
    data[t["type"] : t["type"] + 4] = type_id.to_bytes(4, "little")  # i32/i8/q4_0 fit in those bytes
    p = tmp_path / f"norm-{name}.gguf"
    p.write_bytes(bytes(data))
    r = run_python(
        f"""
import llamabind
try:
    m = llamabind.Model({str(p)!r}, n_ctx=64)
    m.generate("Hi", max_tokens=2)
    print("generated")
except ValueError as e:
    print("ValueError", " / ".join(str(e).splitlines())[:300])
""",
        env=dict(os.environ, GGML_NO_BACKTRACE="1"),
    )
    assert r.returncode == 0, r.stderr[-800:]
    assert r.stdout.startswith("ValueError"), r.stdout
