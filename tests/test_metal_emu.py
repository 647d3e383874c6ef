"""The Metal backend executed on Linux (issue 57): upstream's ggml-metal C++ (ggml-metal.cpp, -ops, -device,
-common, -fusion, -tuning) of the patched tree, compiled unchanged over a CPU implementation of
ggml-metal-device.h / -context.h (tests/metal/emu), with the kernels/*.metal compiled as C++ and run
thread by thread (a threadgroup's threads are fibers; simdgroup operations run across its 32 lanes).
Upstream's test-backend-ops, built from the same tree, compares each op on "MTL0" with the CPU backend by
NMSE (its limits) under a device profile (LB_MTL_PROFILE): Apple M2 Max, AMD Radeon Pro 5300M (discrete,
no simdgroup matrices), Intel UHD 630 (no Metal3, not Apple7).

In CI a sample: the kernel files of the sample's ops only (the build is the cost: g++ on the kernels) and
small ops. LLAMABIND_METAL_EMU=full builds every kernel file and runs the issue's whole op list under the
three profiles (`./dev test tests/test_metal_emu.py` with it set). Needs g++ >= 12 (_Float16) and cmake."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, VENDOR

EMU = ROOT / "tests" / "metal" / "emu"
FULL = os.environ.get("LLAMABIND_METAL_EMU") == "full"
BUILD = ROOT / "build" / ("metal-emu-full" if FULL else "metal-emu")

# the sample: these kernel files, these ops (upstream's test cases for each, all of them)
SAMPLE_KERNELS = ["binbcast", "norm", "softmax", "quantize", "conv", "rope"]
SAMPLE_OPS = ["ADD", "MUL", "CONCAT", "RMS_NORM", "SOFT_MAX", "GET_ROWS", "IM2COL"]
# the list (ROPE_BACK and SOFT_MAX_BACK / RMS_NORM_BACK: the latter two have no Metal kernel at the pin)
FULL_OPS = SAMPLE_OPS + ["CPY", "ROPE", "ROPE_BACK", "MUL_MAT", "FLASH_ATTN_EXT", "SCALE", "SILU", "GELU", "SUB", "DIV"]
PROFILES = ["apple", "amd", "intel"]


def _gxx_ok() -> bool:
    gxx = shutil.which("g++")
    if not gxx or not shutil.which("cmake"):
        return False
    out = subprocess.run([gxx, "-dumpversion"], capture_output=True, text=True).stdout.strip()
    return int(out.split(".")[0]) >= 12


@pytest.fixture(scope="module")
def backend_ops() -> Path:
    """Builds (or brings up to date) the test build and returns its test-backend-ops."""
    if not _gxx_ok():
        pytest.skip("needs g++ >= 12 and cmake")
    cfg = ["cmake", "-S", str(EMU), "-B", str(BUILD), f"-DLLAMA_DIR={VENDOR}", "-DCMAKE_BUILD_TYPE=Release",
           f"-DLB_MTL_KERNELS={'' if FULL else ';'.join(SAMPLE_KERNELS)}"]  # fmt: skip
    if shutil.which("ccache"):
        cfg += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    for cmd in (cfg, ["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 2)]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    exe = BUILD / "bin" / "test-backend-ops"
    assert exe.exists() and (BUILD / "bin" / "libggml-metal.so").exists()
    return exe


def run_op(exe: Path, op: str, profile: str, params: str | None = None) -> tuple[int, int, str]:
    """test-backend-ops -b MTL0 -o OP [-p PARAMS] under PROFILE, naming the pipelines it compiles
    (LB_MTL_TRACE): (passed, total, output)."""
    env = dict(os.environ, LB_MTL_PROFILE=profile, LB_MTL_TRACE="1")
    cmd = [str(exe), "-b", "MTL0", "-o", op] + (["-p", params] if params else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=exe.parent, timeout=1800)
    out = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr)
    m = re.search(r"(\d+)/(\d+) tests passed", out)
    assert p.returncode == 0 and m, f"{op} on MTL0 ({profile}) rc={p.returncode}:\n{out[-3000:]}"
    return int(m.group(1)), int(m.group(2)), out


def test_mtl0_registers_with_the_profiles_props(backend_ops):
    """The module registers MTL0 through ggml_backend_load_all, named by ggml-metal-device.m's rule, with the
    profile's description; the concurrency decision (patch 0003) follows its unified memory."""
    for profile, name, concurrent in (("apple", "Apple M2 Max", "true"), ("amd", "AMD Radeon Pro 5300M", "false"),
                                      ("intel", "Intel(R) UHD Graphics 630", "true")):  # fmt: skip
        _, total, out = run_op(backend_ops, "CONCAT", profile)
        assert "loaded MTL backend" in out and "Backend 1/2: MTL0" in out
        assert f"Device description: {name} (emulated)" in out
        assert f"use concurrency    = {concurrent}" in out, out[:2000]
        assert total > 0


@pytest.mark.parametrize("profile", PROFILES if FULL else ["apple", "amd"])
@pytest.mark.parametrize("op", FULL_OPS if FULL else SAMPLE_OPS)
def test_op_on_mtl0_matches_the_cpu(backend_ops, op, profile):
    """Every upstream test case of OP that MTL0 supports under PROFILE agrees with the CPU backend
    (test-backend-ops' NMSE limits); at least one case runs."""
    passed, total, out = run_op(backend_ops, op, profile)
    print(f"{op} {profile}: {passed}/{total}")
    assert total > 0 and passed == total, out[-3000:]


def test_patch_0005_intel_profile_runs_simdgroup_reductions(backend_ops):
    """Patch 0005: has_simdgroup_reduction on every Mac2-family GPU, so the Intel profile (no Metal3, not
    Apple7) runs SOFT_MAX and RMS_NORM on MTL0; without it ggml-metal-device.m's supports_op sends every
    case to the CPU ("not supported", no case run)."""
    for op in ("SOFT_MAX", "RMS_NORM"):
        passed, total, out = run_op(backend_ops, op, "intel")
        assert total > 0 and passed == total, out[-2000:]
        assert "not supported [MTL0]" not in out


def test_profiles_take_their_kernels(backend_ops):
    """What the profiles change in the encoding: the Apple profile's RMS_NORM rows of 4 floats take the
    _4 kernels and SOFT_MAX its vector one; the same pipelines under the AMD profile, which has no simdgroup
    matrices but reductions (Metal3), and every case agrees with the CPU under both."""
    for profile in ("apple", "amd"):
        passed, total, out = run_op(backend_ops, "RMS_NORM", profile)
        assert passed == total > 0
        assert "(kernel_rms_norm_f32_4)" in out and "(kernel_rms_norm_f32)" in out
        passed, total, out = run_op(backend_ops, "SOFT_MAX", profile)
        assert passed == total > 0 and "(kernel_soft_max_f32_4)" in out
