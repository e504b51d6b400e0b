// Decode attention over K4V2 pages (4-bit planar keys, 2-bit planar values, fp16 scale / zero per token; layout in
// kernels/page_layout.py and kernels/quant.py), head_dim 128, a GQA group of up to 8 query heads, one warp per
// (batch entry, KV head, split). kernels/decode_attention/k4v2_cuda.py compiles it (NVRTC) and launches it; its
// reference is kernels/decode_attention/reference.py.
//
// Why CUDA and not Triton: Triton puts the query group on the mma's M side (padded to 16 rows) and takes packed codes
// to the value dot through a shared-memory transpose read byte by byte. Here tokens are the M side of q.k (m16n8k16:
// 16 tokens x 8 query heads, no padding up to a group of 8), the logits' C fragments become p.v's B operand by one
// movmatrix, and packed codes become A fragments in registers: a lop3 turns two codes into fp16 1024 + c * 2^s, a
// prmt interleaves two tokens' value bytes. The codes' bias of 1024 cancels inside each mma chain, which starts from
// -1024 * (the sum it multiplies): the tensor cores' fp32 adds truncate, so a large running bias would cost digits.
//
// Compile-time settings (defined by the launcher): STAGES (cp.async tiles in flight), Q_BF16 (q / out are bf16).
typedef unsigned int u32;
typedef unsigned long long u64;
struct __attribute__((aligned(16))) U4 { u32 x, y, z, w; };

#ifndef STAGES
#define STAGES 2
#endif
#ifndef Q_BF16
#define Q_BF16 0
#endif
#define TILE 64
#define D 128
#define KROW 64   // key bytes per token (4-bit x 128)
#define VROW 32   // value bytes per token (2-bit x 128)
#define STAGE_BYTES (TILE * KROW + TILE * VROW + TILE * 4 + TILE * 4)

