"""Data-parallel fine-tuning (issue 87): the gradients of each step reduced between ggml-opt's backward pass and
its step (patch 0102: ggml_opt_params.grad_reduce, ``Optimizer(grad_reduce=)``), and finetune as ranks of a
torchrun-style launch averaging them over gloo (torch.distributed from the reference venv: llamabind needs torch
only under a launch)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import GPU_BUILD, ROOT

import llamabind
from llamabind.context import Context
from llamabind.optimizer import Optimizer

gguf = pytest.importorskip("gguf")


def _weights(path: Path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(str(path))
    return {t.name: np.array(t.data, dtype=np.float64).reshape(-1) for t in r.tensors}


def _sgd_steps(tiny_f32, out: Path, windows, grad_reduce=None, lr=1e-2, steps=2, **opt) -> dict[str, np.ndarray]:
    """Weights after ``steps`` SGD evals over ``windows`` (a micro-batch of 2; Optimizer's ``opt``), one thread
    (saved to ``out``)."""
    with llamabind.Model(tiny_f32, use_mmap=False, n_threads=1) as m:
        ctx = Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=2, n_threads=1, training=True)
        try:
            optimizer = Optimizer(ctx, "sgd", lr, 0.0, grad_reduce=grad_reduce, **opt)
            for _ in range(steps):
                optimizer.eval(windows, True)
        finally:
            ctx.close()
        m.save(out)
    return _weights(out)


@pytest.fixture(scope="module")
def windows():
    return np.random.default_rng(0).integers(0, 49152, (2, 257)).astype(np.int32)


def test_grad_reduce_changes_the_step(tiny_f32, windows, tmp_path):
    """What grad_reduce leaves in the gradients is what the step takes: left as they are, the steps of the split
    graphs (the gradient graph, then the step's own) equal ggml-opt's one graph bit for bit; doubled, SGD's steps
    of twice the learning rate (bit for bit: x2 is exact); zeroed, no step at all. It sees every trained tensor's
    gradient once per step: float32 1-D DLPack arrays over the accumulators' own memory (numpy views of it on the
    CPU: what they write is what the step reads), here one array over all of them (ggml-opt allocates them one
    after the other in its static buffer: a reduction takes them whole, with no copy), whose size is the trained
    parameters' count plus the padding between two accumulators (each under the CPU buffer's 32-byte alignment: at
    most 7 floats a tensor)."""
    seen = []

    def double(grads):
        arrays = [np.from_dlpack(g) for g in grads]
        seen.append([(a.dtype, a.ndim) for a in arrays] + [sum(a.size for a in arrays)])
        for a in arrays:
            a *= 2

    twice = _sgd_steps(tiny_f32, tmp_path / "a.gguf", windows, double)
    lr2 = _sgd_steps(tiny_f32, tmp_path / "b.gguf", windows, lr=2e-2)
    start = _weights(tiny_f32)
    assert lr2.keys() == twice.keys() == start.keys()
    same = _sgd_steps(tiny_f32, tmp_path / "d.gguf", windows, lambda g: None, lr=2e-2)
    for name, w in lr2.items():
        assert np.array_equal(w, twice[name]), name
        assert np.array_equal(w, same[name]), name
        assert not np.array_equal(w, start[name]), name  # every weight trained
    with llamabind.Model(tiny_f32, use_mmap=False) as m:
        n_params = m.n_params
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 2, seen
    assert n_params <= seen[0][-1] <= n_params + 7 * len(start), (seen, n_params)
    assert seen[0][0] == (np.dtype(np.float32), 1)

    def zero(grads):
        for g in grads:
            np.from_dlpack(g).fill(0)

    for name, w in _sgd_steps(tiny_f32, tmp_path / "c.gguf", windows, zero).items():
        assert np.array_equal(w, start[name]), name


@pytest.mark.parametrize("opt", [{}, {"recompute": True}, {"grad_accum": 2}], ids=["plain", "checkpointing", "accum"])
def test_gradient_buckets_are_handed_over_during_the_backward_pass(tiny_f32, windows, tmp_path, opt):
    """Patch 0104: a grad_reduce with ``ready`` and ``bucket_bytes`` (train.distributed.GradientReducer's protocol)
    gets each bucket of about bucket_bytes of gradients from the step's backward pass as soon as the nodes that write
    it have run (``ready``), in the order the backward pass finishes them, then the rest in the call at the end: the
    buckets and the rest are disjoint and together every trained tensor's gradient (the trained parameters' count,
    plus padding under the CPU buffer's alignment); each bucket's arrays are final when handed over (ggml writes
    them no more: doubled there and in the rest, the steps are those of twice the learning rate, bit for bit); a
    bucket of 0 bytes, or a grad_reduce without ``ready``, hands everything over at the end (the other test). The
    same with gradient checkpointing (the backward pass's recomputed nodes) and with two micro-batches a step
    (buckets from the last one's backward pass only: the first one's gradients are not final)."""

    class Doubler:
        def __init__(self, bucket_bytes):
            self.bucket_bytes, self.calls = bucket_bytes, []

        def ready(self, grads):
            self.calls.append(("ready", self._double(grads)))

        def __call__(self, grads):
            self.calls.append(("end", self._double(grads)))

        @staticmethod
        def _double(grads):
            arrays = [np.from_dlpack(g) for g in grads]
            for a in arrays:
                a *= 2
            return sum(a.size for a in arrays), [a.ctypes.data for a in arrays]

    with llamabind.Model(tiny_f32, use_mmap=False) as m:
        n_params, n_tensors = m.n_params, len(m.tensor_info())
    steps = 2 * opt.get("grad_accum", 1)  # two optimizer steps
    lr2 = _sgd_steps(tiny_f32, tmp_path / "lr2.gguf", windows, lr=2e-2, steps=steps, **opt)
    for bucket_bytes, at_least in ((64 << 10, 3), (1, 10)) if not opt else ((1, 10),):
        d = Doubler(bucket_bytes)
        twice = _sgd_steps(tiny_f32, tmp_path / f"b{bucket_bytes}.gguf", windows, d, steps=steps, **opt)
        for name, w in lr2.items():
            assert np.array_equal(w, twice[name]), (bucket_bytes, name)
        ends = [i for i, (kind, _) in enumerate(d.calls) if kind == "end"]
        assert len(ends) == 2 and ends[1] == len(d.calls) - 1, d.calls  # a call at the end of each of the 2 steps
        step = d.calls[: ends[0] + 1]
        assert len(step) - 1 >= at_least, (bucket_bytes, len(step))
        assert n_params <= sum(n for _, (n, _) in step) <= n_params + 7 * n_tensors
        starts = [p for _, (_, ps) in step for p in ps]
        assert len(set(starts)) == len(starts)  # disjoint
        assert [c[0] for c in d.calls[ends[0] + 1 :]] == [c[0] for c in step]  # the same buckets each step


def test_a_reduction_that_fails_takes_no_step(tiny_f32, windows, tmp_path):
    """A grad_reduce that raises: the eval raises RuntimeError with its message, no step is taken (the weights and
    ggml-opt's step counter unchanged), and every later step refuses too (the ranks would have parted)."""

    def broken(g):
        raise ConnectionError("rank 1 is gone")

    with llamabind.Model(tiny_f32, use_mmap=False, n_threads=1) as m:
        ctx = Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=2, n_threads=1, training=True)
        try:
            opt = Optimizer(ctx, "adamw", 1e-3, 0.0, grad_reduce=broken)
            for _ in range(2):
                with pytest.raises(RuntimeError, match="grad_reduce.*rank 1 is gone"):
                    opt.eval(windows, True)
            assert opt.state()[0] == 1  # AdamW's iter: no step taken
        finally:
            ctx.close()
        m.save(tmp_path / "after.gguf")
    before = _weights(tiny_f32)
    for name, w in _weights(tmp_path / "after.gguf").items():
        assert np.array_equal(w, before[name]), name
    with llamabind.Model(tiny_f32, use_mmap=False) as m:
        ctx = Context(m, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=2, training=True)
        try:
            with pytest.raises(TypeError, match="grad_reduce must be callable"):
                Optimizer(ctx, "sgd", 1e-3, 0.0, grad_reduce=3)
        finally:
            ctx.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_path(reference_python: Path) -> str:
    """PYTHONPATH for a rank: the reference venv's site-packages (torch for torch.distributed's gloo) before this
    process's PYTHONPATH (the GPU machine finds its llamabind build there)."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    path = subprocess.run([str(reference_python), "-c", code], capture_output=True, text=True, check=True).stdout
    return os.pathsep.join(p for p in (path.strip(), os.environ.get("PYTHONPATH")) if p)


def _launch(
    job: dict, work: Path, world: int, torch_path: str, timeout: float = 600, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """job run by tests/ddp_rank.py as ``world`` ranks (torchrun's environment), or as one process (world 0); ``env``:
    more environment variables for every process."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(dict(job, out=str(work))))
    env = dict(os.environ, PYTHONPATH=torch_path, OMP_NUM_THREADS="1", **(env or {}))
    port = _port()
    procs = []
    for rank in range(max(world, 1)):
        e = dict(env)
        if world:
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "ddp_rank.py"), str(work / "job.json")],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    return [subprocess.CompletedProcess(p.args, p.wait(timeout), *p.communicate()) for p in procs]


def _same_run(one: Path, two: Path, w0: dict, rtol: float = 1e-6, of_step: float = 1e-5) -> None:
    """The results and weights of two runs that took the same steps: losses within rtol, each weight within 2 F32
    ulps plus of_step of the largest step's size (see the tests below for the tolerances)."""
    r1 = json.loads((one / "result-0.json").read_text())
    r2 = json.loads((two / "result-0.json").read_text())
    assert r1["steps"] == r2["steps"] == 3
    np.testing.assert_allclose(r2["losses"], r1["losses"], rtol=rtol)
    np.testing.assert_allclose([r2["val_before"], *r2["val"]], [r1["val_before"], *r1["val"]], rtol=rtol)
    w1, w2 = _weights(one / "model.gguf"), _weights(two / "model.gguf")
    gaps = {n: float(np.abs(w2[n] - w1[n]).max() / np.abs(w1[n] - w0[n]).max()) for n in w1}
    print("largest weight gap / largest step:", max(gaps.items(), key=lambda x: x[1]))
    for name in w1:
        step = np.abs(w1[name] - w0[name]).max()
        ulp = np.spacing(np.abs(w1[name]).astype(np.float32)).astype(np.float64)
        assert (np.abs(w2[name] - w1[name]) <= 2 * ulp + of_step * step).all(), name


def _loss_gap(one: Path, two: Path) -> float:
    """The largest relative difference of two runs' training losses."""
    r1, r2 = (np.array(json.loads((d / "result-0.json").read_text())["losses"]) for d in (one, two))
    return float(np.max(np.abs(r2 - r1) / np.abs(r1)))


def test_two_ranks_train_as_one_with_the_global_batch(tiny_f32, reference_python, tmp_path):
    """2 ranks x batch_size 2 (gloo) against 1 process x batch_size 4 in two micro-batches (grad_accum 2): the
    same windows each step (rank r takes the global batch's rows r::2, as DistributedSampler), the same loss
    curve, validation losses (each rank half of the 3 held-out windows, the sums all-reduced) and weights after 3
    SGD steps. The two differ only in the order of F32 sums (a micro-batch's windows, then the mean over 2
    micro-batches scaled before or after adding): losses within 1e-6 relative; each weight within 2 F32 ulps of
    its own value (a gradient a rounding apart moves the F32 sum w - lr g to the neighbouring float: measured 1 ulp,
    3.7e-9 at 0.03) plus 1e-5 of the largest step's size (the gradients' roundings, ~1e-7 relative, over 3
    steps). Every rank returns the global numbers; rank 0 alone writes the log and the checkpoint. The ranks
    all-reduce buckets of 64 KiB while their backward passes run (ddp_bucket_cap_mb, patch 0104: asynchronous gloo
    all-reduces of the accumulators' own memory, beside ggml's threads)."""
    tokens = np.random.default_rng(1).integers(0, 49152, 128 * 16 + 1).tolist()
    args = dict(ctx_size=256, iters=3, lr=1e-2, optimizer="sgd", val_split=0.2, n_threads=1, progress=False, seed=3)
    job = dict(model=str(tiny_f32), tokens=tokens)
    torch_path = _torch_path(reference_python)
    one = _launch(dict(job, args=dict(args, batch_size=4, grad_accum=2)), tmp_path / "one", 0, torch_path)
    ckpt = dict(checkpoint_dir=str(tmp_path / "two" / "ckpt"), save_every=3, log=str(tmp_path / "two" / "log.jsonl"))
    # buckets of 64 KiB: most of the gradients all-reduced by gloo while the backward pass runs (patch 0104)
    two = _launch(dict(job, args=dict(args, batch_size=2, ddp_bucket_cap_mb=1 / 16, **ckpt)), tmp_path / "two", 2,
                  torch_path)  # fmt: skip
    for p in one + two:
        assert p.returncode == 0, p.stderr[-3000:]
    r2 = [json.loads((tmp_path / "two" / f"result-{k}.json").read_text()) for k in (0, 1)]
    assert r2[0]["checkpoints"] == 1 and r2[1]["checkpoints"] == 0  # rank 0 writes the checkpoint and the log
    assert len((tmp_path / "two" / "log.jsonl").read_text().splitlines()) == 3 + 1  # the steps, the last validation
    assert {k: v for k, v in r2[0].items() if k != "checkpoints"} == {
        k: v for k, v in r2[1].items() if k != "checkpoints"
    }
    _same_run(tmp_path / "one", tmp_path / "two", _weights(tiny_f32))


def test_two_ranks_preference_tune_as_one_with_the_global_batch(tiny_f32, reference_python, tmp_path):
    """train.preference under a launch: DPO and ORPO, 2 ranks x batch_size 2 pairs (gloo) against 1 process x 4
    pairs in two micro-batches (grad_accum 2): rank r takes the step's pairs r::2, the gradients are averaged over
    the ranks, each step's metrics are those of all 4 pairs (the ranks' log-probabilities all-reduced), and the
    held-out metrics, losses and weights after 3 SGD steps are the one process's (tolerances as the SFT test's:
    F32 sums in another order; ORPO's pairs with chosen windows of one length, see below). Rank 0 alone writes the
    checkpoint."""
    rng = np.random.default_rng(5)

    def ids(n):
        return rng.integers(10, 49152, n).tolist()

    torch_path = _torch_path(reference_python)
    for method in ("dpo", "orpo"):
        # ORPO's nll is the mean over a micro-batch's chosen tokens, pooled (TRL's too, per device): the same
        # whichever pairs share a micro-batch only where every chosen prompt + answer has the same length
        def n(lo, hi, fixed):
            return fixed if method == "orpo" else int(rng.integers(lo, hi))

        pairs = [[ids(n(4, 12, 8)), ids(n(3, 9, 6)), ids(n(3, 9, int(rng.integers(3, 9))))] for _ in range(10)]
        args = dict(ctx_size=256, iters=3, lr=5e-2, optimizer="sgd", val_split=0.2, n_threads=1, progress=False,
                    seed=3, pack=False)  # fmt: skip
        job = dict(model=str(tiny_f32), tokens=[0], pairs=pairs, method=method)
        one = _launch(dict(job, args=dict(args, batch_size=4, grad_accum=2)), tmp_path / method / "one", 0, torch_path)
        ckpt = dict(checkpoint_dir=str(tmp_path / method / "two" / "ckpt"), save_every=3)
        # (the ranks' gradients all-reduced in 64 KiB buckets during the backward pass: patch 0104, a caller's loss)
        two = _launch(dict(job, args=dict(args, batch_size=2, ddp_bucket_cap_mb=1 / 16, **ckpt)),
                      tmp_path / method / "two", 2, torch_path)  # fmt: skip
        for p in one + two:
            assert p.returncode == 0, p.stderr[-3000:]
        r1 = json.loads((tmp_path / method / "one" / "result-0.json").read_text())
        r2 = [json.loads((tmp_path / method / "two" / f"result-{k}.json").read_text()) for k in (0, 1)]
        assert r2[0]["checkpoints"] == 1 and r2[1]["checkpoints"] == 0
        assert r2[0]["losses"] == r2[1]["losses"] and r2[0]["metrics"] == r2[1]["metrics"]
        assert r1["steps"] == r2[0]["steps"] == 3
        np.testing.assert_allclose(r2[0]["losses"], r1["losses"], rtol=1e-6, err_msg=method)
        r2m = [r2[0]["val_before"], *r2[0]["val"], *r2[0]["metrics"]]
        for a, b in zip([r1["val_before"], *r1["val"], *r1["metrics"]], r2m):
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (method, k, a[k], b[k])
        w0 = _weights(tiny_f32)
        w1, w2 = _weights(tmp_path / method / "one" / "model.gguf"), _weights(tmp_path / method / "two" / "model.gguf")
        assert any(np.abs(w1[n] - w0[n]).max() > 0 for n in w1), method  # the steps trained
        for name in w1:
            step = np.abs(w1[name] - w0[name]).max()
            ulp = np.spacing(np.abs(w1[name]).astype(np.float32)).astype(np.float64)
            assert (np.abs(w2[name] - w1[name]) <= 2 * ulp + 1e-5 * step).all(), (method, name)


def test_two_ranks_grpo_as_one_with_the_global_batch(tiny_f32, reference_python, tmp_path):
    """train.grpo under a launch: 2 ranks x 2 prompts x num_generations 2 (gloo) against 1 process x 4 prompts in
    two micro-batches (grad_accum 2), two optimizer steps on each generation batch (num_iterations 2, beta 0.04:
    the ratio, the reference's KL and the clipping in play), loss_type dapo (the sum over the step's tokens on
    every rank: n_items all-reduced) and grpo with scale_rewards "batch" (the standard deviation of every rank's
    rewards: the advantages come from all the step's rewards, gathered). Rank r rolls out prompts [2r, 2r + 2) of
    each step with the seeds one process gives those completions, so the rewards are the same numbers; the losses,
    KL and clip ratios are those of all the step's completions (all-reduced) within 1e-5 relative / 1e-6 absolute
    (F32 sums in another order), and the held-out rewards (every rank all held-out prompts) are equal. Rank 0
    alone writes the checkpoint."""
    prompts = [f"Colour number {i} is" for i in range(10)]
    torch_path = _torch_path(reference_python)
    for loss_type, scale in (("dapo", "group"), ("grpo", "batch")):
        grpo = dict(num_generations=2, max_completion_length=5, beta=0.04, num_iterations=2, seed=7,
                    loss_type=loss_type, scale_rewards=scale)  # fmt: skip
        args = dict(iters=4, lr=5e-2, optimizer="sgd", val_split=0.2, n_threads=1, progress=False, seed=3)
        job = dict(model=str(tiny_f32), tokens=[0], prompts=prompts, grpo=grpo)
        work = tmp_path / loss_type
        one = _launch(dict(job, args=dict(args, batch_size=8, grad_accum=2)), work / "one", 0, torch_path)
        ckpt = dict(checkpoint_dir=str(work / "two" / "ckpt"), save_every=4)
        # (64 KiB gradient buckets all-reduced during the backward pass: patch 0104 under GRPO's loss)
        two = _launch(dict(job, args=dict(args, batch_size=4, ddp_bucket_cap_mb=1 / 16, **ckpt)), work / "two", 2,
                      torch_path)  # fmt: skip
        for p in one + two:
            assert p.returncode == 0, p.stderr[-3000:]
        r1 = json.loads((work / "one" / "result-0.json").read_text())
        r2 = [json.loads((work / "two" / f"result-{k}.json").read_text()) for k in (0, 1)]
        assert r2[0]["checkpoints"] == 1 and r2[1]["checkpoints"] == 0
        assert r2[0]["metrics"] == r2[1]["metrics"] and r1["steps"] == r2[0]["steps"] == 4
        assert any(abs(m["loss"]) > 1e-4 for m in r1["metrics"]), r1["metrics"]  # the steps trained on something
        for a, b in zip(r1["metrics"], r2[0]["metrics"]):
            assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (loss_type, k, a[k], b[k])
        assert [r2[0]["val_before"], *r2[0]["val"]] == pytest.approx([r1["val_before"], *r1["val"]], abs=1e-9)


def test_a_resumed_launch_continues_the_same_run(tiny_f32, reference_python, tmp_path):
    """2 ranks (gloo), LoRA, AdamW, 4 steps with a checkpoint every 2 (rank 0 writes them); a second launch of 2
    ranks resumes from step 2's checkpoint (every rank reads it: the adapter, AdamW's moments, the step, the
    global batch in the run record): its steps 3-4 take the same windows, and its losses and adapter are the
    uninterrupted run's bit for bit (the same ranks, the same reductions in the same order). A launch of another
    world size resuming that checkpoint is refused naming the batch (its global batch would differ)."""
    tokens = np.random.default_rng(4).integers(0, 49152, 128 * 16 + 1).tolist()
    args = dict(ctx_size=256, iters=4, lr=1e-3, lora_rank=4, val_split=0.0, n_threads=1, progress=False, seed=5,
                batch_size=2, save_every=2)  # fmt: skip
    job = dict(model=str(tiny_f32), tokens=tokens)
    torch_path = _torch_path(reference_python)
    whole = _launch(dict(job, args=dict(args, checkpoint_dir=str(tmp_path / "ck"))), tmp_path / "whole", 2, torch_path)
    ckpt = tmp_path / "ck" / "step-0000002"
    resumed = _launch(
        dict(job, args=dict(args, checkpoint_dir=str(tmp_path / "ck2")), resume=str(ckpt)),
        tmp_path / "resumed", 2, torch_path,
    )  # fmt: skip
    for p in whole + resumed:
        assert p.returncode == 0, p.stderr[-3000:]
    r1 = json.loads((tmp_path / "whole" / "result-0.json").read_text())
    r2 = json.loads((tmp_path / "resumed" / "result-0.json").read_text())
    assert r1["steps"] == r2["steps"] == 4 and r2["losses"] == r1["losses"], (r1, r2)
    a1, a2 = _weights(tmp_path / "whole" / "adapter.gguf"), _weights(tmp_path / "resumed" / "adapter.gguf")
    assert a1.keys() == a2.keys() and all(np.array_equal(a1[k], a2[k]) for k in a1)
    one = _launch(dict(job, args=dict(args, checkpoint_dir=str(tmp_path / "ck3")), resume=str(ckpt)),
                  tmp_path / "one", 0, torch_path)  # fmt: skip
    assert one[0].returncode != 0 and "batch_size" in one[0].stderr.splitlines()[-1], one[0].stderr[-2000:]


@pytest.mark.skipif(not GPU_BUILD, reason="needs a GPU backend device (1 or more) in this build")
def test_ranks_over_nccl_train_as_one(tiny_f32, reference_python, tmp_path):
    """On GPUs, NCCL through torch.distributed (tests/device/cuda_run.sh ddp87): with one GPU, a launch of one rank
    (the reduction over one rank, the step as a graph of its own: patch 0102 on CUDA) against the same run without
    a launch; with two or more, 2 ranks x batch_size 2, each on its GPU, against 1 process x batch_size 4 in two
    micro-batches. Within the issue's "bf16 tolerance on GPUs", not the CPU test's. Measured on an H100
    (2026-12-05, GGML_CUDA_FA_BACK_DETERMINISTIC=1 on both sides): the plain run against itself 0 apart (printed),
    the one-rank launch against it 5.2e-6 of the loss at step 3 and weights up to 1.07% of the largest step
    (blk.1.attn_k; the gradients went through the host then, on the GPU in place since). With one rank the
    reduction is the identity (a sum of one, divided by one), so the gap is CUDA's arithmetic in patch 0102's split
    graphs (the gradients into static accumulators, then the step as a graph of its own) against the one graph of
    a step. Likely (not yet checked with
    GGML_CUDA_FUSE_GEMM_ADD=0): a weight's gradient added into its accumulator by cuBLAS (beta 1, ggml-cuda's
    GEMM + ADD fusion) sums in another order than the same product written alone (beta 0), and the BF16 inputs of
    the next steps' products turn such last-bit differences into BF16 roundings (2^-8); the CPU test shows none.
    So: losses within 1e-4 relative, weights within 2% of the largest step (bf16's 2^-7 ~ 0.8% doubled); a
    reduction that summed two ranks without averaging, or dropped one's gradients, moves the steps by 100% or 50%
    and fails. The same launch with 64 KiB buckets (NCCL's all-reduces started during the backward pass, patch
    0104) within the same tolerances."""
    torch_path = _torch_path(reference_python)
    code = "import torch; print(torch.cuda.device_count())"
    env = dict(os.environ, PYTHONPATH=torch_path)
    n_gpu = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout or 0)
    if not n_gpu:
        pytest.skip("the reference Python's torch sees no CUDA device (NCCL needs one)")
    world = 2 if n_gpu >= 2 else 1
    tokens = np.random.default_rng(1).integers(0, 49152, 128 * 16 + 1).tolist()
    args = dict(ctx_size=256, iters=3, lr=1e-2, optimizer="sgd", val_split=0.2, progress=False, seed=3)
    job = dict(model=str(tiny_f32), tokens=tokens, gpu=True)
    det = dict(GGML_CUDA_FA_BACK_DETERMINISTIC="1")
    plain = dict(job, args=dict(args, batch_size=2 * world, grad_accum=world))
    one = _launch(plain, tmp_path / "one", 0, torch_path, env=det)
    again = _launch(plain, tmp_path / "again", 0, torch_path, env=det)
    two = _launch(dict(job, args=dict(args, batch_size=2, ddp_backend="nccl")), tmp_path / "two", world, torch_path,
                  env=det)  # fmt: skip
    # NCCL's all-reduces started while the backward pass runs, on ggml's CUDA memory (patch 0104: 64 KiB buckets)
    bucketed = dict(job, args=dict(args, batch_size=2, ddp_backend="nccl", ddp_bucket_cap_mb=1 / 16))
    buckets = _launch(bucketed, tmp_path / "buckets", world, torch_path, env=det)
    for p in one + again + two + buckets:
        assert p.returncode == 0, p.stderr[-3000:]
    print(
        f"loss gap: launch {_loss_gap(tmp_path / 'one', tmp_path / 'two'):.2e}, "
        f"with buckets {_loss_gap(tmp_path / 'one', tmp_path / 'buckets'):.2e}, "
        f"plain run again {_loss_gap(tmp_path / 'one', tmp_path / 'again'):.2e}"
    )
    for run in ("two", "buckets"):
        _same_run(tmp_path / "one", tmp_path / run, _weights(tiny_f32), rtol=1e-4, of_step=2e-2)


