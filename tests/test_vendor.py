"""The pin and the patch tooling: vendor/vendor.py sync/verify/status/refresh and build_info."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT

import llamabind

PIN_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
PIN_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PATCH = "0001-ggml-cpu-soft_max_back-dst-aliases-y.patch"


def vendor_py(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, str(ROOT / "vendor" / "vendor.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def vendor_mod():
    spec = importlib.util.spec_from_file_location("llamabind_vendor", ROOT / "vendor" / "vendor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lock_records_the_pin():
    lock = json.loads((ROOT / "vendor" / "llama.cpp.lock").read_text())
    assert lock["upstream"]["commit"] == PIN_COMMIT
    assert lock["upstream"]["release"] == "b11312"
    assert lock["source"]["package"] == "llama-cpp-python" and lock["source"]["version"] == "0.3.36"
    assert lock["source"]["sha256"] == PIN_SDIST_SHA256
    assert len(lock["tree_sha256"]) == 64


def test_verify_pristine_tree_matches_the_lock(vendor_dir):
    p = vendor_py("verify")
    assert p.returncode == 0, p.stderr
    assert "b11312" in p.stdout and PIN_COMMIT in p.stdout


def test_sync_is_idempotent(vendor_dir):
    stamp = (vendor_dir / ".llamabind-stamp.json").stat().st_mtime_ns
    p = vendor_py("sync")
    assert p.returncode == 0, p.stderr
    assert "up to date" in p.stderr
    assert (vendor_dir / ".llamabind-stamp.json").stat().st_mtime_ns == stamp


def test_status_reports_the_patch_applied(vendor_dir):
    p = vendor_py("status", "--json")
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows[PATCH]["state"] == "applies"  # not upstream at b11312
    assert rows[PATCH]["vendor"] == "applied"


def test_status_against_a_tree_that_has_the_fix_says_already_upstream(vendor_dir, tmp_path):
    # A "newer upstream" that contains our fix: the patched file itself.
    rel = "ggml/src/ggml-cpu/ops.cpp"
    (tmp_path / rel).parent.mkdir(parents=True)
    shutil.copy(vendor_dir / rel, tmp_path / rel)
    p = vendor_py("status", "--json", "--source", str(tmp_path))
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows[PATCH]["state"] == "already upstream"


def test_build_info_names_the_pin_and_the_applied_patch():
    info = llamabind.build_info()
    assert info["upstream_release"] == "b11312"
    assert info["upstream_commit"] == PIN_COMMIT
    assert PATCH in info["patches"]
    assert "CPU" in info["backends"]
    assert info["compile_flags"]["CMAKE_BUILD_TYPE"]
    assert any(d["type"] == "cpu" for d in info["devices"])


def _compile_defines(build_ninja: Path) -> dict[str, str]:
    """{source file: its DEFINES line} of every C/C++ compile in a Ninja build file."""
    out, src = {}, None
    for line in build_ninja.read_text().splitlines():
        if line.startswith("build ") and "_COMPILER__" in line:
            src = line.split("_COMPILER__", 1)[1].split()[1]
        elif src and line.startswith("  DEFINES = "):
            out[src], src = line[len("  DEFINES = ") :], None
    return out


def test_the_backend_list_stays_inside_ggml(vendor_dir):
    """CMakeLists.txt keeps ggml's GGML_USE_<BACKEND> definitions private to ggml (upstream: PUBLIC),
    so that a Vulkan or CUDA build of the tree compiles libllama, common, mtmd, server-context and
    _core with the command lines of the CPU build (ccache's direct mode hits). Safe only while no file
    of those targets reads GGML_USE_*: checked in their sources too."""
    builds = [p for p in sorted((ROOT / "build").glob("cp3*/build.ninja")) if "-matrix" not in p.parent.name]
    if not builds:
        pytest.skip("no ./dev build in build/")
    defines = _compile_defines(max(builds, key=lambda p: p.stat().st_mtime))
    reg = [d for s, d in defines.items() if s.endswith("ggml/src/ggml-backend-reg.cpp")]
    assert reg and "-DGGML_USE_CPU" in reg[0]  # ggml itself still registers its backends
    outside = {s: d for s, d in defines.items() if "/ggml/src/" not in s and "GGML_USE_" in d}
    assert not outside, list(outside)[:5]
    assert any(s.endswith("src/llama.cpp") for s in defines) and any("_core.dir" in s for s in defines)
    readers = [
        str(p.relative_to(ROOT))
        for top in (vendor_dir / "src", vendor_dir / "common", vendor_dir / "tools", vendor_dir / "examples",
                    ROOT / "python" / "src")
        for p in top.rglob("*")
        if p.suffix in (".c", ".cpp", ".h", ".hpp") and "GGML_USE_" in p.read_text(errors="replace")
    ]  # fmt: skip
    # upstream's cvector-generator reads GGML_USE_CUDA/METAL; llamabind neither builds nor ships it
    assert [r for r in readers if "cvector-generator" not in r] == [], readers


def test_stubs_ship_with_the_extension():
    pkg = Path(llamabind.__file__).parent
    stub = (pkg / "_core.pyi").read_text()
    assert "class Model" in stub and "def tokenize" in stub
    assert (pkg / "py.typed").exists()


def test_conflicting_patch_names_file_and_hunk(vendor_mod, vendor_dir, tmp_path):
    rel = "ggml/src/ggml-cpu/ops.cpp"
    tree = tmp_path / "tree"
    (tree / rel).parent.mkdir(parents=True)
    shutil.copy(vendor_dir / rel, tree / rel)  # already patched: the patch's context no longer matches
    patch = ROOT / "patches" / PATCH
    with pytest.raises(vendor_mod.VendorError) as e:
        vendor_mod.apply_patch(patch, tree)
    msg = str(e.value)
    assert PATCH in msg and "ggml/src/ggml-cpu/ops.cpp:60" in msg and "hunk" in msg


def test_refresh_reexports_an_edited_tree(vendor_mod, vendor_dir, tmp_path, monkeypatch):
    # Work on a copy of patches/ so the real patch file is untouched. 0022 is the last patch to
    # touch binary-ops.cpp (refresh re-exports a patch from the tree's files as they are).
    patch = "0022-ggml-cpu-binary-ops-flat-range-for-contiguous-operands.patch"
    pdir = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", pdir)
    monkeypatch.setattr(vendor_mod, "PATCHES", pdir)
    tree = tmp_path / "tree"
    rel = "ggml/src/ggml-cpu/binary-ops.cpp"
    (tree / rel).parent.mkdir(parents=True)
    line = "    // One shape and all three contiguous (no broadcast): a flat range of elements per thread. The"
    text = (vendor_dir / rel).read_text().replace(line, line + " // refreshed")
    assert "// refreshed" in text
    (tree / rel).write_text(text)
    monkeypatch.setattr(vendor_mod, "TREE", tree)
    assert vendor_mod.main(["refresh", patch]) == 0
    new = (pdir / patch).read_text()
    assert "+" + line + " // refreshed" in new
    assert new.startswith((ROOT / "patches" / patch).read_text().split("---\n", 1)[0])  # DEP-3 header kept
    # and the refreshed patch applies to the pin's file
    pristine = tmp_path / "pristine"
    vendor_mod.pristine_files(vendor_mod.load_lock(), {rel}, pristine)
    vendor_mod.apply_patch(pdir / patch, pristine)
    assert (pristine / rel).read_text() == text
    # a patch whose files a later patch also changes (0001 and 0023: ggml-cpu/ops.cpp) is refused:
    # the tree holds both, and the earlier patch would swallow the later one's hunks
    before = (pdir / PATCH).read_text()
    assert vendor_mod.main(["refresh", PATCH]) != 0
    assert (pdir / PATCH).read_text() == before


class _Index(http.server.BaseHTTPRequestHandler):
    """A package index on loopback that serves a corrupt llama-cpp-python sdist."""

    def do_GET(self):
        if self.path.startswith("/simple/llama-cpp-python/"):
            body = b'<a href="/files/llama_cpp_python-0.3.36.tar.gz">llama_cpp_python-0.3.36.tar.gz</a>'
        elif self.path == "/files/llama_cpp_python-0.3.36.tar.gz":
            body = b"not the real archive"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_fetch_rejects_a_hash_mismatch(tmp_path):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {
            **os.environ,
            "LLAMABIND_CACHE": str(tmp_path),
            "PIP_INDEX_URL": f"http://127.0.0.1:{srv.server_port}/simple",
        }
        p = vendor_py("fetch", env=env)
    finally:
        srv.shutdown()
    assert p.returncode == 1
    assert "hash mismatch" in p.stderr and PIN_SDIST_SHA256 in p.stderr
    assert not list(tmp_path.rglob("*.tar.gz"))  # nothing unverified is kept


def test_fetch_says_when_the_registry_is_unreachable(tmp_path):
    env = {
        **os.environ,
        "LLAMABIND_CACHE": str(tmp_path),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_INDEX": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "3",
        "PIP_CONFIG_FILE": os.devnull,
    }
    p = vendor_py("fetch", env=env, timeout=600)
    assert p.returncode == 3, p.stderr
    assert "could not download llama-cpp-python==0.3.36" in p.stderr


_PATCH = """diff --git a/a.txt b/a.txt
--- a/a.txt
+++ b/a.txt
@@ -8,7 +8,7 @@
 line 7
 line 8
 line 9
-line 10
+LINE 10 patched
 line 11
 line 12
 line 13
diff --git a/new.txt b/new.txt
new file mode 100644
--- /dev/null
+++ b/new.txt
@@ -0,0 +1 @@
+hello
"""


@pytest.mark.parametrize(
    "upstream,state",
    [
        ({12: "line 12 upstream"}, "applies (3-way)"),  # a context line changed: git apply refuses, the merge is clean
        ({10: "line 10 upstream"}, "conflicts"),  # the line the patch changes, changed otherwise
        ({10: "LINE 10 patched"}, "already upstream"),
        ({-1: "a new first line"}, "applies"),  # moved lines only: git apply's offsets
    ],
)
def test_merge_patch_is_gits_three_way_merge(vendor_mod, tmp_path, upstream, state):
    """Issue 86 item 8: a patch over a newer source applies as it is where it can, else by a 3-way merge of the
    file from the pin's version before and after the patch and the source's (git am -3's rule): a changed context
    line merges cleanly (both changes kept), a changed patched line is a conflict region marked diff3-style with
    the file named, a source that has the change says so, moved lines apply with offsets; the patch's new file is
    created; the pin side always advances."""
    lines = [f"line {i}" for i in range(30)]
    pin, src = tmp_path / "pin", tmp_path / "src"
    for d in (pin, src):
        d.mkdir()
    (pin / "a.txt").write_text("\n".join(lines) + "\n")
    new = list(lines)
    for i, text in upstream.items():
        if i < 0:
            new.insert(0, text)
        else:
            new[i] = text
    (src / "a.txt").write_text("\n".join(new) + "\n")
    if state == "already upstream":
        (src / "new.txt").write_text("hello\n")
    patch = tmp_path / "p.patch"
    patch.write_text(_PATCH)
    r = vendor_mod.merge_patch(patch, pin, src)
    assert r["state"] == state, r
    assert "LINE 10 patched" in (pin / "a.txt").read_text() and (pin / "new.txt").read_text() == "hello\n"
    out = (src / "a.txt").read_text()
    if state == "conflicts":
        assert r["conflicts"] == {"a.txt": 1}
        assert (
            "<<<<<<< source\nline 10 upstream\n||||||| pin\nline 10\n=======\nLINE 10 patched\n>>>>>>> patched" in out
        )
    else:
        assert r["conflicts"] == {} and "LINE 10 patched" in out and (src / "new.txt").read_text() == "hello\n"
        assert all(text in out for text in upstream.values())


def test_rehearse_the_series_over_a_moved_source(vendor_dir, tmp_path):
    """Issue 86 item 8, the whole series: ``vendor.py rehearse --source DIR --out DIR`` over the pin's own files with
    a context line of patch 0001's hunk changed upstream: git apply refuses 0001 there, the 3-way merge takes it, the
    rest apply, nothing needs hands, and the patched copy is the vendor tree's patched file with the upstream change;
    --out refuses a non-empty directory."""
    spec = importlib.util.spec_from_file_location("v", ROOT / "vendor" / "vendor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = tmp_path / "src"
    touched = {f for n in mod.series() for f in mod.patch_files(mod.PATCHES / n)}
    mod.pristine_files(mod.load_lock(), touched, src)
    rel = "ggml/src/ggml-cpu/ops.cpp"
    line = "        // post-order:\n        // dot_y_dy := dot(y, dy)\n"  # the first 2 lines above the changed ones
    upstream = "        // post-order (upstream):\n        // dot_y_dy := dot(y, dy)\n"
    text = (src / rel).read_text()
    assert text.count(line) == 1
    (src / rel).write_text(text.replace(line, upstream))
    p = vendor_py("rehearse", "--source", str(src), "--out", str(tmp_path / "out"), timeout=600)
    print(p.stdout[-3000:], p.stderr[-2000:])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 file(s) need hands" in p.stdout
    assert "0001-ggml-cpu-soft_max_back-dst-aliases-y.patch" in p.stdout.split("applies (3-way)")[0].splitlines()[-1]
    assert (tmp_path / "out" / rel).read_text() == (vendor_dir / rel).read_text().replace(line, upstream)
    again = vendor_py("rehearse", "--source", str(src), "--out", str(tmp_path / "out"))
    assert again.returncode == 1 and "is not empty" in again.stderr + again.stdout