__device__ __forceinline__ u32 lop_or(u32 a, u32 mask, u32 c) {  // (a & mask) | c
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(c));
  return d;
}
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
__device__ __forceinline__ float q_elem(unsigned short x) {  // one element of q (fp16 or bf16) as float
#if Q_BF16
  return __uint_as_float(((u32)x) << 16);
#else
  return f16_lo(x);
#endif
}
__device__ __forceinline__ unsigned short out_elem(float v) {
#if Q_BF16
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
#else
  return (unsigned short)(pack_f16x2(v, 0.f) & 0xffff);
#endif
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
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
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// The tile of tokens [t0, t0 + TILE) of a section into stage buffer `buf` (rows past hi are zero-filled).
// A tile spans at most two pages (T >= TILE, checked by the launcher).
__device__ __forceinline__ void load_tile(unsigned char* buf, const unsigned char* pool, const int* pt_row, int t0,
                                          int hi, int T, int page_bytes, int k_off, int k_meta, int v_off,
                                          int v_meta, int lane) {
  int p0 = t0 / T;
  int bound = (p0 + 1) * T;
  long long pg0 = (long long)pt_row[p0] * page_bytes;
  long long pg1 = bound < hi ? (long long)pt_row[p0 + 1] * page_bytes : pg0;
  int row0 = t0 - p0 * T;  // row of token t0 in page p0; tokens past bound continue at row (t - bound) of p1
  u32 sbase = smem_addr(buf);
#pragma unroll
  for (int it = 0; it < TILE * KROW / 16 / 32; ++it) {  // keys: 16-byte chunks
    int i = it * 32 + lane, tok = i >> 2, part = i & 3, t = t0 + tok;
    bool second = t >= bound;
    long long src = (second ? pg1 + (long long)(t - bound) * KROW : pg0 + (long long)(row0 + tok) * KROW) + k_off + part * 16;
    cp16(sbase + tok * KROW + part * 16, pool + (t < hi ? src : 0), t < hi);
  }
#pragma unroll
  for (int it = 0; it < TILE * VROW / 16 / 32; ++it) {  // values
    int i = it * 32 + lane, tok = i >> 1, part = i & 1, t = t0 + tok;
    bool second = t >= bound;
    long long src = (second ? pg1 + (long long)(t - bound) * VROW : pg0 + (long long)(row0 + tok) * VROW) + v_off + part * 16;
    cp16(sbase + TILE * KROW + tok * VROW + part * 16, pool + (t < hi ? src : 0), t < hi);
  }
#pragma unroll
  for (int it = 0; it < TILE / 32; ++it) {  // (scale, zero) words of keys and values
    int tok = it * 32 + lane, t = t0 + tok;
    bool second = t >= bound;
    long long r = second ? pg1 + (long long)(t - bound) * 4 : pg0 + (long long)(row0 + tok) * 4;
    cp4(sbase + TILE * (KROW + VROW) + tok * 4, pool + (t < hi ? r + k_meta : 0), t < hi);
    cp4(sbase + TILE * (KROW + VROW + 4) + tok * 4, pool + (t < hi ? r + v_meta : 0), t < hi);
  }
}

#ifndef MINB
#define MINB 1
#endif
extern "C" __global__ void __launch_bounds__(32, MINB) decode_k4v2(
    const unsigned short* __restrict__ q, const unsigned char* __restrict__ pool, const int* __restrict__ page_table,
    const int* __restrict__ lengths, const int* __restrict__ slots, unsigned short* __restrict__ out,
    float* __restrict__ mid_acc, float* __restrict__ mid_ml, int stride_qb, int stride_qh, int stride_ob,
    int stride_oh, int stride_pts, int stride_ptl, int stride_pth, int stride_ls, int stride_ll, int stride_lh,
    int layer, double qk_scale_d, int Hq, int group, int num_splits, int T, int page_bytes, int k_off, int k_meta,
    int v_off, int v_meta) {
  const float qk_scale = (float)qk_scale_d;
  extern __shared__ __attribute__((aligned(16))) unsigned char smem[];
  const int lane = threadIdx.x, gi = lane >> 2, t4 = lane & 3;
  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const long long slot = slots[b];  // strides are int: int64 products below
  const int length = lengths[slot * stride_ls + (long long)layer * stride_ll + (long long)h * stride_lh];
  const int* pt_row = page_table + slot * stride_pts + (long long)layer * stride_ptl + (long long)h * stride_pth;
  const int per_split = ((length + TILE - 1) / TILE + num_splits - 1) / num_splits * TILE;
  const int lo = split * per_split, hi = length < lo + per_split ? length : lo + per_split;

  // q as the B operand of q.k (k rows: dims, n: group member gi), scaled to the log2 domain and by 16^-plane for
  // high-nibble dims. Slice s of lane t4: codes e of k-rows 2 t4 + e / 2 t4 + 8 + e are key byte
  // 16 t4 + 4 (s >> 1) + (s & 1) + 2 e, low nibble (b01) / high nibble (b23): dims byte and 64 + byte.
  u32 qb[8][2];
  float q1 = 0.f, q0 = 0.f;  // this lane's share of sum(fp16 q') and of sum(q * qk_scale) for member gi
  {
    const bool real = gi < group;
    const unsigned short* qrow = q + (long long)b * stride_qb + (long long)(h * group + (real ? gi : 0)) * stride_qh;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          int k = 16 * t4 + 4 * (s >> 1) + (s & 1) + 2 * e;
          float x = real ? q_elem(qrow[64 * r + k]) * qk_scale : 0.f;
          q0 += x;
          v[e] = r ? x * 0.0625f : x;
        }
        u32 p = pack_f16x2(v[0], v[1]);
        q1 += f16_lo(p) + f16_hi(p);
        qb[s][r] = p;
      }
    }
    q1 += __shfl_xor_sync(0xffffffff, q1, 1);
    q1 += __shfl_xor_sync(0xffffffff, q1, 2);
    q0 += __shfl_xor_sync(0xffffffff, q0, 1);
    q0 += __shfl_xor_sync(0xffffffff, q0, 2);
  }
  // The C fragment's columns are members 2 t4, 2 t4 + 1: their sums sit at lanes 8 t4 and 8 t4 + 4.
  float kb[2], kq0[2];
  kb[0] = 1024.f * __shfl_sync(0xffffffff, q1, 8 * t4);
  kb[1] = 1024.f * __shfl_sync(0xffffffff, q1, 8 * t4 + 4);
  kq0[0] = __shfl_sync(0xffffffff, q0, 8 * t4);
  kq0[1] = __shfl_sync(0xffffffff, q0, 8 * t4 + 4);

  float acc[8][4];  // out^T [dims x members] per 16-dim M tile, in units of the current tile's top value scale
