#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run mimw; with no arguments, serve the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- serve; fi
exec .venv/bin/mimw "$@"
