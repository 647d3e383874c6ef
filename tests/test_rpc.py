"""ggml's RPC backend on loopback: servers started with llamabind.rpc.serve (child processes running
`python -m llamabind rpc-server`), models spread over them, ops on a remote device, failures as
exceptions (patch 0011), the loopback default and its warning, and a bounded fuzz of the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import ROOT, run_python

import llamabind
from llamabind import _core, ops, rpc

pytestmark = pytest.mark.skipif(not getattr(_core, "HAS_RPC", False), reason="build without GGML_RPC")
PROMPT = "The capital of France is"
# The servers compute on their CPUs with the GGUF's weight layout. The comparisons are the same
# kernels on both sides: the local reference and the local part of an RPC model keep that layout
# too (repack=False: on a CPU with AMX the repacked weights take other kernels, and greedy text
# parted from the servers' at token 14), and on a GPU build the local reference is a CPU model and
# the RPC models put no layer on the local GPUs (tensor_split 0 there).
LOCAL_GPUS = sum(d["type"] == "gpu" and d["backend"] != "RPC" for d in llamabind.devices())
LOCAL_CPU = {"n_gpu_layers": 0, "op_offload": False, "repack": False} if LOCAL_GPUS else {"repack": False}


def only_rpc(n_servers: int) -> dict:
    """Model kwargs that put every offloaded layer on the RPC servers (the local GPUs come first)."""
    if LOCAL_GPUS:
        return {"tensor_split": [0] * LOCAL_GPUS + [1] * n_servers, "op_offload": False, "repack": False}
    return {"repack": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers():
    ss = [rpc.serve(port=free_port(), device="CPU", threads=1) for _ in range(2)]
    yield ss
    for s in ss:
        s.stop()


@pytest.fixture(scope="module")
def local_tokens(model_path):
    with llamabind.Model(model_path, n_ctx=256, n_threads=2, **LOCAL_CPU) as m:
        return m.generate(PROMPT, max_tokens=32, temperature=0).tokens


def test_two_servers_and_the_local_cpu_match_local_greedy(model_path, servers, local_tokens, caplog):
    caplog.set_level("DEBUG", logger="llamabind.native")
    with llamabind.Model(model_path, n_ctx=256, n_threads=2, rpc=[s.endpoint for s in servers], **only_rpc(2)) as m:
        load_log = caplog.text
        assert m.generate(PROMPT, max_tokens=32, temperature=0).tokens == local_tokens
    # llama.cpp's loader put weights on both servers' devices
    for s in servers:
        assert f"[{s.endpoint}]" in load_log or s.endpoint in load_log, load_log[-2000:]


def test_rpc_devices_are_listed_and_run_ops(servers):
    names = [rpc.connect(s.endpoint) for s in servers]
    listed = {d["name"]: d for d in ops.devices()}
    for s, ns in zip(servers, names):
        assert ns and all(listed[n]["backend"] == "RPC" and listed[n]["description"] == s.endpoint for n in ns)
    a = np.random.default_rng(0).uniform(-1, 1, (8, 33)).astype(np.float32)
    b = np.random.default_rng(1).uniform(-1, 1, (33, 5)).astype(np.float32)
    np.testing.assert_allclose(ops.mul_mat(a, b, backend=names[0][0]), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    assert ops.check(ops.silu, a, backend=names[1][0]) < 1e-7


def test_device_arrays_stay_on_an_rpc_device(servers):
    """A device that is not host memory (ggml-rpc): arrays kept there between ops (issue 21)."""
    from llamabind.ops import eager

    dev = rpc.connect(servers[0].endpoint)[0]
    rng = np.random.default_rng(2)
    x, b = rng.standard_normal((16, 24)).astype(np.float32), rng.standard_normal((16, 24)).astype(np.float32)
    dx, db = ops.to_device(x, dev), ops.to_device(b, dev)
    ops.clear_cache()
    y = ops.mul(dx, db)  # no backend=: the arrays' device
    (exe, _, _), *rest = eager._cache.values()
    assert not rest and exe.graph.device == dev and exe.graph._ggml_graph.bytes_copied == 0
    y = ops.silu(ops.add(y, x))  # a numpy argument goes up; the result stays on the device
    assert isinstance(y, ops.DeviceArray) and y.device == dev
    ref = (x * b + x).astype(np.float64)
    np.testing.assert_allclose(y.numpy(), ref / (1 + np.exp(-ref)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not on the op's device"):
        ops.add(dx, ops.to_device(x, "cpu"))
    with pytest.raises(TypeError, match="CPU and CUDA"):
        y.__dlpack__()


def test_cli_generate_over_two_servers_matches_local(model_path):
    """From the shell, with its own servers (a ggml RPC server serves one client at a time, and this
    test process keeps its connections to the module's servers open)."""

    def cli(*extra):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "llamabind",
                "generate",
                PROMPT,
                "-m",
                str(model_path),
                "--temp",
                "0",
                "-n",
                "24",
                "--no-repack",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    with (
        rpc.serve(port=free_port(), device="CPU", threads=1) as a,
        rpc.serve(port=free_port(), device="CPU", threads=1) as b,
    ):
        if LOCAL_GPUS:  # CPU against CPU (the prompt is under ggml-cuda's 32-token op-offload batch)
            ts = ",".join(["0"] * LOCAL_GPUS + ["1", "1"])
            assert cli("--rpc", a.endpoint, "--rpc", b.endpoint, "--tensor-split", ts) == cli("-ngl", "0")
        else:
            assert cli("--rpc", a.endpoint, "--rpc", b.endpoint) == cli()


def test_unreachable_server_raises(model_path):
    port = free_port()  # nothing listens there
    r = run_python(f"""
import llamabind
try:
    llamabind.Model({str(model_path)!r}, rpc=["127.0.0.1:{port}"])
except ConnectionError as e:
    print("ConnectionError", e)
try:
    llamabind.rpc.connect("no-port")
except ValueError as e:
    print("ValueError", e)
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"ConnectionError Failed to connect to RPC server 127.0.0.1:{port}" in r.stdout and "ValueError" in r.stdout


def test_dead_server_mid_generation_raises(model_path):
    """The server process is killed while tokens stream: LlamaError in the client, no hang, no abort."""
    r = run_python(
        f"""
import llamabind
from llamabind import rpc
s = rpc.serve(port={free_port()}, device="CPU", threads=1)
m = llamabind.Model({str(model_path)!r}, n_ctx=256, n_threads=2, rpc=[s.endpoint])
stream = m.generate("Once upon a time", max_tokens=200, temperature=0, stream=True)
n = 0
try:
    for piece in stream:
        n += 1
        if n == 5:
            s.process.kill(); s.process.wait()
    print("no error after", n)
except llamabind.LlamaError as e:
    print("LlamaError after", n, "pieces:", str(e).splitlines()[0])
m.close()
print("closed")
# listing devices asks every RPC server for its memory: the dead one is marked, nothing hangs
# (a dispatcher thread logging the failure once deadlocked with a caller holding the GIL)
print("devices", [d.get("error") for d in llamabind.devices() if d["backend"] == "RPC"])
""",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LlamaError after" in r.stdout and "RPC server" in r.stdout and "closed" in r.stdout, r.stdout
    assert "devices ['unreachable']" in r.stdout, r.stdout


def test_server_binds_loopback_by_default_and_warns_otherwise():
    with rpc.serve(port=free_port(), device="CPU", threads=1) as s:
        port = int(s.endpoint.rsplit(":", 1)[1])
        listening = [
            line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:] if line.split()[3] == "0A"
        ]  # state LISTEN
        assert f"0100007F:{port:04X}" in listening  # 127.0.0.1, not 0.0.0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rpc.check_host("127.0.0.1")
        rpc.check_host("::1")
    with pytest.warns(UserWarning, match="no authentication"):
        rpc.check_host("0.0.0.0")
    r = subprocess.run(
        [sys.executable, "-m", "llamabind", "rpc-server", "--host", "0.0.0.0", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "port" in r.stderr  # bad port: argparse error, before any socket


def test_bad_arguments():
    with pytest.raises(ValueError, match="host:port"):
        rpc.connect("127.0.0.1")
    with pytest.raises(ValueError, match="host:port"):
        llamabind.Model("smollm2-135m-instruct", rpc=["127.0.0.1:0"])
    with pytest.raises(OSError, match="exited"):
        rpc.serve(port=free_port(), device="NoSuchDevice")


def test_bounded_fuzz_of_the_server_finds_no_crash(tmp_path):
    """tests/fuzz/rpc_fuzz.py: malformed frames on loopback; the server must stay up and serve."""
    n = int(os.environ.get("LLAMABIND_RPC_FUZZ_CASES", "400"))
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fuzz" / "rpc_fuzz.py"), "--cases", str(n), "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"{n} cases" in r.stdout


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns_hosts():
    """Two network namespaces, each a 'host' reached over a veth pair (a real network stack, not lo).
    Needs root and iproute2; skips otherwise (set LLAMABIND_REQUIRE_NETNS=1 to make that a failure)."""
    import shutil

    tag = f"lb{os.getpid() % 100000}"
    hosts, made = [], []
    try:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise PermissionError("needs root and iproute2")
        for i in (1, 2):
            ns, a, b = f"{tag}n{i}", f"{tag}a{i}", f"{tag}b{i}"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            made.append(a)
            _sh("ip", "link", "set", b, "netns", ns)
            _sh("ip", "addr", "add", f"10.213.{i}.1/24", "dev", a)
            _sh("ip", "link", "set", a, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.213.{i}.2/24", "dev", b)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", b, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            hosts.append((ns, f"10.213.{i}.2"))
    except (PermissionError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for x in made:
            subprocess.run(
                ["ip", "netns", "del", x] if not x[len(tag) :].startswith("a") else ["ip", "link", "del", x],
                capture_output=True,
            )
        msg = f"network namespaces unavailable: {getattr(e, 'stderr', '') or e}"
        if os.environ.get("LLAMABIND_REQUIRE_NETNS") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    yield hosts
    for x in made:
        subprocess.run(
            ["ip", "netns", "del", x] if not x[len(tag) :].startswith("a") else ["ip", "link", "del", x],
            capture_output=True,
        )


def test_servers_in_network_namespaces_match_local(model_path, netns_hosts, local_tokens):
    """Each server in its own network namespace, bound to its veth address (which warns), the client
    in the root namespace: the same greedy tokens as local."""
    procs, eps = [], []
    try:
        for ns, addr in netns_hosts:
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        sys.executable,
                        "-m",
                        "llamabind",
                        "rpc-server",
                        "--host",
                        addr,
                        "--port",
                        str(port),
                        "--device",
                        "CPU",
                        "--threads",
                        "1",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            eps.append(f"{addr}:{port}")
        for (ns, addr), ep in zip(netns_hosts, eps):
            for _ in range(200):
                try:
                    socket.create_connection((addr, int(ep.rsplit(":", 1)[1])), timeout=0.5).close()
                    break
                except OSError:
                    time.sleep(0.05)
        with llamabind.Model(model_path, n_ctx=256, n_threads=2, rpc=eps, **only_rpc(len(eps))) as m:
            assert m.generate(PROMPT, max_tokens=32, temperature=0).tokens == local_tokens
    finally:
        for p in procs:
            p.terminate()
            _, err = p.communicate(timeout=10)
            assert "no authentication" in err  # bound beyond loopback: the server warned


def test_cache_dir_keeps_large_tensors_by_hash(model_path, tmp_path, local_tokens):
    """cache_dir: tensors above ggml-rpc's hash threshold (10 MiB; SmolLM2's token embedding) are
    stored on the server by hash, and a second load over a fresh connection still generates the same."""
    with rpc.serve(port=free_port(), device="CPU", threads=1, cache_dir=tmp_path / "cache") as s:
        for _ in range(2):
            with llamabind.Model(model_path, n_ctx=256, n_threads=2, rpc=[s.endpoint], **only_rpc(1)) as m:
                assert m.generate(PROMPT, max_tokens=32, temperature=0).tokens == local_tokens
        cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert cached and max(p.stat().st_size for p in cached) > 10 * 2**20
