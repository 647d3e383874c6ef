"""A mutation fuzzer for GGUF loading: llamabind.Model(path) and Model(path, vocab_only=True).

Seeds are real files (a small llama GGUF written like bench/make_model.py, upstream's vocab-only
GGUFs). Mutations are structure-aware: the header is parsed so that counts, string lengths, value
types, array lengths, tensor dims/types/offsets and the alignment can be set to hostile values;
plus truncations, duplicated keys and random bit flips. Each mutant is loaded by a worker
subprocess, so an abort or a segfault kills only the worker: the parent records the input and
starts a new one. A load that takes too long is a hang.

    python tests/fuzz/gguf_fuzz.py --iterations 2000 --seed 1 [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
CRASHES = HERE / "crashes"

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SIZES = {U8: 1, I8: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, BOOL: 1, U64: 8, I64: 8, F64: 8}


@dataclass
class Layout:
    """Byte offsets of the fields of a GGUF header (what the mutators aim at)."""

    n_tensors_pos: int = 8
    n_kv_pos: int = 16
    kv_entries: list = field(default_factory=list)  # dicts: key_len, key, type, value, arr_type, arr_n, end
    tensors: list = field(default_factory=list)  # dicts: name_len, n_dims, dims[], type, offset
    alignment_value_pos: int | None = None
    header_end: int = 0


def parse(data: bytes) -> Layout:
    lay = Layout()
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def read_str(p):
        n = struct.unpack_from("<Q", data, p)[0]
        return p + 8 + n, data[p + 8 : p + 8 + n]

    for _ in range(n_kv):
        e = {"key_len": pos}
        pos, key = read_str(pos)
        e["key"] = key
        e["type"] = pos
        t = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        e["value"] = pos
        if t == STR:
            pos, _ = read_str(pos)
        elif t == ARR:
            at, n = struct.unpack_from("<IQ", data, pos)
            e["arr_type"], e["arr_n"] = pos, pos + 4
            pos += 12
            if at == STR:
                for _ in range(n):
                    pos, _ = read_str(pos)
            else:
                pos += SIZES[at] * n
        else:
            if key == b"general.alignment":
                lay.alignment_value_pos = pos
            pos += SIZES[t]
        e["end"] = pos
        lay.kv_entries.append(e)
    for _ in range(n_tensors):
        t = {"name_len": pos}
        pos, _ = read_str(pos)
        t["n_dims"] = pos
        nd = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        t["dims"] = [pos + 8 * i for i in range(nd)]
        pos += 8 * nd
        t["type"] = pos
        pos += 4
        t["offset"] = pos
        pos += 8
        lay.tensors.append(t)
    lay.header_end = pos
    return lay


HOSTILE_U64 = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 0x4000000000]
HOSTILE_U32 = [0, 1, 12, 13, 31, 39, 40, 255, 2**31 - 1, 2**32 - 1]


def put(b: bytearray, pos: int, fmt: str, v) -> None:
    if pos + struct.calcsize(fmt) <= len(b):
        struct.pack_into(fmt, b, pos, v)


def mutate(data: bytes, lay: Layout, rng: random.Random) -> tuple[bytes, str]:
    b = bytearray(data)
    kind = rng.choice(
        [
            "count",
            "strlen",
            "vtype",
            "arr",
            "dims",
            "ttype",
            "offset",
            "align",
            "dup",
            "trunc",
            "flip",
            "flip",
            "version",
            "ndims",
        ]
    )
    if kind == "count":
        put(b, rng.choice([lay.n_tensors_pos, lay.n_kv_pos]), "<Q", rng.choice(HOSTILE_U64))
    elif kind == "strlen" and (lay.kv_entries or lay.tensors):
        e = rng.choice(lay.kv_entries + lay.tensors)
        put(b, e["key_len"] if "key_len" in e else e["name_len"], "<Q", rng.choice(HOSTILE_U64))
    elif kind == "vtype" and lay.kv_entries:
        put(b, rng.choice(lay.kv_entries)["type"], "<I", rng.choice(HOSTILE_U32))
    elif kind == "arr":
        arrs = [e for e in lay.kv_entries if "arr_n" in e]
        if arrs:
            e = rng.choice(arrs)
            if rng.random() < 0.5:
                put(b, e["arr_n"], "<Q", rng.choice(HOSTILE_U64))
            else:
                put(b, e["arr_type"], "<I", rng.choice(HOSTILE_U32))
    elif kind == "dims" and lay.tensors:
        t = rng.choice(lay.tensors)
        if t["dims"]:
            put(b, rng.choice(t["dims"]), "<Q", rng.choice(HOSTILE_U64 + [3, 7, 33]))
    elif kind == "ndims" and lay.tensors:
        put(b, rng.choice(lay.tensors)["n_dims"], "<I", rng.choice(HOSTILE_U32))
    elif kind == "ttype" and lay.tensors:
        put(b, rng.choice(lay.tensors)["type"], "<I", rng.choice(HOSTILE_U32 + list(range(4, 42))))
    elif kind == "offset" and lay.tensors:
        put(b, rng.choice(lay.tensors)["offset"], "<Q", rng.choice(HOSTILE_U64 + [len(data), 1, 3, 31]))
    elif kind == "align":
        if lay.alignment_value_pos is not None:
            put(b, lay.alignment_value_pos, "<I", rng.choice([0, 1, 3, 7, 48, 2**31, 2**32 - 1]))
    elif kind == "dup" and lay.kv_entries:
        e = rng.choice(lay.kv_entries)
        if len(data) >= lay.header_end:
            b[lay.header_end : lay.header_end] = data[e["key_len"] : e["end"]]  # a second copy of a key/value
            n_kv = struct.unpack_from("<Q", data, lay.n_kv_pos)[0]
            put(b, lay.n_kv_pos, "<Q", (n_kv + 1) % 2**64)
    elif kind == "trunc":
        cut = rng.choice([rng.randrange(0, max(1, lay.header_end)), rng.randrange(0, len(data))])
        del b[cut:]
    elif kind == "version":
        put(b, 4, "<I", rng.choice([0, 1, 2, 4, 2**31, 2**32 - 1]))
    else:  # random bit flips, mostly in the header
        for _ in range(rng.randint(1, 16)):
            i = rng.randrange(0, max(1, min(len(b), lay.header_end + 64 if rng.random() < 0.9 else len(b))))
            b[i] ^= 1 << rng.randrange(8)
    return bytes(b), kind


WORKER = r"""
import sys
import llamabind
for line in sys.stdin:
    path, vocab_only = line.rsplit(" ", 1)
    try:
        m = llamabind.Model(path, vocab_only=vocab_only.strip() == "1", n_ctx=64)
        if not m.vocab_only:
            m.generate("Hi", max_tokens=2, temperature=0)
        m.tokenize("Hello, world")
        m.close()
        r = "ok"
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        r = "error " + type(e).__name__
    except Exception as e:  # any other exception type is a bug of ours, but the process lives
        r = "unexpected " + type(e).__name__ + ": " + str(e)[:200].replace("\n", " ")
    print("RESULT " + r, flush=True)
