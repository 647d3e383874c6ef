#!/usr/bin/env python3
"""Write multimodal projector (mmproj) GGUFs with random weights in the layout of real ones, for
the multimodal tests and benchmarks (no trained projector is reachable here).

    python bench/make_mmproj.py vision -o /tmp/mmproj-gemma3.gguf [--n-embd-text 576]
    python bench/make_mmproj.py audio  -o /tmp/mmproj-ultravox.gguf
    python bench/make_mmproj.py omni   -o /tmp/mmproj-both.gguf      # both encoders in one file
    python bench/make_mmproj.py qwen2vl -o /tmp/mmproj-qwen2vl.gguf --text-from SmolLM2.gguf \
        --text-out /tmp/smollm2-mrope.gguf                              # + an M-RoPE text model
    python bench/make_mmproj.py idefics3 -o /tmp/mmproj-smolvlm.gguf --text-from SmolLM2.gguf \
        --text-out /tmp/smollm2-smolvlm.gguf                            # + SmolVLM's image tokens

The keys and tensor names are the ones llama.cpp's ``tools/mtmd/clip.cpp`` reads (clip-impl.h's
KEY_* and TN_*), as ``convert_hf_to_gguf.py --mmproj`` writes them:

- vision, ``gemma3``: Gemma 3's SigLIP encoder (patch conv, learned position embeddings,
  pre-norm ViT blocks with biases, GELU MLP, post-LN), the 4x4 average pool and the projector
  (RMS soft-embedding norm, ``mm.input_projection``). Real Gemma 3: 896 px, patch 14, 1152 wide,
  27 blocks, 256 tokens per image. Default here: 224 px, patch 14, 192 wide, 2 blocks, 16 tokens
  per image (``--size base``: SigLIP-base's 768 x 12 blocks at 448 px, 64 tokens; ``--size real``:
  the real shapes).
- audio, ``ultravox``: a Whisper encoder (two conv1d over 128 mel bins, the second with stride 2,
  1500 positions, pre-norm blocks, no bias on attn_k) with Ultravox's projector (frames stacked by
  8, RMS pre-norm, SwiGLU MLP, RMS mid-norm). Default: Whisper-tiny's 384 wide (so the second
  conv1d's im2col has KW*IC = 3*384 = 1152 > 1024 columns), 2 blocks; ``--size real``:
  Whisper-large's 1280 wide, 32 blocks.

- vision, ``idefics3``: SmolVLM's (SigLIP at 512 px, patch 16, a 4x4 pixel shuffle, one linear
  layer: 64 tokens per tile); an image is cut into 512 px tiles after an overview, one medium in
  several chunks. ``idefics3_text`` gives a text model SmolVLM's two image tokens.
- vision, ``qwen2vl_merger``: Qwen2-VL's ViT (two patch convs, one per frame of a temporal
  patch, no position embeddings: 2D M-RoPE in every block; LayerNorm blocks with biases) and its
  merger (LayerNorm, 2x2 patches concatenated, GELU MLP). Images keep their aspect ratio: an
  image gives (h/28) x (w/28) tokens but only max(h, w)/28 text positions, the decoder's M-RoPE
  places the tokens on a grid. Default 192 wide x 2 blocks; ``--size real``: Qwen2-VL's 1280 x 32.
  Such a projector needs an M-RoPE text model: ``mrope_text`` (``--text-from/--text-out``) writes
  a copy of a llama-architecture GGUF (SmolLM2) as llama.cpp's ``qwen2vl`` architecture, with
  Qwen2-VL's rope sections scaled to its head size.

``--n-embd-text`` is the text model's n_embd (576: SmolLM2-135M's; mtmd refuses a projector
whose output width differs from the text model's). Matrices are F16 (as the converter writes
them), norms, biases and position embeddings F32. The output is meaningless; the path is real.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

# (width, blocks, heads, ffn, image size, patch) per size
VISION = {
    "small": (192, 2, 3, 768, 224, 14),
    "base": (768, 12, 12, 3072, 448, 14),  # SigLIP-base's blocks at 448 px: 64 tokens per image
    "real": (1152, 27, 16, 4304, 896, 14),
}
QWEN2VL = {"small": (192, 2, 3, 768), "base": (768, 12, 12, 3072), "real": (1280, 32, 16, 5120)}
AUDIO = {"small": (384, 2, 6, 1536), "base": (768, 12, 12, 3072), "real": (1280, 32, 20, 5120)}


def _writer(path: str, kind: str, name: str):
    import gguf

    w = gguf.GGUFWriter(path, "clip")
    w.add_string("general.name", name)
    w.add_string("general.description", f"random-weight {kind} projector in a real projector's layout (llamabind)")
    w.add_uint32("general.file_type", 1)  # mostly F16
    return w


def _blocks(w, rng: np.random.Generator, prefix: str, n: int, width: int, n_ff: int, k_bias: bool) -> None:
    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    def vec(k: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(k) * scale).astype(np.float32)

    for i in range(n):
        b = f"{prefix}.blk.{i}"
        for p in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{p}.weight", mat(width, width))
            if p != "attn_k" or k_bias:
                w.add_tensor(f"{b}.{p}.bias", vec(width))
        for ln in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{ln}.weight", (1 + vec(width, 0.1)).astype(np.float32))
            w.add_tensor(f"{b}.{ln}.bias", vec(width))
        w.add_tensor(f"{b}.ffn_up.weight", mat(n_ff, width))
        w.add_tensor(f"{b}.ffn_up.bias", vec(n_ff))
        w.add_tensor(f"{b}.ffn_down.weight", mat(width, n_ff))
        w.add_tensor(f"{b}.ffn_down.bias", vec(width))
    w.add_tensor(f"{prefix}.post_ln.weight", np.ones(width, np.float32))
    w.add_tensor(f"{prefix}.post_ln.bias", np.zeros(width, np.float32))


def _common(w, modality: str, width: int, blocks: int, heads: int, n_ff: int, n_embd_text: int, eps: float) -> None:
    w.add_uint32(f"clip.{modality}.embedding_length", width)
    w.add_uint32(f"clip.{modality}.feed_forward_length", n_ff)
    w.add_uint32(f"clip.{modality}.block_count", blocks)
    w.add_uint32(f"clip.{modality}.projection_dim", n_embd_text)
    w.add_uint32(f"clip.{modality}.attention.head_count", heads)
    w.add_float32(f"clip.{modality}.attention.layer_norm_epsilon", eps)


def vision(path: str, n_embd_text: int = 576, size: str = "small", seed: int = 0) -> str:
    """A Gemma 3 vision projector (``clip.projector_type = gemma3``) at ``path``."""
    w = _writer(path, "vision", f"gemma3-vision-random-{size}")
    w.add_string("clip.projector_type", "gemma3")
    _vision(w, np.random.default_rng(seed), n_embd_text, size)
    _finish(w)
    return path


def _vision(w, rng: np.random.Generator, n_embd_text: int, size: str) -> None:
    width = _siglip(w, rng, n_embd_text, *VISION[size])
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(width, np.float32))  # the converter stores 1 + w
    w.add_tensor(  # outputs of about the text model's embedding scale (std 0.1)
        "mm.input_projection.weight",
        (rng.standard_normal((width, n_embd_text)) * 0.1 / np.sqrt(width)).astype(np.float16),
    )


def idefics3(path: str, n_embd_text: int = 576, size: str = "small", seed: int = 0, longest_edge: int = 1024) -> str:
    """A SmolVLM / Idefics3 vision projector (``clip.projector_type = idefics3``): SigLIP at 512 px,
    patch 16, then a 4x4 pixel shuffle and one linear layer (``mm.model.fc``): 64 tokens per tile.
    An image is resized so that its longest edge is ``longest_edge`` (SmolVLM-256M's: 2048; 1024
    here: test-1.jpeg becomes 2 x 2 tiles), cut into 512 px tiles, and a 512 px overview goes first:
    one medium, several image chunks with the row/column text between them. The text model needs
    the tokens ``<fake_token_around_image>`` and ``<global-img>``: see :func:`idefics3_text`."""
    width, blocks, heads, n_ff, _, _ = VISION[size]
    scale = 4
    rng = np.random.default_rng(seed)
    w = _writer(path, "vision", f"idefics3-vision-random-{size}")
    w.add_string("clip.projector_type", "idefics3")
    w.add_uint32("clip.vision.projector.scale_factor", scale)
    w.add_uint32("clip.vision.preproc_image_size", longest_edge)
    _siglip(w, rng, n_embd_text, width, blocks, heads, n_ff, 512, 16)
    fc = rng.standard_normal((n_embd_text, width * scale * scale)) * 0.1 / np.sqrt(width * scale * scale)
    w.add_tensor("mm.model.fc.weight", fc.astype(np.float16))  # outputs of about the embeddings' scale
    _finish(w)
    return path


def idefics3_text(src: str, dst: str) -> str:
    """A copy of ``src`` (SmolLM2) whose vocabulary has SmolVLM's image tokens: two of its
    StarCoder-era control tokens (``<jupyter_start>``, ``<jupyter_text>``) renamed
    ``<fake_token_around_image>`` and ``<global-img>``, which libmtmd looks up for Idefics3's
    layout. Weights and every other token are ``src``'s."""
    renames = {"<jupyter_start>": "<fake_token_around_image>", "<jupyter_text>": "<global-img>"}

    def rename(name: str, value):
        if name != "tokenizer.ggml.tokens":
            return value
        missing = set(renames) - set(value)
        if missing:
            raise ValueError(f"{src} has no {sorted(missing)} to rename")
        return [renames.get(t, t) for t in value]

    return _copy_gguf(src, dst, value=rename)


