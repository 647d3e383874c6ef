"""The native-facing layer, training side: :class:`Optimizer`, llama.cpp's optimizer API (llama_opt_init,
llama_opt_epoch, ggml-opt's AdamW and SGD) on a training :class:`~llamabind.context.Context`. The loop
and its batches are :mod:`llamabind.train`'s (:class:`~llamabind.train.Trainer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _core
from ._validate import as_float, as_int
from .context import Context

__all__ = ["Optimizer"]


class Optimizer:
    """ggml-opt's optimizer over a context made with ``training=True`` (wraps llama_opt_init; once per
    context). ``params``: ``"model"`` (every F32 weight; token_embd too unless ``embeddings`` is
    False, patch 0033) or ``"lora"`` (the A/B tensors of the adapters applied to the context).
    ``grad_accum``: evals per optimizer step (their gradients averaged, patch 0025). ``precision``:
    ``"bf16"`` lets the backend run the products of F32 tensors in BF16 with F32 accumulation
    (llama_opt_params.prec_products, patch 0052), ``"f32"`` keeps F32. Raises
    ValueError/TypeError for bad arguments or a context that is not a training one. ``loss``:
    ``"cross_entropy"`` (next-token), or ``"dpo"`` / ``"orpo"``: a preference loss over windows that
    alternate a pair's chosen and rejected answer (an even n_seq_max; llama_opt_params.build_loss, patch
    0054), ``beta`` > 0 DPO's beta or ORPO's lambda; or ``"grpo"``: the sum over the labelled positions of a
    coefficient (``refs`` of :meth:`eval`) times the position's log softmax(logits / ``beta``) (``beta``: GRPO's
    sampling temperature; :func:`~llamabind.train.grpo`). ``recompute``: gradient checkpointing, only the layers'
    outputs kept for the backward pass, the rest recomputed there (llama_opt_params.recompute_activations,
    patch 0066). ``max_grad_norm``: clip the gradients to this global L2 norm before each optimizer step
    (torch.nn.utils.clip_grad_norm_; llama_opt_params.max_grad_norm, patch 0094); None or 0: no clipping.
    ``loss_chunk_tokens``: the next-token cross-entropy computed in chunks of this many labelled tokens, the
    output product too, each chunk's logits recomputed for the backward pass, so that a window's [tokens,
    n_vocab] logits and their gradient never exist whole (a fused linear cross-entropy; llama_opt_params
    .ce_chunk_rows, patch 0098); None (default): automatic, chunks of <= 512 MiB of F32 logits where a window's
    exceed 2 GiB; 0: whole. ValueError for a negative value. ``grad_reduce``: called before each optimizer step as
    ``grad_reduce(grads)``, ``grads`` a list of float32 (n_i,) arrays covering every trained tensor's gradient, in
    ggml's own memory by DLPack (``np.from_dlpack`` / ``torch.from_dlpack`` without a copy: host memory, or a CUDA
    device's, the backends synchronized; a host copy on other devices): one array over each run of gradients lying
    one after the other in a buffer (ggml-opt allocates them so: typically one array in all, the padding between
    two, under the buffer's alignment, included), valid during the call, to change in place element-wise:
    data parallelism's all-reduce (llama_opt_params.grad_reduce, patch 0102); what it raises is raised by
    :meth:`eval` as a RuntimeError, no step taken then or after. TypeError if not callable."""

    def __init__(
        self,
        context: Context,
        optimizer: str = "adamw",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        params: str = "model",
        grad_accum: int = 1,
        embeddings: bool = True,
        precision: str = "f32",
        loss: str = "cross_entropy",
        beta: float = 0.1,
        recompute: bool = False,
        max_grad_norm: float | None = None,
        loss_chunk_tokens: int | None = None,
        grad_reduce: Callable[[list[Any]], Any] | None = None,
    ):
        self.context = context
        self._native = context._llama_context
        _core.opt_init(
            self._native, optimizer, as_float(lr, "lr"), as_float(weight_decay, "weight_decay"), params,
            as_int(grad_accum, "grad_accum", 1), bool(embeddings), precision, loss, as_float(beta, "beta"),
            bool(recompute), 0.0 if max_grad_norm is None else as_float(max_grad_norm, "max_grad_norm"),
            _ce_chunk_rows(loss_chunk_tokens), grad_reduce,
        )  # fmt: skip

    def eval(
        self,
        windows: np.ndarray,
        train: bool,
        labels: np.ndarray | None = None,
        refs: np.ndarray | None = None,
        prompt_rows: np.ndarray | None = None,
        segments: np.ndarray | None = None,
        shared: np.ndarray | None = None,
    ) -> None:
        """One eval of n_seq_max windows, int32 C-contiguous (n_seq_max, n_ctx / n_seq_max + 1), one
        sequence each, with optional labels (n_seq_max, n_ctx / n_seq_max), -1 left out: forward, and
        with ``train`` backward and (every grad_accum-th eval) the optimizer step (llama_opt_epoch).
        Its loss adds to :meth:`result`. A preference loss needs ``labels`` (each window's answer tokens)
        and for DPO ``refs``, float64 (n_seq_max / 2,): each pair's reference log-ratio log p_ref(chosen)
        - log p_ref(rejected) in nats. ORPO's nll over the chosen prompt and answer (TRL's) takes
        ``prompt_rows``, int32 (n_seq_max / 2,): per pair, how many of its chosen window's labelled positions
        are the prompt's (they come before the answer's; the odds ratio is of the answer's alone). Raises
        ValueError for other shapes, ids out of range, a window without a labelled position under a
        preference loss, prompt_rows without ORPO or not fewer than the chosen window's labelled positions.
        A ``packed=True`` context takes any number m of windows that divides n_ctx, (m, n_ctx / m + 1), and
        ``segments``, int32 (m, n_ctx / m): each position's document in its window, counted from 0 in steps
        of 1 (None: one document a window); each document attends only to itself, its positions from 0
        (llama_opt_set_segments, patch 0096); ValueError for segments otherwise or more documents than
        n_seq_max. ``shared``, int32 (m, n_ctx / m): -1, or a later document of the window that the position's
        token belongs to too, seen by that document's tokens as its own (a prompt shared by a pair's chosen and
        rejected answer; a shared token has the same position in both: llama_opt_set_shared_tokens, patch 0101).
        Under a preference loss a packed window's documents alternate chosen, rejected and take the windows'
        place in ``refs``, ``prompt_rows`` and :meth:`seq_logps`. Under ``loss="grpo"``: ``refs`` float64
        (labelled positions,), window-major, each one's coefficient."""
        if refs is not None:
            refs = np.ascontiguousarray(refs, dtype=np.float64).reshape(-1)
        if prompt_rows is not None:
            prompt_rows = np.ascontiguousarray(prompt_rows, dtype=np.int32).reshape(-1)
        _core.opt_step(self._native, windows, bool(train), labels, refs, prompt_rows, segments, shared)

    def seq_logps(self, prompt: bool = False) -> np.ndarray:
        """float64 (n_seq_max,): the last :meth:`eval`'s per-window summed log-likelihood of its answer's
        labelled tokens (nats), read from the preference loss's graph after the eval (its per-window
        ggml_cross_entropy_loss nodes, ggml_backend_tensor_get; patch 0054); ``prompt``: of the labelled
        prompt positions before them (ORPO's ``prompt_rows``; 0 where none). Under ``loss="grpo"``: float64
        (labelled positions,), window-major, each one's log-probability. ValueError without a caller's loss."""
        return _core.opt_seq_logps(self._native, bool(prompt))

    def forward_as_training(self, on: bool) -> None:
        """Evaluate the forward-only :meth:`eval` calls (``train=False``) made between optimizer steps in the
        training graph: its backward pass computed and dropped (no step, the accumulation period unmoved), so that
        the backend computes the forward nodes as a training step does (the same fusions and in-place ops, the same
        roundings). Costs a backward pass a call. Wraps ggml_opt_set_forward_as_training (patch 0095)."""
        _core.opt_forward_as_training(self._native, bool(on))

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients at the last optimizer step, before clipping (transformers'
        logged ``grad_norm``); NaN without ``max_grad_norm`` or before the first step. Wraps
        ggml_opt_get_grad_norm (patch 0094)."""
        return float(_core.opt_grad_norm(self._native))

    def result(self, train: bool) -> tuple[float, float, int]:
        """(mean cross-entropy per labelled token in nats, next-token accuracy, labelled tokens) of the
        training or validation evals since :meth:`reset`, token-weighted; NaN, NaN, 0 for none."""
        return _core.opt_result(self._native, bool(train))

    def reset(self) -> None:
        """Zero the losses :meth:`result` sums."""
        _core.opt_reset(self._native)

    def set_lr(self, lr: float) -> None:
        """The learning rate (> 0) of the next optimizer steps (ggml-opt reads it at each step)."""
        _core.opt_set_lr(self._native, as_float(lr, "lr"))

    def state(self) -> tuple[int, list[tuple[str, np.ndarray, np.ndarray]]]:
        """(AdamW's step counter, [(tensor name, m, v)]): float32 copies of the moments, shape
        (n_elements,); an empty list for SGD. Wraps ggml_opt_get_iter / ggml_opt_get_param (patch
        0028). ValueError before the first eval (ggml-opt allocates the moments with its first graph)."""
        it, params = _core.opt_state(self._native)
        return it, [(n, m, v) for n, m, v in params if m is not None]

    def set_state(self, iter: int, state: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Set the state :meth:`state` returned: every trained tensor by name with as many float32
        values; nothing is written unless all are (ValueError: a missing or extra tensor, a wrong
        size, iter < 1, before the first eval). Wraps ggml_opt_set_iter and ggml_backend_tensor_set."""
        flat = [
            (str(n), np.ascontiguousarray(m, dtype=np.float32).reshape(-1),
             np.ascontiguousarray(v, dtype=np.float32).reshape(-1))
            for n, m, v in state
        ]  # fmt: skip
        _core.opt_set_state(self._native, as_int(iter, "iter", 1), flat)

    def stats(self) -> dict[str, Any]:
        """llama_opt_get_stats (patches 0032, 0063, 0066): n_evals, n_graph_builds, n_opt_builds, n_graph_allocs,
        n_kept_batches (int counts), t_prepare_ms, t_build_ms, t_alloc_ms, t_inputs_ms, t_eval_ms
        (float milliseconds) since llama_opt_init, and compute_buffer_bytes (int: the largest of the
        graphs' compute buffers, summed over the backends)."""
        return dict(_core.opt_stats(self._native))

    def profile(self) -> list[tuple[str, str, float, int]]:
        """[(phase, ggml op, ms, nodes)] timed since the last call, for a context made with
        training_profile=True (ValueError otherwise)."""
        return _core.opt_profile(self._native)


def _ce_chunk_rows(loss_chunk_tokens: int | None) -> int:
    """llama_opt_params.ce_chunk_rows of a ``loss_chunk_tokens``: None automatic (0), 0 whole (-1), n > 0 itself."""
    if loss_chunk_tokens is None:
        return 0
    n = as_int(loss_chunk_tokens, "loss_chunk_tokens", 0, note=" (0: whole; None: automatic)")
    return -1 if n == 0 else n
