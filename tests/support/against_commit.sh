#!/usr/bin/env bash
# Run today's tests against the service and client of an earlier commit: to watch a test fail against the code
# from before the change it guards.
#
#   tests/support/against_commit.sh [--patch FILE] COMMIT [pytest arguments...]
#   tests/support/against_commit.sh 8c27064 tests/test_request_gate.py -k browser_shaped
#
# The commit's tree (with FILE applied, e.g. a test-only hook the old code lacks) is built as a wheel into a
# temporary folder and put first on PYTHONPATH, past the editable install's redirect (a sitecustomize drops it),
# so the installed checkout is left as it is; the servers the tests start inherit the same path.  The tests are
# today's, run in the old tree: a module importing what the old code lacks must be adapted by hand (the
# failure is then the import, not the behaviour).  Everything is removed at the end.
set -euo pipefail

patch=""
if [[ "${1:-}" == "--patch" ]]; then
  patch=$(realpath "$2")
  shift 2
fi
commit=${1:?usage: $0 [--patch FILE] COMMIT [pytest arguments...]}
shift
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
cleanup() {
  git -C "$repo" worktree remove --force "$work/tree" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

git -C "$repo" worktree add --detach "$work/tree" "$commit" >/dev/null
if [[ -n "$patch" ]]; then
  git -C "$work/tree" apply "$patch"
fi
rm -rf "$work/tree/tests"
cp -r "$repo/tests" "$work/tree/tests"
pip wheel -q --no-deps -w "$work/wheel" "$work/tree"
mkdir -p "$work/site" "$work/path"
wheel=$(ls "$work"/wheel/samrollout-*.whl)
python -m zipfile -e "$wheel" "$work/site"
cat >"$work/path/sitecustomize.py" <<'PY'
"""Imports of samrollout from PYTHONPATH (the earlier commit's build), not the editable install's source."""
import sys

sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
PY
cd "$work/tree"
PYTHONPATH="$work/path:$work/site:$work/tree/clients" python -c \
  "import samrollout, samrollout_client; print('samrollout from', samrollout.__file__, samrollout_client.__file__)"
PYTHONPATH="$work/path:$work/site:$work/tree/clients" python -m pytest -p no:cacheprovider "$@"
