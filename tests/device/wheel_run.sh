#!/usr/bin/env bash
# Issue 30 on the device machine: the CUDA wheel (tools/build_cuda_wheel.py; cp312-abi3 on its
# Python 3.12) built there and tested in a clean venv (no system site-packages). Three calls that
# follow each other while the machine is warm:
#
#   bash tests/device/pack.sh                                    # here, once: .device, .device-b, .device-w
#   run(carry=[".device"],   "bash tests/device/wheel_run.sh build")  # starts the build (background)
#   run(carry=[".device-b"], "bash tests/device/wheel_run.sh wait")   # joins SmolLM2, waits for the wheel
#   run(carry=[".device-w"], "bash tests/device/wheel_run.sh test")   # clean venv: install, info, generate, op tests
#
# LB_ARCHS: CMAKE_CUDA_ARCHITECTURES of the build (default 90, the H100/H200: the tool's default list of
# six architectures takes several times longer than one call allows). Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}
mkdir -p "$OUT"
phase=${1:?phase: build, wait or test}
cd "$(dirname "$0")/../.."
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONUNBUFFERED=1
DIST=/tmp/cuda-dist

wait_build() {
  local t0=$SECONDS limit=${1:-540}
  while [ ! -f $DIST.rc ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 10; done
  if [ -f $DIST.rc ]; then
    echo "build finished: rc=$(cat $DIST.rc)"; ls -la $DIST
  else
    echo "build still running after $((SECONDS - t0)) s"; tail -3 "$OUT/../wheel-build.log" 2>/dev/null
  fi
  tail -c 3000 /tmp/wheel-build.log > "$OUT/wheel-build-tail.log"
  grep -E "^\s*\[[0-9]+/[0-9]+\]" /tmp/wheel-build.log | tail -1
}

case $phase in
build)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 --version; nvcc --version | tail -1
  if [ ! -f vendor/llama.cpp/.llamabind-stamp.json ]; then
    mkdir -p vendor/llama.cpp && tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
  fi
  cp .device/smollm2.part-a /tmp/smollm2.part-a
  rm -rf $DIST $DIST.rc
  t0=$(date +%s)
  setsid bash -c "python3 tools/build_cuda_wheel.py --archs '${LB_ARCHS:-90}' --no-build-isolation --out $DIST \
    > /tmp/wheel-build.log 2>&1; echo \$? > $DIST.rc; echo \$((\$(date +%s) - $t0)) > $DIST.seconds" < /dev/null &
  wait_build 540
  ;;
wait)
  cat /tmp/smollm2.part-a .device-b/smollm2.part-b > /tmp/smollm2.gguf
  sha256sum /tmp/smollm2.gguf | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
    && echo "SmolLM2 sha256 ok"
  wait_build 560
  ;;
test)
  [ -f $DIST.rc ] && [ "$(cat $DIST.rc)" = 0 ] || { echo "no wheel"; wait_build 300; }
  echo "build took $(cat $DIST.seconds 2>/dev/null) s"
  wheel=$(ls $DIST/llamabind-*.whl | head -1)
  echo "wheel: $(basename $wheel) $(du -m $wheel | cut -f1) MiB"
  python3 - "$wheel" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for i in sorted(z.infolist(), key=lambda i: -i.file_size)[:8]:
    print(f"{i.file_size / 2**20:8.1f} MiB  {i.compress_size / 2**20:6.1f} MiB zipped  {i.filename}")
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
print([l for l in z.read(meta).decode().splitlines() if "nvidia" in l or l.startswith(("Name", "Version"))])
PY
  rm -rf /tmp/cv && python3 -m venv /tmp/cv
  /tmp/cv/bin/pip install -q --no-index --find-links .device-w/whl numpy ml_dtypes tqdm gguf huggingface_hub \
    starlette uvicorn httptools uvloop pytest hypothesis
  /tmp/cv/bin/pip install -q --no-index --no-deps "$wheel"  # the CUDA libraries: the system's toolkit here
  /tmp/cv/bin/pip list 2>/dev/null | grep -iE "llamabind|numpy|nvidia" 
  ls /tmp/cv/lib/python3*/site-packages/llamabind/_core*  # abi3: _core.abi3.so
  so=$(ls /tmp/cv/lib/python3*/site-packages/llamabind/libggml-cuda*.so | head -1)
  echo "RUNPATH of $(basename $so): $(readelf -d $so | grep -oE 'R(UN)?PATH.*')"
  ldd $so | grep -E "cudart|cublas|libcuda"
  cd /tmp && /tmp/cv/bin/python -m llamabind info | grep -vE "^flags|^system"
  for ngl in 99 0; do
    /tmp/cv/bin/python -m llamabind generate -m /tmp/smollm2.gguf "The capital of France is" -t 0 -n 16 -ngl $ngl \
      > $OUT/generate-ngl$ngl.txt 2> $OUT/generate-ngl$ngl.err; echo "generate -ngl $ngl rc=$?"; cat $OUT/generate-ngl$ngl.txt
    tail -1 $OUT/generate-ngl$ngl.err
  done
  cmp -s $OUT/generate-ngl99.txt $OUT/generate-ngl0.txt && echo "CUDA0 and CPU text equal" || echo "CUDA0 and CPU text differ"
  cd - > /dev/null
  # the op tests with every op on CUDA0 (each call checked against the CPU by NMSE), from the clean venv
  LLAMABIND_TEST_BACKEND=cuda timeout 420 /tmp/cv/bin/python -m pytest tests/test_ops.py tests/test_ops_grad.py \
    -q -p no:cacheprovider -x 2>&1 | tail -5 | tee $OUT/ops-tests.log
  ;;
esac
