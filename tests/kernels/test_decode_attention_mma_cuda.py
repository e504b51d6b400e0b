"""The hand-written CUDA decode kernel (diffkv_serve/kernels/decode_attention/mma_cuda.py, decode_mma.cu): which calls it serves,
that the launcher passes what the kernel's signature takes, and its outputs, logits and lse against float64 loops
over the dequantized cache: on the CPU through the warp emulation (_cuda_emu.py, every CI run), on CUDA through the
dispatcher (kernel="mma_cuda"). Cases: K4V2, K4V4, K8V4, K8V2, K8V8, K4V8, e4m3 K8V8 / K8V4 pages, DiffKV's
K8V4 + K4V2 sections, GQA groups 1-8, one and many splits, partial tiles, tiles across two, three and four pages
(down to 21-token pages), heads without tokens, sections of which one is empty, fp16 and bf16, with and without
the logits / lse outputs."""
import math
import re

import pytest
import torch

from diffkv_serve.kernels.decode_attention import decode_kernel, mma_cuda, paged_decode_attention_triton
from diffkv_serve.kernels.decode_attention.dispatch import pick_kernel
from diffkv_serve.kernels.decode_attention.merge import merge_splits
from diffkv_serve.kernels.decode_attention.tiles import LOG2E

import _cuda_emu
from _decode_check import DEVICE, NMAX_PAD, QTOL, naive_sections
from _paged_cache import build_cache, formats

CUDA = DEVICE.startswith("cuda")


def test_usable_names_what_it_cannot_serve():
    q = torch.zeros(2, 8, 128, dtype=torch.float16)
    k4v2, _ = formats("K4V2", 128, 2)
    k8v4, k4v2_low = formats("K8V4+K4V2", 128, 2)
    assert mma_cuda.usable(k4v2, None, q, 4) == "not a CUDA device"
    if CUDA:
        qc = q.to(DEVICE)
        assert mma_cuda.usable(k4v2, None, qc, 4) is None
        assert mma_cuda.usable(k8v4, k4v2_low, qc, 4) is None
        assert mma_cuda.usable(formats("K8V8", 128, 2)[0], None, qc, 4) is None
        assert mma_cuda.usable(formats("K8V8-e4m3", 128, 2)[0], None, qc, 4) is None
        assert "K8V8-e4m3 low" in mma_cuda.usable(k8v4, formats("K8V8-e4m3", 128, 2)[0], qc, 4)
        assert "8-bit values only" in mma_cuda.usable(*formats("K8V8+K4V2", 128, 2), qc, 4)
        assert mma_cuda.usable(k8v4, formats("K2V2", 128, 2)[0], qc, 4) is None  # 2-bit keys in a low section
        assert "head_dim 64" in mma_cuda.usable(formats("K4V2", 64, 2)[0], None, qc[..., :64], 4)
        assert "float32" in mma_cuda.usable(k4v2, None, qc.float(), 4)
        assert "12 query heads" in mma_cuda.usable(k4v2, None, qc, 12)
    # pages of fewer than MIN_TOKENS tokens (a tile would span more than three pages)
    small, _ = formats("K8V4", 128, 1)
    assert small.tokens < mma_cuda.MIN_TOKENS
    assert "tokens per high page" in mma_cuda._format_reason(small, "high")


def test_a_missing_toolchain_sends_calls_to_triton(monkeypatch):
    """Without torch.cuda._compile_kernel, or when NVRTC cannot build the kernel, usable names why (so the
    dispatcher keeps the Triton kernels) instead of the first decode step failing."""
    check = mma_cuda._toolchain_reason.__wrapped__  # uncached
    monkeypatch.delattr(torch.cuda, "_compile_kernel", raising=False)
    assert "_compile_kernel" in check(torch.device("cpu"))

    def broken(device, var):
        raise RuntimeError("nvrtc: libnvrtc.so not found")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a: None, raising=False)
    monkeypatch.setattr(mma_cuda, "_compiled", broken)
    assert "libnvrtc.so not found" in check(torch.device("cpu"))


def test_forcing_it_where_it_cannot_serve_raises():
    fmt, _ = formats("K4V2", 128, 4)
    pool, pt, lens, _, _ = build_cache(fmt, None, torch.float32, 2, [[5, 3]], None, DEVICE, 0)
    q = torch.randn(1, 8, 128, device=DEVICE)
    why = mma_cuda.usable(fmt, None, q, 4)  # a float32 q (and no GPU on CPU runs)
    assert why is not None
    with pytest.raises(ValueError, match=re.escape(f"(mma_cuda: {why})")):
        paged_decode_attention_triton(q, pool, fmt, torch.float32, pt, lens, torch.zeros(1, dtype=torch.int32,
                                      device=DEVICE), 0, 0.1, kernel="mma_cuda")


