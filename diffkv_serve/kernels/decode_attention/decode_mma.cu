// Decode attention over quantized pages with 2-, 4- or 8-bit keys and 2-, 4- or 8-bit values (integer codes, planar
// packing, fp16 scale / zero per token; layout in kernels/page_layout.py and kernels/quant.py), head_dim 128, a
// GQA group of up to 8 query heads, a high section and optionally a low section of another precision (DiffKV's
// K8V4 + K4V2), one warp per (batch entry, KV head, split). kernels/decode_attention/mma_cuda.py compiles it
// (NVRTC) and launches it; its reference is kernels/decode_attention/reference.py. tests/kernels/cuda_emu runs it
// on a CPU for the tests.
//
// Why CUDA and not Triton: Triton puts the query group on the mma's M side (padded to 16 rows) and takes packed
// codes to the value dot through a shared-memory transpose read byte by byte. Here tokens are the M side of q.k
// (16 tokens x 8 query heads, no padding up to a group of 8), the logits' C fragments become p.v's B operand by one
// movmatrix, and packed codes become A fragments in registers. Keys go to the integer mma (m16n8k32, u8 codes
// against q as integers: 16-bit in two 8-bit parts against 8-bit codes, 8-bit against 4- and 2-bit codes): 8-bit
// codes as ldmatrix loads them, 4- and 2-bit codes after a mask (and a shift); exact, and 1.5-5% faster on an
// H200 than turning codes into fp16 for the fp16 mma (K4V2, int4, DiffKV's mix; e4m3 keys stay on the fp16 mma).
// Values: a mask (after a prmt for 8-bit codes) leaves c * 2^s in
// the low bits of each fp16 half, the subnormal c * 2^(s - 24), which the fp16 mma multiplies exactly: no bias to
// cancel, and the running sum is touched only where the softmax max or the top value scale grows. (Codes as fp16
// 1024 + c * 2^s had needed a bias term and a rescale of the sum every tile: on an H200 up to 2% slower for int4,
// 0-1% for K4V2, K8V4 and DiffKV's mix.)
//
// A split covers a run of 64-token tiles of the high section followed by the low one, so both sections share the
// split's softmax state. Value codes of every width reach the same accumulator rows (dim 32 p + 4 gi + byte for
// plane p), 2- and 4-bit codes at the same factor 4^p (so those two widths can share a split), 8-bit codes at 1.
//
// Compile-time settings (defined by the launcher): KB_HI / VB_HI and KB_LO / VB_LO (key / value bits of the
// sections; KB_LO 0: no low section), MAXPAGES (pages a 64-token tile can span: 2 when every format holds >= 64
// tokens a page, 3 when >= 32, 4 when >= 21), STAGES (cp.async tiles in flight), MINB (programs per SM the
// registers must allow), Q_BF16 (q / out are bf16), WRITE_LOGITS (each token's logit q.k * scale into `logits`,
// stored straight from the C fragments), F8_HI (the high section's 8-bit sides hold e4m3 codes, zero point 0:
// converted to fp16 by cvt, no bias; sm_89+). With several splits the kernel writes each split's partials and
// kernels/decode_attention/merge.py's kernel combines them.
typedef unsigned int u32;
struct __attribute__((aligned(16))) U4 { u32 x, y, z, w; };
struct __attribute__((aligned(8))) U2 { u32 x, y; };

#ifndef KB_HI
#define KB_HI 4
#endif
#ifndef VB_HI
#define VB_HI 2
#endif
#ifndef KB_LO
#define KB_LO 0
#endif
#ifndef VB_LO
#define VB_LO 2
#endif
#ifndef F8_HI
#define F8_HI 0
#endif
#ifndef MAXPAGES
#define MAXPAGES 2
#endif
#if MAXPAGES < 2
#error "MAXPAGES: a 64-token tile of pages of at most 64 tokens spans two pages or more"
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef MINB
#define MINB 1
#endif
#ifndef Q_BF16
#define Q_BF16 0
#endif
#ifndef WRITE_LOGITS
#define WRITE_LOGITS 0
#endif
// How a row copy picks its page: a 64-bit select where a tile can span three pages (K4V4 and K8V4 at the default
// page size), two predicated copies elsewhere (cp_from). Measured on an H200: predication 2-5% faster on K4V2 and
// DiffKV's mix, up to 2% slower on K8V4 at small calls, K4V4 within 1% either way.
#define SELECT_ROWS (MAXPAGES == 3)
#define TILE 64
#define D 128
#define CODE_UNIT 16777216.f  // 2^24: integer value codes reach the mma as fp16 subnormals, c * 2^-24
#define LN2 0.6931471805599453f

