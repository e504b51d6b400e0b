"""The hand-written CUDA kernel for K4V2 pages (kernels/decode_attention/k4v2_cuda.py, k4v2_mma.cu): which calls it
serves, that the launcher passes what the kernel's signature takes, and (on CUDA) its outputs against float64 loops
over the dequantized cache: GQA groups 1-8, one and many splits, partial tiles, tiles across a page boundary, heads
without tokens, fp16 and bf16."""
import math
import re

import pytest
import torch

from kernels.decode_attention import k4v2_cuda, paged_decode_attention_triton

from _decode_check import DEVICE, QTOL, naive_sections
from _paged_cache import build_cache, formats

CUDA = DEVICE.startswith("cuda")


def test_usable_names_what_it_cannot_serve():
    q = torch.zeros(2, 8, 128, dtype=torch.float16)
    k4v2, _ = formats("K4V2", 128, 2)
    k8v4, k4v2_low = formats("K8V4+K4V2", 128, 2)
    assert k4v2_cuda.usable(k4v2, False, q, False, False) == "not a CUDA device"
    if CUDA:
        qc = q.to(DEVICE)
        assert k4v2_cuda.usable(k4v2, False, qc, False, False) is None
        assert "K8V4" in k4v2_cuda.usable(k8v4, False, qc, False, False)
        assert k4v2_cuda.usable(k4v2, True, qc, False, False) == "a low section"
        assert "logits" in k4v2_cuda.usable(k4v2, False, qc, True, False)
        assert "head_dim 64" in k4v2_cuda.usable(formats("K4V2", 64, 2)[0], False, qc[..., :64], False, False)
        assert "float32" in k4v2_cuda.usable(k4v2, False, qc.float(), False, False)


def test_forcing_it_where_it_cannot_serve_raises():
    fmt, _ = formats("K4V2", 128, 4)
    pool, pt, lens, _, _ = build_cache(fmt, None, torch.float32, 2, [[5, 3]], None, DEVICE, 0)
    q = torch.randn(1, 8, 128, device=DEVICE)
    why = k4v2_cuda.usable(fmt, False, q, False, False)  # a float32 q (and no GPU on CPU runs)
    assert why is not None
    with pytest.raises(ValueError, match=re.escape(f"(k4v2_cuda: {why})")):
        paged_decode_attention_triton(q, pool, fmt, torch.float32, pt, lens, torch.zeros(1, dtype=torch.int32,
                                      device=DEVICE), 0, 0.1, kernel="k4v2_cuda")


def _signature(src: str) -> list[str]:
    body = re.search(r"decode_k4v2\((.*?)\)\s*\{", src, re.S).group(1)
    return [p.strip() for p in body.split(",")]


def test_launcher_passes_what_the_signature_takes(monkeypatch):
    """Pointers for the tensors, C ints for Python ints, a double for the Python float (torch's launcher converts
    them so), in the kernel's order and number."""
    params = _signature(k4v2_cuda.SOURCE.read_text())
    calls = []
    monkeypatch.setattr(k4v2_cuda, "_compiled", lambda dev, bf16: lambda **kw: calls.append(kw))
    fmt, _ = formats("K4V2", 128, 2)
    B, Hq, Hkv = 2, 12, 2
    q = torch.zeros(B, Hq, 128, dtype=torch.float16)
    pt = torch.zeros(3, 2, Hkv, 5, dtype=torch.int32)
    lens = torch.zeros(3, 2, Hkv, dtype=torch.int32)
    k4v2_cuda.launch_k4v2(q, torch.zeros(4, fmt.page_bytes, dtype=torch.uint8), fmt, pt, lens,
                          torch.zeros(B, dtype=torch.int32), q, q, q, 1, 0.5, 4)
    (call,) = calls
    assert call["grid"] == (B, Hkv, 4) and call["block"] == (32, 1, 1)
    assert call["shared_mem"] == k4v2_cuda.shared_bytes() <= 48 * 1024
    args = call["args"]
    assert len(args) == len(params)
    for a, p in zip(args, params):
        if "*" in p:
            assert isinstance(a, torch.Tensor), p
        elif p.startswith("double"):
            assert isinstance(a, float), p
        else:
            assert p.startswith("int") and isinstance(a, int) and not isinstance(a, bool), p
    named = dict(zip([p.split()[-1] for p in params], args))
    assert named["group"] == Hq // Hkv and named["T"] == fmt.tokens and named["num_splits"] == 4
    assert (named["k_off"], named["k_meta"], named["v_off"], named["v_meta"]) == (
        fmt.k_off, fmt.k_meta_off, fmt.v_off, fmt.v_meta_off)


@pytest.mark.skipif(not CUDA, reason="CUDA kernel: DIFFKV_TEST_DEVICE=cuda runs it on the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,lens,num_splits", [
    (8, 2, [[1000, 777], [64, 0]], 1),        # GQA 4: partial last tile, a head without tokens
    (8, 2, [[1000, 777], [64, 0]], 5),        # splits, some of them empty
    (12, 2, [[4096, 150], [1, 74]], None),    # GQA 6 (Qwen2.5-1.5B), the automatic split count
    (8, 1, [[75], [148]], 2),                 # GQA 8; tiles across page boundaries (74-token pages)
    (4, 4, [[300, 129, 63, 2000]], 3),        # GQA 1
])
def test_k4v2_cuda_matches_float64_loops(dtype, Hq, Hkv, lens, num_splits):
    fmt, _ = formats("K4V2", 128, 2)
    assert fmt.tokens >= k4v2_cuda.TILE
    pool, pt, len_hi, _, _ = build_cache(fmt, None, dtype, Hkv, lens, None, DEVICE, seed=sum(map(sum, lens)))
    B = len(lens)
    slots = torch.arange(B, dtype=torch.int32, device=DEVICE).flip(0)
    q = torch.randn(B, Hq, 128, device=DEVICE).to(dtype)
    scale = 1 / math.sqrt(128)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_triton(q, pool, fmt, dtype, pt, len_hi, slots, 0, scale, num_splits=num_splits, out=out,
                                  kernel="k4v2_cuda")
    want, _, _ = naive_sections(q, pool, fmt, None, dtype, pt, len_hi, None, slots.cpu(), 0, scale)
    tol = QTOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    # the default pick for these calls, and the Triton kernel beside it
    assert torch.equal(paged_decode_attention_triton(q, pool, fmt, dtype, pt, len_hi, slots, 0, scale,
                                                     num_splits=num_splits), out)
    tri = paged_decode_attention_triton(q, pool, fmt, dtype, pt, len_hi, slots, 0, scale, num_splits=num_splits,
                                        kernel="quartered")
    torch.testing.assert_close(out, tri, atol=tol, rtol=tol)