def test_launcher_passes_what_the_signature_takes():
    """Pointers for the tensors, C ints for Python ints, a double for the Python float (torch's launcher converts
    them so), in the kernel's order and number; the variant's shared memory within the default 48 KB."""
    params = _cuda_emu.signature(mma_cuda.SOURCE.read_text())
    calls = []
    fmt, low = formats("K8V4+K4V2", 128, 2)
    B, Hq, Hkv = 2, 12, 2
    q = torch.zeros(B, Hq, 128, dtype=torch.float16)
    pt = torch.zeros(3, 2, Hkv, 5, dtype=torch.int32)
    lens = torch.zeros(3, 2, Hkv, dtype=torch.int32)
    mid = torch.zeros(B, Hq, 4, 128)
    mma_cuda.launch_mma(q, torch.zeros(4, fmt.page_bytes, dtype=torch.uint8), fmt, low, pt, lens, lens + 1,
                        torch.zeros(B, dtype=torch.int32), q, mid, mid[..., :2], None, torch.zeros(B, Hq), 1, 0.5, 4,
                        compiled=lambda dev, var: (lambda **kw: calls.append((var, kw))))
    ((var, call),) = calls
    assert var == mma_cuda.Variant(8, 4, 4, 2, 2 if min(fmt.tokens, low.tokens) >= 64 else 3, False, 0)
    assert call["grid"] == (B, Hkv, 4) and call["block"] == (32, 1, 1)
    assert call["shared_mem"] == var.shared_bytes <= 48 * 1024
    args = call["args"]
    assert len(args) == len(params)
    for a, (ctype, name) in zip(args, params):
        if ctype.endswith("*"):
            assert isinstance(a, torch.Tensor), name
        elif ctype == "double":
            assert isinstance(a, float), name
        else:
            assert ctype == "int" and isinstance(a, int) and not isinstance(a, bool), name
    named = dict(zip([n for _, n in params], args))
    assert named["group"] == Hq // Hkv and named["num_splits"] == 4 and named["P"] == 4 and named["write_lse"] == 1
    assert (named["T_hi"], named["k_off_hi"], named["k_meta_hi"], named["v_off_hi"], named["v_meta_hi"]) == (
        fmt.tokens, fmt.k_off, fmt.k_meta_off, fmt.v_off, fmt.v_meta_off)
    assert (named["T_lo"], named["k_off_lo"], named["k_meta_lo"], named["v_off_lo"], named["v_meta_lo"]) == (
        low.tokens, low.k_off, low.k_meta_off, low.v_off, low.v_meta_off)
    assert named["len_lo"] is not named["len_hi"]


