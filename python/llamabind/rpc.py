"""Models and ops across hosts with ggml's RPC backend (llama.cpp's own distributed engine).

On each remote host (its GPUs or CPU become devices of the client)::

    python -m llamabind rpc-server --host 0.0.0.0 --port 50052      # no authentication: trusted networks only

On the client::

    model = llamabind.Model("model.gguf", rpc=["10.0.0.2:50052", "10.0.0.3:50052"])  # layers spread
    llamabind.rpc.connect("10.0.0.2:50052")        # or just add the devices: ops.devices() lists "RPC0"...
    ops.add(a, b, backend="RPC0")

:func:`serve` starts a server from Python (a child process running ``python -m llamabind
rpc-server``; :meth:`Server.stop` ends it). The protocol is ggml's (``ggml-rpc.h``, version
``RPC_PROTO``): servers and clients must come from the same llama.cpp pin, which every llamabind
release of one version shares. A server serves one client connection at a time (others wait for
it to disconnect). Weights travel to the servers at load time (``cache_dir`` keeps
them on the server's disk by hash, so a second load sends only hashes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import warnings

from . import _core
from ._validate import endpoint as _endpoint
from ._validate import is_loopback
from .build import default_threads, devices

__all__ = ["Server", "connect", "serve", "DEFAULT_PORT"]

DEFAULT_PORT = 50052  # upstream rpc-server's default
NO_AUTH_WARNING = (
    "the ggml RPC server has no authentication and no encryption: anyone who can reach "
    "{endpoint} can run computations on this host and read what it holds. Bind it to "
    "127.0.0.1 (the default) or use it only on a trusted network."
)


def _join(host: str, port: int) -> str:
    """The endpoint "host:port" (an IPv6 host in brackets); ValueError if it is not a valid one."""
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    _endpoint(endpoint)
    return endpoint


NO_RPC = "this llamabind build has no RPC backend (build with CMAKE_ARGS=-DGGML_RPC=ON)"


def _require_rpc() -> None:
    if not getattr(_core, "HAS_RPC", False):
        raise _core.LlamaError(NO_RPC)


def connect(endpoint: str) -> list[str]:
    """Connect to the RPC server at ``endpoint`` ("host:port") and add its devices to this process's
    ggml device list (:func:`llamabind.devices`, :func:`llamabind.ops.devices`); returns their names
    (e.g. ``["RPC0"]``). Connecting twice to one endpoint returns the same devices.

    Raises ValueError (malformed endpoint), ConnectionError (nothing listening, handshake or protocol
    version mismatch), LlamaError (a build without the RPC backend). Wraps
    ggml_backend_rpc_add_server and ggml_backend_register.
    """
    _endpoint(endpoint)
    _require_rpc()
    return list(_core.rpc_connect(endpoint))


class Server:
    """A running RPC server (a child process); a context manager that stops it on exit."""

    def __init__(self, proc: subprocess.Popen, endpoint: str):
        self.process = proc
        self.endpoint = endpoint

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server process (SIGTERM, then SIGKILL after ``timeout`` seconds). Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<llamabind.rpc.Server {self.endpoint} {'running' if self.running else 'stopped'}>"


def check_host(host: str) -> None:
    """Warn (UserWarning) when a server would listen beyond this machine."""
    if not is_loopback(host):
        warnings.warn(NO_AUTH_WARNING.format(endpoint=host), UserWarning, stacklevel=3)


def serve(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    device: str | list[str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    threads: int | None = None,
    timeout: float = 60.0,
) -> Server:
    """Start a ggml RPC server on ``host:port`` serving ``device`` (a device name such as "CUDA0" or
    "CPU", or a list; None: this build's GPUs, else the CPU) and return once it accepts connections.

    host: the address to bind; 127.0.0.1 unless told otherwise (anything else warns: ggml RPC has
    no authentication). port: TCP port (0 is not allowed: clients must know it). cache_dir: where
    the server keeps tensors it received, by hash (faster reloads); None: no cache. threads: CPU
    threads of a CPU device (None: all cores).

    Returns a :class:`Server` (stop it with ``.stop()`` or a ``with`` block). Raises ValueError
    (bad arguments), OSError (the server could not start, e.g. the port is taken, within
    ``timeout`` seconds). Runs ``python -m llamabind rpc-server`` (ggml_backend_rpc_start_server)
    in a child process: the serving loop never returns, so it is not run in this interpreter.
    """
    endpoint = _join(host, port)
    check_host(host)
    _require_rpc()
    cmd = [sys.executable, "-m", "llamabind", "rpc-server", "--host", host, "--port", str(port), "--quiet-warning"]
    for d in [device] if isinstance(device, str) else (device or []):
        cmd += ["--device", d]
    if cache_dir is not None:
        cmd += ["--cache-dir", os.fspath(cache_dir)]
    if threads is not None:
        cmd += ["--threads", str(int(threads))]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise OSError(f"the RPC server on {endpoint} exited with code {proc.returncode}: {err[-500:]}")
        try:
            with socket.create_connection((host if host != "0.0.0.0" else "127.0.0.1", port), timeout=0.5):
                pass  # accepted and closed: the server logs it and waits for the next client
            return Server(proc, endpoint)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise OSError(f"the RPC server on {endpoint} did not accept connections within {timeout} s")


def parser():
    """The rpc-server command's argparse parser."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m llamabind rpc-server",
        description="Serve this host's devices to llamabind/llama.cpp clients over ggml's RPC "
        "protocol (no authentication: bind to 127.0.0.1 unless on a trusted network).",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", "-p", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    ap.add_argument(
        "--device",
        "-d",
        action="append",
        default=None,
        help="device to serve (repeatable; default: the GPUs, else CPU); see `python -m llamabind info`",
    )
    # (no -c: it is every other command's --ctx-size)
    ap.add_argument("--cache-dir", default=None, help="keep received tensors here by hash (faster reloads)")
    ap.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--quiet-warning", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    """``python -m llamabind rpc-server``: serve until killed (Ctrl-C)."""
    import signal

    ap = parser()
    args = ap.parse_args(argv)
    try:
        endpoint = _join(args.host, args.port)
    except ValueError as e:
        ap.error(str(e))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_host(args.host)
    for w in caught if not args.quiet_warning else ():  # serve() has warned its caller already
        print(f"warning: {w.message}", file=sys.stderr)
    if not getattr(_core, "HAS_RPC", False):
        print(f"error: {NO_RPC}", file=sys.stderr)
        return 2
    local = [d for d in devices() if d["backend"] != "RPC"]
    names = args.device or (
        [d["name"] for d in local if d["type"] != "cpu"] or [d["name"] for d in local if d["type"] == "cpu"]
    )
    if args.cache_dir:
        os.makedirs(args.cache_dir, exist_ok=True)
    threads = args.threads or default_threads()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the C++ loop never returns to Python: let Ctrl-C end it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        _core.rpc_serve(endpoint, args.cache_dir or "", threads, names)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # anything escaping ggml's serving loop ends this server, with a message
        print(f"error: the RPC server stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"error: could not serve on {endpoint} (address in use or not available?)", file=sys.stderr)
    return 1
