"""Worst-case page reservations the scheduler plans with (docs/DESIGN.md "Scheduler and prompt reservation"):
a prompt reserves its all-high pages, a decode step its worst-case growth. One rank's MemoryManager and the
driver's tensor-parallel view (diffkv_serve/engine/kv/distributed.py) both answer with these rules."""
from __future__ import annotations

from diffkv_serve.engine.kv.layout import cdiv


def worst_case_pages(heads: int, tokens_high: int, extra_prompt_pages: int, num_tokens: int) -> int:
    """All-high pages of one sequence of num_tokens tokens over `heads` (layer, KV head) pairs: the prompt
    reservation rule the scheduler plans with, on one device or on the busiest tensor-parallel rank."""
    return heads * (cdiv(num_tokens, tokens_high) + extra_prompt_pages)


def worst_case_growth(heads: int, tokens_high: int, extra_prompt_pages: int, two_sided: bool, old_len: int,
                      new_len: int) -> int:
    """Worst-case new pages to grow a sequence from old_len to new_len cached tokens."""
    if two_sided:
        return heads * (new_len - old_len)  # any head may fill a page on either side
    return (worst_case_pages(heads, tokens_high, extra_prompt_pages, new_len)
            - worst_case_pages(heads, tokens_high, extra_prompt_pages, old_len))
