"""Benchmark scripts keep working: their --smoke modes run tiny shapes on CPU."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_decode_throughput_smoke(tmp_path):
    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["decode_tok_s"] > 0 and r["roofline_tok_s"] > 0 for r in rows)


def test_key_centering_cost_smoke(tmp_path):
    out = tmp_path / "centering.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"), "--smoke", "--kv-mode", "int4",
                    "--key-centering", "off", "bias", "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    r = json.loads(out.read_text())
    assert r["order"] == ["off", "bias", "bias", "off"]
    assert r["modes"]["off"]["mode"] == "off" and r["modes"]["bias"]["mode"] == "bias"
    row = r["rows"][0]
    assert len(row["step_ms"]["bias"]) == 2 and all(t > 0 for t in row["step_ms"]["off"] + row["step_ms"]["bias"])
    assert row["ratio_vs_off"]["off"] == 1.0


def test_kv_rotation_cost_smoke(tmp_path):
    out = tmp_path / "rotation.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"), "--smoke", "--kv-mode", "int4",
                    "--kv-rotation", "off", "hadamard", "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    r = json.loads(out.read_text())
    assert r["benchmark"] == "kv_rotation_decode_cost" and r["order"] == ["off", "hadamard", "hadamard", "off"]
    assert r["modes"] == {"off": "off", "hadamard": "hadamard"}
    row = r["rows"][0]
    assert all(t > 0 for t in row["step_ms"]["off"] + row["step_ms"]["hadamard"])


def test_decode_splits_smoke(tmp_path):
    out = tmp_path / "splits.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_splits.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["fp16", "K4V4", "mix"]
    assert all(set(r["us"]) == {"1", "2"} and r["best_us"] == min(r["us"].values()) for r in rows)
    score = rows[-1]["score"]  # diffkv rows also time the score update per split count
    assert "score" not in rows[0] and {"1", "2"} <= set(score["us"]) and score["best_us"] == min(score["us"].values())


def test_decode_stages_smoke(tmp_path):
    out = tmp_path / "stages.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_stages.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["K8V8", "fp8", "K8V4", "mix"]
    for r in rows:  # both stage counts at each split count, plus the automatic pick (2 pairs: two stages)
        assert {"2st/1", "2st/2", "1st/1", "1st/2"} <= set(r["us"]) and r["auto"].startswith("2st/")
        assert r["best_us"] == min(r["us"].values()) and r["auto_us"] == r["us"][r["auto"]] and r["pairs"] == 4


def test_tune_decode_attention_smoke(tmp_path):
    out = tmp_path / "tune.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tune_decode_attention.py"), "--smoke", "--out",
                    str(out)], check=True, cwd=ROOT, timeout=300)
    r = json.loads(out.read_text())
    # every shape: the dispatcher's launch, then each configuration at each split count (0: its automatic count)
    launches = [(tuple(x["config"]), x["splits"]) for x in r["rows"] if x["precision"] == "mix"]
    assert launches == [(("auto",), 0), ((32, 4, 1), 0), ((32, 4, 1), 2), ((32, 4, 2), 0), ((32, 4, 2), 2)]
    assert [(s["precision"], s["batch"], s["seq"]) for s in r["per_shape"]] == [("fp16", 2, 100), ("mix", 2, 100)]
    assert all(x["max_err"] < 4e-3 for x in r["rows"])


def test_decode_merge_smoke(tmp_path):
    out = tmp_path / "merge.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_merge.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["heads"], r["splits"]) for r in rows] == [(2, 3, 4), (1, 2, 64)]
    # head_dim 32 in one slice: 4 splits fill 4 warps' 4,096 elements at 32 rows (16, the cap); 64 splits, 1 warp: 1
    assert [(r["rows"], r["chunk"], r["warps"]) for r in rows] == [(16, 32, 4), (1, 32, 1)]
    assert all(r["max_err"] < 2e-3 and r["us"] > 0 and r["us_whole_rows"] > 0 for r in rows)  # fp16 output


def test_q_precision_smoke(tmp_path):
    out = tmp_path / "q.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "q_precision.py"), "--smoke", "--key-centering",
                    "served", "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["rotation"], r["kv"], r["q"]) for r in rows} == {
        (rot, kv, q) for rot in ("off", "hadamard") for kv in ("K4V4", "K4V2")
        for q in ("fp16", "int16", "int8", "int8/zq")}
    by = {(r["rotation"], r["kv"], r["q"]): r for r in rows}
    for rot in ("off", "hadamard"):
        for kv in ("K4V4", "K4V2"):
            assert by[rot, kv, "fp16"]["q_alone_max"] == 0 and by[rot, kv, "fp16"]["total_mean"] > 0
            # 16-bit q adds a small share of what 4-bit keys cost, the 8-bit q the kernel takes against them more
            # (still a small part), and more again with the zero points' term on q as given
            assert 0 < by[rot, kv, "int16"]["share_max"] < 0.05
            assert by[rot, kv, "int8"]["q_alone_mean"] > 10 * by[rot, kv, "int16"]["q_alone_mean"]
            assert by[rot, kv, "int8"]["share_mean"] < 0.15
            assert by[rot, kv, "int8/zq"]["q_alone_mean"] > by[rot, kv, "int8"]["q_alone_mean"]


def test_p_precision_smoke(tmp_path):
    out = tmp_path / "p.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "p_precision.py"), "--smoke", "--kv", "K4V4", "K8V4",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    by = {(r["rotation"], r["kv"], r["p"]): r for r in rows}
    assert set(by) == {(rot, kv, p) for rot in ("off", "hadamard") for kv in ("K4V4", "K8V4")
                       for p in ("fp16", "u8/tile", "u7/tile")}
    for rot in ("off", "hadamard"):
        for kv in ("K4V4", "K8V4"):
            assert by[rot, kv, "fp16"]["p_alone_max"] == 0 and by[rot, kv, "fp16"]["total_mean"] > 0
            # integer weights add a small share of what the cache's quantization costs, 7 bits about twice 8 bits'
            assert 0 < by[rot, kv, "u8/tile"]["share_max"] < 0.2
            assert 1.5 < by[rot, kv, "u7/tile"]["p_alone_mean"] / by[rot, kv, "u8/tile"]["p_alone_mean"] < 2.6


def test_decode_sass_smoke(tmp_path):
    """The decode kernel compiled for sm_90 on this (GPU-less) machine: its main loop holds the tile's mmas."""
    out = tmp_path / "sass.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_sass.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kernel"] == "_decode_split_kernel" and row["registers"] > 0 and row["shared_bytes"] > 0
    # 128-token tile, head_dim 64, group 4 in 8 rows: 16 mmas each for q.k and p.v per quarter pair
    assert row["hmma"] > 0 and 0 < row["loop"] < row["sass_total"] and row["loop_per_token"] > 0
    assert 0 < row["before_loop"] < row["sass_total"] - row["loop"] and "date" in json.loads(out.read_text())
    assert sum(row["opcodes"].values()) == row["loop"]


