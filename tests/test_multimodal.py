"""Images and audio through libmtmd: projector embeddings and greedy text against upstream's
llama-mtmd-cli from the same build, the audio encoder's conv1d against numpy in float64, prompt
caching across turns, every way of passing media, the errors, leaks, the server with the real
openai client (and LangChain), and the CLI. The projectors are random-weight GGUFs in the layout
of real ones (bench/make_mmproj.py: Gemma 3's SigLIP, Ultravox over Whisper), sized to SmolLM2."""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import GPU_BUILD, ROOT, VENDOR, require_tool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memory import growth, malloc_trim, snapshot

import llamabind

IMAGE = VENDOR / "tools" / "mtmd" / "test-1.jpeg"
AUDIO = VENDOR / "tools" / "mtmd" / "test-2.mp3"
CPU_ONLY = {"n_gpu_layers": 0, "op_offload": False} if GPU_BUILD else {}
CLI_CPU_ONLY = ["-ngl", "0", "--no-op-offload"] if GPU_BUILD else []  # the same for llama-mtmd-cli


def _make_mmproj():
    spec = importlib.util.spec_from_file_location("make_mmproj", ROOT / "bench" / "make_mmproj.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    """{"vision", "audio", "omni", "other"} -> path; "other": a vision projector for n_embd 256."""
    d = tmp_path_factory.mktemp("mmproj")
    mk = _make_mmproj()
    return {
        "vision": Path(mk.vision(str(d / "vision.gguf"))),
        "audio": Path(mk.audio(str(d / "audio.gguf"))),
        "omni": Path(mk.omni(str(d / "omni.gguf"))),
        "other": Path(mk.vision(str(d / "other.gguf"), n_embd_text=256)),
    }


@pytest.fixture(scope="module")
def omni(model_path, mmproj):
    """SmolLM2 with a projector that takes images and audio. On a GPU build the text model stays on
    the CPU (conftest's "exact": a cached prefix and a fresh one decode in other batch shapes, which
    CUDA's kernels do not round alike); the projector's encoder runs on the GPU either way."""
    with llamabind.Model(model_path, mmproj=mmproj["omni"], n_ctx=2048, n_threads=2, **CPU_ONLY) as m:
        yield m


def _nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


def _mtmd_cli(model_path, mmproj_path, media, *args, env=None, timeout=300):
    cli = require_tool("llama-mtmd-cli")
    flag = "--audio" if Path(media).suffix in (".mp3", ".wav", ".flac") else "--image"
    cmd = [str(cli), "-m", str(model_path), "--mmproj", str(mmproj_path), flag, str(media), "-t", "2", "--jinja"]
    r = subprocess.run(
        cmd + list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _media_chunk(projector, source):
    pieces = projector.tokenize("x" + llamabind.MEDIA_MARKER, [projector.media(source)])
    (chunk,) = [p for p in pieces if not isinstance(p, int)]
    return chunk


# ---- against llama-mtmd-cli (same build, same files)


@pytest.mark.parametrize("kind, media", [("image", IMAGE), ("audio", AUDIO)])
def test_embeddings_equal_llama_mtmd_cli(omni, model_path, mmproj, tmp_path, kind, media):
    """The projector's output for test-1.jpeg / test-2.mp3 equals what llama-mtmd-cli computes
    (its MTMD_DEBUG_EMBEDDINGS dump) for the same file and mmproj."""
    dump = tmp_path / "embd.bin"
    _mtmd_cli(model_path, mmproj["omni"], media, "-p", "hi", "-n", "1", env={"MTMD_DEBUG_EMBEDDINGS": str(dump)})
    raw = dump.read_bytes()
    n_tok, n_embd = np.frombuffer(raw[:8], np.int32)
    ref = np.frombuffer(raw[8:], np.float32).reshape(n_tok, n_embd)
    chunk = _media_chunk(omni.projector, media)
    assert chunk.kind == kind
    got = omni.projector.encode(chunk)
    assert got.shape == ref.shape == (chunk.n_tokens, omni.n_embd)
    assert np.abs(ref).max() > 0.01  # a real output, not zeros
    assert _nmse(got, ref) <= 1e-6


@pytest.mark.parametrize("media", [IMAGE, AUDIO], ids=["image", "audio"])
def test_greedy_text_after_media_equals_llama_mtmd_cli(model_path, mmproj, media):
    """Model.chat with [media, text] renders and evaluates as llama-mtmd-cli does (its single-turn
    prompt is the marker then the text, with the model's jinja template): same greedy text."""
    prompt = "What is in this file?"
    want = _mtmd_cli(model_path, mmproj["omni"], media, "-p", prompt, "-n", "24", "--temp", "0", "-c", "2048")
    kind = "image" if media == IMAGE else "audio"
    with llamabind.Model(model_path, mmproj=mmproj["omni"], n_ctx=2048, n_threads=2) as m:
        got = m.chat(
            [{"role": "user", "content": [{"type": kind, kind: media}, {"type": "text", "text": prompt}]}],
            max_tokens=24,
            temperature=0,
        )
    assert got.generation.tokens, "generated nothing"
    assert want.stdout.strip() == got.text.strip()


def test_audio_encoder_conv1d_matches_numpy(model_path, mmproj):
    """The Whisper encoder's two conv1d (the second's im2col has KW*IC = 3*384 = 1152 > 1024
    columns: the case ggml's Metal im2col got wrong) against numpy float64 on the same mel input
    and weights; and the clip's token count is the graph's (patch 0030: it aborted before)."""
    import gguf

    r = gguf.GGUFReader(mmproj["audio"])
    w = {
        t.name: np.asarray(t.data, np.float64).reshape(t.shape[::-1]) for t in r.tensors if t.name.startswith("a.conv")
    }
    oc, ic, kw = w["a.conv1d.2.weight"].shape
    assert kw * ic > 1024
    with llamabind.Model(model_path, n_ctx=512, n_threads=2) as m:
        p = llamabind.Projector(m, mmproj["audio"], _capture=["inp_raw", "after_conv1d"])
        chunk = _media_chunk(p, AUDIO)
        p.encode(chunk)
        cap = p._native.captured()
    mel = cap["inp_raw"].reshape(cap["inp_raw"].shape[-2:]).astype(np.float64)  # (n_mel, n_frames)
    assert mel.shape == (128, 3000)
    assert chunk.n_tokens == math.ceil(3000 / 2 / 8)  # Whisper halves, Ultravox stacks 8 frames

    def conv1d(x, weight, bias, stride):  # x (ic, n); weight (oc, ic, kw); padding kw // 2
        k = weight.shape[2]
        xp = np.pad(x, ((0, 0), (k // 2, k // 2)))
        n_out = (xp.shape[1] - k) // stride + 1
        cols = np.stack([xp[:, i * stride : i * stride + k] for i in range(n_out)])  # (n_out, ic, kw)
        return np.einsum("nik,oik->on", cols, weight) + bias.reshape(-1, 1)

    def gelu(x):
        from math import erf

        return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))

    h = gelu(conv1d(mel, w["a.conv1d.1.weight"], w["a.conv1d.1.bias"], 1))
    h = gelu(conv1d(h, w["a.conv1d.2.weight"], w["a.conv1d.2.bias"], 2))
    assert cap["after_conv1d"].shape == (1500, oc)
    # CPU: 1e-6 (the F16 im2col's rounding). CUDA multiplies the F16 columns in cuBLAS with F16
    # compute on this path: 1.6e-6 measured on an H100
    assert _nmse(cap["after_conv1d"], h.T) <= (5e-6 if GPU_BUILD else 1e-6)


# ---- tiles: SmolVLM / Idefics3 cuts an image into 512 px tiles after an overview (one medium, several chunks)


@pytest.fixture(scope="module")
def smolvlm(model_path, tmp_path_factory):
    """(text model, mmproj): SmolLM2 with SmolVLM's two image tokens, and a random-weight Idefics3
    projector whose longest edge is 1024 px (test-1.jpeg: 2 x 2 tiles + the overview)."""
    d = tmp_path_factory.mktemp("smolvlm")
    mk = _make_mmproj()
    return Path(mk.idefics3_text(str(model_path), str(d / "text.gguf"))), Path(mk.idefics3(str(d / "mmproj.gguf")))


@pytest.mark.parametrize("max_tokens", [None, 128], ids=["longest-edge", "image_max_tokens"])
def test_tiled_image_equals_llama_mtmd_cli(smolvlm, model_path, tmp_path, max_tokens):
    """An image in tiles (the rows and columns between them in text) gives llama-mtmd-cli's greedy
    text; the last tile's embeddings equal its dump; a second turn reuses the whole image. A text
    model without SmolVLM's image tokens is a ValueError (libmtmd puts -1 where they go)."""
    text, mmproj = smolvlm
    if max_tokens is None:
        with llamabind.Model(model_path, mmproj=mmproj, n_ctx=1024, n_threads=2, **CPU_ONLY) as plain:
            with pytest.raises(ValueError, match="vocabulary lacks"):
                plain.chat([{"role": "user", "content": [{"type": "image", "image": IMAGE}]}], max_tokens=2)
    prompt = "What is in this file?"
    dump = tmp_path / "embd.bin"
    limit = (["--image-max-tokens", str(max_tokens)] if max_tokens else []) + CLI_CPU_ONLY
    want = _mtmd_cli(
        text, mmproj, IMAGE, "-p", prompt, "-n", "24", "--temp", "0", "-c", "4096", *limit,
        env={"MTMD_DEBUG_EMBEDDINGS": str(dump)},
    )  # fmt: skip
    raw = dump.read_bytes()
    n_tok, n_embd = np.frombuffer(raw[:8], np.int32)
    ref = np.frombuffer(raw[8:], np.float32).reshape(n_tok, n_embd)
    with llamabind.Model(text, mmproj=mmproj, image_max_tokens=max_tokens, n_ctx=4096, n_threads=2, **CPU_ONLY) as m:
        p = m.projector
        pieces = p.tokenize("x" + llamabind.MEDIA_MARKER, [p.media(IMAGE)])
        tiles = [x for x in pieces if not isinstance(x, int)]
        assert len(tiles) >= 2 and {t.n_tokens for t in tiles} == {64} and len({t.key for t in tiles}) == 1
        assert max_tokens is None or sum(t.n_tokens for t in tiles) <= max_tokens
        assert _nmse(p.encode(tiles[-1]), ref) <= 1e-6 and np.abs(ref).max() > 0.01
        turn1 = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": prompt}]}]
        with m.context(n_ctx=4096) as ctx:
            r1 = ctx.chat(turn1, max_tokens=24, temperature=0)
            assert want.stdout.strip() == r1.text.strip() != ""
            turn2 = turn1 + [r1.message, {"role": "user", "content": "And the colors?"}]
            r2 = ctx.chat(turn2, max_tokens=4, temperature=0)
            assert r2.generation.timings.prompt_reused >= r1.generation.prompt_tokens - 8


# ---- M-RoPE: an image of h x w tokens on max(h, w) positions (Qwen2-VL and its successors)


@pytest.fixture(scope="module")
def qwen2vl(model_path, tmp_path_factory):
    """(text model, mmproj): SmolLM2's weights as llama.cpp's qwen2vl architecture (M-RoPE) and a
    random-weight Qwen2-VL projector; images capped at 64 tokens (image_max_tokens, both sides)."""
    d = tmp_path_factory.mktemp("qwen2vl")
    mk = _make_mmproj()
    return Path(mk.mrope_text(str(model_path), str(d / "text.gguf"))), Path(mk.qwen2vl(str(d / "mmproj.gguf")))


def test_mrope_image_equals_llama_mtmd_cli(qwen2vl, tmp_path):
    """The projector's output and the greedy text after it equal llama-mtmd-cli's: the text after an
    M-RoPE image starts n_pos (not n_tokens, not 1) positions after it, and the image's cells count
    against n_ctx (found this way: text went on at the image's first position + 1)."""
    text, mmproj = qwen2vl
    prompt = "What is in this file?"
    dump = tmp_path / "embd.bin"
    limit = ("--image-max-tokens", "64", "-c", "2048", *CLI_CPU_ONLY)
    want = _mtmd_cli(
        text, mmproj, IMAGE, "-p", prompt, "-n", "24", "--temp", "0", *limit, env={"MTMD_DEBUG_EMBEDDINGS": str(dump)}
    )
    raw = dump.read_bytes()
    n_tok, n_embd = np.frombuffer(raw[:8], np.int32)
    ref = np.frombuffer(raw[8:], np.float32).reshape(n_tok, n_embd)
    with llamabind.Model(text, mmproj=mmproj, image_max_tokens=64, n_ctx=2048, n_threads=2, **CPU_ONLY) as m:
        chunk = _media_chunk(m.projector, IMAGE)
        assert chunk.n_tokens == n_tok <= 64 and chunk.n_pos < chunk.n_tokens  # a grid on max(h, w) positions
        got = m.projector.encode(chunk)
        assert np.abs(ref).max() > 0.01 and _nmse(got, ref) <= 1e-6
        content = [{"type": "image", "image": IMAGE}, {"type": "text", "text": prompt}]
        with m.context(n_ctx=2048) as ctx:
            r = ctx.chat([{"role": "user", "content": content}], max_tokens=24, temperature=0)
            assert want.stdout.strip() == r.text.strip() != ""
            assert ctx.n_cells == ctx.n_past + chunk.n_tokens - chunk.n_pos
            assert len(ctx.tokens) == ctx.n_past  # the record holds positions: prompt caching reuses it
    # serve --image-max-tokens (upstream's server core, its own position bookkeeping): the same
    # text, and usage counts the image's tokens as Model.chat does
    import openai

    url = "data:image/jpeg;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    with llamabind.serve(text, port=0, parallel=1, ctx_size=2048, mmproj=mmproj, image_max_tokens=64, **CPU_ONLY) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]
        msgs = [{"role": "user", "content": content}]
        got = client.chat.completions.create(model=s.model_id, messages=msgs, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == r.text
    assert got.usage.prompt_tokens == r.generation.prompt_tokens


def test_mrope_prompt_cache_state_and_n_ctx(qwen2vl, tmp_path):
    """Across turns an M-RoPE image is reused as on other models and the reply equals a fresh
    context's, and a saved state restores it (positions and cells); n_ctx bounds cells: an image
    whose positions fit but whose tokens do not is a ValueError, and a generation stops with
    "length" when the cells are full."""
    text, mmproj = qwen2vl
    turn1 = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What is it?"}]}]
    with llamabind.Model(text, mmproj=mmproj, image_max_tokens=64, n_ctx=2048, n_threads=2, **CPU_ONLY) as m:
        chunk = _media_chunk(m.projector, IMAGE)
        with m.context(n_ctx=2048) as ctx:
            r1 = ctx.chat(turn1, max_tokens=6, temperature=0)
            turn2 = turn1 + [r1.message, {"role": "user", "content": "And its colors?"}]
            r2 = ctx.chat(turn2, max_tokens=6, temperature=0)
            assert r2.generation.timings.prompt_reused >= r1.generation.prompt_tokens - 8
            with m.context(n_ctx=2048) as fresh:
                assert fresh.chat(turn2, max_tokens=6, temperature=0).text == r2.text
            # save_state/load_state keep the media record: a restored context goes on as this one
            turn3 = turn2 + [r2.message, {"role": "user", "content": "Why?"}]
            state = ctx.save_state()
            with m.context(n_ctx=2048) as restored:
                restored.load_state(state)
                assert (restored.n_past, restored.n_cells, restored.tokens) == (ctx.n_past, ctx.n_cells, ctx.tokens)
                r3 = restored.chat(turn3, max_tokens=6, temperature=0)
            assert r3.generation.timings.prompt_reused >= r2.generation.prompt_tokens
            assert ctx.chat(turn3, max_tokens=6, temperature=0).text == r3.text
            with pytest.raises(ValueError, match="save_state"):
                ctx.save_state_file(tmp_path / "session.bin")  # token ids only: refused, not mangled
            # an image last: the next position is past its n_pos positions, in a restored context too
            ctx.clear()
            assert ctx.n_past == ctx.n_cells == 0
            ctx.decode(m.tokenize("Look:"))
            ctx.decode_media(chunk)
            assert ctx.n_past == len(m.tokenize("Look:")) + chunk.n_pos
            with m.context(n_ctx=2048) as restored:
                restored.load_state(ctx.save_state())
                assert (restored.n_past, restored.n_cells) == (ctx.n_past, ctx.n_cells)
        with m.context(n_ctx=256) as small:

            def images(count):
                content = [{"type": "image", "image": IMAGE}] * count + [{"type": "text", "text": "Hi"}]
                return [{"role": "user", "content": content}]

            count, last = 1, None
            while True:  # more images each time, until their cells exceed n_ctx
                try:
                    r = small.chat(images(count), max_tokens=300, temperature=0, ignore_eos=True)
                except ValueError as e:
                    assert "n_ctx" in str(e)
                    break
                assert r.generation.finish_reason == "length" and small.n_cells == small.n_ctx
                assert small.n_cells == r.generation.prompt_tokens + len(r.generation.tokens) - 1
                count, last = count + 1, r
            extra = chunk.n_tokens - chunk.n_pos
            assert count >= 2 and last.generation.prompt_tokens - (count - 1) * extra + chunk.n_pos + 16 < small.n_ctx


# ---- the Python API


def test_prompt_cache_reuses_media_across_turns(omni):
    """A follow-up turn evaluates only what follows the cached prefix, image included (the image's
    positions are not encoded again), and answers as a fresh context does."""
    turn1 = [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What is it?"}]}]
    ctx = omni.context(n_ctx=2048)
    r1 = ctx.chat(turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [r1.message, {"role": "user", "content": "And its colors?"}]
    r2 = ctx.chat(turn2, max_tokens=8, temperature=0)
    image_end = r1.generation.prompt_tokens - 8  # the image sits before the question's few tokens
    assert r2.generation.timings.prompt_reused >= image_end
    assert r2.generation.prompt_tokens > r1.generation.prompt_tokens
    with omni.context(n_ctx=2048) as fresh:
        assert fresh.chat(turn2, max_tokens=8, temperature=0).text == r2.text
    # another image at the same place is evaluated again: different content, different key
    other = np.full((64, 96, 3), 200, np.uint8)
    turn1b = [{"role": "user", "content": [{"type": "image", "image": other}, {"type": "text", "text": "What is it?"}]}]
    r3 = ctx.chat(turn1b, max_tokens=4, temperature=0)
    assert r3.generation.timings.prompt_reused < image_end - 10
    ctx.close()


@pytest.mark.parametrize("kind", ["gemma3", "qwen2vl"])
def test_generate_batch_with_media_equals_one_at_a_time(omni, qwen2vl, kind):
    """generate_batch with an image in some prompts (sequences side by side in one KV cache, their
    media through libmtmd at each sequence's own positions; M-RoPE too): each result equals
    generate() of that prompt alone (greedy, CPU)."""
    other = np.full((64, 96, 3), 200, np.uint8)
    prompts = [
        "Look: " + llamabind.MEDIA_MARKER + " It shows",
        "A story about a lighthouse:",
        "Two pictures " + llamabind.MEDIA_MARKER + llamabind.MEDIA_MARKER + " and they",
    ]
    media = [[IMAGE], None, [other, IMAGE]]
    kw = dict(max_tokens=12, temperature=0)
    if kind == "gemma3":
        m = omni
        got = m.generate_batch(prompts, media=media, **kw)
        want = [m.context(n_ctx=2048).generate(p, media=md, **kw) for p, md in zip(prompts, media)]
    else:
        text, mmproj = qwen2vl
        with llamabind.Model(text, mmproj=mmproj, image_max_tokens=64, n_ctx=2048, n_threads=2, **CPU_ONLY) as m:
            got = m.generate_batch(prompts, media=media, **kw)
            want = [m.context(n_ctx=2048).generate(p, media=md, **kw) for p, md in zip(prompts, media)]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert [g.prompt_tokens for g in got] == [w.prompt_tokens for w in want]
    if kind == "gemma3":
        with pytest.raises(ValueError, match="one list per prompt"):
            omni.generate_batch(prompts, media=media[:2])
        with pytest.raises(ValueError, match="end in text"):  # Ultravox puts no text after a clip
            omni.generate_batch(["Hear: " + llamabind.MEDIA_MARKER], media=[[AUDIO]])
        with llamabind.Model(omni.path, n_ctx=256) as text_only, pytest.raises(ValueError, match="projector"):
            text_only.generate_batch(prompts[:1], media=media[:1])


def test_every_way_of_passing_an_image_is_the_same_image(omni, tmp_path):
    data = IMAGE.read_bytes()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    p = omni.projector
    ids = {_media_chunk(p, s).id for s in (IMAGE, str(IMAGE), IMAGE.as_uri(), data, url)}
    assert len(ids) == 1
    fetched = []
    chunk = _media_chunk(p, IMAGE)
    via_fetch = p.tokenize(
        llamabind.MEDIA_MARKER, [p.media("https://example.invalid/a.jpg", fetch=lambda u: fetched.append(u) or data)]
    )
    assert fetched == ["https://example.invalid/a.jpg"]
    assert [x.id for x in via_fetch if not isinstance(x, int)] == [chunk.id]
    # numpy arrays: RGB uint8 images and float32 PCM at the projector's rate
    rgb = np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    a, b = _media_chunk(p, rgb), _media_chunk(p, rgb[::-1].copy())
    assert a.kind == "image" and a.id != b.id
    assert not np.allclose(p.encode(a), p.encode(b))
    pcm = np.sin(np.linspace(0, 2000, p.audio_sample_rate)).astype(np.float32)
    assert _media_chunk(p, pcm).kind == "audio"
    # generate() with a marker in a raw prompt
    g = omni.generate("Look: " + llamabind.MEDIA_MARKER + " It is", media=[IMAGE], max_tokens=4, temperature=0)
    assert len(g.tokens) == 4


def test_errors_are_exceptions(model_path, omni, mmproj, tmp_path):
    img = [{"type": "image", "image": IMAGE}, {"type": "text", "text": "hi"}]
    # an in-process server first: its core points libmtmd's (global) log callback at common's silent
    # logger, and libmtmd's reasons then went missing from these messages (found in a full suite run)
    llamabind.serve(model_path, port=0, parallel=1, ctx_size=256, **CPU_ONLY).stop()
    with llamabind.Model(model_path, n_ctx=256, n_threads=2) as text_only:
        with pytest.raises(ValueError, match="no projector"):
            text_only.chat([{"role": "user", "content": img}])
        with pytest.raises(ValueError, match="n_embd"):
            text_only.load_mmproj(mmproj["other"])
        with pytest.raises(FileNotFoundError):
            text_only.load_mmproj(tmp_path / "missing.gguf")
        not_gguf = tmp_path / "x.gguf"
        not_gguf.write_bytes(b"GGUF" + b"\0" * 64)
        with pytest.raises(ValueError, match="cannot load the projector"):
            text_only.load_mmproj(not_gguf)
    with llamabind.Model(model_path, mmproj=mmproj["vision"], n_ctx=256, n_threads=2) as vision:
        wav = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF").decode(), "format": "wav"}}
        with pytest.raises(ValueError, match="takes images, not audio"):
            vision.chat([{"role": "user", "content": [{"type": "audio", "audio": AUDIO}]}])
        with pytest.raises(ValueError, match="not supported"):
            vision.chat([{"role": "user", "content": [{**wav, "input_audio": {"data": "AAAA", "format": "ogg"}}]}])
        with pytest.raises(ValueError, match="cannot decode the media"):
            vision.chat([{"role": "user", "content": [{"type": "image", "image": b"\x89PNG not really"}]}])
        with pytest.raises(ValueError, match="not valid base64"):
            vision.chat(
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]
            )
        with pytest.raises(ValueError, match="not fetched by default"):
            vision.chat(
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}}]}]
            )
        with pytest.raises(ValueError, match="markers"):
            vision.generate("no marker here", media=[IMAGE])
        with vision.context(n_ctx=256) as small:  # images of 16 positions each, more than n_ctx holds
            many = [{"type": "image", "image": IMAGE}] * (small.n_ctx // 16 + 1)
            with pytest.raises(ValueError, match="n_ctx"):
                small.chat([{"role": "user", "content": many}])
        p = vision.projector
    with pytest.raises(ValueError, match="closed"):
        p.media(IMAGE)  # the model's close() freed the projector: an exception, not a crash


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=512), st.binary(min_size=1, max_size=64).map(lambda b: b"\xff\xd8\xff" + b)))
def test_arbitrary_bytes_never_abort(omni, data):
    """Random bytes (and random JPEG-looking headers) as media: a ValueError or a medium, never an abort."""
    try:
        m = omni.projector.media(data)
    except ValueError:
        return
    assert m.nx > 0


