"""The package's shape (design.md, pyproject.toml's import-linter contracts): what import-linter cannot
see, because the extension llamabind._core is not a Python source, and the size of modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "llamabind"
SRC = ROOT / "python" / "src"
FACE = {"__init__", "__main__"}
FEATURES = {"generation", "chat", "batch", "embeddings", "speculative", "train", "server", "api", "multimodal"}


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _imports_of_the_package(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every `from <llamabind> import name` in path, whatever its spelling."""
    depth = len(path.relative_to(PKG).parts) - 1  # 0 for llamabind/x.py, 1 for llamabind/ops/x.py
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if (node.level and node.level == depth + 1 and not node.module) or node.module == "llamabind":
                out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".", 1)[1]) for a in node.names if a.name.startswith("llamabind.")]
    return out


def _is_module(name: str) -> bool:
    return (PKG / f"{name}.py").exists() or (PKG / name / "__init__.py").exists()


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_imports_the_face(path):
    """Below the face, `from . import X` names a module (or the extension _core), never a name that
    __init__ re-exports (that would import the whole package from a lower layer)."""
    if path.parent == PKG and path.stem in FACE:
        return
    bad = [(line, n) for line, n in _imports_of_the_package(path) if n.split(".")[0] != "_core" and not _is_module(n)]
    assert not bad, f"{path.name} imports names from the package face: {bad}"


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_modules_do_not_touch_the_extension(name):
    """Feature modules (or every module of a feature package, e.g. train/) reach llama.cpp through
    Model/Context (the native-facing layer) only."""
    paths = [PKG / f"{name}.py"] if (PKG / f"{name}.py").exists() else sorted((PKG / name).glob("*.py"))
    assert paths, name
    for path in paths:
        uses = [line for line, n in _imports_of_the_package(path) if n.split(".")[0] == "_core"]
        text = path.read_text(encoding="utf-8")
        assert not uses and "_llama_" not in text, f"{path.name} uses the extension or a native handle (lines {uses})"


def test_no_module_over_600_lines():
    files = [*_modules(), *SRC.glob("*.cpp"), *SRC.glob("*.h")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


def test_no_cpp_line_passes_120_columns():
    """clang-format's ColumnLimit holds for comments too (ReflowComments: a 128-column comment in
    server.cpp had passed `./dev lint`)."""
    long = [
        f"{p.name}:{i}: {len(line)}"
        for p in sorted([*SRC.glob("*.cpp"), *SRC.glob("*.h")])
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > 120
    ]
    assert not long, long
    assert "ReflowComments: true" in (ROOT / ".clang-format").read_text(encoding="utf-8")
