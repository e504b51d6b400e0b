"""Benchmark scripts keep working: their --smoke modes run tiny shapes on CPU."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_throughput_smoke(tmp_path):
    out = tmp_path / "decode.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_throughput.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["decode_tok_s"] > 0 and r["roofline_tok_s"] > 0 for r in rows)


def test_memory_manager_smoke(tmp_path):
    out = tmp_path / "mm.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_manager.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["prompt_mm_ms"] > 0 and r["gen_mm_ms"] > 0 for r in rows)


def test_throughput_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--smoke", "--quiet", "--out",
                    str(out)], check=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["fp16", "diffkv/worst_case", "diffkv/learned"]
    for r in rows:
        assert r["tokens"] == 4 * 16 and r["tokens_per_s"] > 0 and r["steps"] > 0
        assert r["max_batch"] >= 1 and r["compression_ratio"] > 0 and r["preemptions"] >= 0
    assert rows[1]["compression_ratio"] > rows[0]["compression_ratio"]
    assert rows[1]["overflows"] == 0 and rows[2]["overflows"] >= 0 and rows[2]["admission"] == "learned"


def test_recorded_results_docs_are_generated_not_typed():
    """benchmarks/results/README.md and docs/PERFORMANCE.md are exactly what the recorded JSON files render."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("summarize_results", root / "benchmarks" / "summarize_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme, performance = mod.render()
    assert (root / "benchmarks" / "results" / "README.md").read_text() == readme
    assert (root / "docs" / "PERFORMANCE.md").read_text() == performance
    assert "vs fp16" in performance and "Command: `python benchmarks/throughput.py" in performance
