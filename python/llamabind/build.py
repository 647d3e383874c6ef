"""What this build of llamabind contains: :func:`build_info` and upstream's tools."""

from __future__ import annotations

import os
from pathlib import Path

from . import _core


def build_info() -> dict:
    """Facts about this build.

    Returns a dict with ``version``; ``upstream_commit`` and ``upstream_release`` (the llama.cpp
    pin, e.g. ``"b11312"``); ``patches`` (names from patches/series applied to the compiled tree);
    ``compile_flags`` (CMake build type, compiler, GGML_* options); ``backends`` (compiled-in ggml
    backend registries, e.g. ``["CPU"]`` or ``["CUDA", "CPU"]``); ``devices`` (see
    :func:`llamabind.devices`); ``system_info`` (llama_print_system_info: CPU features);
    ``tools`` (whether upstream's llama-bench etc. were built, see :func:`tool_path`).
    """
    return _core.build_info()


def devices() -> list[dict]:
    """ggml backend devices of this build, plus those of connected RPC servers (:mod:`llamabind.rpc`):
    dicts with name, description, type ("cpu", "gpu", ...), backend, memory_free and memory_total
    (bytes), and ``error: "unreachable"`` for an RPC device whose server is gone. Wraps
    ggml_backend_dev_get / ggml_backend_dev_memory."""
    return _core.devices()


def tool_path(name: str) -> Path | None:
    """Path of the upstream tool ``name`` built from the same tree (``llama-bench``, ``llama-simple``,
    ``llama-completion``, ``llama-finetune``, ``ggml-rpc-server``), or None when this build has no tools
    (build with ``LLAMABIND_BUILD_TOOLS=ON``)."""
    p = Path(__file__).resolve().parent / "bin" / name
    if os.name == "nt":
        p = p.with_suffix(".exe")
    return p if p.exists() else None


def default_threads() -> int:
    """CPU threads llamabind uses when n_threads is None: the cores this process may run on
    (os.sched_getaffinity where there is one, else os.cpu_count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