"""


class Worker:
    def __init__(self):
        env = dict(os.environ, GGML_NO_BACKTRACE="1")  # ggml's abort handler would run gdb into our pipe
        self.p = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )

    def load(self, path: str, vocab_only: bool, timeout: float) -> str:
        try:
            self.p.stdin.write(f"{path} {1 if vocab_only else 0}\n")
            self.p.stdin.flush()
        except BrokenPipeError:  # the worker died after its last answer
            self.p.wait()
            return f"crash {self.p.returncode} (after the previous input)"
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.p.kill()
            self.p.wait()
            return "hang"
        while True:
            line = self.p.stdout.readline()
            if not line:
                self.p.wait()
                return f"crash {self.p.returncode}"
            if line.startswith("RESULT "):
                return line[len("RESULT ") :].strip()

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=10)
        except Exception:
            self.p.kill()


def seeds(model: Path | None = None) -> list[tuple[Path, bool]]:
    """(path, vocab_only) seed files: a small full model and upstream's vocab-only GGUFs."""
    out = []
    if model is not None and model.exists():
        out.append((model, False))
        out.append((model, True))
    vendor = HERE.parent.parent / "vendor" / "llama.cpp" / "models"
    for name in ("llama-bpe", "llama-spm", "gpt-2", "qwen2", "bert-bge", "phi-3"):
        p = vendor / f"ggml-vocab-{name}.gguf"
        if p.exists():
            out.append((p, True))
    return out


