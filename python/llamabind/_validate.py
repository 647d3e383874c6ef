"""Argument checks shared by every public call (models, contexts, generation, ops): the same misuse
raises the same error everywhere, with a message that names the argument, the expected value and
the value given. A leaf module: it imports nothing of llamabind.

TypeError: the wrong kind of value (a str for an int, a bool for a number, bytes for a prompt).
ValueError: the right kind, out of range (or empty where something is needed).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "as_int",
    "as_float",
    "one_of",
    "expect",
    "stop_strings",
    "sampling_kwargs",
    "prompt_tokens",
    "endpoint",
    "is_loopback",
    "tool_choice",
]

T = TypeVar("T")


def as_int(value: Any, name: str, lo: int | None = None, hi: int | None = None, note: str = "") -> int:
    """value as an int in [lo, hi] (either bound may be None): TypeError for a non-integer (bool
    too), ValueError out of range. ``note`` is appended to the range, e.g. " (0 disables)"."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name} must be {rng}{note}; got {value}")
    return value


def as_float(
    value: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    finite: bool = True,
    note: str = "",
) -> float:
    """value as a float in [lo, hi] ((lo, hi] with lo_open): TypeError for a non-number (bool
    too), ValueError for NaN/inf (unless finite=False) or out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number; got {type(value).__name__}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        lb = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {lb}{lo}, {hi if hi is not None else 'inf'}]{note}; got {value}")
    return value


def one_of(value: T, name: str, choices: Iterable[T]) -> T:
    """value if it is one of choices, else ValueError listing them."""
    options = list(choices)
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in options)}; got {value!r}")
    return value


def expect(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """Stop strings as a list: None -> [], a str -> [it]; TypeError for a non-str element,
    ValueError for an empty string."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    out = []
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop must be a str or a sequence of str; got an element of type {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must not be empty")
        out.append(s)
    return out


def sampling_kwargs(fields: Sequence[str], kwargs: Mapping[str, Any], caller: str) -> dict[str, Any]:
    """The sampling fields of kwargs; TypeError naming caller and the unknown names otherwise."""
    rest = [k for k in kwargs if k not in fields]
    if rest:
        raise TypeError(f"{caller}() got unexpected keyword argument(s): {', '.join(rest)}")
    return dict(kwargs)


def prompt_tokens(
    prompt: Any,
    tokenize: Callable[[str], list[int]],
    n_vocab: int,
    name: str = "prompt",
) -> list[int]:
    """Token ids of a prompt: a str is tokenized with ``tokenize``; a sequence of ints is checked
    against [0, n_vocab). TypeError for bytes or non-integer ids, ValueError for an empty prompt or
    an id out of range."""
    if isinstance(prompt, str):
        tokens = tokenize(prompt)
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{name} must be a str or a sequence of token ids, not bytes; decode it first")
    else:
        try:
            items = list(prompt)
        except TypeError:
            raise TypeError(f"{name} must be a str or a sequence of token ids; got {type(prompt).__name__}") from None
        tokens = [as_int(t, f"token id in {name}") for t in items]
    if not tokens:
        raise ValueError(f"{name} is empty: it tokenized to no tokens (this model adds no BOS)")
    for t in tokens:
        if not 0 <= t < n_vocab:
            raise ValueError(f"token id {t} in {name} is out of range: expected 0 <= id < n_vocab ({n_vocab})")
    return tokens


def endpoint(value: Any) -> tuple[str, int]:
    """(host, port) of a "host:port" string (IPv6 as "[::1]:50052"); TypeError/ValueError if malformed."""
    if not isinstance(value, str):
        raise TypeError(f"an RPC endpoint must be a 'host:port' string; got {type(value).__name__}")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an RPC endpoint must be 'host:port' with a port in 1..65535; got {value!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """True when a server bound to ``host`` is reachable from this machine only."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tool_choice(tools: Sequence[dict] | None, choice: Any) -> tuple[list[dict] | None, str]:
    """(tools, choice) as llama.cpp common takes them: ``choice`` "auto", "none" or "required", or
    OpenAI's named form ``{"type": "function", "function": {"name": NAME}}``, which becomes the
    one tool NAME and "required" (the model must call it). TypeError/ValueError for a malformed
    choice or a NAME that is not among ``tools``."""
    if isinstance(choice, str):
        one_of(choice, "tool_choice", ("auto", "none", "required"))
        return (list(tools) if tools else None), choice
    if not isinstance(choice, Mapping):
        raise TypeError(f"tool_choice must be 'auto', 'none', 'required' or a dict; got {type(choice).__name__}")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError("a named tool_choice must be {'type': 'function', 'function': {'name': ...}}")
    named = [
        t
        for t in tools or []
        if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and t["function"].get("name") == name
    ]
    if not named:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return named[:1], "required"