def test_launcher_refuses_a_table_past_the_exact_page_lookup():
    """The kernel divides token indices by a page's token count with a multiply-high, exact below 2^32 / T tokens:
    a page table wide enough to hold more is refused by name before anything is launched."""
    fmt, low = formats("K8V4+K4V2", 128, 2)
    T = max(fmt.tokens, low.tokens)
    q = torch.zeros(1, 4, 128, dtype=torch.float16)
    lens = torch.zeros(1, 1, 1, dtype=torch.int32)
    wide = torch.zeros(1, 1, 1, 1, dtype=torch.int32).expand(1, 1, 1, (1 << 32) // (T * T) + 1)
    with pytest.raises(ValueError, match="page lookup"):
        mma_cuda.launch_mma(q, torch.zeros(4, fmt.page_bytes, dtype=torch.uint8), fmt, low, wide, lens, lens,
                            torch.zeros(1, dtype=torch.int32), q, q, q, None, None, 0, 0.5, 1,
                            compiled=lambda dev, var: pytest.fail("launched"))


def test_variants_fit_the_sm():
    """Shared memory and the register cap (MINB) of every served precision leave programs resident."""
    for kb in mma_cuda.KEY_BITS:
        for vb in mma_cuda.VALUE_BITS:
            for low in ((0, 2), (4, 2)):
                for stages in (1, 2):
                    var = mma_cuda.Variant(kb, vb, *low, mma_cuda.MAX_PAGES, False, True, stages=stages)
                    assert var.shared_bytes == stages * var.stage_bytes <= 48 * 1024
                    two = low[0] and stages == 2
                    assert 1 <= var.min_programs <= (mma_cuda.MAX_PROGRAMS_TWO_SECTIONS if two else mma_cuda.MAX_PROGRAMS)
                    assert var.min_programs * (var.shared_bytes + 1024) <= mma_cuda.SHARED_PER_SM
                    assert f"#define KB_LO {low[0]}" in var.defines() and f"#define STAGES {stages}" in var.defines()
    # int4's one section keeps 12 programs; the same pages as a high section beside a low one get 8 (12 at one stage)
    assert mma_cuda.Variant(4, 4, 0, 2, 3, False, False).min_programs == 12
    assert mma_cuda.Variant(4, 4, 4, 2, 3, False, True).min_programs == 8
    assert mma_cuda.Variant(8, 4, 4, 2, 3, False, True, stages=1).min_programs == 12
    # K8V8's 16.5 KB tiles: 6 programs at two stages, 12 at one
    assert mma_cuda.Variant(8, 8, 0, 2, 3, False, False).min_programs == 6
    assert mma_cuda.Variant(8, 8, 0, 2, 3, False, False, stages=1).min_programs == 12


def test_one_stage_rule():
    """One stage exactly where the pairs overfill the two-stage residents by at most half a wave and fit the
    one-stage ones (132 SMs off a GPU): K8V8 792 < pairs <= 1,188, K8V4 and DiffKV's two sections 1,056 < pairs <=
    1,584; never for int4 / K4V2."""
    dev = torch.device("cpu")
    k8v8, k8v4, k4v4, k4v2 = (mma_cuda.variant(formats(s, 128, 2)[0], None, False, False)
                              for s in ("K8V8", "K8V4", "K4V4", "K4V2"))
    mix = mma_cuda.variant(*formats("K8V4+K4V2", 128, 2), False, True)
    cases = {k8v8: (792, 1184), k8v4: (1056, 1584), mix: (1056, 1584)}  # K8V8: 1,188 is not a multiple of 8
    for var, (lo, hi) in cases.items():
        for pairs, want in ((lo, False), (lo + 8, True), (hi, True), (hi + 8, False), (64, False)):
            assert mma_cuda.one_stage(var, pairs // 8, 8, dev) is want, (var, pairs)
    for var in (k4v4, k4v2):
        assert not any(mma_cuda.one_stage(var, b, 8, dev) for b in range(1, 400))
    assert not mma_cuda.one_stage(k8v8._replace(stages=1), 128, 8, dev)  # already one stage


def test_split_count_rule():
    """K8V8 (6 resident programs an SM) takes half the quartered kernel's one-warp split count, a power of two;
    other precisions keep the one-warp count; a call one_stage takes goes unsplit."""
    from diffkv_serve.kernels.decode_attention.launch import choose_num_splits
    dev = torch.device("cpu")  # num_sms: 132 off a GPU
    k8v8, k4v2, e4m3 = (formats(s, 128, 2)[0] for s in ("K8V8", "K4V2", "K8V8-e4m3"))
    for B, Hkv, S in ((32, 8, 1024), (8, 8, 4096), (8, 2, 4096), (32, 2, 16384), (128, 8, 512)):
        one_warp = choose_num_splits(B, Hkv, S, dev, mma_cuda.TILE, 1, 128)
        assert mma_cuda.num_splits(k4v2, None, B, Hkv, S, dev) == one_warp
        half = choose_num_splits(B, Hkv, S, dev, mma_cuda.TILE, 2, 128)
        want = 1 << (half.bit_length() - 1)
        assert mma_cuda.num_splits(k8v8, None, B, Hkv, S, dev) == want
        assert mma_cuda.num_splits(e4m3, None, B, Hkv, S, dev) == want
    assert mma_cuda.num_splits(k8v8, None, 32, 8, 1024, dev) == 2
    assert mma_cuda.num_splits(k8v8, None, 8, 2, 4096, dev) == 32  # 33 for two warps, rounded down
    # 1,024 (sequence, KV head) pairs overfill 132 SMs x 6 two-stage programs and fit 12 one-stage ones: unsplit
    k8v4 = formats("K8V4", 128, 2)[0]
    for fmt, S in ((k8v8, 4096), (e4m3, 4096), (k8v8, 1024), (e4m3, 16384)):
        assert mma_cuda.num_splits(fmt, None, 128, 8, S, dev) == 1
    assert mma_cuda.num_splits(k8v4, None, 160, 8, 16384, dev) == 1
    assert mma_cuda.num_splits(k8v4, None, 64, 2, 16384, dev) == choose_num_splits(64, 2, 16384, dev, 64, 1, 128) > 1
    assert mma_cuda.num_splits(k8v8, None, 256, 8, 4096, dev) == 1  # past one stage's residents: the two-stage rule
    assert mma_cuda.num_splits(k4v2, None, 256, 8, 4096, dev) == 1  # the one-warp rule's count, overfull or not


def test_query_levels_follow_the_key_width():
    """q meets 8-bit integer keys as 16-bit integers (two mma chains), 4- and 2-bit keys as 8-bit ones (one chain),
    e4m3 keys in fp16: None."""
    for spec in ("K8V4", "K8V8"):
        assert mma_cuda.query_levels(formats(spec, 128, 2)[0]) == 32767, spec
    for spec in ("K4V2", "K4V4", "K2V2", "K4V8"):
        assert mma_cuda.query_levels(formats(spec, 128, 2)[0]) == 127, spec
    assert mma_cuda.query_levels(formats("K8V8-e4m3", 128, 2)[0]) is None
    assert mma_cuda.zero_term_rounded(127) and not mma_cuda.zero_term_rounded(32767)


def test_round_query_takes_the_kernels_float32_steps():
    """round_query: integers at each row's own scale max |x| / levels (x = q * qk_scale), the largest element at
    +-levels, a zero row zero; an element at exactly half a step rounds as float32 arithmetic takes it (the kernel's),
    which can differ from rounding the exact quotient."""
    qk = 128 ** -0.5 * LOG2E
    q = torch.randn(6, 128, generator=torch.Generator().manual_seed(1)).half()
    q[3] = 0
    for levels in (127, 32767):
        r = mma_cuda.round_query(q, levels, qk)
        assert r.dtype == torch.float64 and torch.equal(r[3], torch.zeros(128, dtype=torch.float64))
        step = q.double().abs().amax(-1, keepdim=True) / levels
        ints = r / step
        live = step[:, 0] > 0
        assert (ints[live] - ints[live].round()).abs().max() < levels * 1e-6  # whole steps, up to float32's scale
        assert (r - q.double()).abs().max() <= (step / 2 * 1.001).max()
        assert torch.allclose(ints[live].abs().amax(-1), torch.full((int(live.sum()),), float(levels), dtype=torch.float64))
    tie = torch.randn(128, generator=torch.Generator().manual_seed(4)).half()  # a row where float32 steps differ
    tie[7] = tie.abs().max() / 2  # 63.5 steps exactly; float32's x * (127 / max |x|) is 63.499996
    x = tie.float() * torch.tensor(qk, dtype=torch.float32)
    want = float(torch.round(x[7] * (torch.tensor(127.0) / x.abs().max())))
    assert abs(want) == 63.0 and float(torch.round(tie[7].double() / (tie.double().abs().max() / 127))) != want
    got = mma_cuda.round_query(tie, 127, qk)[7] / (tie.double().abs().max() / 127)
    assert abs(float(got) - want) < 1e-3


def test_reference_q_low_applies_to_the_low_section_only():
    """The reference's q_low (a model of a kernel that rounds q per section): the low section's logits take it, the
    high section's keep q; q_low = q changes nothing."""
    from diffkv_serve.kernels.decode_attention.reference import paged_decode_attention_ref

    fmt, low = formats("K8V4+K4V2", 128, 2)
    pool, pt, len_hi, len_lo, _ = build_cache(fmt, low, torch.float16, 2, [[70, 40]], [[90, 3]], "cpu", 4)
    slots = torch.zeros(1, dtype=torch.int32)
    q = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(2)).half()
    q_low = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(3)).half()
    runs = []
    for ql in (None, q, q_low):
        logits = torch.full((1, 4, 200), float("nan"))
        out = paged_decode_attention_ref(q, pool, fmt, torch.float16, pt, len_hi, slots, 0, 0.088, fmt_low=low,
                                         len_low=len_lo, logits_out=logits, q_low=ql)
        runs.append((out, logits))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1].nan_to_num(7), runs[1][1].nan_to_num(7))
    (_, lg), (_, lg_low) = runs[0], runs[2]
    for h in range(2):  # KV head h: query heads 2h, 2h + 1
        n_hi, n_lo = int(len_hi[0, 0, h]), int(len_lo[0, 0, h])
        hs = slice(2 * h, 2 * h + 2)
        assert torch.equal(lg[0, hs, :n_hi], lg_low[0, hs, :n_hi])
        assert not torch.allclose(lg[0, hs, n_hi:n_hi + n_lo], lg_low[0, hs, n_hi:n_hi + n_lo])
    alone = paged_decode_attention_ref(q_low, pool, fmt, torch.float16, pt, len_hi, slots, 0, 0.088, fmt_low=low,
                                       len_low=len_lo, logits_out=(lg2 := torch.full((1, 4, 200), float("nan"))))
    for h in range(2):
        n_hi, n_lo = int(len_hi[0, 0, h]), int(len_lo[0, 0, h])
        hs = slice(2 * h, 2 * h + 2)
        torch.testing.assert_close(lg_low[0, hs, n_hi:n_hi + n_lo], lg2[0, hs, n_hi:n_hi + n_lo])
    assert alone.isfinite().all()


