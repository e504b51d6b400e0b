"""The hand-written CUDA decode kernel (decode_mma.cu) for quantized pages with 2-, 4- or 8-bit keys and 2-, 4- or
8-bit values (K2V2, K4V2, K4V4, K8V4, K8V8, ...; integer codes, or e4m3 codes in the 8-bit sides of a high section:
kv_mode fp8), with or without a low section of another such precision (DiffKV's K8V4 + K4V2), with or without the
per-token logits / lse outputs DiffKV's significance update reads: when it serves a call (usable), how it is
compiled (NVRTC through torch.cuda._compile_kernel, once per device and variant) and launched (launch_mma).

It computes what the Triton kernels compute (reference: reference.py), with q rounded to integers where q.k runs on
the integer tensor cores (query_levels, round_query). On CUDA GPUs the dispatcher picks it over
the quartered and q8 Triton kernels wherever it can serve the call (dispatch.pick_kernel). On an H200
(benchmarks/results/decode_mma_vs_triton_H200.json) it runs 1.20-1.78x quartered.py's speed, and on K8V8 pages
(integer or e4m3), split as num_splits says, 1.16-1.38x q8.py's (under the quartered kernel's split rule it had been
0.81-0.96x q8's speed on an H100, decode_mma_vs_triton_H100.json). With several splits the partials are merged by
merge.py's kernel.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from diffkv_serve.kernels._common import num_sms
from diffkv_serve.kernels.decode_attention.launch import choose_num_splits
from diffkv_serve.kernels.decode_attention.reference import paged_decode_attention_ref
from diffkv_serve.kernels.decode_attention.tiles import LOG2E
from diffkv_serve.kernels.page_layout import PageFormat

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_mma.cu")
TILE = 64  # tokens per tile (decode_mma.cu)
MAX_PAGES = 4  # pages one tile may span (decode_mma.cu's MAXPAGES): pages must hold MIN_TOKENS or more
MIN_TOKENS = -(-(TILE - 1) // (MAX_PAGES - 1))  # 21: then TILE tokens touch at most MAX_PAGES pages
KEY_BITS, VALUE_BITS = (2, 4, 8), (2, 4, 8)
MAX_GROUP = 8  # query heads per KV head: the mma's N
STAGES = 2  # cp.async tiles in flight in a program (Variant.stages; one_stage says when a call takes 1)
MAX_PROGRAMS = 12  # one-warp programs per SM the register allocation allows at most (__launch_bounds__)
# A variant with a low section compiles two sections' loops; held to 12 programs (170 registers) it ran 6-13% slower
# than at 8 on an H100 (K4V4+K4V4 and K4V4+K4V2 sections, batch 128 and 256, 1,088 tokens a head), at two stages.
# At one stage it takes 12 (one_stage): at 8, one tile in flight a program was 4-14% slower than two stages.
MAX_PROGRAMS_TWO_SECTIONS = 8
# one_stage: past 1.5 two-stage waves (a second wave at least half full) two stages keep up with one: K8V8 and fp8
# at Llama-3-8B batch 160-192 (1.6-1.9 waves) within 5% either way (decode_stages_H200.json), and an engine decode
# step on fp8 pages at batch 160 x 2,048 tokens ran 3% slower at one stage (Llama-3-8B random weights, H200).
MAX_SECOND_WAVE = 1.5
SHARED_PER_SM = 228 * 1024  # H100 / A100-class SMs; each resident block also takes 1 KB of it
HEAD_DIM = 128
# q.k on the integer mma takes q as integers at each query head's own scale, max |q| / levels: 16-bit (two mma
# chains) against 8-bit keys, 8-bit (one chain) against 4- and 2-bit keys, whose own rounding dwarfs q's
# (benchmarks/q_precision.py; decode_mma.cu says what the second chain cost)
Q_LEVELS_8BIT_KEYS, Q_LEVELS_LOW_KEYS = 32767, 127


def query_levels(fmt: PageFormat) -> int | None:
    """The integer levels the kernel rounds q to against fmt's keys; None for e4m3 keys (q in fp16, fp16 mma) and
    for keys it does not serve."""
    if fmt.side_float8("k") or fmt.key_bits not in KEY_BITS:
        return None
    return Q_LEVELS_8BIT_KEYS if fmt.key_bits == 8 else Q_LEVELS_LOW_KEYS


def zero_term_rounded(levels: int) -> bool:
    """Whether the keys' zero-point term, z * sum of q, takes the rounded q (8-bit q: a logit is then the dequantized
    key times that q) or q as given (16-bit q)."""
    return levels == Q_LEVELS_LOW_KEYS


def round_query(q: torch.Tensor, levels: int, qk_scale: float) -> torch.Tensor:
    """q [..., D] as the kernel's integer q.k sees it, float64: Q * max |x| / levels / qk_scale, where x = q * qk_scale
    and Q = round(x * (levels / max |x|)) in float32 steps, the kernel's own (an element at exactly half a step
    rounds the way the kernel's float32 arithmetic takes it; a row of zeros stays zeros)."""
    x = q.float() * torch.tensor(qk_scale, dtype=torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    rsq = torch.where(amax > 0, torch.tensor(float(levels), dtype=torch.float32) / amax, torch.zeros_like(amax))
    return torch.round(x * rsq).double() * (amax.double() / levels) / qk_scale


def kernel_reference(q, pool, fmt: PageFormat, cache_dtype, page_table, lengths, slots, layer, scale, max_len=None,
                     fmt_low=None, len_low=None, logits_out=None, lse_out=None):
    """The torch reference (reference.py) over q as this kernel's q.k takes it: each section's keys against q
    rounded to that section's query_levels (q as given against e4m3 keys). What the kernel is held to."""
    qk = scale * LOG2E
    q_hi, q_lo = (q if f is None or query_levels(f) is None else round_query(q, query_levels(f), qk).float()
                  for f in (fmt, fmt_low))
    return paged_decode_attention_ref(q_hi, pool, fmt, cache_dtype, page_table, lengths, slots, layer, scale,
                                      max_len=max_len, fmt_low=fmt_low, len_low=len_low, logits_out=logits_out,
                                      lse_out=lse_out, q_low=q_lo)


class Variant(NamedTuple):
    """What a compiled instance of decode_mma.cu is specialized to (its #defines)."""

    kb_hi: int
    vb_hi: int
    kb_lo: int  # 0: no low section
    vb_lo: int
    maxpages: int
    bf16: bool
    logits: bool  # writes each token's logit (stored from the mma fragments)
    f8: bool = False  # the high section's 8-bit sides are e4m3 codes (PageFormat.float8)
    stages: int = STAGES  # tiles in flight a program: 1 or 2 (one_stage)

    @property
    def stage_bytes(self) -> int:
        sizes = [TILE * (16 * self.kb_hi + 16 * self.vb_hi + 8)]
        if self.kb_lo:
            sizes.append(TILE * (16 * self.kb_lo + 16 * self.vb_lo + 8))
        return max(sizes)

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.stage_bytes

    @property
    def min_programs(self) -> int:
        """Programs per SM the registers must allow: as many as shared memory lets reside, at most MAX_PROGRAMS
        (K4V2: 12 -> 170 registers; K8V4: 8, no cap), or MAX_PROGRAMS_TWO_SECTIONS with a low section at two
        stages."""
        cap = MAX_PROGRAMS_TWO_SECTIONS if self.kb_lo and self.stages > 1 else MAX_PROGRAMS
        return max(1, min(cap, SHARED_PER_SM // (self.shared_bytes + 1024)))

    def defines(self) -> str:
        d = dict(KB_HI=self.kb_hi, VB_HI=self.vb_hi, KB_LO=self.kb_lo, VB_LO=self.vb_lo, MAXPAGES=self.maxpages,
                 STAGES=self.stages, MINB=self.min_programs, Q_BF16=int(self.bf16), WRITE_LOGITS=int(self.logits),
                 F8_HI=int(self.f8))
        return "".join(f"#define {k} {v}\n" for k, v in d.items())


def one_stage(var: Variant, batch: int, kv_heads: int, device: torch.device) -> bool:
    """Whether a call runs with one tile in flight a program instead of two: where its (sequence, KV head) pairs
    overfill the SMs' resident two-stage programs, by at most half a wave (MAX_SECOND_WAVE), and one stage lets all
    of them reside at once. Programs a SM, two stages -> one: K8V8 and e4m3 pages 6 -> 12, K8V4 8 -> 12, DiffKV's
    two sections 8 -> 12 (MAX_PROGRAMS_TWO_SECTIONS); K4V4, K4V2 and K2V2 hold 12 either way. Such a call goes unsplit: one wave of programs that keep enough bytes
    in flight between them, where two stages ran a second, part-empty wave.
    Measured on an H200 with Llama-3-8B heads (8 KV heads), batch 128-192 x 1,024-16,384 tokens, one and two
    stages at 1, 2 and 4 splits (benchmarks/decode_stages.py; decode_stages_H200.json in benchmarks/results): this
    pick was the fastest or within 5.5% at every shape. Against two stages unsplit (the split rule's count there):
    DiffKV's two sections with logits at batch 160 72.5 against 90.8 us at 1,024 tokens, 256 / 328 at 4,096, 971 /
    1,255 at 16,384; K8V4 at batch 192 x 4,096 300 against 326; K8V8 at batch 128 x 1,024 71.5 against 86.7 (80.3
    at two stages in two splits, the rule before). End to end, Llama-3-8B random weights at batch 160 x 2,048
    tokens (benchmarks/step_breakdown.py, one process, one stage switched off and on twice): a diffkv decode step
    took 11.6-11.7 ms against 13.0-13.1, its attention 4.63-4.66 against 5.91-5.93 ms. One stage unsplit lost 1-6%
    where the two-stage grid fits (K8V4 and DiffKV's sections at batch 128: 59.6 against 57.7 us at 1,024 tokens,
    783 / 740 at 16,384), and in probes outside that record 5-19% at batch 64 and 10% where one stage's grid
    overfills too (K8V8 at batch 256 x 1,024: 156 against 142 us)."""
    one = var._replace(stages=1)
    pairs, sms = batch * kv_heads, num_sms(device)
    two = sms * var.min_programs  # resident two-stage programs
    return var.stages > 1 and two < pairs <= min(sms * one.min_programs, two * MAX_SECOND_WAVE)


def stages_for(var: Variant, batch: int, kv_heads: int, device: torch.device) -> int:
    """Tiles in flight a program of a call: 1 where one_stage says, else STAGES."""
    return 1 if one_stage(var, batch, kv_heads, device) else STAGES


def num_splits(fmt: PageFormat, fmt_low: PageFormat | None, batch: int, kv_heads: int, max_len: int,
               device: torch.device) -> int:
    """Splits per (sequence, KV head) of a call (max_len: a bound on a head's tokens): one where one_stage says.
    Otherwise every variant but K8V8 takes the quartered kernel's rule (launch.choose_num_splits for one-warp
    programs: about 8 programs per SM), and K8V8, whose tiles leave 6 programs per SM, half of it rounded down to a
    power of two (it runs fastest at about 4 programs per SM).
    Measured on an H200 at 1-32 splits, Llama-3-8B and Qwen2.5-1.5B heads, batch 8-128 x 1,024-4,096 tokens
    (benchmarks/decode_splits.py; decode_splits_mma_cuda_*_H200.json in benchmarks/results, two stages): the pick
    was the fastest count for K8V8 and fp8 pages at every shape, where the one-warp rule's count was up to 23%
    slower (Llama-3-8B's batch 128 now takes one stage, unsplit). For int4, K8V4, K4V2 and DiffKV's two sections
    the one-warp pick was within 6% of the fastest of 1-64 splits up to 16,384 tokens (the same sweep on random
    pages, not recorded)."""
    var = variant(fmt, fmt_low, False, False)
    if one_stage(var, batch, kv_heads, device):
        return 1
    if not (var.kb_hi == var.vb_hi == 8 and not var.kb_lo):
        return choose_num_splits(batch, kv_heads, max_len, device, TILE, 1, HEAD_DIM)
    splits = choose_num_splits(batch, kv_heads, max_len, device, TILE, 2, HEAD_DIM)
    return 1 << (splits.bit_length() - 1)


def _format_reason(fmt: PageFormat, which: str) -> str | None:
    if fmt.key_bits not in KEY_BITS or fmt.value_bits not in VALUE_BITS or (fmt.float8 and which == "low"):
        return (f"{fmt.name} {which} pages (serves keys of {KEY_BITS} bits, values of {VALUE_BITS}, integer codes; "
                "e4m3 codes in a high section)")
    if fmt.tokens < MIN_TOKENS:
        return f"{fmt.tokens} tokens per {which} page (needs {MIN_TOKENS} or more)"
    return None


def usable(fmt: PageFormat, fmt_low: PageFormat | None, q: torch.Tensor, group: int) -> str | None:
    """None if the CUDA kernel can serve this call, else why not (tests and benchmarks print it)."""
    if not q.is_cuda or torch.version.hip:
        return "not a CUDA device"
    capability = torch.cuda.get_device_capability(q.device)
    if capability < (8, 0):
        return "needs sm_80 or newer (cp.async, m16n8k16 mma, movmatrix)"
    for f, which in ((fmt, "high"), (fmt_low, "low")):
        why = _format_reason(f, which) if f is not None else None
        if why:
            return why
    if fmt.float8 and capability < (8, 9):
        return "e4m3 pages need sm_89 or newer (cvt.f16x2.e4m3x2)"
    if fmt_low is not None and (fmt.value_bits == 8) != (fmt_low.value_bits == 8):
        return f"{fmt.value_bits}- and {fmt_low.value_bits}-bit values in one call (8-bit values only with 8-bit)"
    if fmt.head_dim != HEAD_DIM:
        return f"head_dim {fmt.head_dim} (serves {HEAD_DIM})"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"q dtype {q.dtype}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (serves up to {MAX_GROUP})"
    return _toolchain_reason(q.device)


@functools.cache
def _toolchain_reason(device: torch.device) -> str | None:
    """None if this torch can compile and load the kernel here (torch.cuda._compile_kernel, NVRTC), else why
    not; checked once per device by compiling one variant, so that a missing toolchain sends every call to the
    Triton kernels instead of failing at the first decode step."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    try:
        _compiled(device, Variant(4, 2, 0, 2, 2, False, False))
    except Exception as e:  # noqa: BLE001 - any failure to build means: use the Triton kernels
        log.warning("the CUDA decode kernel cannot be compiled here (%s); the Triton kernels serve every call", e)
        return f"compile failed: {e}"[:300]
    return None


def variant(fmt: PageFormat, fmt_low: PageFormat | None, bf16: bool, logits: bool) -> Variant:
    tokens = min(fmt.tokens, fmt_low.tokens if fmt_low else fmt.tokens)
    pages = 1 + -(-(TILE - 1) // tokens)  # most pages TILE consecutive tokens can touch
    return Variant(fmt.key_bits, fmt.value_bits, fmt_low.key_bits if fmt_low else 0,
                   fmt_low.value_bits if fmt_low else 2, pages, bf16, logits, fmt.float8)


@functools.cache
def _compiled(device: torch.device, var: Variant):
    with torch.cuda.device(device):
        # Settings as #defines: _compile_kernel's option list differs between torch versions.
        return torch.cuda._compile_kernel(var.defines() + SOURCE.read_text(), "decode_mma")


def launch_mma(q, pool, fmt: PageFormat, fmt_low: PageFormat | None, page_table, len_hi, len_lo, slots, out,
               mid_acc, mid_ml, logits, lse, layer: int, qk_scale: float, num_splits: int,
               compiled=None, alpha_low_by_slot=None, stages: int | None = None) -> None:
    """One warp per (batch entry, KV head, split) over the split's tiles of the high then the low section. With
    num_splits > 1 it writes mid_acc [B, Hq, num_splits, D] / mid_ml [B, Hq, num_splits, 2] (log2-domain max,
    sum) for merge.merge_splits, else the normalized output into out (and lse, when given). qk_scale is in the
    log2 domain. logits (optional, f32 [B, Hq, >= max_len]) receives each token's natural-domain logit (high
    token j at j, low token j at len_hi + j); with alpha_low_by_slot (f32 [S]) a slot's low tokens get none where
    it is 0 (nothing reads their scores). compiled: a stand-in for _compiled (the CPU emulation in tests). stages:
    tiles in flight a program (default: stages_for's)."""
    B, Hq, _ = q.shape
    Hkv = page_table.shape[2]
    group = Hq // Hkv
    if group > MAX_GROUP:
        raise ValueError(f"launch_mma: {group} query heads per KV head (at most {MAX_GROUP})")
    # The kernel finds token t's page as umulhi(t, ceil(2^32 / T)), exact while t < 2^32 / T; a section's tokens
    # stay below (table columns) * T, so the section with the most tokens a page bounds the table.
    T = max(fmt.tokens, fmt_low.tokens if fmt_low is not None else 0)
    if page_table.shape[3] * T * T >= 1 << 32:
        raise ValueError(f"launch_mma: page_table has {page_table.shape[3]} pages a head; at {T} tokens a page the "
                         f"kernel's page lookup is exact below {((1 << 32) - 1) // T ** 2}")
    if q.stride(2) != 1 or q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8:
        q = q.clone(memory_format=torch.contiguous_format)  # the kernel reads q rows in 16-byte loads
    var = variant(fmt, fmt_low, q.dtype == torch.bfloat16, logits is not None)
    if stages is None:
        stages = stages_for(var, B, Hkv, q.device)
    if stages not in (1, 2):
        raise ValueError(f"launch_mma: stages={stages} (1 or 2)")
    var = var._replace(stages=stages)
    kernel = (compiled or _compiled)(q.device, var)
    lo = fmt_low or fmt
    len_lo = len_lo if fmt_low is not None else len_hi
    logits_t = logits if logits is not None else mid_ml
    lse_t = lse if lse is not None else mid_ml
    kernel(grid=(B, Hkv, num_splits), block=(32, 1, 1), shared_mem=var.shared_bytes, args=[
        q, pool, page_table, len_hi, len_lo, slots, out, mid_acc, mid_ml, logits_t, lse_t, int(lse is not None),
        alpha_low_by_slot if alpha_low_by_slot is not None else lse_t, int(alpha_low_by_slot is not None),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1), page_table.stride(2), page_table.shape[3] - 1,
        len_hi.stride(0), len_hi.stride(1), len_hi.stride(2), len_lo.stride(0), len_lo.stride(1), len_lo.stride(2),
        logits_t.stride(0), logits_t.stride(1), lse_t.stride(0), lse_t.stride(1),
        layer, float(qk_scale), Hq, group, num_splits, fmt.page_bytes,
        fmt.tokens, fmt.k_off, fmt.k_meta_off, fmt.v_off, fmt.v_meta_off,
        lo.tokens, lo.k_off, lo.k_meta_off, lo.v_off, lo.v_meta_off])
