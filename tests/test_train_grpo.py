"""Issue 85: GRPO. The loss and its gradient against TRL 1.16's GRPOTrainer itself (its own ``_compute_loss`` and
autograd, tests/grpo_reference.py in the side venv), the advantages against TRL's formula as its source computes it,
the run end to end (rollouts, rewards, a LoRA step), bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import GPU_BUILD, reference_job
from hypothesis import given, settings
from hypothesis import strategies as st

import llamabind
from llamabind import train

# per case: TRL's loss_type, beta, old log-probabilities moved off the policy's (num_iterations > 1: the ratio
# clipped where it leaves [1 - epsilon, 1 + epsilon_high]), the KL's bias correction, epsilon_high, temperature
CASES = [
    dict(name="dapo", loss_type="dapo", beta=0.0, off_policy=False, bias=True, epsilon_high=None, temperature=1.0),
    dict(name="grpo-kl", loss_type="grpo", beta=0.04, off_policy=False, bias=True, epsilon_high=None, temperature=1.0),
    dict(name="bnpo-clipped", loss_type="bnpo", beta=0.0, off_policy=True, bias=True, epsilon_high=None,
         temperature=1.0),
    dict(name="dr_grpo-kl-clipped", loss_type="dr_grpo", beta=0.1, off_policy=True, bias=False, epsilon_high=0.28,
         temperature=0.7),
]  # fmt: skip
ANSWERS = [" 4<|im_end|>", "The answer is 4.<|im_end|>", "2 + 2 equals five, I think, or", "Four.<|im_end|>"]
ADVANTAGES = [1.2, -0.5, 0.3, -1.0]
WEIGHTS = {"blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
           "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
           "output_norm.weight": "model.norm.weight"}  # fmt: skip


def _tensors(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {t.name: np.array(t.data, np.float64).reshape(-1) for t in r.tensors if t.name in WEIGHTS}


def _ours(path, tmp_path, case: dict, prompt: list[int], completions: list[list[int]], rng,
          f32: bool = False) -> tuple[dict, dict]:  # fmt: skip
    """One SGD step at lr 1 over the case's completions: (what the reference gets, our loss, log-probs and
    gradients: the weights' change). ``f32``: F32 products and composed attention (precision="f32",
    flash_attn=False) where the model is offloaded, instead of the GPU's defaults."""
    n, W = len(completions), 256
    win = np.zeros((n, W + 1), np.int32)
    lab = np.full((n, W), -1, np.int32)
    T = max(len(c) for c in completions)
    mask = np.zeros((n, T))
    for i, c in enumerate(completions):
        seq = prompt + c
        win[i, : len(seq)] = seq
        lab[i, len(prompt) - 1 : len(seq) - 1] = c
        mask[i, : len(c)] = 1
    sel = mask > 0
    with llamabind.Model(path, n_threads=2, repack=False, use_mmap=False) as m:  # offloaded in a GPU build
        tr = train.Trainer(m, ctx_size=W, batch_size=n, optimizer="sgd", lr=1.0, max_grad_norm=1e30, n_threads=2,
                           loss="grpo", beta=case["temperature"],
                           **(dict(precision="f32", flash_attn=False) if f32 else {}))  # fmt: skip
        with tr:
            tr.optimizer.eval(win, False, lab, np.zeros(int(sel.sum())))
            logp = np.zeros((n, T))
            logp[sel] = tr.optimizer.seq_logps()
            shift = lambda s: np.where(sel, logp + rng.uniform(-s, s, logp.shape), 0.0)  # noqa: E731
            old = shift(0.4) if case["off_policy"] else None
            if old is not None and m.output_offloaded:
                # on a GPU (log-probabilities within 0.3 nats of TRL's): every log-ratio 0.55-0.8 nats from 0, at
                # least 0.3 from both clip boundaries (log 0.8, log 1.28), so no clip decision hangs on the rounding
                u = rng.uniform(0.55, 0.8, logp.shape) * rng.choice([-1.0, 1.0], logp.shape)
                old = np.where(sel, logp + u, 0.0)
            ref = shift(0.5) if case["beta"] else None
            # (shift: added to old and ref, as the reference does to give TRL our ratios: matched runs)
            loss_of = lambda lp, shift=0.0: train.token_loss(  # noqa: E731
                lp, None if old is None else old + shift, None if ref is None else ref + shift, np.array(ADVANTAGES),
                mask, loss_type=case["loss_type"], beta=case["beta"],
                epsilon=0.2, epsilon_high=case["epsilon_high"] or 0.2, bias_correction_kl=case["bias"],
                max_completion_length=16, n_items=float(mask.sum()), grad_accum=1,
            )  # fmt: skip
            tl = loss_of(logp)
            tr.optimizer.eval(win, True, lab, tl.coef[sel])
            norm = tr.optimizer.grad_norm()
        out = tmp_path / f"{case['name']}-{f32}.gguf"
        m.save(out)
        on_gpu = bool(m.output_offloaded)
    before, after = _tensors(path), _tensors(out)
    # BF16 on a GPU (the defaults): TRL gets our log-probabilities and shifts old and ref by its own minus ours, so
    # that its ratios and log-ratios to the reference are ours (the docstring)
    matched = on_gpu and not f32
    ours = dict(loss=tl.loss, logps=logp, grad_norm=norm, clipped=tl.clipped, loss_of=loss_of, coef=tl.coef,
                grads={k: before[k] - after[k] for k in WEIGHTS}, on_gpu=on_gpu, matched=matched)  # fmt: skip
    rows = lambda x: None if x is None else [x[i, : len(c)].tolist() for i, c in enumerate(completions)]  # noqa: E731
    job = dict(name=case["name"], prompt=prompt, completions=completions, advantages=ADVANTAGES, old=rows(old),
               ref=rows(ref), loss_type=case["loss_type"], beta=case["beta"], epsilon=0.2,
               epsilon_high=case["epsilon_high"], max_completion_length=16, use_bias_correction_kl=case["bias"],
               temperature=case["temperature"], ours=rows(logp) if matched else None)  # fmt: skip
    return job, ours


