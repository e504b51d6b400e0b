"""benchmarks/_gpu_power.py: nvidia-smi samples parsed, summarised per time window, and nothing recorded (no
error) where there is no nvidia-smi."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _gpu_power as gp  # noqa: E402


def test_parse_sample_reads_clock_power_and_reasons():
    assert gp.parse_sample("1635, 696.24, 700.00, 0x0000000000000004") == (1635.0, 696.24, 700.0, 4)
    assert gp.parse_sample("1980, 486.3, 700.0, 0x0000000000000000\n") == (1980.0, 486.3, 700.0, 0)
    # a driver that has no such field answers "[N/A]" or another column count: no sample, no exception
    assert gp.parse_sample("1980, [N/A], 700.0, 0x0") is None
    assert gp.parse_sample("1980, 486.3") is None


def test_summarize_takes_medians_peaks_and_the_capped_share():
    s = gp.summarize([(1500.0, 700.0, 700.0, 4), (1700.0, 690.0, 700.0, 4), (1980.0, 480.0, 700.0, 0),
                      (1600.0, 699.0, 700.0, 4 | 1)])
    assert s["samples"] == 4
    assert s["sm_mhz"] == pytest.approx(1650.0)
    assert s["sm_mhz_min"] == 1500.0
    assert s["power_w_max"] == 700.0
    assert s["power_capped"] == pytest.approx(0.75)
    assert gp.summarize([]) is None


def test_window_keeps_only_the_samples_taken_inside_it():
    mon = gp.PowerMonitor()
    mon.samples = [(1.0, (1900.0, 500.0, 700.0, 0)), (2.0, (1600.0, 700.0, 700.0, 4)),
                   (3.0, (1500.0, 700.0, 700.0, 4)), (4.0, (1980.0, 450.0, 700.0, 0))]
    w = mon.window(1.5, 3.5)
    assert w["samples"] == 2 and w["power_capped"] == 1.0 and w["sm_mhz"] == pytest.approx(1550.0)
    assert mon.window(5.0, 6.0) is None


def test_without_nvidia_smi_the_monitor_records_nothing(monkeypatch):
    monkeypatch.setattr(gp.shutil, "which", lambda name: None)
    with gp.PowerMonitor() as mon:
        pass
    assert mon.samples == [] and mon.window(0.0, 1e12) is None


def test_attention_rows_carry_the_gpu_state_and_the_run_summarises_it():
    import attention

    rows = [{"precision": "K4V2", "gpu": {"samples": 3, "sm_mhz": 1650.0, "sm_mhz_min": 1500.0, "power_w_max": 701.0,
                                          "power_limit_w": 700.0, "power_capped": 1.0}},
            {"precision": "K4V2", "gpu": {"samples": 1, "sm_mhz": 1750.0, "sm_mhz_min": 1750.0, "power_w_max": 690.0,
                                          "power_limit_w": 700.0, "power_capped": 0.0}},
            {"precision": "sdpa-gqa", "gpu": {"samples": 2, "sm_mhz": 1980.0, "sm_mhz_min": 1980.0,
                                              "power_w_max": 480.0, "power_limit_w": 700.0, "power_capped": 0.0}},
            {"precision": "fp16"}]
    s = attention.gpu_state_summary(rows)
    assert set(s) == {"K4V2", "sdpa-gqa"}
    assert s["K4V2"]["sm_mhz"] == pytest.approx(1700.0) and s["K4V2"]["power_capped"] == pytest.approx(0.75)
    assert s["sdpa-gqa"]["power_capped"] == 0.0
    assert attention.gpu_state_summary([{"precision": "K4V2"}]) is None
