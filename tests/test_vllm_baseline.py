"""benchmarks/vllm_baseline.py on CPU: the same shape and prompts as throughput.py, the skip without vLLM, the
comparison table, and the child-process guard that keeps one failed cache dtype from losing the others."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import throughput  # noqa: E402
import vllm_baseline as vb  # noqa: E402
from diffkv_serve.engine.loader import load_checkpoint  # noqa: E402
from diffkv_serve.engine.loader.presets import ARCH_PRESETS  # noqa: E402


def test_committed_config_is_the_preset_shape():
    arch = ARCH_PRESETS["qwen2.5-1.5b"]
    cfg = json.loads((vb.MODELS / "qwen2.5-1.5b" / "config.json").read_text())
    assert cfg == vb.hf_config(arch)  # regenerate it with hf_config when the preset changes
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"]) == (1536, 28, 12, 2, 8960, 151936)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == arch.head_dim == cfg["head_dim"]
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_theta"] == arch.rope_theta and cfg["rms_norm_eps"] == arch.rms_norm_eps
    assert cfg["max_position_embeddings"] == arch.max_position_embeddings
    assert cfg["use_sliding_window"] is False
    folder, dummy = vb.model_folder("random:qwen2.5-1.5b", Path("/nonexistent"))
    assert folder == vb.MODELS / "qwen2.5-1.5b" and dummy


def test_other_presets_get_a_written_config(tmp_path):
    folder, dummy = vb.model_folder("random:llama3-8b", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert dummy and cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_scaling"]["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="no preset"):
        vb.model_folder("random:nope", tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        vb.model_folder(str(tmp_path / "empty"), tmp_path)


@pytest.mark.parametrize("workload", ["long-decode", "serving"])
def test_prompts_and_workload_equal_throughput(workload):
    args = vb.parse_args(["--workload", workload])
    ours = throughput.parse_args(["--model", "random:qwen2.5-1.5b", "--workload", workload])
    for k in ("prompts", "num_prompts", "prompt_len", "max_tokens", "kv_memory_gb", "max_num_seqs",
              "max_num_batched_tokens", "seed"):
        assert getattr(args, k) == getattr(ours, k), k
    ckpt = load_checkpoint("random:qwen2.5-1.5b")
    expected = throughput.load_prompts(ckpt, ours.num_prompts, ours.prompts, ours.seed, ours.prompt_len)
    got = vb.build_prompts(args)
    assert got == expected and len(got) == ours.num_prompts
    if workload == "serving":
        assert len(got) >= 1000 and {len(p) for p in got} == {512} and args.max_tokens == 256
    else:
        assert len(got) == 128 and args.max_tokens == 2048 and 64 <= min(map(len, got)) <= max(map(len, got)) <= 256
    assert max(max(p) for p in got) < ckpt.arch.vocab_size


def test_flags_override_the_workload_and_bad_values_are_named():
    args = vb.parse_args(["--workload", "serving", "--num-prompts", "8"])
    assert args.num_prompts == 8 and args.prompt_len == 512
    for bad, field in ((["--prompt-len", "0"], "--prompt-len"), (["--kv-memory-gb", "0"], "--kv-memory-gb"),
                       (["--max-tokens", "0"], "--max-tokens")):
        with pytest.raises(SystemExit):
            vb.parse_args(bad)
    with pytest.raises(SystemExit):
        throughput.parse_args(["--prompts", "gsm_symbolic", "--prompt-len", "16"])


def test_skips_without_vllm(tmp_path, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the skip path is not reachable")
    out = tmp_path / "v.json"
    assert vb.main(["--workload", "long-decode", "--out", str(out)]) == 0
    assert "skipped: vLLM is not importable" in capsys.readouterr().out
    assert not out.exists()


def test_compare_pairs_equal_formats(tmp_path):
    v = {"vllm": "0.26.0", "device": "NVIDIA H100 80GB HBM3", "model": "random:qwen2.5-1.5b",
         "config": {"workload": "long-decode"}, "command": "v",
         "rows": [{"mode": "vllm-bf16", "compare_with": "fp16", "tokens_per_s": 8000.0},
                  {"mode": "vllm-fp8", "compare_with": "fp8", "error": "exit 1"}]}
    ours16 = {"command": "a", "rows": [{"mode": "fp16", "tokens_per_s": 7200.0}]}
    ours8 = {"command": "b", "rows": [{"mode": "fp8", "tokens_per_s": 11000.0}, {"mode": "int4", "tokens_per_s": 2e4}]}
    table = {r["cache"]: r for r in vb.compare(v, [ours16, ours8])}
    assert table["bf16"]["ours_over_vllm"] == pytest.approx(0.9)
    assert table["fp8"]["ours_over_vllm"] is None and table["fp8"]["vllm_error"] == "exit 1"
    assert table["fp8"]["ours_tokens_per_s"] == 11000.0 and table["int4"]["vllm_tokens_per_s"] is None
    paths = []
    for name, d in (("v", v), ("o16", ours16)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "cmp.json"
    assert vb.main(["--compare", str(paths[0]), "--ours", str(paths[1]), str(tmp_path / "missing.json"),
                    "--out", str(out)]) == 0
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["bf16"]["ours_over_vllm"] == pytest.approx(0.9) and rows["fp8"]["ours_tokens_per_s"] is None


def test_child_group_is_ended_at_timeout(tmp_path):
    """A hung dtype (and a process it started, as vLLM starts its engine core) is ended at the limit."""
    pidfile = tmp_path / "grandchild"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.perf_counter()
    assert vb.run_child([sys.executable, "-c", script], timeout=3) == "timeout"
    assert time.perf_counter() - t0 < 20
    grandchild = int(pidfile.read_text())
    time.sleep(0.2)
    assert not _alive(grandchild)
    assert vb.run_child([sys.executable, "-c", "raise SystemExit(4)"], timeout=30) == 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by init) counts as ended
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_script_runs_from_the_checkout():
    """As the device script calls it: a subprocess from the repository root, no vLLM here -> exit 0."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    r = subprocess.run([sys.executable, "benchmarks/vllm_baseline.py", "--workload", "serving", "--out",
                        "/dev/null/never"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "skipped" in r.stdout, r.stderr