def test_grpo_loss_and_gradient_equal_trls(smollm2_f32_cut, reference_python, tmp_path):
    """TRL 1.16's GRPOTrainer._compute_loss and its autograd against llamabind's GRPO loss (train.token_loss on
    the host, the training graph's sum of coefficient x log-probability) on the same prompt, four completions
    (three ending in <|im_end|>, one cut off) and advantages, every weight of SmolLM2's F32 blocks (CPU, F32 on
    both sides). Cases: TRL's default dapo; grpo with the k3 KL to a reference (bias-corrected); bnpo and
    dr_grpo with old log-probabilities moved up to +-0.4 nats from the policy's, so that ratios are clipped (both
    sides clip: the case asserts some were), dr_grpo with epsilon_high 0.28, temperature 0.7, KL without the
    bias correction.

    - per token log-probabilities (log softmax(logits / temperature)): within 5e-5 nats (measured 1.9e-5 at
      temperature 1, 3.1e-5 at 0.7: F32 forward passes of four blocks and 49,152 logits in two programs);
    - the loss: train.token_loss of TRL's own log-probabilities within 1e-5 of TRL's loss relative to the sum of
      its terms' magnitudes (the issue's bound for F32; the terms cancel: grpo-kl's loss is 1.6e-3 of terms
      summing to ~0.2, which TRL adds in F32); of ours within 5e-5 x sum |d loss / d logp| (+1e-7) of it: the
      log-probabilities' difference moves it by at most that to first order;
    - the gradient's global norm (ggml-opt's, patch 0094) within 1e-4 relative, and the gradients of three
      weights whose layout is the GGUF's (blk.0.attn_v, blk.1.ffn_down, output_norm: an SGD step at lr 1 reads
      them off as the weights' change, F32 weights of ~0.05 round the difference at ~3e-9) within 1e-3 of their
      norm: F32 sums over 49,152 logits and 576-wide products in another order than PyTorch's.

    In a GPU build the model is offloaded and every case runs twice against TRL in F32: as a user's would train
    there (the defaults: BF16 products with F32 accumulation, flash attention) and with precision="f32" and
    flash_attn=False (ggml-cuda's cuBLAS handles run F32 products in TF32: 10-bit mantissas). The issue's "on CUDA
    within bf16's tolerance": BF16 keeps 8 mantissa bits (operands rounded by up to 2^-9 = 2e-3 relative), which
    moves four blocks' 576-wide products and 49,152 logits by up to a few tenths of a nat: log-probabilities within
    0.3 nats (measured on an H100 with the defaults: 0.14 at temperature 1, 0.20 at 0.7), our loss within 0.3 x
    sum |d loss / d logp| of TRL's (the first-order bound at that gap), the gradient norm within 2% and the three
    gradients within 5% of their norm (measured 0.2% and 1.2% for the unclipped cases; a wrong clip, mask or
    normalization moves them by 20-100%). A token's coefficient in the clipped cases is its advantage times its
    ratio exp(logp - old): a log-probability off by d nats scales it by up to e^d - 1 (15% at BF16's 0.14; on an
    H100 the clipped cases' gradients came 7-19% from TRL's, bench/results/h100-2026-12-06b). So in the BF16 run TRL
    gets our log-probabilities and shifts old and ref by its own minus ours (tests/grpo_reference.py): its ratios and
    log-ratios to the reference are ours, TRL's loss equals ours at TRL's log-probabilities and the same shift to
    1e-5 as on the CPU, and what the gradient bounds measure is BF16's error in each token's gradient. The TF32 run
    keeps TRL's own ratios (its log-probabilities lie within 0.04 nats of TRL's), its clipped cases' bounds widened
    by e^d - 1. The old log-probabilities of the clipped cases are drawn 0.55-0.8 nats from the policy's there
    (below or above it), so that every ratio lies at least 0.3 nats from a clip boundary: with the +-0.4 of the
    CPU's draw a gap of 0.2 nats flipped the clip decisions of tokens near a boundary and the gradients came 12-121%
    apart (bench/results/h100-2026-12-06-profiles). Each clipped case asserts that no token's clip decision differs
    between our log-probabilities and TRL's.

    Every case's gaps are printed before any is asserted."""
    if os.environ.get("LLAMABIND_REFERENCE_PYTHON") and subprocess.run([str(reference_python), "-c", "import trl"],
                                                                      capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("the reference Python given by LLAMABIND_REFERENCE_PYTHON has no trl (carry its wheel)")
    with llamabind.Model(smollm2_f32_cut, vocab_only=True) as v:
        text = v.chat_templates().render([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
        prompt = v.tokenize(text, add_special=False, parse_special=True)
        completions = [v.tokenize(a, add_special=False, parse_special=True) for a in ANSWERS]
    rng = np.random.default_rng(0)
    runs = [(case, f32, case["name"] + ("-f32" if f32 else "")) for case in CASES
            for f32 in ((False, True) if GPU_BUILD else (False,))]  # fmt: skip
    jobs, ours = [], {}
    for case, f32, name in runs:
        job, o = _ours(smollm2_f32_cut, tmp_path, case, prompt, completions, rng, f32)
        job["name"] = name
        jobs.append(job)
        ours[name] = o
    theirs = reference_job(reference_python, "grpo_reference.py", tmp_path, {"gguf": str(smollm2_f32_cut),
                                                                             "cases": jobs})  # fmt: skip
    gaps = {}
    for name, o in ours.items():
        t = theirs[name]
        lp = np.concatenate([o["logps"][i, : len(c)] for i, c in enumerate(completions)])
        rel = {k: np.linalg.norm(o["grads"][k] - np.asarray(t["grads"][h])) / np.linalg.norm(t["grads"][h])
               for k, h in WEIGHTS.items()}  # fmt: skip
        t_lp = np.zeros_like(o["logps"])
        for i, row in enumerate(t["logps"]):
            t_lp[i, : len(row)] = row
        # ours at TRL's log-probabilities (with the same shift of old and ref as TRL's where matched)
        at_theirs = o["loss_of"](t_lp, t_lp - o["logps"] if o["matched"] else 0.0)
        gaps[name] = (np.abs(lp - np.concatenate(t["logps"])).max(), at_theirs, rel)
        print(f"{name} ({'GPU' if o['on_gpu'] else 'CPU'}): loss {o['loss']:.8f} / TRL {t['loss']:.8f} (gap "
              f"{abs(o['loss'] - t['loss']) / np.abs(o['coef']).sum():.1e} of sum |coef|); logps {gaps[name][0]:.1e}; "
              f"grad_norm {o['grad_norm']:.6f} / {t['grad_norm']:.6f}; grads {rel}; "
              f"clipped {o['clipped']}")  # fmt: skip
    for case, _, name in runs:
        o, t = ours[name], theirs[name]
        d_lp, at_theirs, rel = gaps[name]
        # (log-probs, loss per sum |coef|, grad norm, grads) bounds: CPU F32; GPU, BF16 or TF32 (the docstring),
        # the ratios' error added where they are not matched and the old log-probabilities are not the policy's
        b_lp, b_norm, b_grad = (0.3, 2e-2, 5e-2) if o["on_gpu"] else (5e-5, 1e-4, 1e-3)
        if o["on_gpu"] and case["off_policy"] and not o["matched"]:
            b_norm, b_grad = b_norm + np.expm1(d_lp), b_grad + np.expm1(d_lp)
        assert d_lp <= b_lp, name
        assert abs(at_theirs.loss - t["loss"]) <= 1e-5 * at_theirs.magnitude, name
        assert abs(o["loss"] - t["loss"]) <= b_lp * np.abs(o["coef"]).sum() + 1e-7, name
        if case["off_policy"]:
            assert o["clipped"][2] > 0, name
            assert at_theirs.clipped == o["clipped"], (name, at_theirs.clipped, o["clipped"])
        assert o["grad_norm"] == pytest.approx(t["grad_norm"], rel=b_norm), name
        assert max(rel.values()) <= b_grad, (name, rel)


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def test_grpo_learns_a_verifiable_reward_on_held_out_prompts(model_path):
    """The issue's "it learns", measured without sampling noise: SmolLM2-135M-Instruct (Q4_1, a QLoRA adapter of rank
    8) trained with GRPO (G = 4, two prompts a step, TRL's dapo loss) on a reward for answering "What is a plus b?"
    with a digit first (1 when the completion's first token's text begins with a digit). The reward's expectation
    on three held-out questions is the probability of such a first token, read from the logits (float64 softmax
    over the vocabulary) with the trained adapter: 0.30 before (the base model mostly begins with words); after
    four steps it must have risen by more than 0.2 (measured 0.30 -> 0.8-0.98 over these settings' runs)."""
    with llamabind.Model(model_path, n_threads=2, repack=False, n_gpu_layers=0) as m:
        digit = np.array([m.detokenize([t]).strip()[:1].isdigit() for t in range(m.n_vocab)])
        tpl = m.chat_templates()
        held = [f"What is {a} plus {b}?" for a, b in [(1, 6), (2, 7), (4, 4)]]
        held_ids = [m.tokenize(tpl.render(_chat(q), add_generation_prompt=True), parse_special=True) for q in held]

        def p_digit(adapter) -> float:
            out = []
            with llamabind.Context(m, n_ctx=512, n_threads=2) as ctx:
                if adapter is not None:
                    ctx.set_lora(adapter, 1.0)
                for ids in held_ids:
                    ctx.clear()
                    z = ctx.eval(ids)[-1].astype(np.float64)
                    p = np.exp(z - z.max())
                    out.append(p[digit].sum() / p.sum())
            return float(np.mean(out))

        def first_digit(completion_ids, **kw):
            return [1.0 if digit[c[0]] else 0.0 for c in completion_ids]

        before = p_digit(None)
        pairs = [(2, 3), (4, 1), (6, 2), (5, 5), (7, 1), (3, 3), (8, 4), (9, 2)]
        r = train.grpo(
            m, [{"prompt": _chat(f"What is {a} plus {b}?")} for a, b in pairs], first_digit, lora_rank=8,
            batch_size=8, iters=4, lr=3e-3, val_split=0.0, progress=False, n_threads=2,
            config=train.GRPOConfig(num_generations=4, max_completion_length=2),
        )  # fmt: skip
        after = p_digit(r.adapter)
    print(
        f"P(digit first) on held-out prompts: {before:.3f} -> {after:.3f}; rewards {[x['reward'] for x in r.metrics]}"
    )
    assert r.steps == 4 and len(r.metrics) == 4
    assert after > before + 0.2


def test_grpo_refuses_bad_input_and_trains_nothing(smollm2_f32_cut):
    """The issue's bad input: no prompts, num_generations < 2, a batch that is not whole groups, a prompt +
    max_completion_length beyond the model's context, a reward function that raises or returns the wrong
    length or a non-number: a clear error naming it, and the model's logits unchanged (nothing trained).
    Completions that never end stop at max_completion_length; under mask_truncated_completions a batch of only
    truncated ones still steps (a token with coefficient 0) and changes nothing."""
    prompts = [{"prompt": "Count: one two", "k": 1}, {"prompt": "Say a word:", "k": 2}]
    cfg = train.GRPOConfig(num_generations=2, max_completion_length=4)
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, use_mmap=False) as m:
        probe = m.tokenize("Count: one two three")

        def logits() -> np.ndarray:
            with llamabind.Context(m, n_ctx=256, n_threads=2) as ctx:
                return ctx.eval(probe)[-1].copy()

        z0 = logits()
        ok = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
        kw = dict(batch_size=2, iters=1, val_split=0.0, progress=False, n_threads=2)
        with pytest.raises(ValueError, match="no prompts"):
            train.grpo(m, [], ok, config=cfg, **kw)
        with pytest.raises(ValueError, match="num_generations"):
            train.GRPOConfig(num_generations=1)
        with pytest.raises(ValueError, match="multiple of num_generations"):
            train.grpo(m, prompts, ok, config=cfg, **{**kw, "batch_size": 3})
        with pytest.raises(ValueError, match="exceed the model's context"):
            train.grpo(m, prompts, ok, config=train.GRPOConfig(num_generations=2, max_completion_length=9000), **kw)
        with pytest.raises(ValueError, match="at least one reward function"):
            train.grpo(m, prompts, [], config=cfg, **kw)

        def boom(completions, **kw):
            raise KeyError("answer")

        def short(completions, k, **kw):  # the rows' other columns arrive as lists
            assert k == [1, 1] or k == [2, 2]
            return [1.0]

        def text(completions, **kw):
            return ["high"] * len(completions)

        for f, err, match in [(boom, RuntimeError, "'boom' raised KeyError"), (short, ValueError, "'short' returned 1"),
                              (text, ValueError, "'text': reward 0 is 'high'")]:  # fmt: skip
            with pytest.raises(err, match=match):
                train.grpo(m, prompts, [ok, f], config=cfg, **kw)
        np.testing.assert_array_equal(logits(), z0)
        never = train.GRPOConfig(num_generations=2, max_completion_length=3, mask_truncated_completions=True)
        seen = []

        def ends(completion_ids, **kw):
            seen.extend(len(c) for c in completion_ids)
            return [float(len(c)) for c in completion_ids]

        r = train.grpo(m, prompts[:1], ends, config=never, **kw)
        assert r.steps == 1 and max(seen) <= 3
        assert all(n == 3 for n in seen)  # the 4-block cut never ends a completion this early
        np.testing.assert_array_equal(logits(), z0)  # every completion truncated and masked: nothing trained


def test_cli_finetune_grpo(smollm2_f32_cut, tmp_path):
    """``python -m llamabind finetune --method grpo --data prompts.jsonl --reward rewards.py:FUNC --num-generations 2``:
    the reward functions load from a file (a column of the JSONL reaches them), the steps report the mean reward,
    the log has TRL's metric names, the adapter loads and generates (``generate --lora``); a bad --reward is a
    clear error (exit 2, no traceback)."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Say {w}."}], "word": w} for w in ("yes", "no", "hi", "ok")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def says_it(prompts, completions, word, **kw):\n"
        "    return [float(w in c[0]['content'].lower()) for c, w in zip(completions, word)]\n"
        "def brief(completions, **kw):\n"
        "    return [-len(c[0]['content']) / 50 for c in completions]\n"
    )
    out, log = tmp_path / "grpo.gguf", tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "llamabind", "finetune", "-m", str(smollm2_f32_cut), "--method", "grpo", "--data",
           str(data), "--reward", f"{rewards}:says_it", "--reward", f"{rewards}:brief", "--reward-weights", "1,0.5",
           "--num-generations", "2", "--max-completion-length", "6", "--lora-rank", "8", "--lr", "1e-4", "--batch",
           "4", "--grad-accum", "2", "--iters", "2", "--val-split", "0.25", "-o", str(out), "-t", "2",
           "--no-progress", "--steps-per-report", "1", "--log", str(log), "--beta", "0.04"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out prompts before: mean reward" in r.stdout and "held-out prompts after:" in r.stdout, r.stdout
    assert "2 optimizer steps of 4 completion(s) (2 prompt(s) x 2), grpo (dapo) with beta 0.04" in r.stdout
    assert "step 2/2: loss" in r.stderr and "4 prompts from" in r.stderr, r.stderr
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in logged] == [1, 2]
    for k in ("loss", "reward", "reward_std", "kl", "rewards/says_it/mean", "rewards/brief/mean",
              "completions/mean_length", "clip_ratio/region_mean", "frac_reward_zero_std"):  # fmt: skip
        assert all(np.isfinite(x[k]) for x in logged), k
    g = subprocess.run([sys.executable, "-m", "llamabind", "generate", "-m", str(smollm2_f32_cut), "--lora", str(out),
                        "--prompt", "Say yes.", "-n", "4", "--temp", "0", "-t", "2"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert g.returncode == 0, g.stderr[-2000:]
    bad = subprocess.run([a.replace(":says_it", ":nothing") for a in cmd], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "has no function 'nothing'" in bad.stderr and "Traceback" not in bad.stderr


def test_grpo_resumes_from_a_checkpoint_as_if_never_stopped(smollm2_f32_cut, tmp_path):
    """save_every / checkpoint_dir and resume=: a LoRA GRPO run of 4 steps (checkpoints at steps 2 and 4) against the
    same run stopped at step 2 and resumed from its checkpoint: the prompts come in the same order, the rollouts are
    seeded by the step and AdamW's state is restored, so the losses of steps 3-4 and the final adapter are the
    same numbers (the CPU's sums are deterministic). A checkpoint of another run (another num_generations) is
    refused, naming the difference."""
    prompts = [f"Name a colour number {i}:" for i in range(6)]

    def reward(completions, **kw):
        return [float(len(c)) / 10 for c in completions]

    cfg = train.GRPOConfig(num_generations=2, max_completion_length=4)
    kw = dict(lora_rank=4, batch_size=4, grad_accum=2, lr=1e-3, val_split=0.0, progress=False, n_threads=2)
    runs = {}
    for name, iters, resume in (("whole", 4, None), ("first", 2, None), ("resumed", 4, "first")):
        with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, n_gpu_layers=0) as m:
            ck = tmp_path / name if resume is None else tmp_path / resume
            r = train.grpo(m, prompts, reward, config=cfg, iters=iters, save_every=2, checkpoint_dir=ck,
                           resume=None if resume is None else ck, **kw)  # fmt: skip
            r.adapter.save(tmp_path / f"{name}.gguf")
            runs[name] = r
    assert [c.name for c in runs["whole"].checkpoints] == ["step-0000002", "step-0000004"]
    assert runs["resumed"].steps == 4 and runs["resumed"].losses[:2] == runs["first"].losses
    np.testing.assert_array_equal(runs["resumed"].losses, runs["whole"].losses)
    a, b = gguf.GGUFReader(tmp_path / "whole.gguf"), gguf.GGUFReader(tmp_path / "resumed.gguf")
    for x, y in zip(a.tensors, b.tensors):
        np.testing.assert_array_equal(np.array(x.data), np.array(y.data), err_msg=x.name)
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, n_gpu_layers=0) as m:
        other = train.GRPOConfig(num_generations=4, max_completion_length=4)
        with pytest.raises(ValueError, match="cannot resume .* grpo"):
            train.grpo(m, prompts, reward, config=other, iters=4, resume=tmp_path / "first", **kw)


def test_packed_completions_train_as_their_windows(smollm2_f32_cut):
    """GRPO packs a micro-batch's completions back to back into one window by default (each its own document: its
    positions from 0, attending to itself; train.pack_completions), where pack=False gives each completion a
    window of its own padded to 256 tokens. Two optimizer steps on one generation batch (num_iterations 2, beta
    0.04: the forward pass's log-probabilities, the reference's and the clipped ratio all in play), grad_accum 2:
    the same rollouts, and losses, KL and clip ratios within 2e-5 of each other on the CPU (F32 sums of other
    lengths: measured ~1e-7)."""
    prompts = ["The colour of the sky is", "Two plus two is", "My favourite animal is", "Water is"]

    def reward(completions, **kw):
        return [float(len(c)) / 10 for c in completions]

    cfg = train.GRPOConfig(num_generations=2, max_completion_length=6, beta=0.04, num_iterations=2)
    out = {}
    for pack in (True, False):
        with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, n_gpu_layers=0) as m:
            r = train.grpo(m, prompts, reward, config=cfg, pack=pack, lora_rank=4, lr=1e-3, batch_size=4,
                           grad_accum=2, iters=2, val_split=0.0, progress=False, n_threads=2)  # fmt: skip
            out[pack] = r.metrics
    for a, b in zip(out[True], out[False]):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        for k in ("loss", "kl", "clip_ratio/region_mean"):
            assert a[k] == pytest.approx(b[k], abs=2e-5), (k, a[k], b[k])
    print([(round(x["loss"], 7), round(y["loss"], 7)) for x, y in zip(out[True], out[False])])


def test_split_micro_batches_train_the_same_steps(smollm2_f32_cut):
    """GRPO splits a micro-batch whose loss's logits would be large into smaller ones (train.grpo's
    loss_chunk_tokens; train.grpo.loss_splits): 1 completion of <= 6 tokens a micro-batch at loss_chunk_tokens=6
    (8 micro-batches a step), packed and a window each, against the whole batch of 8 (loss_chunk_tokens=0). The
    loss's coefficients are scaled by the count as ggml-opt averages the micro-batches' gradients, so the same
    rollouts give the same losses, KL and clip ratios (two steps on one generation batch, beta 0.04: the ratio,
    the reference and the clipping in play) within 2e-5 on the CPU (F32 sums of other lengths; the second step's
    after the first's update). In a GPU build the training context offloads the large products to the GPU (BF16
    with F32 sums, kernels picked by the row count): within 1e-3 there (an H100 gave -0.020666 split against
    -0.020817 whole, 2026-12-05). The first step's loss is 0 (ratio 1, advantages summing to 0), the second's
    -0.0209 comes from the first update alone: a gradient 8x or 2x off moves it by 0.018 or 0.01. SGD, whose step
    is proportional to the gradient: AdamW's is not, and hid a gradient 8x too small."""
    from llamabind.train.grpo import loss_splits

    assert loss_splits(32, 256, 49152, None) == 4  # 8 x 256 rows x 49,152 x 4 B = 402 MB <= 512 MiB
    assert loss_splits(32, 256, 49152, 0) == 1 and loss_splits(6, 100, 10, 250) == 3 and loss_splits(5, 9, 9, 1) == 5
    assert loss_splits(4, 64, 1000, None) == 1
    prompts = ["The colour of the sky is", "Two plus two is", "My favourite animal is", "Water is"]

    def reward(completions, **kw):
        return [float(len(c)) / 10 for c in completions]

    cfg = train.GRPOConfig(num_generations=2, max_completion_length=6, beta=0.04, num_iterations=2)
    out = {}
    for chunk, pack in ((0, True), (6, True), (6, False)):  # packed windows (the default) and a window each
        with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, n_gpu_layers=0) as m:
            r = train.grpo(m, prompts, reward, config=cfg, loss_chunk_tokens=chunk, lora_rank=4, optimizer="sgd",
                           lr=0.5, batch_size=8, iters=2, val_split=0.0, progress=False, n_threads=2,
                           pack=pack)  # fmt: skip
            out[chunk, pack] = r.metrics
    for split in ((6, True), (6, False)):
        for a, b in zip(out[0, True], out[split]):
            assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
            for k in ("loss", "kl", "clip_ratio/region_mean"):
                assert a[k] == pytest.approx(b[k], abs=1e-3 if GPU_BUILD else 2e-5), (split, k, a[k], b[k])
    print({k: [round(x["loss"], 7) for x in v] for k, v in out.items()})


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=4), st.lists(st.floats(-2, 2), max_size=3))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(train.GRPOConfig)]), _VALUES, max_size=4))
def test_grpo_config_fuzz_is_valid_or_a_clear_error(fields):
    """Any GRPOConfig field given any value: a config, or a ValueError/TypeError naming the field; nothing else."""
    try:
        train.GRPOConfig(**fields)
    except (ValueError, TypeError) as e:
        assert any(k in str(e) for k in fields), (fields, e)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_VALUES, st.just(float("nan"))), max_size=6))
