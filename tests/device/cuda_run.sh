#!/usr/bin/env bash
# The CUDA run of issue 6, on the device tool's nvidia-h200-x2 (two H200s), in three calls that
# follow each other while the machine is warm (it keeps build/ and /tmp between calls):
#
#   bash tests/device/pack.sh                         # here, once: fills .device/ and .device-b/
#   run(carry=[".device"],   "bash tests/device/cuda_run.sh ops")     # build, op tests, bandwidth
#   run(carry=[".device-b"], "bash tests/device/cuda_run.sh models")  # the test suite on CUDA
#   run(carry=[],            "bash tests/device/cuda_run.sh bench")   # pp512/tg128 vs llama-bench
#
# ops:    builds (setup.sh), then the op tests with every op on CUDA0 (LLAMABIND_TEST_BACKEND=cuda:
#         each call checked against the CPU by NMSE, table in ops-check.json), gradients on CUDA0,
#         the GPU-vs-CPU tests; measures the memory bandwidth; starts writing the random-weight
#         models in the background for the bench call: micro (F16) and LB_BENCH_SIZES (default 1b, empty for none;
#         "1b 8b" for the 8b-shape rows too) x LB_BENCH_TYPES (default q4_0 q8_0 f16).
# models: joins SmolLM2 (sha256-checked) into the llamabind cache and runs the whole test suite with
#         the model fully offloaded (n_gpu_layers=-1 is the default), multi-GPU split tests included;
#         LLAMABIND_REQUIRE_GPU=1 makes a skipped GPU test a failure (left out: the tests that build
#         CPU wheels, sdists or notebooks, which need PyPI or other Pythons: they run in CI here).
#         Then tests/device/rss_probe.py: host memory over 200 CUDA load/generate/close cycles,
#         through llamabind and through llama.h alone (tests/device/load_cycles.cpp).
# train:  (carry .device-b on a machine that ran ops) tests/test_train.py on CUDA, then trainbench.
# trainbench: bench/train.py -ngl 99 (llama-finetune beside llamabind full and LoRA).
# rss:    the RSS probe alone (models runs it after the suite).
# cost:   tests/device/decode_cost.py on the micro model: per-call cost of a one-token decode in
#         llama-bench, in llama.h alone with each of llamabind's context settings, and in llamabind.
# leak:   (carry .device-b on a machine that ran ops) tensor split vs one GPU under each all-reduce
#         setting (split_nmse.py), then the leak test alone / without log capture / after the
#         multi-GPU tests, and the multi-GPU + RPC tests; LB_LEAK_FULL=1: the whole suite instead.
# build:  (carry .device) the build alone, SmolLM2's first part kept in /tmp for "server" and "e2e",
#         the bench models started in the background.
# e2e:    (carry .device-b after build) generation and chat tests on CUDA, then bench/e2e.py on each
#         model (issue 20: end-to-end vs decode, per-token breakdown, CPU vs backend sampling).
# vulkan: (carry .device-v after e2e) tests/device/vulkan.sh: Debian 12's Vulkan SDK from the
#         carried .debs, the Vulkan build, op and model tests on Vulkan0, pp/tg vs llama-bench.
# vulkanqlora: (carry .device-v after qlora) issue 27 on Vulkan: the Vulkan build, tests/test_qlora.py on
#         Vulkan0 (NVIDIA's driver), bench/train.py's full/LoRA/QLoRA rows on Vulkan0.
# server: (carry .device-b after build) tests/test_server.py and the fuzz with the model fully offloaded,
#         then bench/server.py -ngl 99 (llamabind serve beside llama-server from the same build); LB_NO_TESTS=1:
#         the bench alone, LB_NO_BENCH=1 the tests alone; LB_PARALLEL (slots, 8), LB_CTX (8192), LB_CLIENTS (1,4,8).
# opsarrays: (carry .device after build) issue 21: the op tests on CUDA0 with inputs bound in place,
#         DeviceArray/DLPack tests with torch, then bench/ops.py (per-call overhead, element-wise,
#         the 10-op chain: numpy round trips vs DeviceArray vs PyTorch CUDA).
# multimodal: (carry .device-b after build) issue 29: tests/test_multimodal.py on CUDA0, bench/multimodal.py.
# qlora:  (carry .device-b after build) issue 27: tests/test_qlora.py on CUDA0, the gradient-accumulation
#         test, bench/train.py on the GPU with PyTorch beside it (SmolLM2); qlora1b: the 1B shape;
#         ctx: SmolLM2 training at ctx 512-4096.
# fa56:   (carry .device; LB_NO_TOOLS=1: the build with the flash-attention kernels, no tools) issue 56: random-weight
#         1B llamas in /tmp/lb-models, then the new kernels on CUDA0 (FLASH_ATTN_BACK against the CPU, the
#         gradient compositions, out_prod and the BF16 GEMM of quantized weights).
# fa56ncu: (after fa56, or alone: it builds) FLASH_ATTN_BACK's kernels under Nsight Compute and SDPA's bf16 backward
#         beside them (bench/attention_backward.py; LB_FA_DET, LB_PIPES, LB_ATTN_ARGS).
# fa67ab: (after fa56) patch 0068's casts and patch 0067's split on and off as bench/train.py rows in one lease, then
#         the step's kernels with the casts (LB_BENCH, LB_SETTINGS).
# fa69:   (after fa56) settings (LB_SETTINGS: environment variables) against each other as bench/train.py rows.
# fa69tests: (after fa56 carrying .device-s, or SmolLM2's parts in /tmp or .device-b) the casts' and FFN activations'
#         GPU tests (fa56 with LB_TRAIN_K=bf16 and .device-s carried runs them in its call).
# fa56kernels: (after fa56) one 1B training step's kernels timed by Nsight Compute (bench/kernel_times.py);
#         LB_KT_GRAPH=1: its CUDA graph too, as one workload, beside the host's part and the SM clock.
# fa56profile: (after fa56) bench/train_profile.py on the 1B: LB_MODES (default now,bf16: F32 products with composed
#         attention, and the defaults: BF16 products, flash attention) at LB_PROFILE_1B (default 2048x4,4096x1).
# train42: (carry .device) issue 42: the build, random-weight 1B and 135M llamas (Q4_0 and F32 copies in
#         /tmp/lb-models), then bench/train_profile.py: a step's breakdown (build, alloc, inputs, compute;
#         forward/backward/optimizer ops) for the pin's way (a window per graph, rebuilt every window) and
#         this tree's (a batch per graph, kept), 1B at 256x8 and 2048x1, 135M at 256x8.
# train42b: (carry .device-b after train42) SmolLM2 joined, the fine-tuning tests on CUDA0 (the graph, token_embd,
#         batch and QLoRA tests; the PyTorch parity tests run on the CPU in CI), then LB_BENCH (default
#         "1b:256:1,8"): bench/train.py rows SIZE:CTX:BATCHES, runners LB_RUNNERS, PyTorch LB_TORCH_RUNS.
# train42c: (after train42) more bench/train.py rows only (LB_BENCH, as train42b).
# pref58: (carry .device-b after build) issue 58: the preference tests on CUDA0, then bench/preference.py.
# amx:    (LB_NO_CUDA=1; LB_AMX_STEP=build, then test) the CPU suite on the device's Intel Xeon with AMX_INT8.
# pending: (carry .device/llama.cpp.tar.xz, whl, tokenizer.gguf, .device-s, .device-t; LB_NO_TOOLS=1) what the
#         2026-12-06 lease left for a GPU, in one build: fa_harness's attention-backward orders (patch 0106) while it
#         builds, GRPO's TRL parity on CUDA (TF32 and BF16), patch 0105's Q6_K kernel in the q6_K QLoRA tests, the
#         8B Q4_K_M QLoRA step's kernels without and with it.
# defaults: (carry .device) the build and the CUDA tests of patches 0105's and 0106's defaults, no variable set.
# kbfix:  (as pending) patch 0106's and 0088's CUDA tests with their whole output, GRPO's parity, the 1B 16k and 8B
#         2048 x 4 steps' kernels in both dK/dV orders, in one call.
# kbchunk: (after pending, warm) patch 0106's dK/dV blocks in chunks of key blocks (GGML_CUDA_FA_BACK_KB_CHUNK): its
#         test, fa_harness --backward in each order against SDPA, the 1B 16k and 8B 2048 x 4 steps' kernels.
# bulkdq: (after profiles, warm) GGML_CUDA_FA_BACK_BULK_DQ=1 against the defaults in 1B 16k and 8B 8k training steps.
# profiles: (after pending, warm) fa_harness's BULK_DQ variant (issue 84), bench/kernel_times.py --trace and
#         bench/train_profile.py on the 8B QLoRA step (issue 88) and the 1B at 16k (issue 84), the CLI example on the
#         8B Q4_K_M GGUF.
# pack84: (carry .device/llama.cpp.tar.xz, whl, tokenizer.gguf and .device-s; LB_NO_TOOLS=1) issue 84: the build, the
#         packing tests on CUDA0, bench/pack.py on the random-weight 1B (packed against padded windows).
# chunk84: (as pack84) issue 84, item 3: the build, the chunked cross-entropy's tests on CUDA0, bench/pack.py's packed
#         1B windows with the logits whole and chunked (LB_CHUNK_RUNS CTX:LOSS_CHUNK_TOKENS[:gc]), nvidia-smi's peak.
# wgmma84: (as chunk84) issue 84, item 2: the build, the flash-attention tests on CUDA0 (patch 0099's wgmma forward),
#         bench/train.py's full fine-tune rows at 16k and 32k with PyTorch bf16 beside them (LB_NO_TESTS, LB_NO_BENCH).
# attn84: (after pack84) issue 84: SDPA and llamabind's flash-attention kernels at 8k-64k tokens, 1B/8B/70B head shapes.
# bench:  bench/generation.py on each model, full offload, llama-bench beside it in the same run
#         (LB_ROUNDS x LB_REPS, default 5 x 20).
# Logs, JSON and summaries go to $OUT (then bench/results/).
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}
mkdir -p "$OUT"
phase=${1:?phase: pending, defaults, kbfix, kbchunk, profiles, bulkdq, amx, qlora88, ddp87, grpo85, pref83b, pack84, chunk84, wgmma84, attn84, pref83, pref58, fa56, fa56ncu, fa67ab, fa69, fa69tests, fa56kernels, fa56profile, train42, train42b, train42c, multimodal, qlora, qlora1b, ctx, vulkanqlora, ops, models, train, trainbench, rss, cost, leak, build, opsarrays, server, e2e, vulkan or bench}
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODELS=/tmp/lb-models
# the image's pytest plugins are not autoloaded (one of them crashed the interpreter at start-up)
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# a test that does not return dumps every thread's stack after LB_FAULT_S seconds (pytest's faulthandler_timeout): a
# hang shows where it is rather than only eating the call's 600 s (two calls did so on 2026-11-28)
PYTEST_ARGS="-q -p no:cacheprovider -p _hypothesis_pytestplugin -rs -o faulthandler_timeout=${LB_FAULT_S:-90} ${LB_PYTEST_EXTRA:-}"
# left out of the suite here: test_embeddings (builds a side venv from PyPI), the sdist, vendor and
# wheel-building tests (PyPI, other Pythons, the untrimmed upstream tree), upstream's vocab GGUFs and
# chat templates (not carried), the notebook (nbformat is not in the image); the op tests run in "ops"
# (and the fine-tuning parity with PyTorch: transformers is not in the image; the "train" phase runs the rest)
SUITE_EXCLUDES=(--deselect tests/test_train.py::test_matches_pytorch --deselect tests/test_train.py::test_lora_matches_pytorch --deselect tests/test_train.py::test_finetune_notebook_executes --ignore=tests/test_embeddings.py --ignore=tests/test_ops.py --ignore=tests/test_ops_grad.py --ignore=tests/test_vendor.py --deselect tests/test_packaging.py::test_sdist_carries_the_patched_tree_and_needs_no_registry --deselect tests/test_packaging.py::test_ops_notebook_executes --deselect tests/test_chat.py::test_tool_call_parsing_with_a_tool_template --ignore=tests/test_portable.py --deselect tests/test_packaging.py::test_sdist_builds_a_wheel_offline --deselect tests/test_packaging.py::test_wheel_installs_into_a_fresh_venv_and_generates -k "not upstream_tokenizer_vectors and not four_named_vocabularies and not duplicate_token_texts")
# the 8B shape over Q4_K_M with Llama-3.1's vocabulary size (issue 88's profiles), in the background; .done when whole
# (a call's end kills what it started: a file without .done is written again)
F8=$MODELS/llama-8b-q4_k_m-v128k.gguf
start_8b_q4_k_m() {
  cp .device/tokenizer.gguf /tmp/; mkdir -p $MODELS
  [ -f $F8.done ] || { python3 bench/make_model.py --size 8b --type q4_k_m --vocab 128256 -o $F8 \
    --tokenizer-from /tmp/tokenizer.gguf > $F8.log 2>&1 && touch $F8.done || touch $F8.fail; } &
}
# pending: fa_harness's dispatch orders of the attention backward (patch 0106) on the GPU, idle while the build runs
# (the harness needs only nvcc, torch and the unpacked tree; the build takes two cores fewer); LB_EARLY_HARNESS=0: not
HARNESS_PID=
if [ "$phase" = pending ] && [ "${LB_EARLY_HARNESS:-1}" = 1 ]; then
  [ -f vendor/llama.cpp/.llamabind-stamp.json ] || { mkdir -p vendor/llama.cpp \
    && tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp; }
  export LB_BUILD_JOBS=$(( $(nproc) - 2 ))
  timeout 400 python3 tests/device/fa_harness.py --backward --reps 10 --ctx ${LB_KB_CTX:-8192,16384,32768} \
    --chunks ${LB_KB_CHUNKS:-0,16,auto,max} --out "$OUT" > "$OUT/harness-kbchunk.txt" 2>&1 &
  HARNESS_PID=$!
