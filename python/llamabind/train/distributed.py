"""Data-parallel fine-tuning (issue 87) with torchrun's conventions: one process per device, launched by
``torchrun --nproc-per-node N -m llamabind finetune ...`` (or anything that sets the same environment),
each holding the model and training on its shard of every global batch; before each optimizer step the
trained gradients are averaged over the ranks by torch.distributed's all-reduce (gloo on the CPU, NCCL on
NVIDIA GPUs: maintained collectives, not one of ours), between ggml-opt's backward pass and its step
(``ggml_opt_params.grad_reduce``, patch 0102), so the step is the same on every rank.

torch is needed only here, and only under a launch: ``pip install torch`` where you train on several
processes (its CPU wheel does for gloo)."""

from __future__ import annotations

import datetime
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import expect

__all__ = ["ProcessGroup", "process_group"]

BACKENDS = ("gloo", "nccl")
"""torch.distributed backends the all-reduce runs on (:attr:`~llamabind.train.TrainingArgs.ddp_backend`)."""

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_BUCKET_BYTES = 256 << 20
"""The most bytes of small gradient arrays packed into one all-reduce by :meth:`ProcessGroup.all_reduce_mean_`
(bounded for the packing's copy). Its arrays are typically one over all the accumulators (ggml-opt allocates them one
after the other) or a few large ones, each reduced whole where it lies: no packing, no copy. (The buckets started
during the backward pass are another thing: :class:`GradientReducer`, TrainingArgs.ddp_bucket_cap_mb.)"""


