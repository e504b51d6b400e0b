"""PageFormat's segment offsets: the key, value and scale/zero segments fill data_bytes from the page's start,
followed by the score and position rows on tracked pages only."""
import pytest

from diffkv_serve.kernels.page_layout import ALIGN, PageFormat, page_bytes_for

D, FULL = 64, 2  # head_dim, fp16 cache


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


def _side_bytes(bits, tokens):
    """A side's data segment plus its scale/zero segment (none at 16 bits)."""
    return _aligned(tokens * D * FULL) if bits == 16 else _aligned(tokens * D * bits // 8) + _aligned(tokens * 4)


@pytest.mark.parametrize("tracked", [True, False])
@pytest.mark.parametrize("kb,vb,float8", [(16, 16, False), (8, 8, False), (4, 4, False), (8, 4, False),
                                          (4, 2, False), (8, 8, True)])
def test_data_bytes_is_the_key_value_and_scale_segments(kb, vb, float8, tracked):
    fmt = PageFormat.make(kb, vb, D, page_bytes_for(16, D, FULL, tracked), FULL, float8=float8, tracked=tracked)
    assert fmt.data_bytes == _side_bytes(kb, fmt.tokens) + _side_bytes(vb, fmt.tokens)
    if tracked:
        assert fmt.score_off == fmt.data_bytes
        assert fmt.pos_off + _aligned(fmt.tokens * 4) <= fmt.page_bytes
    else:
        # the page holds as many tokens as fit: one more would not
        assert fmt.data_bytes <= fmt.page_bytes < _side_bytes(kb, fmt.tokens + 1) + _side_bytes(vb, fmt.tokens + 1)


def test_data_bytes_of_an_untracked_k4v4_page():
    """56 tokens in the bytes of a 16-token fp16 page (4096): 2 x 1792 packed bytes + 2 x 224 scale/zero bytes."""
    fmt = PageFormat.make(4, 4, D, 4096, FULL, tracked=False)
    assert (fmt.tokens, fmt.data_bytes) == (56, 4032)
