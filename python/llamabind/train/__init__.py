"""Fine-tuning a GGUF model on text, through llama.cpp's optimizer API (llama_opt_init /
llama_opt_epoch: ggml's backward graph, ggml-opt's AdamW or SGD).

    >>> import llamabind
    >>> from llamabind import train
    >>> train.to_f32("smollm2-135m-instruct", "smol-f32.gguf")        # dequantize: trainable weights
    >>> model = llamabind.Model("smol-f32.gguf", use_mmap=False)
    >>> result = train.finetune(model, open("notes.txt").read(), ctx_size=256, epochs=2, lr=1e-5)
    >>> model.save("smol-tuned.gguf")

Data: text, token ids, or examples from JSONL files (:func:`read_data`: ``{"text"}``,
``{"prompt", "completion"}``, ``{"messages"}`` rendered with the chat template, the loss counted on
the completion / assistant tokens only: patch 0027), one example per window, cut at ctx_size + 1
tokens or padded (padding not counted). Text is cut into windows of ``ctx_size + 1`` tokens every
``ctx_size // 2`` tokens (as upstream's ``common_opt_dataset_init``); the last ``val_split`` of
them are held out for the validation loss. One optimizer step per ``batch_size`` windows (the mean next-token
cross-entropy over their positions, as PyTorch's mean loss of a batch): the windows of a batch run
as one graph, one sequence each, and the graphs are built once and kept while the shapes stay
(``grad_accum`` splits a batch into micro-batches whose gradients ggml-opt accumulates). A full
fine-tune trains every weight, token_embd included (with a tied output matrix, as PyTorch does).
The model's weights change in place: generate with it afterwards, or save it.

A run's settings are one :class:`TrainingArgs` (its fields may also be given as keyword
arguments): ``finetune(model, text, TrainingArgs(lr=1e-4, batch_size=8))``. Products of F32 weights
run in BF16 with F32 accumulation where the backend has that (``precision="bf16"``, the default on a
GPU: CUDA from Ampere on; on CPUs with AVX512_BF16 when asked for), attention through flash attention
and its backward pass on GPUs.

:class:`Trainer` is the native side of a run (the training context and the optimizer) for loops
of your own: ``Trainer(model, ctx_size=256, batch_size=8).step(windows)``.

Full fine-tuning needs F32 weights (ggml-opt updates them in place; quantized weights have no
gradient): convert a quantized model with :func:`to_f32`. LoRA (``lora_rank=``) trains F32
adapter matrices A (rank x n_in) and B (n_out x rank), scaled by alpha / rank, beside frozen
weights that may be quantized (QLoRA: the Q4_1 SmolLM2 as is); the trained adapter is
``result.adapter`` (apply it with ``Context.set_lora``, save it with ``adapter.save(path)``).

    >>> model = llamabind.Model("smollm2-135m-instruct", repack=False)
    >>> r = train.finetune(model, text, lora_rank=8, lora_alpha=16, lr=1e-4)
    >>> r.adapter.save("smol-lora.gguf")

Preference tuning (:func:`preference`: DPO or ORPO, LoRA, QLoRA or every weight) on pairs in TRL's
formats (:func:`read_pairs`); the log-probabilities of their answers (:func:`pair_logps`) and DPO's /
ORPO's losses and reward metrics (:func:`preference_metrics`) judge a model on held-out pairs.

    >>> pairs = train.read_pairs("pairs.jsonl", model)
    >>> r = train.preference(model, pairs, method="dpo", beta=0.1, lora_rank=8, lr=1e-4, batch_size=4)
"""

from .args import PRECISIONS, TrainingArgs
from .checkpoint import latest_checkpoint
from .data import (
    Example,
    chat_example,
    example_windows,
    from_dataset,
    load_dataset,
    load_jsonl,
    packed_windows,
    read_data,
    windows,
)  # fmt: skip
from .evaluate import EvalResult, evaluate
from .fuse import fuse
from .grpo import GRPOConfig, GRPOResult, grpo
from .grpo_math import group_advantages, token_loss
from .loop import EpochStats, TrainResult, finetune, iterate_batches
from .lora import LORA_TARGETS, lora_init, to_f32
from .pairs import PreferenceMetrics, PreferencePair, pair_logps, preference_metrics, read_pairs
from .preference_loop import METHODS, PreferenceResult, pack_pairs, pair_spans, pair_windows, preference
from .rollout import GRPOPrompt, pack_completions, read_prompts
from .schedule import SCHEDULES, lr_at
from .trainer import Trainer

__all__ = [
    "LORA_TARGETS",
    "METHODS",
    "PRECISIONS",
    "SCHEDULES",
    "EpochStats",
    "EvalResult",
    "Example",
    "GRPOConfig",
    "GRPOPrompt",
    "GRPOResult",
    "PreferenceMetrics",
    "PreferencePair",
    "PreferenceResult",
    "TrainResult",
    "Trainer",
    "TrainingArgs",
    "chat_example",
    "evaluate",
    "example_windows",
    "from_dataset",
    "load_dataset",
    "finetune",
    "fuse",
    "group_advantages",
    "grpo",
    "iterate_batches",
    "load_jsonl",
    "latest_checkpoint",
    "lora_init",
    "lr_at",
    "pack_completions",
    "pack_pairs",
    "packed_windows",
    "pair_logps",
    "pair_spans",
    "pair_windows",
    "preference",
    "preference_metrics",
    "read_data",
    "read_pairs",
    "read_prompts",
    "to_f32",
    "token_loss",
    "windows",
]
