#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. GPU tests are marked `gpu` and skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
