// A CPU emulation of one-warp CUDA programs, for testing the hand-written decode kernel (and the like) without a
// GPU: g++ -DDIFFKV_WARP_EMU -include warp_emu.h compiles the .cu as C++, and emu_grid runs its blocks one after
// another, each as 32 lanes on ucontext stacks. A lane runs until it reaches a warp-collective operation (mma,
// integer mma, ldmatrix, movmatrix, shuffles, __syncwarp), then the next lane runs; once all 32 wait at the same operation, it is done for
// the whole warp with the PTX fragment layouts, and the lanes go on. cp.async copies at once (a __syncwarp orders
// them, as on the GPU); mma accumulates in fp32 in the PTX order of k (the tensor cores' truncating adds are not
// modelled, so the emulation is a little more exact than the hardware).
#pragma once
#include <ucontext.h>

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__

struct EmuDim3 {
  int x, y, z;
};
static EmuDim3 blockIdx, threadIdx;
static unsigned char* emu_smem_base = nullptr;
#define DYNAMIC_SMEM(name) unsigned char* name = emu_smem_base

namespace emu {
typedef unsigned int u32;
enum Op { RUN, SHFL, SYNC, MMA, IMMA, MOVT, LDSM, DONE };
struct Slot {
  Op op;
  float f;
  int src;
  u32 a[4], b[2];
  float c[4];
  int ci[4];
  bool b_signed;  // IMMA: B's bytes are s8 (else u8)
  u32 m;
};
static Slot slots[32];
static ucontext_t main_ctx, lane_ctx[32];
static int cur = 0;
static std::function<void()> body;

static inline void fail(const char* why) {
  std::fprintf(stderr, "warp_emu: %s (block %d %d %d)\n", why, blockIdx.x, blockIdx.y, blockIdx.z);
  std::abort();
}
static inline void wait_for_warp() { swapcontext(&lane_ctx[cur], &main_ctx); }

static inline float h2f(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
static inline unsigned short f2h(float f) {  // round to nearest even, as cvt.rn
  _Float16 x = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}

// The warp-wide step of the operation all 32 lanes wait at.
static void collective() {
  const Op op = slots[0].op;
  for (int l = 1; l < 32; ++l)
    if (slots[l].op != op) fail("lanes diverged at a warp-collective operation");
  if (op == SHFL) {
    float v[32];
    for (int l = 0; l < 32; ++l) v[l] = slots[l].f;
    for (int l = 0; l < 32; ++l) slots[l].f = v[slots[l].src & 31];
  } else if (op == MOVT) {  // m8n8 b16 transpose: lane holds row lane / 4, columns 2 (lane % 4) + {0, 1}
    unsigned short m[8][8];
    for (int l = 0; l < 32; ++l) {
      m[l >> 2][2 * (l & 3)] = slots[l].m & 0xffff;
      m[l >> 2][2 * (l & 3) + 1] = slots[l].m >> 16;
    }
    for (int l = 0; l < 32; ++l) slots[l].m = m[2 * (l & 3)][l >> 2] | ((u32)m[2 * (l & 3) + 1][l >> 2] << 16);
  } else if (op == LDSM) {  // ldmatrix x4 b16: lane 8 j + r gives row r of matrix j; lane l gets row l / 4,
    // columns 2 (l % 4) + {0, 1} of each matrix
    u32 m[4][8][4];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < 8; ++r) std::memcpy(m[j][r], emu_smem_base + slots[8 * j + r].m, 16);
    for (int l = 0; l < 32; ++l)
      for (int j = 0; j < 4; ++j) slots[l].a[j] = m[j][l >> 2][l & 3];
  } else if (op == MMA) {  // m16n8k16, A row-major 16 x 16, B col-major 16 x 8, C / D 16 x 8 fp32
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int e = 0; e < 2; ++e) {
        A[g][2 * t + e] = h2f((slots[l].a[0] >> (16 * e)) & 0xffff);
        A[g + 8][2 * t + e] = h2f((slots[l].a[1] >> (16 * e)) & 0xffff);
        A[g][2 * t + 8 + e] = h2f((slots[l].a[2] >> (16 * e)) & 0xffff);
        A[g + 8][2 * t + 8 + e] = h2f((slots[l].a[3] >> (16 * e)) & 0xffff);
        B[2 * t + e][g] = h2f((slots[l].b[0] >> (16 * e)) & 0xffff);
        B[2 * t + 8 + e][g] = h2f((slots[l].b[1] >> (16 * e)) & 0xffff);
        C[g][2 * t + e] = slots[l].c[e];
        C[g + 8][2 * t + e] = slots[l].c[2 + e];
      }
    }
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) {
        float s = C[r][n];
        for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][n];
        C[r][n] = s;
      }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int e = 0; e < 2; ++e) {
        slots[l].c[e] = C[g][2 * t + e];
        slots[l].c[2 + e] = C[g + 8][2 * t + e];
      }
    }
  } else if (op == IMMA) {  // m16n8k32, A row-major 16 x 32 u8, B col-major 32 x 8 (s8 or u8), C / D s32
    int A[16][32], B[32][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int e = 0; e < 4; ++e) {
        A[g][4 * t + e] = (slots[l].a[0] >> (8 * e)) & 0xff;
        A[g + 8][4 * t + e] = (slots[l].a[1] >> (8 * e)) & 0xff;
        A[g][4 * t + 16 + e] = (slots[l].a[2] >> (8 * e)) & 0xff;
        A[g + 8][4 * t + 16 + e] = (slots[l].a[3] >> (8 * e)) & 0xff;
        for (int r = 0; r < 2; ++r) {
          const int byte = (slots[l].b[r] >> (8 * e)) & 0xff;
          B[4 * t + 16 * r + e][g] = slots[l].b_signed ? (int)(signed char)byte : byte;
        }
      }
      for (int e = 0; e < 2; ++e) {
        C[g][2 * t + e] = slots[l].ci[e];
        C[g + 8][2 * t + e] = slots[l].ci[2 + e];
      }
    }
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < 8; ++n) {
        long long s = C[r][n];
        for (int k = 0; k < 32; ++k) s += (long long)A[r][k] * B[k][n];
        if (s > INT32_MAX || s < INT32_MIN) fail("integer mma overflows s32");
        C[r][n] = (int)s;
      }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int e = 0; e < 2; ++e) {
        slots[l].ci[e] = C[g][2 * t + e];
        slots[l].ci[2 + e] = C[g + 8][2 * t + e];
      }
    }
  }
  // SYNC: nothing to exchange
}

