"""docs/OPERATIONS.md documents every metric of diffkv_serve/service/metrics.py, and the admission page states its
formulas."""
from pathlib import Path

from diffkv_serve.service.metrics import SPECS

ROOT = Path(__file__).resolve().parents[2]


def test_operations_page_documents_every_metric_with_its_description():
    page = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for spec in SPECS:
        assert f"| `{spec.name}` | {spec.kind} |" in page, f"{spec.name} is not in docs/OPERATIONS.md's metrics table"
        assert spec.description in page, f"{spec.name}: docs/OPERATIONS.md's description is out of date"


def test_admission_page_has_the_model():
    page = (ROOT / "docs" / "ADMISSION.md").read_text()
    for needle in ("Erlang", "E[W | n] = (n - C + 1) / M", "λ_max", "Retry-After", "thinning"):
        assert needle in page


def test_metrics_page_maps_every_vllm_name():
    page = (ROOT / "docs" / "METRICS.md").read_text()
    mapped = [spec for spec in SPECS if spec.vllm]
    assert len(mapped) >= 13
    for spec in mapped:
        assert f"| `{spec.name}` | `{spec.vllm}` |" in page, f"{spec.name} -> {spec.vllm} is not in docs/METRICS.md"
        prefix_swapped = "diffkv_" + spec.vllm.removeprefix("vllm:")
        assert spec.name == prefix_swapped, f"{spec.name} does not port from {spec.vllm} by prefix substitution"
    assert "docs/METRICS.md" in (ROOT / "README.md").read_text()
