#!/usr/bin/env python3
"""The pinned upstream llama.cpp tree and our patch series over it.

    python vendor/vendor.py sync      fetch -> verify -> unpack -> apply patches/series (idempotent)
    python vendor/vendor.py fetch     download the pinned source package into the cache and verify it
    python vendor/vendor.py verify    check the unpacked tree against the lock (digest of the pristine files)
    python vendor/vendor.py status    for each patch: applies / already upstream / conflicts, against the pin
                                      (or --source DIR, e.g. a newer upstream checkout, with git's 3-way merge:
                                      "applies (3-way)" where it merges cleanly); and applied in vendor/
    python vendor/vendor.py rehearse --source DIR --out DIR
                                      re-pinning in one command: DIR's tree copied to --out with the series
                                      applied (3-way), conflict regions marked diff3-style; what needs hands listed
    python vendor/vendor.py refresh NAME [--add PATH ...]
                                      re-export patches/NAME from the edited vendor/llama.cpp tree

The pin lives in vendor/llama.cpp.lock (JSON). vendor/llama.cpp/ is git-ignored and never committed.
Cache: $LLAMABIND_CACHE, else $XDG_CACHE_HOME/llamabind, else ~/.cache/llamabind.
Exit codes: 0 ok, 1 a check failed (hash mismatch, patch conflict), 2 usage, 3 registry unreachable.
Standard library only: this runs inside pip's isolated build environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "vendor" / "llama.cpp.lock"
TREE = ROOT / "vendor" / "llama.cpp"
PATCHES = ROOT / "patches"
STAMP = TREE / ".llamabind-stamp.json"
# Files we write into the tree ourselves; they are not part of the upstream digest.
OURS = {STAMP.name}


class VendorError(Exception):
    exit_code = 1


class RegistryUnreachable(VendorError):
    exit_code = 3


def say(msg: str) -> None:
    print(f"[vendor] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    if os.environ.get("LLAMABIND_CACHE"):
        return Path(os.environ["LLAMABIND_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llamabind"


def load_lock() -> dict:
    return json.loads(LOCK.read_text())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def series() -> list[str]:
    names = []
    for line in (PATCHES / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def patch_files(patch: Path) -> list[str]:
    """Paths (relative to the llama.cpp root) that a git-format patch touches."""
    files = []
    for line in patch.read_text().splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if m:
            files.append(m.group(2))
    return files


# ---------------------------------------------------------------------------------------------
# fetch + verify


def index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")


def fetch(lock: dict) -> Path:
    """The pinned source package in the cache, downloaded if missing; sha256-verified."""
    src = lock["source"]
    dest = cache_dir() / "sources" / src["filename"]
    if dest.exists():
        got = sha256_file(dest)
        if got == src["sha256"]:
            return dest
        say(f"cached {dest} has sha256 {got}, expected {src['sha256']}: downloading again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".part")
    errors = []
    # 1. the package index directly (PEP 503 simple page): no build of the sdist's metadata.
    page = f"{index_url()}/{src['package']}/"
    try:
        say(f"looking up {src['filename']} on {page}")
        html = urllib.request.urlopen(page, timeout=60).read().decode("utf-8", "replace")
        m = re.search(r'href="([^"#]*/' + re.escape(src["filename"]) + r')(#[^"]*)?"', html)
        if not m:
            raise VendorError(f"{src['filename']} is not listed on {page}")
        url = urllib.parse.urljoin(page, m.group(1).replace("&amp;", "&"))
        say(f"downloading {url}")
        with urllib.request.urlopen(url, timeout=300) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except (urllib.error.URLError, OSError, VendorError) as e:
        errors.append(f"{page}: {e}")
        # 2. pip, which knows the user's index, proxy and certificate configuration.
        say(f"direct download failed ({e}); trying pip download")
        with tempfile.TemporaryDirectory() as d:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"{src['package']}=={src['version']}",
                "-d",
                d,
            ]
            p = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(d) / src["filename"]
            if p.returncode != 0 or not got.exists():
                errors.append("pip download: " + (p.stderr.strip().splitlines() or ["failed"])[-1])
                raise RegistryUnreachable(
                    f"could not download {src['package']}=={src['version']} from the package registry:\n  "
                    + "\n  ".join(errors)
                    + f"\nPut {src['filename']} (sha256 {src['sha256']}) into {dest.parent} to build offline."
                ) from None
            shutil.move(str(got), tmp)
    got = sha256_file(tmp)
    if got != src["sha256"]:
        tmp.unlink()
        raise VendorError(f"hash mismatch for {src['filename']}: sha256 {got}, the lock expects {src['sha256']}")
    tmp.replace(dest)
    say(f"verified {dest.name} (sha256 {got[:16]}...)")
    return dest


def tree_digest(root: Path, files: list[str] | None = None) -> str:
    """sha256 over 'sha256  path' lines of every regular file below root (sorted, '/' separators)."""
    h = hashlib.sha256()
    if files is None:
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != ".git"]
            for fn in filenames:
                rel = os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")
                if rel not in OURS and rel != ".git":
                    files.append(rel)
    for rel in sorted(files):
        h.update(f"{sha256_file(root / rel)}  {rel}\n".encode())
    return h.hexdigest()


def _members(tar: tarfile.TarFile, prefix: str, only: set[str] | None = None):
    for m in tar.getmembers():
        if not m.name.startswith(prefix):
            continue
        rel = m.name[len(prefix) :]
        if not rel or rel == ".git" or rel.startswith(".git/"):
            continue
        if only is not None and rel not in only:
            continue
        if not (m.isfile() or m.isdir()):
            continue  # no links or devices from an archive
        if rel.startswith("/") or ".." in rel.split("/"):
            raise VendorError(f"unsafe path in {tar.name}: {m.name}")
        yield m, rel


def unpack(archive: Path, lock: dict, dest: Path, only: set[str] | None = None) -> None:
    """Unpack the pinned subtree (or only some of its files) of the source package into dest."""
    prefix = lock["source"]["subtree"].rstrip("/") + "/"
    with tarfile.open(archive) as tar:
        for m, rel in _members(tar, prefix, only):
            target = dest / rel
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            os.chmod(target, 0o755 if m.mode & 0o100 else 0o644)


# ---------------------------------------------------------------------------------------------
# patches


def _git(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    # Never let git discover an enclosing repository (ours): act as a plain 'patch' on cwd.
    env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)


def check_patch(patch: Path, tree: Path, reverse: bool = False) -> tuple[bool, str]:
    args = ["apply", "--check", "-v"] + (["-R"] if reverse else []) + [str(patch)]
    p = _git(args, tree)
    return p.returncode == 0, (p.stderr + p.stdout).strip()


def explain_failure(patch: Path, output: str) -> str:
    """Which file and hunk of a patch did not apply, from git apply's own words."""
    lines = [
        ln
        for ln in output.splitlines()
        if ln.startswith("error:") or "does not apply" in ln or ln.startswith("Checking") or ln.startswith("Hunk")
    ]
    hunks = [ln for ln in output.splitlines() if re.match(r"error: patch failed: ", ln)]
    msg = f"patch {patch.name} does not apply"
    if hunks:
        # 'error: patch failed: FILE:LINE' names the first line of the hunk that failed
        msg += ": " + "; ".join(h[len("error: patch failed: ") :] + " (hunk at that line)" for h in hunks)
    return msg + "\n    " + "\n    ".join(lines[-8:])


