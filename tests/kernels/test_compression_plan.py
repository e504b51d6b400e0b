import os
import random

import pytest
import torch

from diffkv_serve.kernels import compression_plan as compression_plan_module
from diffkv_serve.kernels.compression_plan import FIELDS, compression_plan, compression_plan_triton
from diffkv_serve.kernels.page_layout import PageFormat, page_bytes_for

# The interpreter reads scalar loads used as loop bounds through a deprecated numpy conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

DEVICE = os.environ.get("DIFFKV_TEST_DEVICE", "cpu")
# Decisions are integers computed from the same fp32 arithmetic (IEEE division on both paths): exact.
TOL = {"plan": 0}
PAGE_BYTES = page_bytes_for(4, 16, 2)
FMT_HI = PageFormat.make(8, 4, 16, PAGE_BYTES, 2)  # 6 tokens per page
FMT_LO = PageFormat.make(4, 2, 16, PAGE_BYTES, 2)  # 8 tokens per page: the sections page differently
WINDOW = 4


def _count(p, n0, N, Q):
    return max(1, min(n0 - p, Q) + (N - n0) if p < n0 else N - p)


def _build(heads, S, L, H, P, seed=0):
    """Pool + bidirectional page table from {(slot, layer, head): (high, low)}, each a list of (pos, score).

    Everything not in a section is garbage: NaN scores, small random positions (often equal to a
    candidate position) and stale or -1 page-table entries, so any read past a length shows up.
    """
    g = torch.Generator().manual_seed(seed)
    need = {key: (-(-len(hi) // FMT_HI.tokens), -(-len(lo) // FMT_LO.tokens)) for key, (hi, lo) in heads.items()}
    num_pages = sum(a + b for a, b in need.values()) + 5
    pool = torch.empty(num_pages, PAGE_BYTES, dtype=torch.uint8)
    pf, pi = pool.view(torch.float32), pool.view(torch.int32)
    pf.fill_(float("nan"))
    for fmt in (FMT_HI, FMT_LO):
        o = fmt.pos_off // 4
        pi[:, o:o + fmt.tokens] = torch.randint(0, 40, (num_pages, fmt.tokens), generator=g, dtype=torch.int32)
    pt = torch.randint(-1, num_pages, (S, L, H, P + 1), generator=g, dtype=torch.int32)
    len_hi = torch.randint(0, 9, (S, L, H), generator=g, dtype=torch.int32)  # garbage for unused slots
    len_lo = torch.randint(0, 9, (S, L, H), generator=g, dtype=torch.int32)
    ids = iter(torch.randperm(num_pages, generator=g).tolist())
    for (s, l, h), (hi, lo) in heads.items():
        assert need[(s, l, h)][0] + need[(s, l, h)][1] <= P
        len_hi[s, l, h], len_lo[s, l, h] = len(hi), len(lo)
        for fmt, toks, col in ((FMT_HI, hi, lambda j: j // FMT_HI.tokens),
                               (FMT_LO, lo, lambda j: P - 1 - j // FMT_LO.tokens)):
            for j, (p, sc) in enumerate(toks):
                if j % fmt.tokens == 0:
                    pt[s, l, h, col(j)] = next(ids)
                page, r = int(pt[s, l, h, col(j)]), j % fmt.tokens
                pf[page, fmt.score_off // 4 + r] = sc
                pi[page, fmt.pos_off // 4 + r] = p
    return pool, pt, len_hi, len_lo


def _naive(hi, lo, n0, N, ah, al, window, Q, prunable=(0, 2**30)):
    """Algorithm 1 straight from the paper, one head, fp32 scalars like the kernels. prunable = (lo, hi): a
    token at another position is never pruned (its th_l is 0) and is no low victim."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    mean = [f32(sc) / f32(_count(p, n0, N, Q)) for p, sc in hi]
    th_h, th_l0 = f32(ah) / f32(N), f32(al) / f32(N)

    def th_l_of(p):
        return th_l0 if prunable[0] <= p < prunable[1] else f32(0.0)

    lmean = [f32(sc) / f32(_count(p, n0, N, Q)) if prunable[0] <= p < prunable[1] else f32(float("inf"))
             for p, sc in lo]
    res = dict(high_hole=-1, to_low_src=-1, low_dst=-1, action=0, new_len_high=len(hi), new_len_low=len(lo),
               new_low_armed=1)  # without a lazy count (min_low 0) every head is armed
    c = N - 1 - window
    jc = next((j for j, (p, _) in enumerate(hi) if p == c), None)
    if c < 0 or c < n0 - window or jc is None:
        return res
    th_l = th_l_of(c)
    if mean[jc] >= th_h:
        old = [j for j, (p, _) in enumerate(hi) if p < N - window]
        jv = min(old, key=lambda j: (float(mean[j]), j))
        th_l = th_l_of(hi[jv][0])
        if th_l <= mean[jv] < th_h:
            res.update(action=2, high_hole=jv, to_low_src=jv, low_dst=len(lo), new_len_low=len(lo) + 1)
        elif mean[jv] < th_l:
            res.update(action=3, high_hole=jv)
        else:
            res.update(action=1)
    elif mean[jc] >= th_l:
        res.update(high_hole=jc, to_low_src=jc)
        cand = lmean + [mean[jc]]  # t_c joins low last
        jv = min(range(len(cand)), key=lambda j: (float(cand[j]), j))
        th_l = th_l if jv == len(lo) else th_l_of(lo[jv][0])
        if cand[jv] < th_l and jv == len(lo):
            res.update(action=6, to_low_src=-1)
        elif cand[jv] < th_l:
            res.update(action=5, low_dst=jv)
        else:
            res.update(action=4, low_dst=len(lo), new_len_low=len(lo) + 1)
    else:
        res.update(action=7, high_hole=jc)
    if res["high_hole"] >= 0:
        res["new_len_high"] -= 1
    return res


def _naive_lazy(hi, lo, n0, N, ah, al, window, Q, min_low, armed=None):
    """The lazy low section on top of _naive: while the low section is empty and fewer than min_low old high
    tokens are below th_h (or, with `armed` given, the previous step's count had not reached min_low: armed 0),
    nothing goes to it (a demotion or an append keeps the token high: action 1). new_low_armed: this step's count
    reached min_low (a head with nothing to decide, c < 0 or c < n0 - window, counts none)."""
    res = _naive(hi, lo, n0, N, ah, al, window, Q)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    th_h = f32(ah) / f32(N)
    c = N - 1 - window
    below = sum(1 for p, sc in hi if p < N - window and f32(sc) / f32(_count(p, n0, N, Q)) < th_h) \
        if c >= 0 and c >= n0 - window else 0
    ready = below >= min_low and armed in (None, 1)
    if not lo and not ready and res["action"] in (2, 4):
        res.update(high_hole=-1, to_low_src=-1, low_dst=-1, action=1, new_len_high=len(hi), new_len_low=0)
    res["new_low_armed"] = int(below >= min_low)
    return res


def _run_both(pool, pt, len_hi, len_lo, slots, n0, N, ah, al, window=WINDOW, Q=64, block=None, layer_scale=None,
              prunable=None, min_low=0, low_armed=None, fmt_lo=FMT_LO):
    """Runs ref and Triton, asserts they agree exactly, returns the plan (cpu). prunable: ([lo], [hi]) or None."""
    i32, f32 = torch.int32, torch.float32
    args = [t.to(DEVICE) for t in (pool, pt, len_hi, len_lo)] + [
        torch.tensor(x, dtype=dt, device=DEVICE) for x, dt in ((slots, i32), (n0, i32), (N, i32), (ah, f32), (al, f32))]
    ls = None if layer_scale is None else torch.tensor(layer_scale, dtype=f32, device=DEVICE)
    pr = None if prunable is None else tuple(torch.tensor(x, dtype=i32, device=DEVICE) for x in prunable)
    armed = None if low_armed is None else low_armed.to(DEVICE)
    ref = compression_plan(args[0], FMT_HI, fmt_lo, *args[1:], window=window, num_queries=Q, impl="ref",
                           layer_scale=ls, prunable=pr, min_low=min_low, low_armed=armed)
    tri = compression_plan_triton(args[0], FMT_HI, fmt_lo, *args[1:], window=window, num_queries=Q, block=block,
                                  layer_scale=ls, prunable=pr, min_low=min_low, low_armed=armed)
    for f in FIELDS:
        assert ref[f].dtype == torch.int32 and ref[f].shape == tri[f].shape == (len(slots), *pt.shape[1:3]), f
        torch.testing.assert_close(tri[f].cpu(), ref[f].cpu(), atol=TOL["plan"], rtol=0, msg=f)
    return {f: ref[f].cpu() for f in FIELDS}


# ---- hand-built single-head cases: n0 = 10, N = 20 -> candidate c = 15, window tokens 16..18 --------------
N0, NN, AH, AL = 10, 20, 2.0, 0.5  # th_h = 0.1, th_l = 0.025


def tok(p, mean, n0=N0, N=NN, Q=64):
    """A token at position p whose mean significance is `mean` (stored as a sum)."""
    return (p, mean * _count(p, n0, N, Q))


WIN = [tok(16, 1e-4), tok(17, 1e-4), tok(18, 1e-4)]  # least significant, but inside the window: never victims


def _plan_one(hi, lo, n0=N0, N=NN, ah=AH, al=AL, Q=64, expect=None):
    pool, pt, lh, ll = _build({(1, 0, 0): (hi, lo)}, S=2, L=1, H=1, P=8)
    got = _run_both(pool, pt, lh, ll, [1], [n0], [N], [ah], [al], Q=Q)
    got = {f: int(v[0, 0, 0]) for f, v in got.items()}
    assert got == _naive(hi, lo, n0, N, ah, al, WINDOW, Q)
    if expect is not None:
        full = dict(high_hole=-1, to_low_src=-1, low_dst=-1, new_len_high=len(hi), new_len_low=len(lo),
                    new_low_armed=1)
        full.update(expect)
        assert got == full
    return got


def test_c_high_victim_stays():
    # Victim is t_c itself (the least significant old high token) and it is above th_h.
    _plan_one([tok(3, 0.5), tok(15, 0.3)] + WIN + [tok(8, 0.2)], [tok(5, 0.03)], expect=dict(action=1))


def test_c_high_victim_demoted():
    hi = [tok(3, 0.2), tok(15, 0.3), tok(1, 0.5)] + WIN + [tok(7, 0.05), tok(9, 0.06)]
    _plan_one(hi, [tok(5, 0.03), tok(2, 0.04)],
              expect=dict(action=2, high_hole=6, to_low_src=6, low_dst=2, new_len_high=7, new_len_low=3))


def test_c_high_victim_pruned():
    hi = [tok(3, 0.2), tok(7, 0.01), tok(15, 0.3)] + WIN + [tok(0, 0.02)]
    _plan_one(hi, [], expect=dict(action=3, high_hole=1, new_len_high=6))


def test_c_low_appended():
    hi = [tok(3, 0.2), tok(15, 0.05)] + WIN
    _plan_one(hi, [tok(2, 0.03), tok(4, 0.06)],
              expect=dict(action=4, high_hole=1, to_low_src=1, low_dst=2, new_len_high=4, new_len_low=3))


def test_c_low_appended_to_empty_low():
    _plan_one([tok(15, 0.05)] + WIN, [],
              expect=dict(action=4, high_hole=0, to_low_src=0, low_dst=0, new_len_high=3, new_len_low=1))


def test_c_low_replaces_low_victim():
    lo = [tok(2, 0.03), tok(4, 0.01)] + [tok(p, 0.04) for p in (0, 1, 5, 6, 8, 9, 11)] + [tok(12, 0.005)]
    hi = [tok(3, 0.2)] + WIN + [tok(15, 0.05)]
    # low index 9 (second low page) is the least significant and below th_l.
    _plan_one(hi, lo, expect=dict(action=5, high_hole=4, to_low_src=4, low_dst=9, new_len_high=4))


def test_c_low_is_itself_the_low_min():
    # t_c would be the low victim but its mean is >= th_l by the branch condition, so it is appended
    # (action 6 "c-low pruned" cannot occur under Algorithm 1's thresholds).
    hi = [tok(15, 0.03), tok(3, 0.2)] + WIN
    _plan_one(hi, [tok(2, 0.05), tok(4, 0.06)],
              expect=dict(action=4, high_hole=0, to_low_src=0, low_dst=2, new_len_high=4, new_len_low=3))


def test_c_pruned():
    hi = [tok(3, 0.2), tok(1, 0.001)] + WIN + [tok(15, 0.01)]
    _plan_one(hi, [tok(2, 0.001)], expect=dict(action=7, high_hole=5, new_len_high=5))


@pytest.mark.parametrize("n0,N", [(20, 20), (6, 6), (3, 4), (0, 4)])
def test_noop_candidate_not_in_window(n0, N):
    # c = N - 1 - window < n0 - window (only right after prefill, N = n0): prefill already classified it;
    # or c < 0.
    c = N - 1 - WINDOW
    hi = [tok(p, 0.001, n0, N) for p in range(max(c, 0), N - 1)] + [tok(0, 0.001, n0, N)]
    _plan_one(hi, [], n0=n0, N=N, expect=dict(action=0))


def test_noop_candidate_missing_or_empty():
    _plan_one([tok(3, 0.001)] + WIN, [tok(15, 0.001)], expect=dict(action=0))  # c is not in the high section
    _plan_one([], [tok(2, 0.001)], expect=dict(action=0))


def test_active_at_prompt_boundary():
    # n0 = 16, N = 20: c = 15 >= n0 - window = 12 -> the prompt's last token is the candidate.
    hi = [tok(15, 0.01, n0=16)] + [tok(p, 0.2, n0=16) for p in (16, 17, 18)]
    _plan_one(hi, [], n0=16, expect=dict(action=7, high_hole=0, new_len_high=3))


def test_ties_take_smallest_index():
    hi = [tok(3, 0.3), tok(4, 0.05), tok(15, 0.3)] + WIN + [tok(5, 0.05)]
    _plan_one(hi, [], expect=dict(action=2, high_hole=1, to_low_src=1, low_dst=0, new_len_low=1, new_len_high=6))
    lo = [tok(2, 0.04), tok(4, 0.01), tok(6, 0.01)]
    _plan_one([tok(15, 0.05)] + WIN, lo, expect=dict(action=5, high_hole=0, to_low_src=0, low_dst=1, new_len_high=3))


def test_victim_by_mean_not_sum():
    # Q = 4: prompt token 1 was seen by 4 + 10 queries, token 12 by 8; the larger sum has the smaller mean.
    hi = [tok(1, 0.04, Q=4), tok(12, 0.06, Q=4), tok(15, 0.3, Q=4)] + WIN
    assert hi[0][1] > hi[1][1]
    _plan_one(hi, [], Q=4, expect=dict(action=2, high_hole=0, to_low_src=0, low_dst=0, new_len_high=5,
                                       new_len_low=1))


# ---- random sections: Triton == ref == naive ----------------------------------------------------------------
def _f32_product(a, b):
    """a * b rounded like the kernels (both operands f32, one f32 multiply)."""
    return float(torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32))


def _random_case(seed, layer_scale=None, ranges=None):
    rng = random.Random(seed)
    S, L, H, P = 7, 2, 3, 20
    seqs = [(12, 12), (30, 25), (9, 40), (3, 5), (50, 80), (20, 21)]  # (n0, N): incl. inactive ones
    ranges = ranges or [(0, 2**30)] * len(seqs)
    slots = rng.sample(range(S), len(seqs))
    alphas = [(rng.uniform(0.5, 2.0), rng.uniform(0.05, 0.5)) for _ in seqs]
    heads, naive = {}, {}
    for b, ((n0, N), s, (ah, al)) in enumerate(zip(seqs, slots, alphas)):
        al *= ah
        c = N - 1 - WINDOW
        for l in range(L):
            for h in range(H):
                old = [p for p in range(max(c, 0)) if rng.random() < 0.7]
                rng.shuffle(old)
                cut = rng.randint(0, len(old))
                hi_pos = old[:cut] + [p for p in range(max(c, 0), N - 1) if rng.random() < 0.95]
                lo_pos = old[cut:][:rng.choice([0, 5, 60])]
                rng.shuffle(hi_pos)
                floor = rng.choice([0.25, 1.0])  # heads with no mean below th_l reach "victim demoted"

                def sc(p):  # mean spread over [th_l * floor, th_h * 4], so every branch is hit
                    th_l, th_h = al / N, ah / N
                    m = th_l * floor * (th_h * 4 / (th_l * floor)) ** rng.random()
                    if rng.random() < 0.1:
                        m = th_l  # exact threshold hits and ties
                    return float(torch.tensor(m * _count(p, n0, N, 64), dtype=torch.float32))

                hi = [(p, sc(p)) for p in hi_pos]
                lo = [(p, sc(p)) for p in lo_pos]
                heads[(s, l, h)] = (hi, lo)
                sl = 1.0 if layer_scale is None else layer_scale[l]
                naive[(b, l, h)] = _naive(hi, lo, n0, N, _f32_product(ah, sl), _f32_product(al, sl), WINDOW, 64,
                                          ranges[b])
    pool, pt, lh, ll = _build(heads, S, L, H, P, seed=seed)
    args = (pool, pt, lh, ll, slots, [n for n, _ in seqs], [n for _, n in seqs],
            [a for a, _ in alphas], [a * b for a, b in alphas])
    return args, naive


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block,many", [(None, False), (16, False), (None, True)])
def test_random_matches_naive(seed, block, many, monkeypatch):
    """many: the launch of a large batch (one warp a program, 128-token tiles), forced at this small grid."""
    if many:
        monkeypatch.setattr(compression_plan_module, "MANY_PROGRAMS_PER_SM", 0)
    args, naive = _random_case(seed)
    got = _run_both(*args, block=block)
    actions = set()
    for (b, l, h), want in naive.items():
        assert {f: int(got[f][b, l, h]) for f in FIELDS} == want, (b, l, h)
        actions.add(want["action"])
    assert {0, 1, 2, 3, 4, 5, 7} <= actions  # every reachable branch exercised


@pytest.mark.parametrize("seed", [0, 1])
def test_untracked_low_pages_plan_as_tracked_ones_at_alpha_low_zero(seed):
    """Low pages without score and position rows (CacheConfig.track_low) are never scanned; at alpha_low 0 no low
    token is a victim anyway, so the plan equals the one over tracked low pages (whose rows here are real)."""
    args, _ = _random_case(seed)
    args = (*args[:-1], [0.0] * len(args[-1]))  # alpha_low 0 for every sequence
    untracked = PageFormat.make(4, 2, 16, PAGE_BYTES, 2, tracked=False)
    assert untracked.tokens > FMT_LO.tokens
    tracked = _run_both(*args)
    assert {2, 4} <= set(tracked["action"].flatten().tolist())  # victims demoted, t_c sent low
    got = _run_both(*args, fmt_lo=untracked)
    assert all(torch.equal(got[f], tracked[f]) for f in FIELDS)


@pytest.mark.parametrize("seed,min_low,armed", [(0, 3, False), (1, 1000, False), (2, 3, True), (3, 3, True)])
def test_lazy_low_section_matches_naive(seed, min_low, armed):
    """With min_low, heads with an empty low section keep low-class tokens high until min_low of their old high
    tokens are below th_h (and, with low_armed, were at the head's previous step too); heads that already hold
    low tokens decide as Algorithm 1 does. new_low_armed is each head's count reaching min_low."""
    args, _ = _random_case(seed)
    pool, pt, lh, ll, slots, n0s, Ns, ahs, als = args
    low_armed = torch.randint(0, 2, lh.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32) \
        if armed else None
    got = _run_both(*args, min_low=min_low, low_armed=low_armed)
    eager = _run_both(*args)
    unarmed = _run_both(*args, min_low=min_low)
    kept, held_back, T_hi, P = 0, 0, FMT_HI.tokens, pt.shape[-1] - 1
    for b, s in enumerate(slots):
        for l in range(pt.shape[1]):
            for h in range(pt.shape[2]):
                def rows(n, fmt, col):
                    out = []
                    for j in range(int(n)):
                        page = int(pt[s, l, h, col(j)])
                        out.append((int(pool.view(torch.int32)[page, fmt.pos_off // 4 + j % fmt.tokens]),
                                    float(pool.view(torch.float32)[page, fmt.score_off // 4 + j % fmt.tokens])))
                    return out
                hi = rows(lh[s, l, h], FMT_HI, lambda j: j // T_hi)
                lo = rows(ll[s, l, h], FMT_LO, lambda j: P - 1 - j // FMT_LO.tokens)
                want = _naive_lazy(hi, lo, n0s[b], Ns[b], ahs[b], als[b], WINDOW, 64, min_low,
                                   None if low_armed is None else int(low_armed[s, l, h]))
                assert {f: int(got[f][b, l, h]) for f in FIELDS} == want, (b, l, h)
                kept += int(got["action"][b, l, h] == 1 and eager["action"][b, l, h] in (2, 4))
                held_back += int(got["action"][b, l, h] == 1 and unarmed["action"][b, l, h] in (2, 4))
    assert kept > 0  # the rule changed some decisions
    assert (held_back > 0) == armed  # an unarmed head waits a step more than the count alone would have it
    if min_low < 1000:  # some heads are armed for their next step, some not
        assert 0 < int(got["new_low_armed"].sum()) < got["new_low_armed"].numel()


@pytest.mark.parametrize("seed", [3, 4])
def test_layer_scale_matches_naive(seed):
    # Per-layer budgets: layer l decides with alpha * layer_scale[l] (one f32 product), ref == Triton == naive.
    rng = random.Random(100 + seed)
    scale = [rng.uniform(0.25, 4.0), rng.uniform(0.25, 4.0)]
    args, naive = _random_case(seed, scale)
    got = _run_both(*args, layer_scale=scale)
    for (b, l, h), want in naive.items():
        assert {f: int(got[f][b, l, h]) for f in FIELDS} == want, (b, l, h)
    unscaled = _run_both(*args)
    assert any(not torch.equal(got[f], unscaled[f]) for f in FIELDS)  # the scale changed decisions


@pytest.mark.parametrize("seed", [5, 6])
def test_prunable_range_matches_naive(seed):
    # CacheConfig.prune_phase: per sequence, only positions in [lo, hi) may be pruned (prompt: [0, n0),
    # generation: [n0, inf), and arbitrary ranges); ref == Triton == the naive rule.
    seqs_n0 = [12, 30, 9, 3, 50, 20]
    ranges = [(0, seqs_n0[0]), (seqs_n0[1], 2**30), (0, seqs_n0[2]), (seqs_n0[3], 2**30), (10, 60), (5, 15)]
    args, naive = _random_case(seed, ranges=ranges)
    pr = ([a for a, _ in ranges], [b for _, b in ranges])
    got = _run_both(*args, prunable=pr)
    for (b, l, h), want in naive.items():
        assert {f: int(got[f][b, l, h]) for f in FIELDS} == want, (b, l, h)
    full = _run_both(*args, prunable=([0] * 6, [2**30] * 6))
    assert all(torch.equal(full[f], _run_both(*args)[f]) for f in FIELDS)  # all prunable == no range
    assert any(not torch.equal(got[f], full[f]) for f in FIELDS)  # the ranges changed decisions


def test_prunable_range_protects_each_victim():
    # Every pruning branch of the hand-built cases turns into its keeping branch when the victim is protected.
    hi = [tok(3, 0.2), tok(7, 0.01), tok(15, 0.3)] + WIN + [tok(0, 0.02)]  # high victim at position 7 pruned
    pool, pt, lh, ll = _build({(1, 0, 0): (hi, [])}, S=2, L=1, H=1, P=8)
    got = _run_both(pool, pt, lh, ll, [1], [N0], [NN], [AH], [AL], prunable=([N0], [2**30]))
    assert int(got["action"][0, 0, 0]) == 2  # demoted instead
    lo = [tok(2, 0.03), tok(4, 0.01), tok(12, 0.005)]  # position 12 (generated) is the low victim
    hi = [tok(3, 0.2)] + WIN + [tok(15, 0.05)]
    pool, pt, lh, ll = _build({(1, 0, 0): (hi, lo)}, S=2, L=1, H=1, P=8)
    got = _run_both(pool, pt, lh, ll, [1], [N0], [NN], [AH], [AL], prunable=([0], [N0]))
    assert int(got["action"][0, 0, 0]) == 5 and int(got["low_dst"][0, 0, 0]) == 1  # prompt token 4 goes instead
    got = _run_both(pool, pt, lh, ll, [1], [N0], [NN], [AH], [AL], prunable=([N0], [N0]))
    assert int(got["action"][0, 0, 0]) == 4  # nothing prunable: t_c appended
    hi = [tok(3, 0.2), tok(1, 0.001)] + WIN + [tok(15, 0.01)]  # t_c (15) below th_l
    pool, pt, lh, ll = _build({(1, 0, 0): (hi, [])}, S=2, L=1, H=1, P=8)
    got = _run_both(pool, pt, lh, ll, [1], [N0], [NN], [AH], [AL], prunable=([0], [N0]))
    assert int(got["action"][0, 0, 0]) == 4  # to low instead of pruned


def test_layer_scale_shape_checked():
    pool, pt, lh, ll = _build({}, S=2, L=3, H=1, P=4)
    with pytest.raises(ValueError, match="layer_scale"):
        compression_plan(pool, FMT_HI, FMT_LO, pt, lh, ll, *(torch.zeros(1, dtype=torch.int32) for _ in range(3)),
                         torch.ones(1), torch.ones(1), WINDOW, layer_scale=torch.ones(2))


def test_low_armed_checked():
    pool, pt, lh, ll = _build({}, S=2, L=1, H=2, P=4)
    args = (*(torch.zeros(1, dtype=torch.int32) for _ in range(3)), torch.ones(1), torch.ones(1), WINDOW)
    for bad in (torch.zeros(2, 1, 3, dtype=torch.int32), torch.zeros(2, 1, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match="low_armed"):
            compression_plan(pool, FMT_HI, FMT_LO, pt, lh, ll, *args, min_low=2, low_armed=bad)


def test_empty_batch():
    pool, pt, lh, ll = _build({}, S=2, L=1, H=2, P=4)
    got = _run_both(pool, pt, lh, ll, [], [], [], [], [])
    assert all(v.shape == (0, 1, 2) for v in got.values())


# ---- pinned prompt blocks (score +inf, kernels/prompt_classify.py pin_significance) ----------------------------
INF = float("inf")


def test_pinned_tokens_are_never_victims_and_the_least_significant_unpinned_one_is():
    # Positions 0..5 pinned (the first high page), far below th_h had they been scored; the victim is token 7.
    pinned = [(p, INF) for p in range(6)]
    hi = pinned + [tok(15, 0.3)] + WIN + [tok(7, 0.05), tok(9, 0.06)]
    _plan_one(hi, [tok(8, 0.03)], expect=dict(action=2, high_hole=10, to_low_src=10, low_dst=1, new_len_high=11,
                                               new_len_low=2))


def test_a_head_whose_older_high_tokens_are_all_pinned_has_no_victim():
    hi = [(p, INF) for p in range(6)] + [tok(15, 0.3)] + WIN
    got = _plan_one(hi, [], expect=dict(action=1))
    assert got["high_hole"] == -1


def test_a_pinned_token_leaving_the_window_stays_high():
    # t_c (position 15) is pinned: it goes nowhere, and the only unpinned old token is above th_h (kept).
    hi = [(p, INF) for p in range(12)] + [(15, INF), tok(13, 0.5)] + WIN
    _plan_one(hi, [], expect=dict(action=1))
