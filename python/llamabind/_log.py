"""llama.cpp/ggml logs -> the Python logger ``llamabind`` (quiet by default).

The native side drops records below the logger's effective level without taking the GIL;
:func:`sync_level` re-reads that level and is called at every model/context creation and
generation, so ``logging.getLogger("llamabind").setLevel(logging.DEBUG)`` takes effect there.
"""

from __future__ import annotations

import logging

from . import _core

logger = logging.getLogger("llamabind")
logger.addHandler(logging.NullHandler())  # a library prints nothing unless the application asks

# ggml_log_level -> logging level
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_native = logging.getLogger("llamabind.native")


def _handler(level: int, text: str) -> None:
    _native.log(_LEVELS.get(level, logging.INFO), "%s", text)


def sync_level() -> None:
    """Forward to Python only what the ``llamabind.native`` logger would emit."""
    eff = _native.getEffectiveLevel()
    if eff <= logging.DEBUG:
        lvl = 1
    elif eff <= logging.INFO:
        lvl = 2
    elif eff <= logging.WARNING:
        lvl = 3
    elif eff <= logging.ERROR:
        lvl = 4
    else:
        lvl = 5
    _core.set_log_level(lvl)


_core.set_log_handler(_handler)
sync_level()