def apply_patch(patch: Path, tree: Path) -> None:
    ok, out = check_patch(patch, tree)
    if not ok:
        raise VendorError(explain_failure(patch, out))
    p = _git(["apply", "--whitespace=nowarn", str(patch)], tree)
    if p.returncode != 0:
        raise VendorError(explain_failure(patch, p.stderr))


def merge_patch(patch: Path, pin: Path, tree: Path) -> dict:
    """``patch`` onto ``tree`` (another source, the patches before it applied), as ``git am -3`` does: as it is
    where it applies; else each file it touches is merged (git merge-file, diff3 style) from the pin series'
    version before the patch (``pin``: the pin's files with the patches before it applied), the one after it, and
    the tree's. ``pin`` always gets the patch. Returns {"state": "applies" | "applies (3-way)" | "already
    upstream" | "conflicts", "conflicts": {file: conflict regions}}; the tree keeps the merged files, the
    conflict regions marked where hands are needed (a file the tree lacks counts as one)."""
    files = patch_files(patch)
    before = {f: (pin / f).read_bytes() if (pin / f).exists() else None for f in files}
    apply_patch(patch, pin)  # the series applies to the pin by definition
    if check_patch(patch, tree)[0]:
        apply_patch(patch, tree)
        return {"state": "applies", "conflicts": {}}
    if check_patch(patch, tree, reverse=True)[0]:
        return {"state": "already upstream", "conflicts": {}}
    conflicts = {}
    with tempfile.TemporaryDirectory() as d:
        for i, f in enumerate(files):
            ours, base, theirs = tree / f, Path(d) / f"base{i}", pin / f
            if before[f] is None and not ours.exists():  # a new file: the patch's
                ours.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(theirs, ours)
                continue
            if not ours.exists() or not theirs.exists():  # gone from the source, or deleted by the patch
                conflicts[f] = 1
                continue
            base.write_bytes(before[f] or b"")
            p = subprocess.run(["git", "merge-file", "-p", "--diff3", "-L", "source", "-L", "pin", "-L", "patched",
                                str(ours), str(base), str(theirs)], capture_output=True)  # fmt: skip
            if p.returncode < 0 or p.returncode > 127:
                raise VendorError(f"git merge-file failed on {f}: {p.stderr.decode(errors='replace').strip()}")
            ours.write_bytes(p.stdout)
            if p.returncode:
                conflicts[f] = p.returncode
    return {"state": "conflicts" if conflicts else "applies (3-way)", "conflicts": conflicts}


