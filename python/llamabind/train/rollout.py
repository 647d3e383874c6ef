"""GRPO's rollouts (issue 85): prompts in TRL's formats as token ids, G completions of each sampled from the
policy being trained, their rewards and their training windows. The completions are all decoded together in one
context (one llama_decode a step for every unfinished completion, a prompt's KV cells shared by its G sequences),
with the adapter being trained applied or the fully fine-tuned weights in place: no second copy of the weights."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import expect
from ..context import Context
from ..model import LoraAdapter, Model
from ..sampling import SamplingParams, sample_many
from .pairs import _rows

__all__ = ["GRPOPrompt", "Rollouts", "pack_completions", "read_prompts", "rollout", "score"]


@dataclass
class GRPOPrompt:
    """A prompt of a GRPO run: ``prompt`` as given (text, or a list of messages), ``ids`` its token ids
    (int32, the chat template's generation prompt for messages), ``columns`` the row's other fields (passed
    to the reward functions)."""

    prompt: Any
    ids: np.ndarray
    columns: dict[str, Any]


def read_prompts(data: Any, model: Model, name: str | None = None) -> list[GRPOPrompt]:
    """Prompts in TRL's formats from ``data`` (``name``: what messages call it; default "the prompts"): a JSONL
    file, a list of dicts or a 🤗 Dataset whose rows have ``"prompt"``, text or a list of messages (rendered with
    the model's chat template and its generation prompt), a list of strings, or GRPOPrompts (returned as they
    are). Raises FileNotFoundError, ValueError naming the row (no prompt, an empty one, messages without string
    content)."""
    if isinstance(data, Sequence) and data and all(isinstance(p, GRPOPrompt) for p in data):
        return list(data)
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and data and isinstance(data[0], str):
        data = [{"prompt": p} for p in data]
    rows, at = _rows(data, name or "the prompts")
    out = []
    for k, row in enumerate(rows):
        expect(isinstance(row, dict), f"{at(k)}: a row must be an object with 'prompt'")
        p = row.get("prompt")
        expect(p is not None, f"{at(k)}: missing field 'prompt'")
        if isinstance(p, str):
            expect(bool(p.strip()), f"{at(k)}: field 'prompt' is empty")
            ids = model.tokenize(p, add_special=True, parse_special=True)
        else:
            ok = isinstance(p, list) and p and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in p)
            expect(
                bool(ok), f"{at(k)}: field 'prompt' must be text or a non-empty list of messages with string content"
            )
            text = model.chat_templates().render(p, add_generation_prompt=True)
            ids = model.tokenize(text, add_special=False, parse_special=True)
        expect(len(ids) > 0, f"{at(k)}: the prompt has no token")
        cols = {c: v for c, v in row.items() if c not in ("prompt", "completion", "completion_ids")}
        out.append(GRPOPrompt(p, np.asarray(ids, np.int32), cols))
    expect(len(out) > 0, "no prompts")
    return out


@dataclass
class Rollouts:
    """Completions of prompts: ``completions[i]`` the token ids of completion i (int32; with its end-of-sequence
    token when it ended), ``truncated[i]`` True where it reached max_completion_length without ending,
    ``texts[i]`` its text (the end-of-sequence token left out), ``seconds`` the time the decoding took, of it
    ``sample_seconds`` in the sampler chains (the rest: llama_decode, the prompts included)."""

    completions: list[np.ndarray]
    truncated: np.ndarray
    texts: list[str]
    seconds: float
    sample_seconds: float = 0.0


class Roller:
    """A context that decodes G completions of a few prompts together, kept across steps (cleared each call).
    ``n_seq``: sequences per call (<= 256); ``n_tokens``: the most tokens one sequence holds."""

    def __init__(self, model: Model, n_seq: int, n_tokens: int, adapter: LoraAdapter | None, n_threads: int | None):
        base = model.context_params
        n_ctx = -(-n_seq * n_tokens // 256) * 256
        self.model = model
        self.ctx = Context(
            model, n_ctx=n_ctx, n_batch=max(n_seq, 512), n_ubatch=max(n_seq, 512), n_threads=n_threads,
            n_seq_max=n_seq, kv_unified=True, type_k=base["type_k"], type_v=base["type_v"],
            flash_attn=base["flash_attn"],
        )  # fmt: skip
        if adapter is not None:
            self.ctx.set_lora(adapter, 1.0)

    def close(self) -> None:
        self.ctx.close()

    def __call__(
        self, prompts: Sequence[np.ndarray], num_generations: int, max_tokens: int, sampling: SamplingParams
    ) -> Rollouts:
        return rollout(self.ctx, prompts, num_generations, max_tokens, sampling)


def rollout(
    ctx: Context,
    prompts: Sequence[np.ndarray],
    num_generations: int,
    max_tokens: int,
    sampling: SamplingParams,
    on_device: bool | None = None,
) -> Rollouts:
    """``num_generations`` completions of each prompt (token ids), sampled with ``sampling`` (one sampler chain
    a completion, seeded ``seed + i`` for completion i when a seed is given), at most ``max_tokens`` tokens
    each; completion i is of prompt i // num_generations. Each prompt is decoded once, its KV cells copied to
    its other sequences (llama_memory_seq_cp), then every unfinished completion gets a token per llama_decode.
    ``on_device`` (default: where the model's output layer is on a GPU): each completion's chain runs in the decode
    graph for its sequence (:meth:`~llamabind.sampling.Sampler.attach`), only the sampled tokens leave the device;
    otherwise the chains sample the logits on the CPU together over the context's threads
    (:func:`~llamabind.sampling.sample_many`)."""
    t0 = time.perf_counter()
    model = ctx.model
    ctx.clear()
    G = num_generations
    n = len(prompts) * G
    samplers = []
    try:
        for i in range(n):
            seed = None if sampling.seed is None else (sampling.seed + i) & 0xFFFFFFFF
            samplers.append(dataclasses.replace(sampling, seed=seed).build(model))
        for j, ids in enumerate(prompts):
            for g in range(G):
                samplers[j * G + g].accept(ids.tolist())
            if len(ids) > 1:
                ctx.decode_sequence(ids[:-1].tolist(), j * G)
                for g in range(1, G):
                    ctx.seq_copy(j * G, j * G + g)
        if model.output_offloaded if on_device is None else on_device:
            for i, smp in enumerate(samplers):
                smp.attach(ctx, i)  # False: this chain samples on the CPU
        idx = ctx.decode_batch([(j * G + g, [int(ids[-1])]) for j, ids in enumerate(prompts) for g in range(G)])
        t1 = time.perf_counter()
        nxt = dict(enumerate(sample_many(samplers, ctx, idx)))
        t_sample = time.perf_counter() - t1
        out: list[list[int]] = [[] for _ in range(n)]
        truncated = np.zeros(n, bool)
        active = list(range(n))
        while active:
            step = []
            for i in active:
                tok = nxt[i]
                out[i].append(tok)
                if model.is_eog(tok):
                    continue
                if len(out[i]) >= max_tokens:
                    truncated[i] = True
                    continue
                step.append(i)
            active = step
            if active:
                idx = ctx.decode_batch([(i, [out[i][-1]]) for i in active])
                t1 = time.perf_counter()
                nxt = dict(zip(active, sample_many([samplers[i] for i in active], ctx, idx)))
                t_sample += time.perf_counter() - t1
    finally:
        for s in samplers:
            s.close()
    texts = [model.detokenize([t for t in c if not model.is_eog(t)]) for c in out]
    return Rollouts([np.asarray(c, np.int32) for c in out], truncated, texts, time.perf_counter() - t0, t_sample)


RewardFunc = Callable[..., Sequence[float | None]]


def reward_name(f: RewardFunc) -> str:
    return getattr(f, "__name__", type(f).__name__)


def score(funcs: Sequence[RewardFunc], prompts: Sequence[GRPOPrompt], r: Rollouts, num_generations: int) -> np.ndarray:
    """float64 (n completions, k functions): each function called as TRL calls it, ``f(prompts=, completions=,
    completion_ids=, **columns)`` (prompt i // G for completion i; a conversational prompt's completion as
    ``[{"role": "assistant", "content": text}]``; each other column of the prompts' rows as a list), None as
    NaN. Raises ValueError (a wrong length or a value that is not a number or None) or RuntimeError (the
    function raised) naming the function; nothing has trained when it does."""
    rep = [p for p in prompts for _ in range(num_generations)]
    conv = not isinstance(prompts[0].prompt, str)
    completions = [[{"role": "assistant", "content": t}] for t in r.texts] if conv else list(r.texts)
    cols: dict[str, list[Any]] = {k: [p.columns.get(k) for p in rep] for k in prompts[0].columns}
    out = np.full((len(rep), len(funcs)), np.nan)
    for j, f in enumerate(funcs):
        name = reward_name(f)
        try:
            got = f(prompts=[p.prompt for p in rep], completions=completions,
                    completion_ids=[c.tolist() for c in r.completions], **cols)  # fmt: skip
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        got = list(got) if isinstance(got, (Sequence, np.ndarray)) and not isinstance(got, str) else None
        if got is None or len(got) != len(rep):
            n = "not a list" if got is None else f"{len(got)} values"
            raise ValueError(
                f"reward function {name!r} returned {n}; it must return one reward per completion ({len(rep)})"
            )
        for i, v in enumerate(got):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
                raise ValueError(f"reward function {name!r}: reward {i} is {v!r}; a finite number or None")
            out[i, j] = float(v)
    return out


@dataclass
class Batch:
    """A generation batch as training windows: windows (n, W + 1), labels (n, W) (each completion's tokens,
    -1 elsewhere), mask (n, T) over each completion's tokens (T the longest), its advantages (n,)."""

    windows: np.ndarray
    labels: np.ndarray
    mask: np.ndarray
    prompt_len: np.ndarray  # (n,): each window's prompt tokens
    seq_len: np.ndarray  # (n,): each window's prompt and completion tokens
    advantages: np.ndarray
    ref: np.ndarray | None = None  # (n, T): the reference's log-probabilities (beta > 0)


def batch_windows(prompts: Sequence[np.ndarray], r: Rollouts, G: int, W: int, pad: int, mask_truncated: bool) -> Batch:
    n = len(r.completions)
    T = max(len(c) for c in r.completions)
    win = np.full((n, W + 1), pad, np.int32)
    lab = np.full((n, W), -1, np.int32)
    mask = np.zeros((n, T))
    plen = np.array([len(prompts[i // G]) for i in range(n)])
    for i, c in enumerate(r.completions):
        p = prompts[i // G]
        seq = np.concatenate([p, c])
        win[i, : len(seq)] = seq
        if not (mask_truncated and r.truncated[i]):
            lab[i, len(p) - 1 : len(seq) - 1] = c
            mask[i, : len(c)] = 1.0
    seq_len = plen + np.array([len(c) for c in r.completions])
    return Batch(win, lab, mask, plen, seq_len, np.zeros(n))


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    return z[np.arange(len(targets)), targets] - lse


def reference_logps(
    ctx: Context, prompts: Sequence[np.ndarray], r: Rollouts, G: int, T: int, temperature: float
) -> np.ndarray:
    """float64 (n, T): each completion token's log softmax(logits / temperature) under the reference, from
    llama_decode's logits (:meth:`Context.eval`) in float64; 0 after a completion's end."""
    out = np.zeros((len(r.completions), T))
    for i, c in enumerate(r.completions):
        p = prompts[i // G]
        seq = np.concatenate([p, c])
        ctx.clear()
        logits = ctx.eval(seq[:-1].tolist())
        out[i, : len(c)] = _log_softmax_at(logits[len(p) - 1 :], c, temperature)
    return out


def pack_completions(
    win: np.ndarray, lab: np.ndarray, seq_len: np.ndarray, n_ctx: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Completion windows (``win`` (m, W + 1), ``lab`` (m, W), each ``seq_len`` tokens of prompt and completion)
    packed into one window of ``n_ctx`` tokens, back to back, completion i document i (its own positions from 0,
    attending to itself only), the rest ``pad`` tokens of the last document, unlabelled: no position spent on
    padding between them. The labelled positions keep their order. Returns (windows (1, n_ctx + 1), labels
    (1, n_ctx), segments (1, n_ctx)) int32 for :meth:`~llamabind.Optimizer.eval`; ValueError when they need more
    than n_ctx tokens."""
    need = int(seq_len.sum())
    expect(need <= n_ctx, f"{len(seq_len)} completion(s) need {need} tokens packed; the window holds {n_ctx}")
    tok = np.full(n_ctx + 1, pad, np.int32)
    labels = np.full(n_ctx, -1, np.int32)
    seg = np.full(n_ctx, len(seq_len) - 1, np.int32)
    at = 0
    for i, n in enumerate(seq_len):
        tok[at : at + n] = win[i, :n]
        labels[at : at + n] = lab[i, :n]
        seg[at : at + n] = i
        at += n
    return tok[None], labels[None], seg[None]
