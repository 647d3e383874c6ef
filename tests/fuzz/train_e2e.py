"""Issue 60: hypothesis over ``train.finetune`` and ``train.Trainer`` end to end, run in a subprocess by
tests/test_train_fuzz.py (a native abort or segfault ends the process: the test sees the exit status, and the
last case printed is the one that killed it).

    python tests/fuzz/train_e2e.py MODEL.gguf EXAMPLES

finetune: data (text of a few to thousands of characters, token ids in and out of range, too few of them),
valid (none, or the same kinds), and up to three settings drawn from pairs that are mostly valid and
sometimes not (ctx_size 0 or 2**20, batch_size 10**6, lr nan, lora_rank 300, unknown optimizer, ...), with
and without a checkpoint_dir saved every step. Trainer: windows and labels of other shapes, dtypes and token
ranges, stepped and evaluated. Each case either runs or raises TypeError / ValueError / LlamaError with a
message; anything else fails the run. Prints each case and its outcome, then "FUZZ DONE"."""

import sys
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamabind
from llamabind import train

MODEL = llamabind.Model(sys.argv[1], repack=False, n_threads=2, use_mmap=False)
N_VOCAB = MODEL.n_vocab
OK_ERRORS = (TypeError, ValueError, llamabind.LlamaError)
WORDS = st.text(alphabet=st.sampled_from("ab cdé\n.\u4e2d\U0001f600\x00"), max_size=4000)
TOKENS = st.lists(st.integers(-3, N_VOCAB + 3), max_size=1200)
PAIRS = [  # (setting, value): most valid, some not
    ("ctx_size", 256),
    ("ctx_size", 512),
    ("ctx_size", 0),
    ("ctx_size", 300),
    ("ctx_size", 2**20),
    ("batch_size", 2),
    ("batch_size", 3),
    ("batch_size", 0),
    ("batch_size", 10**6),
    ("batch_size", 1.5),
    ("grad_accum", 2),
    ("grad_accum", 0),
    ("grad_accum", 10**4),
    ("iters", 2),
    ("iters", 0),
    ("iters", -1),
    ("epochs", 1),
    ("epochs", 2),
    ("epochs", 0),
    ("epochs", float("inf")),
    ("lr", 1e-2),
    ("lr", 0.0),
    ("lr", float("nan")),
    ("lr", 10.0),
    ("lr", float("inf")),
    ("lora_rank", 1),
    ("lora_rank", 300),
    ("lora_rank", 0),
    ("lora_rank", None),
    ("lora_alpha", 0.5),
    ("lora_alpha", -1.0),
    ("lora_alpha", float("nan")),
    ("lora_targets", ["attn_q", "ffn_up", "output"]),
    ("lora_targets", []),
    ("lora_targets", ["nope"]),
    ("val_split", 0.0),
    ("val_split", 0.5),
    ("val_split", 1.0),
    ("val_split", -0.1),
    ("train_embeddings", True),
    ("steps_per_eval", 1),
    ("steps_per_eval", 0),
    ("precision", "f32"),
    ("precision", "fp8"),
    ("flash_attn", "on"),
    ("flash_attn", "off"),
    ("flash_attn", 2),
    ("optimizer", "sgd"),
    ("optimizer", "lion"),
    ("loss_chunk_tokens", 1),
    ("loss_chunk_tokens", 0),
    ("loss_chunk_tokens", -1),
    ("weight_decay", 0.1),
    ("weight_decay", 2.0),
    ("lr_schedule", "cosine"),
    ("lr_schedule", "linear"),
    ("lr_schedule", "step"),
    ("warmup", 1),
    ("warmup", 10**6),
    ("warmup", -1),
    ("shuffle", False),
    ("seed", 7),
    ("seed", -1),
]
SETTINGS = st.lists(st.sampled_from(PAIRS), max_size=3).map(dict)
LONG = st.tuples(st.sampled_from(["The fox. ", "é中 😀 x\n", "a"]), st.integers(100, 1500)).map(lambda t: t[0] * t[1])
IDS = st.tuples(st.integers(-1, N_VOCAB), st.integers(300, 2000)).map(
    lambda t: (
        [int(x) for x in np.random.default_rng(t[1]).integers(0, N_VOCAB, t[1])] + ([t[0]] if t[0] % 7 == 0 else [])
    )
)
DATA = st.one_of(LONG, LONG, LONG, IDS, IDS, WORDS, TOKENS)


# every case drawn the same way in each run (no example database), as many as the command line asks
CASES = settings(
    max_examples=int(sys.argv[2]),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


def outcome(fn):
    try:
        fn()
        return "ok"
    except OK_ERRORS as e:
        assert str(e).strip(), f"an empty message: {type(e).__name__}"
        return f"{type(e).__name__}: {str(e)[:150]}"


@CASES
@given(DATA, st.one_of(st.none(), st.none(), st.none(), DATA), SETTINGS, st.booleans())
def test_finetune(data, valid, kw, with_ckpt):
    kw = {"lora_rank": 4, **kw}
    if "epochs" not in kw:
        kw.setdefault("iters", 1)
    if isinstance(kw.get("iters"), int) and kw["iters"] > 3:
        kw["iters"] = 3  # a case is about the arguments, not a long run
    if kw.get("epochs") is not None and isinstance(kw["epochs"], int) and kw["epochs"] > 2:
        kw["epochs"] = 2
    if with_ckpt:
        kw["checkpoint_dir"] = tempfile.mkdtemp()
        kw["save_every"] = 1
    print("finetune", repr(data)[:80], repr(valid)[:40], kw, flush=True)
    r = outcome(lambda: train.finetune(MODEL, data, valid=valid, progress=False, n_threads=2, **kw))
    print("  ->", r, flush=True)


WINDOWS = st.tuples(
    st.sampled_from([(1, 257), (2, 257), (3, 257), (0, 257), (1, 256), (1, 513), (1, 0), (257,), (1, 1, 257)]),
    st.sampled_from(["int32", "int32", "int64", "float32", "uint8"]),
    st.sampled_from([N_VOCAB, N_VOCAB, N_VOCAB + 3, 1, -2]),
)


@CASES
@given(WINDOWS, st.one_of(st.none(), st.just("same"), st.just("short")), st.sampled_from(["lora", "evaluate"]))
def test_trainer(win, labels, what):
    (shape, dtype, hi) = win
    w = np.random.default_rng(0).integers(min(hi, 0), max(hi, 1), size=shape).astype(dtype)
    lab = None if labels is None else (w.copy() if labels == "same" else w[..., :-1].copy())
    print("trainer", shape, dtype, hi, labels, what, flush=True)

    def run():
        t = train.Trainer(MODEL, params="lora", adapter=ADAPTER, n_threads=2, ctx_size=256)
        try:
            (t.evaluate if what == "evaluate" else t.step)(w, lab)
        finally:
            t.close()

    print("  ->", outcome(run), flush=True)


d = tempfile.mkdtemp()
train.lora_init(MODEL, d + "/z.gguf", 2, 4.0, ["attn_q"])
ADAPTER = MODEL.load_lora(d + "/z.gguf")
test_trainer()
test_finetune()
print("FUZZ DONE", flush=True)
