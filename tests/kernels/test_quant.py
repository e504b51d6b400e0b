import os

import pytest
import torch
import triton
import triton.language as tl

from diffkv_serve.kernels.quant import (FP8_MAX, MIN_FP8_SCALE, codes_as_f16, dequantize_fp8_ref, dequantize_ref, e4m3_codes,
                           e4m3_values, quantize_fp8_ref, quantize_fp8_tile, quantize_ref, quantize_tile, unpack_ref,
                           unpack_tile)

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Round trip |x - dequant(quant(x))| <= scale/2 + FP16_SLACK[dtype] * (|min| + (max - min)) + 1e-6 * |x|:
# half a quantization step plus the fp16 rounding of the stored zero point and scale (2^-11 each, doubled).
# Triton's quantization must equal the reference bit for bit (tolerance 0) for every input dtype.
FP16_SLACK = {torch.float32: 2.0 ** -10, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -10}
TOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0}  # triton vs reference (bytes, fp16 meta)
BITS = (8, 4, 2)
# fp8 (e4m3): |x - dequant(quant(x))| <= 2^-4 |x| (half a 3-bit mantissa step) + scale * 2^-10 (half of the
# smallest subnormal step 2^-9) + FP8_SCALE_SLACK * max|x| (the fp16 rounding of the scale can push the row
# maximum just past 448, where it saturates), for every input dtype. Triton's codes come from integer rounding
# (diffkv_serve/kernels/quant.py e4m3_codes), not the interpreter's fp32 -> fp8 cast: bit-identical to torch's cast.
FP8_SCALE_SLACK = {torch.float32: 2.0 ** -10, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -10}
FP8_CODE_TOL = {torch.float32: 0, torch.float16: 0, torch.bfloat16: 0}  # triton vs torch, in e4m3 steps


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


# ---- fp8 (e4m3 codes, kv_mode fp8) -----------------------------------------------------------------------------
def _e4m3_table() -> torch.Tensor:
    """Every finite e4m3 number, by byte value (NaN bytes 0x7F and 0xFF excluded)."""
    b = torch.arange(256, dtype=torch.int32)
    b = b[(b & 0x7F) != 0x7F].to(torch.uint8)
    return b.view(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 24])
def test_fp8_round_trip_bound(dtype, D):
    x = _rows(37, D, dtype, seed=D + 1)
    x[2] = x[2] * 1e-6  # a row below 448 * 2^-14: the scale sits at its floor, small codes go subnormal
    codes, scale = quantize_fp8_ref(x)
    assert codes.dtype == torch.uint8 and codes.shape == (37, D) and scale.dtype == torch.float16
    assert (scale >= MIN_FP8_SCALE).all() and ((codes & 0x7F) != 0x7F).all()  # normal scale, no NaN code
    deq = dequantize_fp8_ref(codes, scale)
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    bound = 2.0 ** -4 * xf.abs() + scale.float()[:, None] * 2.0 ** -10 + FP8_SCALE_SLACK[dtype] * amax
    err = (xf - deq).abs()
    assert (err <= bound).all(), float((err - bound).max())
    # The row maximum lands on (or next to) 448: the codes use e4m3's whole range.
    top = codes.view(torch.float8_e4m3fn).float().abs().amax(-1)
    assert ((top >= 416) & (top <= FP8_MAX))[3:].all()


def test_fp8_zero_and_constant_rows():
    x = torch.zeros(3, 64)
    x[1] = -3.5  # 448 * 2^-7
    x[2, ::2] = 7.0  # 448 * 2^-6, and zeros
    codes, scale = quantize_fp8_ref(x)
    assert scale[0] == MIN_FP8_SCALE and (codes[0] == 0).all()
    assert scale[1] == 2.0 ** -7 and scale[2] == 2.0 ** -6  # amax / 448 exact in fp16: the rows decode exactly
    assert torch.equal(dequantize_fp8_ref(codes, scale), x)


