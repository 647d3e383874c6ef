"""The documentation: every Python block of README.md and docs/ runs as written, the site builds
with ``mkdocs build --strict`` (./dev docs) and fails on a broken link or an undocumented public
name, and its API pages, opened in headless Chromium, name the parameters of what they document."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
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


def api_segments(html: str) -> dict[str, str]:
    """The built API page's HTML per documented name: from its heading to the next heading."""
    heads = list(re.finditer(r'id="(llamabind[\w.]*)" class="doc doc-heading"', html))
    return {m.group(1): html[m.end() : n.start() if n else len(html)] for m, n in zip(heads, [*heads[1:], None])}


def table_rows(segment: str) -> list[str] | None:
    """The names in the segment's parameter table (Parameters, or a dataclass's Attributes); None if it has none."""
    m = re.search(r'doc-section-title">(?:Parameters|Attributes):</span>.*?</table>', segment, re.S)
    if m is None:
        return None
    cells = re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(.*?)</code>', m.group(0), re.S)
    return [re.sub(r"<[^>]+>", "", c).strip() for c in cells]  # a name, or an attribute's link around it


def public_callables():
    """(module, qualified name, object) of every public function, class and method of the API pages."""
    for modname in ("llamabind", "llamabind.ops", "llamabind.train"):
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not callable(obj):
                continue
            yield modname, name, obj
            if inspect.isclass(obj):
                for attr, v in vars(obj).items():
                    if not attr.startswith("_") and callable(v):
                        yield modname, f"{name}.{attr}", getattr(obj, attr)


def test_api_tables_name_every_parameter(site):
    """Issue 59: each public function's, class's and method's rendered documentation names each of its
    parameters (inspect.signature's, but *args/**kwargs and private ones), and where it has a parameter
    table, the table lists exactly them: one row per parameter (no group rows such as "a / b") and no row
    for a parameter the signature lacks, unless the signature takes **kwargs (rows then document those).
    The signature block itself does not count as naming a parameter."""
    import inspect as _inspect

    pages = {
        m: (site / "api" / m.removeprefix("llamabind.") / "index.html").read_text(encoding="utf-8")
        for m in ("llamabind", "llamabind.ops", "llamabind.train")
    }
    segments = {m: api_segments(h) for m, h in pages.items()}
    problems, checked = [], 0
    for modname, qual, obj in public_callables():
        try:
            sig = _inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        kinds = _inspect.Parameter
        params = [
            p.name
            for p in sig.parameters.values()
            if p.name not in ("self", "cls")
            and not p.name.startswith("_")
            and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)
        ]
        var_kw = any(p.kind is kinds.VAR_KEYWORD for p in sig.parameters.values())
        seg = segments[modname].get(f"{modname}.{qual}") or segments[modname].get(f"{modname}.{qual}.{qual}")
        if seg is None:
            problems.append(f"{modname}.{qual}: not on the API page")
            continue
        checked += 1
        body = re.sub(r'<div class="doc-signature.*?</div>', "", seg, flags=re.S)
        text = html_text(body)
        missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", text)]
        if missing:
            problems.append(f"{modname}.{qual}: parameters named nowhere in its documentation: {missing}")
        rows = table_rows(body)
        if rows is not None:
            if [p for p in params if p not in rows]:
                problems.append(f"{modname}.{qual}: its table lacks {[p for p in params if p not in rows]}")
            extra = [r for r in rows if r not in params]
            if extra and not var_kw:
                problems.append(f"{modname}.{qual}: table rows that are no parameter: {extra}")
    assert checked > 150, checked  # the pages were found and read
    assert not problems, "\n".join(problems)


def html_text(html: str) -> str:
    import html as _html

    return _html.unescape(re.sub(r"<[^>]+>", " ", html))


def _resolve(qualname: str):
    """The object an API page's id names (llamabind.train.TrainingArgs, llamabind.generation.generate ...)."""
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def test_api_tables_have_types_defaults_and_no_unresolved_references(site):
    """Issue 86 item 3: every row of every parameter or attribute table on the API pages has a type (Model's 17
    keyword arguments through **params, and the dataclasses' fields, had none), a parameter with a default is not
    rendered "required" (Model's were), and no Sphinx reference is left as its source text (``~llamabind.X``: the
    hooks render it as code, linked where the name has an entry)."""
    import inspect as _inspect

    problems, rows_checked = [], 0
    for page in ("llamabind", "ops", "train"):
        html = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        text = html_text(html)
        problems += [f"api/{page}: unresolved reference {r}" for r in re.findall(r"(?<![\w`])~[A-Za-z_][\w.]+", text)]
        for qual, seg in api_segments(html).items():
            body = re.sub(r'<div class="doc-signature.*?</div>', "", seg, flags=re.S)
            m = re.search(r'doc-section-title">(?:Parameters|Attributes):</span>.*?</table>', body, re.S)
            if m is None:
                continue
            try:
                sig = _inspect.signature(_resolve(qual))
            except (TypeError, ValueError):
                sig = None
            for row in re.findall(r'<tr class="doc-section-item">(.*?)</tr>', m.group(0), re.S):
                cells = [html_text(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
                name, rows_checked = cells[0], rows_checked + 1
                if len(cells) > 2 and not cells[1]:
                    problems.append(f"{qual}: {name}: no type")
                p = sig.parameters.get(name) if sig is not None else None
                if p is not None and p.default is not p.empty and cells[-1] == "required":
                    problems.append(f"{qual}: {name}: rendered 'required', defaults to {p.default!r}")
    assert rows_checked > 100, rows_checked  # the tables were found and read
    assert not problems, "\n".join(problems)