#ifdef DIFFKV_WARP_EMU
using namespace emu_ptx;
#else
#define DYNAMIC_SMEM(name) extern __shared__ __attribute__((aligned(16))) unsigned char name[]
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ float f16_lo(u32 x) {
  float f;
  unsigned short h = (unsigned short)(x & 0xffff);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float f16_hi(u32 x) {
  float f;
  unsigned short h = (unsigned short)(x >> 16);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2bf16(float v) {
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
__device__ __forceinline__ u32 e4m3x2_f16x2(u32 x) {  // the low 16 bits: two e4m3 codes -> two fp16 (exact)
  u32 d;
  unsigned short h = (unsigned short)(x & 0xffff);
#if F8_HI
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(h));
#else
  d = h;  // never reached: only F8 variants convert e4m3 codes (cvt needs sm_89)
#endif
  return d;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp(float x) {  // 1 ulp; 1.f / x took ~12 instructions and a branch a tile
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 warp_max(u32 x) {  // one instruction for a reduction over the warp (sm_80+)
  u32 d;
  asm("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(d) : "r"(x));
  return d;
}
__device__ __forceinline__ bool warp_any(bool p) { return __any_sync(0xffffffff, p); }
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 movtrans(u32 a) {
  u32 d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm4(u32 addr, u32& d0, u32& d1, u32& d2, u32& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}
// Integer mma (m16n8k32, s32 accumulators): u8 key codes (A) by q's signed high bytes (imma_s8) or unsigned low
// bytes (imma_u8).
__device__ __forceinline__ void imma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void imma_u8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp4(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}
// BYTES (16 or 4) from b once k >= to_b, else from a; zeros once k >= to_hi (k: a constant once unrolled). Two
// predicated copies and two compares with an immediate, where choosing between two 64-bit addresses, adding the
// pool and comparing token indices cost ~6 integer instructions a copy (the kernel runs at an H200's power cap:
// every instruction a tile costs clock).
template <int BYTES>
__device__ __forceinline__ void cp_from(u32 dst, const unsigned char* a, const unsigned char* b, int k, int to_b,
                                        int to_hi) {
  if (BYTES == 16)
    asm volatile("{\n.reg .pred q, z;\nsetp.le.s32 q, %3, %5;\nsetp.le.s32 z, %4, %5;\n"
                 "@q cp.async.cg.shared.global [%0], [%2], 16, z;\n@!q cp.async.cg.shared.global [%0], [%1], 16, z;\n}"
                 ::"r"(dst), "l"(a), "l"(b), "r"(to_b), "r"(to_hi), "r"(k));
  else
    asm volatile("{\n.reg .pred q, z;\nsetp.le.s32 q, %3, %5;\nsetp.le.s32 z, %4, %5;\n"
                 "@q cp.async.ca.shared.global [%0], [%2], 4, z;\n@!q cp.async.ca.shared.global [%0], [%1], 4, z;\n}"
                 ::"r"(dst), "l"(a), "l"(b), "r"(to_b), "r"(to_hi), "r"(k));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
#endif

__device__ __forceinline__ float q_elem(unsigned short x) {  // one element of q (fp16 or bf16) as float
#if Q_BF16
  return __uint_as_float(((u32)x) << 16);
#else
  return f16_lo(x);
#endif
}
__device__ __forceinline__ unsigned short out_elem(float v) {
#if Q_BF16
  return f2bf16(v);
#else
  return (unsigned short)(pack_f16x2(v, 0.f) & 0xffff);
#endif
}

// Bytes of one token's keys / values in a page, and of one tile in a shared-memory stage:
// [keys TILE x KROW][values TILE x VROW][key (scale, zero) TILE x 4][value (scale, zero) TILE x 4].
#define KROW(KB) (16 * (KB))
#define VROW(VB) (16 * (VB))
#define STAGE_OF(KB, VB) (TILE * (KROW(KB) + VROW(VB) + 8))
#if KB_LO && STAGE_OF(KB_LO, VB_LO) > STAGE_OF(KB_HI, VB_HI)
#define STAGE_BYTES STAGE_OF(KB_LO, VB_LO)
#else
#define STAGE_BYTES STAGE_OF(KB_HI, VB_HI)
#endif

// Where a section's pages are: page j of the section at pt[pstep * j] (the low section runs backwards from the
// table's column P - 1), `tokens` rows each; t / tokens = umulhi(t, per_page) for t < 2^32 / tokens (a division
// cost ~30 instructions a tile).
struct Section {
  const int* pt;
  int pstep, tokens, k_off, k_meta, v_off, v_meta;
  u32 per_page;
};
__device__ __forceinline__ u32 per_page_of(int tokens) { return (u32)(((1ull << 32) + tokens - 1) / tokens); }

// The softmax state of one split: out^T rows (dims) x columns (members 2 t4, 2 t4 + 1) per 16-dim M tile, in units
// of the last tile's top value scale; log2-domain max m, sum l, and sum of p * value zero point z per member.
struct State {
  float acc[8][4];
  float m[2], l[2], z[2];
  float top;   // the largest value scale so far: acc is in units of it
  float unit;  // what one unit of acc is worth (CODE_UNIT for integer value codes, 1 for e4m3 values)
};

// The <= MAXPAGES pages a tile of a section touches: page k starts at section token first[k], at pool byte base[k]
// (pages past the section's end repeat the first page's base, so every address stays inside a page; never read);
// `tokens` a page.
struct TilePages {
  long long base[MAXPAGES];
  int first[MAXPAGES];
  int tokens;
};

// The page holding section token t (pool byte base_a, from section token first_a) and the one after it (base_b,
// from first_b).
struct PagePair {
  long long base_a, base_b;
  int first_a, first_b;
};
__device__ __forceinline__ PagePair pages_from(const TilePages& tp, int t) {
  PagePair pp = {tp.base[0], tp.base[1], tp.first[0], 0};
#pragma unroll
  for (int k = 1; k < MAXPAGES; ++k)
    if (t >= tp.first[k]) {
      pp.base_a = tp.base[k];
      pp.base_b = tp.base[k + 1 < MAXPAGES ? k + 1 : k];
      pp.first_a = tp.first[k];
    }
  pp.first_b = pp.first_a + tp.tokens;
  return pp;
}

// The 16-byte chunk slot of chunk `part` of row `tok` in shared memory. Chunks are stored XOR-swizzled so that the
// fragment reads in attend hit distinct banks: SWZ 1 (e4m3 keys) by token parity, 5 (integer 8-bit keys, read by
// ldmatrix: eight rows of one chunk at a time) by token % 8, 2 (8-bit values) by 2 ((token / 2) % 4), 3 (4-bit
// values) by (token / 2) % 4, 4 (2-bit values) by (token / 4) % 2; 0 not at all.
template <int SWZ>
__device__ __forceinline__ int swizzled(int part, int tok) {
  return SWZ == 1 ? part ^ (tok & 1)
       : SWZ == 5 ? part ^ (tok & 7)
       : SWZ == 2 ? part ^ (2 * ((tok >> 1) & 3))
       : SWZ == 3 ? part ^ ((tok >> 1) & 3)
       : SWZ == 4 ? part ^ ((tok >> 2) & 1)
                  : part;
}

// One operand of tokens [t0, t0 + TILE) -- keys or values, ROWB (32, 64 or 128) bytes a token at segment offset
// `off` of its page -- into shared memory at dst in 16-byte copies (rows at or past hi zero-filled). Each 8-lane
// phase of a copy instruction fills C = 128 / ROWB consecutive rows (128 contiguous bytes, conflict-free in shared
// memory); the four phases take the four quarters of the tile. A lane's copies stay within 16 consecutive tokens,
// which (pages hold >= 21) touch at most two pages: it works out both addresses once per tile, and each copy picks
// one of the two by comparing its token offset (an immediate) with where the second page starts.
template <int ROWB, int SWZ>
__device__ __forceinline__ void copy_rows(u32 dst, const unsigned char* pool, const TilePages& tp, int t0, int hi,
                                          int off, int lane) {
  constexpr int P = ROWB / 16, C = 128 / ROWB, QUARTER = TILE / 4;  // chunks a row, rows a phase
  const int w = lane & 7, part = w % P, tok0 = (lane >> 3) * QUARTER + w / P, t = t0 + tok0;
  const PagePair pp = pages_from(tp, t);
  const unsigned char* a = pool + pp.base_a + (long long)(t - pp.first_a) * ROWB + off + part * 16;
  const unsigned char* b = pool + pp.base_b + (long long)(t - pp.first_b) * ROWB + off + part * 16;
  const int first_b = pp.first_b;
#pragma unroll
  for (int it = 0; it < QUARTER / C; ++it) {
    const int tok = tok0 + C * it;  // the swizzle below depends on it only
    const u32 d = dst + tok * ROWB + swizzled<SWZ>(part, tok) * 16;
    if (SELECT_ROWS)
      cp16(d, (C * it >= first_b - t ? b : a) + C * it * ROWB, C * it < hi - t);
    else
      cp_from<16>(d, a + C * it * ROWB, b + C * it * ROWB, C * it, first_b - t, hi - t);
  }
}

// One 4-byte (scale, zero) word a token, at segment offsets k_off and v_off of its page, of tokens [t0, t0 + TILE)
// into shared memory at dk and dv (zero past hi): lane l copies tokens l and l + 32. With pages of >= 32 tokens
// (MAXPAGES <= 3) both lie in the page of token l or the next one: one page lookup for the four copies.
__device__ __forceinline__ void copy_words(u32 dk, u32 dv, const unsigned char* pool, const TilePages& tp, int t0,
                                           int hi, int k_off, int v_off, int lane) {
  const int t = t0 + lane;
  if (MAXPAGES <= 3) {
    const PagePair pp = pages_from(tp, t);
    const int first_b = pp.first_b;
    const unsigned char* a = pool + pp.base_a + (long long)(t - pp.first_a) * 4;
    const unsigned char* b = pool + pp.base_b + (long long)(t - first_b) * 4;
    cp_from<4>(dk + lane * 4, a + k_off, b + k_off, 0, first_b - t, hi - t);
    cp_from<4>(dk + lane * 4 + 128, a + k_off + 128, b + k_off + 128, 32, first_b - t, hi - t);
    cp_from<4>(dv + lane * 4, a + v_off, b + v_off, 0, first_b - t, hi - t);
    cp_from<4>(dv + lane * 4 + 128, a + v_off + 128, b + v_off + 128, 32, first_b - t, hi - t);
    return;
  }
#pragma unroll
  for (int it = 0; it < TILE / 32; ++it) {
    const int tok = it * 32 + lane, tt = t + it * 32;
    long long base = tp.base[0];
    int first = tp.first[0];
#pragma unroll
    for (int k = 1; k < MAXPAGES; ++k)
      if (tt >= tp.first[k]) base = tp.base[k], first = tp.first[k];
    const unsigned char* src = pool + base + (long long)(tt - first) * 4;
    cp4(dk + tok * 4, src + k_off, tt < hi);
    cp4(dv + tok * 4, src + v_off, tt < hi);
  }
}

// The pool page ids of the <= MAXPAGES pages from the one holding section token t0 (a page starting at or past hi
// repeats the first id: never read). They are read a tile ahead of the tile's copies: loaded where they are used,
// their latency stalled the warp before every tile's copies (~2.5% of a K4V2 call's samples).
struct TileIds {
  int id[MAXPAGES];
};
__device__ __forceinline__ TileIds tile_ids(const Section& sec, int t0, int hi) {
  const int p0 = __umulhi((u32)t0, sec.per_page);
  TileIds r;
#pragma unroll
  for (int k = 0; k < MAXPAGES; ++k)
    r.id[k] = k == 0 || (p0 + k) * sec.tokens < hi ? sec.pt[sec.pstep * (p0 + k)] : r.id[0];
  return r;
}

// Tokens [t0, t0 + TILE) of a section, on the pages `ids`, into a stage buffer: [keys TILE x KROW][values TILE x
// VROW][key (scale, zero) TILE x 4][value (scale, zero) TILE x 4].
template <int KB, int VB, bool F8>
__device__ __forceinline__ void load_tile(unsigned char* buf, const unsigned char* pool, const Section& sec,
                                          const TileIds& ids, int t0, int hi, int page_bytes, int lane) {
  const int T = sec.tokens, p0 = __umulhi((u32)t0, sec.per_page);
  TilePages tp;
  tp.tokens = T;
#pragma unroll
  for (int k = 0; k < MAXPAGES; ++k) {
    tp.first[k] = k ? tp.first[k - 1] + T : p0 * T;
    tp.base[k] = (long long)ids.id[k] * page_bytes;
  }
  const u32 sbase = smem_addr(buf);
  constexpr int KSWZ = KB == 8 ? (F8 ? 1 : 5) : 0, VSWZ = VB == 8 ? 2 : VB == 4 ? 3 : 4;
  copy_rows<KROW(KB), KSWZ>(sbase, pool, tp, t0, hi, sec.k_off, lane);
  copy_rows<VROW(VB), VSWZ>(sbase + TILE * KROW(KB), pool, tp, t0, hi, sec.v_off, lane);
  copy_words(sbase + TILE * (KROW(KB) + VROW(VB)), sbase + TILE * (KROW(KB) + VROW(VB) + 4), pool, tp, t0, hi,
             sec.k_meta, sec.v_meta, lane);
}

// Tokens [lo, hi) of one section (lo < hi) into the split's state. qrow: member gi's query row (gi < group; zeros
// past it). With LOGITS, token t's logits go to logits0 / logits1 [logit_off + t]: the rows of this lane's
// C-fragment columns (members 2 t4, 2 t4 + 1; null past the group). LOGITS is a template argument, not a null
// check, so that a section whose logits nobody reads runs the loop of a kernel without them (with the stores
// compiled in but skipped, a low section cost ~8% more on an H100).
// F8: the section's 8-bit sides are e4m3 codes.
template <int KB, int VB, bool F8, bool LOGITS>
__device__ __forceinline__ void attend(State& st, const unsigned short* qrow, bool real, float qk_scale,
                                       const unsigned char* pool, const Section& sec, int lo, int hi,
                                       int page_bytes, unsigned char* smem, float* logits0, float* logits1,
                                       int logit_off, int lane) {
  const int gi = lane >> 2, t4 = lane & 3;
  // A section of e4m3 values sums real fp16 values; one of integer codes sums c * 2^-24. A split that goes from one
  // to the other (an e4m3 high section and an integer low one) brings its sums to the new unit.
  constexpr float UNIT = (F8 && VB == 8) ? 1.f : CODE_UNIT;
  if (st.unit != UNIT) {
    const float f = st.unit * (1.f / UNIT);
#pragma unroll
    for (int m = 0; m < 8; ++m) st.acc[m][0] *= f, st.acc[m][1] *= f, st.acc[m][2] *= f, st.acc[m][3] *= f;
    st.unit = UNIT;
  }
  // The first tiles' copies go out before the query's loads and preparation, which they overlap (lo < hi: the
  // first tile is unconditional, so that the compiler does not hoist the query's work above its branch).
  const int ntiles = (hi - lo + TILE - 1) / TILE;
  TileIds ids = tile_ids(sec, lo, hi);  // the pages of the next tile to copy
  constexpr int AHEAD = STAGES > 1 ? STAGES - 1 : 1;  // tiles copied before the loop
#pragma unroll
  for (int j = 0; j < AHEAD; ++j) {
    if (j == 0 || j < ntiles) {
      load_tile<KB, VB, F8>(smem + j * STAGE_BYTES, pool, sec, ids, lo + j * TILE, hi, page_bytes, lane);
      if (j + 1 < ntiles) ids = tile_ids(sec, lo + (j + 1) * TILE, hi);
    }
    cp_commit();
  }
  // This lane's 32 query elements in 16-byte loads (the launcher aligns q rows to 16 bytes): local element 8 j + i
  // of load j is dim 32 t4 + 8 j + i (e4m3 keys), 64 (j / 2) + 16 t4 + 8 (j % 2) + i (4-bit keys) or 32 j + 8 t4 + i
  // (2-bit keys: plane j of the lane's key bytes 8 t4 + i); 8-byte loads for integer 8-bit keys, which ldmatrix
  // hands out by 4-byte column. Those are the dims of the key codes this lane holds, so q's B fragments are built
  // from the lane's own elements.
  constexpr bool IK = !(F8 && KB == 8);
  u32 qw[16];
  if (IK && KB == 8) {  // integer 8-bit keys: local element 4 m + i is dim 32 (m / 2) + 16 (m % 2) + 4 t4 + i
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const U2 v = *(const U2*)(qrow + 32 * (m >> 1) + 16 * (m & 1) + 4 * t4);
      qw[2 * m] = v.x, qw[2 * m + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int dim0 = KB == 8 ? 32 * t4 + 8 * j : KB == 4 ? 64 * (j >> 1) + 16 * t4 + 8 * (j & 1) : 32 * j + 8 * t4;
      const U4 v = *(const U4*)(qrow + dim0);
      qw[4 * j] = v.x, qw[4 * j + 1] = v.y, qw[4 * j + 2] = v.z, qw[4 * j + 3] = v.w;
    }
  }
  float x[32], q0 = 0.f, amax = 0.f;  // q * qk_scale (log2 domain); q0: this lane's share of member gi's sum
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    x[i] = real ? q_elem((unsigned short)(qw[i >> 1] >> (16 * (i & 1)))) * qk_scale : 0.f;
    q0 += x[i];
    amax = fmaxf(amax, fabsf(x[i]));
  }
  // Integer keys: q.k runs on the integer tensor cores (m16n8k32, u8 codes x 8-bit q), exact, with no dequantizing
  // of codes into fp16 (8-bit keys go to the mma as loaded; 4- and 2-bit codes take a mask, and a shift for all but
  // the lowest field). q is integers Q at each member's own scale (one scale for the whole group lost the precision
  // of members 10^4 times smaller than another). Against 8-bit keys, Q has 16 bits (sq = max |q| / 32767: finer than
  // fp16's 11 bits), sent as two 8-bit parts, Q = 256 qh + ql (qh signed, ql unsigned): two mma chains per block,
  // joined as 256 acc_h + acc_l (|.| < 2^31). Against 4- and 2-bit keys, Q has 8 bits (sq = max |q| / 127): one
  // chain. There the keys' own rounding dwarfs q's (on Qwen2.5-Coder-1.5B's activations, as served, the total
  // attention-output error of 4-bit keys rises 0.03-0.45%: benchmarks/q_precision.py), and the second chain's mmas,
  // a quarter of an int4 tile's tensor-core work, cost clock where calls run at an H200's power cap: without it int4
  // and K4V2 at Llama-3-8B batch 128 x 16,384 ran 4.7-5.3% faster, smaller calls 1.8-5.3%. The zero points' term,
  // z * sum of q, takes the 8-bit q's sum, so that a logit is the dequantized key times that q (with q as given in
  // that term, q's rounding meets key - z instead of the key: 1.9x the error on those activations, 1.15x rotated).
  // Slab s's B fragment is local elements 8 s .. 8 s + 3 and 8 s + 4 .. 8 s + 7, for every key width. e4m3 keys
  // (F8) stay on the fp16 mma: qb, q as fp16, slice s of lane t4 takes dims 32 t4 + 4 s + {0, 1} (b01) and
  // + {2, 3} (b23).
  constexpr bool Q16 = IK && KB == 8;  // two chains (16-bit q), else one (8-bit q)
  constexpr float QMAX = Q16 ? 32767.f : 127.f;
  u32 qbh[4][2], qbl[4][2], qb[8][2];
  float sq[2] = {1.f, 1.f};  // the scales of members 2 t4, 2 t4 + 1 (the C fragment's columns)
  if (IK) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 1));  // member gi's lanes 4 gi .. 4 gi + 3
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, 2));
    const float rsq = amax > 0.f ? QMAX / amax : 0.f;
    const float own = amax > 0.f ? amax * (1.f / QMAX) : 1.f;
    sq[0] = __shfl_sync(0xffffffff, own, 8 * t4);
    sq[1] = __shfl_sync(0xffffffff, own, 8 * t4 + 4);
    int qsum = 0;  // 8-bit Q: this lane's share of the member's sum of Q
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        u32 qi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) qi[i] = (u32)__float2int_rn(x[8 * s + 4 * r + i] * rsq);
        // 16-bit Q: bytes 1 (qh) and 0 (ql) of each, four to a register; 8-bit Q: byte 0 (signed), in qbh
        if (Q16) {
          qbh[s][r] = prmt(prmt(qi[0], qi[1], 0x0051), prmt(qi[2], qi[3], 0x0051), 0x5410);
          qbl[s][r] = prmt(prmt(qi[0], qi[1], 0x0040), prmt(qi[2], qi[3], 0x0040), 0x5410);
        } else {
          qbh[s][r] = prmt(prmt(qi[0], qi[1], 0x0040), prmt(qi[2], qi[3], 0x0040), 0x5410);
          qsum += (int)qi[0] + (int)qi[1] + (int)qi[2] + (int)qi[3];
        }
      }
    }
    if (!Q16) q0 = own * (float)qsum;
  } else {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      qb[s][0] = pack_f16x2(x[4 * s], x[4 * s + 1]);
      qb[s][1] = pack_f16x2(x[4 * s + 2], x[4 * s + 3]);
    }
  }
  q0 += __shfl_xor_sync(0xffffffff, q0, 1);
  q0 += __shfl_xor_sync(0xffffffff, q0, 2);
  // The C fragment's columns are members 2 t4, 2 t4 + 1: their sums sit at lanes 8 t4 and 8 t4 + 4.
  float kq0[2];
  kq0[0] = __shfl_sync(0xffffffff, q0, 8 * t4);
  kq0[1] = __shfl_sync(0xffffffff, q0, 8 * t4 + 4);

  // integer 8-bit keys: ldmatrix.x4 of slab sl reads, for lane l, row (l % 8) + 8 ((l / 8) % 2) of a block, chunk
  // 2 sl + l / 16: matrices (rows 0-7 | 8-15) x (bytes 32 sl + 0-15 | 16-31), the A fragment's four registers
  int koff[4];
