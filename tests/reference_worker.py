"""Runs the PyTorch reference scripts (tests/train_reference.py, tests/lora_reference.py) for a whole
pytest session in one side-venv process, so that torch and transformers are imported once and each
base GGUF is loaded once (gguf_once.load_model): ~20 s less per parity test on 2 cores.

    python reference_worker.py

One request per stdin line, "SCRIPT<TAB>WORK" (SCRIPT: a file name beside this one, WORK: the job's
directory with job.json); the script module's main(WORK) runs and one line answers on stdout: "ok",
or "error " and the traceback as a JSON string. The scripts stay runnable alone (python SCRIPT WORK).
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_once  # noqa: E402 - from this directory


def main() -> None:
    reply = sys.stdout
    sys.stdout = sys.stderr  # what the scripts print does not mix with the answers
    for line in sys.stdin:
        script, work = line.rstrip("\n").split("\t")
        try:
            importlib.import_module(Path(script).stem).main(Path(work))
            answer = "ok"
        except Exception:
            answer = "error " + json.dumps(traceback.format_exc())
        finally:
            gguf_once.forget_readers()
        reply.write(answer + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