@pytest.mark.skipif(CUDA or _cuda_emu.compiler() is None, reason="the CPU emulation (needs g++)")
def test_attention_check_holds_the_kernel_to_its_rounded_q():
    """benchmarks/attention.py's correctness check holds the CUDA kernel (emulated) to attention.reference_for: the
    reference over q as the kernel rounds it per section, within the check's tolerance, where the reference over q
    as given is further off for 4- and 2-bit keys (8-bit q) and as close for 8-bit keys (16-bit q)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import attention
    from diffkv_serve.kernels.decode_attention import paged_decode_attention
    from diffkv_serve.kernels.page_layout import page_bytes_for

    B, S, Hq, Hkv = 3, 300, 8, 2
    K, V = attention.make_kv(B, Hkv, S, 128, torch.float16, "cpu", seed=7)
    q = torch.randn(B, Hq, 128, generator=torch.Generator().manual_seed(8)).half()
    slots = torch.arange(B, dtype=torch.int32)
    err = {}
    for prec in ("K4V4", "K8V4+K4V2", "K8V4"):
        hi, lo = attention.parse_spec(prec, 128, page_bytes_for(16, 128, 2), 2)
        pool, pt, lens, len_lo = attention.build_paged(K, V, hi, lo, torch.float16, 0, impl="auto")
        kw = dict(max_len=S, fmt_low=lo, len_low=len_lo)
        ref = paged_decode_attention(q, pool, hi, torch.float16, pt, lens, slots, 0, impl="ref", **kw)
        kernel_ref = attention.reference_for("mma_cuda", ref, q, pool, hi, torch.float16, pt, lens, slots, **kw)
        assert attention.reference_for("quartered", ref, q, pool, hi, torch.float16, pt, lens, slots, **kw) is ref
        out = torch.full_like(q, float("nan"))
        mma_cuda.launch_mma(q, pool, hi, lo, pt, lens, len_lo if lo else lens, slots, out, out, out, None, None, 0,
                            128 ** -0.5 * LOG2E, 1, compiled=_cuda_emu.compiled)
        tol = attention.CHECK_TOL
        attention._close(prec, out, kernel_ref)  # raises past the check's tolerance
        err[prec] = [float(((out.float() - r.float()).abs() / (tol + tol * r.float().abs())).max())
                     for r in (kernel_ref, ref)]
    assert err["K4V4"][1] > 2 * err["K4V4"][0] and err["K8V4+K4V2"][1] > 2 * err["K8V4+K4V2"][0], err
    assert abs(err["K8V4"][1] - err["K8V4"][0]) < 0.05, err


# (spec, Hq, Hkv, high lengths per slot and KV head, low lengths or None, splits)
CASES = [
    ("K4V2", 8, 2, [[1000, 777], [64, 0]], None, 1),          # GQA 4: partial last tile, a head without tokens
    ("K4V2", 8, 2, [[1000, 777], [64, 0]], None, 5),          # splits, some of them empty
    ("K4V2", 12, 2, [[700, 150], [1, 74]], None, None),       # GQA 6 (Qwen2.5-1.5B), the automatic split count
    ("K4V2", 8, 1, [[75], [148]], None, 2),                   # GQA 8; tiles across page boundaries (74-token pages)
    ("K4V2", 4, 4, [[300, 129, 63, 500]], None, 3),           # GQA 1
    ("K8V4", 8, 2, [[300, 77], [41, 0]], None, 1),            # 40-token pages: tiles across three pages
    ("K8V4", 12, 2, [[520, 81], [130, 1]], None, 3),
    ("K4V4", 8, 2, [[400, 57], [58, 0]], None, 2),            # 57-token pages
    ("K4V4/u", 12, 2, [[400, 60], [61, 0]], None, 2),         # kv_mode int4's untracked 60-token pages
    ("K8V2", 6, 1, [[200], [1]], None, 1),
    ("K8V8", 8, 2, [[300, 77], [33, 0]], None, 1),            # 8-bit values; 30-token pages: tiles across four pages
    ("K8V8", 12, 2, [[520, 81], [130, 1]], None, 3),
    ("K4V8", 4, 1, [[150], [64]], None, 2),
    ("K8V8+K4V8", 8, 1, [[100], [70]], [[90], [0]], 2),
    ("K8V8-e4m3+K8V8", 8, 1, [[100], [70]], [[90], [40]], 1),  # a split from e4m3 values to integer codes
    ("K8V8-e4m3", 8, 2, [[300, 77], [33, 0]], None, 1),       # kv_mode fp8: e4m3 codes, no zero point
    ("K8V8-e4m3", 12, 2, [[520, 81], [130, 1]], None, 3),
    ("K8V8-e4m3/u", 8, 2, [[300, 62], [31, 0]], None, 2),     # kv_mode fp8's untracked 31-token pages
    ("K8V4-e4m3", 6, 1, [[200], [65]], None, 2),              # e4m3 keys, 4-bit integer values
    ("K8V4+K4V2", 8, 2, [[300, 77], [64, 0]], [[100, 5], [0, 0]], 1),
    ("K8V4+K4V2", 6, 1, [[300], [64], [0]], [[100], [0], [70]], 4),   # a split across the section boundary
    ("K8V4+K4V2", 8, 2, [[0, 40], [129, 3]], [[300, 0], [75, 2]], 3),  # empty high / low sections
    ("K8V4+K4V2", 12, 2, [[700, 350]], [[260, 600]], None),
    ("K4V4@6", 8, 2, [[300, 85], [21, 0]], None, 2),          # 21-token pages (the fewest served): four a tile
    ("K8V8@12", 12, 2, [[250, 43]], None, 1),                 # 22-token pages
    ("K8V4+K4V2@9", 6, 1, [[200], [64]], [[130], [45]], 3),   # 22- and 41-token pages
    ("K2V2", 8, 2, [[300, 77], [64, 0]], None, 2),            # 2-bit keys
    ("K2V4", 4, 1, [[150], [65]], None, 1),
    ("K4V4+K2V2", 12, 2, [[80, 300]], [[600, 40]], None),     # DiffKV's frontier points: 2-bit keys in the low section
    ("K8V4+K2V2", 6, 1, [[130], [0]], [[300], [70]], 3),
]


def _run(spec, Hq, Hkv, lens, lens_lo, num_splits, dtype, outputs, seed, q_norms=None):
    """q_norms: [Hq, 1] factors on the random queries (None: unit normal)."""
    isz = torch.empty((), dtype=dtype).element_size()
    fmt, low = formats(spec, 128, isz)
    pool, pt, len_hi, len_lo, _ = build_cache(fmt, low, dtype, Hkv, lens, lens_lo, DEVICE, seed)
    B = len(lens)
    slots = torch.arange(B, dtype=torch.int32, device=DEVICE).flip(0)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 128, generator=g)
    q = (q if q_norms is None else q * q_norms).to(DEVICE, dtype)
    scale = 1 / math.sqrt(128)
    total = len_hi + (len_lo if len_lo is not None else 0)
    out = torch.full_like(q, float("nan"))
    logits = torch.full((B, Hq, int(total.max()) + NMAX_PAD), float("nan"), device=DEVICE) if outputs else None
    lse = torch.full((B, Hq), float("nan"), device=DEVICE) if outputs else None
    if CUDA:
        assert paged_decode_attention_triton(q, pool, fmt, dtype, pt, len_hi, slots, 0, scale, num_splits=num_splits,
                                             out=out, fmt_low=low, len_low=len_lo, logits_out=logits,
                                             lse_out=lse, kernel="mma_cuda") is out
    else:
        splits = num_splits or 3
        mid_acc = torch.empty(B, Hq, splits, 128) if splits > 1 else out
        mid_ml = torch.empty(B, Hq, splits, 2) if splits > 1 else out
        mma_cuda.launch_mma(q, pool, fmt, low, pt, len_hi, len_lo, slots, out, mid_acc, mid_ml, logits, lse, 0,
                            scale * LOG2E, splits, compiled=_cuda_emu.compiled)
        if splits > 1:
            merge_splits(mid_acc, mid_ml, out, lse if lse is not None else out, splits, lse is not None)
    want, want_logits, want_lse = naive_sections(q, pool, fmt, low, dtype, pt, len_hi, len_lo, slots.cpu(), 0, scale,
                                                 q_levels=mma_cuda.query_levels)
    return (fmt, low, q, pool, pt, len_hi, len_lo, slots, scale), (out, logits, lse), (want, want_logits, want_lse)


def _expected_logits(shape, want_logits) -> torch.Tensor:
    """naive_sections' logits ({(b, hq, token): value}) laid out as logits_out: NaN where nothing is written."""
    expect = torch.full(shape, float("nan"), dtype=torch.float64)
    for (b, hq, i), x in want_logits.items():
        expect[b, hq, i] = x
    return expect