@pytest.mark.skipif(os.environ.get("LLAMABIND_SANITIZED") == "1", reason="RSS says nothing under ASan")
def test_no_leak_over_projector_load_encode_close_cycles(model_path, mmproj):
    with llamabind.Model(model_path, n_ctx=256, n_threads=1) as m:

        def cycle():
            p = m.load_mmproj(mmproj["vision"], warmup=False)
            p.encode(_media_chunk(p, IMAGE))
            p.close()

        for _ in range(5):
            cycle()
        malloc_trim()
        start = snapshot()
        for _ in range(40):
            cycle()
        malloc_trim()
        g = growth(start, snapshot())
    assert g["heap_mb"] < 10 and g["rss_mb"] < 10, f"over 40 cycles: {g}"


# ---- the server, through the real openai client


@pytest.fixture(scope="module")
def mm_srv(model_path, mmproj):
    with llamabind.serve(model_path, port=0, parallel=1, ctx_size=2048, mmproj=mmproj["omni"], **CPU_ONLY) as s:
        yield s


def test_server_answers_image_and_audio_as_model_chat(mm_srv, model_path, mmproj):
    import openai

    client = openai.OpenAI(base_url=mm_srv.url + "/v1", api_key="unused", max_retries=0)
    image = "data:image/jpeg;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    audio = {"data": base64.b64encode(AUDIO.read_bytes()).decode(), "format": "mp3"}
    convs = [
        [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is in the picture?"}],
        [{"type": "input_audio", "input_audio": audio}, {"type": "text", "text": "What do you hear?"}],
    ]
    with llamabind.Model(model_path, mmproj=mmproj["omni"], n_ctx=2048, n_threads=2, **CPU_ONLY) as m:
        for content in convs:
            msgs = [{"role": "user", "content": content}]
            r = client.chat.completions.create(model=mm_srv.model_id, messages=msgs, max_tokens=16, temperature=0)
            assert (
                r.choices[0].message.content == m.context(n_ctx=2048).chat(msgs, max_tokens=16, temperature=0).content
            )
    props = json.loads(urllib.request.urlopen(mm_srv.url + "/props").read())
    assert props["modalities"]["vision"] and props["modalities"]["audio"]
    with pytest.raises(openai.BadRequestError):
        bad = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}]
        client.chat.completions.create(model=mm_srv.model_id, messages=[{"role": "user", "content": bad}], max_tokens=4)


