"""What several commands share: the model's Hugging Face spelling."""

from __future__ import annotations

import argparse


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
