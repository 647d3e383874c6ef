"""Checkpoints and resume (train.finetune's checkpoint_dir / save_every / resume, patch 0028, and
`python -m llamabind finetune --save-every --resume`): a run stopped by Ctrl-C after 2 of 4 steps
and resumed ends at the weights of the uninterrupted run, LoRA and full, on a random-weight llama of
bench/make_model.py's tiny shape (F32). A resume that drops AdamW's state lands elsewhere (the test
can fail)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import gguf_tensors
import numpy as np
import pytest

import llamabind
from llamabind import train

ROOT = Path(__file__).resolve().parent.parent
KW = dict(ctx_size=256, iters=4, lr=1e-3, batch_size=2, lr_schedule="cosine", warmup=1, weight_decay=0.01,
          progress=False, n_threads=2)  # fmt: skip


@pytest.fixture(scope="module")
def text(vendor_dir):
    return (vendor_dir / "docs" / "build.md").read_text(encoding="utf-8")


def _tensors(path) -> dict[str, np.ndarray]:
    return {n: np.asarray(t.data, dtype=np.float64) for n, t in gguf_tensors.read(path).items()}


def _stop_at(n):
    def on_step(step, loss):
        if step == n:
            raise KeyboardInterrupt

    return on_step


def _run(kind, model_path, text, out, **kw):
    """finetune with KW; the trained adapter (lora) or model (full) written to out; the result. The
    LoRA runs hold out a validation split (a resume validates where the run did), the full runs none:
    the validation is the same code for both, and costs a tiny model's run more than its steps."""
    lora = dict(lora_rank=4) if kind == "lora" else dict(val_split=0)
    mkw = dict(repack=False) if kind == "lora" else dict(use_mmap=False)
    with llamabind.Model(model_path, **mkw) as m, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        r = train.finetune(m, text, **{**KW, **lora, **kw})
        if out is not None:
            (r.adapter if kind == "lora" else m).save(out)
    return r


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_resume_equals_an_uninterrupted_run(kind, tiny_f32, text, tmp_path):
    whole = _run(kind, tiny_f32, text, tmp_path / "whole.gguf")
    assert whole.steps == 4
    stopped = _run(kind, tiny_f32, text, None, checkpoint_dir=tmp_path / "ck", on_step=_stop_at(2))
    assert stopped.interrupted and stopped.steps == 2  # Ctrl-C left a checkpoint of its 2 steps
    ckpt = tmp_path / "ck" / "step-0000002"
    assert stopped.checkpoints == [ckpt]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 2 and state["iter"] == 3
    assert len(state["params"]) == (8 if kind == "lora" else 21)  # 2 layers x 9, output, output_norm, token_embd

    # a copy whose AdamW state is dropped (moments 0, step counter 1): a resume from weights alone
    fresh = tmp_path / "fresh"
    shutil.copytree(ckpt, fresh)
    with np.load(fresh / "optimizer.npz") as z:
        np.savez(fresh / "optimizer.npz", **{k: np.zeros_like(z[k]) for k in z.files})
    (fresh / "state.json").write_text(json.dumps(dict(state, iter=1)))

    def resume(src, out):
        model = train.latest_checkpoint(src) / "model.gguf" if kind == "full" else tiny_f32
        return _run(kind, model, text, out, resume=src)

    resumed = resume(tmp_path / "ck", tmp_path / "resumed.gguf")  # the directory: its newest checkpoint
    assert resumed.steps == 4
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-6)
    resume(fresh, tmp_path / "fresh.gguf")

    a, b, c = (_tensors(tmp_path / f) for f in ("whole.gguf", "resumed.gguf", "fresh.gguf"))
    start = _tensors(ckpt / ("model.gguf" if kind == "full" else "adapter.gguf"))
    trained = [n for n in a if not np.array_equal(a[n], start[n])]
    assert len(trained) == len(state["params"])
    for n in trained:
        moved = np.abs(a[n] - start[n]).max()
        assert np.abs(b[n] - a[n]).max() <= 1e-6 * moved + 1e-9, n
    off = max(np.abs(c[n] - a[n]).max() / np.abs(a[n] - start[n]).max() for n in trained)
    assert off > 0.05, off  # without the optimizer state the last 2 steps go elsewhere


def test_save_every_and_a_run_extended_by_resume(tiny_f32, text, tmp_path):
    """save_every writes step-N every N steps and at the end; resuming with more iters continues
    (the schedule spans the new total). Without a validation split (val_split=0) here and below:
    test_resume_equals_an_uninterrupted_run resumes runs that validate."""
    r = _run("lora", tiny_f32, text, None, val_split=0, checkpoint_dir=tmp_path / "ck", save_every=3, iters=4)
    assert [p.name for p in r.checkpoints] == ["step-0000003", "step-0000004"]
    more = _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", iters=6)
    assert more.steps == 6 and len(more.losses) == 6 and more.losses[:4] == r.losses