static void lane_entry() {
  body();
  slots[cur].op = DONE;
}

// Runs fn as the 32 lanes of one warp of block (bx, by, bz) with `smem_bytes` of dynamic shared memory.
static void run_block(int bx, int by, int bz, size_t smem_bytes, const std::function<void()>& fn) {
  static std::vector<char> stacks(32 * (256 << 10));
  std::vector<unsigned char> smem(smem_bytes + 16, 0xAB);  // stale bytes, as shared memory holds
  emu_smem_base = smem.data();
  blockIdx = {bx, by, bz};
  body = fn;
  for (int l = 0; l < 32; ++l) {
    getcontext(&lane_ctx[l]);
    lane_ctx[l].uc_stack.ss_sp = stacks.data() + (size_t)l * (256 << 10);
    lane_ctx[l].uc_stack.ss_size = 256 << 10;
    lane_ctx[l].uc_link = &main_ctx;
    makecontext(&lane_ctx[l], lane_entry, 0);
    slots[l].op = RUN;
  }
  for (;;) {
    for (int l = 0; l < 32; ++l) {
      cur = l;
      threadIdx = {l, 0, 0};
      swapcontext(&main_ctx, &lane_ctx[l]);
    }
    if (slots[0].op == DONE) {
      for (int l = 1; l < 32; ++l)
        if (slots[l].op != DONE) fail("some lanes ended while others wait at a warp-collective operation");
      break;
    }
    collective();
  }
  emu_smem_base = nullptr;
}
}  // namespace emu

static inline void emu_grid(int gx, int gy, int gz, size_t smem_bytes, const std::function<void()>& fn) {
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) emu::run_block(x, y, z, smem_bytes, fn);
}

// ---- the device intrinsics the kernels use ------------------------------------------------------------------
static inline float __shfl_xor_sync(unsigned, float v, int o) {
  emu::slots[emu::cur] = {};
  emu::slots[emu::cur].op = emu::SHFL;
  emu::slots[emu::cur].f = v;
  emu::slots[emu::cur].src = emu::cur ^ o;
  emu::wait_for_warp();
  return emu::slots[emu::cur].f;
}
static inline float __shfl_sync(unsigned, float v, int src) {
  emu::slots[emu::cur] = {};
  emu::slots[emu::cur].op = emu::SHFL;
  emu::slots[emu::cur].f = v;
  emu::slots[emu::cur].src = src;
  emu::wait_for_warp();
  return emu::slots[emu::cur].f;
}
static inline void __syncwarp() {
  emu::slots[emu::cur].op = emu::SYNC;
  emu::wait_for_warp();
}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
static inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // round to nearest even
static inline unsigned __float_as_uint(float f) {
  unsigned i;
  std::memcpy(&i, &f, 4);
  return i;
}
static inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}

