"""The decode-attention entry points (diffkv_serve/kernels/decode_attention/dispatch.py): every kernel behind one launcher with
a LaunchConfig override, and the validation of a call (a low section without its format, a forced kernel that
cannot serve the pages)."""
import pytest
import torch

from diffkv_serve.kernels.decode_attention import decode_kernel, paged_decode_attention, paged_decode_attention_triton

from _decode_check import DEVICE, DTYPES, run_sections
from _paged_cache import formats

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@pytest.mark.parametrize("min_rows", [1, 4, 16])
@pytest.mark.parametrize("spec,Hq,Hkv,D", [("K8V4+K4V2", 6, 2, 64), ("K8V8", 8, 2, 64), ("K16V16", 9, 3, 32),
                                           ("K4V2", 8, 2, 128)])
def test_decode_group_rows(min_rows, spec, Hq, Hkv, D):
    """The query group's tile padded to other row counts than the default (LaunchConfig.min_rows): unpadded
    (groups 3 and 4 in 4 rows; 1 -> the group's power of two), and 16; every kernel (quartered, q8, f16)."""
    lens_hi = [[50, 37, 3], [45, 0, 20]]
    lens_lo = [[30, 3, 0], [0, 41, 9]] if "+" in spec else None
    for dtype in DTYPES:
        run_sections(spec, dtype, Hq, Hkv, D, [r[:Hkv] for r in lens_hi],
                     None if lens_lo is None else [r[:Hkv] for r in lens_lo], [1, 0], 2, layer=1,
                     seed=D + min_rows, block_n=16, min_rows=min_rows)


def test_decode_low_section_needs_format():
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, fmt_lo = formats("K8V4+K4V2", 64, isz)
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    pool = torch.zeros(2, fmt_hi.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for impl in ("triton", "ref"):
        with pytest.raises(ValueError, match="fmt_low"):
            paged_decode_attention(q, pool, fmt_hi, DTYPES[0], pt, lens, slots, 0, impl=impl, len_low=lens)


def test_quartered_kernel_refuses_e4m3_pages():
    """Only the q8 kernel decodes e4m3 codes: forcing the quartered kernel onto them is an error naming the pages."""
    fmt, _ = formats("K8V8-e4m3", 64, torch.empty((), dtype=DTYPES[0]).element_size())
    assert decode_kernel(fmt, None) == "q8"
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, 1, 1, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="K8V8-e4m3"):
        paged_decode_attention_triton(q, pool, fmt, DTYPES[0], pt, lens, slots, 0, 0.125, kernel="quartered")


def test_q8_refuses_other_pages():
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt, _ = formats("K8V4", 64, isz)
    assert decode_kernel(fmt, None) == "quartered"
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, 1, 1, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        paged_decode_attention_triton(q, pool, fmt, DTYPES[0], pt, lens, slots, 0, 0.125, kernel="q8")


def test_bad_shapes_raise_value_errors_naming_the_argument():
    fmt, _ = formats("K8V8", 16, 2)
    q = torch.randn(2, 3, 16)
    table = torch.zeros(2, 1, 2, 4, dtype=torch.int32)  # 2 KV heads: 3 query heads do not group
    args = (torch.zeros(64, dtype=torch.float16), fmt, torch.float16, table, torch.ones(2, 1, 2, dtype=torch.int32),
            torch.arange(2), 0, 0.25)
    with pytest.raises(ValueError, match="q: 3 query heads"):
        paged_decode_attention_triton(q, *args)
    with pytest.raises(ValueError, match="out: shape"):
        paged_decode_attention_triton(torch.randn(2, 4, 16), *args, out=torch.empty(2, 4, 8))


def test_q8_launch_follows_the_grid_size():
    """K8V8 calls at head_dim 128 (132 SMs): narrow programs where the wide launch would cut sequences into splits
    shorter than WIDE_SPLIT_TOKENS, their split count a power of two; wide where its splits are longer, and one
    wide program per (sequence, KV head) at mid-sized grids; narrow again from 4 wide programs per SM; heads
    narrower than 128 stay wide."""
    from diffkv_serve.kernels.decode_attention.launch import Q8_NARROW, Q8_WIDE, choose_num_splits, q8_launch

    cpu = torch.device("cpu")
    assert q8_launch(8, 2, 4096, cpu, 128) == (Q8_NARROW, 32)  # choose_num_splits says 33 for two warps
    assert choose_num_splits(8, 2, 4096, cpu, 64, 2, 128) == 33
    assert q8_launch(32, 2, 1024, cpu, 128) == (Q8_NARROW, 8)
    assert q8_launch(8, 2, 1024, cpu, 128) == (Q8_NARROW, 16)  # one 64-token tile a split at most
    assert q8_launch(8, 2, 16384, cpu, 128) == (Q8_WIDE, 16)  # 1,024-token wide splits
    assert q8_launch(32, 2, 16384, cpu, 128) == (Q8_WIDE, 4)
    assert q8_launch(128, 2, 1024, cpu, 128) == (Q8_WIDE, 1)  # 256 programs: < 4 per SM
    assert q8_launch(32, 8, 16384, cpu, 128) == (Q8_WIDE, 1)
    assert q8_launch(128, 8, 1024, cpu, 128) == (Q8_NARROW, 1)  # 1,024 programs
    assert q8_launch(8, 2, 4096, cpu, 64)[0] == Q8_WIDE
