#!/usr/bin/env python3
"""Bounded fuzz of the ggml RPC server (upstream's server code, as llamabind.rpc.serve runs it) with
malformed frames on loopback.

    python tests/fuzz/rpc_fuzz.py [--cases 400] [--seed 1]

Each case opens a connection and sends, after a valid HELLO (or, in one case of ten, garbage in its
place), one to six frames ``cmd (u8) | size (u64 LE) | payload``: random commands (valid and not),
sizes near the protocol's structs or random (and sometimes huge), payloads random, zero-filled or
carrying a pointer of a buffer the server really allocated. After every case the server process
must be alive, and every 25 cases a real client (HELLO + DEVICE_COUNT) must be served. Exit 0 and
"N cases" on success; 1 with the case's seed when the server died.
"""

from __future__ import annotations

import argparse
import random
import socket
import struct
import sys
import time

from llamabind import rpc

HELLO, DEVICE_COUNT, ALLOC_BUFFER, N_CMDS = 14, 15, 0, 19
CAPS = 24  # RPC_CONN_CAPS_SIZE
RPC_TENSOR = 296  # sizeof(rpc_tensor) at this pin (the protocol structs are packed)
SIZES = [
    0,
    1,
    4,
    8,
    12,
    16,
    20,
    24,
    28,
    32,
    40,
    48,
    RPC_TENSOR,
    RPC_TENSOR + 4,
    RPC_TENSOR + 8,
    RPC_TENSOR + 16,
    2 * RPC_TENSOR + 12,
    4096,
]


def frame(cmd: int, payload: bytes, size: int | None = None) -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload) if size is None else size) + payload


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def hello(s: socket.socket) -> None:
    s.sendall(frame(HELLO, bytes(CAPS)))
    size = struct.unpack("<Q", recv_exact(s, 8))[0]
    recv_exact(s, size)


def served(port: int) -> bool:
    """A real client: HELLO, then DEVICE_COUNT answered with a count >= 1."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            hello(s)
            s.sendall(frame(DEVICE_COUNT, b""))
            size = struct.unpack("<Q", recv_exact(s, 8))[0]
            return size == 4 and struct.unpack("<I", recv_exact(s, 4))[0] >= 1
    except OSError:
        return False


def remote_buffer(port: int) -> int:
    """ALLOC_BUFFER of 4 KiB on device 0: a pointer the server really has (0 if refused)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        hello(s)
        s.sendall(frame(ALLOC_BUFFER, struct.pack("<IQ", 0, 4096)))  # packed {u32 device; u64 size}
        size = struct.unpack("<Q", recv_exact(s, 8))[0]
        rsp = recv_exact(s, size)
        return struct.unpack("<Q", rsp[:8])[0] if size >= 8 else 0


def one_case(port: int, rng: random.Random, buffers: list[int], sent: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(0.3)
        if rng.random() < 0.1:
            s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))))
            return
        hello(s)
        for _ in range(rng.randrange(1, 7)):
            cmd = rng.randrange(N_CMDS + 3)
            size = rng.choice(SIZES) if rng.random() < 0.8 else rng.randrange(0, 1 << 16)
            kind = rng.random()
            if kind < 0.4:
                payload = bytes(rng.getrandbits(8) for _ in range(size))
            elif kind < 0.6:
                payload = bytes(size)
            else:  # random words with real buffer pointers sprinkled in
                words = [rng.choice(buffers + [0, 1, rng.getrandbits(64)]) for _ in range(size // 8 + 1)]
                payload = b"".join(struct.pack("<Q", w) for w in words)[:size]
            declared = size if rng.random() < 0.9 else rng.choice([size + 1, max(size - 1, 0), 1 << 40, (1 << 64) - 1])
            sent.append(frame(cmd, payload, declared))
            try:
                s.sendall(sent[-1])
                s.recv(1 << 16)  # read whatever answer there is
            except (TimeoutError, ConnectionError, OSError):
                return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = rpc.serve(port=port, device="CPU", threads=1)
    t0 = time.monotonic()
    try:
        buffers = [remote_buffer(port) for _ in range(3)]
        recent: list[tuple[int, list[bytes]]] = []  # the cases since the server last answered a real client
        for i in range(args.cases):
            seed = args.seed * 1_000_003 + i
            sent: list[bytes] = []
            recent.append((seed, sent))
            try:
                one_case(port, random.Random(seed), buffers, sent)
            except OSError:
                pass  # refused or reset: judged by the server's state below
            for _ in range(5):  # a frame that aborts the server mostly kills it within these 10 ms
                if not server.running:
                    break
                time.sleep(0.002)
            if not server.running:  # a later death is seen here, or by served(): every recent case is listed
                err = server.process.stderr.read().decode(errors="replace")[-1500:] if server.process.stderr else ""
                cases = [
                    (sd, [(f[0], struct.unpack("<Q", f[1:9])[0], len(f) - 9) for f in fr]) for sd, fr in recent[-5:]
                ]
                print(
                    f"server died (exit {server.process.returncode}) at case {i} (seed {seed}); the last cases' "
                    f"(seed, frames after HELLO as (cmd, declared size, payload bytes)): {cases}"
                    f"\nserver stderr: {err}"
                )
                return 1
            if i % 25 == 24:
                if not served(port):
                    print(
                        f"server stopped serving after case {i}; the cases since it last served: seeds "
                        f"{[r[0] for r in recent]}"
                    )
                    return 1
                recent.clear()
    finally:
        server.stop()
    print(f"{args.cases} cases, server alive and serving ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