#pragma unroll
  for (int sl = 0; sl < 4; ++sl)
    koff[sl] = ((lane & 7) + 8 * ((lane >> 3) & 1)) * KROW(KB) + (((2 * sl + (lane >> 4)) ^ (lane & 7)) << 4);

  for (int j = 0; j < ntiles; ++j) {
    cp_wait<(STAGES > 1 ? STAGES - 2 : 0)>();
    __syncwarp();
    if (STAGES > 1) {
      const int jn = j + STAGES - 1;
      if (jn < ntiles) {
        load_tile<KB, VB, F8>(smem + (jn % STAGES) * STAGE_BYTES, pool, sec, ids, lo + jn * TILE, hi, page_bytes, lane);
        if (jn + 1 < ntiles) ids = tile_ids(sec, lo + (jn + 1) * TILE, hi);
      }
      cp_commit();
    }
    const unsigned char* buf = smem + (j % STAGES) * STAGE_BYTES;
    const unsigned char* kbuf = buf;
    const unsigned char* vbuf = buf + TILE * KROW(KB);
    const u32* kmeta = (const u32*)(buf + TILE * (KROW(KB) + VROW(VB)));
    const u32* vmeta = kmeta + TILE;
    const int t0 = lo + j * TILE;

    // logits s[blk][0..3]: C fragments (tokens gi / gi + 8 of block blk; members 2 t4, 2 t4 + 1)
    float s[4][4];
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      const u32 ma = kmeta[blk * 16 + gi], mc = kmeta[blk * 16 + gi + 8];
      const float sa = f16_lo(ma), za = f16_hi(ma), sc = f16_lo(mc), zc = f16_hi(mc);
      if (IK) {
        // A fragments of slab sl: rows gi / gi + 8 (a0, a2 / a1, a3), four codes of consecutive k each, the dims of
        // q's local elements 8 sl .. 8 sl + 7
        u32 A[4][4];
        if (KB == 8) {
          // the codes as stored: slab sl is dims 32 sl .. 32 sl + 31, straight into the A registers by ldmatrix
          const u32 kaddr = smem_addr(kbuf) + blk * 16 * KROW(KB);
#pragma unroll
          for (int sl = 0; sl < 4; ++sl) ldsm4(kaddr + koff[sl], A[sl][0], A[sl][1], A[sl][2], A[sl][3]);
        } else if (KB == 4) {
          // lane t4 holds key bytes 16 t4 .. 16 t4 + 15 of rows gi and gi + 8: low nibbles are dims 16 t4 + byte
          // (slabs 0, 1), high nibbles dims 64 + 16 t4 + byte (slabs 2, 3)
          const U4 ka = *(const U4*)(kbuf + (blk * 16 + gi) * KROW(KB) + 16 * t4);
          const U4 kc = *(const U4*)(kbuf + (blk * 16 + gi + 8) * KROW(KB) + 16 * t4);
          const u32 wa[4] = {ka.x, ka.y, ka.z, ka.w}, wc[4] = {kc.x, kc.y, kc.z, kc.w};
#pragma unroll
          for (int sl = 0; sl < 4; ++sl) {
            const int w = 2 * (sl & 1), sh = 4 * (sl >> 1);
            A[sl][0] = (wa[w] >> sh) & 0x0F0F0F0Fu, A[sl][1] = (wc[w] >> sh) & 0x0F0F0F0Fu;
            A[sl][2] = (wa[w + 1] >> sh) & 0x0F0F0F0Fu, A[sl][3] = (wc[w + 1] >> sh) & 0x0F0F0F0Fu;
          }
        } else {
          // 2-bit keys: lane t4 holds bytes 8 t4 .. 8 t4 + 7 of rows gi and gi + 8 (32-byte rows: a half-warp's
          // loads cover 128 contiguous bytes, conflict-free unswizzled); slab sl is plane sl, dims 32 sl + byte
          const U2 ka = *(const U2*)(kbuf + (blk * 16 + gi) * KROW(KB) + 8 * t4);
          const U2 kc = *(const U2*)(kbuf + (blk * 16 + gi + 8) * KROW(KB) + 8 * t4);
#pragma unroll
          for (int sl = 0; sl < 4; ++sl) {
            A[sl][0] = (ka.x >> (2 * sl)) & 0x03030303u, A[sl][1] = (kc.x >> (2 * sl)) & 0x03030303u;
            A[sl][2] = (ka.y >> (2 * sl)) & 0x03030303u, A[sl][3] = (kc.y >> (2 * sl)) & 0x03030303u;
          }
        }
        int ah[4] = {0, 0, 0, 0}, al[4] = {0, 0, 0, 0};
#pragma unroll
        for (int sl = 0; sl < 4; ++sl) {
          imma_s8(ah, A[sl][0], A[sl][1], A[sl][2], A[sl][3], qbh[sl][0], qbh[sl][1]);
          if (Q16) imma_u8(al, A[sl][0], A[sl][1], A[sl][2], A[sl][3], qbl[sl][0], qbl[sl][1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (Q16) ah[e] = (ah[e] << 8) + al[e];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[blk][e] = (sa * sq[e]) * (float)ah[e] + za * kq0[e];
          s[blk][2 + e] = (sc * sq[e]) * (float)ah[2 + e] + zc * kq0[e];
        }
      } else {
        // e4m3 keys: lane t4 holds chunks 2 t4, 2 t4 + 1 of a row (stored swapped on odd rows); cvt turns two codes
        // into two fp16
        s[blk][0] = s[blk][1] = s[blk][2] = s[blk][3] = 0.f;
        const int sw = gi & 1;
        const unsigned char* ra = kbuf + (blk * 16 + gi) * KROW(KB);
        const unsigned char* rc = ra + 8 * KROW(KB);
        const U4 ka0 = *(const U4*)(ra + 16 * (2 * t4 + sw)), ka1 = *(const U4*)(ra + 16 * (2 * t4 + 1 - sw));
        const U4 kc0 = *(const U4*)(rc + 16 * (2 * t4 + sw)), kc1 = *(const U4*)(rc + 16 * (2 * t4 + 1 - sw));
        const u32 wa[8] = {ka0.x, ka0.y, ka0.z, ka0.w, ka1.x, ka1.y, ka1.z, ka1.w};
        const u32 wc[8] = {kc0.x, kc0.y, kc0.z, kc0.w, kc1.x, kc1.y, kc1.z, kc1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
          mma(s[blk], e4m3x2_f16x2(wa[i]), e4m3x2_f16x2(wc[i]), e4m3x2_f16x2(wa[i] >> 16),
              e4m3x2_f16x2(wc[i] >> 16), qb[i][0], qb[i][1]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[blk][e] = sa * s[blk][e] + za * kq0[e];
          s[blk][2 + e] = sc * s[blk][2 + e] + zc * kq0[e];
        }
      }
      if (LOGITS) {
        const int ta = t0 + blk * 16 + gi, tc = ta + 8;
        if (ta < hi) {
          if (logits0) logits0[logit_off + ta] = s[blk][0] * LN2;
          if (logits1) logits1[logit_off + ta] = s[blk][1] * LN2;
        }
        if (tc < hi) {
          if (logits0) logits0[logit_off + tc] = s[blk][2] * LN2;
          if (logits1) logits1[logit_off + tc] = s[blk][3] * LN2;
        }
      }
    }
    // The last tile's rows past hi get no weight. A branch the warp takes together, once a section: checking every
    // token of every tile cost 32 of a K4V2 tile's ~1,000 instructions.
    if (t0 + TILE > hi) {
#pragma unroll
      for (int blk = 0; blk < 4; ++blk) {
        const int ta = t0 + blk * 16 + gi, tc = ta + 8;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (ta >= hi) s[blk][e] = __int_as_float(0xff800000);
          if (tc >= hi) s[blk][2 + e] = __int_as_float(0xff800000);
        }
      }
    }
    // online softmax per member (column): this lane's max over its 16 tokens of the tile
    float mx[2] = {st.m[0], st.m[1]};
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      mx[0] = fmaxf(mx[0], fmaxf(s[blk][0], s[blk][2]));
      mx[1] = fmaxf(mx[1], fmaxf(s[blk][1], s[blk][3]));
    }
    // value scales of this lane's tokens and the largest of them (p * scale / top <= 1 reaches the mma in fp16)
    float vs[4][2], vz[4][2], top = st.top;
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      const u32 ma = vmeta[blk * 16 + gi], mc = vmeta[blk * 16 + gi + 8];
      vs[blk][0] = f16_lo(ma);
      vz[blk][0] = f16_hi(ma);
      vs[blk][1] = f16_lo(mc);
      vz[blk][1] = f16_hi(mc);
      top = fmaxf(top, fmaxf(vs[blk][0], vs[blk][1]));
    }
    // The running sum is rescaled only in a tile where some lane sees a member's max or the top value scale grow:
    // a branch the warp takes together, which most tiles of a long sequence skip, and with it the reductions over
    // the warp (the codes carry no bias to cancel: nothing else touches acc outside the p.v chain).
    if (warp_any(mx[0] > st.m[0] || mx[1] > st.m[1] || top > st.top)) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {  // over the lanes of a column (members 2 t4, 2 t4 + 1)
        mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffff, mx[0], o));
        mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffff, mx[1], o));
      }
      top = __uint_as_float(warp_max(__float_as_uint(top)));  // scales are >= 0: their bits order as integers do
      const float r = top > 0.f ? st.top * rcp(top) : 0.f;  // (top 0: no scale yet, acc is 0)
      float rescale[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float alpha = ex2(st.m[e] - mx[e]);
        rescale[e] = alpha * r;
        st.m[e] = mx[e];
        st.l[e] *= alpha;
        st.z[e] *= alpha;
      }
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        st.acc[m][0] *= rescale[0];
        st.acc[m][1] *= rescale[1];
        st.acc[m][2] *= rescale[0];
        st.acc[m][3] *= rescale[1];
      }
      st.top = top;
    }
    const float rtop = st.top > 0.f ? rcp(st.top) : 0.f;
    // p, and p' = p * scale / top in fp16 as the C fragments of P^T (token gi / gi + 8, members 2 t4, 2 t4 + 1),
    // transposed into the B operands of p.v (k: tokens 2 t4, 2 t4 + 1 / + 8, n: member gi)
    u32 pb[4][2];
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      const float ws[2] = {vs[blk][0] * rtop, vs[blk][1] * rtop};
      float pw[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int me = e & 1, tk = e >> 1;  // member 2 t4 + me, token gi + 8 tk
        const float p = ex2(s[blk][e] - st.m[me]);
        st.l[me] += p;
        st.z[me] += p * vz[blk][tk];
        pw[e] = p * ws[tk];
      }
      pb[blk][0] = movtrans(pack_f16x2(pw[0], pw[1]));
      pb[blk][1] = movtrans(pack_f16x2(pw[2], pw[3]));
    }
    // Lanes gi >= 4 read the odd token of each pair first (bank-conflict-free); the prmt selectors undo it.
    const int odd = gi >> 2;
    const u32 sel_lo = odd ? 0x1054 : 0x5410, sel_hi = odd ? 0x3276 : 0x7632;
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      const u32 pb0 = pb[blk][0], pb1 = pb[blk][1];
      // V^T as the A operand: word gi (and, 4-bit, word gi + 8) of tokens 2 t4, 2 t4 + 1 (a01 / a23) and 2 t4 + 8,
      // 2 t4 + 9 (a45 / a67), their bytes interleaved by token so every 16-bit half is one token's code of one dim.
      const int ta = blk * 16 + 2 * t4 + odd, tb = blk * 16 + 2 * t4 + 1 - odd;  // tile rows read first / second
      if (VB == 8) {
        // 8-bit: word 8 w + gi of a row is plane w (dims 32 w + 4 gi + byte); a prmt takes byte mb of two tokens
        // and a mask leaves each in the low byte of an fp16 half (integer codes), or cvt converts them (e4m3).
        u32 x[4][4];  // [plane][token: first, second of the pair, + 8]
        const int swa = 2 * ((ta >> 1) & 3), swb = 2 * ((tb >> 1) & 3);  // tokens + 8 share them
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const unsigned char* va = vbuf + ta * VROW(VB) + 16 * ((2 * w + odd) ^ swa) + 4 * (gi & 3);
          const unsigned char* vb = vbuf + tb * VROW(VB) + 16 * ((2 * w + odd) ^ swb) + 4 * (gi & 3);
          x[w][0] = *(const u32*)va;
          x[w][1] = *(const u32*)vb;
          x[w][2] = *(const u32*)(va + 8 * VROW(VB));
          x[w][3] = *(const u32*)(vb + 8 * VROW(VB));
        }
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          const u32 sel = odd ? (4 + mb) | (mb << 8) : mb | ((4 + mb) << 8);  // half 0: token 2 t4
          const u32 sel8 = odd ? (4 + mb) | (mb << 4) : mb | ((4 + mb) << 4);  // e4m3: the two codes side by side
