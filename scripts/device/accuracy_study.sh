#!/usr/bin/env bash
# An accuracy study on the GPU box, over several device commands (qwen_run.sh carries the models: `bash
# scripts/device/accuracy_study.sh stash` once per .carry/qNN (and .carry/sNN for the embedded SmolLM2), then):
#     bash scripts/device/accuracy_study.sh run [evals.study arguments]   (repeat: --resume continues)
# STUDY_MODEL picks the model (default qwen2.5-coder-1.5b; "embedded" for SmolLM2-135M). The study's output lives
# in /tmp/<name>out on the box (kept while the box stays warm) and comes back as $OUT/<name>out.tgz after every
# run, so a command that hits its limit loses nothing it had finished.
# .carry/prev (optional): an earlier study's output of the same model (references.json, key_center.json, or a whole qout/ that
# came back from a box handed back mid-study), reused by --resume.
set -uo pipefail
mode=${1:?stash or run}; shift
[ "$mode" = stash ] && exec bash scripts/device/qwen_run.sh stash
model=${STUDY_MODEL:-qwen2.5-coder-1.5b}
name=$([ "$model" = embedded ] && echo smol || echo q)out
if [ -d .carry/prev ] && [ ! -d "/tmp/$name" ]; then mkdir -p "/tmp/$name" && cp -r .carry/prev/. "/tmp/$name/"; fi
STUDY_LIMIT=${STUDY_LIMIT:-540} bash scripts/device/qwen_run.sh \
  timeout "${STUDY_LIMIT:-540}" python3 -m evals.study --model "$model" --device cuda --out "/tmp/$name" --resume "$@"
rc=$?
[ -n "${OUT:-}" ] && tar czf "$OUT/$name.tgz" -C /tmp "$name"
exit $rc