def test_reward_values_fuzz_score_or_refuse(values):
    """Whatever a reward function returns: the rewards (a number or None per completion, NaN for None) or a
    ValueError naming the function; nothing else escapes, nothing is half-scored."""
    from llamabind.train.rollout import GRPOPrompt, Rollouts, score

    prompts = [GRPOPrompt("p", np.array([1], np.int32), {})]
    r = Rollouts([np.array([5], np.int32)] * 4, np.zeros(4, bool), ["a", "b", "c", "d"], 0.0)

    def f(**kw):
        return values

    try:
        out = score([f], prompts, r, 4)
    except ValueError as e:
        assert "'f'" in str(e)
        return
    assert out.shape == (4, 1) and len(values) == 4
    for v, o in zip(values, out[:, 0]):
        assert (v is None and np.isnan(o)) or o == float(v)


def test_full_fine_tune_with_a_kl_to_the_gguf_loaded_again(smollm2_f32_cut):
    """A full fine-tune with beta > 0: the reference is the GGUF loaded again (TRL loads its ref_model from the same
    id), its log-probabilities from llama_decode in float64. At the first step the policy is the reference: the
    per-token KL is ~0 (the training graph's forward pass against llama_decode's, F32 sums in another order:
    below 1e-5 nats); after a step with a large lr the policy moves away from it: the second step's KL is larger."""
    prompts = ["The colour of the sky is", "Two plus two is"]

    def reward(completions, **kw):
        return [float(len(c)) / 10 for c in completions]

    cfg = train.GRPOConfig(num_generations=2, max_completion_length=6, beta=0.04)
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, use_mmap=False, n_gpu_layers=0) as m:
        r = train.grpo(m, prompts, reward, config=cfg, lr=1e-4, batch_size=4, iters=2, val_split=0.0,
                       progress=False, n_threads=2)  # fmt: skip
    kl = [x["kl"] for x in r.metrics]
    print(f"kl per step {kl}")
    assert abs(kl[0]) < 1e-5 and kl[1] > max(abs(kl[0]), 1e-6)


