"""What a user meets: the sdist carries the patched tree, a wheel installs and runs (the README's and
docs' examples: tests/test_docs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import ROOT, build_wheel, new_venv, outside_env


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist, made by the in-tree build backend (tools/llamabind_build: vendor sync, then scikit-build-core)."""
    out = tmp_path_factory.mktemp("sdist")
    code = f"import sys; sys.path.insert(0, 'tools'); import llamabind_build as b; print(b.build_sdist({str(out)!r}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return out / p.stdout.strip().splitlines()[-1]


def test_sdist_carries_the_patched_tree_and_needs_no_registry(sdist, tmp_path):
    top = sdist.name[: -len(".tar.gz")]
    with tarfile.open(sdist) as tar:
        names = set(tar.getnames())
        ops = tar.extractfile(f"{top}/vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp").read().decode()
        for m in tar.getmembers():
            if m.name.startswith(f"{top}/vendor/") or m.name.startswith(f"{top}/patches/"):
                tar.extract(m, tmp_path, filter="data") if sys.version_info >= (3, 12) else tar.extract(m, tmp_path)
    assert f"{top}/vendor/llama.cpp/.llamabind-stamp.json" in names
    assert f"{top}/vendor/llama.cpp/CMakeLists.txt" in names
    assert f"{top}/CMakeLists.txt" in names and f"{top}/python/src/model.cpp" in names
    assert "dx[i] = ((dy[i] - dot_y_dy)*y[i])*scale;" in ops  # the patch is applied in the sdist
    assert not any("/.venv/" in n or n.startswith(f"{top}/build/") for n in names)
    # the sdist's vendor step works with no cache and no registry
    env = {**os.environ, "LLAMABIND_CACHE": str(tmp_path / "empty-cache"), "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    s = subprocess.run(
        [sys.executable, str(tmp_path / top / "vendor" / "vendor.py"), "sync"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert s.returncode == 0, s.stderr
    assert "up to date" in s.stderr


def test_ops_notebook_executes():
    """examples/ops.ipynb (per-op calls, a gradient check, a backend comparison) runs top to bottom."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "ops.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "max |grad - finite differences|" in outputs and "NMSE" in outputs
    assert "HIGH" not in outputs


def test_wheel_installs_into_a_fresh_venv_and_generates(tmp_path, model_path):
    """The user's path: a wheel built from this tree (no tools, its own build dir), installed into a new
    virtual environment that has no build tools, then `python -m llamabind generate` on the default
    model. Also: what the wheel holds (the package only: no tests, upstream sources, docs or models)
    and its size, printed for the record."""

    whl = build_wheel(tmp_path / "wheels", "-Cbuild-dir=build/wheel-{wheel_tag}")
    names = zipfile.ZipFile(whl).namelist()
    assert any(n.startswith("llamabind/_core") for n in names) and "llamabind/__main__.py" in names
    assert not [
        n
        for n in names
        if n.startswith(("tests/", "vendor/", "llamabind/bin/"))
        or n.endswith((".gguf", ".md"))
        and "dist-info" not in n
    ]
    size_mb = whl.stat().st_size / 2**20
    unpacked_mb = sum(i.file_size for i in zipfile.ZipFile(whl).infolist()) / 2**20
    print(f"\n{whl.name}: {size_mb:.1f} MiB, installed {unpacked_mb:.1f} MiB")
    assert unpacked_mb < 40

    py = new_venv(tmp_path / "venv", str(whl))
    tools = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.util as u; print([m for m in ('cmake', 'ninja', 'nanobind', "
            "'scikit_build_core') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
    )
    assert tools.stdout.strip() == "[]", tools.stdout  # nothing to build with: the wheel must just run
    run_env = outside_env()
    run_env["LLAMABIND_CACHE"] = str(model_path.parent.parent.parent)  # the model already fetched
    g = subprocess.run(
        [str(py), "-m", "llamabind", "generate", "The capital of France is", "--temp", "0", "-n", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        env=run_env,
        cwd=tmp_path,
    )
    assert g.returncode == 0, g.stderr[-2000:]
    assert "Paris" in g.stdout


def test_sdist_builds_a_wheel_offline(sdist, tmp_path):
    """`pip wheel <sdist>` with no package index and an empty llamabind cache: everything it compiles
    (the patched llama.cpp included) is inside the sdist. Build requirements come from this environment
    (--no-build-isolation), as on an offline machine that has them installed."""
    (tmp_path / "tmp").mkdir()
    whl = build_wheel(
        tmp_path / "wheels",
        "--no-index",
        source=sdist,
        env={
            "LLAMABIND_CACHE": str(tmp_path / "empty-cache"),
            "PIP_NO_INDEX": "1",
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "TMPDIR": str(tmp_path / "tmp"),
            "CCACHE_BASEDIR": str(tmp_path),
        },
    )  # pip unpacks below it: cache hits
    assert any(n.startswith("llamabind/_core") for n in zipfile.ZipFile(whl).namelist())
