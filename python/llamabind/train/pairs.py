"""Preference pairs (issue 58): TRL's formats read into token ids, the log-probabilities of each pair's answers
under a model (with or without an adapter: the policy, or DPO's reference), and DPO's and ORPO's losses with
TRL's reward metrics computed from them. Training on these losses is not here yet: this is what it starts from
(the reference log-probabilities are precomputed once) and how a tuned model is judged on held-out pairs."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._validate import as_float, as_int, expect
from ..context import Context
from ..model import LoraAdapter, Model

_TEXT_KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """One preference pair as token ids (int32, 1-D).

    Attributes:
        prompt: the prompt's tokens (the vocabulary's BOS where it adds one; for a conversation, the chat
            template's rendering through the generation prompt).
        chosen: the preferred answer's tokens, which follow the prompt (EOS, or the template's end of turn,
            included).
        rejected: the other answer's tokens, which follow the prompt likewise.
    """

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


@dataclass(frozen=True)
class PreferenceMetrics:
    """DPO's or ORPO's loss and TRL's reward metrics over some pairs (means over the pairs).

    Attributes:
        loss: DPO's sigmoid loss ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``, or ORPO's
            ``nll(chosen) - beta * log sigmoid(log odds ratio)``.
        rewards_chosen: DPO: ``beta * (pc - rc)``; ORPO: ``beta`` times the chosen answer's mean token log-prob.
        rewards_rejected: likewise for the rejected answer.
        rewards_accuracies: the fraction of pairs whose chosen reward is the larger.
        rewards_margins: the mean of chosen minus rejected reward.
        logps_chosen: the chosen answers' log-probabilities as the loss takes them (nats; DPO: summed over
            the answer's tokens; ORPO: their mean per token), as TRL logs them.
        logps_rejected: the rejected answers' likewise.
    """

    loss: float
    rewards_chosen: float
    rewards_rejected: float
    rewards_accuracies: float
    rewards_margins: float
    logps_chosen: float
    logps_rejected: float


def read_pairs(data, model: Model, *, name: str | None = None, method: str = "dpo") -> list[PreferencePair]:
    """Preference pairs from ``data``: a JSONL file (a path), a list of dicts, or a 🤗 Dataset, in TRL's
    formats: ``{"prompt", "chosen", "rejected"}`` as text, or conversational: ``prompt`` a list of messages and
    ``chosen``/``rejected`` lists of the answer's messages, rendered with ``model``'s chat template (the prompt
    through the generation prompt; an answer is what the conversation with it adds); without ``prompt``, the
    messages the two conversations share are the prompt.

    Tokenized as TRL 1.16's trainer of ``method`` does (``"dpo"``: DPOTrainer; ``"orpo"``: ORPOTrainer), so that
    the same rows give the same token ids:

    - the prompt and each answer are tokenized together, as one text, and split where the result leaves the
      prompt's own tokens (a prompt ending in a space followed by ``"Paris."`` gives ``' is'|' Paris'``, not
      ``' is', ' '|'Paris'``): the end of the prompt that merged into the answer's first token is left out, the
      answers start at the shorter of the two splits;
    - special tokens written in the text (``"<|im_end|>"``) are parsed to their ids, as a 🤗 tokenizer does;
    - ``"dpo"``: the text is tokenized with the vocabulary's BOS where it adds one; a text answer gets the EOS
      token's text appended (unless it ends with it); a conversation's answer ends where the template ends it;
    - ``"orpo"``: a conversation is first rendered to text, then as a text row: no special tokens added, then
      the vocabulary's BOS put before the prompt unless it starts with it, and EOS after each answer unless it
      ends with it (after a template's end of turn too: TRL's ORPOTrainer adds one more EOS there).

    ``name``: how the messages call the data (default: the file's name, or "the pairs"). Tokens through
    :meth:`Model.tokenize` (llama_tokenize) and :meth:`ChatTemplates.render` (common_chat_templates_apply).
    Everything is read and checked before anything is returned: ValueError naming the row (file:line) and field
    for a missing or mistyped field, an empty answer, two identical answers, an answer left without tokens, or
    no rows; ValueError for another method; FileNotFoundError."""
    expect(method in ("dpo", "orpo"), f"method must be 'dpo' or 'orpo'; got {method!r}")
    rows, where = _rows(data, name)
    pairs = []
    for k, row in enumerate(rows):
        at = where(k)
        expect(isinstance(row, dict), f"{at}: a pair must be a JSON object; got {type(row).__name__}")
        pairs.append(_pair(row, model, at, method))
    expect(bool(pairs), f"{where(-1).rsplit(':', 1)[0]}: no preference pairs")
    return pairs


def _rows(data, name: str | None):
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        label = name or path.name
        rows, lines = [], []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{label}:{i}: not JSON ({e.msg})") from None
                lines.append(i)
        return rows, lambda k: f"{label}:{lines[k] if rows else 0}"
    if hasattr(data, "column_names") and hasattr(data, "__iter__") and not isinstance(data, dict):  # a 🤗 Dataset
        data = list(data)
    expect(isinstance(data, Sequence) and not isinstance(data, (bytes, dict)),
           f"data must be a JSONL path, a list of dicts or a Dataset; got {type(data).__name__}")  # fmt: skip
    label = name or "the pairs"
    return list(data), lambda k: f"{label}: row {k if k >= 0 else len(data)}"


def _pair(row: dict, model: Model, at: str, method: str) -> PreferencePair:
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise ValueError(f"{at}: missing field {missing[0]!r} (a pair has 'prompt', 'chosen' and 'rejected')")
    if isinstance(row["chosen"], str) or isinstance(row.get("prompt"), str):
        for k in _TEXT_KEYS:
            expect(isinstance(row.get(k), str), f"{at}: field {k!r} must be a string; got {type(row.get(k)).__name__}")
            expect(k == "prompt" or row[k].strip(), f"{at}: field {k!r} is empty")
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        if method == "dpo":  # TRL's DPOTrainer: EOS as text after a text answer
            eos_text = _special_text(model, model.token_eos)
            chosen, rejected = (a if not eos_text or a.endswith(eos_text) else a + eos_text for a in (chosen, rejected))
        conversation = False
    else:
        prompt, chosen, rejected = _conversation_texts(row, model, at)
        conversation = True
    add_special = method == "dpo"  # DPO: the tokenizer's own BOS; ORPO: none, then BOS put first below
    ids = [model.tokenize(t, add_special=add_special, parse_special=True) for t in (prompt, prompt + chosen,
                                                                                     prompt + rejected)]  # fmt: skip
    n = min(_common_prefix(ids[0], ids[1]), _common_prefix(ids[0], ids[2]))
    p, c, r = ids[0][:n], ids[1][n:], ids[2][n:]
    if method == "orpo":  # TRL's ORPOTrainer (add_bos_token_if_needed, add_eos_token_if_needed)
        bos, eos = model.token_bos, model.token_eos
        if bos is not None and bos >= 0 and (not p or p[0] != bos):
            p = [bos, *p]
        if eos is not None and eos >= 0:
            c = c if c and c[-1] == eos else [*c, eos]
            r = r if r and r[-1] == eos else [*r, eos]
    what = "message" if conversation else "text"
    for k, answer in (("chosen", c), ("rejected", r)):
        expect(bool(answer), f"{at}: the {k} answer's {what} adds no token to the prompt's")
    expect(c != r, f"{at}: 'chosen' and 'rejected' are the same answer")
    return PreferencePair(*(np.asarray(t, np.int32) for t in (p, c, r)))


def _special_text(model: Model, token: int | None) -> str:
    """The text of a special token (e.g. ``"<|im_end|>"``), "" for none."""
    if token is None or token < 0:
        return ""
    return model.detokenize([token], unparse_special=True)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _conversation_texts(row: dict, model: Model, at: str) -> tuple[str, str, str]:
    """The prompt rendered through the generation prompt, and the text each answer's conversation adds to it."""
    for k in ("chosen", "rejected", *(("prompt",) if "prompt" in row else ())):
        v = row[k]
        ok = isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in v)
        expect(bool(ok), f"{at}: field {k!r} must be a non-empty list of messages with string content")
    if "prompt" in row:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    else:  # the implicit prompt: the messages both conversations begin with (TRL's extract_prompt)
        n = 0
        while n < min(len(row["chosen"]), len(row["rejected"])) and row["chosen"][n] == row["rejected"][n]:
            n += 1
        expect(n > 0, f"{at}: without 'prompt', 'chosen' and 'rejected' must begin with the same messages")
        prompt, chosen, rejected = row["chosen"][:n], row["chosen"][n:], row["rejected"][n:]
    for k, answer in (("chosen", chosen), ("rejected", rejected)):
        expect(
            answer and answer[0].get("role") == "assistant",
            f"{at}: the {k} answer must begin with an assistant message",
        )
        expect(all(m["content"].strip() for m in answer), f"{at}: the {k} answer has an empty message")
    tpl = model.chat_templates()
    head = tpl.render(prompt, add_generation_prompt=True)
    out = [head]
    for k, answer in (("chosen", chosen), ("rejected", rejected)):
        whole = tpl.render(prompt + answer, add_generation_prompt=False)
        expect(whole.startswith(head), f"{at}: the chat template renders the prompt differently before the {k} answer")
        out.append(whole[len(head) :])
    return out[0], out[1], out[2]


