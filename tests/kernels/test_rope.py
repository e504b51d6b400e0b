import os

import pytest
import torch

from diffkv_serve.kernels.rope import apply_rope, rope_ref

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# The kernel rotates in fp32 and rounds once; the reference rounds after each multiply in x's dtype.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])


def _tables(N, D, g):
    pos = torch.randint(0, 4096, (N,), generator=g).double()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(pos, inv)
    return f.cos().float().to(DEVICE), f.sin().float().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,H,D", [(1, 6, 64), (7, 20, 128), (3, 3, 32)])
@pytest.mark.parametrize("with_shift", [False, True])
def test_matches_reference(dtype, N, H, D, with_shift):
    g = torch.Generator().manual_seed(N * H * D + with_shift)
    # a strided view like q/k inside the fused qkv projection: heads contiguous, rows wider than the heads
    qkv = (torch.randn(N, H + 2, D, generator=g) * 4).to(DEVICE, dtype)
    x = qkv[:, :H]
    # a large channel offset like Qwen2's k_proj bias, which the shift removes (key centering)
    shift = (torch.randn(H, D, generator=g) + torch.where(torch.arange(D) == D - 1, 300.0, 0.0)).to(DEVICE, dtype) \
        if with_shift else None
    cos, sin = _tables(N, D, g)
    out = apply_rope(x, cos, sin, shift, impl="triton")
    ref = rope_ref(x.float(), cos, sin, None if shift is None else shift.float())  # exact target
    assert out.shape == x.shape and out.dtype == dtype
    scale = ref.abs().amax().item()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * scale, rtol=TOL[dtype])
    same_dtype_ref = rope_ref(x, cos, sin, shift)  # what the CPU path computes
    torch.testing.assert_close(out.float(), same_dtype_ref.float(), atol=2 * TOL[dtype] * scale, rtol=2 * TOL[dtype])


def test_bad_inputs():
    x = torch.randn(2, 3, 8, device=DEVICE)
    cos = torch.randn(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(x, cos[:, :3], cos[:, :3])
    with pytest.raises(ValueError, match="shift"):
        apply_rope(x, cos, cos, torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(2, 3, 7, device=DEVICE), cos, cos)
