"""The fine-tuning commands: ``finetune``, ``eval`` and ``fuse`` (llamabind.train)."""

from __future__ import annotations

import argparse
import math
import sys

from .. import models
from .common import HelpFormatter, add_ctx_size, add_hf, add_lora, add_model, add_ngl, add_threads, lora_specs
from .ddp import add_ddp_options, device_kw, main_rank, spawn
from .grpo import add_grpo_options, prepare_grpo, run_grpo
from .run import _busy_note

DATASET_ID = r"[\w.-]+/[\w.-]+(:[\w.-]+)?"  # a Hub dataset id, org/name[:split]


def _check_inputs(data: dict, files: dict) -> None:
    """FileNotFoundError, before the model loads, for data that is no file, folder or Hub dataset id
    and for a missing file."""
    import re
    from pathlib import Path

    for flag, f in data.items():
        if f is not None and not Path(f).exists() and not re.fullmatch(DATASET_ID, f):
            raise FileNotFoundError(f"{flag}: no such file or folder, and not a Hub dataset id (org/name[:split]): {f}")
    for flag, f in files.items():
        if f is not None and not Path(f).is_file():
            raise FileNotFoundError(f"{flag}: no such file: {f}")


def _eval(args) -> int:
    from pathlib import Path

    from .. import train
    from ..api import Model

    loras = lora_specs(args)
    if (args.data is None) == (args.pairs is None):
        raise ValueError("give --data (the loss) or --pairs (preference metrics), one of them")
    if args.pairs is not None:
        return _eval_pairs(args, loras)
    _check_inputs({"--data": args.data}, {"--chat-template-file": args.chat_template_file})
    _check_inputs({}, {f"--lora {p}": p for p, _ in loras})
    template = Path(args.chat_template_file).read_text(encoding="utf-8") if args.chat_template_file else None
    note = _busy_note(args.threads)  # before our own threads run
    # loaded as finetune loads it (repack=False: the GGUF's own layout and ggml's plain CPU kernels), so
    # that eval's loss is the one finetune's validation and --test print for the same file and machine;
    # repacked layouts (AMX, interleaved) take other kernels, other roundings (docs/finetune.md)
    kw = dict(repack=False, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
    with Model(models.resolve(args.model), **kw) as m:
        print(f"reading and checking {args.data} ...", file=sys.stderr, flush=True)  # silent minutes otherwise
        data = train.read_data(args.data, m, chat_template=template, train_on_prompt=args.train_on_prompt)
        what = "the text" if isinstance(data, str) else f"{len(data)} examples"
        print(f"evaluating {what} in windows of {args.n_ctx} tokens ...", file=sys.stderr, flush=True)
        adapters = [(m.load_lora(p), scale) for p, scale in loras]
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        r = train.evaluate(m, data, ctx_size=args.n_ctx, adapter=adapters, n_threads=args.threads, progress=progress)
    print(f"loss {r.loss:.4f}, perplexity {r.perplexity:.3f} over {r.tokens} tokens in {r.windows} windows{note}")
    return 0


def _print_sft_result(res, args) -> None:
    """finetune's summary lines on stdout; no validation loss where there was none (NaN: --val-split 0)."""
    if not math.isnan(res.val_loss_before):
        print(f"validation loss before: {res.val_loss_before:.4f}")
    print(f"{res.steps} optimizer steps of {args.batch} window(s) of {args.n_ctx} tokens")
    for e in res.epochs:
        val = "" if math.isnan(e.val_loss) else f", validation loss {e.val_loss:.4f}"
        print(f"epoch {e.epoch}: train loss {e.train_loss:.4f}{val}, {e.tokens_per_s:.1f} tokens/s, {e.seconds:.1f} s")


_NO_PROMPT_LOSS = (
    "--method orpo: the nll term over the chosen answers only (the ORPO authors' disable_prompt_loss); default: over "
    "the chosen prompt and answer, as TRL's ORPOTrainer"
)


def _eval_pairs(args, loras) -> int:
    """eval --pairs: DPO's or ORPO's loss and TRL's reward metrics of the model with --lora (the policy) on
    preference pairs; DPO's reference is the model without the adapters."""
    from .. import train
    from ..api import Model

    _check_inputs({}, {"--pairs": args.pairs, **{f"--lora {p}": p for p, _ in loras}})
    if args.method == "dpo" and not loras:
        raise ValueError("--method dpo compares a tuned adapter with its base: give --lora (or --method orpo)")
    with Model(models.resolve(args.model), repack=False, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads) as m:
        pairs = train.read_pairs(args.pairs, m, method=args.method)
        adapters = [(m.load_lora(p), scale) for p, scale in loras]
        prompt = args.method == "orpo" and not args.no_prompt_loss
        policy = train.pair_logps(m, pairs, adapter=adapters, n_threads=args.threads, prompt=prompt)
        reference = train.pair_logps(m, pairs, n_threads=args.threads) if args.method == "dpo" else None
    lengths = [[len(p.chosen), len(p.rejected)] for p in pairs]
    nll = (
        -(policy[:, 0].sum() + policy[:, 2].sum()) / (sum(n for n, _ in lengths) + policy[:, 3].sum())
        if prompt
        else None
    )
    r = train.preference_metrics(policy[:, :2], reference, method=args.method, beta=args.beta, lengths=lengths, nll=nll)
    print(f"{args.method} over {len(pairs)} pairs: loss {r.loss:.4f}, rewards/chosen {r.rewards_chosen:.4f}, "
          f"rewards/rejected {r.rewards_rejected:.4f}, rewards/accuracies {r.rewards_accuracies:.4f}, "
          f"rewards/margins {r.rewards_margins:.4f}, logps/chosen {r.logps_chosen:.4f}, "
          f"logps/rejected {r.logps_rejected:.4f}")  # fmt: skip
    return 0


def _fuse(args) -> int:
    from .. import train

    out = train.fuse(args.model, args.lora, args.output, scale=args.scale, quantize_to=args.quantize,
                     n_threads=args.threads)  # fmt: skip
    print(f"wrote {out}" + (f" ({args.quantize})" if args.quantize else ""))
    return 0


def _checkpoints(args, out):
    """(checkpoint directory or None, the checkpoint to resume or None). Checkpoints are written
    with --save-every, --checkpoint-dir or --resume (then to the resumed checkpoint's directory)."""
    from pathlib import Path

    from ..train import checkpoint

    resume = None
    if args.resume is not None:
        resume = checkpoint.latest_checkpoint(args.resume)
    if args.checkpoint_dir is not None:
        return Path(args.checkpoint_dir), resume
    if resume is not None:
        return resume.parent, resume
    if args.save_every is not None:
        return out.with_name(out.stem + "-checkpoints"), None
    return None, None


def _targets(spec: str):
    """--lora-targets: "all-linear" as peft names it, or matrix names joined by commas."""
    return spec if spec == "all-linear" else tuple(spec.split(","))


def _training_args(args, ckpt_dir):
    """The command line's train.TrainingArgs, checked."""
    from .. import train

    flash = {"auto": None, "on": True, "off": False}[args.flash_attn]
    precision = None if args.precision == "auto" else args.precision
    return train.TrainingArgs.of(
        ctx_size=args.n_ctx, epochs=args.epochs, iters=args.iters, lr=args.lr, optimizer=args.optimizer,
        weight_decay=args.weight_decay, val_split=args.val_split, batch_size=args.batch, grad_accum=args.grad_accum,
        train_embeddings=not args.freeze_embeddings, seed=args.seed, n_threads=args.threads,
        progress=args.progress, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_targets=_targets(args.lora_targets), lr_schedule=args.lr_schedule, warmup=args.warmup,
        min_lr=args.min_lr, steps_per_eval=args.steps_per_eval, steps_per_report=args.steps_per_report, log=args.log,
        checkpoint_dir=ckpt_dir, save_every=args.save_every, precision=precision, flash_attn=flash,
        gradient_checkpointing=args.gradient_checkpointing, max_grad_norm=args.max_grad_norm, pack=args.pack,
        loss_chunk_tokens=args.loss_chunk_tokens, ddp_backend=args.ddp_backend,
        ddp_bucket_cap_mb=args.ddp_bucket_cap_mb,
    )  # fmt: skip


def _finetune(args) -> int:
    import os
    import tempfile
    from pathlib import Path

    from .. import train
    from ..api import Model

    rc = spawn(args)  # --nproc N: torchrun runs this command line N times
    if rc is not None:
        return rc
    _check_inputs({"--data": args.data, "--valid": args.valid, "--test": args.test},
                  {"--chat-template-file": args.chat_template_file})  # fmt: skip
    template = Path(args.chat_template_file).read_text(encoding="utf-8") if args.chat_template_file else None
    out = Path(args.output)
    try:  # fail now, not after the training, if the output cannot be written
        existed = out.exists()
        with open(out, "ab"):
            pass
        if not existed:
            out.unlink(missing_ok=True)  # the ranks of a launch each check it: another may have removed it
    except OSError as err:
        raise ValueError(f"-o: cannot write {out}: {err.strerror}") from None
    if args.method != "sft" and (args.test or args.train_on_prompt or args.chat_template_file):
        raise ValueError("--test, --train-on-prompt and --chat-template-file are for --method sft")
    src = models.resolve(args.model)
    lora = args.lora_rank is not None
    ckpt_dir, resume = _checkpoints(args, out)
    settings = _training_args(args, ckpt_dir)  # checked now: a bad setting fails before the model loads
    grpo = prepare_grpo(args) if args.method == "grpo" else None  # its settings and reward functions too
    if resume is not None:
        print(f"resuming from {resume}", file=sys.stderr)
        if not lora:  # a full fine-tune continues from the checkpoint's weights
            src = resume / "model.gguf"
    with tempfile.TemporaryDirectory(dir=out.resolve().parent) as tmp:
        with Model(src, vocab_only=True) as probe:
            f32 = all(t == "f32" for _, t, _ in probe.tensor_info())
        if not f32 and not lora:
            print(f"converting {src.name} to F32 weights for full fine-tuning (llama_model_quantize)", file=sys.stderr)
            train.to_f32(src, os.path.join(tmp, "f32.gguf"), n_threads=args.threads)
            src = Path(tmp) / "f32.gguf"
        kw = dict(use_mmap=lora, repack=False, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
        kw = device_kw(kw, args.n_gpu_layers)
        with Model(src, progress=args.progress and sys.stderr.isatty(), **kw) as m:
            if args.method != "sft":
                res = (
                    run_grpo(args, m, settings, resume, grpo)
                    if args.method == "grpo"
                    else _preference(args, m, settings, resume)
                )
                if not main_rank():  # rank 0 of a data-parallel run reports and writes the output
                    return 0
                (m if res.adapter is None else res.adapter).save(out)
                print(f"wrote {out}" + (" (a LoRA adapter: load it with --lora / Model.load_lora)" if lora else ""))
                return 0
            # JSONL examples or text, read and checked in full before the training starts
            read = dict(chat_template=template, train_on_prompt=args.train_on_prompt)
            if args.progress:  # tokenizing and checking a large file is a while on 2 cores
                print(f"reading and checking {args.data} ...", file=sys.stderr, flush=True)
            data = train.read_data(args.data, m, **read)
            valid = train.read_data(args.valid, m, **read) if args.valid else None
            test = train.read_data(args.test, m, **read) if args.test else None
            if not isinstance(data, str):
                print(f"{len(data)} examples from {args.data}", file=sys.stderr)
            res = train.finetune(m, data, settings, valid=valid, resume=resume)
            if not main_rank():  # rank 0 of a data-parallel run reports and writes the output
                return 0
            _print_sft_result(res, args)
            if res.interrupted:
                print(f"interrupted after {res.steps} steps; saving what was trained", file=sys.stderr)
            if res.adapter is not None:
                res.adapter.save(out)
            else:
                m.save(out)
            if test is not None:  # mlx-lm's --test: the tuned model on held-out data, after training
                t = train.evaluate(m, test, ctx_size=args.n_ctx, adapter=res.adapter, n_threads=args.threads)
                print(f"test loss {t.loss:.4f}, perplexity {t.perplexity:.3f} over {t.tokens} tokens")
    print(f"wrote {out}" + (" (a LoRA adapter: load it with --lora / Model.load_lora)" if lora else ""))
    return 0


def _preference(args, m, settings, resume):
    """finetune --method dpo|orpo: train.preference on the pairs of --data (and --valid); prints TRL's metrics."""
    from .. import train

    args.beta = 0.1 if args.beta is None else args.beta
    pairs = train.read_pairs(args.data, m, method=args.method)
    valid = train.read_pairs(args.valid, m, method=args.method) if args.valid else None
    if main_rank():
        print(f"{len(pairs)} preference pairs from {args.data}", file=sys.stderr)
    res = train.preference(m, pairs, settings, method=args.method, beta=args.beta, valid=valid, resume=resume,
                           prompt_loss=not args.no_prompt_loss)  # fmt: skip
    if not main_rank():
        return res

    def line(r):
        return (
            f"loss {r.loss:.4f}, rewards/accuracies {r.rewards_accuracies:.3f}, rewards/margins "
            f"{r.rewards_margins:.4f}, logps/chosen {r.logps_chosen:.2f}, logps/rejected {r.logps_rejected:.2f}"
        )

    if res.val_before is not None:
        print(f"held-out pairs before: {line(res.val_before)}")
    print(f"{res.steps} optimizer steps of {args.batch} pair(s), {args.method} with beta {args.beta}")
    if res.metrics:
        print(f"last step: {line(res.metrics[-1])}")
    if res.evals:
        print(f"held-out pairs after: {line(res.evals[-1][1])}")
    if res.interrupted:
        print(f"interrupted after {res.steps} steps; saving what was trained", file=sys.stderr)
    return res


def add_parsers(sub) -> None:
    """The finetune, eval and fuse subcommands."""
    _finetune_parser(sub)
    _eval_and_fuse_parsers(sub)


def _add_memory_and_step_options(f) -> None:
    """finetune's --gradient-checkpointing, --loss-chunk-tokens, --pack and --max-grad-norm: how a step spends
    memory and compute."""
    f.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward pass: less memory, one more forward pass",
    )
    f.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        metavar="N",
        help="compute the output layer and the loss in chunks of N tokens, the logits never whole (default: "
        "automatic, where a window's logits exceed 2 GiB; 0: whole); grpo: micro-batches of at most N completion "
        "tokens (default: <= 512 MiB of logits each)",
    )
    f.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack several examples (JSONL rows) into each window, each attending only to itself with its positions "
        "from 0 (sequence packing, TRL's padding_free): no compute spent on padding; --method dpo/orpo: a step's "
        "pairs in one window, each prompt once (default there: on a CUDA GPU with flash attention)",
    )
    f.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        help="clip the gradients to this global L2 norm before each step (transformers' and TRL's max_grad_norm, "
        "there 1.0 by default; default here: no clipping)",
    )


