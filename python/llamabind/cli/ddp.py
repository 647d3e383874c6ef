"""``finetune`` on several processes (issue 87): ``--nproc N`` launches torchrun (torch.distributed.run) with this
command line, one process per device; under such a launch (torchrun's RANK and WORLD_SIZE set, or ``torchrun -m
llamabind finetune`` itself) each rank takes its device, and only rank 0 reports and writes the output."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from ..train.distributed import launched


def add_ddp_options(f) -> None:
    f.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel training on N processes (torchrun --nproc-per-node N: each its device and its share of "
        "each batch, the gradients averaged before each step; --batch is then per process; needs torch)",
    )
    f.add_argument(
        "--ddp-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="torch.distributed backend of a data-parallel run (default: nccl on CUDA GPUs, gloo on the CPU)",
    )
    f.add_argument(
        "--ddp-bucket-cap-mb",
        type=float,
        default=128.0,
        metavar="MIB",
        help="MiB of gradients each all-reduce takes while the backward pass runs (default 128; 0: all after it)",
    )


def spawn(args) -> int | None:
    """With ``--nproc N`` (N > 1) outside a launch: run this command line under torchrun with N processes and
    return its exit status; None where this process trains itself. ValueError for N < 1, ImportError without
    torch."""
    n = args.nproc
    if n is None or launched():
        return None
    if n < 1:
        raise ValueError(f"--nproc must be >= 1; got {n}")
    if n == 1:
        return None
    if importlib.util.find_spec("torch") is None:
        raise ImportError("--nproc launches torchrun (torch.distributed.run): install torch (pip install torch)")
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m", "llamabind", *argv]
    return subprocess.run(cmd).returncode


def main_rank() -> bool:
    """Whether this process reports and writes the output: not under a launch, or its rank 0."""
    return not launched() or os.environ.get("RANK", "0") == "0"


def device_kw(kw: dict, n_gpu_layers) -> dict:
    """Model keyword arguments for this rank: under a launch with GPUs, the whole model on GPU LOCAL_RANK."""
    if not launched() or n_gpu_layers == 0:
        return kw
    from ..build import devices

    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = [d for d in devices() if d.get("type") == "gpu"]
    if local < len(gpus):
        kw = dict(kw, split_mode="none", main_gpu=local)
    return kw