fi
{
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
source tests/device/setup.sh
python3 -m llamabind info
# SmolLM2 from its two carried parts (.device's part-a, copied to /tmp by "ops", and .device-b's), checked
join_model() {
  local f=$LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$(dirname $f)"
  local b=.device-b/smollm2.part-b
  [ -f $b ] || b=/tmp/smollm2.part-b  # copied there by an earlier call that carried .device-b
  cat /tmp/smollm2.part-a $b > $f
  sha256sum $f | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 && echo "SmolLM2 sha256 ok"
}
# SmolLM2's first blocks for the fine-tuning tests (conftest's smollm2_f32_cut), carried in .device-s (pack.sh),
# kept in /tmp for the lease's later calls
[ -f .device-s/smollm2-4l.gguf ] && cp .device-s/smollm2-4l.gguf /tmp/
[ -f /tmp/smollm2-4l.gguf ] && export LLAMABIND_TEST_SMOLLM2_CUT=/tmp/smollm2-4l.gguf
# SmolLM2's tokenizer alone (pack.sh's .device/tokenizer.gguf) for the tests' random-weight models (conftest's tiny_q8)
[ -f .device/tokenizer.gguf ] && cp .device/tokenizer.gguf /tmp/
[ -f /tmp/tokenizer.gguf ] && export LLAMABIND_TEST_TOKENIZER=/tmp/tokenizer.gguf
# random-weight models for the bench calls, written in the background: micro (per-call cost) and
# LB_BENCH_SIZES (default 1b) x LB_BENCH_TYPES (default q4_0 q8_0 f16), from SmolLM2's tokenizer
start_models() {
  [ -d $MODELS ] || (mkdir -p $MODELS && setsid bash -c "python3 bench/make_model.py --size micro --type f16 -o $MODELS/llama-micro-f16.gguf \
      --tokenizer-from /tmp/tokenizer.gguf && for q in ${LB_BENCH_TYPES-q4_0 q8_0 f16}; do for s in ${LB_BENCH_SIZES-1b}; do \
      python3 bench/make_model.py --size \$s --type \$q -o $MODELS/llama-\$s-\$q.gguf --tokenizer-from /tmp/tokenizer.gguf; \
      done; done > $MODELS/make.log 2>&1; touch $MODELS/done" < /dev/null &)
}
# bench/train.py rows, one per setting (the arguments: environment variables, several joined by commas) in one
# lease for each LB_BENCH spec SIZE:CTX:BATCHES (default "1b:2048:4"), runners LB_RUNNERS (default full,lora);
# PyTorch LB_TORCH_RUNS (default bf16,lora-bf16; none: left out) once a spec, beside the first setting; the model
# LB_BENCH_MODEL (default the spec's random-weight Q4_0 llama: QLoRA's base, its F32 copy full and LoRA's)
bench_settings() {
  local spec sz ctx batches setting torch first
  for spec in ${LB_BENCH:-1b:2048:4}; do
    IFS=: read -r sz ctx batches <<< "$spec"
    first=1
    for setting in "$@"; do
      torch=""
      [ -n "$first" ] && [ "${LB_TORCH_RUNS:-}" != none ] && \
        torch="--torch python3 --torch-device cuda --torch-runs ${LB_TORCH_RUNS:-bf16,lora-bf16}"
      first=""
      env ${setting//,/ } python3 bench/train.py -ngl 99 --threads 8 --model ${LB_BENCH_MODEL:-$MODELS/llama-$sz-q4_0.gguf} \
        --chars ${LB_CHARS:-400000} --ctx $ctx --batch $batches --steps ${LB_STEPS:-6} --runners ${LB_RUNNERS:-full,lora} \
        $torch --out "$OUT/train-$sz-ctx$ctx-b$batches-${setting//[=,]/-}.json" 2>&1 | tee -a "$OUT/bench-train-raw.log" | grep -E "^\| (llama|PyTorch)|rror|^row done" \
        | sed "s/^/$setting /" | tee -a "$OUT/bench-train-settings.txt"
    done
  done
}
# the random-weight 1B (Q4_0) and its F32 copy in $MODELS, written in the background (the caller waits): pack84, chunk84
start_1b_f32() {
  cp .device/tokenizer.gguf /tmp/; mkdir -p $MODELS
  [ -f $MODELS/llama-1b-f32.gguf ] || { python3 bench/make_model.py --size 1b --type q4_0 -o $MODELS/llama-1b-q4_0.gguf \
    --tokenizer-from /tmp/tokenizer.gguf && python3 -c "from llamabind import train; \
    train.to_f32('$MODELS/llama-1b-q4_0.gguf', '$MODELS/llama-1b-f32.gguf.part')" \
    && mv $MODELS/llama-1b-f32.gguf.part $MODELS/llama-1b-f32.gguf; } > $MODELS/make.log 2>&1 &
}
# bench/preference.py for each spec of $1 (SIZE:CTX:BATCH; smollm2 for the real model), runners $2, PyTorch's DPO loop
# LB_PREF_TORCH (default lora,full) beside them, LB_PREF_STEPS steps (default 12)
pref_bench() {
  local spec size ctx batch what
  for spec in $1; do
    IFS=: read -r size ctx batch <<< "$spec"
    what=$([ "$size" = smollm2 ] && echo "--model smollm2-135m-instruct" || echo "--size $size")
    [ -f $MODELS/llama-$size-q4_0.gguf ] && what="--model $MODELS/llama-$size-q4_0.gguf"  # start_1b_f32's
    python3 bench/preference.py $what --ctx $ctx --batch $batch --steps ${LB_PREF_STEPS:-12} \
      --runners "$2" --torch python3 --torch-runs ${LB_PREF_TORCH:-lora,full} \
      --out "$OUT/preference-$size-$ctx.json" 2>&1 | grep -vE "^(llama|load|print_info|common|main|ggml|init)" \
      | tail -12 | tee -a "$OUT/bench-preference.txt"
  done
}
case $phase in
pref58)
  # (carry .device-b after build, with SmolLM2's part-a in /tmp) issue 58 on CUDA0: tests/test_train_preference.py
  # (the PyTorch parity against this image's torch + peft: LLAMABIND_REFERENCE_PYTHON), then bench/preference.py:
  # llamabind's DPO (LoRA, QLoRA, full) beside a PyTorch DPO loop in bf16 autocast, LB_PREF (default
  # "1b:512:8 smollm2:256:8", SIZE:CTX:BATCH) with LB_PREF_STEPS steps (default 12)
  join_model
  t0=$SECONDS
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REFERENCE_PYTHON=python3 LLAMABIND_REQUIRE_GPU=1 python3 -m pytest \
    tests/test_train_preference.py $PYTEST_ARGS -s 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" \
    | tee "$OUT/pref-tests.log" | tail -25
  echo "preference tests in $((SECONDS - t0)) s"
  pref_bench "${LB_PREF:-1b:512:8 smollm2:256:8}" "${LB_PREF_RUNNERS:-lora,qlora,full}"
  ;;
pref83b)
  # (as pref83) issue 83 item 4: the build, patch 0101's preference tests (graphs kept, packed pairs) and the ln 2
  # tests on CUDA0 (LB_PREF83_K), then bench/preference.py's 1B rows LB_PREF (default "1b:512:8 1b:2048:4"):
  # LB_PREF_RUNNERS (default lora,lora-pack,full,full-pack) beside PyTorch's DPO loop
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-400} python3 -m pytest \
    tests/test_train_preference.py $PYTEST_ARGS -s -k "${LB_PREF83_K:-ln_2 or keeps_its_graphs or packed_pairs}" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/pref83b-tests.log" | tail -15
  [ "${LB_PREF:-x}" = " " ] || { start_1b_f32; wait; }
  pref_bench "${LB_PREF:-1b:512:8 1b:2048:4}" "${LB_PREF_RUNNERS:-lora,lora-pack,full,full-pack}"
  ;;
ddp87)
  # issue 87 (carry .device/llama.cpp.tar.xz, .device/whl; LB_NO_TOOLS=1): the build, then tests/test_train_ddp.py:
  # the gloo tests on this machine's CPU and, with CUDA, test_ranks_over_nccl_train_as_one (a one-rank launch over
  # NCCL against the plain run on one GPU; 2 ranks, each its GPU, against one process with the global batch on 2+)
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REFERENCE_PYTHON=python3 LLAMABIND_REQUIRE_GPU=1 \
    timeout ${LB_TEST_TIMEOUT:-400} python3 -m pytest tests/test_train_ddp.py $PYTEST_ARGS -s 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/ddp87-tests.log" | tail -15
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  # bench/ddp.py: the 1B shape's full fine-tune at 2048 x 4 a GPU on 1..N GPUs (LB_DDP_N, default every power of two
  # up to the GPUs here) beside PyTorch DDP (bf16 autocast, SDPA)
  start_1b_f32; wait
  n_gpu=$(nvidia-smi -L | wc -l); counts=1; k=2
  while [ $k -le $n_gpu ]; do counts=$counts,$k; k=$((2 * k)); done
  python3 bench/ddp.py --model $MODELS/llama-1b-q4_0.gguf --ctx 2048 --batch 4 --nproc ${LB_DDP_N:-$counts} \
    --runners ${LB_DDP_RUNNERS:-full} --steps 8 --threads 4 --torch python3 --out "$OUT/ddp-1b.json" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|main|ggml|init)" | tail -14 | tee -a "$OUT/bench-ddp.txt"
  ;;