#pragma unroll
          for (int ph = 0; ph < 2; ++ph) {
            if (F8) {
              mma(st.acc[2 * mb + ph], e4m3x2_f16x2(prmt(x[2 * ph][0], x[2 * ph][1], sel8)),
                  e4m3x2_f16x2(prmt(x[2 * ph + 1][0], x[2 * ph + 1][1], sel8)),
                  e4m3x2_f16x2(prmt(x[2 * ph][2], x[2 * ph][3], sel8)),
                  e4m3x2_f16x2(prmt(x[2 * ph + 1][2], x[2 * ph + 1][3], sel8)), pb0, pb1);
            } else {
              mma(st.acc[2 * mb + ph], prmt(x[2 * ph][0], x[2 * ph][1], sel) & 0x00FF00FFu,
                  prmt(x[2 * ph + 1][0], x[2 * ph + 1][1], sel) & 0x00FF00FFu,
                  prmt(x[2 * ph][2], x[2 * ph][3], sel) & 0x00FF00FFu,
                  prmt(x[2 * ph + 1][2], x[2 * ph + 1][3], sel) & 0x00FF00FFu, pb0, pb1);
            }
          }
        }
      } else {
        u32 y[2][2][2];  // [word: gi / gi + 8][byte pair: bytes 0,1 / 2,3][token pair: (0,1) / (8,9)]
#pragma unroll
        for (int w = 0; w < (VB == 4 ? 2 : 1); ++w) {
          const int chunk = 2 * w + odd;  // word gi + 8 w sits in 16-byte chunk (gi + 8 w) / 4
          u32 x[4];
          // tokens ta + 8 / tb + 8 share the swizzle of ta / tb
          const int swa = VB == 4 ? (ta >> 1) & 3 : (ta >> 2) & 1, swb = VB == 4 ? (tb >> 1) & 3 : (tb >> 2) & 1;
          const unsigned char* va = vbuf + ta * VROW(VB) + 16 * (chunk ^ swa) + 4 * (gi & 3);
          const unsigned char* vb = vbuf + tb * VROW(VB) + 16 * (chunk ^ swb) + 4 * (gi & 3);
          x[0] = *(const u32*)va;
          x[1] = *(const u32*)vb;
          x[2] = *(const u32*)(va + 8 * VROW(VB));
          x[3] = *(const u32*)(vb + 8 * VROW(VB));
          y[w][0][0] = prmt(x[0], x[1], sel_lo);
          y[w][1][0] = prmt(x[0], x[1], sel_hi);
          y[w][0][1] = prmt(x[2], x[3], sel_lo);
          y[w][1][1] = prmt(x[2], x[3], sel_hi);
        }
        // M tile 2 mb + ph: byte mb of the word; rows gi hold plane 2 ph, rows gi + 8 plane 2 ph + 1, as
        // c * 4^plane (in units of 2^-24). 2-bit: planes 2 ph, 2 ph + 1 are bits 4 ph and 4 ph + 2 of the byte. 4-bit: plane 2 ph is
        // word gi's nibble ph, plane 2 ph + 1 word gi + 8's nibble ph, shifted up by 2 bits for the factor 4.
#pragma unroll
        for (int mb = 0; mb < 4; ++mb) {
          const u32 ya = (mb & 1) ? y[0][mb >> 1][0] >> 8 : y[0][mb >> 1][0];
          const u32 yc = (mb & 1) ? y[0][mb >> 1][1] >> 8 : y[0][mb >> 1][1];
#pragma unroll
          for (int ph = 0; ph < 2; ++ph) {
            if (VB == 2) {
              const u32 m0 = 0x00030003u << (4 * ph), m1 = 0x000C000Cu << (4 * ph);
              mma(st.acc[2 * mb + ph], ya & m0, ya & m1, yc & m0, yc & m1, pb0, pb1);
            } else {
              const u32 ya8 = ((mb & 1) ? y[1][mb >> 1][0] >> 8 : y[1][mb >> 1][0]) << 2;
              const u32 yc8 = ((mb & 1) ? y[1][mb >> 1][1] >> 8 : y[1][mb >> 1][1]) << 2;
              const u32 m0 = 0x000F000Fu << (4 * ph), m1 = 0x003C003Cu << (4 * ph);
              mma(st.acc[2 * mb + ph], ya & m0, ya8 & m1, yc & m0, yc8 & m1, pb0, pb1);
            }
          }
        }
      }
    }
    if (STAGES == 1) {  // one buffer: the next tile's copy waits for this tile's last read
      __syncwarp();
      if (j + 1 < ntiles) {
        load_tile<KB, VB, F8>(smem, pool, sec, ids, lo + (j + 1) * TILE, hi, page_bytes, lane);
        if (j + 2 < ntiles) ids = tile_ids(sec, lo + (j + 2) * TILE, hi);
      }
      cp_commit();
    }
  }
  cp_wait<0>();
  __syncwarp();  // the next section's prologue reuses the stage buffers
}

