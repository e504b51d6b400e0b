"""The quartered decode kernel (diffkv_serve/kernels/decode_attention/quartered.py: quantized pages, high + low sections) against
the torch reference and float64 loops: outputs, per-token logits and lse, every way of splitting and tiling, both
row-reduction modes, key codes as byte pairs."""
import pytest
import torch

from diffkv_serve.kernels.decode_attention import WIDE_SPLIT_TOKENS, choose_num_splits, launch_config, tile_tokens
from diffkv_serve.kernels.decode_attention.dispatch import paged_decode_attention_triton

from _decode_check import DEVICE, DTYPES, run_sections
from _paged_cache import formats

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

SPECS = ["K8V8", "K4V4", "K4V4/u", "K8V4", "K4V2", "K8V4+K4V2"]  # '/u': a single-precision cache's pages


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("Hq,Hkv,num_splits", [(2, 2, None), (6, 2, 1), (8, 2, 3)])
def test_decode_quantized_sections(spec, Hq, Hkv, num_splits):
    """Lengths 0, 1, T, T+1 per section (T of that section's format), different per head, slots shuffled;
    logits_out / lse_out against float64 loops over the dequantized cache."""
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, fmt_lo = formats(spec, 64, isz)
    th = fmt_hi.tokens
    lens_hi = [[1, th + 1], [th, 0], [0, 3], [2 * th + 5, 0]]
    if fmt_lo is None:
        lens_lo = None
    else:
        tl_ = fmt_lo.tokens
        lens_lo = [[tl_, 1], [0, tl_ + 1], [0, 5], [3, 0]]  # slot 3 head 1: both sections empty
    for dtype in DTYPES:
        res, total = run_sections(spec, dtype, Hq, Hkv, 64, lens_hi, lens_lo, [2, 0, 3, 1], num_splits,
                                  layer=0, seed=Hq + len(spec))
        out = res["triton"][0]
        empty = (total == 0).repeat_interleave(Hq // Hkv, dim=1)
        assert empty.any() and (out[empty] == 0).all()
        assert (res["triton"][2][empty] == float("-inf")).all()


@pytest.mark.parametrize("spec,D,block_n,num_splits", [pytest.param("K8V4+K4V2", 64, 16, None, marks=pytest.mark.slow),
                                                       ("K8V4+K4V2", 64, 32, 5),
                                                       pytest.param("K4V2", 128, 16, None, marks=pytest.mark.slow),
                                                       ("K16V16+K8V4", 64, None, 4),
                                                       ("K8V4+K4V2", 32, 32, None), ("K16V16+K4V2", 32, 16, 3),
                                                       ("K2V2", 128, None, 2)])
@pytest.mark.slow  # long kernel / engine sweeps: CI's second stage
def test_decode_quantized_long_multi_split(spec, D, block_n, num_splits):
    """Long sections split many ways (several tiles per split), GQA 4, two head_dim 128 cases (one in
    launch_config's own tiles); head_dim 32 pads each quarter of the head dimension to the dot's minimum width
    of 16."""
    assert choose_num_splits(2, 2, 600, torch.device(DEVICE), 16) > 1
    lens_hi = [[300, 57], [45, 290]]
    lens_lo = [[250, 260], [0, 131]] if "+" in spec else None
    for dtype in DTYPES:
        run_sections(spec, dtype, 8, 2, D, lens_hi, lens_lo, [1, 0], num_splits, layer=1, seed=D + len(spec),
                     block_n=block_n)


def test_decode_wide_tiles():
    """2-bit values with keys of <= 4 bits take 64-token tiles where a split may cover WIDE_SPLIT_TOKENS tokens
    (tile_tokens), 32 elsewhere; such a launch (max_len 4096 over 2 splits) equals the references."""
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    for spec, wide in (("K4V2", 64), ("K2V2", 64), ("K4V4", 32), ("K8V4", 32)):
        cfg = launch_config(formats(spec, 128, isz)[0], None)
        assert tile_tokens(cfg, 16 * WIDE_SPLIT_TOKENS, 16) == wide and tile_tokens(cfg, 4096, 1) == wide
        assert tile_tokens(cfg, 4096, 16) == 32  # batch 8's 16 splits of 256 tokens
    for dtype in DTYPES:
        run_sections("K2V2", dtype, 8, 2, 128, [[300, 57], [45, 290]], None, [1, 0], 2, layer=1, seed=7,
                     max_len=2 * WIDE_SPLIT_TOKENS)


@pytest.mark.parametrize("red", [0, 1])
@pytest.mark.parametrize("spec,Hq,Hkv,D,block_n,num_splits", [("K8V4+K4V2", 8, 2, 64, 16, 3),
                                                               ("K16V16+K4V2", 16, 1, 32, 16, None)])
@pytest.mark.slow  # long kernel / engine sweeps: CI's second stage
def test_decode_row_sum_modes(red, spec, Hq, Hkv, D, block_n, num_splits):
    """Both ways of reducing a tile's rows (LaunchConfig.red): several tiles per split, both sections; GQA 16
    fills the dot's rows (no padding row for the top value scale), a 16-bit high section has no value scales."""
    lens_hi = [[90, 37], [45, 0]]
    lens_lo = [[70, 3], [0, 41]]
    for dtype in DTYPES:
        run_sections(spec, dtype, Hq, Hkv, D, [r[:Hkv] for r in lens_hi],
                     [r[:Hkv] for r in lens_lo], [1, 0], num_splits, layer=1, seed=D + red, block_n=block_n,
                     red=red)


@pytest.mark.slow  # long kernel / engine sweeps: CI's second stage
@pytest.mark.parametrize("key_pairs", [False, True])
@pytest.mark.parametrize("spec,Hq,Hkv", [("K8V4+K4V2", 8, 2), ("K16V16+K4V2", 8, 2), ("K4V4", 6, 2), ("K2V2", 2, 2)])
def test_decode_key_pairs(key_pairs, spec, Hq, Hkv):
    """Quantized keys read as byte pairs against a zero-padded q (LaunchConfig.key_pairs, the head_dim >= 128
    default) and the byte path: every key width (8/4/2 bits; 16-bit sections keep the byte-free path), GQA 4,
    3 and 1, several tiles per split, both sections."""
    lens_hi = [[90, 37], [45, 0]]
    lens_lo = [[70, 3], [0, 41]] if "+" in spec else None
    for dtype in DTYPES:
        run_sections(spec, dtype, Hq, Hkv, 128, lens_hi, lens_lo, [1, 0], 2, layer=1, seed=len(spec) + key_pairs,
                     block_n=16, key_pairs=key_pairs)


def test_decode_key_pairs_needs_head_dim_128():
    isz = torch.empty((), dtype=DTYPES[0]).element_size()
    fmt_hi, _ = formats("K4V2", 64, isz)
    pool = torch.zeros(2, fmt_hi.page_bytes, dtype=torch.uint8, device=DEVICE)
    pt = torch.zeros(1, 1, 1, 3, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, 1, 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 2, 64, device=DEVICE).to(DTYPES[0])
    cfg = launch_config(fmt_hi, None)._replace(key_pairs=True)
    with pytest.raises(ValueError, match="key_pairs"):
        paged_decode_attention_triton(q, pool, fmt_hi, DTYPES[0], pt, lens, torch.zeros(1, dtype=torch.int32,
                                                                                          device=DEVICE), 0, 0.125,
                                      config=cfg)