qlora88)
  # issue 88 (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf and .device-q: bitsandbytes 0.50.2 with
  # its CUDA 13 library alone; LB_NO_TOOLS=1): the build; LB_88_PREP (default "8b:q4_0 8b:q4_k_m", none: none) random-weight
  # GGUFs of the shape with Llama 3's 128,256-token vocabulary ($MODELS/llama-SIZE-TYPE-v128k.gguf, .done when
  # complete: a warm machine keeps them for the lease's later calls) written while the QLoRA per-type tests run on
  # CUDA0 (quantized OUT_PROD and gradients against float64: every type ggml quantizes; LB_NO_TESTS=1: not); then (LB_NO_BENCH=1:
  # not) bench/train.py rows for each LB_88 spec SIZE:CTX:BATCHES (default "8b:2048:4 8b:8192:1") and LB_88_TARGETS
  # (default "all qv"), rank LB_88_RANK (16): llamabind LB_88_RUNNERS (default qlora) over each LB_88_TYPES (default
  # "q4_0 q4_k_m") beside, with the first type, PyTorch LB_88_TORCH (default qlora-nf4,lora-bf16: peft over
  # bitsandbytes NF4 and over bf16 weights, transformers' random init of the shape); LB_88_EXTRA: more arguments
  [ -d .device-q ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-q/*.whl
  cp .device/tokenizer.gguf /tmp/; mkdir -p $MODELS
  # written while the tests run, waited for before the bench (the device tool ends a call's processes with it, setsid
  # ones too: a GGUF started in one call is not there in the next, 2026-12-05)
  for st in ${LB_88_PREP-8b:q4_0 8b:q4_k_m}; do
    [ "$st" = none ] && continue
    f=$MODELS/llama-${st%%:*}-${st##*:}-v128k.gguf
    [ -f $f.done ] || { python3 bench/make_model.py --size ${st%%:*} --type ${st##*:} --vocab 128256 -o $f \
      --tokenizer-from /tmp/tokenizer.gguf > $f.log 2>&1 && touch $f.done; } &
  done
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-300} \
    python3 -m pytest tests/test_qlora.py $PYTEST_ARGS -k "not every_node" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/qlora88-tests.log" | tail -15
  wait
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  for spec in ${LB_88:-8b:2048:4 8b:8192:1}; do
    [ "$spec" = none ] && continue
    IFS=: read -r sz ctx batches <<< "$spec"
    for targets in ${LB_88_TARGETS:-all qv}; do
      first=1
      for ty in ${LB_88_TYPES:-q4_0 q4_k_m}; do
        f=$MODELS/llama-$sz-$ty-v128k.gguf
        [ -f $f.done ] || { echo "no $f (LB_88_PREP writes it)"; continue; }
        torch=""
        [ -n "$first" ] && [ "${LB_88_TORCH:-}" != none ] && torch="--torch python3 --torch-device cuda --torch-init random \
          --torch-runs ${LB_88_TORCH:-qlora-nf4,lora-bf16}"
        first=""
        python3 bench/train.py -ngl 99 --threads 8 --model $f --chars ${LB_CHARS:-200000} --ctx $ctx --batch $batches \
          --steps ${LB_STEPS:-6} --runners ${LB_88_RUNNERS:-qlora} --lora-rank ${LB_88_RANK:-16} --lora-targets $targets \
          $torch ${LB_88_EXTRA:-} --out "$OUT/train88-$sz-$ty-ctx$ctx-b$batches-$targets.json" 2>&1 \
          | tee -a "$OUT/bench88-raw.log" | grep -E "^\| (llama|PyTorch)|rror|^row done" | tee -a "$OUT/bench88.txt"
      done
    done
  done  # LB_88_CLI=SIZE:TYPE: docs/finetune.md's example, the CLI's QLoRA (rank 16, all-linear, 2048 x 4, 20 steps) on that
  # GGUF from a text file, its wall time, its output and the GPU's peak memory (nvidia-smi every 0.5 s)
  if [ -n "${LB_88_CLI:-}" ]; then
    f=$MODELS/llama-${LB_88_CLI%%:*}-${LB_88_CLI##*:}-v128k.gguf
    for i in $(seq 16); do cat vendor/llama.cpp/docs/build.md; done > /tmp/notes.txt
    (while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done > /tmp/cli-mem.txt) &
    poll=$!; t0=$SECONDS
    python3 -m llamabind finetune -m $f --data /tmp/notes.txt -o /tmp/adapter.gguf --lora-rank 16 --lora-targets \
      all-linear --ctx-size 2048 --batch 4 --iters 20 --no-progress 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" \
      | tail -12 | tee "$OUT/cli88.txt"
    echo "wall $((SECONDS - t0)) s; GPU peak $(sort -n /tmp/cli-mem.txt | tail -1) MiB; adapter $(du -h /tmp/adapter.gguf)" \
      | tee -a "$OUT/cli88.txt"
    kill $poll
  fi
  ;;
pending)
  # (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf, .device-s and .device-t; LB_NO_TOOLS=1) what
  # the 2026-12-06 H100 lease left for a GPU, after one build: GRPO's TRL parity on CUDA with precision="f32" (TF32 products) and the BF16
  # defaults (issue 85), patch 0105's Q6_K -> BF16 kernel (issue 88: GGML_CUDA_Q6_K_BF16_X8=1) in the q6_K QLoRA tests,
  # then the 8B Q4_K_M QLoRA step's kernels without and with it (and where its F32 -> BF16 conversions are: --launches).
  # Then "kbchunk" on the warm machine.
  [ -d .device-t ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-t/*.whl
  # the harness started before the build (patch 0106's orders) has the GPU to itself until it ends
  # (the block runs in a subshell of the pipe to tee: not its child, so polled)
  [ -n "$HARNESS_PID" ] && { while kill -0 $HARNESS_PID 2>/dev/null; do sleep 2; done
    tail -30 "$OUT/harness-kbchunk.txt"; }
  # the models written while the tests run (LB_PENDING_MODELS=0: not); the 8B one after the build: bench/make_model.py
  # imports llamabind (started before it, it failed at once on 2026-12-06)
  [ "${LB_PENDING_MODELS:-1}" = 1 ] && { start_8b_q4_k_m; start_1b_f32; }
  # (the q6_K tests first: seconds, where the GRPO parity takes about two minutes)
  GGML_CUDA_Q6_K_BF16_X8=1 LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout 120 python3 -m pytest \
    tests/test_qlora.py $PYTEST_ARGS -k "q6_K" 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tail -8 \
    | tee "$OUT/pending-q6k.txt"
  LLAMABIND_REFERENCE_PYTHON=python3 timeout 240 python3 -m pytest tests/test_train_grpo.py $PYTEST_ARGS -s \
    -k equal_trls 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/pending-grpo.txt" | tail -30
  # issue 88: the 8B QLoRA r16 all-linear step's kernels (CUPTI, unprofiled steps) once its GGUF is whole, with the
  # old Q6_K kernel and with patch 0105's
  while [ ! -f $F8.done ] && [ ! -f $F8.fail ] && [ $SECONDS -lt 480 ]; do sleep 5; done
  for x8 in 0 1; do
    [ -f $F8.done ] && GGML_CUDA_Q6_K_BF16_X8=$x8 timeout 100 python3 bench/kernel_times.py --model $F8 --mode qlora \
      --lora-rank 16 --lora-targets all --ctx 2048 --batch 4 --steps 3 --trace /tmp/trace-8b.json \
      --launches "convert_unary\w*<float" --out "$OUT/kernels-8b-q6k$x8.json" 2>&1 \
      | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/kernels-8b-q6k$x8.txt" \
      | grep -E "step_ms|^\| (matrix|dequant|flash|element|F32)|q6_K"
  done
  wait; ls -la $MODELS; echo "pending took $SECONDS s"
  ;;
defaults)
  # (carry .device/llama.cpp.tar.xz, whl, tokenizer.gguf; LB_NO_TOOLS=1) the build, then the CUDA tests of the defaults
  # patches 0105 and 0106 turned on: the attention backward's (the dispatch orders, the gradients against the CPU, the
  # kernels' tests) and the q6_K QLoRA tests (Q6_K -> BF16 eight values a thread), no variable set
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout 150 python3 -m pytest tests/test_ops_backends.py \
    tests/test_qlora.py $PYTEST_ARGS --tb=long -k "in_chunks_of_key_blocks or 32_keys_a_warp or gradients_match_cpu \
    or warpgroup or bulk_dq or q6_K" 2>&1 | grep -vE "^(llama|load|print_info|common|init)" > "$OUT/defaults-test.txt"
  tail -8 "$OUT/defaults-test.txt"; echo "defaults took $SECONDS s"
  ;;
kbfix)
  # (carry as pending; LB_NO_TOOLS=1) one call after the 2026-12-06b H100 lease: patch 0106's CUDA test with its whole
  # output (it failed there with only its summary kept) and patch 0088's (its template had been shadowed), GRPO's TRL
  # parity with the BF16 run given our ratios (in the background: TRL's part runs on the CPU), then the 1B 16k and 8B
  # 2048 x 4 steps' kernels with the heads-fastest order and GGML_CUDA_FA_BACK_KB_CHUNK=auto while the call has time
  [ -d .device-t ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-t/*.whl
  start_8b_q4_k_m; start_1b_f32
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout 150 python3 -m pytest tests/test_ops_backends.py \
    $PYTEST_ARGS --tb=long -k "in_chunks_of_key_blocks or 32_keys_a_warp" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|init)" > "$OUT/kbfix-test.txt"
  tail -5 "$OUT/kbfix-test.txt"
  LLAMABIND_REFERENCE_PYTHON=python3 timeout 240 python3 -m pytest tests/test_train_grpo.py $PYTEST_ARGS -s \
    -k equal_trls 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" > "$OUT/kbfix-grpo.txt" &
  GRPO_PID=$!
  while [ ! -f $F8.done ] && [ ! -f $F8.fail ] && [ $SECONDS -lt 420 ]; do sleep 5; done
  for kc in ${LB_KB_STEPS:-0 auto}; do
    [ $SECONDS -lt 500 ] && [ -f $MODELS/llama-1b-f32.gguf ] && GGML_CUDA_FA_BACK_KB_CHUNK=$kc timeout 60 python3 \
      bench/kernel_times.py --model $MODELS/llama-1b-f32.gguf --mode bf16 --ctx 16384 --batch 1 --steps 3 \
      --trace /tmp/trace-k.json --out "$OUT/kc$kc-1b-16k.json" 2>&1 | grep -E "step_ms|^\| (flash|matrix|element)" \
      | tee -a "$OUT/kbchunk.txt"
    [ $SECONDS -lt 520 ] && [ -f $F8.done ] && GGML_CUDA_FA_BACK_KB_CHUNK=$kc timeout 60 python3 bench/kernel_times.py \
      --model $F8 --mode qlora --lora-rank 16 --lora-targets all --ctx 2048 --batch 4 --steps 3 \
      --trace /tmp/trace-k.json --out "$OUT/kc$kc-8b.json" 2>&1 | grep -E "step_ms|^\| (flash|matrix|element)" \
      | tee -a "$OUT/kbchunk.txt"
  done
  while kill -0 $GRPO_PID 2>/dev/null && [ $SECONDS -lt 570 ]; do sleep 2; done
  grep -E "GPU|passed|failed|Error|assert" "$OUT/kbfix-grpo.txt" | tail -20
  echo "kbfix took $SECONDS s"
  ;;
kbchunk)
  # (after pending, warm: its build and models; LB_NO_TOOLS=1) issue 84, patch 0106: the training backward's dK/dV blocks
  # dispatched in chunks of key blocks (GGML_CUDA_FA_BACK_KB_CHUNK) against the heads-fastest order: its CUDA test,
  # fa_harness --backward (each order against float64, then timed beside SDPA's flash backward; LB_KB_CTX, LB_KB_CHUNKS),
  # then the training steps' kernels in each order of LB_KB_STEPS (default 0 and auto): the 1B full fine-tune at 16,384 x 1
  # and the 8B QLoRA r16 all-linear at 2048 x 4 (bench/kernel_times.py --trace), each run its own process
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout 100 python3 -m pytest tests/test_ops_backends.py \
    $PYTEST_ARGS -k "in_chunks_of_key_blocks or flash_attention_gradients_match_cpu" 2>&1 | tail -5 \
    | tee "$OUT/kbchunk-test.txt"
  # (LB_KB_HARNESS=0: not, where pending ran it while it built)
  [ "${LB_KB_HARNESS:-1}" = 1 ] && timeout 220 python3 tests/device/fa_harness.py --backward --reps 10 \
    --ctx ${LB_KB_CTX:-8192,16384,32768} --chunks ${LB_KB_CHUNKS:-0,16,auto,max} 2>&1 | tail -40 \
    | tee "$OUT/harness-kbchunk.txt"
  for kc in ${LB_KB_STEPS:-0 auto}; do
    [ -f $MODELS/llama-1b-f32.gguf ] && GGML_CUDA_FA_BACK_KB_CHUNK=$kc timeout 100 python3 bench/kernel_times.py \
      --model $MODELS/llama-1b-f32.gguf --mode bf16 --ctx 16384 --batch 1 --steps 3 --trace /tmp/trace-k.json \
      --out "$OUT/kc$kc-1b-16k.json" 2>&1 | grep -E "step_ms|^\| (flash|matrix|element)" | tee -a "$OUT/kbchunk.txt"
    [ -f $F8.done ] && GGML_CUDA_FA_BACK_KB_CHUNK=$kc timeout 100 python3 bench/kernel_times.py --model $F8 --mode qlora \
      --lora-rank 16 --lora-targets all --ctx 2048 --batch 4 --steps 3 --trace /tmp/trace-k.json \
      --out "$OUT/kc$kc-8b.json" 2>&1 | grep -E "step_ms|^\| (flash|matrix|element)" | tee -a "$OUT/kbchunk.txt"
  done
  echo "kbchunk took $SECONDS s"
  ;;
bulkdq)
  # (after profiles, warm: its models) issue 84: GGML_CUDA_FA_BACK_BULK_DQ=1 (patch 0100's dK/dV kernel with dQ by bulk
  # reductions) against the defaults in training steps: the 1B full fine-tune at 16,384 x 1 (head size 64) and the 8B
  # QLoRA r16 all-linear at 8,192 x 1 (head size 128), bench/kernel_times.py --trace (step ms, kernels by kind)
  for bulk in 0 1; do
    GGML_CUDA_FA_BACK_BULK_DQ=$bulk timeout 200 python3 bench/kernel_times.py --model $MODELS/llama-1b-f32.gguf \
      --mode bf16 --ctx 16384 --batch 1 --steps 3 --trace /tmp/trace-b.json --out "$OUT/bulk$bulk-1b-16k.json" 2>&1 \
      | grep -E "step_ms|^\| (flash|matrix|element)" | tee -a "$OUT/bulkdq.txt"
    GGML_CUDA_FA_BACK_BULK_DQ=$bulk timeout 200 python3 bench/kernel_times.py --model $MODELS/llama-8b-q4_k_m-v128k.gguf \
      --mode qlora --lora-rank 16 --lora-targets all --ctx 8192 --batch 1 --steps 3 --trace /tmp/trace-b.json \
      --out "$OUT/bulk$bulk-8b-8k.json" 2>&1 | grep -E "step_ms|^\| (flash|matrix|element)" | tee -a "$OUT/bulkdq.txt"
  done
  ;;
profiles)
  # (after pending, warm: the build kept; LB_NO_TOOLS=1) where the time goes in the steps that miss their targets: the
  # 8B shape's QLoRA r16 all-linear step over Q4_K_M at 2048 x 4 (issue 88: 1.10x bnb, target 1.3x) and the 1B full
  # fine-tune at 16,384 x 1 (issue 84: 0.93x PyTorch), bench/train_profile.py's breakdown by phase and op (nodes one at a
  # time, a synchronization each), then docs/finetune.md's CLI example on the 8B Q4_K_M GGUF (qlora88's LB_88_CLI)
  f8=$F8
  # issue 84 first (while the models are written): the dK/dV kernel with dQ by bulk reductions (variant 4) against
  # the atomics one (3), against float64 and SDPA (nvcc on the unpacked tree)
  timeout 240 python3 tests/device/fa_harness.py --backward --variants 3,4 --reps 10 2>&1 | tail -40 \
    | tee "$OUT/harness-bulk-dq.txt" &
  start_8b_q4_k_m; start_1b_f32; wait  # (the models and the harness)
  # first the kernels as CUPTI times them in an unprofiled step (fusions on, no synchronization per node), then
  # train_profile's phases and ops (nodes one at a time); the 1B at 16k the same
  timeout ${LB_PROFILE_TIMEOUT:-200} python3 bench/kernel_times.py --model $f8 --mode qlora --lora-rank 16 \
    --lora-targets all --ctx 2048 --batch 4 --steps 3 --trace /tmp/trace-8b.json --out "$OUT/kernels-8b.json" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/kernels-8b.txt" | tail -45
  timeout ${LB_PROFILE_TIMEOUT:-200} python3 bench/kernel_times.py --model $MODELS/llama-1b-f32.gguf --mode bf16 \
    --ctx 16384 --batch 1 --steps 3 --trace /tmp/trace-1b.json --out "$OUT/kernels-1b-16k.json" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/kernels-1b-16k.txt" | tail -45
  timeout ${LB_PROFILE_TIMEOUT:-200} python3 bench/train_profile.py --qmodel $f8 --modes qlora --lora-rank 16 \
    --lora-targets all --configs ${LB_PROFILE_8B:-2048x4} -ngl 99 --threads 8 --steps 3 --profile-steps 1 --peak 989.5 \
    --out "$OUT/train-profile-8b.json" 2>&1 | tee "$OUT/train-profile-8b.txt" | tail -40
  timeout ${LB_PROFILE_TIMEOUT:-200} python3 bench/train_profile.py --model $MODELS/llama-1b-f32.gguf \
    --configs ${LB_PROFILE_1B:-16384x1} -ngl 99 --modes bf16 --threads 8 --steps 3 --profile-steps 1 --peak 989.5 \
    --out "$OUT/train-profile-1b.json" 2>&1 | tee "$OUT/train-profile-1b.txt" | tail -40
  [ -n "${LB_NO_CLI:-}" ] || LB_NO_TESTS=1 LB_NO_BENCH= LB_88=none LB_88_PREP=none LB_88_CLI=8b:q4_k_m bash "$0" qlora88
  ;;
grpo85)
  # (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf, .device-s and .device-t: TRL 1.16, datasets,
  # dill, multiprocess wheels; LB_NO_TOOLS=1) issue 85: the build, GRPO's tests on CUDA0 (bad input, the CLI;
  # the TRL parity runs on the CPU in CI), then bench/grpo.py on the 1B shape beside TRL's GRPOTrainer (LB_GRPO_ARGS)
  [ -d .device-t ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-t/*.whl
  [ -n "${LB_NO_BENCH:-}" ] || start_1b_f32
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-300} python3 -m pytest \
    tests/test_train_grpo.py $PYTEST_ARGS -s -k "${LB_GRPO_K:-refuses or cli}" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/grpo85-tests.log" | tail -15
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  wait
  python3 bench/grpo.py --model $MODELS/llama-1b-q4_0.gguf --trl python3 ${LB_GRPO_ARGS:-} \
    --out "$OUT/grpo-1b.json" 2>&1 | grep -vE "^(llama|load|print_info|common|main|ggml|init)" | tee "$OUT/grpo-raw.log" \
    | grep -E "^\||row done|TRL's speed|rror|^[0-9a-z.-]+ \(" | tee -a "$OUT/bench-grpo.txt"
  ;;
qlora)
  # (carry .device-b after build) issue 27: quantized OUT_PROD on CUDA0 against float64 and the CPU,
  # the QLoRA step's node placement, the gradient-accumulation tests on this GPU; then bench/train.py
  # on SmolLM2 (its Q4_1 file is the QLoRA base): llamabind beside PyTorch on the GPU (f32, tf32,
  # bf16 autocast, peft LoRA) at batch 1 and 8. (The PyTorch parity tests run on the CPU in CI:
  # cuBLAS's TF32 products move AdamW's steps here.)
  join_model
  t0=$SECONDS
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_qlora.py tests/test_train.py \
    $PYTEST_ARGS -k "qlora or validation_between or quantized_model or any_shape" 2>&1 | tee "$OUT/qlora-tests.log" | tail -15
  echo "qlora tests in $((SECONDS - t0)) s"
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  python3 bench/train.py -ngl 99 --threads 8 --chars ${LB_TRAIN_CHARS:-400000} --batch 8 --steps ${LB_TRAIN_STEPS:-48} \
    --torch python3 --torch-device cuda --torch-runs ${LB_TORCH_RUNS:-f32,tf32,bf16,lora} --out "$OUT/train-smollm2.json" \
    2>&1 | grep -vE "^(llama|load|print_info|common|main|ggml|init|srv|slot)" | tail -30 | tee "$OUT/bench-train-smollm2.txt"
  ;;
ctx)
  # (carry .device-b after build) issue 27: longer training contexts (n_ctx = n_batch = n_ubatch),
  # SmolLM2 full / LoRA / QLoRA at ctx 512-4096: tokens/s and peak GPU memory
  join_model
  for c in ${LB_CTXS:-512 1024 2048 4096}; do
    python3 bench/train.py -ngl 99 --threads 8 --ctx $c --chars 400000 --batch 1 --steps ${LB_CTX_STEPS:-8} \
      --runners full,lora,qlora --out "$OUT/train-ctx$c.json" 2>&1 | grep -E "^\| llamabind|^[A-Za-z].*ctx|rror" | tee -a "$OUT/bench-train-ctx.txt"
  done
  ;;
qlora1b)
  # (after qlora) the 1B llama shape (bench/make_model.py, Q4_0 QLoRA base, its F32 copy): llamabind LoRA,
  # QLoRA and full fine-tune beside PyTorch tf32 and peft LoRA, batch 1 and 8, peak GPU memory
  python3 bench/train.py -ngl 99 --threads 8 --size 1b --chars 200000 --batch 8 --steps ${LB_TRAIN_STEPS_1B:-12} \
    --runners ${LB_1B_RUNNERS:-lora,qlora,full} --torch python3 --torch-device cuda --torch-runs ${LB_TORCH_RUNS_1B:-tf32,lora} \
    --out "$OUT/train-1b.json" 2>&1 | grep -vE "^(llama|load|print_info|common|main|ggml|init)" | tail -30 | tee "$OUT/bench-train-1b.txt"
  ;;
build)
  cp .device/smollm2.part-a .device/tokenizer.gguf /tmp/
  [ -n "${LB_NO_MODELS:-}" ] || start_models
  ;;
multimodal)
  # (carry .device-b after build) issue 29 on CUDA0: tests/test_multimodal.py with the text model and the
  # projector's encoder offloaded (llama-mtmd-cli from the same build as the reference), then
  # bench/multimodal.py: image prefill beside llama-mtmd-cli, SigLIP-base- and Gemma-3-sized projectors
  join_model
  t0=$SECONDS
  LLAMABIND_REQUIRE_GPU=1 LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests/test_multimodal.py $PYTEST_ARGS 2>&1 \
    | tee "$OUT/multimodal-tests.log" | tail -20
  echo "multimodal tests in $((SECONDS - t0)) s"
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  for size in base real; do
    python3 bench/multimodal.py --size $size --rounds ${LB_ROUNDS:-5} --threads 8 -ngl 99 --tag h100-$size 2>&1 \
      | grep -vE "^(llama|load|print_info|common|main|ggml|init|clip|WARN|warmup|alloc)" | tail -12 | tee "$OUT/bench-multimodal-$size.txt"
  done
  cp bench/results/multimodal-h100-*.json "$OUT/"
  ;;
opsarrays)
  t0=$SECONDS
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_OPS_CHECK_OUT="$OUT/ops-check.json" LLAMABIND_REQUIRE_GPU=1 \
    python3 -m pytest tests/test_ops.py tests/test_ops_arrays.py tests/test_ops_backends.py $PYTEST_ARGS 2>&1 \
    | tee "$OUT/ops-tests.log" | tail -30
  echo "op tests in $((SECONDS - t0)) s"
  python3 bench/ops.py --rounds ${LB_ROUNDS:-5} --out "$OUT/ops.json" 2>&1 | tee "$OUT/ops-bench.txt"
  ;;
e2e)
  # (carry .device-b after build) generation tests with the model fully offloaded (backend sampling
  # on by default there), then bench/e2e.py on each model: decode alone, llama-bench tg,
  # llama-completion, and llamabind's loop taken apart with CPU and backend sampling
  join_model
  cp .device-b/smollm2.part-b /tmp/
  t0=$SECONDS
  LLAMABIND_REQUIRE_GPU=1 LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests/test_generation.py tests/test_chat.py $PYTEST_ARGS \
    --deselect tests/test_chat.py::test_tool_call_parsing_with_a_tool_template 2>&1 | tee "$OUT/generation-tests.log" | tail -15
  echo "generation tests in $((SECONDS - t0)) s"
  # greedy generations repeated on one context (the prompt's KV reused but for its last token),
  # with the sampler chain on the CPU and in the decode graph
  python3 - $LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf <<'PY'
import sys, llamabind
m = llamabind.Model(sys.argv[1])
for bs in (False, True):
    runs = [m.generate("The three primary colors are", max_tokens=24, temperature=0, backend_sampling=bs).tokens for _ in range(3)]
    with m.context(n_ctx=256) as c:  # a fresh context each time: no prefix reuse
        fresh = [c.generate("The three primary colors are", max_tokens=24, temperature=0, backend_sampling=bs).tokens
                 for _ in range(1)]
    print(f"backend_sampling={bs}: repeated equal {runs[0] == runs[1] == runs[2]}, first == fresh context {runs[0] == fresh[0]}")
    print("  ", runs[0][:14], runs[1][:14])
PY
  until [ -f $MODELS/done ]; do sleep 5; done; cat $MODELS/make.log | tr '\r' '\n' | grep wrote
  # LB_SAMPLER_COST: tests/device/sampler_cost.py on these 1B types first (the in-graph sampler's us/token)
  for t in ${LB_SAMPLER_COST:-}; do
    python3 tests/device/sampler_cost.py $MODELS/llama-1b-$t.gguf --rounds 7 --out "$OUT/sampler-cost-1b-$t.json" 2>&1 | tail -6
  done
  # LB_E2E_MODELS: which models (default: micro, SmolLM2, every 1B type)
  for m in ${LB_E2E_MODELS:-$MODELS/llama-micro-f16.gguf $LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
           $(ls $MODELS/llama-1b-*.gguf)}; do
    python3 bench/e2e.py --model $m -ngl 99 --threads 8 --rounds ${LB_ROUNDS:-3} --out "$OUT/e2e-$(basename $m .gguf).json" 2>&1 | grep -v "^round"
  done
  ;;
server)
  join_model
  t0=$SECONDS
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests/test_server.py tests/test_server_fuzz.py $PYTEST_ARGS --durations=5 \
    2>&1 | tee "$OUT/server-tests.log" | tail -30
  echo "server tests in $((SECONDS - t0)) s"
  [ -n "${LB_NO_BENCH:-}" ] && exit 0
  python3 bench/server.py -ngl 99 --threads 8 --parallel ${LB_PARALLEL:-8} --ctx ${LB_CTX:-8192} --rounds ${LB_ROUNDS:-3} \
    --requests 8 --max-tokens 128 --clients ${LB_CLIENTS:-1,4,8} --out "$OUT/server-bench.json" 2>&1 | tail -12
  ;;
ops)
  cp .device/smollm2.part-a .device/tokenizer.gguf /tmp/
  start_models
  python3 bench/gpu_bandwidth.py --out "$OUT/bandwidth.json"
  cp "$OUT/bandwidth.json" /tmp/bandwidth.json
  t0=$SECONDS
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_OPS_CHECK_OUT="$OUT/ops-check.json" LLAMABIND_REQUIRE_GPU=1 \
    LLAMABIND_REFERENCE_PYTHON=python3 python3 -m pytest tests/test_ops.py tests/test_ops_grad.py tests/test_ops_errors.py \
    tests/test_ops_backends.py tests/test_patches.py tests/test_grad_compositions.py $PYTEST_ARGS \
    --deselect tests/test_patches.py::test_prompt_batch_on_the_cpu_amx_path 2>&1 | tee "$OUT/ops-tests.log" | tail -60
  echo "op tests in $((SECONDS - t0)) s"
  ;;
models)
  join_model
  t0=$SECONDS
  LLAMABIND_REQUIRE_GPU=1 LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests $PYTEST_ARGS "${SUITE_EXCLUDES[@]}" --durations=10 2>&1 | tee "$OUT/tests.log" | tail -80
  echo "test suite in $((SECONDS - t0)) s"
  ;&
rss)
  f=$LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  # where host memory grows over CUDA load/generate/close cycles: binding vs llama.h alone, heap vs mappings
  t0=$SECONDS
  python3 tests/device/rss_probe.py $f --cycles 200 --build-dir $(ls -d build/cp3*-linux_x86_64 | head -1) --out "$OUT/rss-probe.json"
  echo "RSS probe in $((SECONDS - t0)) s"
  ;;
train)
  # fine-tuning on CUDA (full offload): tests/test_train.py without the PyTorch parity and the notebook
  # (transformers and nbformat are not in the image), then bench/train.py with -ngl 99 (no PyTorch row)
  join_model
  t0=$SECONDS
  LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests/test_train.py $PYTEST_ARGS -s --durations=10 \
    --deselect tests/test_train.py::test_matches_pytorch --deselect tests/test_train.py::test_lora_matches_pytorch \
    --deselect tests/test_train.py::test_finetune_notebook_executes 2>&1 | tee "$OUT/train-tests.log" | tail -40
  echo "train tests in $((SECONDS - t0)) s"
  ;&
trainbench)
  # llama-finetune times its epoch in whole seconds: on the GPU the text must be long (default 1.2 M
  # characters, the build docs repeated: ~40 s per runner); QLoRA's OUT_PROD of Q4_1 runs on the CPU
  # there (no CUDA kernel), so it is left out unless LB_TRAIN_RUNNERS asks for it
  python3 bench/train.py -ngl 99 --threads 8 --chars ${LB_TRAIN_CHARS:-1200000} --runners ${LB_TRAIN_RUNNERS:-full,lora} \
    2>&1 | tee "$OUT/bench-train.log" | tail -12
  cp bench/results/train-*.json "$OUT/" 2>/dev/null
  ;;
cost)
  # per-call cost of a single-token decode: llama-bench, llama.h alone (settings one at a time), llamabind
  until [ -f $MODELS/llama-micro-f16.gguf ]; do sleep 2; done; sleep 2
  python3 tests/device/decode_cost.py $MODELS/llama-micro-f16.gguf --build-dir $(ls -d build/cp3*-linux_x86_64 | head -1) \
    --out "$OUT/decode-cost.json"
  ;;
leak)
  # the RSS test alone, without pytest's log capture, and after the multi-GPU tests; then the two
  # test files changed for GPU builds (multi-GPU tensor split, RPC against CPU references)
  f=$LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f $f ] || { mkdir -p "$(dirname $f)"; cat /tmp/smollm2.part-a .device-b/smollm2.part-b > $f; }
  python3 tests/device/split_nmse.py $f --out "$OUT/split-nmse.json" 2>&1 | grep NMSE
  [ -n "${LB_LEAK_FULL:-}" ] && { LLAMABIND_REQUIRE_GPU=1 LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests $PYTEST_ARGS \
    "${SUITE_EXCLUDES[@]}" 2>&1 | tee "$OUT/tests.log" | grep -E "^E  |passed|failed" | cut -c1-400 | tail -40; exit; }
  T=tests/test_reliability.py::test_no_leak_over_load_generate_close_cycles
  for extra in "" "-p no:logging" "tests/test_multi_gpu.py"; do
    echo "== $T $extra"; python3 -m pytest $PYTEST_ARGS $extra $T 2>&1 | grep -E "RSS grew|passed|failed" | cut -c1-600
  done
  LLAMABIND_REQUIRE_GPU=1 python3 -m pytest $PYTEST_ARGS tests/test_multi_gpu.py tests/test_rpc.py 2>&1 | tee "$OUT/tests-multi-gpu-rpc.log" | grep -E "^E  |passed|failed" | head -40
  ;;
vulkan|vulkanmodels|vulkanqlora)
  # Debian 12's Vulkan SDK pieces (carried .debs: glslc 2023.2, libshaderc1, libvulkan 1.3.239 with
  # headers, spirv-headers) unpacked into /tmp/vk, the GL dispatch libraries the NVIDIA ICD loads into /
  VK=/tmp/vk
  if [ ! -x $VK/usr/bin/glslc ]; then
    for d in .device-v/debs/{glslc,libshaderc1,libvulkan1,libvulkan-dev,spirv-headers}_*.deb; do dpkg -x $d $VK; done
    for d in .device-v/debs/lib{glvnd0,glx0,gl1,egl1,opengl0,gles2}_*.deb; do dpkg -x $d /; done
    ldconfig
  fi
  export PATH=$VK/usr/bin:$PATH LD_LIBRARY_PATH=$VK/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  VK_DRIVER_FILES=$(ls /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
    /etc/vulkan/icd.d/nvidia_icd.json 2>/dev/null | head -1)
  export VK_DRIVER_FILES
  echo "Vulkan ICD: $VK_DRIVER_FILES"
  CUDA_BIN=$PWD/build/lb-cuda/llamabind/bin
  if [ ! -f build/lb-vulkan/.built ]; then
    t0=$SECONDS
    CMAKE_ARGS="-DGGML_VULKAN=ON -DCMAKE_PREFIX_PATH=$VK/usr -DVulkan_INCLUDE_DIR=$VK/usr/include -DVulkan_LIBRARY=$VK/usr/lib/x86_64-linux-gnu/libvulkan.so -DVulkan_GLSLC_EXECUTABLE=$VK/usr/bin/glslc" \
      python3 -m pip install -v --no-build-isolation --no-deps -Cbuild-dir=build/vulkan --target build/lb-vulkan . \
      > "$OUT/build-vulkan.log" 2>&1 && touch build/lb-vulkan/.built
    echo "Vulkan build rc=$? in $((SECONDS - t0)) s ($(nproc) jobs)"
    grep -E "not supported by glslc|GL_.*supported" "$OUT/build-vulkan.log" | sort -u | head -12
  fi
  export PYTHONPATH=$PWD/build/lb-vulkan:/tmp/site
  python3 -m llamabind info | grep -iE "vulkan|device|GGML_VULKAN" | head -8
  if [ $phase = vulkanqlora ]; then
    # issue 27 on Vulkan (patch 0026): OUT_PROD of every block type on Vulkan0 against float64 and the
    # CPU, the QLoRA step's node placement (SmolLM2 Q4_1 and the tiny Q4_0 llama), then bench/train.py
    # on Vulkan0: full, LoRA over F32 and QLoRA over the Q4_1 file, batch 1 and 8, peak GPU memory
    [ -f .device-b/smollm2.part-b ] && join_model
    t0=$SECONDS
    LLAMABIND_TEST_BACKEND=vulkan LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_qlora.py $PYTEST_ARGS 2>&1 \
      | tee "$OUT/qlora-tests-vulkan.log" | tail -15
    echo "Vulkan qlora tests in $((SECONDS - t0)) s"
    [ -n "${LB_NO_BENCH:-}" ] && exit 0
    python3 bench/train.py -ngl 99 --threads 8 --chars ${LB_TRAIN_CHARS:-400000} --batch 8 --steps ${LB_TRAIN_STEPS:-24} \
      --runners ${LB_VK_RUNNERS:-full,lora,qlora} --out "$OUT/train-vulkan-smollm2.json" 2>&1 \
      | grep -vE "^(llama|load|print_info|common|main|ggml|init)" | tail -20 | tee "$OUT/bench-train-vulkan.txt"
  elif [ $phase = vulkan ]; then
    t0=$SECONDS
    LLAMABIND_TEST_BACKEND=vulkan LLAMABIND_OPS_CHECK_OUT="$OUT/ops-check-vulkan.json" LLAMABIND_REQUIRE_GPU=1 \
      LLAMABIND_REFERENCE_PYTHON=python3 python3 -m pytest tests/test_ops.py tests/test_ops_grad.py tests/test_ops_errors.py \
      tests/test_ops_backends.py tests/test_grad_compositions.py $PYTEST_ARGS 2>&1 | tee "$OUT/ops-tests-vulkan.log" | tail -40
    echo "Vulkan op tests in $((SECONDS - t0)) s"
    [ -n "${LB_NO_CUDA:-}" ] || until [ -f $MODELS/done ]; do sleep 5; done
    for m in $([ -f $MODELS/done ] && ls $MODELS/llama-1b-q4_0.gguf); do
      python3 bench/e2e.py --model $m -ngl 99 --threads 8 --rounds 3 --out "$OUT/e2e-vulkan-$(basename $m .gguf).json" 2>&1 | grep -v "^round"
    done
  else
    f=$LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f .device-b/smollm2.part-b ] && join_model
    [ -f $f ] || { mkdir -p "$(dirname $f)"; cat /tmp/smollm2.part-a /tmp/smollm2.part-b > $f; }
    t0=$SECONDS
    LLAMABIND_REQUIRE_GPU=1 LLAMABIND_REQUIRE_TOOLS=1 python3 -m pytest tests/test_generation.py tests/test_chat.py \
      tests/test_state.py $PYTEST_ARGS \
      --deselect tests/test_chat.py::test_tool_call_parsing_with_a_tool_template 2>&1 | tee "$OUT/model-tests-vulkan.log" | tail -25
    echo "Vulkan model tests in $((SECONDS - t0)) s"
    [ -n "${LB_NO_CUDA:-}" ] && exit 0  # no CUDA build to compare with
    # pp512/tg128: llamabind on Vulkan vs llama-bench on Vulkan, then llama-bench Vulkan vs CUDA
    for m in $f $MODELS/llama-1b-q4_0.gguf $MODELS/llama-1b-q8_0.gguf $MODELS/llama-1b-f16.gguf; do
      name=$(basename $m .gguf)
      python3 bench/generation.py --model $m -ngl 99 --threads 8 --rounds 3 --reps 10 --llama-cpp-python /nonexistent \
        --out "$OUT/gen-vulkan-$name.json" 2>&1 | grep -E "^\| |wrote"
      for r in 1 2 3; do
        for b in vulkan cuda; do
          exe=$PWD/build/lb-vulkan/llamabind/bin/llama-bench; [ $b = cuda ] && exe=$CUDA_BIN/llama-bench
          echo "{\"round\": $r, \"backend\": \"$b\", \"model\": \"$name\", \"llama_bench\": $($exe -m $m -ngl 99 -t 8 -r 10 -o json 2>/dev/null | tr -d '\n')}"
        done
      done >> "$OUT/vulkan-vs-cuda.jsonl"
    done
    python3 - "$OUT/vulkan-vs-cuda.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    for t in r["llama_bench"]:
        test = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}"
        by.setdefault((r["model"], test), {}).setdefault(r["backend"], []).append(t["avg_ts"])
print("| model | test | Vulkan t/s | CUDA t/s | Vulkan / CUDA |")
print("|---|---|---|---|---|")
for (m, test), d in by.items():
    v, c = statistics.median(d["vulkan"]), statistics.median(d["cuda"])
    print(f"| {m} | {test} | {v:.1f} | {c:.1f} | {v / c:.3f} |")
PY
  fi
  ;;
train42)
  cp .device/smollm2.part-a .device/tokenizer.gguf /tmp/
  mkdir -p $MODELS
  for sz in 1b 135m; do
    python3 bench/make_model.py --size $sz --type q4_0 -o $MODELS/llama-$sz-q4_0.gguf --tokenizer-from /tmp/tokenizer.gguf 2>&1 | tail -1
    python3 -c "from llamabind import train; train.to_f32('$MODELS/llama-$sz-q4_0.gguf', '$MODELS/llama-$sz-f32.gguf')"
  done
  t0=$SECONDS
  # the backward kernels of the training step on CUDA0 against the CPU (patch 0034) and finite differences
  [ -n "${LB_NO_KERNEL_TESTS:-}" ] || LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 python3 -m pytest \
    tests/test_ops_backends.py tests/test_ops_grad.py $PYTEST_ARGS -k "${LB_KERNEL_K:-gradients or get_rows or repeat or soft_max or cross_entropy}" 2>&1 \
    | tee "$OUT/train42-kernel-tests.log" | tail -4
  # LB_MODES: pin, now (full fine-tunes), lora, qlora (LoRA r8 over the F32 copy or the Q4_0 original)
  python3 bench/train_profile.py --model $MODELS/llama-1b-f32.gguf --qmodel $MODELS/llama-1b-q4_0.gguf \
    --configs ${LB_PROFILE_1B:-256x8,2048x1} -ngl 99 \
    --modes ${LB_MODES:-pin,now} --threads 8 --steps 5 --profile-steps 2 --out "$OUT/train-profile-1b.json" 2>&1 \
    | tee "$OUT/train-profile-1b.txt" | tail -70
  [ -n "${LB_PROFILE_135M-256x8}" ] && python3 bench/train_profile.py --model $MODELS/llama-135m-f32.gguf \
    --qmodel $MODELS/llama-135m-q4_0.gguf \
    --configs ${LB_PROFILE_135M:-256x8} -ngl 99 --modes ${LB_MODES:-pin,now} --threads 8 --steps 5 --profile-steps 2 \
    --out "$OUT/train-profile-135m.json" 2>&1 | tee "$OUT/train-profile-135m.txt" | tail -40
  echo "kernel tests and profiles in $((SECONDS - t0)) s"
  ;;
amx)
  # (LB_NO_CUDA=1) the CPU test suite on this machine's CPU, an Intel Xeon with AMX_INT8, where ggml-cpu takes its AMX
  # kernels for the quantized products (CI's AMX hosts; a cold CI of main failed on one on 2026-12-03). Two calls:
  # the tree and a carry hold 64 MiB: SmolLM2 travels in .device-m1 (its first 50,000,000 bytes) and .device-m2 (the
  # rest, with the wheels the image lacks for the server tests: openai, uvicorn, starlette, pydantic and theirs).
  # LB_AMX_STEP=build (carry .device/llama.cpp.tar.xz, .device/whl, .device-m1): a native CPU-only build (tools off: the
  # tests that need them skip) into build/lb-cpu, the first part kept in /tmp; LB_AMX_STEP=test (carry .device-m2):
  # SmolLM2 joined, the suite less SUITE_EXCLUDES (or LB_AMX_FILES) in LB_AMX_JOBS (default 8) shards of the test
  # files (round robin), each a pytest on two cores of its own (taskset: CI's 2-core machine; pytest-xdist over all 16
  # cores ran every test's threads on every core and took past 540 s, 2026-12-04), a file that fails to collect not
  # stopping its shard, each printing its failures (-rfE) when it ends or when LB_AMX_TIMEOUT s interrupt it (SIGINT:
  # pytest still prints its summary); the reference Python is this image's (torch, transformers)
  export PYTHONPATH=$PWD/build/lb-cpu:/tmp/site
  [ -d .device-m2 ] && cp .device-m2/smollm2.part-b /tmp/ && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site .device-m2/*.whl
  if [ "${LB_AMX_STEP:-test}" = build ]; then
    cp .device-m1/smollm2.part-a /tmp/
    t0=$SECONDS
    CMAKE_ARGS="-DGGML_CUDA=OFF" LLAMABIND_BUILD_TOOLS=OFF CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -v \
      --no-build-isolation --no-deps --upgrade --target build/lb-cpu . > "$OUT/build-cpu.log" 2>&1
    echo "CPU build rc=$? in $((SECONDS - t0)) s"; python3 -m llamabind info | grep -E "system|backends"
  else
    join_model
    t0=$SECONDS
    AMX_EXCLUDES=()  # SUITE_EXCLUDES less its --ignore of the op tests
    for a in "${SUITE_EXCLUDES[@]}"; do [[ "$a" == --ignore=tests/test_ops*.py ]] || AMX_EXCLUDES+=("$a"); done
    n=${LB_AMX_JOBS:-8}; i=0; rm -f /tmp/amx-shard*
    # the op tests too (the CPU's own kernels: on a Xeon with AMX also AVX512_FP16, whose half arithmetic a native
    # build takes for ggml's F16 vector ops, where AVX2 and Zen 4 hosts convert to float: the first suspects)
    for f in ${LB_AMX_FILES:-$(ls tests/test_*.py | grep -vE "test_(embeddings|vendor|portable)\.py")}; do
      echo $f >> /tmp/amx-shard$((i % n)); i=$((i + 1))
    done
    for k in $(seq 0 $((n - 1))); do
      CUDA_VISIBLE_DEVICES= LLAMABIND_REFERENCE_PYTHON=python3 taskset -c $((2 * k)),$((2 * k + 1)) \
        timeout -s INT -k 15 ${LB_AMX_TIMEOUT:-540} python3 -m pytest $(cat /tmp/amx-shard$k) $PYTEST_ARGS -rfE \
        --continue-on-collection-errors -o faulthandler_timeout=400 "${AMX_EXCLUDES[@]}" \
        > "$OUT/amx-shard$k.log" 2>&1 &
    done
    wait
    grep -hE "^(FAILED|ERROR) |passed|failed|^Timeout" "$OUT"/amx-shard*.log | tail -40
    echo "AMX suite in $((SECONDS - t0)) s"
  fi
  ;;
pack84)
  # (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf and .device-s; LB_NO_TOOLS=1) issue 84: the
  # build, the random-weight 1B (Q4_0 and its F32 copy) written in the background, the packing tests on CUDA0
  # (tests/test_train_pack.py, patch 0096), then bench/pack.py (packed against padded windows of the standard library's
  # modules) on the F32 1B at LB_PACK_CTX (default "32768 4096")
  start_1b_f32
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-240} python3 -m pytest tests/test_train_pack.py \
    $PYTEST_ARGS -s 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/pack84-tests.log" | tail -15
  wait; tail -2 $MODELS/make.log
  for c in ${LB_PACK_CTX:-32768 4096}; do
    python3 bench/pack.py --model $MODELS/llama-1b-f32.gguf --ctx $c --steps ${LB_PACK_STEPS:-3} --out "$OUT/pack-1b-ctx$c.json" \
      2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee -a "$OUT/pack84-bench.txt" | tail -5
  done
  ;;
chunk84)
  # (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf and .device-s; LB_NO_TOOLS=1) issue 84, item 3:
  # the build, the random-weight 1B in the background, the chunked cross-entropy's tests on CUDA0 (patch 0098), then
  # bench/pack.py's packed windows of the F32 1B at each LB_CHUNK_RUNS entry CTX:LOSS_CHUNK_TOKENS[:gc] (default
  # "32768:0 32768:auto": the logits whole and chunked; gc: gradient checkpointing), nvidia-smi's peak beside each
  start_1b_f32
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-240} python3 -m pytest tests/test_train_graphs.py \
    -k "chunk" $PYTEST_ARGS -s 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/chunk84-tests.log" | tail -15
  wait; tail -2 $MODELS/make.log
  for run in ${LB_CHUNK_RUNS:-32768:0 32768:auto}; do
    IFS=: read -r c n gc <<< "$run"
    args="--model $MODELS/llama-1b-f32.gguf --ctx $c --steps ${LB_PACK_STEPS:-3} --modes packed"
    [ "$n" = auto ] || args="$args --loss-chunk-tokens $n"
    [ -z "$gc" ] || args="$args --gradient-checkpointing"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/smi-$c-$n$gc.txt" & smi=$!
    timeout ${LB_CHUNK_TIMEOUT:-400} python3 bench/pack.py $args --out "$OUT/pack-1b-ctx$c-chunk$n$gc.json" 2>&1 \
      | grep -vE "^(llama|load|print_info|common|ggml|init)" | sed "s/^/$run /" | tee -a "$OUT/chunk84-bench.txt" | tail -4
    kill $smi; echo "$run peak GPU MiB $(sort -n "$OUT/smi-$c-$n$gc.txt" | tail -1)" | tee -a "$OUT/chunk84-bench.txt"
  done
  ;;
wgmma84)
  # (as chunk84) issue 84, item 2: the build (90 compiled as 90a: patch 0099), the random-weight 1B in the background,
  # the flash-attention tests on CUDA0 (the training forward on warpgroup products and the float64 / CPU checks), then
  # (LB_NO_TESTS=1 on the warm machine: the bench alone) bench/train.py's full fine-tune rows LB_BENCH (default
  # "1b:16384:1 1b:32768:1") with PyTorch bf16 beside them
  start_1b_f32
  if [ -z "${LB_NO_TESTS:-}" ]; then
    LLAMABIND_REQUIRE_GPU=1 timeout ${LB_TEST_TIMEOUT:-300} python3 -m pytest tests/test_ops_backends.py -k "flash_attention" \
      $PYTEST_ARGS 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/wgmma84-tests.log" | tail -15
  fi
  wait; tail -2 $MODELS/make.log
  [ -n "${LB_NO_BENCH:-}" ] || LB_BENCH=${LB_BENCH:-1b:16384:1 1b:32768:1} LB_RUNNERS=${LB_RUNNERS:-full} \
    LB_TORCH_RUNS=${LB_TORCH_RUNS:-bf16} LB_STEPS=${LB_STEPS:-4} \
    LB_CHARS=${LB_CHARS:-1200000} bench_settings "GGML_CUDA_FA_FWD_WGMMA=1" ${LB_WGMMA_OFF:+"GGML_CUDA_FA_FWD_WGMMA=0"}
  ;;
attn84)
  # issue 84, item 1 (after pack84 or fa56: the build): the attention at long contexts, batch 1, the 1B (32 (8) heads x 64),
  # 8B (32 (8) x 128) and 70B (64 (8) x 128) shapes: PyTorch SDPA's bf16 flash forward and backward (CUDA events) at
  # LB_ATTN_CTX (default 8192 16384 32768 65536), and llamabind's kernels (ops.grad of flash_attn_ext) each timed by
  # Nsight Compute (gpu__time_duration; --clock-control none: at the clocks SDPA runs at, where 2026-12-04's run had
  # ncu's base clock) up to LB_ATTN_NCU_MAX tokens (default 32768: the F16 mask of 64k is 8 GiB)
  for shape in ${LB_ATTN_SHAPES:-32:8:64 32:8:128 64:8:128}; do
    IFS=: read -r h hk d <<< "$shape"
    for n in ${LB_ATTN_CTX:-8192 16384 32768 65536}; do
      args="--batch 1 --heads $h --kv-heads $hk --ctx $n --head-dim $d"
      python3 bench/attention_backward.py $args --runners torch --reps 5 --out "$OUT/sdpa-$h-$hk-$d-$n.json" 2>&1 | grep "PyTorch" \
        | tee -a "$OUT/attn84-sdpa.txt"
      [ "$n" -le "${LB_ATTN_NCU_MAX:-32768}" ] || continue
      ncu --clock-control none -k regex:"fa_|flash" --metrics gpu__time_duration.sum --csv python3 bench/attention_backward.py $args \
        --runners llamabind --reps 1 > "$OUT/ncu-$h-$hk-$d-$n.csv" 2>&1
      echo "$h $hk $d $n: $(grep -E '^"[0-9]' "$OUT/ncu-$h-$hk-$d-$n.csv" | awk -F'","' '{print $5"="$NF}' | tr -d '"' | tr '\n' ' ')" \
        | tee -a "$OUT/attn84-ncu.txt"
    done
  done
  ;;
pref83)
  # (carry .device/llama.cpp.tar.xz, .device/whl, .device/tokenizer.gguf and .device-s; LB_NO_TOOLS=1) issue 83: the
  # build, SmolLM2's first blocks in F32, then where DPO's reference log-probabilities part from the policy's at step 1
  # (tests/device/pref_ref_diag.py: one process per switch, LB_DIAG_SETTINGS), then the ln 2 tests on CUDA0;
  # LB_PREF83_1B=1: the diagnosis on the random-weight 1B shape too (LB_DIAG_1B settings, LoRA)
  f32=/tmp/smollm2-f32-4l.gguf
  [ -f $f32 ] || python3 -c "from llamabind import train; train.to_f32('/tmp/smollm2-4l.gguf', '$f32')"
  timeout ${LB_DIAG_TIMEOUT:-300} python3 tests/device/pref_ref_diag.py $f32 --ctx 512 --pairs 8 \
    ${LB_DIAG_SETTINGS:+--settings "$LB_DIAG_SETTINGS"} 2>&1 | tee -a "$OUT/pref83-diag.txt"
  if [ -n "${LB_PREF83_1B:-}" ]; then
    cp .device/tokenizer.gguf /tmp/ 2>/dev/null; mkdir -p $MODELS
    [ -f $MODELS/llama-1b-f32.gguf ] || { python3 bench/make_model.py --size 1b --type q4_0 -o $MODELS/llama-1b-q4_0.gguf \
      --tokenizer-from /tmp/tokenizer.gguf 2>&1 | tail -1; python3 -c "from llamabind import train; \
      train.to_f32('$MODELS/llama-1b-q4_0.gguf', '$MODELS/llama-1b-f32.gguf')"; }
    timeout ${LB_DIAG_TIMEOUT:-300} python3 tests/device/pref_ref_diag.py $MODELS/llama-1b-f32.gguf --ctx 512 --pairs 8 \
      --kinds ${LB_DIAG_KINDS:-lora} --settings "${LB_DIAG_1B:-default:}" 2>&1 | sed 's/^/1b /' | tee -a "$OUT/pref83-diag.txt"
  fi
  [ -n "${LB_NO_TESTS:-}" ] || LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_train_preference.py $PYTEST_ARGS -s \
    -k "${LB_PREF83_K:-ln_2}" 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/pref83-tests.log" | tail -12
  ;;
fa56)
  # issue 56, first call (LB_NO_TOOLS=1): the build with the flash-attention kernels, random-weight 1B llamas
  # (Q4_0 and F32) in /tmp/lb-models, then the new kernels on CUDA0: FLASH_ATTN_BACK against the CPU (patch
  # 0051), the gradient compositions (PyTorch float64 where a reference Python is given), the BF16 products
  # (patch 0051) through the QLoRA/out_prod tests
  cp .device/tokenizer.gguf /tmp/
  mkdir -p $MODELS
  [ -f $MODELS/llama-1b-f32.gguf ] || { python3 bench/make_model.py --size 1b --type q4_0 -o $MODELS/llama-1b-q4_0.gguf \
    --tokenizer-from /tmp/tokenizer.gguf 2>&1 | tail -1; python3 -c "from llamabind import train; \
    train.to_f32('$MODELS/llama-1b-q4_0.gguf', '$MODELS/llama-1b-f32.gguf')"; }
  t0=$SECONDS
  # (LB_KERNEL_TIMEOUT, default 240 s: the rows of a later command in the same call still run after a hang)
  LLAMABIND_TEST_BACKEND=cuda LLAMABIND_REQUIRE_GPU=1 timeout ${LB_KERNEL_TIMEOUT:-240} python3 -m pytest tests/test_ops_backends.py tests/test_ops_grad.py \
    tests/test_qlora.py $PYTEST_ARGS -k "${LB_KERNEL_K:-flash or gradients or out_prod or many_columns}" 2>&1 \
    | tee "$OUT/fa56-kernel-tests.log" | tail -12
  echo "kernel tests in $((SECONDS - t0)) s"
  # LB_TRAIN_K: tests/test_train_graphs.py on CUDA0, e.g. "bf16" (SmolLM2's first blocks: carry .device-s beside
  # .device) or "kept_batches" (its tiny random-weight llama takes SmolLM2's tokenizer, so SmolLM2 must be joined
  # first: .device-a's part in /tmp, then .device-b, see train42b)
  [ -n "${LB_TRAIN_K:-}" ] && LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_train_graphs.py $PYTEST_ARGS \
    -k "$LB_TRAIN_K" 2>&1 | tee "$OUT/fa56-train-tests.log" | tail -6
  ;;
fa56profile)
  # issue 56: the 1B step's breakdown (bench/train_profile.py) before (F32 products, composed attention: "now")
  # and after (the defaults: BF16 products, flash attention: "bf16"), LB_PROFILE_1B configs, in one run
  python3 bench/train_profile.py --model $MODELS/llama-1b-f32.gguf --qmodel $MODELS/llama-1b-q4_0.gguf \
    --configs ${LB_PROFILE_1B:-2048x4,4096x1} -ngl 99 --modes ${LB_MODES:-now,bf16} --threads 8 --steps 4 \
    --profile-steps ${LB_PROFILE_STEPS:-1} --peak 989.5 --out "$OUT/train-profile-1b.json" 2>&1 \
    | tee "$OUT/train-profile-1b.txt" | tail -80
  ;;
fa56ncu)
  # issue 56 (after the build; LB_NO_TOOLS=1): FLASH_ATTN_BACK's kernels under Nsight Compute (duration, SM and memory
  # throughput, occupancy, warp stalls) with and without cp.async pipelining, and PyTorch SDPA's bf16 backward at the
  # same shape (bench/attention_backward.py, default 4 x 32 (8) x 2048 x 64)
  # LB_FA_DET (default "0 1"): GGML_CUDA_FA_BACK_DETERMINISTIC, dQ by atomics in the dK/dV kernel (0, patch 0065) or
  # the fixed-order pair (1); LB_PIPES (default "1 0"): GGML_CUDA_FA_BACK_PIPE; LB_SPLITS (default "1"):
  # GGML_CUDA_FA_BACK_SPLIT (patch 0067: dK/dV blocks per query head, 1, or per K/V head, 0)
  python3 bench/attention_backward.py ${LB_ATTN_ARGS:-} --out "$OUT/attention-backward.json" 2>&1 | tee "$OUT/attention-backward.txt"
  for det in ${LB_FA_DET:-0 1}; do
  for p in ${LB_PIPES:-1 0}; do
  for sp in ${LB_SPLITS:-1}; do
    GGML_CUDA_FA_BACK_DETERMINISTIC=$det GGML_CUDA_FA_BACK_PIPE=$p GGML_CUDA_FA_BACK_SPLIT=$sp ncu -k regex:fa_back_mma \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 bench/attention_backward.py ${LB_ATTN_ARGS:-} --runners llamabind --reps 1 > "$OUT/ncu-det$det-pipe$p-split$sp.txt" 2>&1
    echo "GGML_CUDA_FA_BACK_DETERMINISTIC=$det GGML_CUDA_FA_BACK_PIPE=$p GGML_CUDA_FA_BACK_SPLIT=$sp"
    grep -E "fa_back_mma|Duration|SM Active Cycles|Elapsed Cycles|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit (Reg|Shared)|Stall" "$OUT/ncu-det$det-pipe$p-split$sp.txt" | head -40
  done
  done
  done
  ;;
fa67ab)
  # issue 56 (after fa56: the build and the 1B models): patch 0068's casts (LLAMA_OPT_BF16_INPUTS) against none, and
  # patch 0067's dK/dV split (GGML_CUDA_FA_BACK_SPLIT) against a block per K/V head, as bench/train.py rows in one
  # lease (bench_settings; LB_BENCH default "1b:2048:4 1b:4096:1"), then the step's kernels with the casts
  # (bench/kernel_times.py, 2048 x 4 full) to set beside fa56kernels' without
  LB_BENCH=${LB_BENCH:-1b:2048:4 1b:4096:1} bench_settings ${LB_SETTINGS:-LLAMA_OPT_BF16_INPUTS=0,GGML_CUDA_FA_BACK_SPLIT=1 \
    LLAMA_OPT_BF16_INPUTS=1,GGML_CUDA_FA_BACK_SPLIT=1 LLAMA_OPT_BF16_INPUTS=0,GGML_CUDA_FA_BACK_SPLIT=0}
  LLAMA_OPT_BF16_INPUTS=1 python3 bench/kernel_times.py --model $MODELS/llama-1b-f32.gguf --ctx 2048 --batch 4 --mode bf16 \
    --out "$OUT/kernel-times-bf16-2048x4-cast.json" 2>&1 | tee "$OUT/kernel-times-bf16-2048x4-cast.txt" | head -45
  ;;
fa69)
  # issue 56 (after fa56: the build and the 1B models): settings against each other as bench/train.py rows in one
  # lease (bench_settings), by default patch 0069's FFN activations in BF16 or F32; e.g. LB_SETTINGS=
  # "LLAMA_OPT_BF16_FROZEN=1 LLAMA_OPT_BF16_FROZEN=0": patch 0070's copies (on by default)
  bench_settings ${LB_SETTINGS:-LLAMA_OPT_BF16_FFN=1 LLAMA_OPT_BF16_FFN=0}
  ;;
fa69tests)
  # (after fa56 with .device-s carried, or SmolLM2's parts in /tmp or .device-b) patch 0068-0070's GPU tests: the
  # casts bit for bit, the FFN's BF16 activations against F32 ones and fused against unfused kernels (LB_TEST_K,
  # default "bf16")
  [ -n "${LLAMABIND_TEST_SMOLLM2_CUT:-}" ] || join_model
  LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_train_graphs.py $PYTEST_ARGS -s -k "${LB_TEST_K:-bf16}" 2>&1 \
    | grep -vE "^(llama|load|print_info|common|ggml|init)" | tee "$OUT/fa69-tests.log" | tail -25
  ;;
fa56kernels)
  # issue 56 (after fa56: the build and the 1B models): one training step's kernels timed by Nsight Compute
  # (bench/kernel_times.py: gpu time per kernel, summed by kind), LB_KT (default "2048:4:bf16 2048:4:lora";
  # CTX:BATCH:MODE, MODE bf16 (full), lora or qlora)
  for spec in ${LB_KT:-2048:4:bf16 2048:4:lora}; do
    IFS=: read -r ctx batch mode <<< "$spec"
    kt_model=$MODELS/llama-1b-f32.gguf
    [ "$mode" = qlora ] && kt_model=$MODELS/llama-1b-q4_0.gguf  # QLoRA: LoRA over the Q4_0 GGUF as it is
    # LB_KT_TRACE=1: two steps traced by CUPTI (torch.profiler): GPU busy time, idle gaps, the host's CUDA calls
    [ -n "${LB_KT_TRACE:-}" ] && python3 bench/kernel_times.py --trace "$OUT/trace-$mode-${ctx}x$batch.trace.json" \
      --model $kt_model --ctx $ctx --batch $batch --mode $mode \
      --out "$OUT/kernel-times-trace-$mode-${ctx}x$batch.json" 2>&1 | tee "$OUT/kernel-times-trace-$mode-${ctx}x$batch.txt" | tail -80
    [ -n "${LB_KT_ONLY_TRACE:-}" ] && continue
    python3 bench/kernel_times.py --model $kt_model --ctx $ctx --batch $batch --mode $mode \
      --out "$OUT/kernel-times-$mode-${ctx}x$batch.json" 2>&1 | tee "$OUT/kernel-times-$mode-${ctx}x$batch.txt" | head -60
    # LB_KT_GRAPH=1: the same step's CUDA graph timed as one workload (the gaps between kernels included)
    [ -n "${LB_KT_GRAPH:-}" ] && python3 bench/kernel_times.py --graph --model $kt_model --ctx $ctx \
      --batch $batch --mode $mode --out "$OUT/kernel-times-graph-$mode-${ctx}x$batch.json" 2>&1 \
      | tee "$OUT/kernel-times-graph-$mode-${ctx}x$batch.txt" | head -30
  done
  ;;
train42b)
  join_model
  t0=$SECONDS
  LLAMABIND_REQUIRE_GPU=1 python3 -m pytest tests/test_train_graphs.py tests/test_train.py tests/test_qlora.py $PYTEST_ARGS \
    -k "${LB_TEST_K:-graphs or token_embd or profile or attend or batched or masked_labels or validation_between or qlora_runs or bad_input}" \
    --deselect "tests/test_train.py::test_batched_step_matches_pytorch" 2>&1 | tee "$OUT/train42-tests.log" | tail -25
  echo "tests in $((SECONDS - t0)) s"
  ;&
train42c)
  for spec in ${LB_BENCH:-1b:256:1,8}; do
    IFS=: read -r sz ctx batches <<< "$spec"
    python3 bench/train.py -ngl 99 --threads 8 --model $MODELS/llama-$sz-q4_0.gguf --chars ${LB_CHARS:-400000} \
      --ctx $ctx --batch $batches --steps ${LB_STEPS:-8} --runners ${LB_RUNNERS:-full,lora,qlora} \
      $([ "${LB_TORCH_RUNS:-}" = none ] || echo --torch python3 --torch-device cuda --torch-runs ${LB_TORCH_RUNS:-tf32,bf16,lora}) \
      --out "$OUT/train-$sz-ctx$ctx.json" 2>&1 | grep -E "^\||^[A-Za-z].*(parameters|wrote)|rror" | tee "$OUT/bench-train-$sz-ctx$ctx.txt"
  done
  ;;
bench)
  bw=$(python3 -c "import json; print(json.load(open('/tmp/bandwidth.json'))['bandwidth_gbs'])")
  until [ -f $MODELS/done ]; do sleep 5; done; cat $MODELS/make.log | tr '\r' '\n' | grep wrote
  # micro: 6 M parameters, so its t/s is the fixed cost per llama_decode call (binding vs llama-bench);
  # more rounds and reps than the 8b rows, whose single measurements are 10-100x longer
  for m in $MODELS/llama-micro-f16.gguf $LLAMABIND_CACHE/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
           $(ls $MODELS/llama-1b-*.gguf $MODELS/llama-8b-*.gguf 2>/dev/null); do
    name=$(basename $m .gguf)
    python3 bench/generation.py --model $m -ngl 99 --threads 8 --rounds ${LB_ROUNDS:-5} --reps ${LB_REPS:-20} --bandwidth $bw \
      --llama-cpp-python /nonexistent --out "$OUT/gen-$name.json" 2>&1 | grep -v "^round"
  done
  ;;
esac
} 2>&1 | tee "$OUT/summary-$phase.log"
wait  # what the phase started before its block (pending's 8B GGUF)