def patch_hashes() -> list[dict]:
    return [{"name": n, "sha256": sha256_file(PATCHES / n)} for n in series()]


# ---------------------------------------------------------------------------------------------
# commands


def cmd_fetch(args) -> int:
    print(fetch(load_lock()))
    return 0


def cmd_sync(args) -> int:
    lock = load_lock()
    want = {
        "upstream_commit": lock["upstream"]["commit"],
        "tree_sha256": lock["tree_sha256"],
        "patches": patch_hashes(),
    }
    if STAMP.exists():
        try:
            have = json.loads(STAMP.read_text())
        except ValueError:
            have = {}
        if {k: have.get(k) for k in want} == want:
            say(f"vendor/llama.cpp is up to date: {lock['upstream']['release']} + {len(want['patches'])} patch(es)")
            return 0
        say("vendor/llama.cpp does not match the lock and patches/series: unpacking again")
    archive = fetch(lock)
    staging = TREE.with_name(TREE.name + ".new")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    say(f"unpacking {lock['source']['subtree']} of {archive.name}")
    unpack(archive, lock, staging)
    digest = tree_digest(staging)
    if digest != lock["tree_sha256"]:
        shutil.rmtree(staging)
        raise VendorError(f"hash mismatch: unpacked tree digest {digest}, the lock expects {lock['tree_sha256']}")
    for p in want["patches"]:
        apply_patch(PATCHES / p["name"], staging)
        say(f"applied {p['name']}")
    (staging / STAMP.name).write_text(json.dumps(want, indent=1) + "\n")
    if TREE.exists():
        shutil.rmtree(TREE)
    staging.rename(TREE)
    say(
        f"vendor/llama.cpp ready: {lock['upstream']['release']} ({lock['upstream']['commit'][:12]}) "
        f"+ {len(want['patches'])} patch(es)"
    )
    return 0


def pristine_files(lock: dict, files: set[str], dest: Path) -> None:
    """The pin's version of some files, from the verified source package."""
    unpack(fetch(lock), lock, dest, only=files)