def test_rollouts_sampled_in_the_decode_graph(model_path):
    """GRPO's rollouts with each completion's chain attached to its sequence (rollout(on_device=True), what a GPU
    model gets: only the sampled tokens leave the device) against the chains on the CPU (sample_many), on the CPU
    backend: greedy chains pick the same tokens for every completion of two prompts (a chain attached to the
    wrong sequence would not); a seeded chain draws its own sequence's tokens (the first prompt's completions
    alone = beside another prompt's); seeded chains give the same completions run after run and other ones for
    another seed. (Seeded draws are not compared across the two paths: the graph's softmax rounds otherwise than
    the CPU chain's, and a draw at a boundary parts them: 1 of 168 tokens on this VM; with top_k the graph's
    candidates come in another order, so the same uniform draw picks another token.)"""
    from llamabind.context import Context
    from llamabind.train.rollout import rollout

    with llamabind.Model(model_path, n_threads=2, n_gpu_layers=0) as m:
        ctx = Context(m, n_ctx=2048, n_batch=512, n_ubatch=512, n_seq_max=8, kv_unified=True, n_threads=2)
        ps = [p.ids for p in train.read_prompts([{"prompt": _chat(q)} for q in ("2+3?", "A color?")], m)]

        def run(on_device: bool, **kw) -> list[list[int]]:
            r = rollout(ctx, ps, 4, 16, llamabind.SamplingParams(**kw), on_device=on_device)
            assert len(r.completions) == 8 and all(1 <= len(c) <= 16 for c in r.completions)
            return [c.tolist() for c in r.completions]

        greedy = run(False, temperature=0)
        assert run(True, temperature=0) == greedy
        assert greedy[0] != greedy[4]  # two prompts, two answers
        # each completion's chain (seed + i) draws its own sequence's tokens: the first prompt's 4 completions are the
        # same alone as beside a second prompt's (the CPU's products are the same per row at either batch size)
        full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
        alone = rollout(ctx, ps[:1], 4, 16, llamabind.SamplingParams(**full), on_device=True).completions
        assert [c.tolist() for c in alone] == run(True, **full)[:4]
        seeded = run(True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
        assert run(True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7) == seeded
        assert run(True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8) != seeded
        assert len({tuple(c) for c in seeded[:4]}) > 1  # a prompt's completions draw apart
        ctx.close()
