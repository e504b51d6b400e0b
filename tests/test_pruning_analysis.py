"""evals/pruning_analysis.py: token categories, the pruning tally against a direct count, and the --smoke run on
the embedded SmolLM2 (CPU), stopped by --time-limit and finished with --resume."""
import json
import math

import pytest
import torch

from diffkv_serve.engine.kv.policy import KEPT_HIGH, KEPT_LOW, PRUNED
from evals import pruning_analysis as pa
from evals.runner import EvalModel


@pytest.fixture(scope="module")
def model(smollm_module):
    return EvalModel(checkpoint=smollm_module, device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def smollm_module():
    from diffkv_serve.engine.loader import load_checkpoint

    return load_checkpoint(None)


def test_prompt_categories_find_the_question_and_its_numbers(model):
    q = "Tom has 12 apples and buys 305 more. How many apples does he have?"
    ids, cats = pa.prompt_categories(model, q)
    assert len(ids) == len(cats) and set(cats) <= set(pa.CATEGORIES)
    text = lambda c: "".join(model.tokenizer.decode([i]) for i, x in zip(ids, cats) if x == c)  # noqa: E731
    assert "".join(ch for ch in text("question_number") if ch.isdigit()) == "12305"
    assert "apples" in text("question_text") and "12" not in text("question_text")
    assert "Answer" in text("instruction")
    assert cats[0] == "template" and cats[-1] == "template"  # the chat template around the user turn
    assert pa.generated_categories(model, model.tokenizer.encode("x = 42", add_special_tokens=False)).count(
        "generated_number") >= 1


def test_tally_matches_a_direct_count():
    g = torch.Generator().manual_seed(0)
    L, H, N = 3, 2, 17
    classes = torch.randint(0, 3, (L, H, N), generator=g).to(torch.int8)
    classes[1, :, 5] = PRUNED  # layer 1 lost position 5 in both heads
    cats = [pa.CATEGORIES[int(i)] for i in torch.randint(0, len(pa.CATEGORIES), (N,), generator=g)]
    t = pa.PruneTally(L)
    t.add(classes, cats)
    t.add(classes, cats)  # counts add up; rates stay
    s = t.summary()
    total = int((classes == PRUNED).sum()) * 2
    assert s["pruned_entries"] == total and s["problems"] == 2
    assert math.isclose(sum(v["share_of_pruned"] for v in s["categories"].values()), 1)
    for c, v in s["categories"].items():
        m = torch.tensor([x == c for x in cats])
        if not m.any():
            assert v["pruned_rate"] is None
            continue
        sub = classes[:, :, m]
        assert v["positions"] == 2 * int(m.sum())
        assert math.isclose(v["pruned_rate"], float((sub == PRUNED).double().mean()))
        assert math.isclose(v["low_rate"], float((sub == KEPT_LOW).double().mean()))
        lost = (sub == PRUNED).all(1).any(0)
        assert math.isclose(v["lost_in_a_layer"], float(lost.double().mean()))
        for layer in range(L):
            assert math.isclose(v["pruned_rate_per_layer"][layer], float((sub[layer] == PRUNED).double().mean()))
    assert (classes != KEPT_HIGH).any()
    with pytest.raises(ValueError, match="categories"):
        t.add(classes, cats[:-1])


@pytest.mark.slow
def test_smoke_run_with_time_limit_and_resume(tmp_path, capsys):
    out = tmp_path / "pa"
    assert pa.main(["--smoke", "--device", "cpu", "--out", str(out), "--time-limit", "0"]) == 0
    first = json.loads((out / "summary.json").read_text())
    assert list(first["configs"]) == ["fp16"] and first["pending"]  # the first run always runs, then the limit
    fp16_file = (out / "configs" / "fp16.json").read_text()
    assert pa.main(["--smoke", "--device", "cpu", "--out", str(out), "--resume"]) == 0
    assert (out / "configs" / "fp16.json").read_text() == fp16_file  # reused, not rerun
    s = json.loads((out / "summary.json").read_text())
    assert not s["pending"]
    assert set(s["configs"]) == {"fp16", "diffkv", "phase_prompt", "phase_generation", "window_16", "queries_4"}
    for name, row in s["configs"].items():
        assert 0 <= row["accuracy"] <= 1 and 0 < row["memory_fraction"]
        if name != "fp16":
            lo, hi = row["diff_ci95_points"]
            assert lo <= row["diff_vs_fp16_points"] <= hi
    assert set(s["pruning"]) == set(s["configs"]) - {"fp16"}
    prompt_cats = ("template", "question_number", "question_text", "instruction")
    for name, groups in s["pruning"].items():
        assert set(groups) == set(pa.GROUPS) and groups["all"]["problems"] == s["problems"] == 3
        cats = groups["all"]["categories"]
        assert math.isclose(sum(v["share_of_pruned"] for v in cats.values()), 1)
        for c in ("generated_number", "generated_text") if name == "phase_prompt" else ():
            assert cats[c]["pruned_rate"] in (0, None)
        for c in prompt_cats if name == "phase_generation" else ():
            assert cats[c]["pruned_rate"] == 0
    assert s["pruning"]["diffkv"]["all"]["categories"]["question_number"]["pruned_rate"] > 0
    assert isinstance(s["failing"], list)
    printed = capsys.readouterr().out
    assert "question_number" in printed and "phase_generation" in printed
    # A command's first engine run starts whatever the limit (resumed results do not count as run).
    (out / "configs" / "queries_4.json").unlink()
    assert pa.main(["--smoke", "--device", "cpu", "--out", str(out), "--resume", "--time-limit", "0"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert not again["pending"] and "queries_4" in again["configs"]


def test_failing_problems_are_detailed(model):
    from evals.problems import load_problems

    problems = load_problems(split="eval", tasks=(pa.TASK,), limit=2)
    ids = [p.id for p in problems]
    fp16 = {"ids": ids, "correct": [1, 1], "predicted": [p.answer for p in problems]}  # as if fp16 solved both
    run = pa.EngineRun({"kv_mode": "diffkv", "alpha_high": 4.0, "alpha_low": 1.0, "window": 8}, (("diffkv", None),))
    r = pa.run_engine(model, run, problems, 8, fp16)["diffkv"]
    wrong = [i for i, c in zip(ids, r["correct"]) if not c]
    assert [f["id"] for f in r["failing"]] == wrong and r["pruning"]["fp16_only"]["problems"] == len(wrong) > 0
    for f in r["failing"]:
        assert f["fp16_predicted"] is not None and f["prompt_tokens"] > 0
        assert f["question_numbers"] and all(0 <= q["pruned_share"] <= 1 for q in f["question_numbers"])
        assert all(q["text"].strip() and any(ch.isdigit() for ch in q["text"]) for q in f["question_numbers"])
        assert all(set(q["layers_lost"]) <= set(range(model.ckpt.arch.num_layers)) for q in f["question_numbers"])
