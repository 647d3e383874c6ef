#!/usr/bin/env python3
"""Two results of one benchmark side by side: each row's median ratio NEW / OLD, and a flag where the
drop is larger than the runs' own measured spread (a regression guard that noise does not trip).

    python bench/compare.py OLD.json NEW.json [--relative-to ROW] [--min-tol 0.01]

Rows and their per-run samples are read from the JSON the benchmarks write: ``raw`` (bench/e2e.py,
bench/generation.py: a list of values per row, or per row and test, one per round; a value may be a
dict with ``tps``) or ``rows`` with ``step_times`` (bench/train.py: tokens/s per step). A row's
spread is its samples' interquartile range over their median; a row is flagged DROP when
``ratio < 1 - tol``, tol = max(old spread, new spread, --min-tol), and GAIN when ``ratio > 1 + tol``.
``--relative-to ROW`` first divides every row, round by round where both have as many rounds, by
that row (e.g. ``"tg (llama-bench)"``: the native tool of the same run), so that two runs on hosts
of different speed compare by their ratios to the reference. Exit status 1 when a row dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _value(x) -> float:
    return float(x["tps"] if isinstance(x, dict) else x)


def samples(result: dict) -> dict[str, list[float]]:
    """Row name -> per-run samples (higher is better) of one benchmark result."""
    out: dict[str, list[float]] = {}
    if "raw" in result:
        for row, v in result["raw"].items():
            if isinstance(v, list):
                out[row] = [_value(x) for x in v]
            elif isinstance(v, dict):  # bench/generation.py: {"llamabind": {"pp": [...], "tg": [...]}}
                for test, xs in v.items():
                    if test.endswith(("_tokens", "_chars")):  # counts beside the rates, not speeds
                        continue
                    if isinstance(xs, list) and xs and all(isinstance(x, (int, float, dict)) for x in xs):
                        out[f"{row} {test}"] = [_value(x) for x in xs]
    elif "rows" in result:  # bench/train.py: tokens/s per optimizer step
        for row, r in result["rows"].items():
            times, tps = r.get("step_times"), r.get("train_tok_s")
            if times and tps:
                mid = statistics.median(times)
                out[row] = [tps * mid / t for t in times]
            elif tps:
                out[row] = [float(tps)]
    if not out:
        raise ValueError("no per-run samples: expected 'raw' (e2e, generation) or 'rows' with 'step_times' (train)")
    return out


def spread(xs: list[float]) -> float:
    """Interquartile range over the median (0 for fewer than 4 samples: then --min-tol decides)."""
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def relative(rows: dict[str, list[float]], ref: str) -> dict[str, list[float]]:
    if ref not in rows:
        raise ValueError(f"--relative-to {ref!r}: no such row (rows: {', '.join(rows)})")
    base = rows[ref]
    out = {}
    for row, xs in rows.items():
        if len(xs) == len(base):  # round by round: each round's host state cancels
            out[row] = [x / b for x, b in zip(xs, base)]
        else:
            out[row] = [x / statistics.median(base) for x in xs]
    return out


def compare(old: dict, new: dict, relative_to: str | None = None, min_tol: float = 0.01) -> list[dict]:
    a, b = samples(old), samples(new)
    if relative_to:
        a, b = relative(a, relative_to), relative(b, relative_to)
    rows = []
    for row in a:
        if row not in b or row == relative_to:
            continue
        ma, mb = statistics.median(a[row]), statistics.median(b[row])
        sa, sb = spread(a[row]), spread(b[row])
        tol = max(sa, sb, min_tol)
        ratio = mb / ma
        flag = "DROP" if ratio < 1 - tol else "GAIN" if ratio > 1 + tol else ""
        rows.append(dict(row=row, old=ma, new=mb, ratio=ratio, old_spread=sa, new_spread=sb, tol=tol, flag=flag))
    if not rows:
        raise ValueError("the two results share no row")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--relative-to", default=None, help="a row every row is divided by first (per round)")
    ap.add_argument("--min-tol", type=float, default=0.01, help="the smallest drop flagged (default 1%%)")
    args = ap.parse_args(argv)
    try:
        old, new = json.loads(args.old.read_text()), json.loads(args.new.read_text())
        rows = compare(old, new, args.relative_to, args.min_tol)
    except ValueError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    unit = f" (/ {args.relative_to})" if args.relative_to else ""
    print(f"{args.old} -> {args.new}{unit}")
    print("| row | old median | new median | new / old | old spread | new spread | flag |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['old']:.4g} | {r['new']:.4g} | {r['ratio']:.3f} | "
            f"{100 * r['old_spread']:.1f}% | {100 * r['new_spread']:.1f}% | {r['flag']} |"
        )
    drops = [r["row"] for r in rows if r["flag"] == "DROP"]
    if drops:
        print(f"dropped beyond the spread: {', '.join(drops)}")
    return 1 if drops else 0


if __name__ == "__main__":
    sys.exit(main())
