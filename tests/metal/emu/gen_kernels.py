"""ggml-metal's kernels as C++ the CPU runs (issue 57; tests only): each kernels/*.metal of the patched tree
is rewritten where MSL's syntax has no C++ meaning, and thunks are appended that bind a dispatch's
buffers, threadgroup memory and thread-position attributes to each kernel's parameters by the same rules
as Metal (a [[buffer(n)]] index, or the parameter's place among the buffer parameters), plus a table of
the kernels by [[host_name]] that the emulated device's library looks up.

A source using what MSL forbids and C++ allows (`double`, exceptions, goto, ...: MSL_FORBIDDEN) is refused
with its file and line, as Apple's compiler would refuse it.

Rewrites (line numbers kept): `[[threadgroup(n)]]` -> `[[lb_threadgroup(n)]]` (`threadgroup` is an empty
macro); `constant T name [[function_constant(i)]];` -> a thread_local set from the pipeline's constants
before a dispatch runs; `threadgroup T name[n];` in a function body -> `static thread_local` (one array per
OS thread = per threadgroup in flight, shared by its fibers), filled as host-set threadgroup memory is (poison)
when a threadgroup first reaches it (lbrt::tg_local); GNU range designators -> a loop; the
[[host_name]] instantiations are removed (the thunks instantiate what they call). Each source goes into
a namespace of its own (lb_k_<file>). Which kernels exist is read after the preprocessor (#if decided as
the real compile decides them).

Usage: python gen_kernels.py KERNELS_DIR OUT_DIR GGML_METAL_DIR  -> OUT_DIR/<file>.cpp for each kernel file
(GGML_METAL_DIR: where ggml-metal-impl.h is, beside ggml-common.h's directory)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

FRAGMENTS = {"fa_common.metal", "fa_vec_common.metal"}

ATTRS = {
    "threadgroup_position_in_grid": "lbrt::attr{{p.tgpig[0], p.tgpig[1], p.tgpig[2]}}",
    "thread_position_in_threadgroup": "lbrt::attr{{p.tpitg[0], p.tpitg[1], p.tpitg[2]}}",
    "threads_per_threadgroup": "lbrt::attr{{d.tptg[0], d.tptg[1], d.tptg[2]}}",
    "threadgroups_per_grid": "lbrt::attr{{d.grid[0], d.grid[1], d.grid[2]}}",
    "thread_position_in_grid": "lbrt::attr{{p.tgpig[0]*d.tptg[0] + p.tpitg[0], p.tgpig[1]*d.tptg[1] + p.tpitg[1], "
    "p.tgpig[2]*d.tptg[2] + p.tpitg[2]}}",
    "threads_per_grid": "lbrt::attr{{d.grid[0]*d.tptg[0], d.grid[1]*d.tptg[1], d.grid[2]*d.tptg[2]}}",
    "thread_index_in_threadgroup": "lbrt::attr{{p.tiitg, 0, 0}}",
    "simdgroup_index_in_threadgroup": "lbrt::attr{{p.sgitg, 0, 0}}",
    "thread_index_in_simdgroup": "lbrt::attr{{p.tiisg, 0, 0}}",
    "threads_per_simdgroup": "lbrt::attr{{32u, 0, 0}}",
    "simdgroups_per_threadgroup": "lbrt::attr{{(d.tptg[0]*d.tptg[1]*d.tptg[2] + 31) / 32, 0, 0}}",
}

FC_RE = re.compile(r"^(\s*)constant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\(([^\]]*)\)\s*\]\]\s*;", re.M)
TG_LOCAL_RE = re.compile(r"^(\s+)threadgroup\s+([\w:]+(?:\s*<[^;>]*>)?)\s+(\w+)(\s*\[[^;]*\]\s*;)", re.M)
# GNU C's range designators (`float s[N] = { [0 ... N-1] = v };`, which g++ does not take in C++)
RANGE_INIT_RE = re.compile(r"\b([\w:]+)\s+(\w+)\[([^\]]+)\]\s*=\s*\{\s*\[\s*0\s*\.\.\.[^\]]*\]\s*=\s*([^}]+?)\s*\}\s*;")
# explicit instantiations: `kernel type_t name<args>;` or `kernel void name<args>(param types);`
INST_RE = re.compile(
    r'template\s*\[\[\s*host_name\(\s*"([^"]+)"\s*\)\s*\]\]\s*(?:kernel|__lb_kernel__)\s+(?:void\s+)?(?:[\w:]+\s+)?'
    r"(\w+\s*<[^;(]*>)\s*(?:\([^;]*\))?\s*;"
)
KERNEL_RE = re.compile(r"\b__lb_kernel__\s+void\s+(\w+)\s*\(")
SCAN = Path(__file__).parent / "scan"
# what the real compile defines (tests/metal/emu/CMakeLists.txt): bfloat kernels always, no tensor API
DEFINES = ["-DGGML_METAL_HAS_BF16=1", "-D__METAL_VERSION__=310"]


def _params(src: str, open_paren: int) -> str:
    depth, i = 0, open_paren
    while True:
        c = src[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return src[open_paren + 1 : i]
        i += 1


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for c in s:
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    if cur.strip():
        out.append(cur)
    return out


def bind(params: str) -> list[str]:
    """The C++ expression that binds each parameter of a kernel inside a thunk (d: the dispatch, p: the
    thread's position)."""
    exprs, n_buf = [], 0
    for raw in _split_top(re.sub(r"//[^\n]*", "", params)):
        prm = " ".join(raw.split())
        attr = re.search(r"\[\[\s*(\w+)\s*(?:\(([^)]*)\))?\s*\]\]", prm)
        name = attr.group(1) if attr else None
        if name == "buffer":
            exprs.append(f"lbrt::arg{{d.buffers[{attr.group(2)}]}}")
        elif name == "lb_threadgroup":
            exprs.append(f"lbrt::arg{{p.tgmem[{attr.group(2)}]}}")
        elif name in ATTRS:
            exprs.append(ATTRS[name].format())
        elif name is None:
            exprs.append(f"lbrt::arg{{d.buffers[{n_buf}]}}")
            n_buf += 1
        else:
            raise ValueError(f"unknown kernel parameter attribute: {prm}")
    return exprs


def preprocess(src: str, where: Path, ggml_metal: Path, keep_lines: bool = False) -> str:
    """src after the preprocessor with the real compile's #if decisions, `kernel` kept as __lb_kernel__
    (``keep_lines``: with clang's line markers, for messages; without, -P)."""
    cmd = ["clang++", "-E", *([] if keep_lines else ["-P"]), "-x", "c++", "-nostdinc", "-nostdinc++", f"-I{SCAN}",
           f"-I{where}", f"-I{ggml_metal}", f"-I{ggml_metal.parent}", *DEFINES, "-"]  # fmt: skip
    return subprocess.run(cmd, input=src, capture_output=True, text=True, check=True).stdout


# what C++ allows and the Metal Shading Language does not (MSL specification 3.2, sections 1.4 and 2.1: no double
# or long double, no exceptions, RTTI, virtual functions, new/delete, goto, register or thread_local storage): g++
# compiles a kernel using them and the emulator runs it, where Apple's compiler rejects the file
MSL_FORBIDDEN = {
    "double": "MSL has no double type (float is the widest)",
    "goto": "MSL has no goto",
    "virtual": "MSL has no virtual functions",
    "try": "MSL has no exceptions",
    "catch": "MSL has no exceptions",
    "throw": "MSL has no exceptions",
    "new": "MSL has no new (no dynamic allocation)",
    "delete": "MSL has no delete (no dynamic allocation)",
    "typeid": "MSL has no run-time type information",
    "dynamic_cast": "MSL has no run-time type information",
    "thread_local": "MSL has no thread_local storage",
    "register": "MSL has no register storage class",
}
_NOT_CODE_RE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def msl_violations(src: str, where: Path, ggml_metal: Path) -> list[str]:
    """What MSL forbids in ``src`` as the real compile sees it (after the preprocessor; comments and literals
    left out): "FILE:LINE: `word`: why" for each use (FILE "<stdin>" for src itself, else the header)."""
    pre = preprocess(src, where, ggml_metal, keep_lines=True)
    code = _NOT_CODE_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), pre)
    out, file, line = [], "<stdin>", 1
    for raw, text in zip(pre.split("\n"), code.split("\n")):
        marker = re.match(r'#\s*(\d+)\s+"([^"]*)"', raw)
        if marker:  # clang's line marker: the next line is LINE of FILE
            line, file = int(marker.group(1)), marker.group(2)
            continue
        for m in re.finditer(r"\b(" + "|".join(MSL_FORBIDDEN) + r")\b", text):
            out.append(f"{file}:{line}: `{m.group(1)}`: {MSL_FORBIDDEN[m.group(1)]}")
        line += 1
    return out


