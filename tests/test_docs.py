"""The documentation: every Python block of README.md and docs/ runs as written, the site builds
with ``mkdocs build --strict`` (./dev docs) and fails on a broken link or an undocumented public
name, and its API pages, opened in headless Chromium, name the parameters of what they document."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import ROOT, run_python

import llamabind

DOCS = sorted(  # the pages with Python examples, and the README (which must have one)
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")]
    if p.name == "README.md" or "```python" in p.read_text(encoding="utf-8")
)
SITE_PACKAGES = str(Path(llamabind.__file__).resolve().parent.parent)  # the installed package and its _core.pyi


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run(doc, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), re.S)
    if doc == "README.md":
        assert blocks, "README.md has no python example"
    for d in ("bench", "vendor"):  # the examples run from a clone's root (bench/make_mmproj.py, upstream's media)
        (tmp_path / d).symlink_to(ROOT / d)
    for block in blocks:  # every example runs as written, each in a fresh interpreter
        r = run_python(block, timeout=300, cwd=tmp_path)  # the examples write files (zen-lora.gguf)
        assert r.returncode == 0, f"{doc}:\n{block}\n{r.stderr}"
        assert r.stdout.strip(), f"{doc}: a block printed nothing:\n{block}"


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMABIND_DOCS_PATH": SITE_PACKAGES, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    r = mkdocs_build(ROOT, out)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_site_has_every_guide_and_api_page(site):
    for md in (ROOT / "docs").glob("**/*.md"):
        rel = md.relative_to(ROOT / "docs").with_suffix("")
        page = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert page.exists(), f"{md} was not built"
    assert not (site / "hooks.py").exists() and not (site / "griffe_ext.py").exists()  # the build's scripts
    api = (site / "api" / "llamabind" / "index.html").read_text(encoding="utf-8")
    assert 'id="llamabind.Model"' in api and 'id="llamabind.Model.generate"' in api
    assert "n_gpu_layers" in api  # the base class's docstring, as Python composes it (api.Model)


def copy_docs(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root)
    shutil.copytree(ROOT / "docs", root / "docs")
    return root


def test_strict_build_fails_on_a_broken_link(tmp_path):
    root = copy_docs(tmp_path)
    index = root / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + "\nSee [the lost guide](lost-guide.md).\n", encoding="utf-8")
    r = mkdocs_build(root, tmp_path / "site")
    assert r.returncode != 0
    assert "lost-guide.md" in r.stderr


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_undocumented_and_unrendered_names_are_found(tmp_path, monkeypatch):
    hooks = load_hooks()
    mod = types.ModuleType("lb_fake")

    def documented():
        """Has one."""

    def bare():
        pass

    class Thing:
        """A class."""

        def method(self):
            pass

        @property
        def prop(self):
            """A property."""

    mod.documented, mod.bare, mod.Thing = documented, bare, Thing
    mod.__all__ = ["documented", "bare", "Thing"]
    monkeypatch.setitem(sys.modules, "lb_fake", mod)
    assert hooks.undocumented(["lb_fake"]) == ["lb_fake.bare", "lb_fake.Thing.method"]
    assert hooks.undocumented() == []  # llamabind's own public names all have one
    page = tmp_path / "api" / "lb_fake" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text('<h2 id="lb_fake.documented">documented</h2><h2 id="lb_fake.Thing">Thing</h2>')
    assert hooks.unrendered(tmp_path, ["lb_fake"]) == ["lb_fake.bare"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_api_page_renders_parameters_in_a_browser(site, tmp_path):
    browser = chromium()
    if browser is None:
        if os.environ.get("LLAMABIND_REQUIRE_TOOLS"):
            pytest.fail("no chromium (./dev test installs Debian's package when run as root)")
        pytest.skip("no chromium")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    pages = {  # names of parameters in signatures and parameter tables
        "llamabind": ["n_gpu_layers", "n_ctx", "max_tokens", "json_schema"],  # Model(...), generate(...)
        "ops": ["mul_mat", "backend", "soft_max", "scale", "eps", "ggml_mul_mat"],
        "train": ["finetune", "lora_rank", "ctx_size", "batch_size"],
    }
    for name, words in pages.items():
        url = (site / "api" / name / "index.html").as_uri()
        r = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        text = re.sub(r"<[^>]+>", " ", r.stdout)  # the DOM after the theme's scripts ran, as text
        if name == "llamabind":  # Model's Google-style "Args:" as a table
            assert re.search(r"Parameters\s*:?\s*Name\s+Type\s+Description", text), "api/llamabind: no parameter table"
        for w in words:
            assert re.search(rf"\b{w}\b", text), f"api/{name}: {w!r} not rendered"
    shot = ROOT / "build" / "docs-api-llamabind.png"  # for a person to look at
    shot.parent.mkdir(exist_ok=True)
    url = (site / "api" / "llamabind" / "index.html").as_uri()
    subprocess.run(
        [browser, *flags, "--window-size=1280,1600", f"--screenshot={shot}", url], capture_output=True, timeout=120
    )
    assert shot.exists() and shot.stat().st_size > 10_000
