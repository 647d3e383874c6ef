"""The tensors of a GGUF file, without building its key/values: gguf's GGUFReader makes numpy views
of every part of every value, ~7 s on 2 cores for SmolLM2's tokenizer arrays (49,152 tokens, 48,900
merges) per file; tests that compare weights of several saved models spent most of their time
there. This walks past the values (their lengths only, the layout of the GGUF specification in
ggml/docs/gguf.md) and maps the tensor data, with gguf's own tables (value types and their numpy
types, GGML_QUANT_SIZES). cut() writes a model's first blocks as a GGUF of their own (gguf's reader and writer)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np

_V = gguf.GGUFValueType
_SCALAR = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}  # value type -> bytes
_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


class Tensor(NamedTuple):
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (the GGUF's ne reversed)
    data: np.ndarray  # F32/F16: that dtype in `shape`; other types: the raw blocks (uint8)


def read(path: str | Path) -> dict[str, Tensor]:
    """name -> Tensor for every tensor of the GGUF at ``path`` (memory-mapped, read-only)."""
    buf = np.memmap(path, mode="r")
    mem = memoryview(buf)
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", mem, 0)
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF v2+ file")
    pos = 24
    alignment = 32

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", mem, pos)
        return bytes(mem[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

    def skip(pos: int, vtype: int) -> int:
        if vtype in _SCALAR:
            return pos + _SCALAR[vtype]
        if vtype == _V.STRING:
            return pos + 8 + struct.unpack_from("<Q", mem, pos)[0]
        if vtype == _V.ARRAY:
            itype, n = struct.unpack_from("<IQ", mem, pos)
            pos += 12
            if itype in _SCALAR:
                return pos + n * _SCALAR[itype]
            for _ in range(n):
                pos = skip(pos, itype)
            return pos
        raise ValueError(f"{path}: unknown value type {vtype} at byte {pos}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", mem, pos)
        pos += 4
        if key == "general.alignment" and vtype == _V.UINT32:
            (alignment,) = struct.unpack_from("<I", mem, pos)
        pos = skip(pos, vtype)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", mem, pos)
        ne = struct.unpack_from(f"<{n_dims}Q", mem, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", mem, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, gguf.GGMLQuantizationType(ttype), tuple(reversed(ne)), offset))
    start = -(-pos // alignment) * alignment
    out = {}
    for name, ttype, shape, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[ttype]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * size
        raw = buf[start + offset : start + offset + nbytes]
        data = raw.view(_DTYPES[ttype]).reshape(shape) if ttype in _DTYPES else raw
        out[name] = Tensor(ttype, shape, data)
    return out


def cut(src: str | Path, dst: str | Path, n_layers: int) -> Path:
    """Writes ``dst``: the GGUF at ``src`` with only transformer blocks 0..n_layers-1 (``blk.N.*``
    with N >= n_layers left out, ``<arch>.block_count`` set to n_layers), every other key/value and
    tensor as it is, quantized ones in their own blocks (gguf's GGUFReader and GGUFWriter)."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        kind = f.types[0]
        value = n_layers if name == f"{arch}.block_count" else f.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, kind, sub_type=f.types[-1])
        else:
            w.add_key_value(name, value, kind)
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= n_layers:
            continue
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
