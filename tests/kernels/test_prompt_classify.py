import os

import pytest
import torch

from diffkv_serve.kernels.prompt_classify import classify_prompt

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
SEQLENS = [1, 5, 64, 65, 300, 9]
Q, WINDOW, H = 64, 8, 3


def _inputs(seed, per_token_alpha=False):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(SEQLENS)
    N = int(lens.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(SEQLENS)), lens)
    n = lens[seq]
    pos = torch.arange(N) - cu[:-1].long()[seq]
    seen = torch.clamp(n - pos, max=Q).clamp_min(1)
    # Means spread over a few decades around the thresholds alpha / i, so every class occurs.
    mean = torch.exp(torch.empty(N, H).uniform_(-9, 1, generator=g)) / (pos + 1).unsqueeze(1)
    sig = (mean * seen.unsqueeze(1)).float()
    ah = torch.full((N,), 1.0)
    al = torch.full((N,), 0.02)
    if per_token_alpha:  # per-request thresholds: constant within a sequence
        ah = torch.rand(len(SEQLENS), generator=g)[seq] * 2
        al = ah * torch.rand(len(SEQLENS), generator=g)[seq] * 0.1
    return sig, pos.to(torch.int32), cu, seq, n.to(torch.int32), ah.float(), al.float()


def _naive(sig, pos, cu, n, ah, al, scale):
    """Token by token in float32 tensors: the class, then running counts per (sequence, head)."""
    B = cu.numel() - 1
    N = sig.shape[0]
    idx_hi = torch.full((N, H), -1, dtype=torch.int32)
    idx_lo = torch.full((N, H), -1, dtype=torch.int32)
    n_hi = torch.zeros(B, H, dtype=torch.int32)
    n_lo = torch.zeros(B, H, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for t in range(int(cu[b]), int(cu[b + 1])):
                p, m = int(pos[t]), int(n[t])
                mean = sig[t, h] / float(max(min(m - p, Q), 1))
                i1 = torch.tensor(float(p + 1))
                if p >= m - WINDOW or mean >= (ah[t] * scale) / i1:
                    idx_hi[t, h] = n_hi[b, h]
                    n_hi[b, h] += 1
                elif mean >= (al[t] * scale) / i1:
                    idx_lo[t, h] = n_lo[b, h]
                    n_lo[b, h] += 1
    return idx_hi, idx_lo, n_hi, n_lo


@pytest.mark.parametrize("per_token_alpha,layer_scale", [(False, None), (True, None), (False, [1.0, 0.25])])
def test_classify_matches_naive_and_kernel_matches_reference(per_token_alpha, layer_scale):
    sig, pos, cu, seq, n, ah, al = _inputs(1, per_token_alpha)
    scale = None if layer_scale is None else torch.tensor(layer_scale)
    want = _naive(sig, pos, cu, n, ah, al, 1.0 if scale is None else float(scale[1]))
    args = (sig, pos, cu, seq, n, ah, al, WINDOW, Q)
    ref = classify_prompt(*args, layer=1, layer_scale=scale, impl="ref")
    for got, exp in zip(ref, want):
        assert torch.equal(got.cpu(), exp)
    counts = [int((want[0] >= 0).sum()), int((want[1] >= 0).sum())]
    assert all(0 < c < sig.numel() for c in counts) and sum(counts) < sig.numel()  # all three classes occur
    dev = [x.to(DEVICE) for x in args[:7]]
    # Small blocks: sequences span several blocks, so the carried counts are exercised.
    for max_seqlen in (16, 300):
        got = classify_prompt(*dev, WINDOW, Q, layer=1, layer_scale=None if scale is None else scale.to(DEVICE),
                              max_seqlen=max_seqlen, impl="triton")
        for g, exp in zip(got, want):
            assert torch.equal(g.cpu(), exp)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_trailing_empty_sequences_get_empty_sections(impl):
    """A graphed prompt step's layout (engine/prefill_graph.py): the real sequences, then empty ones, with a
    max_seqlen bound (the bucket) above the longest. The real sequences classify as without them."""
    sig, pos, cu, seq, n, ah, al = _inputs(3)
    want = classify_prompt(sig, pos, cu, seq, n, ah, al, WINDOW, Q, impl="ref")
    cu_pad = torch.cat([cu, cu[-1:].repeat(4)])
    got = classify_prompt(*[x.to(DEVICE) for x in (sig, pos, cu_pad, seq, n, ah, al)], WINDOW, Q,
                          max_seqlen=1024, impl=impl)
    for g, exp in zip(got[:2], want[:2]):
        assert torch.equal(g.cpu(), exp)
    for g, exp in zip(got[2:], want[2:]):
        assert torch.equal(g.cpu()[: len(SEQLENS)], exp) and not g.cpu()[len(SEQLENS):].any()