extern "C" __global__ void __launch_bounds__(32, MINB) decode_mma(
    const unsigned short* __restrict__ q, const unsigned char* __restrict__ pool, const int* __restrict__ page_table,
    const int* __restrict__ len_hi, const int* __restrict__ len_lo, const int* __restrict__ slots,
    unsigned short* __restrict__ out, float* __restrict__ mid_acc, float* __restrict__ mid_ml,
    float* __restrict__ logits, float* __restrict__ lse, int write_lse, const float* __restrict__ low_alpha,
    int gate_low, int stride_qb, int stride_qh, int stride_ob,
    int stride_oh, int stride_pts, int stride_ptl, int stride_pth, int P, int stride_ls, int stride_ll,
    int stride_lh, int stride_ms, int stride_ml, int stride_mh, int stride_gb, int stride_gh, int stride_eb,
    int stride_eh, int layer, double qk_scale_d, int Hq, int group, int num_splits, int page_bytes, int T_hi,
    int k_off_hi, int k_meta_hi, int v_off_hi, int v_meta_hi, int T_lo, int k_off_lo, int k_meta_lo,
    int v_off_lo, int v_meta_lo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // the split merge (merge.py) is launched as a programmatic dependent: its programs may start once every program
  // of this grid has (and wait in gdc_wait for this grid's results)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const float qk_scale = (float)qk_scale_d;
  DYNAMIC_SMEM(smem);
  const int lane = threadIdx.x, gi = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const long long slot = slots[b];  // strides are int: int64 products below
  const int n_hi = len_hi[slot * stride_ls + (long long)layer * stride_ll + (long long)h * stride_lh];
  const int n_lo = KB_LO ? len_lo[slot * stride_ms + (long long)layer * stride_ml + (long long)h * stride_mh] : 0;
  const int* pt_row = page_table + slot * stride_pts + (long long)layer * stride_ptl + (long long)h * stride_pth;
  // This split's run of tiles over [high tiles; low tiles].
  const int tiles_hi = (n_hi + TILE - 1) / TILE, tiles = tiles_hi + (n_lo + TILE - 1) / TILE;
  const int per_split = (tiles + num_splits - 1) / num_splits;
  const int ta = split * per_split, tb = min(ta + per_split, tiles);

  const bool real = gi < group;
  const unsigned short* qrow = q + (long long)b * stride_qb + (long long)(h * group + (real ? gi : 0)) * stride_qh;
  float* lg0 = nullptr;
  float* lg1 = nullptr;
#if WRITE_LOGITS
  float* const lg = logits + (long long)b * stride_gb + (long long)h * group * stride_gh;  // member 0's row
  if (2 * t4 < group) lg0 = lg + 2 * t4 * (long long)stride_gh;
  if (2 * t4 + 1 < group) lg1 = lg + (2 * t4 + 1) * (long long)stride_gh;
#endif
  State st;
#pragma unroll
  for (int m = 0; m < 8; ++m) st.acc[m][0] = st.acc[m][1] = st.acc[m][2] = st.acc[m][3] = 0.f;
  st.m[0] = st.m[1] = -1.0e30f;
  st.l[0] = st.l[1] = st.z[0] = st.z[1] = 0.f;
  st.top = 0.f;
  st.unit = (F8_HI && VB_HI == 8) ? 1.f : CODE_UNIT;

  if (ta < tiles_hi) {
    const Section sec = {pt_row, 1, T_hi, k_off_hi, k_meta_hi, v_off_hi, v_meta_hi, per_page_of(T_hi)};
    attend<KB_HI, VB_HI, F8_HI, WRITE_LOGITS>(st, qrow, real, qk_scale, pool, sec, ta * TILE, min(tb * TILE, n_hi),
                                             page_bytes, smem, lg0, lg1, 0, lane);
  }
#if KB_LO
  if (tb > tiles_hi && ta < tb) {  // (an empty split past the last tile has ta >= tb)
    const Section sec = {pt_row + (P - 1), -1, T_lo, k_off_lo, k_meta_lo, v_off_lo, v_meta_lo, per_page_of(T_lo)};
    const int la = ta > tiles_hi ? ta - tiles_hi : 0;
    // gate_low: a slot decoding at alpha_low 0 never reads its low tokens' scores (score_update skips them), so
    // their logits are not written.
    const int lb = min((tb - tiles_hi) * TILE, n_lo);
    if (WRITE_LOGITS && (!gate_low || low_alpha[slot] > 0.f))
      attend<KB_LO, VB_LO, false, true>(st, qrow, real, qk_scale, pool, sec, la * TILE, lb, page_bytes, smem, lg0, lg1,
                                        n_hi, lane);
    else
      attend<KB_LO, VB_LO, false, false>(st, qrow, real, qk_scale, pool, sec, la * TILE, lb, page_bytes, smem, nullptr,
                                         nullptr, n_hi, lane);
  }
#endif

  // members' sums over all tokens: each lane summed its own rows (tokens gi, gi + 8)
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      st.l[e] += __shfl_xor_sync(0xffffffff, st.l[e], o);
      st.z[e] += __shfl_xor_sync(0xffffffff, st.z[e], o);
    }
  }
  // acc[m][c]: dim row gi (c 0, 1) / gi + 8 (c 2, 3) of M tile m = byte 4 gi + (m >> 1), plane 2 (m & 1) (+1);
  // member 2 t4 + (c & 1). Value = 4^-plane * top * acc + z.
  const bool single = num_splits == 1;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int me = 2 * t4 + (c & 1);
    if (me >= group) continue;
    const int hq = h * group + me;
    const float l = st.l[c & 1];
    const float inv = single ? (l > 0.f ? 1.f / l : 0.f) : 1.f;
    const long long mid = ((long long)(b * Hq + hq) * num_splits + split);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int plane = 2 * (m & 1) + (c >> 1);
      const int dim = 32 * plane + 4 * gi + (m >> 1);
      const float f = VB_HI == 8 ? 1.f : 1.f / (float)(1 << (2 * plane));  // codes' factor 4^plane (2/4-bit)
      const float v = (st.acc[m][c] * (st.top * st.unit) * f + st.z[c & 1]) * inv;
      if (single) {
        out[(long long)b * stride_ob + (long long)hq * stride_oh + dim] = out_elem(v);
      } else {
        mid_acc[mid * D + dim] = v;
      }
    }
    if (gi == 0 && c < 2) {
      if (!single) {
        mid_ml[mid * 2] = st.m[c];
        mid_ml[mid * 2 + 1] = l;
      } else if (write_lse) {  // natural-log log-sum-exp; -inf without tokens
        lse[(long long)b * stride_eb + (long long)hq * stride_eh] =
            l > 0.f ? (st.m[c] + lg2(l)) * LN2 : __int_as_float(0xff800000);
      }
    }
  }
}