def test_a_rank_that_dies_ends_the_run_on_the_others(tiny_f32, reference_python, tmp_path):
    """Rank 1 exits after the first step: rank 0's next all-reduce fails (gloo: the peer closed the connection)
    and its finetune raises RuntimeError naming the reduction, no step taken, well within ddp_timeout; nothing
    hangs (the launch's wait has a limit)."""
    tokens = np.random.default_rng(2).integers(0, 49152, 128 * 10 + 1).tolist()
    args = dict(ctx_size=256, iters=3, batch_size=1, val_split=0.0, n_threads=1, progress=False, ddp_timeout=120)
    job = dict(model=str(tiny_f32), tokens=tokens, args=args, die=[1, 1])
    r0, r1 = _launch(job, tmp_path, 2, _torch_path(reference_python), timeout=240)
    assert r1.returncode == 3
    assert r0.returncode != 0 and "grad_reduce" in r0.stderr and "RuntimeError" in r0.stderr, r0.stderr[-3000:]


def test_torchrun_and_nproc_launch_the_cli(tiny_q8, reference_python, tmp_path):
    """``torchrun --nproc-per-node 2 -m llamabind finetune`` (torch.distributed.run, the module torchrun runs) and
    ``python -m llamabind finetune --nproc 2`` (which runs it): a QLoRA run over the Q8_0 model as it is on Python's
    own documentation text, 2 ranks x --batch 1; rank 0 alone prints the result and writes the adapter, and the two
    launches print the same losses (the same data, seed and reduction). --method dpo on 2 ranks prints and writes
    once too, and so does --method grpo (2 ranks x 1 prompt x 2 completions)."""
    import pydoc_data.topics

    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)[:6]))
    env = dict(os.environ, PYTHONPATH=_torch_path(reference_python), OMP_NUM_THREADS="1")
    args = ["finetune", "-m", str(tiny_q8), "--data", str(text), "--lora-rank", "4", "--lr", "1e-3", "--iters", "2"]
    args += ["--batch", "1", "-c", "256", "--threads", "1", "--no-progress", "--val-split", "0.2"]
    runs = {}
    for name, launch in (
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "llamabind"]),
        ("nproc", [sys.executable, "-m", "llamabind"]),
    ):
        out = tmp_path / f"{name}.gguf"
        extra = ["--nproc", "2"] if name == "nproc" else []
        p = subprocess.run([*launch, *args, *extra, "-o", str(out)], capture_output=True, text=True, env=env,
                           timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.count("optimizer steps") == 1 and p.stdout.count(f"wrote {out}") == 1, p.stdout
        with llamabind.Model(tiny_q8, repack=False) as m:
            assert m.load_lora(out) is not None
        runs[name] = re.findall(r"loss [\d.]+", p.stdout)
    assert runs["torchrun"] == runs["nproc"] and runs["nproc"]
    pairs = tmp_path / "pairs.jsonl"
    words = ["red", "green", "blue", "cyan", "pink", "gold", "grey", "teal"]
    pairs.write_text("".join(json.dumps({"prompt": f"Name colour {i}:", "chosen": f" {w}.", "rejected": " no."}) + "\n"
                             for i, w in enumerate(words)))  # fmt: skip
    dpo = [a if a != str(text) else str(pairs) for a in args]
    out = tmp_path / "dpo.gguf"
    p = subprocess.run([sys.executable, "-m", "llamabind", *dpo, "--nproc", "2", "--method", "dpo", "-o", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("optimizer steps of 1 pair") == 1 and p.stdout.count(f"wrote {out}") == 1, p.stdout
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name colour {i}:"}) + "\n" for i in range(8)))
    reward = "def brief(completions, **kw):\n    return [-len(c) / 50 for c in completions]\n"
    (tmp_path / "rewards.py").write_text(reward)
    grpo = ["finetune", "-m", str(tiny_q8), "--data", str(prompts), "--lora-rank", "4", "--lr", "1e-3", "--iters", "2",
            "--batch", "2", "--threads", "1", "--no-progress", "--val-split", "0.25"]  # fmt: skip
    out = tmp_path / "grpo.gguf"
    p = subprocess.run([sys.executable, "-m", "llamabind", *grpo, "--nproc", "2", "--method", "grpo", "--reward",
                        f"{tmp_path / 'rewards.py'}:brief", "--num-generations", "2", "--max-completion-length", "4",
                        "-o", str(out)], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("optimizer steps of 2 completion(s)") == 1 and p.stdout.count(f"wrote {out}") == 1, p.stdout
