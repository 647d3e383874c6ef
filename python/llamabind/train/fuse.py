"""Fuse a LoRA adapter into its base model: one GGUF to ship (mlx-lm's ``fuse``, upstream's
``llama-export-lora``). Read and written with the gguf package (llama.cpp's own GGUF library); the
merged matrices are computed in float32 from the base's values decoded by it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .. import models
from .._validate import as_float, expect
from ..model import FILE_TYPES, quantize

__all__ = ["fuse"]


def _field(reader, name: str):
    f = reader.get_field(name)
    return None if f is None else f.contents()


def fuse(
    base: str | os.PathLike,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    *,
    scale: float = 1.0,
    quantize_to: str | None = None,
    n_threads: int | None = None,
) -> Path:
    """Write ``out``: the model ``base`` (a GGUF path or model name) with the LoRA ``adapter``
    (a llama.cpp LoRA GGUF, e.g. ``finetune(...).adapter.save(path)``) merged in at ``scale``:
    each targeted matrix W (numpy (n_out, n_in)) becomes float32
    ``W + scale * alpha / rank * B @ A``; every other tensor and all metadata are copied as they
    are (so a Q4_1 base keeps its Q4_1 tensors beside F32 merged ones). ``quantize_to``: a key of
    :data:`llamabind.model.FILE_TYPES` (e.g. "Q4_1", "Q8_0") to requantize the result with
    llama_model_quantize (on ``n_threads`` threads; None: all cores). Returns the path written.

    Generating with the fused model equals generating with the base and the adapter applied at
    ``scale`` (``Context.set_lora``) up to float rounding. Raises FileNotFoundError, ValueError
    for a file that is not a LoRA adapter, an adapter tensor the base lacks or whose shape does
    not match, an unknown ``quantize_to``; ImportError without the gguf package."""
    import gguf

    scale = as_float(scale, "scale")
    if quantize_to is not None:
        expect(quantize_to in FILE_TYPES, f"quantize_to must be one of {', '.join(FILE_TYPES)}; got {quantize_to!r}")
    base = models.resolve(base)
    adapter, out = Path(adapter), Path(out)
    if not adapter.is_file():
        raise FileNotFoundError(f"no such adapter: {adapter}")
    ad = gguf.GGUFReader(adapter)
    expect(
        _field(ad, "general.type") == "adapter" and _field(ad, "adapter.type") == "lora",
        f"{adapter} is not a LoRA adapter GGUF (general.type 'adapter', adapter.type 'lora')",
    )
    alpha = _field(ad, "adapter.lora.alpha")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in ad.tensors:
        stem, _, part = t.name.rpartition(".")
        expect(part in ("lora_a", "lora_b"), f"{adapter}: tensor {t.name!r} is not a .lora_a/.lora_b")
        pairs.setdefault(stem, {})[part] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    src = gguf.GGUFReader(base)
    names = {t.name for t in src.tensors}
    for stem, ab in pairs.items():
        expect(stem in names, f"the adapter's {stem!r} is not a tensor of {base.name}")
        expect(len(ab) == 2, f"the adapter's {stem!r} lacks its lora_a or lora_b")
    arch = str(_field(src, "general.architecture"))
    target = out
    tmp = None
    if quantize_to is not None:
        tmp = tempfile.TemporaryDirectory(dir=out.resolve().parent)
        target = Path(tmp.name) / "fused.gguf"
    try:
        w = gguf.GGUFWriter(target, arch)
        for name, f in src.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
                continue
            kind = f.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_key_value(name, f.contents(), kind, sub_type=f.types[-1])
            else:
                w.add_key_value(name, f.contents(), kind)
        datas = []
        for t in src.tensors:
            data = t.data
            if t.name in pairs:
                a, b = pairs[t.name]["lora_a"], pairs[t.name]["lora_b"]  # (rank, n_in), (n_out, rank)
                wt = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
                fits = wt.ndim == 2 and b.shape[0] == wt.shape[0] and a.shape[1] == wt.shape[1]
                expect(
                    fits and a.shape[0] == b.shape[1],
                    f"{t.name}: the adapter's B {b.shape} @ A {a.shape} does not fit the weight {wt.shape}",
                )
                s = scale * (float(alpha) / a.shape[0] if alpha else 1.0)
                data = wt + np.float32(s) * (b @ a)
                w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType.F32)
            else:
                w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
            datas.append(data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for data in datas:
            w.write_tensor_data(data)
        w.close()
        if quantize_to is not None:
            quantize(target, out, quantize_to, n_threads=n_threads)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return out
