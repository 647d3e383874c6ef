"""PEP 517 backend: scikit_build_core.build, with the vendor tree populated before an sdist.

A wheel build runs vendor/vendor.py sync from CMakeLists.txt itself; an sdist is made without
CMake, so this wrapper runs the same sync first. Everything else is scikit-build-core's.
"""

import subprocess
import sys
from pathlib import Path

from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)
from scikit_build_core.build import build_sdist as _build_sdist


def build_sdist(sdist_directory, config_settings=None):
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, str(root / "vendor" / "vendor.py"), "sync"], check=True)
    return _build_sdist(sdist_directory, config_settings)
