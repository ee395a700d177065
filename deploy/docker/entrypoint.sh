#!/usr/bin/env bash
# Container entrypoint: load the accelerator runtime's environment, then run `samrollout serve`.
#
# On Ascend, CANN's libraries and tools are found through variables that its set_env.sh scripts
# export; SAMROLLOUT_CANN_ENV_SCRIPTS lists them (set in the ascend image, empty elsewhere) and
# each one present is sourced.  Arguments are passed to `samrollout serve`: flags first, then
# `--` and extra vLLM engine flags.  Every flag also has a SAMROLLOUT_* environment variable.
set -euo pipefail

for script in ${SAMROLLOUT_CANN_ENV_SCRIPTS:-}; do
  if [[ -f "$script" ]]; then
    # set_env.sh reads unset variables; relax -u while it runs.
    set +u
    # shellcheck disable=SC1090
    source "$script"
    set -u
  fi
done

exec samrollout serve "$@"
