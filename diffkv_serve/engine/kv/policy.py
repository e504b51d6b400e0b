"""The KV cache of one worker: the memory manager plus the compression policy that decides where each
token lives (DiffKV paper §4-§5). Every mode uses the same pages and kernels:

  fp16 / int8 / int4 / fp8   one precision, every token in the high section, nothing pruned (fp8: e4m3 codes)
  diffkv               high (K8V4) and low (K4V2) sections per (sequence, layer, KV head), the rest pruned

Prompt: each layer scores its tokens (attention from the last queries), classifies them (recent window
and score >= alpha_high / i: high; >= alpha_low / i: low; else pruned) and writes them quantized into the
all-high reservation (high pages from its left, low pages from its right); after the forward the unused
pages are recycled in one batched operation. With learned reservation (SchedulerConfig.reservation) nothing is
reserved: each layer takes exactly its plan's pages, and flags a sequence they do not fit for (the scheduler
retries it). With CacheConfig.pin_prompt_blocks (prefix caching) a prompt's full blocks of T_high tokens
are pinned: high, never demoted, pruned or moved (their significance is +inf), so their pages can be the
prefix cache's, shared read-only by every request with that prefix. Generation: before each step the token
leaving the window is placed by Algorithm 1 (compression_plan); then each head gets at most one new page, the
tokens move and the new token is appended to the high section (diffkv_serve/kernels/decode_pages.py, two launches); the decode kernel
returns each token's attention, which is added to its score. All of it is batched over (sequence, layer, head)
on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from diffkv_serve.engine.config import CacheConfig
from diffkv_serve.engine.host_copy import to_device
from diffkv_serve.engine.kv.layout import CacheShape
from diffkv_serve.engine.kv.pool import MemoryManager
from diffkv_serve.engine.kv.request_settings import KVRequestSettings
from diffkv_serve.engine.profiling import cost_range, costed
from diffkv_serve.kernels.compression_plan import BIG, compression_plan
from diffkv_serve.kernels.decode_pages import decode_pages
from diffkv_serve.kernels.decode_attention import paged_decode_attention
from diffkv_serve.kernels.kv_write import KVWrite, write_kv
from diffkv_serve.kernels.kv_write_sections import write_sections
from diffkv_serve.kernels.prompt_classify import (classify_prompt, pin_significance, prompt_mean_significance,
                                                 segment_index)
from diffkv_serve.kernels.prompt_significance import budget_keep_mask, prompt_significance
from diffkv_serve.kernels.quant import read_rows_ref, stored_rows_ref
from diffkv_serve.kernels.score_update import accumulate_scores
from diffkv_serve.kernels.sections import section_columns

# token_classes: where a token position lives in one (layer, KV head)
PRUNED, KEPT_LOW, KEPT_HIGH = 0, 1, 2


@dataclass
class PrefillInfo:
    """Per-step tensors a diffkv prefill needs besides the model's (all on the device)."""

    slots: torch.Tensor  # int32 [B]
    token_slots: torch.Tensor  # int64 [N]
    seq_of_token: torch.Tensor  # int64 [N]
    seq_len_of_token: torch.Tensor  # int32 [N]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    alpha_high: torch.Tensor  # f32 [N]
    alpha_low: torch.Tensor  # f32 [N]
    n_high: torch.Tensor  # int32 [B, L, H], filled layer by layer
    n_low: torch.Tensor
    # Learned reservation: no all-high reservation; each layer takes its pages, and a sequence they do not
    # fit for is flagged here (bool [B]) instead (MemoryManager.alloc_prompt_layer). None: reserved.
    overflow: Optional[torch.Tensor] = None
    max_new_pages: int = 0  # host bound on one head's pages in a layer (alloc_prompt_layer)
    # CacheConfig.pin_prompt_blocks: each prompt's first floor(n / pin_block) * pin_block tokens (its full
    # prefix-cache blocks) are pinned high; 0: nothing pinned.
    pin_block: int = 0
    # A prompt step replayed from a CUDA graph (engine/prefill_graph.py) pads to its bucket with one padding
    # sequence and empty ones: bool [B], True for those. They plan no pages and write nothing.
    padding: Optional[torch.Tensor] = None


