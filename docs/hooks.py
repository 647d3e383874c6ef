"""mkdocs hooks of the documentation site (mkdocs.yml): every public name documented, Sphinx roles shown as code.

- on_pre_build: every name in ``__all__`` of llamabind, llamabind.ops and llamabind.train, and every
  public method and property of the classes among them, must have a docstring; each one without is a
  warning, which ``mkdocs build --strict`` (./dev docs, tests/test_docs.py) turns into a failure.
- on_post_build: every public name is on its module's API page (docs/api/MODULE.md), as
  ``id="module.name"`` (or ``module.name.name`` where a submodule of that name holds it); one
  missing is a warning (a name mkdocstrings could not see, e.g. a function made by a factory).
- on_page_content: the docstrings write Sphinx roles (``:func:`finetune```, ``:class:`~llamabind.Model```); the
  rendered ``:func:<code>finetune</code>`` is shown as the code alone, as Sphinx shows it (``~``: the last name
  only), and linked to the name's entry where it is a public name of an API page.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.llamabind")
PUBLIC = ("llamabind", "llamabind.ops", "llamabind.train")
ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):(<code>)")


def undocumented(modules=PUBLIC) -> list[str]:
    """The public names (module.name, module.Class.member) that have no docstring."""
    missing = []
    for modname in modules:
        mod = importlib.import_module(modname)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if isinstance(obj, (str, int, float, tuple)):  # constants (MEDIA_MARKER, __version__)
                continue
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(f"{modname}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") or not (callable(value) or isinstance(value, property)):
                        continue
                    if not (getattr(value, "__doc__", None) or "").strip():  # a property's own doc or its getter's
                        missing.append(f"{modname}.{name}.{attr}")
    return missing


def on_pre_build(config, **kwargs):
    for name in undocumented():
        log.warning(f"public name without a docstring: {name}")


CODE_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):<code>(~?)([\w.]+)</code>")


# submodules documented on llamabind's API page (docs/api/llamabind.md), with the members shown there
SUBMODULES = {
    "llamabind.models": None,
    "llamabind.rpc": None,
    "llamabind.generation": ["generate"],
    "llamabind.chat": ["chat"],
}


def anchor(target: str, page_url: str) -> str | None:
    """The URL, relative to the page at ``page_url``, of ``target``'s entry on its API page; None where it has none
    (a private module's name, a bare method name)."""
    for modname, members in SUBMODULES.items():
        if target.startswith(modname + ".") and (members is None or target[len(modname) + 1 :] in members):
            return f"{posixpath.relpath('api/llamabind/', page_url or '.')}/#{target}"
    for modname in sorted(PUBLIC, key=len, reverse=True):
        if not target.startswith(modname + "."):
            continue
        first = target[len(modname) + 1 :].split(".")[0]
        if first not in getattr(importlib.import_module(modname), "__all__", []):
            return None
        path = f"api/{modname.removeprefix('llamabind.')}/"
        return f"{posixpath.relpath(path, page_url or '.')}/#{target}"
    return None


def on_page_content(html, page, config, files):
    def role(m: re.Match) -> str:
        short, target = m.group(1), m.group(2)
        code = f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"
        url = anchor(target, page.url)
        return f'<a href="{url}">{code}</a>' if url else code

    return ROLE.sub(r"\1", CODE_ROLE.sub(role, html))


def unrendered(site: Path, modules=PUBLIC) -> list[str]:
    """The public names of ``modules`` missing from their API pages under ``site``."""
    missing = []
    for modname in modules:
        page = site / "api" / modname.removeprefix("llamabind.") / "index.html"
        html = page.read_text(encoding="utf-8") if page.exists() else ""
        for name in importlib.import_module(modname).__all__:
            if name.startswith("_"):
                continue
            if f'id="{modname}.{name}"' not in html and f'id="{modname}.{name}.{name}"' not in html:
                missing.append(f"{modname}.{name}")
    return missing


def on_post_build(config, **kwargs):
    for name in unrendered(Path(config["site_dir"])):
        log.warning(f"public name missing from the API reference: {name}")
