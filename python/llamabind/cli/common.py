"""What several commands share, in llama.cpp's spellings: the model (-m, -hf), -c/--ctx-size, -t/--threads,
--lora/--lora-scaled, -fa/--flash-attn."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the noise: no ``(default: ...)`` where the help already says
    its default in words, where the default is None, or on an on/off flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def add_hf(p: argparse.ArgumentParser, mmproj: bool = False) -> None:
    """``-hf org/repo[:QUANT]``: the model from a Hugging Face repository (llama.cpp's spelling);
    ``mmproj``: the command takes a projector, which -hf then loads from the repository too."""
    p.add_argument(
        "--hf-repo",
        "-hf",
        default=None,
        metavar="ORG/REPO[:QUANT]",
        help="the model from a Hugging Face repository: the GGUF of that quant (default Q4_K_M, then Q8_0, "
        "then the first), through huggingface_hub's cache (HF_HUB_OFFLINE=1 works from it)"
        + ("; with the repository's multimodal projector if it has one (--no-mmproj: not)" if mmproj else ""),
    )
    if mmproj:
        p.add_argument("--no-mmproj", action="store_true", help="with -hf: leave the repository's projector out")


def add_image_tokens(p: argparse.ArgumentParser) -> None:
    """``--image-min-tokens/--image-max-tokens``: bounds on an image's tokens for projectors with
    dynamic resolution (Qwen-VL ...; llama.cpp's flags of the same names)."""
    for bound in ("min", "max"):
        p.add_argument(
            f"--image-{bound}-tokens", type=int, default=None, metavar="N", help=f"{bound}imum tokens per image"
        )


def resolve_hf(args: argparse.Namespace) -> None:
    """Replace the command's model with the -hf repository's file, downloaded if needed."""
    spec = getattr(args, "hf_repo", None)
    if spec:
        from .. import hub

        args.model = str(hub.download_spec(spec))
        if hasattr(args, "model_pos"):
            args.model_pos = None
        # as llama.cpp's -hf: the repository's projector too, for the commands that take one
        if hasattr(args, "mmproj") and args.mmproj is None and not getattr(args, "no_mmproj", False):
            proj = hub.download_mmproj(spec.partition(":")[0])
            args.mmproj = str(proj) if proj is not None else None


def add_model(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``-m/--model``: a model name or a GGUF path."""
    from .. import models

    p.add_argument("--model", "-m", default=models.DEFAULT, help=help or "model name or GGUF path")


def add_ctx_size(p: argparse.ArgumentParser, default: int | None, help: str = "context size in tokens") -> None:
    """``-c/--ctx-size`` (``--n-ctx`` too, the Python argument's name): n_ctx."""
    p.add_argument("--ctx-size", "-c", "--n-ctx", dest="n_ctx", type=int, default=default, help=help)


def _threads(text: str) -> int | None:
    """``-t`` as llama.cpp reads it: a count >= 1, or 0 (and -1) for all the cores there are (None)."""
    n = int(text)
    if n < -1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or 0 / -1 for all the cores; got {n}")
    return n if n > 0 else None


def _ngl_model(text: str) -> int:
    """``-ngl`` of the commands that load a :class:`~llamabind.Model`: a layer count >= 0, or ``all`` / ``auto`` /
    -1 for every layer (llama.cpp's ``auto`` fits the layers to the GPU's memory: Model offloads them all, and a
    model larger than the GPU fails to load naming it)."""
    if text in ("all", "auto"):
        return -1
    n = int(text)
    if n < -1:
        raise argparse.ArgumentTypeError(f"must be a layer count >= 0, or all / auto / -1 for every layer; got {n}")
    return n


def _ngl_server(text: str) -> int | None:
    """``serve -ngl`` as llama-server reads it: a layer count >= 0, ``auto`` (or -1: the layers that fit, the
    default) or ``all`` (-2: every layer)."""
    n = {"auto": -1, "all": -2}.get(text)
    if n is None:
        n = int(text)
    if n < -2:
        raise argparse.ArgumentTypeError(f"must be a layer count >= 0, auto (-1) or all (-2); got {n}")
    return None if n == -1 else n


def add_ngl(p: argparse.ArgumentParser, server: bool = False) -> None:
    """``-ngl/--n-gpu-layers/--gpu-layers``: layers to offload, with llama.cpp's ``auto`` and ``all``."""
    p.add_argument(
        "--n-gpu-layers", "-ngl", "--gpu-layers", dest="n_gpu_layers", type=_ngl_server if server else _ngl_model,
        default=None if server else -1, metavar="N|auto|all",
        help="layers to offload: a count, auto (the layers that fit, default) or all" if server
        else "layers to offload: a count, or all (default; auto and -1 too)",
    )  # fmt: skip


def add_threads(p: argparse.ArgumentParser) -> None:
    """``-t/--threads``: CPU threads (0 or -1: all the cores, as llama.cpp)."""
    p.add_argument(
        "--threads", "-t", type=_threads, default=None, help="CPU threads (default, 0 or -1: the cores there are)"
    )


class CommaList(argparse.Action):
    """A repeatable flag whose values may each be a comma-separated list (llama.cpp's ``--lora a,b`` and
    ``--rpc h1:p1,h2:p2``): all of them, in order, in one list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = [v.strip() for v in str(values).split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentError(self, "needs a value")
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), *items])


class LoraScaled(argparse.Action):
    """``--lora-scaled FILE:SCALE[,FILE:SCALE...]`` as llama.cpp's (repeatable): [(path, scale)] in order. The
    scale follows the last colon (a Windows path keeps its drive's); an item without one is an error naming the
    format (``FILE SCALE``, two arguments, was llamabind's spelling until 2026-12-04)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        out = list(getattr(namespace, self.dest, None) or [])
        for item in (v.strip() for v in str(values).split(",")):
            if not item:
                continue
            path, _, scale = item.rpartition(":")
            try:
                out.append((path, float(scale)))
            except ValueError:
                msg = f"{item!r}: the format is FILE:SCALE (llama.cpp's), e.g. a.gguf:0.5"
                raise argparse.ArgumentError(self, msg) from None
            if not path:
                raise argparse.ArgumentError(self, f"{item!r}: no file before the colon (FILE:SCALE)")
        if not out:
            raise argparse.ArgumentError(self, "needs FILE:SCALE")
        setattr(namespace, self.dest, out)


def add_lora(p: argparse.ArgumentParser) -> None:
    """``--lora FILE`` (repeatable or a comma list, scale 1) and ``--lora-scaled FILE:SCALE`` (repeatable or a comma
    list): LoRA adapters applied to the model (llama.cpp's flags)."""
    p.add_argument(
        "--lora", action=CommaList, default=None, metavar="FILE", help="apply this LoRA adapter (repeatable, or a,b)"
    )
    p.add_argument(
        "--lora-scaled", action=LoraScaled, default=None, metavar="FILE:SCALE",
        help="apply this LoRA adapter at SCALE (repeatable, or a.gguf:0.5,b.gguf:2)",
    )  # fmt: skip


def lora_specs(args: argparse.Namespace) -> list[tuple[str, float]]:
    """[(path, scale)] of --lora (scale 1) then --lora-scaled, each in its command line order."""
    return [(f, 1.0) for f in getattr(args, "lora", None) or []] + list(getattr(args, "lora_scaled", None) or [])


def add_flash_attn(p: argparse.ArgumentParser, default: str | None) -> None:
    """``-fa/--flash-attn on|off|auto`` (llama.cpp's values; on/off also as its truthy/falsy spellings)."""
    p.add_argument(
        "--flash-attn", "-fa", type=_on_off_auto, default=default, metavar="on|off|auto",
        help="flash attention (default: auto, on where the backend supports it)",
    )  # fmt: skip


def _on_off_auto(text: str) -> str:
    """llama.cpp's is_truthy / is_falsey / is_autoy: on|enabled|true|1, off|disabled|false|0, auto|-1."""
    v = text.strip().lower()
    for name, spellings in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0"))):
        if v in spellings:
            return name
    if v in ("auto", "-1"):
        return "auto"
    raise argparse.ArgumentTypeError(f"must be on, off or auto; got {text!r}")
