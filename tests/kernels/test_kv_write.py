import os

import pytest
import torch

from diffkv_serve.kernels.kv_write import write_kv
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for
from diffkv_serve.kernels.quant import quantize_fp8_ref, quantize_ref, read_rows_ref

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# A write is a cast + copy: every implementation must produce identical bytes.
TOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0}
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.startswith("cuda") else [])
T = 16


def _setup(cache_dtype, H, D, N, num_pages=24, seed=0):
    torch.manual_seed(seed)
    isz = torch.empty((), dtype=cache_dtype).element_size()
    fmt = PageFormat.make(16, 16, D, page_bytes_for(T, D, isz), isz)
    pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    pool.view(cache_dtype).fill_(float("nan"))  # poison: every written row must be overwritten
    k = torch.randn(N, H, D, device=DEVICE) * 2 + 0.5
    v = torch.randn(N, H, D, device=DEVICE) - 0.25
    # Distinct random (page, row) destinations over shuffled pages; ~1/5 of them skipped with page -1.
    rows = torch.randperm(num_pages * T)[: N * H].view(N, H)
    dst_page = (rows // T).to(torch.int32)
    dst_slot = (rows % T).to(torch.int32)
    dst_page[torch.rand(N, H) < 0.2] = -1
    positions = torch.randint(0, 10_000, (N,), dtype=torch.int32)
    return fmt, pool, k, v, dst_page.to(DEVICE), dst_slot.to(DEVICE), positions.to(DEVICE)


def _naive(pool, fmt, cache_dtype, k, v, dst_page, dst_slot, positions):
    pc, pi, pf = pool.view(cache_dtype), pool.view(torch.int32), pool.view(torch.float32)
    isz, D = fmt.full_itemsize, fmt.head_dim
    for n in range(k.shape[0]):
        for h in range(k.shape[1]):
            p, s = int(dst_page[n, h]), int(dst_slot[n, h])
            if p < 0:
                continue
            pc[p, fmt.k_off // isz + s * D: fmt.k_off // isz + (s + 1) * D] = k[n, h].to(cache_dtype)
            pc[p, fmt.v_off // isz + s * D: fmt.v_off // isz + (s + 1) * D] = v[n, h].to(cache_dtype)
            pi[p, fmt.pos_off // 4 + s] = int(positions[n])
            pf[p, fmt.score_off // 4 + s] = 0.0


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("H,D,N,in_dtype", [(3, 64, 21, torch.float32), (2, 128, 9, None), (5, 48, 7, None)])
def test_write_kv(cache_dtype, H, D, N, in_dtype):
    fmt, pool, k, v, dst_page, dst_slot, positions = _setup(cache_dtype, H, D, N)
    k, v = k.to(in_dtype or cache_dtype), v.to(in_dtype or cache_dtype)
    pools = {impl: pool.clone() for impl in ("triton", "ref", "naive")}
    write_kv(pools["triton"], fmt, cache_dtype, k, v, dst_page, dst_slot, positions, impl="triton")
    write_kv(pools["ref"], fmt, cache_dtype, k, v, dst_page, dst_slot, positions, impl="ref")
    _naive(pools["naive"], fmt, cache_dtype, k, v, dst_page.cpu(), dst_slot.cpu(), positions.cpu())
    assert TOL[cache_dtype] == 0.0
    assert torch.equal(pools["ref"], pools["naive"]), "reference differs from the naive loop"
    assert torch.equal(pools["triton"], pools["ref"]), "triton differs from the reference"
    # Every written row holds finite data (the NaN poison was overwritten), untouched rows are unchanged.
    written = pools["triton"].view(cache_dtype)[dst_page[dst_page >= 0].long()]
    assert written.isnan().any()  # other rows of those pages still hold poison
    isz = fmt.full_itemsize
    ok = dst_page >= 0
    for p, s in zip(dst_page[ok].tolist(), dst_slot[ok].tolist()):
        row = pools["triton"].view(cache_dtype)[p, fmt.k_off // isz + s * D: fmt.k_off // isz + (s + 1) * D]
        assert not row.isnan().any()
    assert (pools["triton"].view(torch.float32)[dst_page[ok].long(), fmt.score_off // 4 + dst_slot[ok].long()]
            == 0).all()


def _naive_quant(pool, fmt, cache_dtype, k, v, dst_page, dst_slot, positions, scores):
    """Row by row: quantize_ref (itself checked against a plain loop in test_quant) into the page segments."""
    pi, pf, ph = pool.view(torch.int32), pool.view(torch.float32), pool.view(torch.float16)
    isz, D = fmt.full_itemsize, fmt.head_dim
    for n in range(k.shape[0]):
        for h in range(k.shape[1]):
            p, s = int(dst_page[n, h]), int(dst_slot[n, h])
            if p < 0:
                continue
            for x, bits, off, moff in ((k[n, h], fmt.key_bits, fmt.k_off, fmt.k_meta_off),
                                       (v[n, h], fmt.value_bits, fmt.v_off, fmt.v_meta_off)):
                if bits == 16:
                    pool.view(cache_dtype)[p, off // isz + s * D: off // isz + (s + 1) * D] = x.to(cache_dtype)
                    continue
                if fmt.float8 and bits == 8:  # e4m3 codes, zero point 0
                    packed, scale = quantize_fp8_ref(x)
                    zero = torch.zeros_like(scale)
                else:
                    packed, scale, zero = quantize_ref(x, bits)
                rb = D * bits // 8
                pool[p, off + s * rb: off + (s + 1) * rb] = packed
                ph[p, moff // 2 + 2 * s] = scale
                ph[p, moff // 2 + 2 * s + 1] = zero
            pi[p, fmt.pos_off // 4 + s] = int(positions[n])
            pf[p, fmt.score_off // 4 + s] = 0.0 if scores is None else float(scores[n, h])


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("kb,vb,float8", [(8, 8, False), (4, 4, False), (8, 4, False), (4, 2, False),
                                          (2, 16, False), (16, 8, False), (8, 8, True), (8, 16, True), (4, 8, True)])
@pytest.mark.parametrize("H,D,in_dtype,with_scores", [(3, 64, torch.float32, True), (2, 128, None, False)])
def test_write_kv_quantized(cache_dtype, kb, vb, float8, H, D, in_dtype, with_scores):
    """Quantize on the fly: Triton bytes == reference bytes == row-by-row quantize_ref (quantize_fp8_ref for the
    8-bit sides of a float8 format: kv_mode fp8); scores stored."""
    isz = torch.empty((), dtype=cache_dtype).element_size()
    fmt = PageFormat.make(kb, vb, D, page_bytes_for(T, D, isz), isz, float8=float8)
    N, num_pages = 11, 6
    torch.manual_seed(kb * 10 + vb + D)
    pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    pool.view(torch.float32).fill_(float("nan"))
    k = (torch.randn(N, H, D, device=DEVICE) * 2 + 0.5).to(in_dtype or cache_dtype)
    v = (torch.randn(N, H, D, device=DEVICE) - 0.25).to(in_dtype or cache_dtype)
    rows = torch.randperm(num_pages * fmt.tokens)[: N * H].view(N, H)
    dst_page = (rows // fmt.tokens).to(torch.int32)
    dst_slot = (rows % fmt.tokens).to(torch.int32)
    dst_page[torch.rand(N, H) < 0.2] = -1
    dst_page, dst_slot = dst_page.to(DEVICE), dst_slot.to(DEVICE)
    positions = torch.randint(0, 10_000, (N,), dtype=torch.int32, device=DEVICE)
    scores = torch.rand(N, H, device=DEVICE) + 0.5 if with_scores else None
    pools = {impl: pool.clone() for impl in ("triton", "ref")}
    for impl in ("triton", "ref"):
        write_kv(pools[impl], fmt, cache_dtype, k, v, dst_page, dst_slot, positions, impl=impl, scores=scores)
    naive = pool.cpu().clone()
    _naive_quant(naive, fmt, cache_dtype, k.cpu(), v.cpu(), dst_page.cpu(), dst_slot.cpu(), positions.cpu(),
                 None if scores is None else scores.cpu())
    assert torch.equal(pools["ref"].cpu(), naive), "reference differs from the naive loop"
    assert TOL[cache_dtype] == 0.0
    assert torch.equal(pools["triton"], pools["ref"]), "triton differs from the reference"
    # The written tokens decode back close to their inputs.
    ok = dst_page >= 0
    for which, x, bits in (("k", k, kb), ("v", v, vb)):
        got = read_rows_ref(pools["triton"], fmt, cache_dtype, which, dst_page[ok].long(), dst_slot[ok].long())
        assert not got.isnan().any()
        if fmt.side_float8(which):  # relative rounding of a 3-bit mantissa (bound of test_quant)
            xf = x[ok].float()
            amax = xf.abs().amax(-1, keepdim=True)
            assert ((got - xf).abs() <= 2.0 ** -4 * xf.abs() + amax * 2.0 ** -9).all()
        elif bits < 16:
            xf = x[ok].float()
            step = (xf.amax(-1) - xf.amin(-1)) / ((1 << bits) - 1)
            assert ((got - xf).abs() <= step[:, None] * 0.51 + 1e-2 * xf.abs().amax(-1, keepdim=True)).all()


def test_write_kv_checks_dtype():
    fmt = PageFormat.make(8, 8, 64, page_bytes_for(T, 64, 4), 4)
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    k = torch.randn(1, 1, 64, device=DEVICE)
    idx = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for impl in ("triton", "ref"):
        with pytest.raises(ValueError):  # a 4-byte format with a 2-byte cache dtype
            write_kv(pool, fmt, torch.float16, k, k, idx, idx, pos, impl=impl)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("kb,vb,float8", [(16, 16, False), (8, 8, False), (4, 4, False), (8, 8, True)])
def test_write_kv_untracked_pages(cache_dtype, kb, vb, float8):
    """A single-precision cache's pages (tracked=False) hold no score or position rows: more tokens per page, the
    Triton bytes equal the reference's, each written row decodes to what a tracked page's row decodes to, and
    nothing past the key/value segments is written."""
    isz = torch.empty((), dtype=cache_dtype).element_size()
    H, D, N, num_pages = 3, 64, 13, 5
    fmts = {tr: PageFormat.make(kb, vb, D, page_bytes_for(T, D, isz, tr), isz, float8=float8, tracked=tr)
            for tr in (True, False)}
    fmt = fmts[False]
    assert fmt.page_bytes < fmts[True].page_bytes and fmt.tokens >= fmts[True].tokens
    assert fmt.token_bytes() < fmts[True].token_bytes()
    with pytest.raises(ValueError, match="no score rows"):
        fmt.score_off
    with pytest.raises(ValueError, match="no position rows"):
        fmt.pos_off
    torch.manual_seed(kb + vb + float8)
    k = torch.randn(N, H, D, device=DEVICE).to(cache_dtype) * 2 + 0.5
    v = (torch.randn(N, H, D, device=DEVICE) - 0.25).to(cache_dtype)
    rows = torch.randperm(num_pages * fmts[True].tokens)[: N * H].view(N, H)
    dst_page = (rows // fmts[True].tokens).to(torch.int32).to(DEVICE)
    dst_slot = (rows % fmts[True].tokens).to(torch.int32).to(DEVICE)
    positions = torch.randint(0, 10_000, (N,), dtype=torch.int32, device=DEVICE)
    pools = {}
    for name, f, impl in (("triton", fmt, "triton"), ("ref", fmt, "ref"), ("tracked", fmts[True], "ref")):
        pool = torch.zeros(num_pages, f.page_bytes, dtype=torch.uint8, device=DEVICE)
        pool.view(torch.float32).fill_(float("nan"))
        write_kv(pool, f, cache_dtype, k, v, dst_page, dst_slot, positions, impl=impl)
        pools[name] = pool
    assert torch.equal(pools["triton"], pools["ref"]), "triton differs from the reference"
    data_end = fmt.data_bytes
    untouched = pools["ref"][:, data_end:].view(torch.float32) if data_end < fmt.page_bytes else None
    assert untouched is None or untouched.isnan().all()
    for which in ("k", "v"):
        got = read_rows_ref(pools["ref"], fmt, cache_dtype, which, dst_page.flatten().long(), dst_slot.flatten().long())
        want = read_rows_ref(pools["tracked"], fmts[True], cache_dtype, which, dst_page.flatten().long(),
                             dst_slot.flatten().long())
        assert torch.equal(got, want)