@dataclass
class CachedPrefix:
    """A prefill batch that reads cached prompt blocks (engine.kv.prefix_cache).

    Keys are every prompt token of the batch, packed per sequence (cached prefix, then the computed
    suffix); queries only the computed ones. All on the device."""

    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: computed tokens per sequence
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]: all prompt tokens per sequence
    max_len_k: int
    key_positions: torch.Tensor  # int32 [Nk]
    suffix_rows: torch.Tensor  # int64 [Nq]: each computed token's row among the keys
    prefix_rows: torch.Tensor  # int64 [Np]: rows of the cached tokens
    prefix_blocks: torch.Tensor  # int64 [Np]: block id of each cached token
    prefix_offsets: torch.Tensor  # int64 [Np]: its row in the block's page


class KVCache:
    def __init__(self, config: CacheConfig, shape: CacheShape, num_pages: int, cache_dtype: torch.dtype,
                 device: torch.device, num_query_heads: int):
        self.config = config
        high, low = config.precisions()
        self.mm = MemoryManager(shape, num_pages, cache_dtype, device, high=high, low=low, float8=config.float8,
                                low_grows=config.policy == "thresholds", low_tracked=config.tracks_low_tokens())
        self.diffkv = low is not None
        self.pins_prompt_blocks = config.pins_prompt_blocks()  # CacheConfig.pin_prompt_blocks, resolved
        config.check_num_layers(shape.num_layers)
        # Per-layer budgets: [L] multipliers of the alphas (None: one global pair of thresholds).
        scale = config.layer_alpha_scale if self.diffkv and config.policy == "thresholds" else None
        self.layer_scale = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=device)
        self.significance_probe = None  # evals/layer_profile.py: called with each layer's prompt significance
        # Each slot's request settings (diffkv_serve/engine/kv/request_settings.py), written at its sequence's prefill and read
        # by every decode step on the device, eager or replayed in a CUDA graph: they never change during a
        # request, so no step copies them. Row max_seqs is the dummy slot of padded graph rows: all zeros.
        S = shape.max_seqs + 1
        self.slot_alphas = torch.zeros(3, S, dtype=torch.float32, device=device)  # high, low, prompt's low
        self.slot_ranges = torch.zeros(3, S, dtype=torch.int32, device=device)  # prompt length, prunable [lo, hi)
        self.num_query_heads = num_query_heads
        self.last_mm_seconds = 0.0
        self._mm_events: Optional[tuple] = None
        # (layer, slots, logits, lse) of a decode layer whose score update waits for the next layer's K/V write
        self._pending_scores: Optional[tuple] = None

    # ---- per-slot request settings -------------------------------------------------------------------
    def write_slot_settings(self, slots: torch.Tensor, settings: list[KVRequestSettings],
                            prompt_lens: list[int]) -> None:
        """A prefill's sequences (device slots [B]) take their slots: their thresholds and prunable positions
        go into the per-slot table (two small copies per prefill batch, none per decode step)."""
        ranges = [_prunable(s, n0) for s, n0 in zip(settings, prompt_lens)]
        alphas = [[s.alpha_high for s in settings], [s.alpha_low for s in settings],
                  [s.prefill_alpha_low for s in settings]]
        ints = [list(prompt_lens), [lo for lo, _ in ranges], [hi for _, hi in ranges]]
        at = slots.long()
        self.slot_alphas[:, at] = to_device(alphas, torch.float32, self.mm.device)
        self.slot_ranges[:, at] = to_device(ints, torch.int32, self.mm.device)

    def prompt_alphas(self, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """alpha_high and the prompt's alpha_low of each prompt token (int64 [N] slots), from the table."""
        return self.slot_alphas[0, token_slots], self.slot_alphas[2, token_slots]

    # ---- prompt ------------------------------------------------------------------------------------
    @costed("attention")  # the K/V writes (and cached-prefix reads); classification and pages marked inside
    def prefill_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      dst_page: torch.Tensor, dst_row: torch.Tensor, scale: float,
                      info: Optional[PrefillInfo], max_len: int,
                      prefix: Optional[CachedPrefix] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's prompt K/V; returns the K/V its queries attend over (cached prefix included)."""
        mm = self.mm
        if not self.diffkv:
            write_kv(mm.pool, mm.fmt_high, mm.cache_dtype, k, v, dst_page[layer], dst_row[layer], positions)
            return (k, v) if prefix is None else self._with_prefix(layer, k, v, prefix)
        cfg = self.config
        cu_q = hit_rows = pinned = None
        if prefix is not None:  # the whole prompt is classified: its cached (pinned) blocks' tokens too
            k, v = self._with_prefix(layer, k, v, prefix)
            positions, max_len, cu_q = prefix.key_positions, prefix.max_len_k, prefix.cu_seqlens_q
            hit_rows = prefix.prefix_rows
        k_att, v_att = k, v  # what the queries attend over and score with
        if info.pin_block:
            # Pinned tokens are attended as stored, as a later request reading their shared pages sees them;
            # the pages are written from the computed values (a stored value quantized again could move).
            pinned = positions < (info.seq_len_of_token // info.pin_block) * info.pin_block
            k_att, v_att = self._as_stored(k, v, pinned, hit_rows)
        with cost_range("policy"):
            sig = prompt_significance(q, k_att, info.cu_seqlens, scale, num_queries=cfg.significance_queries,
                                      max_seqlen=max_len, cu_seqlens_q=cu_q)  # [N, H] sums of attention received
            if pinned is not None:
                sig = pin_significance(sig, pinned)
            if cfg.policy == "budget" or self.significance_probe is not None:
                mean = prompt_mean_significance(sig, positions, info.seq_len_of_token, cfg.significance_queries)
                if self.significance_probe is not None:
                    self.significance_probe(layer, mean, positions, info)
            if cfg.policy == "budget":  # equal-budget pruning baseline: one precision, top tokens per head
                is_high = budget_keep_mask(mean, positions, info.seq_len_of_token, info.seq_of_token,
                                           info.cu_seqlens, cfg.budget, cfg.window)
                idx_high, n_high = segment_index(is_high, info.cu_seqlens, info.seq_of_token)
                idx_low, n_low = segment_index(torch.zeros_like(is_high), info.cu_seqlens, info.seq_of_token)
            else:  # one fused launch on the GPU (classes and section indices)
                idx_high, idx_low, n_high, n_low = classify_prompt(
                    sig, positions, info.cu_seqlens, info.seq_of_token, info.seq_len_of_token, info.alpha_high,
                    info.alpha_low, cfg.window, cfg.significance_queries, layer, self.layer_scale, max_len)
            if hit_rows is not None:  # pinned high, in pages the cache owns: counted, never written again
                idx_high = idx_high.index_fill(0, hit_rows, -1)
            if info.padding is not None:  # a graphed step's padding sequence plans no page
                n_high = n_high.masked_fill(info.padding.unsqueeze(1), 0)
                n_low = n_low.masked_fill(info.padding.unsqueeze(1), 0)
        with cost_range("memory"):
            if info.overflow is not None:  # learned reservation: pages taken while they last
                mm.alloc_prompt_layer(info.slots, layer, n_high, n_low, info.overflow, info.max_new_pages)
                where = {}
            else:  # low pages sit at the right end of the all-high reservation
                mm.fit_prompt_plan(info.slots, layer, n_high, n_low)
                where = dict(right_of=mm.held_high)
            # Writes go nowhere for an overflowed sequence, and for a graphed step's padding: its section indices
            # (up to the bucket's size) may lie past any sequence's page-table row, so they are not looked up.
            drops = [d for d in (info.overflow, info.padding) if d is not None]
            if drops:
                where.update(drop=drops[0] if len(drops) == 1 else drops[0] | drops[1], seq_of_token=info.seq_of_token)
        # Both sections' rows looked up and written in one launch (diffkv_serve/kernels/kv_write_sections.py).
        write_sections(mm.pool, mm.fmt_high, mm.fmt_low, mm.cache_dtype, k, v, positions, sig, mm.page_table, layer,
                       info.token_slots, idx_high, idx_low, **where)
        info.n_high[:, layer] = n_high
        info.n_low[:, layer] = n_low
        return k_att, v_att

    def _with_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     prefix: CachedPrefix) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of every prompt token: cached blocks' rows (read from their pages: exact in fp16, as stored
        in the high precision otherwise) and the computed suffix, packed per sequence."""
        mm = self.mm
        nk = prefix.key_positions.numel()
        k_all, v_all = k.new_empty(nk, *k.shape[1:]), v.new_empty(nk, *v.shape[1:])
        k_all[prefix.suffix_rows], v_all[prefix.suffix_rows] = k, v
        if prefix.prefix_rows.numel():
            pages = mm.block_pages[prefix.prefix_blocks, layer].long()  # [Np, H]
            rows = prefix.prefix_offsets.unsqueeze(1).expand_as(pages)
            for side, dst in (("k", k_all), ("v", v_all)):
                dst[prefix.prefix_rows] = read_rows_ref(mm.pool, mm.fmt_high, mm.cache_dtype, side, pages,
                                                        rows).to(dst.dtype)
        return k_all, v_all

    def _as_stored(self, k: torch.Tensor, v: torch.Tensor, pinned: torch.Tensor,
                   hit_rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v with the computed pinned rows replaced by what their high-precision pages will return: with or
        without a cache hit, every query then sees a pinned token the same way (cached rows were read so)."""
        rows = (pinned if hit_rows is None else pinned.index_fill(0, hit_rows, False)).view(-1, 1, 1)
        mm = self.mm  # every row converted, then selected: no data-dependent shape, no host sync
        k = torch.where(rows, stored_rows_ref(k, mm.fmt_high, mm.cache_dtype, "k").to(k.dtype), k)
        v = torch.where(rows, stored_rows_ref(v, mm.fmt_high, mm.cache_dtype, "v").to(v.dtype), v)
        return k, v

    @costed("memory")
    def finish_prefill(self, info: Optional[PrefillInfo]) -> None:
        if self.diffkv and info.overflow is not None:
            self.mm.set_prompt_lengths(info.slots, info.n_high, info.n_low, info.overflow)
        elif self.diffkv:
            self.mm.finish_prompt(info.slots, info.n_high, info.n_low)

    # ---- generation ----------------------------------------------------------------------------------
    def prepare_decode(self, slots: torch.Tensor, seq_len: torch.Tensor,
                       timed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Place the token leaving the window (diffkv), give heads their page, append the new token's slot.

        slots int32 [B]; seq_len int32 [B] = tokens after this step's token; returns write targets [L, B, H].
        Thresholds, prompt lengths and prunable positions come from the per-slot table (write_slot_settings).
        No host synchronization: a CUDA graph can capture it (timed=False there; the graph runner times it).
        """
        plan = self.plan_decode(slots, seq_len)
        return self.decode_pages(slots, seq_len, plan, timed)

    @costed("policy")
    def plan_decode(self, slots: torch.Tensor, seq_len: torch.Tensor) -> Optional[dict]:
        """diffkv: Algorithm 1 for the token leaving each head's window (None for one precision), with each
        slot's settings gathered from the per-slot table on the device."""
        if not self.diffkv:
            return None
        if self._pending_scores is not None:  # a step cut short before its last layer: its update still counts
            self._flush_scores()
        mm, at = self.mm, slots.long()
        alpha_high, alpha_low = self.slot_alphas[0, at], self.slot_alphas[1, at]
        prompt_len, lo, hi = self.slot_ranges[:, at].unbind(0)
        return compression_plan(mm.pool, mm.fmt_high, mm.fmt_low, mm.page_table, mm.len_high, mm.len_low, slots,
                                prompt_len, seq_len, alpha_high, alpha_low, self.config.window,
                                num_queries=self.config.significance_queries,
                                budget=self.config.budget if self.config.policy == "budget" else None,
                                layer_scale=self.layer_scale, prunable=(lo, hi),
                                # lazy low section: open a low page only once a page's worth of tokens would go
                                # there (a short request then holds no more pages than its high precision alone)
                                min_low=mm.fmt_low.tokens, low_armed=mm.low_armed)

    @costed("memory")
    def decode_pages(self, slots: torch.Tensor, seq_len: torch.Tensor, plan: Optional[dict],
                     timed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's pages and token moves, lengths and the new tokens' write targets: the memory management of
        a decode step (two launches on the GPU, diffkv_serve/kernels/decode_pages.py), timed for stats unless in a graph."""
        mm = self.mm
        if timed:
            self._mm_begin()
        out = decode_pages(mm.page_state, mm.fmt_high, mm.fmt_low if self.diffkv else None, mm.cache_dtype, slots,
                           seq_len, plan, low_grows=mm.low_grows)
        if timed:
            self._mm_end()
        return out

    @costed("attention")  # the new K/V write and the paged attention; the score update marked inside
    def decode_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      dst_page: torch.Tensor, dst_row: torch.Tensor, slots: torch.Tensor, scale: float,
                      max_len: int) -> torch.Tensor:
        mm = self.mm
        new_tokens = KVWrite(mm.pool, mm.fmt_high, mm.cache_dtype, k, v, dst_page[layer], dst_row[layer], positions)
        if not self.diffkv:
            write_kv(*new_tokens)
            return paged_decode_attention(q, mm.pool, mm.fmt_high, mm.cache_dtype, mm.page_table, mm.len_high,
                                          slots, layer, scale, max_len=max_len)
        if self._pending_scores is None:
            write_kv(*new_tokens)
        else:  # the layer before's score update writes this layer's new tokens: one launch for both
            self._flush_scores(write=new_tokens)
        B, Hq = q.shape[0], q.shape[1]
        logits = torch.empty(B, Hq, max_len, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
        out = paged_decode_attention(q, mm.pool, mm.fmt_high, mm.cache_dtype, mm.page_table, mm.len_high, slots,
                                     layer, scale, max_len=max_len, fmt_low=mm.fmt_low, len_low=mm.len_low,
                                     logits_out=logits, lse_out=lse, alpha_low_by_slot=self.slot_alphas[1])
        # Nothing reads this layer's scores before the next step's plan, so the update waits for the next layer's
        # write (a launch of ~3 us for one token a sequence, like the update itself); the last layer's runs now.
        self._pending_scores = (layer, slots, logits, lse)
        if layer == mm.shape.num_layers - 1:
            self._flush_scores()
        return out

    def _flush_scores(self, write: Optional[KVWrite] = None) -> None:
        """The pending score update of a decode layer (and `write`, another layer's new tokens, in its launch)."""
        layer, slots, logits, lse = self._pending_scores
        self._pending_scores = None
        mm = self.mm
        # Untracked low pages have no score rows: their tokens are never pruned, so their scores are never read.
        low = dict(fmt_low=mm.fmt_low, len_low=mm.len_low) if mm.fmt_low.tracked else {}
        with cost_range("policy"):
            accumulate_scores(mm.pool, mm.fmt_high, mm.page_table, mm.len_high, slots, layer, logits, lse,
                              alpha_low_by_slot=self.slot_alphas[1], high_only=self.config.alpha_low == 0,
                              write=write, **low)

    # ---- memory-management timing (no host sync on the hot path) -------------------------------------
    def _mm_begin(self) -> None:
        if self.mm.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._mm_events = (start, end)
        else:
            import time

            self._mm_t0 = time.perf_counter()

    def _mm_end(self) -> None:
        if self._mm_events is not None:
            self._mm_events[1].record()
        else:
            import time

            self.last_mm_seconds = time.perf_counter() - self._mm_t0

    def set_mm_events(self, start, end) -> None:
        """A CUDA graph replay timed the memory management with these events."""
        self._mm_events = (start, end)

    def mm_seconds(self) -> float:
        """Memory-management time of the last decode step (device time on CUDA)."""
        if self._mm_events is not None:
            start, end = self._mm_events
            end.synchronize()
            self.last_mm_seconds = start.elapsed_time(end) / 1e3
        return self.last_mm_seconds

    # ---- stats -----------------------------------------------------------------------------------------
    def token_classes(self, slot: int, num_tokens: int) -> torch.Tensor:
        """int8 [L, H, num_tokens] on the device: where each token position of a sequence lives per (layer,
        KV head): KEPT_HIGH, KEPT_LOW or PRUNED (read from the positions its section rows store; a debug and
        evaluation aid, CacheConfig.record_pruning). One precision: every cached token is high."""
        mm = self.mm
        L, H = mm.len_high.shape[1:]
        out = torch.full((L, H, num_tokens), PRUNED, dtype=torch.int8, device=mm.device)
        pt = mm.page_table[slot]  # [L, H, P + 1]
        pos_words = mm.pool.view(torch.int32)
        sections = [(mm.fmt_high, mm.len_high[slot], False, KEPT_HIGH)]
        if mm.fmt_low is not None and mm.fmt_low.tracked:
            sections.append((mm.fmt_low, mm.len_low[slot], True, KEPT_LOW))
        elif mm.fmt_low is not None:
            # Untracked low rows have no positions, but nothing is pruned in such a cache (alpha_low 0): every
            # cached token not in the high section is low.
            out.fill_(KEPT_LOW)
        head = torch.arange(L * H, device=mm.device).view(L, H, 1)
        for fmt, lens, low, cls in sections:
            n = int(lens.max()) if lens.numel() else 0
            if n == 0:
                continue
            j = torch.arange(n, device=mm.device)
            pages = pt[:, :, section_columns(j, fmt.tokens, low, pt.shape[-1])].long()  # [L, H, n]
            valid = j < lens[..., None]  # rows past a length hold stale positions
            if not fmt.tracked:  # one precision keeps tokens in order: row j is position j
                pos = j.expand_as(valid)
            else:
                pos = pos_words[pages.clamp_min(0), fmt.pos_off // 4 + (j % fmt.tokens)].long()
            valid &= (pos >= 0) & (pos < num_tokens)
            out.view(-1)[(head * num_tokens + pos)[valid]] = cls
        return out

    def token_counts(self, slots: list[int], cached: int) -> dict[str, int]:
        """Tokens kept high / low and pruned over these sequences (cached = their summed lengths), and the pages
        they own (prefix-cache pages they read are the cache's)."""
        if not slots:
            return {"tokens_high": 0, "tokens_low": 0, "tokens_pruned": 0, "pages_held": 0}
        mm = self.mm
        s = torch.tensor(slots, device=mm.device)
        hi, lo, pages = torch.stack([mm.len_high[s].sum(), mm.len_low[s].sum(),
                                     (mm.held_high[s] + mm.held_low[s]).sum()]).tolist()
        pages -= sum(mm.shared_cols[x] for x in slots) * mm.heads_per_seq
        return {"tokens_high": hi, "tokens_low": lo, "tokens_pruned": cached * mm.heads_per_seq - hi - lo,
                "pages_held": pages}


def _prunable(settings: KVRequestSettings, prompt_len: int) -> tuple[int, int]:
    """The positions [lo, hi) a sequence's decode steps may prune (prune_phase): every one, the prompt's, or the
    generated tokens' (BIG: above any position)."""
    if settings.prune_phase == "prompt":
        return 0, prompt_len
    if settings.prune_phase == "generation":
        return prompt_len, BIG
    return 0, BIG