def test_fp8_values_convert_before_the_transpose(tmp_path):
    """The q8 kernel's e4m3 value codes are converted in registers before Triton's shared-memory transpose (so the
    value dot reads fp16 pairs): no single-byte shared loads in its sm_90 main loop, and no more instructions per
    tile than the integer K8V8 codes take."""
    out = tmp_path / "sass.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_sass.py"), "--precisions", "K8V8", "fp8",
                    "--hq", "12", "--hkv", "2", "--seq", "256", "--batch", "32", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = {r["precision"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp8"]["kernel"] == rows["K8V8"]["kernel"] == "decode_q8_kernel"
    assert "LDS.U8" not in rows["fp8"]["opcodes"] and rows["fp8"]["opcodes"]["F2FP.F16.E4M3.UNPACK_B"] > 0
    assert rows["fp8"]["loop"] <= rows["K8V8"]["loop"]


def test_memory_manager_smoke(tmp_path):
    out = tmp_path / "mm.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_manager.py"), "--smoke", "--engine",
                        "--out", str(out)], check=True, cwd=ROOT, timeout=300, capture_output=True, text=True)
    d = json.loads(out.read_text())
    rows = d["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["prompt_mm_ms"] > 0 and r["gen_mm_ms"] > 0 for r in rows)
    # one engine for every engine batch, each timed with its memory-management share
    assert [e["batch"] for e in d["engine"]] == [2, 3] and d["skipped"] == []
    for e in d["engine"]:
        assert e["steps"] == 3 and e["decode_step_ms"] > 0 and 0 < e["engine_mm_ms"] < e["decode_step_ms"]
        assert e["mm_share_engine"] == pytest.approx(e["engine_mm_ms"] / e["decode_step_ms"])
    assert d["engine"][0]["mm_share_isolated"] > 0  # batch 2 has an isolated row too
    # progress lines as each phase ends, with the time since the start
    assert "engine batch 3: first decode step" in r.stdout and "] cpu batch 1: prompt MM" in r.stdout


def test_memory_manager_time_limit(tmp_path):
    """Past --time-limit nothing starts, and the JSON still says what was skipped."""
    out = tmp_path / "mm.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_manager.py"), "--smoke", "--engine",
                    "--time-limit", "0.001", "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    d = json.loads(out.read_text())
    assert d["rows"] == [] and d["skipped"] == [{"device": "cpu", "batch": 1}, {"device": "cpu", "batch": 2}]
    assert [(e["batch"], e["skipped"]) for e in d["engine"]] == [(2, "time limit"), (3, "time limit")]


def test_host_overhead_smoke(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    d = json.loads(out.read_text())
    assert [(r["mode"], r["async_steps"], r["batch"]) for r in d["rows"]] == [
        (m, a, b) for m in ("int4", "diffkv") for a in (False, True) for b in (2, 4)]  # synchronous and async steps
    for r in d["rows"]:
        ms = r["ms"]
        assert r["running"] == r["batch"] and ms["step"] > 0 and ms["wait"] > 0  # every sequence decoded
        parts = sum(ms[p] for p in ("schedule", "inputs", "launch", "wait", "outputs"))
        assert abs(parts - ms["step"]) < 1e-6 and abs(ms["host"] - (ms["step"] - ms["wait"])) < 1e-6
        assert all(ms[p] >= 0 for p in ("schedule", "inputs", "launch", "outputs"))


@pytest.mark.slow
def test_throughput_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--smoke", "--quiet", "--out",
                    str(out), "--modes", "fp16", "diffkv:alpha_low=0.01,window=8"], check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    spec = "diffkv:alpha_low=0.01,window=8"
    assert [r["mode"] for r in rows] == ["fp16", f"{spec}/worst_case", f"{spec}/learned"]
    assert rows[1]["settings"]["alpha_low"] == 0.01 and rows[1]["settings"]["window"] == 8
    for r in rows:
        assert r["tokens"] == 4 * 16 and r["tokens_per_s"] > 0 and r["steps"] > 0
        assert r["max_batch"] >= 1 and r["compression_ratio"] > 0 and r["preemptions"] >= 0
    assert rows[1]["compression_ratio"] > rows[0]["compression_ratio"]
    assert rows[1]["overflows"] == 0 and rows[2]["overflows"] >= 0 and rows[2]["reservation"] == "learned"
    for r in rows:  # --smoke traces every step: one sample per step, pages and token classes consistent
        tr = r["trace"]
        assert len(tr["samples"]) == r["steps"]
        for sample in tr["samples"]:
            s = dict(zip(tr["fields"], sample))
            assert s["num_running"] <= 4 and s["pages_used"] <= r["pages_total"]
            assert s["tokens_high"] + s["tokens_low"] + s["tokens_pruned"] > 0 or s["cached_tokens"] == 0


