#!/usr/bin/env bash
# Where DiffKV's pruning costs Qwen2.5-Coder-1.5B accuracy (evals/pruning_analysis.py) on the GPU box, over one
# or more device commands of at most 540 s. qwen_run.sh carries the model: `bash scripts/device/qwen_run.sh stash`
# once per .carry/qNN first (see that script). Then, repeated until the printed summary lists nothing pending:
#     bash scripts/device/pruning_ablation.sh [evals.pruning_analysis arguments]
# The output lives in /tmp/pout on the box (kept while the box stays warm) and comes back as $OUT/pout.tgz (and
# $OUT/summary.json) after every command; .carry/pout (optional: an earlier pout/ unpacked there) seeds a fresh
# box, so a run goes on after the box was handed back. PRUNE_LIMIT (default 540) is the hard stop; the analysis
# itself stops 60 s earlier between configurations (--time-limit), losing nothing it finished.
set -uo pipefail
limit=${PRUNE_LIMIT:-540}
if [ -d .carry/pout ] && [ ! -d /tmp/pout ]; then mkdir -p /tmp/pout && cp -r .carry/pout/. /tmp/pout/; fi
bash scripts/device/qwen_run.sh timeout "$limit" python3 -m evals.pruning_analysis --model qwen2.5-coder-1.5b \
  --device cuda --out /tmp/pout --resume --time-limit $((limit - 60)) "$@"
rc=$?
if [ -n "${OUT:-}" ] && [ -d /tmp/pout ]; then
  tar czf "$OUT/pout.tgz" -C /tmp pout
  [ -f /tmp/pout/summary.json ] && cp /tmp/pout/summary.json "$OUT/summary.json"
fi
exit $rc