def run(
    iterations: int, seed: int, model: Path | None, timeout: float = 30.0, keep: Path | None = None, log=None
) -> dict:
    rng = random.Random(seed)
    base = [(p, vo, p.read_bytes()) for p, vo in seeds(model)]
    layouts = [parse(d) for _, _, d in base]
    stats = {"tried": 0, "ok": 0, "error": 0, "unexpected": 0, "crash": 0, "hang": 0, "by_kind": {}, "crashes": []}
    worker = Worker()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        for i in range(iterations):
            k = rng.randrange(len(base))
            path, vocab_only, data = base[k]
            mutant, kind = mutate(data, layouts[k], rng)
            if rng.random() < 0.2:  # stack a second mutation sometimes
                mutant, kind2 = mutate(mutant, layouts[k], rng)
                kind = f"{kind}+{kind2}"
            f = Path(d) / f"m{i}.gguf"
            f.write_bytes(mutant)
            prev = getattr(run, "_prev", None)
            r = worker.load(str(f), vocab_only, timeout)
            stats["tried"] += 1
            bucket = r.split()[0]
            stats[bucket] = stats.get(bucket, 0) + 1
            stats["by_kind"].setdefault(kind.split("+")[0], {}).setdefault(bucket, 0)
            stats["by_kind"][kind.split("+")[0]][bucket] += 1
            if bucket in ("crash", "hang", "unexpected"):
                dest = keep or CRASHES
                dest.mkdir(parents=True, exist_ok=True)
                name = f"{bucket}-{path.stem}-{'vocab' if vocab_only else 'full'}-{kind}-{seed}-{i}.gguf"
                (dest / name).write_bytes(mutant)
                if prev is not None:  # state from the input before may be the cause (e.g. heap damage)
                    (dest / (name[:-5] + ".previous.gguf")).write_bytes(prev)
                stats["crashes"].append({"file": name, "result": r, "kind": kind})
                worker = Worker()
            run._prev = mutant
            f.unlink()
            if log and (i + 1) % 500 == 0:
                print(
                    f"{i + 1} inputs, {stats.get('crash', 0)} crashes, {stats.get('hang', 0)} hangs, "
                    f"{time.time() - t0:.0f} s",
                    file=log,
                    flush=True,
                )
    worker.close()
    stats["seconds"] = round(time.time() - t0, 1)
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None, help="a small full GGUF to mutate (default: make one)")
    ap.add_argument(
        "--keep", type=Path, default=None, help="where to write crashing inputs (default tests/fuzz/crashes)"
    )
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = Path(tempfile.gettempdir()) / "llamabind-fuzz-micro.gguf"
        if not model.exists():
            subprocess.run(
                [
                    sys.executable,
                    str(HERE.parent.parent / "bench" / "make_model.py"),
                    "--size",
                    "micro",
                    "--type",
                    "q8_0",
                    "-o",
                    str(model),
                ],
                check=True,
                capture_output=True,
            )
    stats = run(args.iterations, args.seed, model, keep=args.keep, log=sys.stderr)
    print(json.dumps(stats, indent=1))
    return 1 if stats.get("crash") or stats.get("hang") or stats.get("unexpected") else 0


if __name__ == "__main__":
    sys.exit(main())