def _buckets(tensors: list[Any], limit: int) -> list[list[Any]]:
    """``tensors`` in order, grouped by device into runs of at most ``limit`` bytes (a larger tensor alone)."""
    out: list[list[Any]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if not out or size + n > limit or out[-1][0].device != t.device:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _torch_distributed() -> Any:
    try:
        return importlib.import_module("torch.distributed")
    except ImportError as e:
        raise ImportError(
            "data-parallel training (a torchrun launch: WORLD_SIZE is set) averages the gradients with "
            "torch.distributed's all-reduce: install torch (pip install torch; its CPU wheel does for gloo)"
        ) from e


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a data-parallel run: ``rank`` in [0, ``world_size``), ``local_rank`` on its
    host (the device it trains on), and torch.distributed's ``backend`` (``"gloo"`` or ``"nccl"``)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that logs, reports and writes checkpoints."""
        return self.rank == 0

    def shard(self, rows: np.ndarray) -> np.ndarray:
        """This rank's rows of a global batch, ``rows[rank::world_size]`` (torch's DistributedSampler's
        interleaving); ValueError unless world_size divides their count."""
        expect(
            len(rows) % self.world_size == 0,
            f"a global batch of {len(rows)} windows does not split over {self.world_size} ranks",
        )
        return rows[self.rank :: self.world_size]

    def all_reduce_mean_(self, grads: Sequence[Any]) -> None:
        """Replace the gradients in place by their mean over the ranks: ``grads`` the float32 DLPack arrays of
        :class:`~llamabind.Optimizer`'s grad_reduce (the gradients in their own memory, on the host or a CUDA
        device: typically one array over all of them), taken as torch tensors without a copy; an array of 256 MiB or
        more all-reduced where it lies, smaller ones packed into buckets of up to 256 MiB on their device; NCCL
        averages them itself (ReduceOp.AVG: no pass of its own), gloo sums and they are divided by world_size; then
        written back (host memory under NCCL: through a copy on this rank's GPU); a CUDA device's stream is
        synchronized before the step reads them. What the collective raises (a rank gone: its timeout) propagates:
        the training step then takes no step and raises."""
        torch = importlib.import_module("torch")
        dist = _torch_distributed()
        tensors = [torch.from_dlpack(g) for g in grads]
        for bucket in _buckets(tensors, _BUCKET_BYTES):
            flat = torch.cat(bucket) if len(bucket) > 1 else bucket[0]  # one tensor: reduced where it is
            on = flat.to(f"cuda:{self.local_rank}") if self.backend == "nccl" and not flat.is_cuda else flat
            if self.backend == "nccl":
                dist.all_reduce(on, op=dist.ReduceOp.AVG)
            else:
                dist.all_reduce(on)
                on /= self.world_size
            if on is not flat:
                flat.copy_(on.cpu())
            if flat is not bucket[0]:
                for t, part in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                    t.copy_(part)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()

    def reducer(self, bucket_cap_mb: float = 0.0) -> GradientReducer:
        """The ``grad_reduce`` of :class:`~llamabind.Optimizer` that averages a step's gradients over the ranks:
        with ``bucket_cap_mb`` > 0 (MiB) the gradient buckets' all-reduces start while the backward pass runs."""
        return GradientReducer(self, int(bucket_cap_mb * 2**20))

    def all_reduce_sum(self, values: Sequence[float] | np.ndarray) -> np.ndarray:
        """float64 (len(values),): each value summed over the ranks (a loss's token-weighted sums)."""
        torch = importlib.import_module("torch")
        t = torch.tensor(np.asarray(values, dtype=np.float64))
        if self.backend == "nccl":
            t = t.to(f"cuda:{self.local_rank}")
        _torch_distributed().all_reduce(t)
        return t.cpu().numpy()

    def gather_rows(self, rows: np.ndarray, interleaved: bool = False) -> np.ndarray:
        """float64 (world_size x n, ...): every rank's ``rows`` (n, ...) of one shape in the global order: rank r's
        at [r n, (r + 1) n) (a contiguous shard), or with ``interleaved`` at r::world_size (:meth:`shard`'s). An
        all-gather as an all-reduce with zeros elsewhere: a NaN stays in its own row."""
        rows = np.asarray(rows, np.float64)
        n = len(rows)
        full = np.zeros((self.world_size * n, *rows.shape[1:]))
        at = slice(self.rank, None, self.world_size) if interleaved else slice(self.rank * n, (self.rank + 1) * n)
        full[at] = rows
        return self.all_reduce_sum(full.reshape(-1)).reshape(full.shape)

    def barrier(self) -> None:
        """Wait for every rank (torch.distributed.barrier)."""
        _torch_distributed().barrier()


class GradientReducer:
    """A step's gradients averaged over a process group's ranks, as :class:`~llamabind.Optimizer`'s grad_reduce:
    :meth:`ready` starts each bucket's all-reduce (asynchronous: torch.distributed's ``async_op``; NCCL averages,
    gloo sums) as soon as the backward pass has finished it (patch 0104, buckets of ``bucket_bytes``), on the
    bucket's own memory; the call at the end reduces what is left (:meth:`ProcessGroup.all_reduce_mean_`), waits
    for the started ones, divides gloo's sums by world_size and synchronizes the CUDA stream before the step.
    Arrays: 1-D float32 (DLPack: host memory or a CUDA device's), changed in place. What torch.distributed raises
    (a rank gone: RuntimeError or its timeout) propagates: Optimizer.eval then raises and takes no step."""

    def __init__(self, group: ProcessGroup, bucket_bytes: int) -> None:
        self.group, self.bucket_bytes = group, bucket_bytes
        self.n_buckets = 0  # buckets started during backward passes, all steps together
        self._pending: list[tuple[Any, Any, Any]] = []

    def ready(self, grads: Sequence[Any]) -> None:
        """Start the all-reduce of a bucket's float32 DLPack arrays (on the host or this rank's GPU)."""
        torch = importlib.import_module("torch")
        dist = _torch_distributed()
        op = dist.ReduceOp.AVG if self.group.backend == "nccl" else dist.ReduceOp.SUM
        for g in grads:
            t = torch.from_dlpack(g)
            on = t.to(f"cuda:{self.group.local_rank}") if self.group.backend == "nccl" and not t.is_cuda else t
            self._pending.append((dist.all_reduce(on, op=op, async_op=True), on, t))
        self.n_buckets += 1

    def __call__(self, grads: Sequence[Any]) -> None:
        """The rest of the step's gradients reduced, then every started bucket waited for and averaged."""
        try:
            if grads:
                self.group.all_reduce_mean_(grads)
            for work, on, t in self._pending:  # (on: t itself, or its copy on this rank's GPU under NCCL)
                work.wait()
                if self.group.backend != "nccl":
                    on /= self.group.world_size
                if on is not t:
                    t.copy_(on.cpu())
                if on.is_cuda:
                    importlib.import_module("torch").cuda.current_stream(on.device).synchronize()
        finally:
            self._pending.clear()


def reports(group: ProcessGroup | None) -> bool:
    """Whether this process logs, reports and writes checkpoints: the only one, or rank 0 of a data-parallel run."""
    return group is None or group.is_main


def launched() -> bool:
    """Whether this process is a rank of a launch (torchrun's RANK and WORLD_SIZE set; a world of 1 too, which runs
    the same path: the reduction over one rank)."""
    return bool(os.environ.get("WORLD_SIZE")) and bool(os.environ.get("RANK"))


def process_group(backend: str | None = None, timeout: float = 1800.0, *, gpu: bool = False) -> ProcessGroup | None:
    """The process group of a torchrun launch, joined (torch.distributed.init_process_group over env://, once
    per process), or None outside one (RANK or WORLD_SIZE unset). ``backend``: ``"gloo"`` or ``"nccl"``; None:
    "nccl" where ``gpu`` (the model's output layer on a CUDA GPU), else "gloo". ``timeout``: seconds a
    collective waits for the other ranks (transformers' ddp_timeout). Raises ImportError without torch,
    ValueError for a launch environment that is incomplete or inconsistent (naming the variable)."""
    if not launched():
        return None
    missing = [k for k in _ENV if not os.environ.get(k)]
    expect(not missing, f"a data-parallel launch sets {', '.join(_ENV)}; missing: {', '.join(missing)} (use torchrun)")
    ints = {}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            ints[k] = int(os.environ[k])
        except ValueError:
            raise ValueError(f"{k} must be an integer; got {os.environ[k]!r}") from None
    rank, world, local = ints["RANK"], ints["WORLD_SIZE"], ints["LOCAL_RANK"]
    expect(world >= 1, f"WORLD_SIZE must be >= 1; got {world}")
    expect(0 <= rank < world, f"RANK must be in [0, WORLD_SIZE = {world}); got {rank}")
    expect(0 <= local < world, f"LOCAL_RANK must be in [0, WORLD_SIZE = {world}); got {local}")
    name = backend or ("nccl" if gpu else "gloo")
    expect(name in BACKENDS, f"ddp_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    dist = _torch_distributed()
    if not dist.is_initialized():
        dist.init_process_group(backend=name, timeout=datetime.timedelta(seconds=timeout))
    else:
        expect(dist.get_world_size() == world, "the process group already joined has another world size")
    return ProcessGroup(rank, world, local, name)
