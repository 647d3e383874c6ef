"""bench/compare.py, the regression guard between two results of one benchmark, on crafted results:
it must flag a drop beyond the runs' spread and let noise within it pass."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from conftest import ROOT

COMPARE = ROOT / "bench" / "compare.py"


def e2e_result(rows: dict[str, float], noise: float, seed: int, rounds: int = 10, host: float = 1.0) -> dict:
    """An e2e-shaped result: per round, every row's t/s around its level (relative noise), times a host factor."""
    rng = random.Random(seed)
    raw = {}
    for r in range(rounds):
        h = host * (1 + rng.uniform(-noise, noise))  # the round's host state moves every row alike
        for row, level in rows.items():
            raw.setdefault(row, []).append({"tps": level * h * (1 + rng.uniform(-noise / 4, noise / 4))})
    return {"raw": raw}


def run(tmp_path, old: dict, new: dict, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    cmd = [sys.executable, str(COMPARE), str(tmp_path / "old.json"), str(tmp_path / "new.json"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def table(out: str) -> dict[str, list[str]]:
    cells = (ln.split("|") for ln in out.splitlines())
    return {c[1].strip(): [x.strip() for x in c[2:-1]] for c in cells if len(c) > 7}


def test_a_drop_beyond_the_spread_is_flagged(tmp_path):
    levels = {"tg (llama-bench)": 250.0, "generate, CPU sampling": 240.0}
    old = e2e_result(levels, noise=0.01, seed=1)
    new = e2e_result({**levels, "generate, CPU sampling": 240.0 * 0.94}, noise=0.01, seed=2)  # 6% slower
    r = run(tmp_path, old, new)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = table(r.stdout)
    assert rows["generate, CPU sampling"][-1] == "DROP"
    assert rows["tg (llama-bench)"][-1] == ""
    assert 0.92 < float(rows["generate, CPU sampling"][2]) < 0.96


def test_noise_within_the_spread_passes(tmp_path):
    levels = {"tg (llama-bench)": 250.0, "generate, CPU sampling": 240.0}
    old = e2e_result(levels, noise=0.04, seed=3)
    new = e2e_result({**levels, "generate, CPU sampling": 240.0 * 0.99}, noise=0.04, seed=4)  # 1% within 4% noise
    r = run(tmp_path, old, new)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DROP" not in r.stdout


def test_relative_to_the_native_tool_cancels_a_slower_host(tmp_path):
    levels = {"tg (llama-bench)": 250.0, "generate, CPU sampling": 240.0}
    old = e2e_result(levels, noise=0.005, seed=5)
    new = e2e_result(levels, noise=0.005, seed=6, host=0.85)  # every row 15% slower: another host
    assert run(tmp_path, old, new).returncode == 1  # by t/s alone: a drop
    r = run(tmp_path, old, new, "--relative-to", "tg (llama-bench)")
    assert r.returncode == 0, r.stdout
    assert 0.98 < float(table(r.stdout)["generate, CPU sampling"][2]) < 1.02


def test_train_results_compare_by_step_times(tmp_path):
    def train(tps: float, times: list[float]) -> dict:
        return {"rows": {"llamabind full, ctx 256, batch 1": {"train_tok_s": tps, "step_times": times}}}

    old = train(43.0, [6.00, 5.95, 5.90, 5.92, 5.97])
    r = run(tmp_path, old, train(38.0, [6.70, 6.75, 6.72, 6.68, 6.80]))
    assert r.returncode == 1 and "DROP" in r.stdout
    r = run(tmp_path, old, {"host": "x"})
    assert r.returncode == 2 and "no per-run samples" in r.stderr