def pair_logps(
    model: Model,
    pairs: Sequence[PreferencePair],
    *,
    adapter: LoraAdapter | Sequence[tuple[LoraAdapter, float]] | None = None,
    scale: float = 1.0,
    n_threads: int | None = None,
    prompt: bool = False,
) -> np.ndarray:
    """The log-probabilities of each pair's answers given its prompt under ``model`` (with ``adapter`` applied
    at ``scale``, or several adapters as (adapter, scale) pairs: a LoRA policy; without, DPO's reference for a
    LoRA): float64 (n_pairs, 2), chosen then rejected, each the sum over the answer's tokens of
    log p(token | the tokens before it), in nats; ``prompt``: (n_pairs, 4), then the sum over the prompt's tokens
    after its first (what ORPO's nll adds, TRL's ORPOTrainer) and their count. The logits come from llama_decode
    (:meth:`Context.eval`) in a context with a training context's parameters (F32 KV cache, no flash attention;
    ``n_threads``: None for all cores), as :func:`evaluate`'s; log-softmax in float64. Raises ValueError for no
    pairs."""
    expect(len(pairs) > 0, "pairs is empty")
    scale = as_float(scale, "scale")
    longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)
    n_ctx = as_int(-(-longest // 256) * 256, "the longest pair's tokens", 256)
    out = np.zeros((len(pairs), 4 if prompt else 2))
    with Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads, training=True) as ctx:
        for a, sc in [(adapter, scale)] if isinstance(adapter, LoraAdapter) else list(adapter or []):
            ctx.set_lora(a, as_float(sc, "scale"))
        for i, p in enumerate(pairs):
            for j, answer in enumerate((p.chosen, p.rejected)):
                tokens = np.concatenate([p.prompt, answer])
                ctx.clear()
                logits = ctx.eval(tokens[:-1].tolist())
                first = max(len(p.prompt) - 1, 0)  # the row that predicts the answer's first token
                out[i, j] = _token_logps(logits, tokens[1:], first, len(logits))
                if prompt and j == 0:
                    out[i, 2:] = _token_logps(logits, tokens[1:], 0, first), first
    return out


def _token_logps(logits: np.ndarray, targets: np.ndarray, r0: int, r1: int) -> float:
    """The summed log-softmax of rows [r0, r1) of float32 ``logits`` at ``targets``, in float64 (256 rows at a time)."""
    total = 0.0
    for a in range(r0, r1, 256):
        z = logits[a : min(a + 256, r1)].astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        total += float((z[np.arange(len(z)), targets[a : a + len(z)]] - np.log(np.exp(z).sum(axis=1))).sum())
    return total


def preference_metrics(
    policy_logps: np.ndarray | Sequence[Sequence[float]],
    reference_logps: np.ndarray | Sequence[Sequence[float]] | None = None,
    *,
    method: str = "dpo",
    beta: float = 0.1,
    lengths: np.ndarray | Sequence[Sequence[int]] | None = None,
    nll: float | None = None,
) -> PreferenceMetrics:
    """DPO's (Rafailov et al. 2023, the sigmoid loss) or ORPO's (Hong et al. 2024) loss and TRL's reward
    metrics from :func:`pair_logps`' log-probabilities: ``policy_logps`` (n, 2) and, for DPO, the reference's
    ``reference_logps`` (n, 2). ORPO needs the answers' ``lengths`` (n, 2) in tokens (its odds ratio is of mean
    token log-probs) and takes ``nll``, its nll term in nats per token: TRL's ORPOTrainer's is the mean over the
    chosen sequences' prompt and answer tokens (:func:`pair_logps` with ``prompt=True`` gives the prompts' part);
    without it, the chosen answers' pooled mean token nll (the ORPO authors' ``disable_prompt_loss``). ``beta``
    > 0: DPO's beta, ORPO's lambda. Computed in numpy float64 (no ggml or llama.cpp call); the results are in
    nats (loss, logps) and beta-scaled nats (rewards). Raises ValueError for a method other than "dpo" or
    "orpo", beta <= 0, missing inputs or shapes that differ."""
    beta = as_float(beta, "beta")
    expect(beta > 0 and math.isfinite(beta), f"beta must be > 0; got {beta}")
    pol = np.asarray(policy_logps, np.float64)
    expect(pol.ndim == 2 and pol.shape[1] == 2 and len(pol) > 0, f"policy_logps must be (n_pairs, 2); got {pol.shape}")
    pc, pr = pol[:, 0], pol[:, 1]
    if method == "dpo":
        expect(reference_logps is not None, "DPO needs reference_logps (pair_logps of the reference model)")
        ref = np.asarray(reference_logps, np.float64)
        expect(ref.shape == pol.shape, f"reference_logps must be {pol.shape}; got {ref.shape}")
        rc, rr = beta * (pc - ref[:, 0]), beta * (pr - ref[:, 1])
        loss = -_log_sigmoid(rc - rr)
    elif method == "orpo":
        expect(lengths is not None, "ORPO needs the answers' lengths in tokens")
        n = np.asarray(lengths, np.float64)
        expect(n.shape == pol.shape and bool((n > 0).all()), f"lengths must be {pol.shape}, > 0; got {n.shape}")
        pc, pr = pc / n[:, 0], pr / n[:, 1]  # mean token log-probs (< 0), what ORPO's odds ratio is of
        log_odds = (pc - pr) - (np.log(-np.expm1(pc)) - np.log(-np.expm1(pr)))
        if nll is None:
            nll = -pol[:, 0].sum() / n[:, 0].sum()  # the chosen answers' tokens pooled
        loss = as_float(nll, "nll") - beta * _log_sigmoid(log_odds)
        rc, rr = beta * pc, beta * pr
    else:
        raise ValueError(f"method must be 'dpo' or 'orpo'; got {method!r}")
    return PreferenceMetrics(
        float(loss.mean()), float(rc.mean()), float(rr.mean()), float((rc > rr).mean()), float((rc - rr).mean()),
        float(pc.mean()), float(pr.mean()),
    )  # fmt: skip


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)
