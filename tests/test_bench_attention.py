"""benchmarks/attention.py keeps working: its --smoke mode (CPU, impl="ref" + SDPA, tiny shapes) writes rows for
every page precision and both SDPA baselines, a floor fitted to SDPA and the verdict; its floor fit and head
layouts are right."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_smoke(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["device"] and res["torch"] and "triton" in res and "attention.py" in res["command"]
    rows = res["rows"]
    precisions = {"fp16", "K8V8", "fp8", "int4", "K8V4", "K4V2", "mix", "sdpa-gqa", "sdpa-fold"}
    assert {r["precision"] for r in rows} == precisions
    shapes = {(r["batch"], r["seq"]) for r in rows}
    for p in precisions:  # every precision at every smoke shape
        assert {(r["batch"], r["seq"]) for r in rows if r["precision"] == p} == shapes
    for r in rows:
        assert r["time_us"] > 0 and r["bytes"] > 0 and r["gb_s"] > 0
        assert r["speedup_vs_fp16"] > 0 and r["speedup_vs_sdpa"] > 0
    # Compressed pages read fewer bytes than fp16 ones, in the expected order.
    b = {r["precision"]: r["kv_bytes"] for r in rows if r["seq"] == max(s for _, s in shapes)}
    assert b["fp16"] > b["K8V8"] > b["K8V4"] > b["mix"] > b["int4"] > b["K4V2"]
    assert b["fp8"] == b["K8V8"]  # e4m3 codes: the same bytes per token as integer K8V8
    assert b["fp16"] == b["sdpa-gqa"]
    # The correctness pass ran for every precision; the fp16 reference matched SDPA on the same data.
    assert {c["precision"] for c in res["checks"]} == precisions - {"sdpa-gqa", "sdpa-fold"}
    assert res["checks"][0]["ref_vs_sdpa_gqa"] < 4e-3
    # A floor from the SDPA rows, every row placed against it; no smoke shape is large enough to be judged.
    assert res["floor"]["points"] == len(shapes) and res["floor"]["t0_us"] is not None
    assert all(r["of_floor"] > 0 and r["floor_us"] > 0 for r in rows)
    assert res["targets"]["of_floor"]["rows"] == 0 and res["targets"]["of_floor"]["pass"] is None
    assert res["targets"]["big_reads"]["rows"] == 0


def test_floor_fit_recovers_a_line():
    """fit_floor returns the t0 and bandwidth of points on t0 + bytes / bw, and reports the residual of noise."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import fit_floor

    pts = [(b, 7.3 + b / 3.09e12 * 1e6) for b in (1e5, 3e7, 1.3e8, 5e8, 2e9)]
    fit = fit_floor(pts)
    assert abs(fit["t0_us"] - 7.3) < 1e-6 and abs(fit["bw"] / 3.09e12 - 1) < 1e-9
    assert fit["max_rel_residual"] < 1e-9
    noisy = [(b, t * (1.05 if i == 2 else 1.0)) for i, (b, t) in enumerate(pts)]
    assert 0.02 < fit_floor(noisy)["max_rel_residual"] < 0.06
    # Times that extrapolate to a negative fixed cost (CPU noise on tiny shapes) fit a floor with t0 = 0, not below.
    steep = [(b, -2.0 + b / 1e9 * 1e6) for b in (1e5 * 40, 3e7, 1.3e8)]
    fit = fit_floor(steep)
    assert fit["t0_us"] == 0.0 and fit["bw"] > 0
    assert all(fit["t0_us"] + b / fit["bw"] * 1e6 > 0 for b, _ in steep)
    # Times that fall as bytes grow fit a constant floor (no bandwidth term), still positive.
    flat = [(1e5, 9.0), (1e6, 8.0), (1e7, 7.0)]
    fit = fit_floor(flat)
    assert fit["bw"] == float("inf") and 7.0 < fit["t0_us"] < 9.0


def test_head_layouts_match_the_model_presets():
    """attention.HEADS (kept import-free for the GPU box) names the presets' own head counts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from attention import HEADS

    from diffkv_serve.engine.loader.presets import ARCH_PRESETS

    for name, (hq, hkv, d) in HEADS.items():
        arch = ARCH_PRESETS[name]
        assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (hq, hkv, d)
    assert {hq // hkv for hq, hkv, _ in HEADS.values()} == {4, 6}
