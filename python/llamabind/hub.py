"""GGUF models from Hugging Face repositories, through huggingface_hub (its cache, token, offline
mode ``HF_HUB_OFFLINE=1``, ``HF_ENDPOINT`` and progress bars).

Three spellings: ``Model.from_pretrained("org/repo", filename="*Q4_K_M.gguf")`` (llama-cpp-python's),
``-hf org/repo[:QUANT]`` on the command line (llama.cpp's: the tag picks the file by its quant, Q4_K_M
then Q8_0 then the first model file when none is given), and ``Model("hf://org/repo/path/file.gguf")``.
A model split in parts (``name-00001-of-00003.gguf``) downloads every part and loads the first.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["download", "download_spec", "download_uri", "pick"]

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # as llama.cpp's download.cpp
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")


def _is_model(path: str) -> bool:
    name = PurePosixPath(path).name
    return name.endswith(".gguf") and not any(s in name for s in _NOT_MODELS)


def _first_part(path: str) -> bool:
    m = _SPLIT.search(path)
    return m is None or int(m.group(1)) == 1


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(PurePosixPath(path).name, pattern)


def _listing(repo_id: str, files: list[str]) -> str:
    ggufs = [f for f in files if f.endswith(".gguf")]
    return f"{repo_id} holds " + (", ".join(ggufs) if ggufs else "no GGUF file")


def pick(repo_id: str, files: list[str], *, filename: str | None = None, tag: str | None = None) -> list[str]:
    """The files to download for a model of ``repo_id`` whose files are ``files``: by ``filename``
    (a path or a glob, matched against paths and file names) or by quant ``tag`` (case-insensitive,
    followed by '.' or '-' in the name; default Q4_K_M, then Q8_0, then the first model file).
    Every part of a split model, the first first. Raises ValueError naming the repository's GGUF
    files when nothing or (for a glob) several models match, or a split model misses parts."""
    if filename is not None:
        found = [f for f in files if _first_part(f) and _matches(f, filename)]
        if len(found) != 1:
            what = "no file" if not found else f"{len(found)} files ({', '.join(found)})"
            raise ValueError(f"{what} of {repo_id} match {filename!r}: {_listing(repo_id, files)}")
        primary = found[0]
    else:
        primary = ""
        for t in [tag] if tag else DEFAULT_TAGS:
            pat = re.compile(re.escape(t) + "[.-]", re.IGNORECASE)
            primary = next((f for f in files if _is_model(f) and _first_part(f) and pat.search(f)), "")
            if primary:
                break
        if not primary and not tag:
            primary = next((f for f in files if _is_model(f) and _first_part(f)), "")
        if not primary:
            what = f"no {tag} model" if tag else "no model"
            raise ValueError(f"{what} in {repo_id}: {_listing(repo_id, files)}")
    m = _SPLIT.search(primary)
    if m is None:
        return [primary]
    n, prefix = int(m.group(2)), primary[: m.start()]
    parts = [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [p for p in parts if p not in files]
    if missing:
        raise ValueError(f"{repo_id}: the split model {primary} misses {', '.join(missing)}")
    return parts


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:  # a runtime dependency; a trimmed environment may lack it
        raise ImportError("models from Hugging Face need huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


def _unreachable(hf: Any) -> str | None:
    """Why the Hub's endpoint cannot be reached (one request through huggingface_hub's session, its
    proxies and timeouts; any HTTP answer counts as reached), or None. huggingface_hub's own calls
    retry a refused connection five times over ~23 s each."""
    try:
        hf.get_session().head(hf.constants.ENDPOINT, timeout=10)
    except Exception as e:  # httpx's ConnectError, timeouts, DNS failures (OSError)
        return f"{type(e).__name__}: {e}"
    return None


def _repo_files(hf: Any, repo_id: str, revision: str | None) -> tuple[list[str], bool]:
    """The repository's files and whether the Hub answered: from the Hub, or in offline mode (or
    when the Hub cannot be reached) the ones huggingface_hub's cache holds for that revision. Where
    the Hub did not answer, the downloads that follow read the cache only (local_files_only):
    hf_hub_download would otherwise retry each file's request for ~23 s before using the cache."""
    err = hf.errors
    reason = "HF_HUB_OFFLINE is set" if hf.constants.HF_HUB_OFFLINE else _unreachable(hf)
    if reason is None:
        try:
            return hf.list_repo_files(repo_id, revision=revision), True
        except err.RepositoryNotFoundError:
            where = hf.constants.ENDPOINT
            raise FileNotFoundError(f"no repository {repo_id!r} on {where} (or it is private)") from None
        except err.RevisionNotFoundError:
            raise FileNotFoundError(f"{repo_id} has no revision {revision!r}") from None
        except Exception as e:  # unreachable (httpx's errors, HfHubHTTPError, OSError): the cache, if any
            reason = f"{type(e).__name__}: {e}"
    try:
        snap = Path(hf.snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (err.LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise ConnectionError(f"cannot list {repo_id} ({reason}) and huggingface_hub's cache has no copy") from None
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file() or p.is_symlink()), False


def download(repo_id: str, filename: str | None = None, *, tag: str | None = None, revision: str | None = None) -> Path:
    """The local path of a GGUF model of Hugging Face repository ``repo_id`` (``org/name``),
    downloaded into huggingface_hub's cache if not there: the file ``filename`` (a path or a glob)
    or the model whose quant is ``tag`` (see :func:`pick`), every part of a split model (the
    first part's path is returned: llama.cpp loads the rest from beside it). Wraps
    ``huggingface_hub.list_repo_files`` and ``hf_hub_download``.

    Raises FileNotFoundError (no such repository, revision or file), ValueError (no file or
    several match, listing the GGUF files), ConnectionError (the Hub cannot be reached and the
    cache has no copy), ImportError without huggingface_hub."""
    if not isinstance(repo_id, str) or repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"a Hugging Face repository is 'org/name'; got {repo_id!r}")
    hf = _hub()
    files, online = _repo_files(hf, repo_id, revision)
    paths = []
    for f in pick(repo_id, files, filename=filename, tag=tag):
        try:
            paths.append(Path(hf.hf_hub_download(repo_id, f, revision=revision, local_files_only=not online)))
        except hf.errors.EntryNotFoundError:
            raise FileNotFoundError(f"{repo_id} has no file {f!r}") from None
        except (hf.errors.LocalEntryNotFoundError, hf.errors.HfHubHTTPError) as e:
            raise ConnectionError(f"cannot download {f} of {repo_id}: {e}") from None
    return paths[0]


