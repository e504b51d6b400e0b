"""The engine's command-line flags live in one module (diffkv_serve.engine.flags): every command and script takes
them from it, flags left out leave their EngineConfig fields unset, and a script's own defaults apply."""
import argparse
import re
from pathlib import Path

import pytest

from diffkv_serve.engine.config import EngineConfig
from diffkv_serve.engine.flags import ENGINE_FLAGS, add_engine_flags, engine_config_from_args, engine_settings

ROOT = Path(__file__).resolve().parents[1]
# A flag of these names defined anywhere else is a second definition of an engine setting. loadtest/sweep.py's
# --device only labels a results file and the load tests' --model names the served model (no engine runs there);
# benchmarks/vllm_baseline.py configures vLLM, not this engine; benchmarks/decode_step_profile.py's --model names
# the random-weight preset both engines build (its vLLM process never imports this project's flags).
ENGINE_FLAG_RE = re.compile(r"""add_argument\(\s*["']--(model|device|dtype|kv-mode|max-model-len|alpha-high|"""
                            r"""alpha-low|kv-cache-memory-gb|tensor-parallel-size)["']""")
LABEL_ONLY = {("loadtest/sweep.py", "device"), ("loadtest/locustfile.py", "model"), ("loadtest/sweep.py", "model"),
              ("benchmarks/vllm_baseline.py", "model"), ("benchmarks/vllm_baseline.py", "max-model-len"),
              ("benchmarks/decode_step_profile.py", "model")}


def test_engine_flags_are_defined_in_one_module():
    found = []
    for folder in ("diffkv_serve", "evals", "benchmarks", "loadtest", "scripts", "k8s", "grafana"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            for m in ENGINE_FLAG_RE.finditer(path.read_text()):
                if (rel, m[1]) not in LABEL_ONLY:
                    found.append(f"{rel}: --{m[1]}")
    assert not found, f"engine flags defined outside diffkv_serve/engine/flags.py: {found}"


def test_flags_left_out_stay_unset():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_settings(p.parse_args([])) == {}
    cfg = engine_config_from_args(p.parse_args(["--kv-mode", "diffkv", "--alpha-low", "0.01", "--engine-seed", "5",
                                                "--enforce-eager", "--max-num-seqs", "4", "--device", "cpu"]))
    assert cfg.cache.model_fields_set == {"kv_mode", "alpha_low"}  # alpha_high: the model's calibrated value
    assert (cfg.seed, cfg.enforce_eager, cfg.scheduler.max_num_seqs, cfg.device) == (5, True, 4, "cpu")
    assert cfg.model_fields_set == {"seed", "enforce_eager", "scheduler", "device", "cache"}
    # a command's fixed fields come first; flags override them section by section
    fixed = engine_config_from_args(p.parse_args(["--kv-mode", "int8"]), cache={"num_pages": 64, "kv_mode": "fp8"})
    assert (fixed.cache.kv_mode, fixed.cache.num_pages) == ("int8", 64)
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()


def test_script_defaults_only_and_bad_names():
    p = argparse.ArgumentParser()
    add_engine_flags(p, only=("device", "kv_mode"), defaults={"kv_mode": "diffkv"})
    args = p.parse_args([])
    assert (args.kv_mode, args.device) == ("diffkv", None) and not hasattr(args, "dtype")
    assert "(default: diffkv)" in " ".join(p.format_help().split())
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-mode", "fp4"])
    with pytest.raises(ValueError, match="unknown engine flags.*'gpu'"):
        add_engine_flags(argparse.ArgumentParser(), only=("gpu",))
    assert "engine_seed" in ENGINE_FLAGS and "threads" in ENGINE_FLAGS


def test_a_bad_flag_value_names_the_field():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    with pytest.raises(ValueError, match="device='tpu'"):
        engine_config_from_args(p.parse_args(["--device", "tpu"]))
    with pytest.raises(ValueError, match="max_graph_batch_size"):
        engine_config_from_args(p.parse_args(["--max-graph-batch-size", "0"]))