def test_throughput_mode_settings():
    """--modes entries: a KV mode, for diffkv optionally with cache settings; bad ones name what is wrong."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("throughput_bench", ROOT / "benchmarks" / "throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_mode("int4") == ("int4", {}) and mod.parse_mode("fp8") == ("fp8", {})
    assert mod.parse_mode("diffkv:alpha_low=0.06,high=K8V8,window=32") == (
        "diffkv", {"alpha_low": 0.06, "high": "K8V8", "window": 32})
    for bad, words in (("int3", "kv mode"), ("diffkv:beta=1", "beta"), ("diffkv:alpha_low=x", "alpha_low"),
                       ("int4:alpha_low=0.1", "only diffkv"), ("diffkv:window", "key=value")):
        with pytest.raises(ValueError, match=words):
            mod.parse_mode(bad)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--modes", "diffkv:beta=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "beta" in r.stderr


def test_recorded_results_docs_are_generated_not_typed():
    """benchmarks/results/README.md and docs/PERFORMANCE.md are exactly what the recorded JSON files render."""
    mod = _load_script("summarize_results")
    index, performance = mod.render()
    assert (ROOT / "benchmarks" / "results" / "README.md").read_text() == index
    assert (ROOT / "docs" / "PERFORMANCE.md").read_text() == performance
    assert "vs fp16" in performance and "`python benchmarks/throughput_qwen.py" in performance
    assert len(performance.splitlines()) <= 250 and "/root/" not in performance


def test_recorded_results_are_small_and_all_indexed():
    """Every recorded file is listed in the index, and the folder stays small."""
    results = ROOT / "benchmarks" / "results"
    files = [p for p in results.iterdir() if p.name != "README.md"]
    index = (results / "README.md").read_text()
    assert all(f"`{p.name}`" in index for p in files)
    assert sum(p.stat().st_size for p in results.iterdir()) <= 2 * 1024 * 1024


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("spec,bound", [("K8V4", 0.15), ("K8V4+K4V2", 0.4)])  # + half the tokens at 2-bit values
def test_decode_sweeps_time_quantized_tokens(spec, bound):
    """The cache decode_kernel_ab.py, decode_splits.py and decode_stages.py time (attention.decode_inputs) holds the
    engine's codes and finite scales of real keys and values (random bytes had NaN / infinite scales, which skip
    the softmax's rescale path and so time a different kernel run): the reference decode over it matches dense
    attention over the unquantized tokens to the format's error."""
    import math

    import torch

    from diffkv_serve.kernels.decode_attention import paged_decode_attention
    from diffkv_serve.kernels.page_layout import page_bytes_for

    _load_script("decode_kernel_ab")
    attention = sys.modules["attention"]
    B, S, hkv, hq = 2, 300, 2, 4
    hi, lo = attention.parse_spec(spec, 128, page_bytes_for(16, 128, 2), 2)
    c = attention.decode_inputs(hi, lo, B, hq, hkv, S, torch.float16, "cpu", 0, seed=3)
    assert len(c.pools) == 1 and c.lengths.flatten().tolist() == [S - S // 2 if lo else S] * (B * hkv)
    assert c.len_low is None if lo is None else c.len_low.flatten().tolist() == [S // 2] * (B * hkv)
    q = torch.randn(B, hq, 128, generator=torch.Generator().manual_seed(4)).half()  # c.q is unseeded
    out = paged_decode_attention(q, c.pools[0], hi, torch.float16, c.page_table, c.lengths, c.slots, 0,
                                 1 / math.sqrt(128), fmt_low=lo, len_low=c.len_low, impl="ref")
    K, V = attention.make_kv(B, hkv, S, 128, torch.float16, "cpu", 3)  # the tokens decode_inputs wrote
    want = attention.sdpa(q.float(), K.float(), V.float(), "gqa")
    assert out.isfinite().all()
    rel = ((out.float() - want).norm(dim=-1) / want.norm(dim=-1)).max()
    assert rel < bound, rel  # measured 0.08 (K8V4) and 0.28 (with the K4V2 low section)


@pytest.fixture(scope="module")
def step_breakdown_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_breakdown") / "step_breakdown.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_step_breakdown_smoke(step_breakdown_json):
    d = step_breakdown_json
    cats = ("model", "attention", "policy", "memory", "other")
    by_key = {}
    for r in d["rows"]:
        by_key.setdefault((r["mode"], r["batch"], r["seq"]), []).append(r)
    assert set(by_key) == {(m, b, s) for m in ("fp16", "diffkv") for b in (2, 3) for s in (16, 64)}
    skipped = [rows[0] for rows in by_key.values() if "skipped" in rows[0]]
    # The smoke pool (48 pages) holds everything but fp16 3 x 64; a skip is exactly "does not fit".
    assert [(r["mode"], r["batch"], r["seq"]) for r in skipped] == [("fp16", 3, 64)]
    for (mode, batch, seq), rows in by_key.items():
        if "skipped" in rows[0]:
            assert len(rows) == 1 and rows[0]["pages_needed"] > rows[0]["pages_free"]
            continue
        assert [r["phase"] for r in rows] == ["prompt", "decode"]
        for r in rows:
            # Every moment of device work counts once: the categories add up to the busy time, host is the rest.
            assert all(r[f"{c}_ms"] >= 0 for c in cats)
            assert sum(r[f"{c}_ms"] for c in cats) == pytest.approx(r["busy_ms"], rel=1e-6)
            assert r["host_ms"] == pytest.approx(max(0.0, r["wall_ms"] - r["busy_ms"]))
            assert r["pct"]["host"] == pytest.approx(100 * r["host_ms"] / r["wall_ms"])
            assert r["model_ms"] > 0 and r["attention_ms"] > 0 and r["memory_ms"] > 0
            # Only diffkv has a compression policy: significance and classification, Algorithm 1, scores.
            assert (r["policy_ms"] > 0) == (mode == "diffkv")
        prompt, decode = rows
        assert decode["seqs_per_step"] == batch and decode["preemptions"] == 0
        assert decode["wall_source"] == "unprofiled" and decode["profiled_steps"] == decode["unprofiled_steps"] == 2
        assert decode["mm_timer_ms"] > 0
        # 32-token prompt steps: prompts of 64 run one per step, so later ones are timed without the profiler.
        assert prompt["seqs_per_step"] == (1 if seq == 64 else 2)
        assert prompt["wall_source"] == ("unprofiled" if seq == 64 else "profiled")
    assert d["targets"]["rows"] == 0 and d["targets"]["memory"]["pass"] is None


def test_step_breakdown_attributes_graph_replays():
    """GPU path on synthetic profiler events: a kernel counts by its name, else by the range its launch (the
    CUDA runtime call with its correlation id, else the torch op it came from) was in, else as other."""
    sb = _load_script("step_breakdown")
    E = sb.Event
    events = [
        E("step_breakdown::decode", 0, 1000, "range"),
        E("diffkv::memory", 100, 200, "range"), E("cudaGraphLaunch", 110, 150, "runtime", corr=7),
        E("diffkv::policy", 240, 270, "range"), E("aten::index", 250, 260, "op", corr=21),
        E("diffkv::model", 300, 400, "range"), E("cudaGraphLaunch", 310, 350, "runtime", corr=8),
        E("cudaMemcpyAsync", 50, 60, "runtime", corr=9),
        E("cudaLaunchKernel", 2000, 2010, "runtime", corr=50),  # after the step: not counted
        E("Memcpy HtoD (Pinned -> Device)", 60, 70, "device", corr=9),
        E("_plan_kernel", 150, 190, "device", corr=7),  # policy by name inside the memory graph
        E("void at::native::vectorized_elementwise_kernel<4>", 190, 230, "device", corr=7),
        E("_move_kernel", 230, 250, "device", corr=7),
        E("void at::native::index_elementwise_kernel", 260, 280, "device", corr=99, linked=21),
        E("_decode_split_kernel", 350, 450, "device", corr=8),
        E("sm90_xmma_gemm_bf16bf16_bf16f32", 450, 750, "device", corr=8),
        E("_score_kernel", 750, 770, "device", corr=8),
        E("_write_kv_kernel", 780, 790, "device", corr=77),  # no launch record: placed by its own start
        E("sm90_xmma_gemm_tail", 990, 1010, "device", corr=8),  # counted whole past the step's end (async steps)
        E("_write_kv_kernel", 2010, 2020, "device", corr=50),
    ]
    rows, unnamed, named = sb.step_breakdown(events)
    assert len(rows) == 1
    r = rows[0]
    assert r["phase"] == "decode" and r["wall_ms"] == pytest.approx(1.0)
    expect = {"other": 10, "policy": 40 + 20 + 20, "memory": 40 + 20, "attention": 100 + 10, "model": 300 + 20}
    assert {c: round(r[f"{c}_ms"] * 1e3, 6) for c in expect} == expect
    assert r["busy_ms"] == pytest.approx(0.58) and r["no_launch"] == 1
    assert {n: u["category"] for n, u in unnamed.items()} == {
        "Memcpy HtoD (Pinned -> Device)": "other", "void at::native::vectorized_elementwise_kernel<4>": "memory",
        "void at::native::index_elementwise_kernel": "policy", "sm90_xmma_gemm_bf16bf16_bf16f32": "model",
        "sm90_xmma_gemm_tail": "model"}
    assert {n: (u["category"], round(u["us"]), u["count"]) for n, u in named.items()} == {
        "_plan_kernel": ("policy", 40, 1), "_move_kernel": ("memory", 20, 1), "_decode_split_kernel": ("attention", 100, 1),
        "_score_kernel": ("policy", 20, 1), "_write_kv_kernel": ("attention", 10, 1)}
    s = sb.summarize(rows, [0.8])
    assert s["wall_source"] == "unprofiled" and s["host_ms"] == pytest.approx(0.22)
    assert s["pct"]["model"] == pytest.approx(100 * 0.32 / 0.8)


def test_step_breakdown_reads_profiler_events():
    """Which profiler events are ranges, host ops, CUDA runtime calls and device work (the rest is dropped)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sb = _load_script("step_breakdown")

    def ev(name, dev, act=None, user=False, eid=1, linked=0):
        return SimpleNamespace(name=name, device_type=dev, activity_type=act, is_user_annotation=user,
                               time_range=SimpleNamespace(start=1.0, end=2.0), id=eid, linked_correlation_id=linked)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    got = sb.events_from_profiler([
        ev("diffkv::memory", cpu, "user_annotation", True), ev("diffkv::memory", gpu, "gpu_user_annotation", True),
        ev("step_breakdown::decode", cpu, "user_annotation", True), ev("ProfilerStep#3", cpu, "user_annotation", True),
        ev("aten::mm", cpu, "cpu_op", eid=5), ev("cudaGraphLaunch", cpu, "cuda_runtime", eid=9, linked=5),
        ev("cudaLaunchKernel", cpu, None, eid=10), ev("_plan_kernel", gpu, "kernel", eid=9, linked=5),
        ev("Memcpy DtoH (Device -> Pinned)", gpu, "gpu_memcpy", eid=11), ev("annotation", gpu, "gpu_user_annotation"),
    ])
    assert [(e.name, e.kind, e.corr, e.linked) for e in got] == [
        ("diffkv::memory", "range", 1, 0), ("step_breakdown::decode", "range", 1, 0), ("aten::mm", "op", 5, 0),
        ("cudaGraphLaunch", "runtime", 9, 5), ("cudaLaunchKernel", "runtime", 10, 0),
        ("_plan_kernel", "device", 9, 5), ("Memcpy DtoH (Device -> Pinned)", "device", 11, 0)]


@pytest.mark.slow
def test_step_breakdown_renders_into_recorded_docs(step_breakdown_json, tmp_path, monkeypatch):
    """A recorded step breakdown appears in docs/PERFORMANCE.md with its GPU, date and command."""
    mod = _load_script("summarize_results")
    monkeypatch.setattr(mod, "RESULTS", tmp_path)  # an empty results folder: nothing recorded
    index, performance = mod.render()
    assert "Where a step's time goes" not in performance and "Not measured" not in performance
    d = json.loads(json.dumps(step_breakdown_json))
    d["device"], d["date"] = "NVIDIA H200", "2030-01-02"
    (tmp_path / mod.STEP_BREAKDOWN_RUNS[0]).write_text(json.dumps(d))
    index, performance = mod.render()
    decode = next(r for r in d["rows"] if r["mode"] == "diffkv" and r.get("phase") == "decode" and r["batch"] == 3
                  and r["seq"] == 16)
    row = (f"| diffkv | 3 | 16 | decode | {decode['wall_ms']:.2f} | {decode['busy_ms']:.2f} | "
           f"{decode['pct']['model']:.1f} | {decode['pct']['attention']:.1f} |")
    assert "## Where a step's time goes" in performance and row in performance
    assert "NVIDIA H200, 2030-01-02: `python benchmarks/step_breakdown.py --smoke" in performance
    assert "- skipped: fp16 batch 3 tokens 64: needs 60 KV pages" in performance
    assert f"`{mod.STEP_BREAKDOWN_RUNS[0]}` | NVIDIA H200 | 2030-01-02 |" in index
    # a run given diffkv's thresholds and precisions names them in its rows
    d["config"]["diffkv"] = {"alpha_high": 64.0, "alpha_low": 0.0, "high": "K8V4", "low": "K4V4"}
    (tmp_path / mod.STEP_BREAKDOWN_RUNS[0]).write_text(json.dumps(d))
    assert "| diffkv K8V4/K4V4 a_h 64 a_l 0 | 3 | 16 | decode |" in mod.render()[1]


def _serve_run(label, ttft_p90_ms, per_token_ms, skipped=()):
    results = [{"rate": rate, "num_requests": 4, "completed": 4, "request_throughput": rate * 0.9,
                "output_throughput": rate * 400.0, "ttft": {"p50": t / 2, "p90": t}, "tpot": {"p50": 12.0},
                "e2el": {"p90": 9000.0}, "per_token_latency": {"mean": p}}
               for rate, t, p in zip((0.5, 1, 2), ttft_p90_ms, per_token_ms)]
    return {"label": label, "model": "SmolLM2-135M-Instruct-Q4_1", "results": results, "skipped_rates": list(skipped),
            "config": {"num_requests": 4, "max_tokens": 512, "prompts": "scripts/device/long_prompts.jsonl"}}


def test_serve_sweep_renders_into_recorded_docs(tmp_path, monkeypatch):
    """A recorded serve sweep (scripts/device/serve_sweep.sh) appears in docs/PERFORMANCE.md, with the sustained
    rates under its SLO, a row per rate and mode, and its plot drawn from the JSON."""
    mod = _load_script("summarize_results")
    monkeypatch.setattr(mod, "RESULTS", tmp_path)  # an empty results folder: nothing recorded
    _, performance = mod.render()
    assert "Serving: latency" not in performance
    assert mod.serve_sweep_section() == [] and not mod.serve_sweep_plot(tmp_path / "none.png")
    sweep = mod._sweep_module()
    runs = [_serve_run("fp16", [400, 2600, 9000], [14.5, 41.0, 220.0]),
            _serve_run("diffkv", [300, 900, 3000], [13.0, 16.2, 95.0], skipped=[4])]
    runs[0]["results"][0]["completed"] = 3  # one request failed at 0.5 req/s: fp16 sustains no rate
    setup = {"command": "bash scripts/device/serve_sweep.sh --rates 0.5,1,2", "kv_cache_memory_gb": 0.125,
             "max_num_seqs": 64, "admission": False, "prefix_caching": False}
    record = sweep.slo_summary(runs, ttft_ms=2000, percentile=90, device="NVIDIA H200", setup=setup)
    assert record["sustained_rate"] == {"fp16": None, "diffkv": 1} and record["date"]
    (tmp_path / mod.SERVE_SWEEP).write_text(json.dumps(record))
    _, text = mod.render()
    assert "## Serving: latency against Poisson request rate" in text
    assert "Highest rate sustained under the TTFT SLO (p90 <= 2 s, every request completed, at that rate and " \
           "every lower one): fp16 none, diffkv 1 req/s." in text
    assert "KV pool 0.125 GiB and max_num_seqs 64 for every mode, admission control off, prefix caching off" in text
    assert f"NVIDIA H200, {record['date']}: `bash scripts/device/serve_sweep.sh --rates 0.5,1,2`" in text
    assert f"![per-token latency and TTFT vs request rate]({Path(mod.SERVE_SWEEP).stem}.png)" in text
    # rows by rate, then in the record's run order
    lines = [ln for ln in text.splitlines() if ln.startswith("| 0.5 |") or ln.startswith("| 1 |")]
    assert lines == ["| 0.5 | fp16 | 3/4 | 0.45 | 200 | 14 | 200 | 400 | 12 | 9000 | misses |",
                     "| 0.5 | diffkv | 4/4 | 0.45 | 200 | 13 | 150 | 300 | 12 | 9000 | meets |",
                     "| 1 | fp16 | 4/4 | 0.90 | 400 | 41 | 1300 | 2600 | 12 | 9000 | misses |",
                     "| 1 | diffkv | 4/4 | 0.90 | 400 | 16 | 450 | 900 | 12 | 9000 | meets |"]
    assert "Rates skipped for time: diffkv 4." in text
    png = tmp_path / "sweep.png"
    assert mod.serve_sweep_plot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.fixture(scope="module")
def throughput_qwen_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput_qwen")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput_qwen.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    return json.loads((out / "throughput_tiny-qwen2_smoke.json").read_text())  # named by what it measures


@pytest.mark.slow
def test_throughput_qwen_smoke(throughput_qwen_json):
    """One pool for every mode, each mode's runs before the next mode's engine, fits and accuracy lookups."""
    tq = _load_script("throughput_qwen")
    d = throughput_qwen_json
    modes = tq.available_modes()  # fp8 only where the engine has that kv_mode
    assert {"fp16", "int8", "k8v4", "int4", "diffkv"} <= set(modes)
    assert [r["mode"] for r in d["rows"]] == modes
    assert d["order"] == [f"{rep}:{m}" for m in modes for rep in (0, 1)]
    assert d["skipped_runs"] == [] and d["model"] == "random:tiny-qwen2"
    rows = {r["mode"]: r for r in d["rows"]}
    assert rows["fp16"]["seqs_fit"] == 2  # --fp16-seqs 2 sized the pool
    for r in d["rows"]:
        # one pool of bytes for every mode (diffkv's pages keep score and position rows: a little larger)
        assert abs(r["pool_bytes"] - rows["fp16"]["pool_bytes"]) < r["page_bytes"]
        assert r["seqs_fit"] >= 2 and [x["repeat"] for x in r["runs"]] == [0, 1]
        assert all(x["tokens"] == 6 * 12 and x["tokens_per_s"] > 0 and not x["cut"] for x in r["runs"])
        assert r["tokens_per_s"] == pytest.approx(statistics.median(x["tokens_per_s"] for x in r["runs"]))
        assert r["spread"] >= 0 and r["vs_fp16"] > 0
        # no study of the tiny model: every row says so instead of borrowing Qwen's numbers
        assert r["accuracy"]["diff_points"] is None and "no accuracy study" in r["accuracy"]["why"]
    assert rows["fp16"]["vs_fp16"] == 1.0 and rows["int4"]["seqs_fit"] > rows["fp16"]["seqs_fit"]
    assert rows["k8v4"]["cache"]["high"] == rows["k8v4"]["cache"]["low"] == "K8V4"


def test_throughput_qwen_modes_and_time_limit():
    tq = _load_script("throughput_qwen")
    assert tq.should_start(100.0, 30.0, 140.0) and not tq.should_start(100.0, 50.0, 140.0)
    assert tq.should_start(100.0, None, 140.0) and not tq.should_start(150.0, None, 140.0)
    assert tq.mode_cache("k8v4") == {"kv_mode": "diffkv", "high": "K8V4", "low": "K8V4", "alpha_high": 0.0,
                                     "alpha_low": 0.0}
    assert tq.mode_cache("int4") == {"kv_mode": "int4"} and tq.mode_cache("diffkv") == {"kv_mode": "diffkv"}
    with pytest.raises(ValueError, match="'int3'"):
        tq.mode_cache("int3")
    assert tq.model_tag("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M") == "qwen2.5-1.5b"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput_qwen.py"), "--modes", "int3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--modes 'int3'" in r.stderr


def _summary(model="M", **cfgs):
    def cfg(cache, diff, ci):
        return {"cache": {"key_centering": "auto", **cache},
                "tasks": {"gsm_symbolic": {"n": 300, "accuracy": 0.5 + diff / 100, "diff_vs_fp16_points": diff,
                                           "diff_ci95_points": ci}}}
    return {"model": model, "configs": {k: cfg(*v) for k, v in cfgs.items()}}


def test_study_accuracy_lookup():
    """A row borrows the study's number only for the same model and the same cache settings."""
    sa = _load_script("study_accuracy")
    dk = {"kv_mode": "diffkv", "high": "K4V4", "low": "K4V2", "alpha_high": 1.0, "alpha_low": 0.02, "window": 64,
          "significance_queries": 64, "policy": "thresholds", "budget": 0.5, "layer_alpha_scale": None}
    s = _summary(fp16=({"kv_mode": "fp16"}, 0.0, [0.0, 0.0]), k4v4=({"kv_mode": "int4"}, -1.6, [-4.6, 1.4]),
                 diffkv=(dk, -1.2, [-4.2, 1.8]))
    engine = {**dk, "key_centering": "auto"}
    got = sa.accuracy_vs_fp16(s, "M", "diffkv", engine, "gsm_symbolic")
    assert (got["diff_points"], got["ci95_points"], got["n"]) == (-1.2, [-4.2, 1.8], 300)
    assert sa.accuracy_vs_fp16(s, "M", "k4v4", {"kv_mode": "int4", "key_centering": "auto", "high": "K8V4"},
                               "gsm_symbolic")["diff_points"] == -1.6  # int4 ignores the diffkv fields
    for cache, config, model, words in (({**engine, "alpha_low": 0.0}, "diffkv", "M", "alpha_low=0.02"),
                                        ({"kv_mode": "int4", "key_centering": "off"}, "k4v4", "M", "key_centering"),
                                        ({"kv_mode": "fp8", "key_centering": "auto"}, "fp8", "M", "no 'fp8'"),
                                        (engine, "diffkv", "N", "the study is of M")):
        got = sa.accuracy_vs_fp16(s, model, config, cache, "gsm_symbolic")
        assert got["diff_points"] is None and words in got["why"] and got["why"].startswith("not measured")
    assert "no chain_sum" in sa.accuracy_vs_fp16(s, "M", "k4v4", {"kv_mode": "int4", "key_centering": "auto"},
                                                 "chain_sum")["why"]
    rows = [{"mode": m, "tokens_per_s": t, "accuracy": {"diff_points": a}}
            for m, t, a in (("fp16", 100.0, 0.0), ("int8", 180.0, -0.4), ("int4", 300.0, -1.6), ("fp8", 400.0, None))]
    assert sa.fastest_within(rows, 1.0)["mode"] == "int8" and sa.fastest_within(rows, 2.0)["mode"] == "int4"


@pytest.mark.parametrize("mode", ["fp16", "fp8", "int8", "k8v4", "int4", "diffkv"])
def test_committed_qwen_study_covers_the_throughput_modes(mode):
    """Every mode of the Qwen throughput benchmark has its accuracy in the committed study."""
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.model_settings import apply_model_settings

    tq, sa = _load_script("throughput_qwen"), _load_script("study_accuracy")
    assert mode in tq.available_modes()
    name = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
    study = sa.load_study(sa.find_study(name))
    cache = apply_model_settings(EngineConfig(cache=tq.mode_cache(mode)), name).cache.model_dump()
    got = sa.accuracy_vs_fp16(study, name, tq.STUDY_NAMES[mode], cache, "gsm_symbolic")
    assert got["diff_points"] is not None and got["n"] >= 2000, (mode, got)


def test_throughput_modes_are_the_ones_the_study_test_names():
    assert sorted(_load_script("throughput_qwen").available_modes()) == sorted(
        ["fp16", "fp8", "int8", "k8v4", "int4", "diffkv"])


@pytest.mark.slow
def test_throughput_at_accuracy_renders_into_recorded_docs(throughput_qwen_json, tmp_path, monkeypatch):
    """A recorded throughput_qwen.py run appears in both documents with the accuracy column."""
    mod = _load_script("summarize_results")
    monkeypatch.setattr(mod, "RESULTS", tmp_path)
    name = mod.THROUGHPUT_AT_ACCURACY_RUNS[0]
    readme, performance = mod.render()
    assert "throughput at accuracy" not in performance and name not in readme
    d = json.loads(json.dumps(throughput_qwen_json))
    d.update(device="NVIDIA H100 80GB HBM3", study="evals/results/qwen2.5-coder-1.5b/summary.json",
             best_within="int8", skipped_runs=[{"repeat": 1, "mode": "fp16", "expected_s": 40.0}])
    rows = {r["mode"]: r for r in d["rows"]}
    rows["int8"]["accuracy"] = {"study_config": "k8v8", "diff_points": 0.0, "ci95_points": [-1.47, 1.47], "n": 500}
    (tmp_path / name).write_text(json.dumps(d))
    readme, performance = mod.render()
    r8 = rows["int8"]
    line = (f"| int8 | k8v8 | +0.0 [-1.5, +1.5] | {r8['seqs_fit']} | {r8['tokens_per_s']:.0f} | "
            f"{r8['runs'][0]['tokens_per_s']:.0f} / {r8['runs'][1]['tokens_per_s']:.0f} | {100 * r8['spread']:.1f}% |")
    assert "## Generation throughput at accuracy: random:tiny-qwen2" in performance
    assert line in performance and "| fp16 | fp16 | not measured |" in performance
    assert "Runs not started for --time-limit: 1:fp16." in performance
    assert "from `evals/results/qwen2.5-coder-1.5b" in performance
    assert "NVIDIA H100 80GB HBM3" in performance and "`python benchmarks/throughput_qwen.py --smoke" in performance
    assert f"| `{name}` | NVIDIA H100 80GB HBM3 |" in readme


@pytest.mark.slow
def test_throughput_qwen_annotate_refreshes_accuracy(throughput_qwen_json, tmp_path):
    """--annotate re-reads a study written after the run: a row gains its accuracy and the ratios follow."""
    d = json.loads(json.dumps(throughput_qwen_json))
    fp16_row = next(r for r in d["rows"] if r["mode"] == "fp16")
    int8_row = next(r for r in d["rows"] if r["mode"] == "int8")
    assert int8_row["accuracy"]["diff_points"] is None  # the tiny random model has no study
    from diffkv_serve.engine import EngineConfig
    from diffkv_serve.engine.model_settings import apply_model_settings

    tq = _load_script("throughput_qwen")

    def config(mode):  # the cache the run resolved for this mode, as the study records it
        cache = apply_model_settings(EngineConfig(cache=tq.mode_cache(mode)), d["model"]).cache.model_dump()
        return {"cache": cache, "tasks": {"gsm_symbolic": {"n": 200, "accuracy": 0.5, "diff_vs_fp16_points": 0.0,
                                                           "diff_ci95_points": [-1.0, 1.0]}}}

    study = {"model": d["model"], "configs": {"fp16": config("fp16"), "k8v8": config("int8")}}
    path, study_path = tmp_path / "run.json", tmp_path / "summary.json"
    path.write_text(json.dumps(d))
    study_path.write_text(json.dumps(study))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput_qwen.py"), "--annotate", str(path),
                    "--study", str(study_path)], check=True, cwd=ROOT, timeout=120)
    got = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    assert got["int8"]["accuracy"]["diff_points"] == 0.0 and got["int8"]["accuracy"]["n"] == 200
    assert got["fp16"]["tokens_per_s"] == fp16_row["tokens_per_s"]  # measurements untouched
    best = json.loads(path.read_text())["best_within"]
    assert best in ("fp16", "int8")
    assert got["int8"]["vs_best_within"] == pytest.approx(int8_row["tokens_per_s"] / got[best]["tokens_per_s"])


