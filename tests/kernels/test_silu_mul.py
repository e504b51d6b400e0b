import os

import pytest
import torch

from diffkv_serve.kernels.silu_mul import silu_mul, silu_mul_ref

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# 16-bit: silu is rounded to the dtype before the product in both; exp implementations differ by an ulp.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,I", [(1, 96), (4, 1500), (2, 2048)])
def test_matches_reference(dtype, N, I):
    g = torch.Generator().manual_seed(N + I)
    x = (torch.randn(N, 2 * I, generator=g) * 3).to(DEVICE, dtype)
    out = silu_mul(x, impl="triton")
    assert out.shape == (N, I) and out.dtype == dtype
    torch.testing.assert_close(out.float(), silu_mul_ref(x).float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_input():
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.randn(2, 7, device=DEVICE))