def test_a_different_run_is_refused(tiny_f32, text, tmp_path):
    _run("lora", tiny_f32, text, None, val_split=0, checkpoint_dir=tmp_path / "ck", iters=1)
    with pytest.raises(ValueError, match=r"batch_size 2 there, 1 now"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", batch_size=1)
    with pytest.raises(ValueError, match=r"lora .*rank"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", lora_rank=8)
    with pytest.raises(ValueError, match=r"kind 'lora' there, 'full' now"):
        _run("full", tiny_f32, text, None, resume=tmp_path / "ck")
    with pytest.raises(ValueError, match="save_every needs a checkpoint_dir"):
        _run("lora", tiny_f32, text, None, val_split=0, save_every=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path)
    (tmp_path / "ck" / "step-0000001" / "optimizer.npz").unlink()
    with pytest.raises(ValueError, match="incomplete: no optimizer.npz"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck")
    _run("full", tiny_f32, text, None, checkpoint_dir=tmp_path / "full", iters=1)
    with pytest.raises(ValueError, match="load the model from the checkpoint"):
        _run("full", tiny_f32, text, None, resume=tmp_path / "full")  # the base, not model.gguf


def test_optimizer_state_is_checked(tiny_f32, text):
    with llamabind.Model(tiny_f32, repack=False) as m:
        ad = m.load_lora(_lora(m))
        with train.Trainer(m, lr=1e-3, params="lora", adapter=ad) as ctx:
            with pytest.raises(ValueError, match="first opt_step"):
                ctx.state()
            win = np.array([m.tokenize(text, add_special=True)[:257]])
            ctx.step(win)
            it, params = ctx.state()
            assert it == 2 and len(params) == 8 and all(m.dtype == np.float32 for _, m, _ in params)
            assert any(np.abs(mm).max() > 0 for _, mm, _ in params)
            with pytest.raises(ValueError, match=re.escape(f"the state has no moments for '{params[7][0]}'")):
                ctx.set_state(it, params[:7])
            with pytest.raises(ValueError, match="holds 9 parameters; this optimizer has 8"):
                ctx.set_state(it, [*params, ("extra", params[0][1], params[0][2])])
            with pytest.raises(ValueError, match="have 3 values"):
                ctx.set_state(it, [(params[0][0], np.zeros(3), np.zeros(3))] + params[1:])
            with pytest.raises(ValueError, match="iter must be >= 1"):
                ctx.set_state(0, params)
            before = ctx.state()[1][0][1].copy()
            ctx.set_state(5, [(n, 2 * mm, vv) for n, mm, vv in params])
            it2, p2 = ctx.state()
            assert it2 == 5 and np.array_equal(p2[0][1], 2 * before)


def _lora(m) -> str:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "init.gguf"
    train.lora_init(m, path, 4, 8.0, ("attn_q", "attn_v"), 0)
    return str(path)


def test_cli_save_every_and_resume(tiny_f32, text, tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text(text, encoding="utf-8")
    cmd = [sys.executable, "-m", "llamabind", "finetune", "-m", str(tiny_f32), "--data", str(data),
           "--lora-rank", "4", "--lr", "1e-3", "--no-progress", "-o", str(tmp_path / "a.gguf")]  # fmt: skip
    subprocess.run([*cmd, "--iters", "2", "--save-every", "1"], check=True, capture_output=True, text=True)
    ck = tmp_path / "a-checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-0000001", "step-0000002"]
    r = subprocess.run([*cmd, "--iters", "3", "--resume", str(ck)], check=True, capture_output=True, text=True)
    assert "resuming from" in r.stderr and "step-0000002" in r.stderr
    assert json.loads((ck / "step-0000003" / "state.json").read_text())["step"] == 3
    with llamabind.Model(tiny_f32) as m:
        m.load_lora(tmp_path / "a.gguf")


def test_the_tensor_reader_agrees_with_gguf(tiny_q8, tiny_f32):
    """tests/gguf_tensors.py (the fast reader _tensors uses) gives gguf.GGUFReader's names, types and
    bytes, for an F32 and a Q8_0 file."""
    for path in (tiny_f32, tiny_q8):
        fast = gguf_tensors.read(path)
        ref = gguf.GGUFReader(path).tensors
        assert list(fast) == [t.name for t in ref]
        for t in ref:
            f = fast[t.name]
            assert f.type == t.tensor_type and f.shape == tuple(int(n) for n in reversed(t.shape)), t.name
            assert np.asarray(f.data).tobytes() == np.asarray(t.data).tobytes(), t.name


def test_a_resume_with_nothing_left_or_a_bogus_position_is_refused(tiny_f32, text, tmp_path):
    """Issue 60: resuming a checkpoint at step 2 with iters=2 would train nothing and return: refused,
    naming the step; a truncated optimizer.npz is a ValueError naming it (numpy's BadZipFile before); a
    state.json whose step is 10**9 (beyond its run's total, its losses) is refused when it is read,
    before any training."""
    _run("lora", tiny_f32, text, None, val_split=0, checkpoint_dir=tmp_path / "ck", iters=2)
    with pytest.raises(ValueError, match="at step 2; this run has 2 steps"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", iters=2)
    npz = tmp_path / "ck" / "step-0000002" / "optimizer.npz"
    whole = npz.read_bytes()
    npz.write_bytes(whole[: len(whole) // 2])  # truncated: BadZipFile from numpy before
    with pytest.raises(ValueError, match="optimizer.npz: not the optimizer state of this checkpoint"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", iters=4)
    npz.write_bytes(whole)
    state_path = tmp_path / "ck" / "step-0000002" / "state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "step": 10**9}))
    with pytest.raises(ValueError, match="not a checkpoint's position"):
        _run("lora", tiny_f32, text, None, val_split=0, resume=tmp_path / "ck", iters=10)