def cmd_verify(args) -> int:
    """Digest of the pristine upstream files: for each patched file, take the pin's copy."""
    lock = load_lock()
    if not STAMP.exists():
        raise VendorError("vendor/llama.cpp is not populated; run: python vendor/vendor.py sync")
    touched = set()
    for n in series():
        touched.update(patch_files(PATCHES / n))
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        pristine = d / "tree"
        # Copy the tree, reverse our patches in the copy's touched files, then digest.
        shutil.copytree(TREE, pristine, ignore=shutil.ignore_patterns(".llamabind-stamp.json"))
        for n in reversed(series()):
            p = _git(["apply", "-R", str(PATCHES / n)], pristine)
            if p.returncode != 0:
                raise VendorError(f"{n} does not reverse-apply on vendor/llama.cpp: the tree was edited\n{p.stderr}")
        digest = tree_digest(pristine)
    if digest != lock["tree_sha256"]:
        raise VendorError(
            f"hash mismatch: vendor/llama.cpp (patches reversed) has digest {digest}, "
            f"the lock expects {lock['tree_sha256']}"
        )
    print(
        f"ok: vendor/llama.cpp is {lock['upstream']['release']} ({lock['upstream']['commit']}) "
        f"+ {len(series())} patch(es); tree sha256 {digest}"
    )
    return 0


def status(source: Path | None = None) -> list[dict]:
    """For each patch in the series, in order: its state against the pin (or source) and in vendor/."""
    lock = load_lock()
    names = series()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        base = Path(d) / "base"
        base.mkdir()
        touched = set()
        for n in names:
            touched.update(patch_files(PATCHES / n))
        pin = Path(d) / "pin"  # with a source: the pin series, whose files the 3-way merges start from
        pristine_files(lock, touched, pin if source is not None else base)
        if source is not None:
            _copy_files(source, base, touched)
        for n in names:
            patch = PATCHES / n
            row = {"name": n, "against": "pin" if source is None else str(source)}
            if source is not None:
                merged = merge_patch(patch, pin, base)
                row["state"] = merged["state"]
                if merged["conflicts"]:
                    row["detail"] = "conflict regions: " + ", ".join(
                        f"{f} ({k})" for f, k in merged["conflicts"].items()
                    )
            else:
                fwd, out = check_patch(patch, base)
                if fwd:
                    _git(["apply", str(patch)], base)  # later patches see this one
                rev = not fwd and check_patch(patch, base, reverse=True)[0]
                row["state"] = "applies" if fwd else "already upstream" if rev else "conflicts"
                if row["state"] == "conflicts":
                    row["detail"] = explain_failure(patch, out)
            if STAMP.exists():
                applied = {p["name"]: p["sha256"] for p in json.loads(STAMP.read_text())["patches"]}
                if applied.get(n) == sha256_file(patch):
                    row["vendor"] = "applied"
                elif n in applied:
                    row["vendor"] = "applied (older version of the patch: run sync)"
                else:
                    row["vendor"] = "not applied (run sync)"
            else:
                row["vendor"] = "vendor/llama.cpp not populated"
            rows.append(row)
    return rows


def cmd_status(args) -> int:
    rows = status(Path(args.source).resolve() if args.source else None)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        w = max([len(r["name"]) for r in rows] + [5])
        print(f"{'patch':<{w}}  {'against ' + rows[0]['against'] if rows else '':<20}  vendor/llama.cpp")
        for r in rows:
            print(f"{r['name']:<{w}}  {r['state']:<20}  {r['vendor']}")
            if "detail" in r:
                print("    " + r["detail"].replace("\n", "\n    "))
    return 1 if any(r["state"] == "conflicts" for r in rows) else 0


def _copy_files(src: Path, dest: Path, files: set[str]) -> None:
    for rel in files:
        if (src / rel).exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dest / rel)


def cmd_rehearse(args) -> int:
    """The series over another source (a newer upstream): its tree copied to --out, every patch applied as it is or
    by a 3-way merge, conflict regions marked; prints each patch's state and what needs hands."""
    source, out = Path(args.source).resolve(), Path(args.out).resolve()
    if not (source / "ggml").is_dir():
        raise VendorError(f"--source {source}: not a llama.cpp tree (no ggml/)")
    if out.exists() and any(out.iterdir()):
        raise VendorError(f"--out {out}: exists and is not empty")
    shutil.copytree(source, out, dirs_exist_ok=True, symlinks=True)
    names = series()
    touched = {f for n in names for f in patch_files(PATCHES / n)}
    hands = []
    with tempfile.TemporaryDirectory() as d:
        pin = Path(d) / "pin"
        pristine_files(load_lock(), touched, pin)
        for n in names:
            r = merge_patch(PATCHES / n, pin, out)
            print(f"{n:<72}  {r['state']}")
            for f, k in r["conflicts"].items():
                hands.append(f"{n}: {f} ({k} conflict region{'s' if k > 1 else ''})")
    print(f"{len(names)} patches over {source}; {len(hands)} file(s) need hands" + (":" if hands else ""))
    for h in hands:
        print("  " + h)
    return 1 if hands else 0