FAKE_VLLM = '''
import json, os
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, max_tokens, ignore_eos, temperature):
        self.max_tokens, self.ignore_eos, self.temperature = max_tokens, ignore_eos, temperature
class _Out:
    def __init__(self, n):
        self.outputs = [type("C", (), {"token_ids": list(range(n))})()]
class LLM:
    def __init__(self, **kw):
        self.kw, self.calls = kw, []
        if kw["kv_cache_dtype"] == "fp8" and os.environ.get("FAKE_VLLM_FP8") == "crash":
            raise RuntimeError("fp8 start failed")
    def generate(self, inputs, sp, use_tqdm=True):
        self.calls.append({"n": len(inputs), "max_tokens": sp.max_tokens, "ignore_eos": sp.ignore_eos,
                           "temperature": sp.temperature})
        if len(self.calls) == 2:  # the timed call: record what vLLM was given
            with open(os.environ["FAKE_VLLM_LOG"] + "-" + self.kw["kv_cache_dtype"], "w") as f:
                json.dump({"kw": self.kw, "calls": self.calls, "prompts": [i["prompt_token_ids"] for i in inputs]}, f)
        return [_Out(sp.max_tokens) for _ in inputs]
'''
FAKE_TORCH = '''
__version__ = "0.0-fake"
class cuda:
    @staticmethod
    def synchronize(): pass
    @staticmethod
    def get_device_name(): return "NVIDIA H100 80GB HBM3"
'''


def test_parent_and_children_with_a_fake_vllm(tmp_path, monkeypatch, capsys):
    """The whole path the device runs, with stand-ins for vLLM and CUDA: the prompts and limits vLLM receives,
    one child per dtype whose PYTHONPATH is the vLLM site alone, and a crashed dtype that leaves the other row."""
    site = tmp_path / "vsite"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)  # the child must not need this project's torch
    log = tmp_path / "vllm-log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_FP8", "crash")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    out = tmp_path / "v.json"
    args = ["--workload", "long-decode", "--num-prompts", "6", "--max-tokens", "5", "--vllm-site", str(site),
            "--out", str(out), "--child-timeout", "120"]
    assert vb.main(args) == 0
    d = json.loads(out.read_text())
    rows = {r["mode"]: r for r in d["rows"]}
    assert rows["vllm-bf16"]["tokens"] == 30 and rows["vllm-bf16"]["vllm"] == "0.0-fake"
    assert rows["vllm-fp8"]["error"] == "exit 1" and d["device"] == "NVIDIA H100 80GB HBM3"
    seen = json.loads(Path(f"{log}-auto").read_text())
    ours = throughput.parse_args(["--model", "random:qwen2.5-1.5b", "--workload", "long-decode",
                                  "--num-prompts", "6", "--max-tokens", "5"])
    ckpt = load_checkpoint("random:qwen2.5-1.5b")
    assert seen["prompts"] == throughput.load_prompts(ckpt, 6, "synthetic", 0, None)
    kw = seen["kw"]
    assert kw["kv_cache_memory_bytes"] == int(ours.kv_memory_gb * 2**30) and kw["enable_prefix_caching"] is False
    assert ours.prefix_caching == "off" and throughput.PREFIX_CACHING[ours.prefix_caching] is False  # ours too
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["dtype"] == "bfloat16"
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (ours.max_num_seqs, ours.max_num_batched_tokens)
    assert json.loads((Path(kw["model"]) / "config.json").read_text())["hidden_size"] == 1536
    assert seen["calls"][0]["max_tokens"] == 2  # the short warm-up, untimed
    assert seen["calls"][1] == {"n": 6, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    assert "vllm fp8: FAILED" in capsys.readouterr().out


def test_metric_totals_sum_labels_and_read_histograms():
    from types import SimpleNamespace as NS

    class FakeLLM:
        def get_metrics(self):
            return [NS(name="vllm:num_preemptions", value=3), NS(name="vllm:num_preemptions", value=2),
                    NS(name="vllm:iteration_tokens_total", count=10, sum=270.0, buckets={}),
                    NS(name="vllm:num_requests_running", value=7)]  # not one of METRICS

    assert vb.metric_totals(FakeLLM()) == {"vllm:num_preemptions": 5.0, "vllm:iteration_tokens_total.count": 10.0,
                                           "vllm:iteration_tokens_total.sum": 270.0}

    class Broken:
        def get_metrics(self):
            raise AttributeError("no metrics")

    assert vb.metric_totals(Broken()) == {}
