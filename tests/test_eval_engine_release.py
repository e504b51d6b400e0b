"""Engines that evaluations build one after another in one process: each must find the earlier ones' model and
page pool released. On CUDA a pool sized under gpu_memory_utilization takes only what is free when its engine
starts, so an earlier engine still alive (the study's fp16 reference engine, bound to `eng` after its block)
left every later configuration a 64 MiB pool, and the quantized ones, preempted and recomputed over and over,
lost accuracy."""
import json
import weakref

import pytest

from diffkv_serve.engine.model_runner import ModelRunner

STUDY = ["--device", "cpu", "--no-calibrate", "--smoke", "--configs", "fp16", "k4v4", "--task-configs", "fp16",
         "k4v4", "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "8"]


@pytest.fixture
def runners(monkeypatch):
    """Weak references to every ModelRunner built; building one while an earlier one is alive fails."""
    built: list[weakref.ref] = []
    real_init = ModelRunner.__init__

    def init(self, *args, **kwargs):
        alive = sum(r() is not None for r in built)
        assert alive == 0, f"engine {len(built) + 1} starts while {alive} earlier engine(s) hold a model and pool"
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(ModelRunner, "__init__", init)
    return built


def test_closed_engine_releases_its_model_and_pool_while_still_referenced(runners, smollm):
    from evals.runner import EvalModel

    model = EvalModel(device="cpu", max_model_len=256, max_num_seqs=4, kv_cache_memory_gb=0.05, checkpoint=smollm)
    with model.engine({"kv_mode": "int4"}) as eng:
        assert eng.runner is not None
    assert eng.runner is None and eng.mm is None and runners[0]() is None
    assert not eng.is_healthy()


@pytest.mark.slow
def test_study_engines_start_with_the_earlier_ones_released(runners, tmp_path):
    from evals.study import main

    assert main([*STUDY, "--out", str(tmp_path)]) == 0
    assert len(runners) == 3  # the fp16 references, then fp16 and k4v4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["configs"]) == {"fp16", "k4v4"}


@pytest.mark.slow
def test_resumed_study_without_calibration_reuses_its_references(runners, tmp_path):
    from evals.study import main

    assert main([*STUDY, "--configs", "fp16", "--task-configs", "fp16", "--out", str(tmp_path)]) == 0
    refs = (tmp_path / "references.json").read_text()
    (tmp_path / "configs" / "fp16.json").unlink()
    assert main([*STUDY, "--configs", "fp16", "--task-configs", "fp16", "--resume", "--out", str(tmp_path)]) == 0
    assert len(runners) == 3  # references and fp16, then fp16 alone: the recorded references were reused
    assert (tmp_path / "references.json").read_text() == refs