def _split_patch(text: str) -> tuple[str, str]:
    """(header through the '---' line, diff part) of a git format-patch file."""
    m = re.search(r"^---\n", text, re.M)
    if not m:
        raise VendorError("not a git format-patch file: no '---' line before the diff")
    return text[: m.end()], text[m.end() :]


def cmd_refresh(args) -> int:
    """Re-export patch NAME: diff between (pin + earlier patches) and the vendor tree's files."""
    lock = load_lock()
    names = series()
    if args.name not in names:
        raise VendorError(f"{args.name} is not in patches/series")
    k = names.index(args.name)
    patch = PATCHES / args.name
    files = set(patch_files(patch)) | set(args.add or [])
    later = [n for n in names[k + 1 :] if files & set(patch_files(PATCHES / n))]
    if later:
        raise VendorError(
            f"{', '.join(later)} touch the same files later in the series; refresh those first or reorder the series"
        )
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d)
        earlier = set()
        for n in names[:k]:
            earlier.update(patch_files(PATCHES / n))
        pristine_files(lock, files | earlier, repo)
        for n in names[:k]:  # every earlier patch: one touching these files may need others applied first
            apply_patch(PATCHES / n, repo)
        _git(["init", "-q"], repo)
        _git(["add", "-A"], repo)
        env = {"GIT_AUTHOR_NAME": "x", "GIT_AUTHOR_EMAIL": "x", "GIT_COMMITTER_NAME": "x", "GIT_COMMITTER_EMAIL": "x"}
        _git(["commit", "-q", "-m", "base"], repo, env={**os.environ, **env})
        for rel in files:
            src = TREE / rel
            if src.exists():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, repo / rel)
            elif (repo / rel).exists():
                (repo / rel).unlink()
        _git(["add", "-A"], repo)
        diff = _git(
            ["diff", "--cached", "--stat=72", "-p", "--no-color", "--no-ext-diff", "--", *sorted(files)], repo
        ).stdout
    if not diff.strip():
        raise VendorError(f"vendor/llama.cpp has no changes for {args.name}'s files: nothing to export")
    header, _ = _split_patch(patch.read_text())
    text = header + diff
    if not text.endswith("\n"):
        text += "\n"
    text += "-- \nllamabind vendor.py refresh\n"
    patch.write_text(text)
    say(f"refreshed {patch} ({len(files)} file(s)); run sync to rebuild the stamp")
    return 0


def cmd_digest(args) -> int:
    """Print the digest of an unpacked pristine tree (for writing a new lock)."""
    print(tree_digest(Path(args.dir)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vendor.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("sync", help="fetch, verify, unpack, apply patches (idempotent)").set_defaults(fn=cmd_sync)
    sub.add_parser("fetch", help="download and verify the pinned source package").set_defaults(fn=cmd_fetch)
    sub.add_parser("verify", help="check vendor/llama.cpp against the lock").set_defaults(fn=cmd_verify)
    s = sub.add_parser("status", help="state of each patch against the pin (or --source)")
    s.add_argument("--source", help="another llama.cpp tree (e.g. a newer upstream) to check against")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)
    h = sub.add_parser("rehearse", help="the series over another source, 3-way merged, into --out")
    h.add_argument("--source", required=True, help="a llama.cpp tree (e.g. a newer upstream)")
    h.add_argument("--out", required=True, help="where the patched copy goes (a new or empty directory)")
    h.set_defaults(fn=cmd_rehearse)
    r = sub.add_parser("refresh", help="re-export a patch from the edited vendor tree")
    r.add_argument("name")
    r.add_argument("--add", action="append", help="also include this file (relative to llama.cpp root)")
    r.set_defaults(fn=cmd_refresh)
    g = sub.add_parser("digest", help="tree digest of a directory")
    g.add_argument("dir")
    g.set_defaults(fn=cmd_digest)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except VendorError as e:
        say(f"error: {e}")
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
