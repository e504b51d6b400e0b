#!/usr/bin/env bash
# Task accuracy of the frontier's DiffKV points that hold no more KV bytes than uniform int4: 2,500 gsm_symbolic
# problems each, paired with fp16 (evals.study, the recorded study's settings). Run it on the box right after
# `bash scripts/device/frontier.sh`, in the next call (same warm box): it reads the frontier JSON that run left in
# /tmp (FRONTIER_JSON), takes the FRONTIER_TOP (default 3) DiffKV rows with memory <= k4v4's, best top-1 first,
# and resumes the recorded study (carry .carry/prev = a copy of evals/results/qwen2.5-coder-1.5b), so fp16 and
# the rows already there are not run again. The study's folder comes back as $OUT/qout.tgz.
set -uo pipefail
json=${FRONTIER_JSON:-/tmp/fidelity_frontier_qwen2.5-1.5b.json}
[ -f "$json" ] || { echo "no frontier JSON at $json: run scripts/device/frontier.sh on this box first"; exit 2; }
picked=$(python3 - "$json" "${FRONTIER_TOP:-3}" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["configs"]
cap = rows["k4v4"]["memory_fraction"]
dk = [(r["top1_agreement"], n) for n, r in rows.items()
      if n.startswith("diffkv") and r["memory_fraction"] <= cap]
print(" ".join(n for _, n in sorted(dk, reverse=True)[: int(sys.argv[2])]))
EOF
)
echo "DiffKV points at no more bytes than k4v4: ${picked:-none}"
[ -n "$picked" ] || exit 0
bash scripts/device/accuracy_study.sh run --max-num-seqs 128 --max-model-len 2048 --tasks gsm_symbolic \
  --task-n 2500 --fidelity-n 64 --gen-len 512 --calib-n 32 --calib-gen-len 512 \
  --max-tokens '{"gsm_symbolic": 384}' --criterion tasks --tolerance-points 1.0 --min-agreement 0.97 \
  --tolerance 0.01 --no-calibrate --configs fp16 k4v4 $picked --task-configs fp16 k4v4 $picked
