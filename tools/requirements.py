"""Print the requirements that pyproject.toml lists, one per line, for `pip install`: the one source of
every dependency list (./dev reads it; so do the wheel tests).

    python tools/requirements.py build runtime test
      build    [build-system].requires
      runtime  [project].dependencies
      NAME     [project.optional-dependencies].NAME (test, lint, ...)
"""

from __future__ import annotations

import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def load() -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # 3.10: the same parser, from PyPI
        import tomli as tomllib
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)


def requirements(*groups: str) -> list[str]:
    data = load()
    out: list[str] = []
    for g in groups:
        if g == "build":
            reqs = data["build-system"]["requires"]
        elif g == "runtime":
            reqs = data["project"]["dependencies"]
        else:
            extras = data["project"]["optional-dependencies"]
            if g not in extras:
                raise SystemExit(f"requirements.py: no group {g!r} (build, runtime, {', '.join(extras)})")
            reqs = extras[g]
        out += [r for r in reqs if r not in out]
    return out


if __name__ == "__main__":
    print("\n".join(requirements(*(sys.argv[1:] or ["build", "runtime", "test"]))))
