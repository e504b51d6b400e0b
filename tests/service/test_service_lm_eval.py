"""lm-evaluation-harness against `diffkv serve` (the embedded model, CPU, diffkv cache): its `local-completions`
model runs a generate_until task and a multiple_choice (log-likelihood: echo + logprobs) task with no API
error. The tasks read a local jsonl written here; the harness's tokenizer is the server's own (/tokenizer_info,
/tokenize, /detokenize, auto-detected), so nothing is downloaded."""
import json
import math
import os
import subprocess
import sys

import pytest

from _cluster import free_port, stop_process, wait_serve_healthy

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")

DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris", "choices": ["Paris", "Rome", "Oslo"], "label": 0},
    {"question": "What colour is the sky on a clear day?", "answer": "Blue", "choices": ["Green", "Blue", "Red"],
     "label": 1},
    {"question": "How many legs does a cat have?", "answer": "Four", "choices": ["Two", "Six", "Four"], "label": 2},
]

COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
"""
GENERATE = COMMON + """task: diffkv_local_gen
output_type: generate_until
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
CHOICE = COMMON + """task: diffkv_local_mc
output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


@pytest.mark.slow  # a `diffkv serve` start and an lm-eval run: ~30 s on an idle machine
def test_lm_eval_local_completions_runs_generate_until_and_multiple_choice(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen.yaml").write_text(GENERATE.format(data=data))
    (tasks / "mc.yaml").write_text(CHOICE.format(data=data))

    port, metrics = free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "diffkv_serve.service.cli", "serve", "--device", "cpu",
                             "--port", str(port), "--metrics-port", str(metrics), "--num-cpus", "4",
                             "--max-model-len", "256", "--kv-mode", "diffkv", "--no-admission"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        model = wait_serve_healthy(proc, base, tmp_path / "serve.log", interval=1.0)
        offline = {**env, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "HF_HOME": str(tmp_path / "hf")}
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
             "--model_args", f"base_url={base}/v1/completions,model={model},max_retries=1,num_concurrent=1",
             "--tasks", "diffkv_local_gen,diffkv_local_mc", "--include_path", str(tasks),
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            env=offline, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        logged = run.stdout + run.stderr
        assert "API request failed" not in logged, logged[-5000:]  # lm-eval's words for any non-2xx answer
        assert "Using remote tokenizer" in logged, logged[-5000:]
    finally:
        stop_process(proc)
        log.close()
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["diffkv_local_gen"]["exact_match,none"] <= 1
    assert 0 <= results["diffkv_local_mc"]["acc,none"] <= 1
    samples = next((tmp_path / "out").rglob("samples_diffkv_local_mc_*.jsonl")).read_text().splitlines()
    assert len(samples) == len(DOCS)
    for s in map(json.loads, samples):  # every choice scored: a finite log-likelihood per choice
        lls = [float(r[0][0]) for r in s["resps"]]
        assert len(lls) == 3 and all(math.isfinite(x) and x < 0 for x in lls), s["resps"]
    gens = next((tmp_path / "out").rglob("samples_diffkv_local_gen_*.jsonl")).read_text().splitlines()
    assert len(gens) == len(DOCS) and all(isinstance(json.loads(g)["resps"][0][0], str) for g in gens)
