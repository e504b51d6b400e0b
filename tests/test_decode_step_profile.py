"""benchmarks/decode_step_profile.py on CPU: kernel names sort into what they do, the decode step is the long run
minus the short one, and the smoke run profiles our engine while saying why vLLM did not run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_step_profile as dsp  # noqa: E402


@pytest.mark.parametrize("kernel,cat", [
    ("void flash::FlashAttnFwdSm90<cutlass::bfloat16_t>(...)", "attention"),  # before gemm: "Sm90", "cutlass"
    ("decode_mma", "attention"),
    ("decode_f16_kernel", "attention"),
    ("_decode_reduce_kernel", "attention"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_coopB_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("_rms_norm_kernel", "norm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
    ("_silu_mul_kernel", "activation"),
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps>", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor>", "copy"),
    ("triton_poi_fused_add_0", "other"),
])
def test_categories(kernel, cat):
    assert dsp.category(kernel) == cat


def test_per_step_subtracts_the_short_run():
    short = {"gemm_a": [10, 100.0], "prefill_only": [4, 400.0], "norm": [2, 4.0]}
    long = {"gemm_a": [50, 500.0], "prefill_only": [4, 400.0], "norm": [10, 20.0], "decode_only": [8, 24.0]}
    rows = dsp.per_step(short, long, 4)
    assert [r["kernel"] for r in rows] == ["gemm_a", "decode_only", "norm"]  # by time; prefill_only cancels
    assert rows[0]["calls"] == 10 and rows[0]["us"] == 100.0
    assert rows[1]["calls"] == 2 and rows[1]["us"] == 6.0
    cats = dsp.summarize(rows)
    assert cats["other"] == {"calls": 2.0, "us": 6.0} and cats["norm"] == {"calls": 2.0, "us": 4.0}


def test_bad_arguments_name_the_flag():
    with pytest.raises(ValueError, match="--batch"):
        dsp.parse_args(["--batch", "0"])
    with pytest.raises(ValueError, match="--model"):
        dsp.parse_args(["--model", "some/folder"])


@pytest.mark.slow
def test_smoke(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_step_profile.py"), "--smoke", "--out", str(out)],
                   check=True, cwd=ROOT, timeout=300)
    d = json.loads(out.read_text())
    ours = d["engines"]["ours"]
    assert "error" not in ours and ours["kv_mode"] == "fp16"
    assert ours["wall_ms_per_step"] > 0 and ours["kernels_per_step"] > 0
    assert ours["kernel_ms_per_step"] == pytest.approx(sum(r["us"] for r in ours["kernels"]) / 1e3)
    assert sum(c["us"] for c in ours["categories"].values()) == pytest.approx(ours["kernel_ms_per_step"] * 1e3)
    # The prefill alone (the short call): its wall time and what its kernels did.
    assert ours["prefill_ms"] > 0 and ours["prefill_tokens"] == 4 * 32 and ours["prefill_kernels"]
    assert sum(c["us"] for c in ours["prefill_categories"].values()) == pytest.approx(ours["prefill_kernel_ms"] * 1e3)
