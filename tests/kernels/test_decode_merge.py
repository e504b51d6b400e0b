"""The split merge (diffkv_serve/kernels/decode_attention/merge.py) against its torch reference: random partials of
several (sequence, query head) rows per program, splits without tokens, rows past the last program's end."""
import math
import os

import pytest
import torch

from diffkv_serve.kernels.decode_attention.merge import MergeLaunch, merge_launch, merge_splits, merge_splits_ref

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")


def test_merge_launch():
    assert merge_launch(4, 128) == MergeLaunch(rows=16, chunk=32, warps=4)  # 4 splits x 32 dims: 32 rows, capped
    assert merge_launch(8, 128) == MergeLaunch(rows=16, chunk=32, warps=4)
    assert merge_launch(16, 128) == MergeLaunch(rows=2, chunk=32, warps=1)  # 1,024 elements: 16 x 32 x 2 rows
    assert merge_launch(3, 128) == MergeLaunch(rows=16, chunk=32, warps=4)  # 3 splits pad to 4
    assert merge_launch(64, 128) == MergeLaunch(rows=1, chunk=32, warps=1)
    assert merge_launch(64, 16) == MergeLaunch(rows=1, chunk=16, warps=1)  # a slice is never wider than head_dim
    assert merge_launch(48, 64).rows == 1  # 48 splits pad to 64


@pytest.mark.parametrize("B,Hq,splits,D,dtype", [
    (3, 5, 4, 64, torch.float16),  # 15 rows in one program of 16: its last row is past the end
    (5, 7, 3, 32, torch.bfloat16),  # split count not a power of two; 35 rows over three programs of 16
    (1, 3, 64, 64, torch.float32),  # one row a program, two slices of head_dim
    (2, 3, 5, 48, torch.float16),  # head_dim not a power of two: the second slice is half masked
])
def test_merge_matches_reference(B, Hq, splits, D, dtype):
    g = torch.Generator().manual_seed(B * 100 + splits)
    acc = torch.randn(B, Hq, splits, D, generator=g)
    ml = torch.stack([torch.randn(B, Hq, splits, generator=g) * 4,
                      torch.rand(B, Hq, splits, generator=g) * 10 + 0.5], -1)
    ml[0, 0, 1:, 1] = 0.0  # row (0, 0): only its first split holds tokens
    acc[0, 0, 1:] = 0.0
    ml[-1, -1, :, 1] = 0.0  # the last row: no tokens at all
    acc[-1, -1] = 0.0
    want_out, want_lse = merge_splits_ref(acc, ml)
    out = torch.full((B, Hq, D), float("nan"), dtype=dtype, device=DEVICE)
    lse = torch.full((B, Hq), float("nan"), device=DEVICE)
    merge_splits(acc.to(DEVICE), ml.to(DEVICE), out, lse, splits, True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]  # the output dtype's rounding
    torch.testing.assert_close(out.float().cpu(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)
    assert want_lse[-1, -1] == float("-inf") and torch.all(out[-1, -1].float().cpu() == 0)
    # row (0, 0) is its first split's own partial: acc / l, lse = m + log2(l) in nats
    torch.testing.assert_close(want_out[0, 0], acc[0, 0, 0] / ml[0, 0, 0, 1])
    assert math.isclose(float(want_lse[0, 0]), (float(ml[0, 0, 0, 0]) + math.log2(float(ml[0, 0, 0, 1]))) * math.log(2),
                        rel_tol=1e-5)


def test_merge_without_lse_leaves_it_alone():
    acc = torch.randn(4, 6, 2, 32)
    ml = torch.stack([torch.randn(4, 6, 2), torch.rand(4, 6, 2) + 0.5], -1)
    out = torch.empty(4, 6, 32, device=DEVICE)
    lse = torch.full((4, 6), 7.0, device=DEVICE)
    merge_splits(acc.to(DEVICE), ml.to(DEVICE), out, lse, 2, False)
    torch.testing.assert_close(out.cpu(), merge_splits_ref(acc, ml)[0], atol=1e-5, rtol=1e-5)
    assert torch.all(lse == 7.0)


def test_forced_launches_give_the_same_merge():
    """merge_splits(launch=) (benchmarks time whole rows a program against the default) changes only the launch."""
    acc = torch.randn(3, 4, 4, 64)
    ml = torch.stack([torch.randn(3, 4, 4), torch.rand(3, 4, 4) + 0.5], -1)
    outs = []
    for launch in (MergeLaunch(1, 64, 4), MergeLaunch(4, 16, 1), MergeLaunch(2, 128, 2), None):
        out = torch.empty(3, 4, 64, device=DEVICE)
        lse = torch.empty(3, 4, device=DEVICE)
        merge_splits(acc.to(DEVICE), ml.to(DEVICE), out, lse, 4, True, launch=launch)
        outs.append((out.cpu(), lse.cpu()))
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, outs[0][1], atol=1e-6, rtol=1e-6)
    for bad in (MergeLaunch(3, 32, 4), MergeLaunch(1, 24, 4)):
        with pytest.raises(ValueError, match="is not a power of two"):
            merge_splits(acc.to(DEVICE), ml.to(DEVICE), outs[0][0].to(DEVICE), outs[0][0].to(DEVICE), 4, False,
                         launch=bad)
