"""Launch rules of decode attention (diffkv_serve/kernels/decode_attention/launch.py): which kernel serves which pages and how
many ways a launch splits the sequence."""
import torch

from diffkv_serve.kernels.decode_attention import choose_num_splits, decode_kernel

from _paged_cache import formats


def test_choose_num_splits():
    dev = torch.device("cpu")
    assert choose_num_splits(64, 8, 4096, dev, 64) == 1  # batch * heads fills the GPU
    assert choose_num_splits(1, 8, 32, dev, 64) == 1  # too short to split
    assert 1 < choose_num_splits(1, 8, 32768, dev, 64) <= 64
    # SmolLM2's shape (3 KV heads, head_dim 64, 2-warp quantized programs): batch 64 alone starves the SMs
    assert choose_num_splits(64, 3, 8192, dev, 128, num_warps=2, head_dim=64) > 1
    assert choose_num_splits(16, 3, 1024, dev, 128, num_warps=2, head_dim=64) == 8  # one 128-token tile each
    assert choose_num_splits(32, 8, 4096, dev, 128, num_warps=4, head_dim=128) == 1


def test_decode_kernel_choice():
    """16-bit pages go to the f16 kernel, K8V8 pages (integer or e4m3) to q8, any low section or other precision
    to the quartered kernel."""
    pick = {spec: decode_kernel(*formats(spec, 64, 4)) for spec in
            ("K16V16", "K8V8", "K8V8-e4m3", "K8V4", "K4V2", "K2V2", "K16V16+K8V4", "K8V8+K4V2")}
    assert pick == {"K16V16": "f16", "K8V8": "q8", "K8V8-e4m3": "q8", "K8V4": "quartered", "K4V2": "quartered",
                    "K2V2": "quartered", "K16V16+K8V4": "quartered", "K8V8+K4V2": "quartered"}
