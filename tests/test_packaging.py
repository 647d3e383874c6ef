"""What a user meets: the README's example runs, and the sdist carries the patched tree."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

from conftest import ROOT, run_python


def test_readme_python_example_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README.md has no python example"
    for block in blocks:  # every example in the README runs as written
        r = run_python(block, timeout=300)
        assert r.returncode == 0, f"{block}\n{r.stderr}"
        assert r.stdout.strip()


def test_sdist_carries_the_patched_tree_and_needs_no_registry(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); import llamabind_build as b; "
            f"print(b.build_sdist({str(tmp_path)!r}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    sdist = tmp_path / p.stdout.strip().splitlines()[-1]
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
    s = subprocess.run([sys.executable, str(tmp_path / top / "vendor" / "vendor.py"), "sync"], capture_output=True,
                       text=True, env=env, timeout=120)
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