def translate(src: str, stem: str, where: Path, ggml_metal: Path) -> str:
    bad = [b.replace("<stdin>", f"{stem}.metal", 1) for b in msl_violations(src, where, ggml_metal)]
    if bad:
        raise ValueError(f"{stem}.metal uses what Metal's compiler rejects:\n  " + "\n  ".join(bad))
    fcs = [(m.group(2), m.group(3), m.group(4)) for m in FC_RE.finditer(src)]
    src = FC_RE.sub(lambda m: f"{m.group(1)}static thread_local {m.group(2)} {m.group(3)};", src)
    src = src.replace("[[threadgroup(", "[[lb_threadgroup(")
    src = RANGE_INIT_RE.sub(
        lambda m: f"{m.group(1)} {m.group(2)}[{m.group(3)}]; for (auto & lb_e_ : {m.group(2)}) lb_e_ = {m.group(4)};",
        src,
    )
    src = TG_LOCAL_RE.sub(
        lambda m: (
            f"{m.group(1)}static thread_local {m.group(2)} {m.group(3)}{m.group(4)} "
            f"lbrt::tg_local({m.group(3)}, sizeof({m.group(3)}));"
        ),
        src,
    )

    # the kernels the real compile sees: definitions and instantiations after #if
    pre = preprocess(src, where, ggml_metal)
    defs: dict[str, tuple[str, bool]] = {}
    for m in KERNEL_RE.finditer(pre):
        before = pre[: m.start()]
        head = before[max(before.rfind(";"), before.rfind("}")) + 1 :]
        defs[m.group(1)] = (_params(pre, m.end() - 1), "template" in head)
    kernels: list[tuple[str, str]] = []  # (host name, callable)
    for m in INST_RE.finditer(pre):
        kernels.append((m.group(1), " ".join(m.group(2).split())))
    for name, (_, is_template) in defs.items():
        if not is_template:
            kernels.append((name, name))
    src = INST_RE.sub(lambda m: "\n" * m.group(0).count("\n"), src)

    # one namespace per source: MSL's namespace-scope `constant` data (internal linkage there) and the
    # kernels' helpers stay apart across the sources linked into one library
    out = [
        f"namespace lb_k_{stem} {{\n#line 1\n",
        src,
        "\n// ---- generated by tests/metal/emu/gen_kernels.py ----\n",
        "namespace {\n",
    ]
    out.append("void lb_set_fc(const long long * fc) {\n")
    out += [f"    {n} = ({t}) fc[{e}];\n" for t, n, e in fcs]
    out.append("    (void) fc;\n}\n")
    for i, (host, call) in enumerate(kernels):
        base = call.split("<")[0].strip()
        if base not in defs:
            raise ValueError(f"{stem}: {host}: no definition of {base}")
        args = ",\n        ".join(bind(defs[base][0]))
        out.append(
            f"void lb_thunk_{i}(const lbrt::dispatch & d) {{\n    const lbrt::thread_pos & p = lbrt::pos();\n"
            f"    (void) p;\n    {call}(\n        {args});\n}}\n"
        )
    out.append("const lbrt::kernel_entry lb_entries[] = {\n")
    out += [f'    {{"{host}", lb_thunk_{i}, lb_set_fc, "{stem}.metal"}},\n' for i, (host, _) in enumerate(kernels)]
    out.append("    {nullptr, nullptr, nullptr, nullptr}};\n")
    out.append(f"lbrt::kernel_table lb_table{{lb_entries, {len(kernels)}, nullptr}};\n")
    out.append("struct lb_reg { lb_reg() { lbrt::register_table(&lb_table); } } lb_reg_;\n}  // namespace\n")
    out.append(f"}}  // namespace lb_k_{stem}\n")
    return "".join(out)


def main(kernels: Path, out: Path, ggml_metal: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(kernels.glob("*.metal")):
        if f.name in FRAGMENTS:
            continue
        # the fragments a kernel file includes (fa_common.metal) go in place: their kernels' definitions
        src = re.sub(r'#include "(\w+\.metal)"', lambda m: (kernels / m.group(1)).read_text(), f.read_text())
        text = translate(src, f.stem, kernels, ggml_metal)
        dst = out / f"{f.stem}.cpp"
        if not dst.exists() or dst.read_text() != text:
            dst.write_text(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
