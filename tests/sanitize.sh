#!/usr/bin/env bash
# Builds the native core with AddressSanitizer + UBSan and runs the drafter tests against it.
# Usage: bash tests/sanitize.sh   (CI runs it after the main suite)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build/sanitize"
cmake -S "$root/service/csrc" -B "$build" -DSAMROLLOUT_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DPython_EXECUTABLE="$(command -v python)" >/dev/null
cmake --build "$build" -j 2 >/dev/null
lib="$(ls "$build"/_sam_core*.so)"
export SAMROLLOUT_CORE_LIB="$lib"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# CPython itself leaks by design at exit; leaks inside the core show up in the lifecycle tests' memory checks.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cd "$root"
python -m pytest -q -p no:cacheprovider tests/test_drafter_matches_oracle.py tests/test_drafter_lifecycle.py \
  tests/test_draft_history.py tests/test_global_index.py \
  --deselect tests/test_draft_history.py::test_a_second_rollout_of_a_prompt_joins_the_first_rollouts_response_and_keeps_its_output