def pick_mmproj(files: list[str], model_file: str | None = None) -> str | None:
    """The multimodal projector among a repository's ``files``, as llama.cpp's ``-hf`` finds one: a
    GGUF with "mmproj" in its name, in the model's folder if it has one there; of several, F16,
    then BF16, Q8_0, F32, then the first. None when the repository has none."""
    found = [f for f in files if f.endswith(".gguf") and "mmproj" in f.rsplit("/", 1)[-1].lower()]
    if model_file is not None and "/" in model_file:
        folder = model_file.rsplit("/", 1)[0] + "/"
        found = [f for f in found if f.startswith(folder)] or found
    for t in ("F16", "BF16", "Q8_0", "F32"):
        pat = re.compile(r"[.-]" + t + r"[.-]", re.IGNORECASE)
        hit = next((f for f in found if pat.search(f)), None)
        if hit:
            return hit
    return found[0] if found else None


def download_mmproj(
    repo_id: str, filename: str | None = None, *, model_file: str | None = None, revision: str | None = None
) -> Path | None:
    """The local path of ``repo_id``'s multimodal projector: the file ``filename`` (a path or a
    glob), else :func:`pick_mmproj`'s choice (None when the repository has no projector).
    Downloaded into huggingface_hub's cache as :func:`download` does (same errors)."""
    hf = _hub()
    files, online = _repo_files(hf, repo_id, revision)
    if filename is not None:
        found = [f for f in files if _matches(f, filename)]
        if len(found) != 1:
            what = "no file" if not found else f"{len(found)} files ({', '.join(found)})"
            raise ValueError(f"{what} of {repo_id} match {filename!r}: {_listing(repo_id, files)}")
        name: str | None = found[0]
    else:
        name = pick_mmproj(files, model_file)
    if name is None:
        return None
    try:
        return Path(hf.hf_hub_download(repo_id, name, revision=revision, local_files_only=not online))
    except hf.errors.EntryNotFoundError:
        raise FileNotFoundError(f"{repo_id} has no file {name!r}") from None
    except (hf.errors.LocalEntryNotFoundError, hf.errors.HfHubHTTPError) as e:
        raise ConnectionError(f"cannot download {name} of {repo_id}: {e}") from None


def download_spec(spec: str) -> Path:
    """``org/repo[:QUANT]`` (llama.cpp's ``-hf``) to a local path, as :func:`download` by tag
    (same errors)."""
    repo, _, tag = spec.partition(":")
    return download(repo, tag=tag or None)


def download_uri(uri: str | os.PathLike) -> Path:
    """``hf://org/repo/path/in/repo.gguf`` (optionally ``org/repo@revision/...``) to a local path,
    as :func:`download` of that file (same errors; ValueError for a malformed URI)."""
    rest = os.fspath(uri)[len("hf://") :]
    parts = rest.split("/", 2)
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"an hf:// URI is hf://org/repo/path/to/file.gguf; got {os.fspath(uri)!r}")
    org, repo, path = parts
    repo, _, revision = repo.partition("@")
    return download(f"{org}/{repo}", path, revision=revision or None)