@triton.jit
def _e4m3_codes_kernel(y_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(out_ptr + i, e4m3_codes(tl.load(y_ptr + i)))


def test_e4m3_codes_match_torch_cast():
    """Every e4m3 number, every midpoint between neighbours (ties to even), points just either side of them
    and random values in [-448, 448], subnormals included: the integer rounding equals torch's cast bit for bit."""
    table = _e4m3_table().unique()  # sorted, -448 .. 448, one zero
    mid = (table[1:] + table[:-1]) / 2
    eps = mid.abs() * 2.0 ** -20 + 2.0 ** -30
    g = torch.Generator().manual_seed(5)
    rand = (torch.rand(4096, generator=g) * 2 - 1) * FP8_MAX * torch.rand(4096, generator=g) ** 6
    y = torch.cat([table, mid, mid - eps, mid + eps, rand, -rand])
    n = 1024
    y = torch.cat([y, torch.zeros(-y.numel() % n)]).to(DEVICE)
    out = torch.full_like(y, -1, dtype=torch.int32)
    _e4m3_codes_kernel[(y.numel() // n,)](y, out, N=n)
    want = y.cpu().to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    got = out.cpu()
    assert FP8_CODE_TOL[torch.float32] == 0
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(y[i]), int(got[i]), int(want[i])) for i in bad[:5]]


@triton.jit
def _fp8_roundtrip_kernel(x_ptr, codes_ptr, scale_ptr, values_ptr, BLOCK_M: tl.constexpr, D: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + m[:, None] * D + d[None, :]).to(tl.float32)
    codes, scale = quantize_fp8_tile(x, BLOCK_M)
    tl.store(codes_ptr + m[:, None] * D + d[None, :], codes.to(tl.uint8))
    tl.store(scale_ptr + m, scale)
    back = tl.load(codes_ptr + m[:, None] * D + d[None, :])
    tl.store(values_ptr + m[:, None] * D + d[None, :], e4m3_values(back, tl.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_tile_helpers_match_reference(dtype):
    M, D = 32, 64
    x = _rows(M, D, dtype, seed=11).to(DEVICE)
    x[2] = 0.375  # constant row
    x[3] = x[3] * 1e-6  # scale at its floor
    x[4] = 0.0
    codes = torch.full((M, D), 0xAB, dtype=torch.uint8, device=DEVICE)
    scale = torch.full((M,), float("nan"), dtype=torch.float16, device=DEVICE)
    values = torch.full((M, D), float("nan"), device=DEVICE)
    _fp8_roundtrip_kernel[(M // 16,)](x, codes, scale, values, BLOCK_M=16, D=D, enable_fp_fusion=False)
    rc, rs = quantize_fp8_ref(x)
    assert torch.equal(scale, rs)
    steps = (codes.cpu().to(torch.int32) - rc.cpu().to(torch.int32)).abs()  # same sign: byte distance = steps
    assert steps.max() <= FP8_CODE_TOL[dtype], int(steps.max())
    assert torch.equal(values, rc.view(torch.float8_e4m3fn).float())  # e4m3_values: exact


@triton.jit
def _e4m3_values_kernel(codes_ptr, out32_ptr, out16_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(codes_ptr + i)
    tl.store(out32_ptr + i, e4m3_values(c, tl.float32))
    tl.store(out16_ptr + i, e4m3_values(c, tl.float16))


def test_e4m3_values_exact_for_every_code():
    """The decode kernel's conversion of codes to dot operands gives each e4m3 number exactly, in fp32 and fp16."""
    b = torch.arange(256, dtype=torch.int32)
    b = b[(b & 0x7F) != 0x7F]
    codes = b[torch.randperm(b.numel(), generator=torch.Generator().manual_seed(2))]
    n = 256
    codes = torch.cat([codes, torch.zeros(n - codes.numel(), dtype=torch.int32)]).to(DEVICE)
    out32 = torch.full((n,), float("nan"), device=DEVICE)
    out16 = torch.full((n,), float("nan"), dtype=torch.float16, device=DEVICE)
    _e4m3_values_kernel[(1,)](codes, out32, out16, N=n)
    want = codes.cpu().to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(out32.cpu(), want) and torch.equal(out16.cpu().float(), want)


@pytest.mark.parametrize("spec", [(16, 16), (8, 4), (4, 4), (4, 2), (2, 2), (8, 8, True)])
def test_stored_rows_are_what_a_page_returns(spec):
    """stored_rows_ref (what a prefill attends for a pinned token, and for every token of a single-precision
    quantized cache) equals write_rows_ref then read_rows_ref, bit for bit."""
    from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for
    from diffkv_serve.kernels.quant import read_rows_ref, stored_rows_ref, write_rows_ref

    D, dtype = 32, torch.float32
    fmt = PageFormat.make(spec[0], spec[1], D, page_bytes_for(4, D, 4), 4, float8=len(spec) > 2)
    x = torch.randn(5, 3, D) * 2
    pool = torch.zeros(15, fmt.page_bytes, dtype=torch.uint8)
    pages = torch.arange(15).view(5, 3)
    rows = torch.zeros(5, 3, dtype=torch.long)
    for side in ("k", "v"):
        write_rows_ref(pool, fmt, dtype, side, pages.flatten(), rows.flatten(), x.view(-1, D))
        assert torch.equal(read_rows_ref(pool, fmt, dtype, side, pages, rows), stored_rows_ref(x, fmt, dtype, side))
