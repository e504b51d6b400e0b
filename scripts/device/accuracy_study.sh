#!/usr/bin/env bash
# The Qwen2.5-Coder-1.5B accuracy study on the GPU box, over several device commands (qwen_run.sh carries the
# model: `bash scripts/device/accuracy_study.sh stash` once per .carry/qNN, then):
#     bash scripts/device/accuracy_study.sh run [evals.study arguments]   (repeat: --resume continues)
# The study's output lives in /tmp/qout on the box (kept while the box stays warm) and comes back as
# $OUT/qout.tgz after every run, so a command that hits its limit loses nothing it had finished.
# .carry/prev (optional): an earlier study's output (references.json, key_center.json, or a whole qout/ that came
# back from a box handed back mid-study), reused by --resume.
set -uo pipefail
mode=${1:?stash or run}; shift
[ "$mode" = stash ] && exec bash scripts/device/qwen_run.sh stash
if [ -d .carry/prev ] && [ ! -d /tmp/qout ]; then mkdir -p /tmp/qout && cp -r .carry/prev/. /tmp/qout/; fi
STUDY_LIMIT=${STUDY_LIMIT:-540} bash scripts/device/qwen_run.sh \
  timeout "${STUDY_LIMIT:-540}" python3 -m evals.study --model qwen2.5-coder-1.5b --device cuda --out /tmp/qout --resume "$@"
rc=$?
[ -n "${OUT:-}" ] && tar czf "$OUT/qout.tgz" -C /tmp qout
exit $rc