def _siglip(w, rng, n_embd_text, width, blocks, heads, n_ff, image, patch) -> int:
    """SigLIP's encoder (patch conv, learned position embeddings, blocks, post-LN); returns its width."""
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    _common(w, "vision", width, blocks, heads, n_ff, n_embd_text, 1e-6)
    w.add_uint32("clip.vision.image_size", image)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    n_patches = (image // patch) ** 2
    w.add_tensor(
        "v.patch_embd.weight", (rng.standard_normal((width, 3, patch, patch)) / patch / np.sqrt(3)).astype(np.float16)
    )
    w.add_tensor("v.patch_embd.bias", np.zeros(width, np.float32))
    w.add_tensor("v.position_embd.weight", (rng.standard_normal((n_patches, width)) * 0.02).astype(np.float32))
    _blocks(w, rng, "v", blocks, width, n_ff, k_bias=True)
    return width


def audio(path: str, n_embd_text: int = 576, size: str = "small", seed: int = 0) -> str:
    """An Ultravox audio projector over a Whisper encoder (``clip.projector_type = ultravox``)."""
    w = _writer(path, "audio", f"ultravox-whisper-random-{size}")
    w.add_string("clip.projector_type", "ultravox")
    _audio(w, np.random.default_rng(seed), n_embd_text, size)
    _finish(w)
    return path


def omni(path: str, n_embd_text: int = 576, size: str = "small", seed: int = 0) -> str:
    """Both in one file, as the projectors of models that read images and audio ship (Qwen2.5-Omni,
    Gemma 3n): ``clip.vision.projector_type = gemma3``, ``clip.audio.projector_type = ultravox``."""
    w = _writer(path, "vision and audio", f"gemma3-ultravox-random-{size}")
    w.add_string("clip.vision.projector_type", "gemma3")
    w.add_string("clip.audio.projector_type", "ultravox")
    rng = np.random.default_rng(seed)
    _vision(w, rng, n_embd_text, size)
    _audio(w, rng, n_embd_text, size)
    _finish(w)
    return path


def qwen2vl(path: str, n_embd_text: int = 576, size: str = "small", seed: int = 0) -> str:
    """A Qwen2-VL vision projector (``clip.projector_type = qwen2vl_merger``) at ``path``."""
    width, blocks, heads, n_ff = QWEN2VL[size]
    patch, merged = 14, 4 * width  # the merger concatenates 2x2 neighbouring patches
    rng = np.random.default_rng(seed)
    w = _writer(path, "vision", f"qwen2vl-vision-random-{size}")
    w.add_string("clip.projector_type", "qwen2vl_merger")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    _common(w, "vision", width, blocks, heads, n_ff, n_embd_text, 1e-6)
    w.add_uint32("clip.vision.image_size", 560)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])  # CLIP's, as Qwen2-VL's processor
    w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):  # one conv per frame of a temporal patch
        conv = rng.standard_normal((width, 3, patch, patch)) / patch / np.sqrt(6)
        w.add_tensor(name, conv.astype(np.float16))
    _blocks(w, rng, "v", blocks, width, n_ff, k_bias=True)  # its post_ln is the merger's ln_q
    w.add_tensor("mm.0.weight", (rng.standard_normal((merged, merged)) / np.sqrt(merged)).astype(np.float16))
    w.add_tensor("mm.0.bias", np.zeros(merged, np.float32))
    w.add_tensor(  # outputs of about the text model's embedding scale (std 0.1)
        "mm.2.weight", (rng.standard_normal((n_embd_text, merged)) * 0.1 / np.sqrt(merged)).astype(np.float16)
    )
    w.add_tensor("mm.2.bias", np.zeros(n_embd_text, np.float32))
    _finish(w)
    return path


