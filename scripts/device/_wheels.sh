# Shared by the device scripts; source it from the repository root on the GPU box (Python 3.12 with torch,
# triton and numpy, no network, no Ray). It installs the carried wheels once into $DIFFKV_SITE (see
# scripts/device/carry_wheels.py: one device command carries one .carry/ray* folder; the wheels add up in a
# stash until a group is complete) and puts the site and the repository on PYTHONPATH (the project is not
# pip-installed there, so `diffkv` runs as `python3 -m diffkv_serve.service.cli`).
#   DIFFKV_SKIP_WHEELS=1   use the packages this Python already has (CPU dry runs on a dev machine)
#   DIFFKV_SITE            install target (default /tmp/site); PYTHON (default python3)

DIFFKV_SITE="${DIFFKV_SITE:-/tmp/site}"
PYTHON="${PYTHON:-python3}"
export RAY_USAGE_STATS_ENABLED=0

# diffkv_wheels GROUPS: install these wheel groups (core, or core,plot); plot is optional (no PNGs without it).
diffkv_wheels() {
  if [ "${DIFFKV_SKIP_WHEELS:-0}" = "1" ]; then
    echo "wheels: skipped (DIFFKV_SKIP_WHEELS=1), using this Python's packages"
    return 0
  fi
  local t0=$SECONDS
  "$PYTHON" scripts/device/carry_wheels.py install --target "$DIFFKV_SITE" --groups "${1:-core}" || return $?
  echo "wheels: ready in $((SECONDS - t0)) s"
}

case ":${PYTHONPATH:-}:" in
  *":$DIFFKV_SITE:"*) ;;
  *) export PYTHONPATH="$DIFFKV_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
export PYTHONPATH="$PWD:$PYTHONPATH"

# gpu_info: "H200|NVIDIA H200" (the tag for file names, benchmarks/_results.gpu_tag, and the full name), or
# "cpu|cpu" without CUDA.
gpu_info() {
  "$PYTHON" - <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import torch
from _results import gpu_tag
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(f"{gpu_tag(name) if name != 'cpu' else 'cpu'}|{name}")
PY
}
