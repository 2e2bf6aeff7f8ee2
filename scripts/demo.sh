#!/usr/bin/env bash
# The main job: the demo pipeline on the embedded defaults (local Prefect server on SQLite under
# runs/.prefect, SmolLM2-135M-Instruct, bundled ShareGPT data). Extra arguments go to `eagle3 demo`,
# e.g. ./scripts/demo.sh --set data.sources.0.max_records=10000
# `eagle3 doctor` runs first: it stops here, with the fix, when the preset needs something missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
preset=smollm2-demo   # = the default preset of `eagle3 demo`
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --preset) preset="${args[$((i + 1))]:-$preset}" ;;
    --preset=*) preset="${args[$i]#--preset=}" ;;
  esac
done
.venv/bin/eagle3 doctor --preset "$preset"
exec .venv/bin/eagle3 demo "$@"
