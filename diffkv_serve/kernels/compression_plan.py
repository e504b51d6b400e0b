"""Generation-phase compression decision (DiffKV §4, Algorithm 1), one per (sequence, layer, KV head).

Each step the oldest token of the recent window, t_c at position c = N - 1 - window, leaves the window.
With mean significance s(t) = score(t) / count(t) and thresholds th_h = alpha_high / N, th_l = alpha_low / N:

  s(t_c) >= th_h: t_c stays high; victim v = argmin s over high tokens older than the window (t_c included)
                  th_l <= s(v) < th_h -> v demoted to low (action 2); s(v) < th_l -> v pruned (3); else 1
  s(t_c) >= th_l: t_c moves to low; victim v = argmin s over low tokens + t_c (t_c last, so ties keep the
                  existing token); s(v) < th_l -> v pruned and t_c takes its row (5), or t_c itself is
                  dropped if it were v (6: unreachable, s(t_c) >= th_l; kept for the spec); else appended (4)
  otherwise:      t_c pruned (7)

No-op (0) when c < 0, when c < prompt_len - window (prefill already classified that token) or when no high
token has position c. Only the plan is produced here; moving rows and pages is the caller's job.

Prunable positions (optional `prunable` = (lo, hi), int32 [B] each; CacheConfig.prune_phase): only tokens at
positions lo <= p < hi may be pruned; the others compare against th_l = 0, which no significance is below, so
where Algorithm 1 would prune them they stay (a high victim is demoted instead, t_c goes to low). The low
section's victim is the least significant prunable low token (its only use is being pruned). With every
position prunable the decisions are Algorithm 1's.

Pinned tokens (a prompt's prefix-cache blocks, diffkv_serve/kernels/prompt_classify.py pin_significance) are
stored with score +inf: their mean is inf, so none is ever a victim (nothing finite is above it, and a head
whose older high tokens are all pinned has none: jv = BIG), a pinned t_c stays high (action 1 or a victim
among the unpinned), and the lazy low section never counts them. They are the first rows of the high
section, and holes only open at victims, so no move or compaction ever writes their pages (shared pages).

Untracked low pages (fmt_low.tracked False, CacheConfig.track_low): the low section has no score or position
rows, so it is never scanned for a victim. Such caches decode at alpha_low 0, where no low token is ever below
th_l = 0, so the decisions are Algorithm 1's.

Per-layer budgets (optional `layer_scale`, f32 [L]): layer l compares against alpha * layer_scale[l] / N
(the product rounded to f32 first, then divided), so each layer keeps its own share of tokens.

Budget policy (baseline, H2O/SnapKV-style static sparsity; `budget` given): every head keeps at most
B(N) = max(ceil(budget * N), window) tokens, all in the high section, whatever their significance. Each step
with c >= 0, once the new token would make the head hold more than B(N), the least significant token older
than the window (t_c included) is pruned (3); otherwise nothing moves (1). Thresholds are not used.

Lazy low section (`min_low` > 0): a head whose low section is empty sends nothing to it (an outcome that would
demote the victim or append t_c keeps the token high instead: action 1) until at least min_low of its high tokens
older than the window are below th_h. The engine passes a low page's token count: a low page opened for a few
tokens costs a whole page, while keeping up to that many tokens high costs at most one high page, so a short
request never holds more pages than a uniform cache of the high precision would.
With `low_armed` (int32 [S, L, H], by slot: the previous step's new_low_armed) the count must also have reached
min_low at the head's previous step: the step before already knows which empty low sections may open a page
next, so the memory manager's growth bound counts only those (MemoryManager.decode_growth), not every empty one.

Outputs, int32 [B, L, H] (-1 = none): high_hole (high index that empties), to_low_src (high index whose
token is requantized into low), low_dst (low index it goes to), action, new_len_high, new_len_low (the new
decode token is not counted), new_low_armed (1 where the lazy count reached min_low this step: the head's
low_armed for its next step). Ties in an argmin go to the smallest index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffkv_serve.kernels._common import next_pow2, num_sms, use_triton
from diffkv_serve.kernels.page_layout import PageFormat
from diffkv_serve.kernels.prompt_significance import significance_count

FIELDS = ("high_hole", "to_low_src", "low_dst", "action", "new_len_high", "new_len_low", "new_low_armed")
NONE, C_HIGH_V_STAYS, C_HIGH_V_DEMOTED, C_HIGH_V_PRUNED, C_LOW_APPENDED, C_LOW_REPLACES, C_LOW_PRUNED, \
    C_PRUNED = range(8)
BIG = 2**30  # "no index" (above any section length)
# A program is a chain of dependent loads (page id, then score and position) per tile, so what sets the time is
# how many programs wait at once. Past this many programs per SM they take one warp and 128-token tiles: on an
# H100 at Qwen2.5-1.5B's 28 x 2 heads (K8V4 / K4V4, a_h 64, 1,024 tokens) batch 256 (14,336 programs) planned in
# 15.9 us instead of 43.4 with 4 warps and 256-token tiles (26.3 with one warp and 256), batch 128 in 9.5 instead
# of 22.4. Fewer programs keep 4 warps and up to 256-token tiles: a long section then takes fewer tiles.
MANY_PROGRAMS_PER_SM = 16
_BIG: tl.constexpr = tl.constexpr(BIG)


@triton.jit
def _mean(score, pos, n0, N, num_queries):
    # Same formula as significance_count; div_rn keeps GPU division bit-equal to torch's.
    cnt = tl.where(pos < n0, tl.minimum(n0 - pos, num_queries) + (N - n0), N - pos)
    return tl.div_rn(score, tl.maximum(cnt, 1).to(tl.float32))


@triton.jit
def _plan_kernel(
    pool_f, pool_i, pt_ptr, lh_ptr, ll_ptr, armed_ptr, slots_ptr, n0_ptr, seq_ptr, ah_ptr, al_ptr, ls_ptr, plo_ptr,
    phi_ptr, out_ptr,
    stride_pts, stride_ptl, stride_pth, stride_hs, stride_hl, stride_hh, stride_ls, stride_ll, stride_lh,
    stride_as, stride_al, stride_ah,
    B, L, H, P, window, num_queries, page_words,
    hi_score, hi_pos, lo_score, lo_pos,  # segment offsets in 4-byte words
    budget,  # budget policy: fraction of tokens a head keeps
    min_low,  # lazy low section: low-class high tokens a head needs before its first low token
    T_HI: tl.constexpr, T_LO: tl.constexpr, BLOCK: tl.constexpr, BUDGET: tl.constexpr, SCALED: tl.constexpr,
    RANGED: tl.constexpr, ARMED: tl.constexpr, LO_TRACKED: tl.constexpr,
):
    b, l, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n0 = tl.load(n0_ptr + b)
    N = tl.load(seq_ptr + b)
    lh = tl.load(lh_ptr + slot * stride_hs + l * stride_hl + h * stride_hh)
    ll = tl.load(ll_ptr + slot * stride_ls + l * stride_ll + h * stride_lh)
    ah = tl.load(ah_ptr + b)
    al = tl.load(al_ptr + b)
    if SCALED:  # per-layer budgets: this layer's multiple of the sequence's alphas
        s = tl.load(ls_ptr + l)
        ah = ah * s
        al = al * s
    th_h = tl.div_rn(ah, N.to(tl.float32))
    th_l = tl.div_rn(al, N.to(tl.float32))
    if RANGED:  # prunable positions [p_lo, p_hi)
        p_lo = tl.load(plo_ptr + b)
        p_hi = tl.load(phi_ptr + b)
    else:
        p_lo = 0
        p_hi = _BIG
    pt_row = pt_ptr + slot * stride_pts + l * stride_ptl + h * stride_pth
    c = N - 1 - window
    if BUDGET:
        hi_end = tl.where(c >= 0, lh, 0)
    else:
        hi_end = tl.where((c >= 0) & (c >= n0 - window), lh, 0)  # inactive heads scan nothing

    # High section: find t_c by position and the least significant token older than the window.
    # t_c's mean and the victim's position are kept as the scan finds them: reading them again after the loop
    # was two more rounds of dependent loads (page id, then row) in a kernel that is a chain of such rounds.
    jc = tl.full([], _BIG, tl.int32)
    mean_c = tl.full([], float("inf"), tl.float32)
    jv = tl.full([], _BIG, tl.int32)
    vpos = tl.full([], -1, tl.int32)
    vmin = tl.full([], float("inf"), tl.float32)
    n_below = tl.zeros([], tl.int32)  # high tokens older than the window below th_h (the lazy low section's count)
    for j0 in range(0, hi_end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < hi_end
        base = tl.load(pt_row + j // T_HI, mask=m, other=0).to(tl.int64) * page_words + j % T_HI
        pos = tl.load(pool_i + base + hi_pos, mask=m, other=-1)
        mean = _mean(tl.load(pool_f + base + hi_score, mask=m, other=0.0), pos, n0, N, num_queries)
        is_c = m & (pos == c)  # positions are distinct within a head: at most one token
        jc = tl.minimum(jc, tl.min(tl.where(is_c, j, _BIG), 0))
        mean_c = tl.minimum(mean_c, tl.min(tl.where(is_c, mean, float("inf")), 0))
        vals = tl.where(m & (pos < N - window), mean, float("inf"))
        n_below += tl.sum((vals < th_h).to(tl.int32), 0)
        bmin = tl.min(vals, 0)
        bidx = tl.min(tl.where(vals == bmin, j, _BIG), 0)
        bpos = tl.max(tl.where(j == bidx, pos, -1), 0)
        vpos = tl.where(bmin < vmin, bpos, vpos)  # strict: earlier blocks win ties
        jv = tl.where(bmin < vmin, bidx, jv)
        vmin = tl.minimum(vmin, bmin)

    found = jc < _BIG
    mean_c = tl.where(found, mean_c, 0.0)
    go_high = found & (mean_c >= th_h)
    th_lc = tl.where((c >= p_lo) & (c < p_hi), th_l, 0.0)
    go_low = found & (mean_c < th_h) & (mean_c >= th_lc)
    th_lv = tl.where((vpos >= p_lo) & (vpos < p_hi), th_l, 0.0)

    # Low section: only scanned when t_c joins it and a low victim could be pruned (th_l > 0; at th_l = 0 none
    # is below it, so t_c is appended whatever the scan finds, and score_update leaves such low scores as they are).
    lo_end = tl.where(go_low & (th_l > 0), ll, 0)
    if not LO_TRACKED:  # no score rows to scan: such caches decode at alpha_low 0, where no low token is a victim
        lo_end = tl.zeros_like(ll)
    jl = tl.full([], _BIG, tl.int32)
    lmin = tl.full([], float("inf"), tl.float32)
    for j0 in range(0, lo_end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < lo_end
        base = tl.load(pt_row + (P - 1 - j // T_LO), mask=m, other=0).to(tl.int64) * page_words + j % T_LO
        pos = tl.load(pool_i + base + lo_pos, mask=m, other=0)
        mean = _mean(tl.load(pool_f + base + lo_score, mask=m, other=0.0), pos, n0, N, num_queries)
        vals = tl.where(m & (pos >= p_lo) & (pos < p_hi), mean, float("inf"))
        bmin = tl.min(vals, 0)
        bidx = tl.min(tl.where(vals == bmin, j, _BIG), 0)
        jl = tl.where(bmin < lmin, bidx, jl)
        lmin = tl.minimum(lmin, bmin)

    v_is_c = mean_c < lmin  # t_c sits after the low tokens: it is the victim only if strictly smaller
    low_prune = tl.where(v_is_c, mean_c < th_lc, lmin < th_l)  # a prunable low victim: its threshold is th_l
    act_high = tl.where(vmin < th_lv, 3, tl.where(vmin < th_h, 2, 1))
    act_low = tl.where(low_prune, tl.where(v_is_c, 6, 5), 4)
    action = tl.where(go_high, act_high, tl.where(go_low, act_low, tl.where(found, 7, 0)))
    ready = n_below >= min_low
    if ARMED:  # the previous step's count must have reached min_low too (its growth bound counted this head)
        ready = ready & (tl.load(armed_ptr + slot * stride_as + l * stride_al + h * stride_ah) != 0)
    lazy = (ll == 0) & (ready == 0)
    action = tl.where(lazy & ((action == 2) | (action == 4)), 1, action)
    if BUDGET:
        keep = tl.maximum(tl.ceil(budget * N.to(tl.float32)), window + 0.0)
        over = (jv < _BIG) & ((lh + 1).to(tl.float32) > keep)
        action = tl.where(c >= 0, tl.where(over, 3, 1), 0)

    high_hole = tl.where((action == 2) | (action == 3), jv, tl.where(action >= 4, jc, -1))
    to_low = tl.where(action == 2, jv, tl.where((action == 4) | (action == 5), jc, -1))
    low_dst = tl.where((action == 2) | (action == 4), ll, tl.where(action == 5, jl, -1))
    new_lh = lh - (high_hole >= 0).to(tl.int32)
    new_ll = ll + (low_dst == ll).to(tl.int32)

    o = out_ptr + (b * L + l) * H + h
    plane = B * L * H
    tl.store(o, high_hole)
    tl.store(o + plane, to_low)
    tl.store(o + 2 * plane, low_dst)
    tl.store(o + 3 * plane, action)
    tl.store(o + 4 * plane, new_lh)
    tl.store(o + 5 * plane, new_ll)
    tl.store(o + 6 * plane, (n_below >= min_low).to(tl.int32))


def _section(pool, fmt: PageFormat, cols: torch.Tensor, j: torch.Tensor):
    """Gather (score, position) [B, L, H, J] of section rows j living in page-table columns `cols`."""
    if not fmt.tracked:  # untracked low pages: nothing to gather (the caller scans no row of them)
        assert j.numel() == 0
        empty = cols.new_empty(cols.shape)
        return empty.float(), empty.int()
    pages = cols.long().clamp(0, pool.shape[0] - 1)  # entries past a length are garbage: masked later
    row = (j % fmt.tokens).expand_as(pages)
    pf, pi = pool.view(torch.float32), pool.view(torch.int32)
    return pf[pages, fmt.score_off // 4 + row], pi[pages, fmt.pos_off // 4 + row]


def _argmin(vals: torch.Tensor):
    """(min, first index of the min) over the last dim; (inf, BIG) for an empty or all-inf row."""
    if vals.shape[-1] == 0:
        inf = vals.new_full(vals.shape[:-1], float("inf"))
        return inf, torch.full(vals.shape[:-1], BIG, dtype=torch.long, device=vals.device)
    vmin, idx = vals.min(-1)
    return vmin, torch.where(torch.isinf(vmin), BIG, idx)


def compression_plan_ref(pool, fmt_high, fmt_low, page_table, len_high, len_low, slots, prompt_len, seq_len,
                         alpha_high, alpha_low, window, num_queries=64, budget=None, layer_scale=None,
                         prunable=None, min_low=0, low_armed=None):
    """Vectorized torch: gather both sections -> [B, L, H, maxlen], then the same decision table."""
    sl = slots.long()
    P = page_table.shape[-1] - 1  # last column is the trash cell
    pt = page_table[sl]
    lh, ll = len_high[sl].long(), len_low[sl].long()
    n0 = prompt_len.long().view(-1, 1, 1, 1)
    N = seq_len.long().view(-1, 1, 1, 1)
    ah, al = alpha_high.float().view(-1, 1), alpha_low.float().view(-1, 1)
    if layer_scale is not None:
        ah, al = ah * layer_scale.float().view(1, -1), al * layer_scale.float().view(1, -1)
    th_h = (ah / seq_len.float().view(-1, 1)).unsqueeze(-1)  # [B, 1 or L, 1]
    th_l = (al / seq_len.float().view(-1, 1)).unsqueeze(-1)
    c = N - 1 - window
    if prunable is None:
        p_lo, p_hi = torch.zeros_like(N), torch.full_like(N, BIG)
    else:
        p_lo, p_hi = (x.long().view(-1, 1, 1, 1) for x in prunable)

    def th_l_at(pos):  # pos [B, L, H] or [B, 1, 1]: th_l where prunable, else 0 (nothing is below it)
        ok = (pos >= p_lo[..., 0]) & (pos < p_hi[..., 0])
        return torch.where(ok, th_l, torch.zeros_like(th_l))

    active = ((c >= 0) & (c >= n0 - window if budget is None else c >= 0)).view(-1, 1, 1)
    dev = page_table.device

    def mean(score, pos):
        return score / significance_count(pos.long(), n0, N, num_queries).float()

    j = torch.arange(int(lh.max()) if lh.numel() else 0, device=dev)
    score, pos = _section(pool, fmt_high, pt[..., j // fmt_high.tokens], j)
    valid = (j < lh[..., None]) & active[..., None]
    m_hi = mean(score, pos)
    jc = torch.where(valid & (pos == c), j, BIG).amin(-1) if j.numel() else torch.full_like(lh, BIG)
    older = torch.where(valid & (pos < N - window), m_hi, float("inf"))
    vmin, jv = _argmin(older)
    n_below = (older < th_h[..., None]).sum(-1)
    found = jc < BIG
    mean_c = torch.gather(m_hi, -1, jc.clamp(max=max(j.numel() - 1, 0))[..., None])[..., 0] if j.numel() \
        else torch.zeros(lh.shape, device=dev)
    go_high = found & (mean_c >= th_h)
    th_lc = th_l_at(c[..., 0])
    go_low = found & (mean_c < th_h) & (mean_c >= th_lc)
    pos_v = torch.gather(pos, -1, jv.clamp(max=max(j.numel() - 1, 0))[..., None])[..., 0] if j.numel() \
        else torch.full_like(lh, -1)
    th_lv = th_l_at(torch.where(jv < BIG, pos_v, -1))

    # untracked low pages: no low token is ever a victim (their caches decode at alpha_low 0, where none is)
    j = torch.arange(int(ll.max()) if ll.numel() and fmt_low.tracked else 0, device=dev)
    score, pos = _section(pool, fmt_low, pt[..., P - 1 - j // fmt_low.tokens], j)
    lo_ok = (j < ll[..., None]) & (pos >= p_lo) & (pos < p_hi)
    lmin, jl = _argmin(torch.where(lo_ok, mean(score, pos), float("inf")))

    def w(cond, a, b):
        return torch.where(cond, torch.as_tensor(a, device=dev), torch.as_tensor(b, device=dev))

    act_high = w(vmin < th_lv, 3, w(vmin < th_h, 2, 1))
    v_is_c = mean_c < lmin
    act_low = w(torch.where(v_is_c, mean_c < th_lc, lmin < th_l), w(v_is_c, 6, 5), 4)
    action = w(go_high, act_high, w(go_low, act_low, w(found, 7, 0)))
    ready = n_below >= min_low
    if low_armed is not None:  # the previous step's count must have reached min_low too
        ready &= low_armed[sl] != 0
    lazy = (ll == 0) & ~ready
    action = w(lazy & ((action == 2) | (action == 4)), 1, action)
    if budget is not None:
        keep = torch.clamp_min(torch.ceil(torch.tensor(budget, dtype=torch.float32) * seq_len.float()), float(window))
        over = (jv < BIG) & ((lh + 1).float() > keep.view(-1, 1, 1))
        action = w(active, w(over, 3, 1), 0)
    high_hole = w((action == 2) | (action == 3), jv, w(action >= 4, jc, -1))
    to_low = w(action == 2, jv, w((action == 4) | (action == 5), jc, -1))
    low_dst = w((action == 2) | (action == 4), ll, w(action == 5, jl, -1))
    res = dict(high_hole=high_hole, to_low_src=to_low, low_dst=low_dst, action=action,
               new_len_high=lh - (high_hole >= 0).long(), new_len_low=ll + (low_dst == ll).long(),
               new_low_armed=n_below >= min_low)
    return {k: v.to(torch.int32) for k, v in res.items()}


def compression_plan_triton(pool, fmt_high, fmt_low, page_table, len_high, len_low, slots, prompt_len, seq_len,
                            alpha_high, alpha_low, window, num_queries=64, block=None, budget=None,
                            layer_scale=None, prunable=None, min_low=0, low_armed=None):
    assert pool.dtype == torch.uint8 and pool.is_contiguous() and fmt_high.page_bytes == fmt_low.page_bytes
    assert page_table.stride(3) == 1
    B = slots.numel()
    _, L, H, P1 = page_table.shape
    out = torch.empty(len(FIELDS), B, L, H, dtype=torch.int32, device=pool.device)
    if B and L and H:
        many = B * L * H >= MANY_PROGRAMS_PER_SM * num_sms(pool.device)
        block = block or max(16, min(128 if many else 256, next_pow2(P1 * max(fmt_high.tokens, fmt_low.tokens))))
        _plan_kernel[(B, L, H)](
            pool.view(torch.float32), pool.view(torch.int32), page_table, len_high, len_low,
            low_armed if low_armed is not None else len_low, slots, prompt_len, seq_len,
            alpha_high.float().contiguous(), alpha_low.float().contiguous(),
            layer_scale.float().contiguous() if layer_scale is not None else out,
            *((prunable[0].int().contiguous(), prunable[1].int().contiguous()) if prunable is not None
              else (out, out)), out,
            *page_table.stride()[:3], *len_high.stride(), *len_low.stride(),
            *(low_armed if low_armed is not None else len_low).stride(),
            B, L, H, P1 - 1, window, num_queries, fmt_high.page_bytes // 4,
            *fmt_high.tracked_words(), *fmt_low.tracked_words(), float(budget or 0.0), int(min_low),
            T_HI=fmt_high.tokens, T_LO=fmt_low.tokens, BLOCK=block, BUDGET=budget is not None,
            SCALED=layer_scale is not None, RANGED=prunable is not None, ARMED=low_armed is not None,
            LO_TRACKED=fmt_low.tracked,
            num_warps=1 if many else 4,
        )
    return dict(zip(FIELDS, out.unbind(0)))


def compression_plan(pool, fmt_high: PageFormat, fmt_low: PageFormat, page_table, len_high, len_low, slots,
                     prompt_len, seq_len, alpha_high, alpha_low, window: int, num_queries: int = 64,
                     impl: str = "auto", budget: float | None = None, layer_scale: torch.Tensor | None = None,
                     prunable: tuple[torch.Tensor, torch.Tensor] | None = None,
                     min_low: int = 0, low_armed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Algorithm 1 for every (batch entry, layer, KV head); see the module docstring for the outputs.

    pool uint8 [num_pages, page_bytes]; page_table int32 [S, L, H, P+1] (high section from column 0 up,
    low section from column P-1 down, column P trash); len_high/len_low int32 [S, L, H]; slots, prompt_len,
    seq_len (N: tokens whose queries were processed) int32 [B]; alpha_high/alpha_low f32 [B].
    Scores in the pages are significance SUMS; they are compared as sum / significance_count.
    budget: None for DiffKV's thresholds; a fraction in (0, 1] for the equal-budget pruning baseline.
    layer_scale: None, or f32 [L] per-layer multipliers of both alphas (per-layer budgets).
    prunable: None (every position), or (lo, hi) int32 [B]: only positions lo <= p < hi may be pruned.
    min_low: the lazy low section's count (0: Algorithm 1 as written).
    low_armed: None, or int32 [S, L, H] like len_low: the previous step's new_low_armed (see the module docstring).
    """
    if layer_scale is not None and layer_scale.shape != (page_table.shape[1],):
        raise ValueError(f"layer_scale has shape {tuple(layer_scale.shape)}; expected ({page_table.shape[1]},), "
                         "one multiplier per layer")
    if low_armed is not None and (low_armed.shape != len_low.shape or low_armed.dtype != torch.int32):
        raise ValueError(f"low_armed is {low_armed.dtype} {tuple(low_armed.shape)}; expected torch.int32 "
                         f"{tuple(len_low.shape)}, like len_low")
    if use_triton(impl, pool, page_table, len_high, len_low, slots):
        return compression_plan_triton(pool, fmt_high, fmt_low, page_table, len_high, len_low, slots,
                                       prompt_len, seq_len, alpha_high, alpha_low, window, num_queries,
                                       budget=budget, layer_scale=layer_scale, prunable=prunable, min_low=min_low,
                                       low_armed=low_armed)
    return compression_plan_ref(pool, fmt_high, fmt_low, page_table, len_high, len_low, slots, prompt_len,
                                seq_len, alpha_high, alpha_low, window, num_queries, budget=budget,
                                layer_scale=layer_scale, prunable=prunable, min_low=min_low, low_armed=low_armed)