def test_sampler_cost_smoke(tmp_path):
    out = tmp_path / "sampler.json"
    subprocess.run([sys.executable, "-m", "benchmarks.sampler_cost", "--smoke", "--out", str(out)], check=True,
                   cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["sampler"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(set(r["ms"]) == {"greedy", "sampled", "penalties", "greedy_penalties", "all", "logprobs5", "one_row"} for r in rows)
    assert all(t > 0 for r in rows for t in r["ms"].values())


def test_step_breakdown_names_every_decode_attention_kernel():
    """The CUDA decode kernel (decode_mma.cu, launched by name) counts as attention, as the Triton ones do;
    neighbours of the name (the model's GEMMs, the merge of splits) keep their own category."""
    sb = _load_script("step_breakdown")
    assert sb.kernel_category("decode_mma") == "attention"
    assert sb.kernel_category("_decode_split_kernel") == "attention"
    assert sb.kernel_category("_decode_reduce_kernel") == "attention"
    assert sb.kernel_category("_score_kernel") == "policy"
    assert sb.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") is None
    assert sb.kernel_category("decode_mma_helper") is None


def test_prompt_batching_smoke(tmp_path):
    """Each mode's engine, warmed up on the whole workload, runs every variant (scheduler settings swapped in) and
    the first again; rows record the settings as resolved and what the prompt steps cost."""
    out = tmp_path / "pb.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prompt_batching.py"), "--smoke", "--warmup", "full",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=300)
    d = json.loads(out.read_text())
    assert [(r["mode"], r["resolved"]) for r in d["rows"]] == [
        (m, s) for m in ("int4", "diffkv")
        for s in ("k=1,delay=16,w=0", "k=3,delay=4,w=0.05", "k=1,delay=16,w=0")]
    for r in d["rows"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and not r["cut"] and r["prompt_steps"] >= 1
        assert r["steps"] == r["prompt_steps"] + r["decode_steps"] and r["deferred_steps"] >= 0
    assert all(r["deferred_steps"] == 0 for r in d["rows"] if r["resolved"].startswith("k=1,"))


def test_prompt_batching_variants_name_bad_settings():
    pb = _load_script("prompt_batching")
    assert pb.parse_variant("k=8,delay=16,w=0.01") == {"prefill_min_prompts": 8, "prefill_max_delay_steps": 16,
                                                       "prefill_watermark": 0.01}
    assert pb.parse_variant("prefill_min_prompts=2") == {"prefill_min_prompts": 2}
    with pytest.raises(ValueError, match="not k="):
        pb.parse_variant("batch=3")
    with pytest.raises(ValueError, match="prefill_watermark"):
        pb.parse_variant("w=1.5")
