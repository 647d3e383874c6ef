# issue 56, 2026-12-01, calls 1 and 2 (bare machines), carrying .device-h/ggml.tgz (vendor/llama.cpp/ggml's include/,
# src/*.h and src/ggml-cuda/ of the patched tree being edited):
#   mkdir -p /tmp/g && tar xzf .device-h/ggml.tgz -C /tmp/g && \
#     python3 tests/device/fa_harness.py --ggml /tmp/g/ggml --variants 0,1,3,2 --reps 20   (call 1; 30 in call 2)
# The harness then had two more variants, since dropped with the code they ran: dK/dV variant 3 (the 128-key kernel
# with both row tiles' scores from one load of Q, which became patch 0088's kernel; variant 1 then computed the scores
# a row tile at a time) and, in call 2, forward variants 1 and 2 (128 query rows a block, 32 a warp, registers for 2 or
# 3 blocks an SM). Variant 2 of call 1 ran with a block a query head, for which the no-dQ kernel has no dK/dV
# reduction: its dK/dV "failures" in call1-harness are that, not a kernel error (call 2 runs it with a block a K/V head).
set -uo pipefail
mkdir -p /tmp/g && tar xzf .device-h/ggml.tgz -C /tmp/g && python3 tests/device/fa_harness.py --ggml /tmp/g/ggml --reps 30