def _finetune_parser(sub) -> None:
    f = sub.add_parser(
        "finetune",
        help="fine-tune a GGUF model (full, or LoRA) on JSONL examples or text (llama_opt_*)",
        formatter_class=HelpFormatter,
    )
    add_model(f, "model name or GGUF path (full fine-tunes: converted to F32 if needed)")
    add_hf(f)
    f.add_argument(
        "--data",
        required=True,
        help="JSONL ({text} / {prompt, completion} / {messages[, tools]} per line), a UTF-8 text file, or a 🤗 "
        "dataset with such columns: a folder, a parquet/CSV/JSON file, or a Hub id org/name[:split] (the train extra)",
    )
    f.add_argument(
        "--method",
        choices=["sft", "dpo", "orpo", "grpo"],
        default="sft",
        help="sft: next-token cross-entropy on --data's examples; dpo, orpo: preference tuning on --data's pairs "
        "(JSONL {prompt, chosen, rejected}, text or messages, as TRL), --batch pairs a step; grpo: reinforcement "
        "learning from --reward's rewards of completions of --data's prompts, --batch completions a step "
        "(default: sft)",
    )
    f.add_argument(
        "--beta",
        type=float,
        default=None,
        help="--method dpo: DPO's beta; orpo: ORPO's lambda (default 0.1); grpo: the KL coefficient (default 0)",
    )
    f.add_argument("--no-prompt-loss", action="store_true", help=_NO_PROMPT_LOSS)
    f.add_argument("--valid", default=None, help="held-out file of the same kinds (instead of --val-split)")
    f.add_argument("--test", default=None, help="held-out file: its loss and perplexity after training")
    f.add_argument("--train-on-prompt", action="store_true", help="count the loss on every token, not only the answers")
    f.add_argument("--chat-template-file", default=None, help="jinja chat template instead of the GGUF's")
    f.add_argument("--output", "-o", required=True, help="the tuned model's GGUF path (the adapter's, with LoRA)")
    f.add_argument("--lora-rank", type=int, default=None, help="train a LoRA adapter of this rank instead")
    f.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    f.add_argument(
        "--lora-targets",
        default="attn_q,attn_v",
        help="comma-separated matrices (attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down), or all-linear",
    )
    f.add_argument("--epochs", "-epochs", type=int, default=1, help="passes over the training windows")
    f.add_argument("--iters", type=int, default=None, help="optimizer steps in all (instead of --epochs)")
    f.add_argument(
        "--lr", "-lr", "--learning-rate", dest="lr", type=float, default=1e-5, help="learning rate (default 1e-5)"
    )
    f.add_argument(
        "--lr-schedule", choices=["constant", "cosine", "linear"], default="constant", help="the learning rate's decay"
    )
    f.add_argument("--warmup", type=int, default=0, help="steps of linear warmup (default 0)")
    f.add_argument("--min-lr", type=float, default=0.0, help="where cosine/linear decay heads (default 0)")
    f.add_argument("--steps-per-eval", type=int, default=None, help="validate every N steps too")
    f.add_argument("--steps-per-report", type=int, default=None, help="print loss, lr, tokens/s, ETA every N steps")
    f.add_argument("--log", default=None, help="JSONL file: one line per step and per validation")
    f.add_argument("--optimizer", "-opt", choices=["adamw", "sgd"], default="adamw", help="ggml-opt's optimizer")
    f.add_argument("--weight-decay", "-wd", type=float, default=0.0, help="decoupled weight decay, in [0, 1]")
    add_ctx_size(f, 256, "tokens per window, a multiple of 256")
    f.add_argument(
        "--val-split", "-val-split", type=float, default=0.1, help="fraction of windows held out (default 0.1)"
    )
    f.add_argument("--batch", type=int, default=1, help="windows per optimizer step, run as one graph")
    f.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step (gradient accumulation; divides --batch)"
    )
    f.add_argument(
        "--freeze-embeddings", action="store_true", help="full fine-tune: leave token_embd (and a tied output) as is"
    )
    f.add_argument("--seed", "-s", type=int, default=0, help="shuffling seed")
    f.add_argument(
        "--precision",
        choices=["auto", "bf16", "f32"],
        default="auto",
        help="products of F32 weights: bf16 (BF16 with F32 accumulation where the backend has it: CUDA from "
        "Ampere on, CPUs with AVX512_BF16; F32 elsewhere), f32, or auto (bf16 on a GPU, f32 on the CPU; default)",
    )
    f.add_argument(
        "--flash-attn",
        "-fa",
        choices=["auto", "on", "off"],
        default="auto",
        help="flash attention in training, with its backward pass: auto (on when the model runs on a GPU), on, "
        "off (default: auto)",
    )
    _add_memory_and_step_options(f)
    add_grpo_options(f)
    add_ddp_options(f)
    add_threads(f)
    add_ngl(f)
    f.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    f.add_argument("--save-every", type=int, default=None, help="write a checkpoint every N steps (and at the end)")
    f.add_argument(
        "--checkpoint-dir", default=None, help="where checkpoints go (default: OUTPUT's name + '-checkpoints')"
    )
    f.add_argument(
        "--resume", default=None, metavar="CHECKPOINT", help="continue from a checkpoint (or a directory's newest)"
    )
    f.set_defaults(fn=_finetune)


