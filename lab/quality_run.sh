#!/usr/bin/env bash
# The GPU-scale quality run of the core pipeline, without Prefect (GPU hosts may not have it):
#   lab/quality_run.sh PHASE [--set key=value ...]
# PHASE: data (merge, regenerate with the target, tokenize, vocab) | capture | train | export | eval | all.
# Every phase skips what its manifests say is complete, so a phase killed by a time limit is simply
# run again. PRESET (default smollm2-quality), NPROC (GPUs for training, default all visible) and
# PYTHON may be set in the environment. With train.features=online (smollm2-quality) capture does nothing.
# On a bare GPU host the target and data files arrive with lab/curve_assets.py, and text generated on an
# earlier host with `lab/quality_curve.py unpack-journals DIR --preset "$PRESET"` (then the data phase
# generates only what is missing). PACK_RESULTS_TO=DIR packs what the run has measured, its exported drafter
# included, into DIR after every phase (`lab/quality_curve.py pack-results`), so a host lost mid-run still
# leaves its finished phases to carry off; `quality_curve.py unpack-results DIR` restores them elsewhere.
# Figures and the commands that produced them: docs/evaluate.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PRESET=${PRESET:-smollm2-quality}
phase=${1:?usage: lab/quality_run.sh data|capture|train|export|eval|all [--set k=v ...]}
shift
overrides=("$@")
run_dir=$($PY -c "import sys; from eagle3.config import load_config
print(load_config(sys.argv[1], [a for a in sys.argv[2:] if a != '--set']).run_dir)" "$PRESET" "${overrides[@]}")
config="$run_dir/config.json"
nproc=${NPROC:-$($PY -c "import torch; print(max(1, torch.cuda.device_count()))")}

run_phase() {
  local t0=$SECONDS
  echo "== $1 =="
  case $1 in
    data) $PY -m eagle3.run.stages all --preset "$PRESET" "${overrides[@]}" ;;
    capture) $PY -m eagle3.features.capture --config "$config" "${overrides[@]}" ;;
    train) $PY -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m eagle3.train --config "$config" ;;
    export) $PY -m eagle3.export --config "$config" "${overrides[@]}" ;;
    eval) $PY -m eagle3.evaluate.stage --config "$config" "${overrides[@]}" ;;
  esac
  echo "== $1 took $((SECONDS - t0)) s =="
  if [ -n "${PACK_RESULTS_TO:-}" ]; then
    $PY lab/quality_curve.py pack-results "$PACK_RESULTS_TO" --preset "$PRESET" --with-weights "${overrides[@]}"
  fi
}

if [ "$phase" = all ]; then
  for p in data capture train export eval; do run_phase "$p"; done
else
  run_phase "$phase"
fi
