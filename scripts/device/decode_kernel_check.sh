#!/usr/bin/env bash
# One device command (under its 600 s limit) that checks and times the CUDA decode kernel
# (diffkv_serve/kernels/decode_attention/decode_mma.cu), each stage under its own timeout, logs and JSONs in $OUT:
#   tests           its CUDA tests against float64 loops (every served precision), the dispatcher's and the split merge's
#   kernel_ab       benchmarks/decode_kernel_ab.py: against the Triton kernel the dispatcher would pick, same calls
#   attention       benchmarks/attention.py --repeats 2: every precision against the floor (the decode targets)
#   step_breakdown  benchmarks/step_breakdown.py at the Llama-3-8B shape: int4 and diffkv beside fp16, end to end
#   stages          benchmarks/decode_stages.py: one tile in flight against two where grids overfill the SMs (not
#                   in the default list; ~65 s on an H200)
# The engine (step_breakdown, the dispatcher tests' conftest) needs pydantic: carry .carry/w holding its cp312
# wheels (pydantic, pydantic_core, annotated_types, typing_inspection, typing_extensions; see the device README).
#   run: bash scripts/device/decode_kernel_check.sh [STAGE ...]   (carry: .carry/w). On an H200 tests take ~290 s,
#        kernel_ab ~80 s, attention ~80 s, step_breakdown up to 190 s: run `tests` in one device call and the rest
#        in the next (a call may run 600 s)
set -uo pipefail
STAGES=" ${*:-tests kernel_ab attention step_breakdown} "
for s in $STAGES; do
  case $s in tests|kernel_ab|attention|step_breakdown|stages) ;; *) echo "unknown stage: $s" >&2; exit 2 ;; esac
done

export PYTHONUNBUFFERED=1
if [ -d .carry/w ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/w/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="/tmp/site:$PWD"
OUT="${OUT:-/tmp/decode_kernel_check}"
mkdir -p "$OUT"
gpu=$(python3 -c "import torch; from benchmarks._results import gpu_tag; print(gpu_tag(torch.cuda.get_device_name()))")
echo "GPU: $gpu"

stage() {  # stage NAME SECONDS COMMAND...: run it under a timeout, print its status and the end of its log
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  [[ $STAGES == *" $name "* ]] || return 0
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}

stage tests 420 env DIFFKV_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_decode_attention_mma_cuda.py tests/kernels/test_decode_attention_dispatch.py tests/kernels/test_decode_merge.py
stage kernel_ab 100 python3 benchmarks/decode_kernel_ab.py --out "$OUT/decode_mma_vs_triton_$gpu.json"
stage attention 130 python3 benchmarks/attention.py --repeats 2 --out "$OUT/attention_$gpu.json"
stage step_breakdown 190 python3 benchmarks/step_breakdown.py --preset llama3-8b --modes fp16 int4 diffkv \
  --batches 64 256 --seq 1024 --steps 8 --out "$OUT/step_breakdown_llama3_8b_$gpu.json"
stage stages 150 python3 benchmarks/decode_stages.py --batches 128 160 192 --seqs 1024 4096 16384 \
  --out "$OUT/decode_stages_$gpu.json"
