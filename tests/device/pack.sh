#!/usr/bin/env bash
# Prepares what the device calls carry (the device machine has no network and a 64 MiB carry):
#   .device/    llama.cpp.tar.xz (the patched vendor tree, trimmed to what the build and tests use),
#               whl/ (gguf: the one test dependency missing from the device image), tokenizer.gguf
#               (SmolLM2's tokenizer, for bench/make_model.py) and smollm2.part-a
#   .device-b/  smollm2.part-b, whl/ (the server's and its tests' packages for Python 3.12: starlette,
#               uvicorn, httptools, uvloop, openai, httpx and their dependencies)
#   .device-v/  debs/: Debian 12's Vulkan SDK pieces (glslc, libshaderc1, libvulkan1, libvulkan-dev,
#               spirv-headers) and the GL dispatch libraries NVIDIA's Vulkan ICD loads (apt-get download)
#   .device-w/  whl/: the runtime and test packages a clean Python 3.12 venv needs for the CUDA wheel (wheel_run.sh)
#   .device-s/  smollm2-4l.gguf: SmolLM2 cut to its first CUT_LAYERS blocks (tests/gguf_tensors.cut, 41 MB), what the
#               fine-tuning tests train (conftest's smollm2_f32_cut): carried beside .device, the build and those
#               tests run in one call (cuda_run.sh's fa56 with LB_TRAIN_K)
#   .device-q/  bitsandbytes 0.50.2 with its CUDA 13 libraries alone (7 MB: peft + bitsandbytes NF4, cuda_run.sh qlora88)
#   .device-t/  TRL 1.16.0, datasets, dill, multiprocess (--no-deps; TRL's trainers beside llamabind's: grpo85, pending)
# SmolLM2 Q4_1 (98 MB) is over the carry limit, so it travels in two calls (cuda_run.sh joins the parts
# and checks its sha256). Both folders are git-ignored through .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.device/ /.device-b/ /.device-v/ /.device-w/ /.device-s/ /.device-q/ /.device-t/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .device .device-b .device-v .device-w .device-s .device-q .device-t
mkdir -p .device/whl .device-b/whl .device-v/debs .device-w/whl .device-s .device-q .device-t
# the tree's stamp must name the patches as they are now: a patch edited since the last sync (its header too) makes the
# device's build unpack the pin again, which it cannot without a registry (seen 2026-12-01)
if python3 vendor/vendor.py status | grep -q "older version of the patch"; then
  echo "pack.sh: a patch changed since vendor/llama.cpp was synced: refresh it, then run python3 vendor/vendor.py sync" >&2
  exit 1
fi
# tools/: LLAMA_BUILD_TOOLS configures every tool (the server core is linked into _core); the web UI's
# sources are not built (no npm), only its CMake files are read
tar cJf .device/llama.cpp.tar.xz -C vendor/llama.cpp --exclude=tools/ui/src --exclude=tools/ui/tests --exclude=tools/ui/static \
  CMakeLists.txt cmake include licenses LICENSE .llamabind-stamp.json \
  src ggml common vendor tools scripts/ui-assets.cmake examples/simple examples/training docs/build.md \
  models/templates/Qwen-Qwen2.5-7B-Instruct.jinja
python3 -m pip download -q --no-deps --only-binary=:all: -d .device/whl "gguf==$(./dev python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
./dev python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp -d .device-b/whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  starlette uvicorn httptools uvloop openai httpx
# .device-w: what a clean Python 3.12 venv needs for the CUDA wheel's test (wheel_run.sh test)
./dev python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp -d .device-w/whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  numpy ml_dtypes tqdm gguf huggingface_hub starlette uvicorn httptools uvloop pytest hypothesis
model=$(./dev python -c 'from llamabind import models; print(models.resolve(models.DEFAULT))')
./dev python - "$model" .device/tokenizer.gguf <<'PY'
import sys, gguf
src = gguf.GGUFReader(sys.argv[1])
w = gguf.GGUFWriter(sys.argv[2], "llama")
for name, field in src.fields.items():
    if name.startswith("tokenizer."):
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), t, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), t)
w.write_header_to_file(); w.write_kv_data_to_file(); w.close()
PY
(cd .device-v/debs && apt-get download -q glslc libshaderc1 libvulkan1 libvulkan-dev spirv-headers \
  libglvnd0 libglx0 libgl1 libegl1 libopengl0 libgles2)
head -c 55000000 "$model" > .device/smollm2.part-a
tail -c +55000001 "$model" > .device-b/smollm2.part-b
# conftest imports pytest, which ./dev setup alone does not install
./dev python -c "import pytest" 2>/dev/null || ./dev python -m pip install -q pytest
PYTHONPATH=tests ./dev python -c "import sys, conftest, gguf_tensors; gguf_tensors.cut(sys.argv[1], sys.argv[2], conftest.CUT_LAYERS)" \
  "$model" .device-s/smollm2-4l.gguf
# .device-q: bitsandbytes for Python 3.12, its libraries for other CUDA versions and ROCm/XPU dropped (43 -> 7 MB)
./dev python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .device-q \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 bitsandbytes==0.50.2
for w in .device-q/*.whl; do
  zip -q -d "$w" 'bitsandbytes/libbitsandbytes_cuda11*' 'bitsandbytes/libbitsandbytes_cuda12*' \
    'bitsandbytes/libbitsandbytes_rocm*' 'bitsandbytes/libbitsandbytes_xpu*' 2>/dev/null || true
done
./dev python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .device-t \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .device .device-b .device-v .device-w .device-s .device-q .device-t
