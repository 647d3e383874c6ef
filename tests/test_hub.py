"""Models by Hugging Face id (llamabind.hub: Model.from_pretrained, `-hf org/repo[:QUANT]`, hf://
URIs) against a local HTTP server laid out as the Hub serves repositories (the tree API and the
resolve routes huggingface_hub calls, with X-Repo-Commit, ETag/X-Linked-Etag sha256 and sizes),
holding the default model and a copy split by upstream's llama-gguf-split; then offline
(HF_HUB_OFFLINE=1) from the cache it filled. No network."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import require_tool

from llamabind import hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
SPLIT_REPO = "test-org/SmolLM2-split"
PROMPT = "The three primary colors are"


class FakeHub(ThreadingHTTPServer):
    """repos: {repo_id: {path in repo: local file}}; every request is logged as (method, path)."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, Path]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.log: list[tuple[str, str]] = []
        self._sha: dict[Path, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def sha256(self, f: Path) -> str:
        if f not in self._sha:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            self._sha[f] = h.hexdigest()
        return self._sha[f]


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # quiet
        pass

    def _error(self, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self):
        """(kind, repo, revision, path) of a request: a model repository's routes, and a dataset
        repository's under /api/datasets/ and /datasets/ (the repo id then reads "datasets/ORG/NAME")."""
        path = self.path.split("?", 1)[0]
        self.server.log.append((self.command, path))
        m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)/(tree|paths-info)/([^/]+)(/.*)?", path)
        if m:
            repo = m.group(2) if m.group(1) == "models" else f"datasets/{m.group(2)}"
            return m.group(3), repo, m.group(4), (m.group(5) or "/")[1:]
        m = re.fullmatch(r"/api/(models|datasets)/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo = m.group(2) if m.group(1) == "models" else f"datasets/{m.group(2)}"
            return "info", repo, m.group(3) or "main", None
        m = re.fullmatch(r"/((?:datasets/)?[^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return "resolve", m.group(1), m.group(2), m.group(3)
        return None, None, None, None

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._serve()

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _entries(self, files: dict[str, Path], under: str) -> list[dict]:
        """The tree API's entries below `under` (files and the folders on their paths)."""
        out, dirs = [], set()
        for p, f in files.items():
            if under and not p.startswith(under.rstrip("/") + "/"):
                continue
            parts = p.split("/")
            for k in range(1, len(parts)):
                dirs.add("/".join(parts[:k]))
            size = f.stat().st_size
            lfs = {"oid": self.server.sha256(f), "size": size, "pointerSize": 134}
            out.append(
                {"type": "file", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": size, "path": p, "lfs": lfs}
            )
        out += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                for d in sorted(dirs) if not under or d.startswith(under.rstrip("/") + "/")]  # fmt: skip
        return out

    def do_GET(self):
        self._serve()

    def do_HEAD(self):
        self._serve()

    def _serve(self):
        kind, repo, rev, file = self._route()
        files = self.server.repos.get(repo or "")
        if kind is None or files is None:
            return self._error(404, "RepoNotFound")
        if rev not in ("main", COMMIT):
            return self._error(404, "RevisionNotFound")
        if kind in ("tree", "paths-info"):
            return self._json(self._entries(files, file or ""))
        if kind == "info":
            name = repo.removeprefix("datasets/")
            siblings = [{"rfilename": p} for p in files]
            return self._json({"id": name, "_id": COMMIT[:24], "sha": COMMIT, "private": False, "disabled": False,
                               "gated": False, "siblings": siblings, "tags": [], "cardData": {}})  # fmt: skip
        f = files.get(file)
        if f is None:
            return self._error(404, "EntryNotFound")
        size, sha = f.stat().st_size, self.server.sha256(f)
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if rng and self.command == "GET":
            start = int(rng.group(1))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{sha}"')
        self.send_header("X-Linked-Etag", f'"{sha}"')
        self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        if self.command == "GET":
            with open(f, "rb") as fh:
                fh.seek(start)
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    self.wfile.write(chunk)
        return None


@pytest.fixture(scope="module")
def split_parts(model_path, tmp_path_factory):
    """The default model split by upstream's llama-gguf-split (100 tensors per part)."""
    exe = require_tool("llama-gguf-split")
    d = tmp_path_factory.mktemp("split")
    subprocess.run([str(exe), "--split", "--split-max-tensors", "100", str(model_path),
                    str(d / "SmolLM2-135M-Instruct-Q4_1")], check=True, capture_output=True)  # fmt: skip
    parts = sorted(d.glob("*.gguf"))
    assert len(parts) >= 2, parts
    return parts


@pytest.fixture(scope="module")
def mmproj_path(tmp_path_factory):
    """A random-weight vision projector for SmolLM2 (bench/make_mmproj.py)."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("make_mmproj", ROOT / "bench" / "make_mmproj.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.vision(str(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")))


@pytest.fixture
def fake_hub(model_path, split_parts, mmproj_path, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# SmolLM2 135M Instruct, GGUF\n")
    repos = {
        REPO: {
            "README.md": readme,
            "smollm2-135m-instruct-q4_1.gguf": model_path,
            "smollm2-135m-instruct-q8_0.gguf": model_path,  # the same bytes under another quant's name
            "mmproj-smollm2-f16.gguf": mmproj_path,  # never a model; -hf loads it as the projector
        },
        SPLIT_REPO: {p.name: p for p in split_parts},
    }
    srv = FakeHub(repos)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _env(tmp_path, hub_url: str | None, offline: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1")
    env["HF_ENDPOINT"] = hub_url or "http://127.0.0.1:9"  # nothing listens on the discard port
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _cli(env, *args, check=True):
    p = subprocess.run([sys.executable, "-m", "llamabind", *args], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def _generate(env, *model_args):
    gen = ["generate", PROMPT, "-n", "8", "--temperature", "0", "--threads", "2"]
    return _cli(env, *gen, *model_args).stdout


def test_cli_hf_repo_with_a_quant_tag_then_offline(fake_hub, model_path, tmp_path):
    env = _env(tmp_path, fake_hub.url)
    want = _generate(env, "-m", str(model_path))
    assert _generate(env, "-hf", f"{REPO}:q4_1") == want  # the tag is case-insensitive
    gets = [p for m, p in fake_hub.log if m == "GET" and "/resolve/" in p]
    assert gets == [
        f"/{REPO}/resolve/main/smollm2-135m-instruct-q4_1.gguf",
        f"/{REPO}/resolve/main/mmproj-smollm2-f16.gguf",
    ]
    assert _generate(env, "-hf", f"{REPO}:q4_1", "--no-mmproj") == want
    cached = list((tmp_path / "hf" / "hub").rglob("smollm2-135m-instruct-q4_1.gguf"))
    assert cached, "not in huggingface_hub's cache"
    fake_hub.shutdown()
    off = _env(tmp_path, None, offline=True)
    assert _generate(off, "-hf", f"{REPO}:Q4_1") == want  # HF_HUB_OFFLINE=1: from the cache
    # the Hub unreachable: the cache, at once (huggingface_hub would retry each file's request for ~23 s)
    gen = ["generate", PROMPT, "-n", "8", "--temperature", "0", "--threads", "2", "-hf", f"{REPO}:Q4_1"]
    unreachable = _cli(_env(tmp_path, None), *gen)
    assert unreachable.stdout == want and "Retrying" not in unreachable.stderr, unreachable.stderr[-2000:]
    p = _cli(off, "generate", "-hf", f"{REPO}:Q8_0", "-n", "2", check=False)  # never downloaded
    assert p.returncode == 2 and "error:" in p.stderr, p.stderr


def test_from_pretrained_a_split_model_and_errors(fake_hub, model_path, tmp_path):
    env = _env(tmp_path, fake_hub.url)
    code = f"""
import llamabind
with llamabind.Model({str(model_path)!r}) as m:
    want = m.generate({PROMPT!r}, max_tokens=8, temperature=0).tokens
m = llamabind.Model.from_pretrained({SPLIT_REPO!r}, n_threads=2)   # no Q4_K_M/Q8_0: the first model
print(m.path.name, m.generate({PROMPT!r}, max_tokens=8, temperature=0).tokens == want)
u = llamabind.Model("hf://{REPO}/smollm2-135m-instruct-q4_1.gguf", vocab_only=True)
print(u.path.name)
v = llamabind.Model.from_pretrained({REPO!r}, "*q4_1.gguf", mmproj=True, n_ctx=512)
print(v.projector.modalities, v.projector.path.name)
for kw in ({{"filename": "*.gguf"}}, {{"filename": "*q5_k*"}}):
    try:
        llamabind.Model.from_pretrained({REPO!r}, **kw)
    except ValueError as e:
        print("ValueError:", e)
try:
    llamabind.Model.from_pretrained("test-org/nothing")
except FileNotFoundError as e:
    print("FileNotFoundError:", e)
"""
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "SmolLM2-135M-Instruct-Q4_1-00001-of-00003.gguf True", p.stdout
    parts = sorted(p for m, p in fake_hub.log if m == "GET" and p.startswith(f"/{SPLIT_REPO}/resolve/"))
    assert len(parts) == 3, parts  # every part downloaded
    assert lines[1] == "smollm2-135m-instruct-q4_1.gguf"
    assert lines[2] == "['vision'] mmproj-smollm2-f16.gguf", lines[2]
    assert "3 files" in lines[3] and "q4_1.gguf" in lines[3] and "q8_0.gguf" in lines[3], lines[3]
    assert lines[4].startswith("ValueError: no file") and "holds" in lines[4], lines[4]
    assert lines[5].startswith("FileNotFoundError: no repository 'test-org/nothing'"), lines[5]


def test_pick_follows_llama_cpp_choice():
    files = ["README.md", "m-Q2_K.gguf", "mmproj-m-Q8_0.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-imatrix.gguf"]
    assert hub.pick("o/r", files) == ["m-Q4_K_M.gguf"]  # Q4_K_M first
    assert hub.pick("o/r", files[:4]) == ["m-Q8_0.gguf"]  # then Q8_0, never the mmproj
    assert hub.pick("o/r", ["a.gguf", "mmproj.gguf"]) == ["a.gguf"]  # then the first model
    assert hub.pick("o/r", files, tag="q2_k") == ["m-Q2_K.gguf"]
    split = [f"big-Q4_0-{i:05d}-of-00003.gguf" for i in (2, 1, 3)]
    assert hub.pick("o/r", split, tag="Q4_0") == [f"big-Q4_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="misses big-Q4_0-00003-of-00003.gguf"):
        hub.pick("o/r", split[:2])
    with pytest.raises(ValueError, match="no Q5_K model in o/r: o/r holds m-Q2_K.gguf"):
        hub.pick("o/r", files, tag="Q5_K")
    with pytest.raises(ValueError, match="2 files"):
        hub.pick("o/r", files, filename="m-Q[48]*.gguf")
    with pytest.raises(ValueError, match="'org/name'"):
        hub.download("just-a-name")
    # the projector, as llama.cpp's -hf finds it: in the model's folder, F16 first
    assert hub.pick_mmproj(files) == "mmproj-m-Q8_0.gguf"
    assert hub.pick_mmproj(["m.gguf", "mmproj-m-Q8_0.gguf", "mmproj-m-f16.gguf"]) == "mmproj-m-f16.gguf"
    nested = ["a/m-Q4_K_M.gguf", "a/mmproj-Q8_0.gguf", "b/mmproj-F16.gguf"]
    assert hub.pick_mmproj(nested, "a/m-Q4_K_M.gguf") == "a/mmproj-Q8_0.gguf"
    assert hub.pick_mmproj(["m.gguf", "README.md"]) is None
