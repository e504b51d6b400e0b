import os

import pytest
import torch
import triton
import triton.language as tl

from kernels.quant import codes_as_f16, dequantize_ref, quantize_ref, quantize_tile, unpack_ref, unpack_tile

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Round trip |x - dequant(quant(x))| <= scale/2 + FP16_SLACK[dtype] * (|min| + (max - min)) + 1e-6 * |x|:
# half a quantization step plus the fp16 rounding of the stored zero point and scale (2^-11 each, doubled).
# Triton's quantization must equal the reference bit for bit (tolerance 0) for every input dtype.
FP16_SLACK = {torch.float32: 2.0 ** -10, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -10}
TOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0}  # triton vs reference (bytes, fp16 meta)
BITS = (8, 4, 2)


def _rows(n, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) * torch.rand(n, 1, generator=g) * 4 + torch.randn(n, 1, generator=g) * 3
    x[0] = x[0] * 1e-3 + 100.0  # tiny range far from zero
    x[1, : D // 2] = 5.0  # two clusters
    return x.to(dtype)


def _naive_pack(q, bits):
    """Planar layout by a plain loop: element d -> byte d % (D/r), bit offset (d // (D/r)) * bits."""
    D = len(q)
    r = 8 // bits
    out = [0] * (D * bits // 8)
    for d in range(D):
        out[d % (D // r)] |= int(q[d]) << ((d // (D // r)) * bits)
    return torch.tensor(out, dtype=torch.uint8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 24])
def test_round_trip_bound(bits, dtype, D):
    x = _rows(37, D, dtype, seed=bits * D)
    packed, scale, zero = quantize_ref(x, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (37, D * bits // 8)
    assert scale.dtype == zero.dtype == torch.float16 and (scale > 0).all()
    deq = dequantize_ref(packed, scale, zero, bits, D)
    xf = x.float()
    mn, mx = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    bound = scale.float()[:, None] / 2 + FP16_SLACK[dtype] * (mn.abs() + (mx - mn)) + 1e-6 * xf.abs()
    err = (xf - deq).abs()
    assert (err <= bound).all(), float((err - bound).max())
    # The codes use the whole range: the row minimum and maximum map (close) to 0 and 2^b - 1.
    q = unpack_ref(packed, bits)
    assert (q.amin(-1) == 0).float().mean() > 0.9 and (q.amax(-1) == (1 << bits) - 1).float().mean() > 0.9


@pytest.mark.parametrize("bits", BITS)
def test_constant_row_and_ties(bits):
    qmax = (1 << bits) - 1
    x = torch.full((3, 64), 0.375)  # max == min: scale stays > 0 and the row decodes exactly to its min
    x[1] = -2.5
    packed, scale, zero = quantize_ref(x, bits)
    assert (scale > 0).all() and torch.equal(dequantize_ref(packed, scale, zero, bits, 64), x)
    # Exact ties: min 0, max qmax -> scale 1, so x = k + 0.5 sits halfway; floor(y + 0.5) rounds it up.
    g = torch.Generator().manual_seed(bits)
    row = torch.randint(0, 2 * qmax + 1, (2, 64), generator=g).float() / 2
    row[:, 0], row[:, 1] = 0.0, float(qmax)
    packed, scale, zero = quantize_ref(row, bits)
    assert (scale == 1).all() and (zero == 0).all()
    assert torch.equal(unpack_ref(packed, bits), torch.floor(row + 0.5).int())


@pytest.mark.parametrize("bits", BITS)
def test_planar_layout_matches_naive_loop(bits):
    x = _rows(5, 64, torch.float32, seed=3)
    packed, scale, zero = quantize_ref(x, bits)
    q = unpack_ref(packed, bits)
    for i in range(5):
        assert torch.equal(_naive_pack(q[i], bits), packed[i])
        # decode the bytes by a plain loop too
        r, D = 8 // bits, 64
        naive = [(int(packed[i, d % (D // r)]) >> ((d // (D // r)) * bits)) & ((1 << bits) - 1) for d in range(D)]
        assert q[i].tolist() == naive
        expect = torch.tensor(naive, dtype=torch.float64) * float(scale[i]) + float(zero[i])
        torch.testing.assert_close(dequantize_ref(packed[i], scale[i], zero[i], bits, D).double(), expect,
                                   atol=1e-6, rtol=1e-6)


@triton.jit
def _roundtrip_kernel(x_ptr, packed_ptr, meta_ptr, codes_ptr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                      D: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + m[:, None] * D + d[None, :]).to(tl.float32)
    packed, scale, zero = quantize_tile(x, BITS, BLOCK_M, D)
    RB: tl.constexpr = D * BITS // 8
    j = tl.arange(0, RB)
    tl.store(packed_ptr + m[:, None] * RB + j[None, :], packed.to(tl.uint8))
    tl.store(meta_ptr + m * 2, scale)
    tl.store(meta_ptr + m * 2 + 1, zero)
    codes = unpack_tile(tl.load(packed_ptr + m[:, None] * RB + j[None, :]), BITS, BLOCK_M, D)
    tl.store(codes_ptr + m[:, None] * D + d[None, :], codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_tile_helpers_match_reference(bits, dtype):
    M, D = 32, 64
    x = _rows(M, D, dtype, seed=bits).to(DEVICE)
    x[2] = 0.375  # constant row
    x[3] = (torch.arange(D, device=DEVICE) % ((1 << bits) * 2 - 1)).to(dtype) / 2  # exact ties
    packed = torch.full((M, D * bits // 8), 0xAB, dtype=torch.uint8, device=DEVICE)
    meta = torch.full((M, 2), float("nan"), dtype=torch.float16, device=DEVICE)
    codes = torch.full((M, D), -1, dtype=torch.int32, device=DEVICE)
    _roundtrip_kernel[(M // 16,)](x, packed, meta, codes, BITS=bits, BLOCK_M=16, D=D, enable_fp_fusion=False)
    rp, rs, rz = quantize_ref(x, bits)
    assert TOL[dtype] == 0.0
    assert torch.equal(packed, rp)
    assert torch.equal(meta[:, 0], rs) and torch.equal(meta[:, 1], rz)
    assert torch.equal(codes, unpack_ref(rp, bits))


@triton.jit
def _codes_as_f16_kernel(codes_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, codes_as_f16(tl.load(codes_ptr + i)))


def test_codes_as_f16_is_exact_for_every_byte():
    """The decode kernel's conversion-free int->fp16 trick gives exactly c for every code 0..255."""
    codes = torch.randperm(256, generator=torch.Generator().manual_seed(3)).to(torch.int32).to(DEVICE)
    out = torch.full((256,), float("nan"), dtype=torch.float16, device=DEVICE)
    _codes_as_f16_kernel[(1,)](codes, out, N=256)
    assert torch.equal(out.float(), codes.float())