namespace emu_ptx {
typedef unsigned int u32;
static inline u32 prmt(u32 a, u32 b, u32 sel) {
  const unsigned long long src = (unsigned long long)a | ((unsigned long long)b << 32);
  u32 d = 0;
  for (int k = 0; k < 4; ++k) d |= (u32)((src >> (8 * ((sel >> (4 * k)) & 7))) & 0xff) << (8 * k);
  return d;
}
static inline u32 pack_f16x2(float lo, float hi) { return emu::f2h(lo) | ((u32)emu::f2h(hi) << 16); }
static inline float f16_lo(u32 x) { return emu::h2f(x & 0xffff); }
static inline float f16_hi(u32 x) { return emu::h2f(x >> 16); }
static inline unsigned short f2bf16(float v) {  // round to nearest even, as cvt.rn.bf16
  u32 u;
  std::memcpy(&u, &v, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return (unsigned short)(u >> 16);
}
static inline float e4m3_to_float(unsigned c) {  // OCP e4m3 (fn): bias 7, no infinities, 0x7f / 0xff NaN
  const int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
  float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.f + m / 8.f, e - 7);
  if (e == 15 && m == 7) v = NAN;
  return sign ? -v : v;
}
static inline u32 e4m3x2_f16x2(u32 x) {  // cvt.rn.f16x2.e4m3x2: byte 0 -> low half, byte 1 -> high half
  return pack_f16x2(e4m3_to_float(x & 0xff), e4m3_to_float((x >> 8) & 0xff));
}
static inline float ex2(float x) { return std::exp2(x); }
static inline float lg2(float x) { return std::log2(x); }
static inline float rcp(float x) { return 1.f / x; }
static inline u32 warp_max(u32 x) {  // redux.sync.max.u32 over the warp
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __float_as_uint(__shfl_xor_sync(0xffffffff, __uint_as_float(x), o));
    x = y > x ? y : x;
  }
  return x;
}
static inline bool warp_any(bool p) { return warp_max(p ? 1u : 0u) != 0; }  // __any_sync over the warp
static inline u32 movtrans(u32 a) {
  emu::slots[emu::cur] = {};
  emu::slots[emu::cur].op = emu::MOVT;
  emu::slots[emu::cur].m = a;
  emu::wait_for_warp();
  return emu::slots[emu::cur].m;
}
static inline void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  emu::Slot& s = emu::slots[emu::cur];
  s = {};
  s.op = emu::MMA;
  s.a[0] = a0, s.a[1] = a1, s.a[2] = a2, s.a[3] = a3, s.b[0] = b0, s.b[1] = b1;
  for (int i = 0; i < 4; ++i) s.c[i] = c[i];
  emu::wait_for_warp();
  for (int i = 0; i < 4; ++i) c[i] = emu::slots[emu::cur].c[i];
}
static inline void imma(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, bool b_signed) {
  emu::Slot& s = emu::slots[emu::cur];
  s = {};
  s.op = emu::IMMA;
  s.b_signed = b_signed;
  s.a[0] = a0, s.a[1] = a1, s.a[2] = a2, s.a[3] = a3, s.b[0] = b0, s.b[1] = b1;
  for (int i = 0; i < 4; ++i) s.ci[i] = c[i];
  emu::wait_for_warp();
  for (int i = 0; i < 4; ++i) c[i] = emu::slots[emu::cur].ci[i];
}
static inline void ldsm4(u32 addr, u32& d0, u32& d1, u32& d2, u32& d3) {
  emu::Slot& s = emu::slots[emu::cur];
  s = {};
  s.op = emu::LDSM;
  if (addr & 15) emu::fail("ldmatrix row address not 16-byte aligned");
  s.m = addr;
  emu::wait_for_warp();
  d0 = emu::slots[emu::cur].a[0], d1 = emu::slots[emu::cur].a[1], d2 = emu::slots[emu::cur].a[2],
  d3 = emu::slots[emu::cur].a[3];
}
static inline void imma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  imma(c, a0, a1, a2, a3, b0, b1, true);
}
static inline void imma_u8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  imma(c, a0, a1, a2, a3, b0, b1, false);
}
static inline u32 smem_addr(const void* p) { return (u32)((const unsigned char*)p - emu_smem_base); }
static inline void cp_async(u32 dst, const void* src, int bytes, bool ok) {  // zero-fills when !ok, as src-size 0
  if (ok)
    std::memcpy(emu_smem_base + dst, src, bytes);
  else
    std::memset(emu_smem_base + dst, 0, bytes);
}
static inline void cp16(u32 dst, const void* src, bool ok) { cp_async(dst, src, 16, ok); }
static inline void cp4(u32 dst, const void* src, bool ok) { cp_async(dst, src, 4, ok); }
template <int BYTES>  // BYTES from b once k >= to_b, else from a; zeros once k >= to_hi
static inline void cp_from(u32 dst, const unsigned char* a, const unsigned char* b, int k, int to_b, int to_hi) {
  cp_async(dst, k >= to_b ? b : a, BYTES, k < to_hi);
}
static inline void cp_commit() {}
template <int N>
static inline void cp_wait() {}
}  // namespace emu_ptx
