"""The Metal patches (0003-0007, 0056): well formed, applied, and their pure logic tested on the CPU.

Apple's Metal compiler does not run on Linux; .github/workflows/macos.yml builds and tests them on a
Mac, tests/test_metal_sources.py compiles or parses their sources here. What is arithmetic or index
logic is checked here from the patched vendor tree itself."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import ROOT, VENDOR

PATCHES = ROOT / "patches"
SERIES = [ln.strip() for ln in (PATCHES / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
METAL = [p for p in SERIES if "-metal-" in p]


def test_series_is_well_formed_dep3():
    # 0003-0007, 0056, 0058, 0060, 0061 (tests/test_metal_emu.py runs them in the emulated backend)
    assert len(METAL) == 9
    for name in SERIES:
        text = (PATCHES / name).read_text()
        header = text.split("\n---\n", 1)[0]
        assert text.startswith("From ") and "\nSubject: [PATCH] " in header, name
        for field in ("Description:", "Origin:", "Last-Update:", "Applied-Upstream:", "Test:"):
            assert f"\n{field}" in header, f"{name}: no {field}"
        assert "\nBug:" in header or "\nForwarded:" in header, f"{name}: no Bug/Forwarded"
        assert re.search(r"^diff --git a/\S+ b/\S+$", text, re.M), name
        assert name in (PATCHES / "README.md").read_text(), f"{name} has no row in patches/README.md"


def test_metal_patches_are_applied_in_the_vendor_tree():
    stamp = (VENDOR / ".llamabind-stamp.json").read_text()
    for name in METAL:
        assert name in stamp
    src = (VENDOR / "ggml/src/ggml-metal/ggml-metal-context.m").read_text()
    assert "props_dev->has_unified_memory" in src


def _compile_and_run(code: str, tmp_path) -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "t.cpp").write_text(code)
    exe = tmp_path / "t"
    inc = VENDOR / "ggml" / "src" / "ggml-metal"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{inc}", str(tmp_path / "t.cpp"), "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_mul_mv_ext_r1ptg(tmp_path):
    """patches/0006: the r1ptg choice compiled from the patched ggml-metal-common.h."""
    out = _compile_and_run(
        """
#include "ggml-metal-common.h"
#include <cstdio>
int main() {
    for (int n = 0; n <= 600; ++n)
        std::printf("%d %d %d %d\\n", n, ggml_metal_mul_mv_ext_r1ptg(n, 2, false),
                    ggml_metal_mul_mv_ext_r1ptg(n, 2, true), ggml_metal_mul_mv_ext_r1ptg(n, 4, true));
}
""",
        tmp_path,
    )
    table = {2: 2, 3: 3, 4: 4, 5: 5, 6: 3, 7: 4, 8: 4}  # the switch the patch replaced
    for line in out.splitlines():
        n, off, on, k = map(int, line.split())
        if n <= 8:
            assert off == on == table.get(n, 0), n  # unchanged up to 8 rows, with or without simdgroup_mm
            assert k == (table[n] if n >= 4 else 0), n  # K-quants start at 4 rows
        else:
            assert off == 0, n  # GPUs with simdgroup_mm keep using mul_mm
            assert 2 <= on <= 5 and on == k, n
            idle = (on - n % on) % on
            assert idle == min((r - n % r) % r for r in range(2, 6)), n  # fewest idle rows
    assert 'GGML_ABORT("unsupported ne11")' not in (VENDOR / "ggml/src/ggml-metal/ggml-metal-ops.cpp").read_text()


def test_mask_max_predicate_in_float():
    """patches/0004: 'any mask value of the block is finite' must hold with -INF lanes, computed in
    float. The kernel's predicate is simd_max((float) m) > -MAXHALF over the 32 lanes."""
    src = (VENDOR / "ggml/src/ggml-metal/kernels/fa_vec_common.metal").read_text()
    assert "simd_max((float) sm[qq*C + tiisg]) > -MAXHALF" in src
    maxhalf = float(np.finfo(np.float16).max)
    rng = np.random.default_rng(0)
    for _ in range(200):
        lanes = rng.uniform(-8, 8, 32).astype(np.float16)
        lanes[rng.random(32) < rng.random()] = -np.inf  # blocks from fully masked to unmasked
        pred = lanes.astype(np.float32).max() > -maxhalf
        assert pred == bool(np.isfinite(lanes).any())
    assert not (np.full(32, -np.inf, np.float16).astype(np.float32).max() > -maxhalf)
