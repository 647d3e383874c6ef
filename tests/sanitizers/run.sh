#!/usr/bin/env bash
# One sanitizer run: llamabind built with LLAMABIND_SANITIZE=address,undefined in build/asan-venv
# (see docs/reliability.md), the whole test suite under ASan + UBSan, then LeakSanitizer on one
# load / generate / close cycle (tests/sanitizers/lsan_report.py classifies it). Logs go to
# build/sanitizers/. RSS-drift tests are skipped: ASan's quarantine keeps freed memory resident.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${ASAN_PY:-build/asan-venv/bin/python}
LIBASAN=$(gcc -print-file-name=libasan.so)
LIBUBSAN=$(gcc -print-file-name=libubsan.so)
mkdir -p build/sanitizers
export LD_PRELOAD="$LIBASAN:$LIBUBSAN"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=0:log_path=build/sanitizers/ubsan
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:log_path=build/sanitizers/asan:allocator_may_return_null=1
export LLAMABIND_REQUIRE_TOOLS=1 GGML_NO_BACKTRACE=1 LLAMABIND_SANITIZED=1
"$PY" -m pytest tests -q -p no:cacheprovider -x -k "not notebook and not sdist" "$@" 2>&1 | tee build/sanitizers/pytest.log
echo "pytest exit: ${PIPESTATUS[0]}"
rm -f build/sanitizers/lsan.*
ASAN_OPTIONS=detect_leaks=1:log_path=build/sanitizers/lsan "$PY" -c "
import llamabind
m = llamabind.Model('smollm2-135m-instruct', n_ctx=128, n_threads=2)
print(m.generate('Hello', max_tokens=8, temperature=0).text)
m.close()
"
python3 tests/sanitizers/lsan_report.py build/sanitizers/lsan
echo "ASan/UBSan reports from the test suite:"; ls build/sanitizers/ | grep -E "^(asan|ubsan)\." || echo "none"