@pytest.mark.skipif(not CUDA and _cuda_emu.compiler() is None, reason="the CPU emulation needs g++")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec,Hq,Hkv,lens,lens_lo,num_splits", CASES)
def test_matches_float64_loops(dtype, spec, Hq, Hkv, lens, lens_lo, num_splits):
    outputs = lens_lo is not None or num_splits == 2  # DiffKV's call: logits and lse beside the output
    seed = sum(map(sum, lens)) + Hq
    call, (out, logits, lse), (want, want_logits, want_lse) = _run(spec, Hq, Hkv, lens, lens_lo, num_splits, dtype,
                                                                   outputs, seed)
    tol = QTOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    if outputs:
        torch.testing.assert_close(lse.double().cpu(), want_lse, atol=tol, rtol=tol)  # -inf where no token
        # logits are fp32 from tensor-core dots over q rounded to integers as mma_cuda.query_levels says (fp16 for
        # e4m3 keys); the float64 loops round q alike
        torch.testing.assert_close(logits.double().cpu(), _expected_logits(logits.shape, want_logits), atol=tol,
                                   rtol=tol, equal_nan=True)
    if CUDA:  # the Triton kernel beside it, held to float64 loops over q as given (it does not round q)
        fmt, low, q, pool, pt, len_hi, len_lo, slots, scale = call
        assert mma_cuda.usable(fmt, low, q, Hq // Hkv) is None
        assert pick_kernel(fmt, low, q, Hq // Hkv) == "mma_cuda"
        triton_kernel = decode_kernel(fmt, low)  # quartered, or q8 for K8V8; none serves e4m3 keys with int values
        if not (fmt.float8 and triton_kernel == "quartered"):
            tri = paged_decode_attention_triton(q, pool, fmt, dtype, pt, len_hi, slots, 0, scale,
                                                num_splits=num_splits, fmt_low=low, len_low=len_lo,
                                                kernel=triton_kernel)
            exact, _, _ = naive_sections(q, pool, fmt, low, dtype, pt, len_hi, len_lo, slots.cpu(), 0, scale)
            torch.testing.assert_close(tri.double().cpu(), exact, atol=tol, rtol=tol)


@pytest.mark.skipif(CUDA or _cuda_emu.compiler() is None, reason="the CPU emulation (needs g++); CUDA runs above")
def test_a_query_view_off_16_byte_rows_gives_the_same_output():
    """The kernel reads q rows in 16-byte loads: the launcher copies a q whose rows are not 16-byte aligned (a view
    into a wider buffer) and the output is the one of the same q, contiguous."""
    fmt, low = formats("K8V4+K4V2", 128, 2)
    pool, pt, len_hi, len_lo, _ = build_cache(fmt, low, torch.float16, 2, [[130, 70]], [[65, 3]], DEVICE, 11)
    wide = torch.randn(1, 8, 131, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    view = wide[:, :, 3:]  # rows 262 bytes apart, starting 6 bytes in
    assert view.data_ptr() % 16 and view.stride(1) % 8
    passed = []

    def recording(device, var):  # the emulated kernel, noting the q it is given
        kernel = _cuda_emu.compiled(device, var)

        def launch(grid, block, shared_mem, args):
            passed.append(args[0])
            return kernel(grid=grid, block=block, shared_mem=shared_mem, args=args)
        return launch

    outs = []
    for q in (view, view.contiguous()):
        out = torch.full((1, 8, 128), float("nan"), dtype=torch.float16)
        mma_cuda.launch_mma(q, pool, fmt, low, pt, len_hi, len_lo, torch.zeros(1, dtype=torch.int32), out, out, out,
                            None, None, 0, 128 ** -0.5 * LOG2E, 1, compiled=recording)
        outs.append(out)
    for q in passed:
        assert q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.stride(2) == 1
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not CUDA and _cuda_emu.compiler() is None, reason="the CPU emulation needs g++")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_alpha_low_zero_slots_get_no_low_logits(num_splits):
    """alpha_low_by_slot: a slot at alpha_low 0 gets no logits for its low tokens (nothing reads their scores);
    every other logit, the outputs and the lse are the ones of the call without it."""
    fmt, low = formats("K8V4+K4V2", 128, 2)
    Hq, Hkv = 6, 2
    pool, pt, len_hi, len_lo, _ = build_cache(fmt, low, torch.float16, Hkv, [[130, 70], [65, 200], [40, 3]],
                                              [[65, 3], [90, 0], [120, 250]], DEVICE, 5)
    B = 3
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    alpha_low = torch.tensor([0.3, 0.0, 0.0], device=DEVICE)  # slots 1 and 2 decode at alpha_low 0
    q = torch.randn(B, Hq, 128, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.float16)
    nmax = int((len_hi + len_lo).max()) + NMAX_PAD
    results = []
    for gate in (None, alpha_low):
        out = torch.full_like(q, float("nan"))
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        if CUDA:
            paged_decode_attention_triton(q, pool, fmt, torch.float16, pt, len_hi, slots, 0, 128 ** -0.5,
                                          num_splits=num_splits, out=out, fmt_low=low, len_low=len_lo,
                                          logits_out=logits, lse_out=lse, kernel="mma_cuda", alpha_low_by_slot=gate)
        else:
            mid_acc = torch.empty(B, Hq, num_splits, 128) if num_splits > 1 else out
            mid_ml = torch.empty(B, Hq, num_splits, 2) if num_splits > 1 else out
            mma_cuda.launch_mma(q, pool, fmt, low, pt, len_hi, len_lo, slots, out, mid_acc, mid_ml, logits, lse, 0,
                                128 ** -0.5 * LOG2E, num_splits, compiled=_cuda_emu.compiled, alpha_low_by_slot=gate)
            if num_splits > 1:
                merge_splits(mid_acc, mid_ml, out, lse, num_splits, True)
        results.append((out.cpu(), logits.cpu(), lse.cpu()))
    (out0, lg0, lse0), (out1, lg1, lse1) = results
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    skipped = torch.zeros_like(lg0, dtype=torch.bool)
    for b in range(B):
        s = int(slots[b])
        if alpha_low[s] > 0:
            continue
        for h in range(Hkv):
            n_hi, n_lo = int(len_hi[s, 0, h]), int(len_lo[s, 0, h])
            skipped[b, h * (Hq // Hkv):(h + 1) * (Hq // Hkv), n_hi:n_hi + n_lo] = True
    assert skipped.any() and lg1[skipped].isnan().all() and not lg0[skipped].isnan().any()
    torch.testing.assert_close(lg1[~skipped], lg0[~skipped], rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not CUDA and _cuda_emu.compiler() is None, reason="the CPU emulation needs g++")
@pytest.mark.parametrize("spec", ["K4V2", "K8V8", "K8V4+K4V2"])
def test_group_members_of_very_different_norms(spec):
    """q reaches the integer mma as integers at each member's own scale: a member whose query is 10^4 times
    smaller than another's of the same KV group keeps its precision (logits and output within the fp16 tolerance)."""
    lens, lens_lo = [[300, 77], [64, 5]], ([[100, 5], [0, 70]] if "+" in spec else None)
    norms = torch.tensor([30.0, 0.003, 1.0, 0.1]).repeat(2)[:, None]  # per query head, within each of 2 KV groups
    _, (out, logits, _), (want, want_logits, _) = _run(spec, 8, 2, lens, lens_lo, 1, torch.float16, True, 5,
                                                       q_norms=norms)
    tol = QTOL[torch.float16]
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(logits.double().cpu(), _expected_logits(logits.shape, want_logits), atol=tol,
                               rtol=tol, equal_nan=True)


@pytest.mark.skipif(not CUDA and _cuda_emu.compiler() is None, reason="the CPU emulation needs g++")
@pytest.mark.parametrize("spec", ["K8V8", "K8V8-e4m3", "K8V4", "K8V4+K4V2", "K4V2"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_one_stage_matches_two(spec, num_splits):
    """One tile in flight (the call one_stage picks at large batches) runs the same tiles in the same order as two:
    outputs, logits and lse equal bit for bit, and the reference holds, across partial tiles and page edges."""
    fmt, low = formats(spec, 128, 2)
    Hq, Hkv = 8, 2
    lens = [[300, 129], [64, 1]]
    pool, pt, len_hi, len_lo, _ = build_cache(fmt, low, torch.float16, Hkv, lens, [[100, 0], [65, 200]] if low else None,
                                              DEVICE, 11)
    B = len(lens)
    slots = torch.arange(B, dtype=torch.int32, device=DEVICE)
    q = torch.randn(B, Hq, 128, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    total = len_hi + (len_lo if len_lo is not None else 0)
    nmax = int(total.max()) + NMAX_PAD
    kernel = None if CUDA else _cuda_emu.compiled
    results = []
    for stages in (1, 2):
        out = torch.full_like(q, float("nan"))
        logits = torch.full((B, Hq, nmax), float("nan"), device=DEVICE)
        lse = torch.full((B, Hq), float("nan"), device=DEVICE)
        mid_acc = torch.empty(B, Hq, num_splits, 128, device=DEVICE) if num_splits > 1 else out
        mid_ml = torch.empty(B, Hq, num_splits, 2, device=DEVICE) if num_splits > 1 else out
        mma_cuda.launch_mma(q, pool, fmt, low, pt, len_hi, len_lo, slots, out, mid_acc, mid_ml, logits, lse, 0,
                            128 ** -0.5 * LOG2E, num_splits, compiled=kernel, stages=stages)
        if num_splits > 1:
            merge_splits(mid_acc, mid_ml, out, lse, num_splits, True)
        results.append((out.cpu(), logits.cpu(), lse.cpu()))
    (o1, l1, s1), (o2, l2, s2) = results
    assert torch.equal(o1, o2) and torch.equal(s1, s2) and torch.equal(l1.nan_to_num(-7.0), l2.nan_to_num(-7.0))
    want, _, want_lse = naive_sections(q, pool, fmt, low, torch.float16, pt, len_hi, len_lo, slots.cpu(), 0,
                                       128 ** -0.5, q_levels=mma_cuda.query_levels)
    tol = QTOL[torch.float16]
    torch.testing.assert_close(o1.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(s1.double(), want_lse, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="stages=3"):
        mma_cuda.launch_mma(q, pool, fmt, low, pt, len_hi, len_lo, slots, o1.to(DEVICE), o1.to(DEVICE),
                            o1.to(DEVICE), None, None, 0, 1.0, 1, compiled=kernel, stages=3)
