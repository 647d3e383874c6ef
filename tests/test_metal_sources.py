"""The Metal sources of the patched tree compiled or parsed on Linux (issue 39), where Apple's Metal
compiler does not run: the C++ files with g++ and clang++, the Objective-C files with clang against
GNUstep's Foundation and a stub of the Metal framework (tests/metal/include), the Metal Shading Language
kernels with clang as C++ behind a shim (tests/metal/msl). Errors fail a check anywhere; warnings fail it
on the lines the patch series adds. Each check is shown to fail on a copy with a misspelled identifier
in a patched line. And the patched decisions that are plain C/C++ run with a discrete-GPU profile and
an Apple-silicon one. Needs clang and libgnustep-base-dev (installed with apt-get when run as root)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, VENDOR, metal_toolchain

METAL = VENDOR / "ggml" / "src" / "ggml-metal"
STUBS = ROOT / "tests" / "metal"
PATCHES = ROOT / "patches"


def _unavailable(msg: str):
    if os.environ.get("LLAMABIND_REQUIRE_METAL_CHECKS") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def tools() -> dict:
    """clang, clang++, g++ and GNUstep's headers (conftest.metal_toolchain: apt-get install as root where they
    are missing)."""
    missing = metal_toolchain()
    if missing:
        _unavailable(missing)
    gcc_objc = sorted(Path("/usr/lib/gcc/x86_64-linux-gnu").glob("*/include/objc/objc.h"))
    if not gcc_objc:
        _unavailable("needs gcc's Objective-C runtime headers (objc/objc.h), which libgnustep-base-dev brings")
    return {"gxx": shutil.which("g++"), "clangxx": shutil.which("clang++"), "clang": shutil.which("clang"),
            "objc_dir": gcc_objc[-1].parent}  # fmt: skip


def patched_lines(rel: str) -> set[int]:
    """Line numbers (in the patched tree) of the lines the series adds to ggml/src/ggml-metal/REL. A file
    that several patches touch: the lines an earlier patch added move with each later patch's hunks."""
    target = f"ggml/src/ggml-metal/{rel}"
    series = [ln.strip() for ln in (PATCHES / "series").read_text().splitlines() if ln.strip()[:1].isdigit()]
    lines: set[int] = set()
    for name in series:
        text = (PATCHES / name).read_text()
        for part in re.split(r"^diff --git ", text, flags=re.M)[1:]:
            if not part.startswith(f"a/{target} "):
                continue
            hunks = [tuple(int(g or 1) for g in m.groups()) for m in
                     re.finditer(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", part, re.M)]  # fmt: skip

            def moved(ln: int) -> int:
                return ln + sum(nl - ol for os_, ol, _, nl in hunks if os_ + ol <= ln)

            lines = {moved(ln) for ln in lines}
            new = 0
            for ln in part.splitlines():
                m = re.match(r"@@ -\d+(?:,\d+)? \+(\d+)", ln)
                if m:
                    new = int(m.group(1))
                elif new and ln.startswith("+") and not ln.startswith("+++"):
                    lines.add(new)
                    new += 1
                elif new and ln.startswith(" "):
                    new += 1
    return lines


def diagnostics(output: str) -> list[tuple[str, int, str, str]]:
    """(file name, line, 'error'|'warning', message) of a compiler's diagnostics."""
    found = []
    for m in re.finditer(r"^(.+?):(\d+):\d+: (fatal error|error|warning): (.*)$", output, re.M):
        found.append(
            (Path(m.group(1)).name, int(m.group(2)), "error" if "error" in m.group(3) else "warning", m.group(4))
        )
    for m in re.finditer(r"^(?:clang\S*: )?(fatal error|error): (.*)$", output, re.M):  # a driver error, no location
        found.append(("", 0, "error", m.group(2)))
    return found


def verdict(output: str, rc: int, path: Path, patched: set[int]) -> list[str]:
    """What fails a check: an error in any file, a warning on a patched line of `path`."""
    bad = [f"{name}:{ln}: {kind}: {msg}" for name, ln, kind, msg in diagnostics(output)
           if kind == "error" or (name == path.name and ln in patched)]  # fmt: skip
    if rc != 0 and not bad:
        bad = [f"{path.name}: exit status {rc}: {output.strip()[-300:]}"]
    return bad


def _run(cmd: list[str]) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


# ---------------------------------------------------------------------------------------------- C++

CPP = sorted(p.name for p in METAL.glob("*.cpp")) if METAL.exists() else []


def check_cpp(compiler: str, src: Path, ggml: Path) -> list[str]:
    inc = [f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{src.parent}"]
    rc, out = _run([compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", *inc, str(src)])
    return verdict(out, rc, src, patched_lines(src.name))


@pytest.mark.parametrize("compiler", ["gxx", "clangxx"])
@pytest.mark.parametrize("name", CPP)
def test_cpp_sources_compile(tools, compiler, name):
    """Every ggml-metal/*.cpp compiles (-fsyntax-only -Wall -Wextra) with g++ and clang++; no warning
    on a line the series adds (upstream's own -Wformat warnings about int64_t and %lld stay)."""
    assert check_cpp(tools[compiler], METAL / name, VENDOR / "ggml") == []


# -------------------------------------------------------------------------------------- Objective-C

OBJC = ["ggml-metal-device.m", "ggml-metal-context.m"]


def check_objc(tools: dict, src: Path, ggml: Path, x86_64: bool, tmp: Path) -> list[str]:
    objc = tmp / "gcc-objc"  # gcc's objc/ alone: its stdatomic.h would shadow clang's
    if not objc.exists():
        objc.mkdir()
        (objc / "objc").symlink_to(tools["objc_dir"])
    cmd = [
        tools["clang"], "-x", "objective-c", "-fsyntax-only", "-fno-objc-arc", "-fblocks", "-Wall",
        "-fobjc-runtime=gnustep-2.0", "-fconstant-string-class=NSConstantString",
        "-DGNUSTEP", "-DGNUSTEP_BASE_LIBRARY=1", "-DGNU_RUNTIME=1", "-D_NATIVE_OBJC_EXCEPTIONS",
        "-DvisionOS=watchOS",  # clang 14 knows no visionOS in @available; the parse needs a known name
        f"-DLB_TARGET_X86_64={int(x86_64)}", f"-I{STUBS / 'include'}",
        "-include", str(STUBS / "include" / "apple_foundation_extras.h"),
        "-I/usr/include/GNUstep", "-idirafter", str(objc),
        f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{src.parent}", str(src),
    ]  # fmt: skip
    rc, out = _run(cmd)
    return verdict(out, rc, src, patched_lines(src.name))


@pytest.mark.parametrize("x86_64", [False, True], ids=["apple-silicon", "intel-mac"])
@pytest.mark.parametrize("name", OBJC)
def test_objc_sources_parse(tools, name, x86_64, tmp_path):
    """ggml-metal-device.m (patch 0005) and ggml-metal-context.m (patch 0003) parse with clang as
    Objective-C (manual retain/release, as ggml-metal builds them) against GNUstep's Foundation and
    tests/metal/include's Metal stub, as for an Apple-silicon Mac and an Intel Mac (where the discrete
    GPUs are); no warning on a patched line."""
    assert check_objc(tools, METAL / name, VENDOR / "ggml", x86_64, tmp_path) == []


# ----------------------------------------------------------------------------- Metal Shading Language

T = r"(float|half|bfloat|int|uint|short|ushort|char|uchar|bool)([234])"


def _type_param_cast(m: re.Match) -> str:
    """`(name_t) e` is a cast unless a declaration precedes it (`typedef void (argsort_t)(...)`)."""
    before = re.search(r"(\w+)\s*$", m.string[: m.start()])
    if before and before.group(1) not in ("return", "case"):
        return m.group(0)
    return f"lb_cast<{m.group(1)}>() ->* "


def msl_copy(kernels: Path, dst: Path) -> Path:
    """The kernels with MSL-only syntax rewritten in place (line numbers kept): `[[threadgroup(n)]]`
    (an attribute named like the address space, an empty macro here) renamed, the [[host_name]]
    attribute of explicit instantiations dropped, and vector conversions ((float4) x, float4(x))
    routed through tests/metal/msl's lb_cast / lb_vec (see msl_prelude.h)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in kernels.iterdir():
        s = f.read_text()
        s = s.replace("[[threadgroup(", "[[lb_threadgroup(")
        s = re.sub(r'template\s*\[\[host_name\("[^"]*"\s*\)\]\]', "template", s)
        s = re.sub(r"(?<![\w)\]])\(\s*(?:const\s+)?" + T + r"\s*\)", r"lb_cast<\1\2>() ->* ", s)
        s = re.sub(r"(?<![\w)\]])\((\w+_t)\)\s*", _type_param_cast, s)
        s = re.sub(r"(?<![\w.])" + T + r"\(", r"lb_vec<\1\2>(", s)
        (dst / f.name).write_text(s)
    return dst


def check_msl(tools: dict, unit: Path, ggml_metal: Path, patched: dict[str, set[int]]) -> list[str]:
    cmd = [
        tools["clangxx"], "-target", "arm64-apple-macos14", "-march=armv8.6-a+bf16", "-nostdinc", "-nostdinc++",
        "-x", "c++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-unknown-attributes", "-Wno-user-defined-literals",
        "-Wno-unused-variable", f"-I{STUBS / 'msl'}", "-include", str(STUBS / "msl" / "msl_prelude.h"),
        f"-I{ggml_metal}", f"-I{ggml_metal.parent}", f"-I{unit.parent}", str(unit),
    ]  # fmt: skip
    rc, out = _run(cmd)
    bad = verdict(out, rc, unit, set())
    for name, lines in patched.items():
        bad += verdict(out, 0, unit.parent / name, lines)
    return list(dict.fromkeys(bad))  # in order, each once


def test_patched_kernel_parses(tools, tmp_path):
    """kernels/fa_vec_common.metal (patch 0004) parses as C++ behind the MSL shim, instantiated by
    fa_vec_f16.metal (its explicit instantiations check the template bodies); no warning on the
    patched lines."""
    k = msl_copy(METAL / "kernels", tmp_path / "kernels")
    patched = {"fa_vec_common.metal": patched_lines("kernels/fa_vec_common.metal")}
    assert patched["fa_vec_common.metal"]
    assert check_msl(tools, k / "fa_vec_f16.metal", METAL, patched) == []


# the kernel files that parse behind the shim at the pin; the rest, and why (first error)
KERNELS_PARSED_AT_LEAST = 19


def test_how_many_kernel_files_parse(tools, tmp_path):
    """Every kernels/*.metal through the shim: how many parse (printed with the first error of each
    one that does not). fa_common.metal and fa_vec_common.metal are fragments that only parse inside
    the files that include them. Fails if fewer parse than at the pin (the shim regressed)."""
    k = msl_copy(METAL / "kernels", tmp_path / "kernels")
    ok, failed = [], {}
    for unit in sorted(k.glob("*.metal")):
        bad = check_msl(tools, unit, METAL, {})
        if bad:
            failed[unit.name] = bad[0]
        else:
            ok.append(unit.name)
    print(f"{len(ok)} of {len(ok) + len(failed)} kernel files parse: {', '.join(ok)}")
    for name, why in failed.items():
        print(f"  {name}: {why}")
    assert "fa_vec_f16.metal" in ok
    assert len(ok) >= KERNELS_PARSED_AT_LEAST, failed


# --------------------------------------------------------------------------- each check can fail


def _misspell(path: Path, lines: set[int]) -> int:
    """Misspell the first identifier of four letters or more on a patched line (not a keyword or a
    comment): `abcd` -> `abcdxq`. Returns the line."""
    text = path.read_text().splitlines(keepends=True)
    for ln in sorted(lines):
        code = text[ln - 1].split("//")[0]
        for m in re.finditer(r"\b[A-Za-z_]\w{3,}\b", code):
            if m.group(0) not in {"const", "static", "return", "char", "bool", "float", "true", "false", "void"}:
                text[ln - 1] = text[ln - 1][: m.end()] + "xq" + text[ln - 1][m.end() :]
                path.write_text("".join(text))
                return ln
    raise AssertionError(f"no identifier on the patched lines of {path}")


def _tree_copy(tmp: Path) -> Path:
    ggml = tmp / "ggml"
    shutil.copytree(VENDOR / "ggml" / "include", ggml / "include")
    shutil.copytree(VENDOR / "ggml" / "src", ggml / "src", ignore=shutil.ignore_patterns("ggml-cuda", "ggml-vulkan"))
    return ggml


@pytest.mark.parametrize(
    "rel", ["ggml-metal-ops.cpp", "ggml-metal.cpp", "ggml-metal-context.m", "ggml-metal-device.m",
            "kernels/fa_vec_common.metal"],
)  # fmt: skip
def test_each_check_reports_a_misspelled_identifier_in_a_patched_line(tools, rel, tmp_path):
    ggml = _tree_copy(tmp_path)
    src = ggml / "src" / "ggml-metal" / rel
    lines = patched_lines(rel)
    assert lines, rel
    ln = _misspell(src, lines)
    if rel.endswith(".cpp"):
        reports = check_cpp(tools["gxx"], src, ggml) + check_cpp(tools["clangxx"], src, ggml)
    elif rel.endswith(".m"):
        reports = check_objc(tools, src, ggml, True, tmp_path)
    else:
        k = msl_copy(src.parent, tmp_path / "kernels")
        reports = check_msl(tools, k / "fa_vec_f16.metal", src.parent.parent, {"fa_vec_common.metal": lines})
    print(rel, ln, reports[:3])
    assert any(f":{ln}: " in r for r in reports), reports


# ---------------------------------------------------------------- the patched decisions, run on Linux


def _build_run(tools: dict, code: str, tmp: Path, extra: list[str] | None = None) -> str:
    (tmp / "t.cpp").write_text(code)
    ggml = VENDOR / "ggml"
    cmd = [tools["gxx"], "-std=c++17", "-O0", "-no-pie", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
           f"-I{METAL}", str(tmp / "t.cpp"), "-o", str(tmp / "t"), *(extra or [])]  # fmt: skip
    rc, out = _run(cmd)
    assert rc == 0, out[-3000:]
    return subprocess.run([str(tmp / "t")], capture_output=True, text=True, check=True, timeout=60).stdout


def test_host_pointer_buffers_only_with_unified_memory(tools, tmp_path):
    """patch 0007: ggml-metal.cpp compiled on Linux (its device functions, ggml-metal-device.m's on a
    Mac, stubbed to return the test's properties) reports buffer_from_host_ptr for an Apple-silicon
    device (unified memory) and not for a discrete GPU; mmap stays supported on both."""
    out = _build_run(
        tools,
        r"""
#include "ggml-metal.cpp"
#include <cstdio>
#include <cstring>
const ggml_metal_device_props * ggml_metal_device_get_props(ggml_metal_device_t dev) {
    return (const ggml_metal_device_props *) dev;
}
void ggml_metal_device_get_memory(ggml_metal_device_t, size_t * free, size_t * total) { *free = *total = 1; }
int main() {
    for (int unified = 0; unified <= 1; ++unified) {
        ggml_metal_device_props p;
        std::memset(&p, 0, sizeof(p));
        p.has_unified_memory = unified;
        ggml_backend_device dev{};
        dev.context = (void *) &p;
        ggml_backend_dev_props props{};
        ggml_backend_metal_device_get_props(&dev, &props);
        std::printf("%d %d %d\n", unified, (int) props.caps.buffer_from_host_ptr, (int) props.caps.mmap_support);
    }
}
""",
        tmp_path,
        ["-Wl,--unresolved-symbols=ignore-all"],  # the rest of ggml-metal is linked in but never called
    )
    assert out.split("\n")[:2] == ["0 0 1", "1 1 1"], out


def test_serial_dispatch_without_unified_memory(tools, tmp_path):
    """patch 0003: the block of ggml_metal_init (ggml-metal-context.m) that sets use_concurrency, taken
    from the patched tree and compiled as C++: serial on a discrete GPU, concurrent with unified memory,
    GGML_METAL_CONCURRENCY_DISABLE=0 forcing it on and =1 off on both."""
    src = (METAL / "ggml-metal-context.m").read_text()
    m = re.search(r"\{\s*const char \* val = getenv\(\"GGML_METAL_CONCURRENCY_DISABLE\"\);.*?\n\s*\}", src, re.S)
    assert m, "the patched block is not in ggml-metal-context.m"
    block = m.group(0)
    out = _build_run(
        tools,
        """
#include <cstdio>
#include <cstdlib>
struct props_t { bool has_unified_memory; };
struct res_t { bool use_concurrency; };
static bool decide(const props_t * props_dev) {
    res_t r{}; res_t * res = &r;
    BLOCK
    return res->use_concurrency;
}
int main() {
    const char * envs[] = { nullptr, "0", "1" };
    for (const char * e : envs) {
        if (e) setenv("GGML_METAL_CONCURRENCY_DISABLE", e, 1); else unsetenv("GGML_METAL_CONCURRENCY_DISABLE");
        for (int unified = 0; unified <= 1; ++unified) {
            props_t p{ (bool) unified };
            std::printf("%s %d %d\\n", e ? e : "-", unified, (int) decide(&p));
        }
    }
}
""".replace("BLOCK", block),
        tmp_path,
    )
    assert out.split() == "- 0 0 - 1 1 0 0 1 0 1 1 1 0 0 1 1 0".split(), out
