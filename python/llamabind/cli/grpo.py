"""``finetune --method grpo``'s options and run (issue 85): reward functions loaded from Python files, TRL's
GRPOConfig settings from the command line, train.grpo, TRL's metric names in the report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from .ddp import main_rank


def add_grpo_options(f) -> None:
    """The GRPO options of finetune (TRL GRPOConfig's names as flags)."""
    g = f.add_argument_group("--method grpo (TRL's GRPOConfig; --data holds prompts: JSONL {prompt[, columns]})")
    g.add_argument(
        "--reward", action="append", default=None, metavar="FILE.py:FUNC",
        help="a reward function f(prompts, completions, completion_ids, **columns) -> list[float | None] in a Python "
        "file (repeat for several; their rewards are summed, weighted by --reward-weights)",
    )  # fmt: skip
    g.add_argument("--reward-weights", default=None, help="comma-separated weights, one per --reward (default: 1 each)")
    g.add_argument("--num-generations", type=int, default=8, help="completions per prompt, G (default 8)")
    g.add_argument("--max-completion-length", type=int, default=512, help="tokens a completion may have (512)")
    g.add_argument("--max-prompt-length", type=int, default=None, help="keep a prompt's last N tokens (default: all)")
    g.add_argument("--temperature", type=float, default=1.0, help="the rollouts' sampling temperature (1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="the rollouts' top_p (1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="the rollouts' top_k (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="the rollouts' min_p (0: off)")
    g.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clipping: 1 - epsilon (0.2)")
    g.add_argument("--epsilon-high", type=float, default=None, help="the ratio's clipping: 1 + epsilon_high")
    g.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per generation batch (1)")
    g.add_argument("--loss-type", choices=["dapo", "grpo", "dr_grpo", "bnpo"], default="dapo", help="(dapo)")
    g.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group", help="(group)")
    g.add_argument(
        "--mask-truncated-completions", action="store_true", help="completions cut at the length limit do not train"
    )


def load_reward(spec: str):
    """The callable FUNC of ``FILE.py:FUNC``. FileNotFoundError (no file), ValueError (no FUNC there, not
    callable, or the spec's form)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--reward {spec!r}: give FILE.py:FUNC (a function in a Python file)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--reward: no such file: {path}")
    mod_spec = importlib.util.spec_from_file_location(f"llamabind_reward_{Path(path).stem}", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    f = getattr(mod, name, None)
    if not callable(f):
        raise ValueError(f"--reward {spec!r}: {path} has no function {name!r}")
    return f


def grpo_config(args) -> Any:
    """The command line's train.GRPOConfig, checked."""
    from .. import train

    weights = None
    if args.reward_weights:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            raise ValueError(f"--reward-weights {args.reward_weights!r}: comma-separated numbers") from None
    return train.GRPOConfig(
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_prompt_length=args.max_prompt_length, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, beta=0.0 if args.beta is None else args.beta, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, num_iterations=args.num_iterations, loss_type=args.loss_type,
        scale_rewards=args.scale_rewards, mask_truncated_completions=args.mask_truncated_completions,
        reward_weights=weights, seed=args.seed,
    )  # fmt: skip


def prepare_grpo(args) -> tuple[Any, list]:
    """(GRPOConfig, reward functions) of the command line, checked before the model loads."""
    if not args.reward:
        raise ValueError("--method grpo needs --reward FILE.py:FUNC (a reward function)")
    return grpo_config(args), [load_reward(s) for s in args.reward]


def run_grpo(args, m, settings, resume, prepared):
    """finetune --method grpo: train.grpo on the prompts of --data (and --valid) with --reward's functions
    (``prepared``: :func:`prepare_grpo`'s)."""
    from .. import train

    config, funcs = prepared
    prompts = train.read_prompts(args.data, m)
    valid = train.read_prompts(args.valid, m) if args.valid else None
    if main_rank():
        print(f"{len(prompts)} prompts from {args.data}", file=sys.stderr)
    res = train.grpo(m, prompts, funcs, settings, config, valid=valid, resume=resume)
    if not main_rank():  # rank 0 of a data-parallel run reports
        return res
    if res.val_before is not None:
        print(f"held-out prompts before: mean reward {res.val_before:.4f}")
    G = config.num_generations
    print(f"{res.steps} optimizer steps of {args.batch} completion(s) ({args.batch // G} prompt(s) x {G}), grpo "
          f"({config.loss_type}) with beta {config.beta}")  # fmt: skip
    if res.metrics:
        first, last = res.metrics[0], res.metrics[-1]
        print(f"reward {first['reward']:.4f} at the first step, {last['reward']:.4f} at the last; completion length "
              f"{last['completions/mean_length']:.1f}")  # fmt: skip
    if res.evals:
        print(f"held-out prompts after: mean reward {res.evals[-1][1]:.4f}")
    if res.interrupted:
        print(f"interrupted after {res.steps} steps; saving what was trained", file=sys.stderr)
    return res
