import os

import pytest
import torch

from diffkv_serve.kernels.rms_norm import rms_norm, rms_norm_ref

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# fp32: same operations, summation order differs; 16-bit: the reference rounds the same places, so the outputs
# may differ by one rounding step of the normalized value times the weight.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H", [(1, 64), (5, 96), (3, 512)])
@pytest.mark.parametrize("add", [False, True])
def test_matches_reference(dtype, N, H, add):
    g = torch.Generator().manual_seed(N * H + add)
    h = (torch.randn(N, H, generator=g) * 3 + 0.5).to(DEVICE, dtype)
    delta = (torch.randn(N, H, generator=g) * 2).to(DEVICE, dtype) if add else None
    w = (torch.rand(H, generator=g) + 0.5).to(DEVICE, dtype)
    h_ref, y_ref = rms_norm_ref(h, w, 1e-6, delta)
    h_out, y = rms_norm(h, w, 1e-6, delta, impl="triton")
    assert h_out.dtype == y.dtype == dtype and y.shape == (N, H)
    torch.testing.assert_close(h_out, h_ref, atol=0, rtol=0)  # the add rounds once either way
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    if not add:
        assert h_out is h


def test_strided_rows_and_bad_inputs():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 160, generator=g).to(DEVICE)
    h = base[:, :128]  # row stride 160, columns contiguous
    w = torch.rand(128, generator=g).to(DEVICE) + 0.5
    torch.testing.assert_close(rms_norm(h, w, 1e-5, impl="triton")[1], rms_norm_ref(h, w, 1e-5)[1],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(h, w[:64], 1e-5)
    with pytest.raises(ValueError, match="delta"):
        rms_norm(h, w, 1e-5, delta=h[:2])