def test_langchain_human_message_with_an_image(mm_srv):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage

    image = "data:image/jpeg;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    llm = lc.ChatOpenAI(
        base_url=mm_srv.url + "/v1", api_key="unused", model=mm_srv.model_id, temperature=0, max_tokens=8
    )
    msg = HumanMessage(
        content=[{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": image}}]
    )
    out = llm.invoke([msg])
    assert isinstance(out.content, str) and out.content
    assert out.usage_metadata["input_tokens"] > 16  # the image's 16 positions are in the prompt


# ---- the CLI


def test_cli_chat_with_image_and_generate_with_audio(model_path, mmproj):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "llamabind"]
    common = ["-m", str(model_path), "--mmproj", str(mmproj["omni"]), "--temp", "0", "-n", "8", "--n-ctx", "2048"]
    r = subprocess.run(
        base + ["chat", *common],
        input=f"/image {IMAGE}\nWhat is in the picture?\n",
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    with llamabind.Model(model_path, mmproj=mmproj["omni"], n_ctx=2048) as m:
        content = [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What is in the picture?"}]
        want = m.chat([{"role": "user", "content": content}], max_tokens=8, temperature=0)
    assert r.stdout.strip() == want.text.strip()
    g = subprocess.run(
        base + ["generate", "Transcript:", *common, "--audio", str(AUDIO)], capture_output=True, text=True, timeout=300
    )
    assert g.returncode == 0, g.stderr
    assert "prompt: " in g.stderr
    bad = subprocess.run(base + ["generate", "x", "--image", str(IMAGE)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--mmproj" in bad.stderr
    info = subprocess.run(base + ["info"], capture_output=True, text=True, timeout=120)
    assert "libmtmd" in info.stdout