#pragma unroll
  for (int m = 0; m < 8; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
  float m_i[2] = {-1.0e30f, -1.0e30f}, l_i[2] = {0.f, 0.f}, z_i[2] = {0.f, 0.f};
  float top_prev = 1.f;

  const int ntiles = hi > lo ? (hi - lo + TILE - 1) / TILE : 0;
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (j < ntiles) load_tile(smem + j * STAGE_BYTES, pool, pt_row, lo + j * TILE, hi, T, page_bytes, k_off, k_meta,
                              v_off, v_meta, lane);
    cp_commit();
  }
  for (int j = 0; j < ntiles; ++j) {
    cp_wait<STAGES - 2>();
    __syncwarp();
    {
      int jn = j + STAGES - 1;
      if (jn < ntiles) load_tile(smem + (jn % STAGES) * STAGE_BYTES, pool, pt_row, lo + jn * TILE, hi, T, page_bytes,
                                 k_off, k_meta, v_off, v_meta, lane);
      cp_commit();
    }
    const unsigned char* buf = smem + (j % STAGES) * STAGE_BYTES;
    const unsigned char* kbuf = buf;
    const unsigned char* vbuf = buf + TILE * KROW;
    const u32* kmeta = (const u32*)(buf + TILE * (KROW + VROW));
    const u32* vmeta = kmeta + TILE;
    const int t0 = lo + j * TILE;

    // logits s[blk][0..3]: C fragments (tokens gi / gi + 8 of block blk; members 2 t4, 2 t4 + 1)
    float s[4][4];
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      s[blk][0] = s[blk][2] = -kb[0];  // the codes' bias cancels inside the mma chain (its fp32 adds truncate)
      s[blk][1] = s[blk][3] = -kb[1];
      const U4 ka = *(const U4*)(kbuf + (blk * 16 + gi) * KROW + 16 * t4);
      const U4 kc = *(const U4*)(kbuf + (blk * 16 + gi + 8) * KROW + 16 * t4);
      const u32 wa[4] = {ka.x, ka.y, ka.z, ka.w}, wc[4] = {kc.x, kc.y, kc.z, kc.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // word i: slice 2i takes bytes 0/2 (low, high nibble), slice 2i + 1 bytes 1/3
        u32 a_lo = lop_or(wa[i], 0x000F000F, 0x64006400), a_hi = lop_or(wa[i], 0x00F000F0, 0x64006400);
        u32 c_lo = lop_or(wc[i], 0x000F000F, 0x64006400), c_hi = lop_or(wc[i], 0x00F000F0, 0x64006400);
        mma(s[blk], a_lo, c_lo, a_hi, c_hi, qb[2 * i][0], qb[2 * i][1]);
        u32 wa8 = wa[i] >> 8, wc8 = wc[i] >> 8;
        a_lo = lop_or(wa8, 0x000F000F, 0x64006400);
        a_hi = lop_or(wa8, 0x00F000F0, 0x64006400);
        c_lo = lop_or(wc8, 0x000F000F, 0x64006400);
        c_hi = lop_or(wc8, 0x00F000F0, 0x64006400);
        mma(s[blk], a_lo, c_lo, a_hi, c_hi, qb[2 * i + 1][0], qb[2 * i + 1][1]);
      }
      const u32 ma = kmeta[blk * 16 + gi], mc = kmeta[blk * 16 + gi + 8];
      const float sa = f16_lo(ma), za = f16_hi(ma), sc = f16_lo(mc), zc = f16_hi(mc);
      const int ta = t0 + blk * 16 + gi, tc = ta + 8;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[blk][e] = ta < hi ? sa * s[blk][e] + za * kq0[e] : __int_as_float(0xff800000);
        s[blk][2 + e] = tc < hi ? sc * s[blk][2 + e] + zc * kq0[e] : __int_as_float(0xff800000);
      }
    }
    // online softmax per member (column): the tile's max over its 64 tokens
    float mx[2] = {m_i[0], m_i[1]};
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      mx[0] = fmaxf(mx[0], fmaxf(s[blk][0], s[blk][2]));
      mx[1] = fmaxf(mx[1], fmaxf(s[blk][1], s[blk][3]));
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffff, mx[0], o));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffff, mx[1], o));
    }
    // value scales of this lane's tokens and the tile's top one (p * scale / top reaches the mma in fp16)
    float vs[4][2], vz[4][2], top = 0.f;
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      const u32 ma = vmeta[blk * 16 + gi], mc = vmeta[blk * 16 + gi + 8];
      vs[blk][0] = f16_lo(ma);
      vz[blk][0] = f16_hi(ma);
      vs[blk][1] = f16_lo(mc);
      vz[blk][1] = f16_hi(mc);
      top = fmaxf(top, fmaxf(vs[blk][0], vs[blk][1]));
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
    top = top > 0.f ? top : 1.f;
    const float rtop = 1.f / top;
    float alpha[2], rescale[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      alpha[e] = ex2(m_i[e] - mx[e]);
      rescale[e] = alpha[e] * top_prev * rtop;  // acc is kept in units of the tile's top scale
      m_i[e] = mx[e];
      l_i[e] *= alpha[e];
      z_i[e] *= alpha[e];
    }
    top_prev = top;
    // p, and p * scale / top in fp16 as the C fragments of P^T (token gi / gi + 8, members 2 t4, 2 t4 + 1)
    u32 pa[4], pc[4];
    float wt[2] = {0.f, 0.f};
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      float pw[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int me = e & 1, tk = e >> 1;  // member 2 t4 + me, token gi + 8 tk
        const float p = ex2(s[blk][e] - m_i[me]);
        l_i[me] += p;
        z_i[me] += p * vz[blk][tk];
        pw[e] = p * vs[blk][tk] * rtop;
      }
      pa[blk] = pack_f16x2(pw[0], pw[1]);
      pc[blk] = pack_f16x2(pw[2], pw[3]);
      wt[0] += f16_lo(pa[blk]) + f16_lo(pc[blk]);
      wt[1] += f16_hi(pa[blk]) + f16_hi(pc[blk]);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
      wt[0] += __shfl_xor_sync(0xffffffff, wt[0], o);
      wt[1] += __shfl_xor_sync(0xffffffff, wt[1], o);
    }
    // The tile's p.v starts from -1024 * sum(p') so the codes' bias cancels inside the mma chain.
    float tacc[8][4];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      tacc[m][0] = tacc[m][2] = -1024.f * wt[0];
      tacc[m][1] = tacc[m][3] = -1024.f * wt[1];
    }
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {
      // P^T as the B operand (k: tokens 2 t4, 2 t4 + 1 / + 8, n: member gi): the C fragments transposed
      const u32 pb0 = movtrans(pa[blk]), pb1 = movtrans(pc[blk]);
      // V^T as the A operand: word gi of tokens 2 t4, 2 t4 + 1 (a01 / a23) and 2 t4 + 8, 2 t4 + 9 (a45 / a67),
      // their bytes interleaved by token so every 16-bit half is one token's code of one dim.
      const unsigned char* vb = vbuf + blk * 16 * VROW + 4 * gi;
      const u32 x0 = *(const u32*)(vb + (2 * t4) * VROW), x1 = *(const u32*)(vb + (2 * t4 + 1) * VROW);
      const u32 x8 = *(const u32*)(vb + (2 * t4 + 8) * VROW), x9 = *(const u32*)(vb + (2 * t4 + 9) * VROW);
      u32 y[2][2];  // [byte pair: bytes 0,1 / 2,3][token pair: (0,1) / (8,9)]
      y[0][0] = prmt(x0, x1, 0x5410);
      y[1][0] = prmt(x0, x1, 0x7632);
      y[0][1] = prmt(x8, x9, 0x5410);
      y[1][1] = prmt(x8, x9, 0x7632);
      // M tile 2 mb + ph: byte mb of the word, planes 2 ph (rows gi) and 2 ph + 1 (rows gi + 8)
#pragma unroll
      for (int mb = 0; mb < 4; ++mb) {
        const u32 ya = (mb & 1) ? y[mb >> 1][0] >> 8 : y[mb >> 1][0];
        const u32 yc = (mb & 1) ? y[mb >> 1][1] >> 8 : y[mb >> 1][1];
#pragma unroll
        for (int ph = 0; ph < 2; ++ph) {
          const u32 m0 = 0x00030003u << (4 * ph), m1 = 0x000C000Cu << (4 * ph);
          mma(tacc[2 * mb + ph], lop_or(ya, m0, 0x64006400), lop_or(ya, m1, 0x64006400),
              lop_or(yc, m0, 0x64006400), lop_or(yc, m1, 0x64006400), pb0, pb1);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      acc[m][0] = acc[m][0] * rescale[0] + tacc[m][0];
      acc[m][1] = acc[m][1] * rescale[1] + tacc[m][1];
      acc[m][2] = acc[m][2] * rescale[0] + tacc[m][2];
      acc[m][3] = acc[m][3] * rescale[1] + tacc[m][3];
    }
  }
  cp_wait<0>();

  // members' sums over all tokens: each lane summed its own rows (tokens gi, gi + 8)
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l_i[e] += __shfl_xor_sync(0xffffffff, l_i[e], o);
      z_i[e] += __shfl_xor_sync(0xffffffff, z_i[e], o);
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
    const float inv = single ? (l_i[c & 1] > 0.f ? 1.f / l_i[c & 1] : 0.f) : 1.f;
    const long long mid = ((long long)(b * Hq + hq) * num_splits + split);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int plane = 2 * (m & 1) + (c >> 1);
      const int dim = 32 * plane + 4 * gi + (m >> 1);
      const float v = (acc[m][c] * top_prev * (1.f / (float)(1 << (2 * plane))) +
                       z_i[c & 1]) * inv;
      if (single) {
        out[(long long)b * stride_ob + (long long)hq * stride_oh + dim] = out_elem(v);
      } else {
        mid_acc[mid * D + dim] = v;
      }
    }
    if (!single && gi == 0) {
      mid_ml[mid * 2] = m_i[c & 1];
      mid_ml[mid * 2 + 1] = l_i[c & 1];
    }
  }
}