def _eval_and_fuse_parsers(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="loss and perplexity on JSONL examples or text (the finetune masking rules); DPO/ORPO metrics on pairs",
        formatter_class=HelpFormatter,
    )
    add_model(ev)
    add_hf(ev)
    add_lora(ev)
    ev.add_argument("--adapter", action="append", dest="lora", metavar="FILE", help="the same as --lora")
    ev.add_argument("--data", default=None, help="as finetune --data: JSONL, a text file, or a 🤗 dataset")
    pairs_help = "preference pairs (JSONL in TRL's formats) instead of --data: DPO's or ORPO's metrics"
    ev.add_argument("--pairs", default=None, metavar="FILE", help=pairs_help)
    ev.add_argument("--method", choices=["dpo", "orpo"], default="dpo", help="with --pairs: the loss")
    ev.add_argument("--beta", type=float, default=0.1, help="with --pairs: DPO's beta, ORPO's lambda")
    ev.add_argument("--no-prompt-loss", action="store_true", help=_NO_PROMPT_LOSS)
    add_ctx_size(ev, 256, "tokens per window")
    ev.add_argument("--train-on-prompt", action="store_true", help="count every token, not only the answers")
    ev.add_argument("--chat-template-file", default=None, help="jinja chat template instead of the GGUF's")
    add_threads(ev)
    add_ngl(ev)
    ev.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="a tqdm bar over the windows with the running loss (default: where stderr is a terminal)",
    )  # fmt: skip
    ev.set_defaults(fn=_eval)
    fu = sub.add_parser(
        "fuse",
        help="merge a LoRA adapter into its base model: one GGUF",
        formatter_class=HelpFormatter,
    )
    add_model(fu, "the base model (name or GGUF path)")
    add_hf(fu)
    fu.add_argument("--lora", "--adapter", dest="lora", required=True, metavar="FILE", help="the LoRA adapter to merge")
    fu.add_argument("--output", "-o", required=True, help="the fused GGUF")
    fu.add_argument("--scale", type=float, default=1.0, help="the adapter's scale")
    fu.add_argument("--quantize", default=None, help="requantize the result: F16, Q8_0, Q4_0, Q4_1, ...")
    add_threads(fu)
    fu.set_defaults(fn=_fuse)