def mrope_text(src: str, dst: str) -> str:
    """``src`` (a llama-architecture GGUF) rewritten as llama.cpp's ``qwen2vl`` architecture: the same
    weights and tokenizer, M-RoPE with Qwen2-VL's 16:24:24 rope sections scaled to the head size
    (SmolLM2: 64 -> 8, 12, 12). llama's converter permutes the rows of Q and K for llama.cpp's
    interleaved RoPE; M-RoPE pairs dimensions as Hugging Face's rotate_half does (NEOX), so those
    rows are put back in Hugging Face's order (whole rows: quantized blocks stay intact). On text,
    where all sections share one position, the copy is ``src`` (SmolLM2: perplexity 16.24 vs 16.16
    on pydoc's docstring; greedy replies part at near ties)."""
    import gguf

    fields = gguf.GGUFReader(src).fields
    arch = str(fields["general.architecture"].contents())
    n_rot = int(fields[f"{arch}.rope.dimension_count"].contents())
    q = n_rot // 2 // 8  # Qwen2-VL: head 128, sections 16, 24, 24 of 64 rotated pairs
    heads = {
        "attn_q": int(fields[f"{arch}.attention.head_count"].contents()),
        "attn_k": int(fields[f"{arch}.attention.head_count_kv"].contents()),
    }

    def unpermute(name: str, data: np.ndarray) -> np.ndarray:
        part = name.split(".")[-2]
        if part not in heads:
            return data
        n_head, rows = (
            heads[part],
            data.shape[0],
        )  # the converter's permute undone: rows (head, d/2, 2) -> (head, 2, d/2)
        return data.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(data.shape)

    sections = ("qwen2vl.rope.dimension_sections", [2 * q, 3 * q, 3 * q, 0])
    return _copy_gguf(src, dst, arch="qwen2vl", extra=[sections], tensor=unpermute)


def _copy_gguf(src: str, dst: str, arch: str | None = None, value=None, tensor=None, extra=()) -> str:
    """``src``'s keys and tensors written to ``dst``: ``arch`` renames the architecture (and its
    keys' prefix), ``value(name, contents)`` and ``tensor(name, data)`` may change what is copied,
    ``extra``: [(key, array)] added."""
    import gguf

    r = gguf.GGUFReader(src)
    old = str(r.fields["general.architecture"].contents())
    arch = arch or old
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        key = arch + name[len(old) :] if name.startswith(old + ".") else name
        v = f.contents() if value is None else value(name, f.contents())
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, v, kind, sub_type=f.types[-1])
        else:
            w.add_key_value(key, v, kind)
    for key, array in extra:
        w.add_array(key, array)
    for t in r.tensors:
        data = t.data if tensor is None else tensor(t.name, np.asarray(t.data))
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    _finish(w)
    return dst


def _audio(w, rng: np.random.Generator, n_embd_text: int, size: str) -> None:
    width, blocks, heads, n_ff = AUDIO[size]
    n_mel, stack, hidden = 128, 8, 4 * n_embd_text
    w.add_bool("clip.has_audio_encoder", True)
    _common(w, "audio", width, blocks, heads, n_ff, n_embd_text, 1e-5)
    w.add_uint32("clip.audio.num_mel_bins", n_mel)
    w.add_uint32("clip.audio.projector.stack_factor", stack)
    w.add_tensor("a.conv1d.1.weight", (rng.standard_normal((width, n_mel, 3)) / np.sqrt(3 * n_mel)).astype(np.float16))
    w.add_tensor("a.conv1d.1.bias", (rng.standard_normal((width, 1)) * 0.02).astype(np.float32))
    w.add_tensor("a.conv1d.2.weight", (rng.standard_normal((width, width, 3)) / np.sqrt(3 * width)).astype(np.float16))
    w.add_tensor("a.conv1d.2.bias", (rng.standard_normal((width, 1)) * 0.02).astype(np.float32))
    w.add_tensor("a.position_embd.weight", (rng.standard_normal((1500, width)) * 0.02).astype(np.float32))
    _blocks(w, rng, "a", blocks, width, n_ff, k_bias=False)
    w.add_tensor("mm.a.norm_pre.weight", np.ones(width * stack, np.float32))
    w.add_tensor(
        "mm.a.mlp.1.weight",
        (rng.standard_normal((2 * hidden, width * stack)) / np.sqrt(width * stack)).astype(np.float16),
    )
    w.add_tensor("mm.a.norm_mid.weight", np.ones(hidden, np.float32))
    w.add_tensor(  # outputs of about the text model's embedding scale (std 0.1)
        "mm.a.mlp.2.weight", (rng.standard_normal((n_embd_text, hidden)) * 0.1 / np.sqrt(hidden)).astype(np.float16)
    )


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["vision", "audio", "omni", "qwen2vl", "idefics3"])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--n-embd-text", type=int, default=576, help="the text model's n_embd (576: SmolLM2-135M)")
    ap.add_argument("--size", choices=["small", "base", "real"], default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-from", help="qwen2vl, idefics3: a llama-architecture GGUF to rewrite as their text model")
    ap.add_argument("--text-out", help="qwen2vl, idefics3: where that text model goes")
    a = ap.parse_args()
    texts = {"qwen2vl": mrope_text, "idefics3": idefics3_text}
    if bool(a.text_from) != bool(a.text_out) or (a.text_from and a.kind not in texts):
        ap.error("--text-from and --text-out go together, with qwen2vl or idefics3")
    make = {"vision": vision, "audio": audio, "omni": omni, "qwen2vl": qwen2vl, "idefics3": idefics3}[a.kind]
    make(a.output, a.n_embd_text, a.size, a.seed)
    print(a.output)
    if a.text_from:
        print(texts[a.kind](a.text_from, a.text_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
