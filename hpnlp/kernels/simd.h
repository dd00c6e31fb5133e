// What hpnlp's CPU kernels share: a vector type, a fast exp, a thread pool of the moment
// and the shape checks of an FFI handler.
//
// Plain C++17 with GCC vector extensions: -march=native gives AVX-512 registers where the
// machine has them; where it does not, a kernel that defines HPNLP_NATIVE_VECTORS gets
// 8-float AVX2 vectors and the others two AVX2 registers per vector (see NR).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

// The helpers' symbols differ between the two vector widths (an inline namespace changes
// the mangled names), so no library's `load` can stand in for another's.
#if defined(__AVX512F__) || !defined(HPNLP_NATIVE_VECTORS)
#define HPNLP_VECTOR_ABI vector16
#define HPNLP_NR 16
#else
#define HPNLP_VECTOR_ABI vector8
#define HPNLP_NR 8
#endif

namespace hpnlp {
inline namespace HPNLP_VECTOR_ABI {

namespace ffi = xla::ffi;

// Floats per vector. With AVX-512 a vf is one 16-float register. Without it, GCC gives a
// 64-byte vector no register of its own: it keeps it in memory and lowers much of its
// arithmetic lane by lane (a splat was 16 scalar stores, a `?:` 16 vmaxss), and the fused
// LSTM and flash attention ran 4x and 19x slower than their peers on an AVX2-only EPYC
// (Zen 3). A kernel that works in whole vectors of NR floats, whatever NR is, defines
// HPNLP_NATIVE_VECTORS before including this header and gets one AVX2 register (8
// floats) there. The MIPS and quantized kernels lay their packed operands out in 16-float
// panels and carry their own AVX2 register tiles, so they keep 16.
// Shapes the kernels accept stay multiples of 16 (TILE) on every build, whatever NR is.
constexpr int TILE = 16;
constexpr int NR = HPNLP_NR;
typedef float vf __attribute__((vector_size(NR * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(NR * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
// Unaligned vector access through a type of alignment 4 (not memcpy: GCC then bounces
// register blocks through the stack).
typedef float vf_u __attribute__((vector_size(NR * sizeof(float)), aligned(alignof(float))));
inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
// A non-temporal store (past the cache, no read for ownership) to a 64-byte aligned p:
// for large outputs that nothing reads again soon.
inline void stream(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
#else
  store(p, v);
#endif
}
inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// A std::vector's storage on 64-byte boundaries, for scratch that products stream: a
// 64-byte load from plain `new` storage (16-byte aligned) spans two cache lines, and the
// flash kernel's register tiles ran 4-12% slower on such operands (Xeon model 167).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Scratch = std::vector<float, Aligned64<float>>;

// An uninitialized array of n T on 64-byte boundaries (the same reason).
struct FreeAligned64 {
  void operator()(void* p) const { ::operator delete(p, std::align_val_t(64)); }
};
template <class T>
using AlignedArray = std::unique_ptr<T[], FreeAligned64>;
template <class T>
AlignedArray<T> aligned_array(size_t n) {
  return AlignedArray<T>(static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))));
}

// One AVX2 register of floats and of int32, for kernels that keep NR = 16 (their vf has
// no register without AVX-512): their elementwise epilogues run on these halves.
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));
typedef float v8f_u __attribute__((vector_size(8 * sizeof(float)), aligned(alignof(float))));
inline v8f load8(const float* p) { return *reinterpret_cast<const v8f_u*>(p); }
inline void store8(float* p, v8f v) { *reinterpret_cast<v8f_u*>(p) = v; }
#if HPNLP_NR == 16
// One 16-float vf from its two AVX2 halves (lo: lanes 0-7, hi: lanes 8-15), where a
// kernel that keeps NR = 16 computed on the halves.
inline vf join8(v8f lo, v8f hi) {
  vf v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}
#endif

// The register tile of a product: c[r * ldc + v * NR, + NR) (+)= sum over k < K of
// a[r * ar + k * ac] * b[k * ldb + v * NR, + NR), r < R, v < NV, with the R x NV
// accumulators, NV vectors of b and a broadcast in registers (R * NV <= 12 fits AVX2's 16).
// Always inlined: a caller's constant strides (ac == 1) must reach the loop, and GCC left
// the large unrolled bodies out of line.
template <int R, int NV, bool Acc>
__attribute__((always_inline)) inline void reg_tile(const float* a, ptrdiff_t ar, ptrdiff_t ac,
                                                    int K, const float* b, ptrdiff_t ldb,
                                                    float* c, ptrdiff_t ldc) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc ? load(c + r * ldc + v * NR) : vf{};
  // K > 0 (callers never pass 0): where K might be 0, GCC kept every accumulator on the
  // stack as well, 24 stores before the loop and 21 stores and loads after it.
  if (K <= 0) __builtin_unreachable();
  for (int k = 0; k < K; ++k, b += ldb) {
    vf bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load(b + v * NR);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * ar + k * ac];
      for (int v = 0; v < NV; ++v) acc[r][v] += x * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(c + r * ldc + v * NR, acc[r][v]);
}

// exp(x) to about 2 ulp for x in [-87, 88] (Cephes expf): 2^n * p(r), r = x - n ln 2.
// Below -87 it returns exp(-87), not 0; `vexp0` is the variant that flushes to 0.
template <class V, class VI>  // a float vector type and the int32 one of its lanes
inline V vexp_t(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V t = x * 1.44269504088896341f + 0.5f;
  VI n = __builtin_convertvector(t, VI);          // truncates toward zero
  V nf = __builtin_convertvector(n, V);
  VI too_big = nf > t;                             // -1 where truncation rounded up
  n = n + too_big;
  nf = __builtin_convertvector(n, V);             // floor(x log2 e + 1/2)
  V r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline vf vexp(vf x) { return vexp_t<vf, vi>(x); }

// exp(x) for x <= 88 to under 1 ulp (0.91 over every float in [-87, 88]), exactly 0 below
// -87 (so exp(-inf) = 0: masked scores weigh nothing); above 88 the AVX2 path returns
// exp(88) and the AVX-512 one overflows. x = n ln 2 + r (two-step reduction, |r| <= ln 2 /
// 2), e^r by a degree-6 polynomial fitted for the least relative error on that interval
// (Taylor's coefficients, 1/k!, left 2.7 ulp), and the final select covers x < -87. With
// AVX-512 2^n is one vscalefps: 12 instructions. Elsewhere (AVX2) 2^n is made from the
// rounding's own bits: 17 instructions per vector, against vexp's 24 (the fused LSTM and
// flash attention measure it: tools/kernel_ab.py). tests/test_kernel_tuning.py checks each
// build's path.
// 2^n from t = n + 1.5 * 2^23 (n an integer in [-126, 127], the float's low mantissa bits
// then n) with no conversion: (bits(t) + 127) << 23, since 1.5 * 2^23's own bits vanish in
// the shift. The AVX2 exps' scale.
inline vf pow2_rounded(vf t) {
  typedef uint32_t vu __attribute__((vector_size(NR * sizeof(uint32_t))));  // shifts defined
  vu bits;
  std::memcpy(&bits, &t, sizeof bits);
  bits = (bits + 127u) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return scale;
}

constexpr float kExpC6 = 0.00138146f, kExpC5 = 0.00836871f, kExpC4 = 0.04166839f,
                kExpC3 = 0.16666521f, kExpC2 = 0.49999994f;
inline vf vexp0(vf x) {
#if defined(__AVX512F__)
  const __m512 xv = reinterpret_cast<__m512>(x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(kExpC6);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const vf e = reinterpret_cast<vf>(_mm512_scalef_ps(p, n));
  return x < splat(-87.0f) ? vf{} : e;
#else
  // The same polynomial in any vector width: n = round(x log2 e) by adding 1.5 * 2^23,
  // and 2^n from those same bits (pow2_rounded).
  const vf xc = x > splat(88.0f) ? splat(88.0f) : x;
  const vf t = xc * 1.44269504088896341f + 12582912.0f;
  const vf n = t - 12582912.0f;
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(kExpC6);
  p = p * r + kExpC5;
  p = p * r + kExpC4;
  p = p * r + kExpC3;
  p = p * r + kExpC2;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return x < splat(-87.0f) ? vf{} : p * pow2_rounded(t);
#endif
}

// 2^x for x <= 127 to under 1 ulp (at most 0.95 over every float with 1/8 <= |x| < 4 and
// 5e7 random ones nearer 0), exactly 0 below -126 (2^-inf = 0); above 127 the AVX2 path
// returns 2^127 and the AVX-512 one overflows. For a softmax whose scores are scaled by
// log2 e (the flash kernel's: scale * log2 e folded into its queries): no multiplication
// by log2 e and no two-step reduction, as r = x - round(x) is exact (|r| <= 1/2); 2^r by
// a degree-6 polynomial fitted for the least relative error on that interval. 10
// instructions with AVX-512 against vexp0's 12.
constexpr float kExp2C6 = 1.53458124e-4f, kExp2C5 = 1.33999309e-3f, kExp2C4 = 9.61848907e-3f,
                kExp2C3 = 5.55032864e-2f, kExp2C2 = 2.40226462e-1f, kExp2C1 = 6.93147182e-1f;
inline vf vexp2_0(vf x) {
#if defined(__AVX512F__)
  const __m512 xv = reinterpret_cast<__m512>(x);
  const __m512 n = _mm512_roundscale_ps(xv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(xv, n);
  __m512 p = _mm512_set1_ps(kExp2C6);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2C5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2C4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2C3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2C2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2C1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const vf e = reinterpret_cast<vf>(_mm512_scalef_ps(p, n));
  return x < splat(-126.0f) ? vf{} : e;
#else
  // n = round(x) by adding 1.5 * 2^23, and 2^n from those same bits, as vexp0 does.
  const vf xc = x > splat(127.0f) ? splat(127.0f) : x;
  const vf t = xc + 12582912.0f;
  const vf r = xc - (t - 12582912.0f);
  vf p = splat(kExp2C6);
  p = p * r + kExp2C5;
  p = p * r + kExp2C4;
  p = p * r + kExp2C3;
  p = p * r + kExp2C2;
  p = p * r + kExp2C1;
  p = p * r + 1.0f;
  return x < splat(-126.0f) ? vf{} : p * pow2_rounded(t);
#endif
}

// ------------------------------------------------------------------------- bfloat16
// bfloat16 values are uint16_t (the upper half of a float's bits). Products take them in
// pairs: `dot2(acc, a, b)` adds a.lo * b.lo + a.hi * b.hi per lane, where every 32-bit lane
// of a and b holds two bfloat16 (the lower address in the low half), in float32. With
// AVX-512 BF16 that is one vdpbf16ps; elsewhere the pairs are widened to float and take
// two FMAs (the same products; the sums may round differently).
typedef uint16_t bf16;
typedef uint32_t bf16x2_u __attribute__((may_alias, aligned(2)));  // a pair, from any even address

inline float bf16_to_float(bf16 x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even (finite inputs; a NaN stays a NaN, infinities stay).
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);  // NaN stays quiet NaN
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// 16 floats to 16 bfloat16 at dst (round to nearest even).
inline void store_bf16(bf16* dst, vf v) {
#if defined(__AVX512BF16__)
  const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
  std::memcpy(dst, &h, sizeof h);
#else
  vi u;
  std::memcpy(&u, &v, sizeof u);
  const vi nan = (u & 0x7fffffff) > 0x7f800000;
  vi r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
  r = nan ? ((u >> 16) | 0x40) : r;
  for (int i = 0; i < NR; ++i) dst[i] = bf16(r[i]);
#endif
}

// 16 bfloat16 at src to floats.
inline vf load_bf16(const bf16* src) {
  vi u;
  for (int i = 0; i < NR; ++i) u[i] = int32_t(uint32_t(src[i]) << 16);
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// NR int8 at src to floats (sign-extended and converted in registers: vpmovsxbd, vcvtdq2ps).
inline vf load_i8(const int8_t* src) {
  vi u;
  for (int i = 0; i < NR; ++i) u[i] = src[i];
  return __builtin_convertvector(u, vf);
}

// dot2 with the pairs widened to float32 and two FMAs, on any CPU: some take longer for a
// vdpbf16ps than for this (the flash kernel's bfloat16 passes measured 1.2x faster widened
// on a Xeon model 207), so a kernel may choose it per CPU (see `widen` in flash_cpu.cc).
inline vf dot2_wide(vf acc, vf a, vf b) {
  vi ai, bi;
  std::memcpy(&ai, &a, sizeof ai);
  std::memcpy(&bi, &b, sizeof bi);
  const vi ahi = ai & int32_t(0xffff0000u), bhi = bi & int32_t(0xffff0000u);
  const vi alo = ai << 16, blo = bi << 16;
  vf al, bl, ah, bh;
  std::memcpy(&al, &alo, sizeof al), std::memcpy(&bl, &blo, sizeof bl);
  std::memcpy(&ah, &ahi, sizeof ah), std::memcpy(&bh, &bhi, sizeof bh);
  return acc + al * bl + ah * bh;
}

inline vf dot2(vf acc, vf a, vf b) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc),
                                               reinterpret_cast<__m512bh>(a),
                                               reinterpret_cast<__m512bh>(b)));
#else
  return dot2_wide(acc, a, b);
#endif
}

// A pair of bfloat16 (32 bits at an even address) in every lane.
inline vf splat_pair(const bf16* p) {
  const uint32_t bits = *reinterpret_cast<const bf16x2_u*>(p);
  vi u = vi{} + int32_t(bits);
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// Horizontal sum and max of a vector, as trees (a lane-by-lane loop is a chain of 16
// dependent scalar operations: GCC may not reassociate float arithmetic).
template <class Op>
inline float htree(vf v, Op op) {
  float t[NR];
  std::memcpy(t, &v, sizeof t);
  for (int w = NR / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) t[j] = op(t[j], t[j + w]);
  return t[0];
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  return htree(v, [](float a, float b) { return a + b; });
#endif
}

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  return htree(v, [](float a, float b) { return std::max(a, b); });
#endif
}

// What Barrier::wait throws once the barrier is aborted.
struct BarrierAborted : std::runtime_error {
  BarrierAborted() : std::runtime_error("another thread of the kernel failed") {}
};

// A barrier for a fixed set of threads: spin briefly, then yield (the kernels run beside
// other processes in a test run; a pure spin would starve them). abort() makes every
// wait, current or later, throw BarrierAborted: a thread that has left by an exception
// never arrives, and the others would wait for it forever (Guarded aborts the barrier of
// a `parallel` call on the first exception).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    if (aborted_.load(std::memory_order_acquire)) throw BarrierAborted();
    int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int spin = 0; gen_.load(std::memory_order_acquire) == gen; ++spin) {
      if (aborted_.load(std::memory_order_relaxed)) throw BarrierAborted();
      if (spin > 4000) std::this_thread::yield();
#if defined(__x86_64__)
      else __builtin_ia32_pause();
#endif
    }
  }
  void abort() { aborted_.store(true, std::memory_order_release); }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
  std::atomic<bool> aborted_{false};
};

// One poll of a spin-wait: a pause instruction, or after 2000 polls a yield of the core.
inline void spin_pause(int spin) {
  if (spin > 2000) std::this_thread::yield();
#if defined(__x86_64__)
  else __builtin_ia32_pause();
#endif
}

// fn(t) as several threads run it: the first exception any of them throws (std::bad_alloc
// of a scratch buffer, say) is kept for the caller to rethrow after the join, and aborts
// `barrier` (if the threads meet at one), so that no thread waits for the one that left.
template <class F>
class Guarded {
 public:
  explicit Guarded(F& fn, Barrier* barrier = nullptr) : fn_(fn), barrier_(barrier) {}
  void operator()(int t) {
    try {
      fn_(t);
    } catch (...) {
      fail(std::current_exception());
    }
  }
  // Keeps e unless an earlier exception is kept (kept before the barrier is aborted, so the
  // BarrierAborted of the threads it releases never hides it).
  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = e;
    }
    if (barrier_ != nullptr) barrier_->abort();
  }
  bool failed() {
    std::lock_guard<std::mutex> lk(mu_);
    return error_ != nullptr;
  }
  void rethrow() {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  F& fn_;
  Barrier* barrier_;
  std::exception_ptr error_;
  std::mutex mu_;
};

// How helpers that may come late or never join a call's job: the caller opens slots, a
// helper counts itself active before it claims one (and runs the job, as t = 1, 2, ...,
// only with one), and the caller closes the slots, then waits until none is active, so no
// helper touches the job after the call. Used by run_joined and by the quantized kernels'
// own helper pool (qgemm.cc).
struct JoinSlots {
  std::atomic<int> slots{0}, active{0}, next_t{1};
  const std::function<void(int)>* job = nullptr;

  void open(const std::function<void(int)>* j, int helpers) {
    job = j;
    next_t.store(1, std::memory_order_relaxed);
    slots.store(helpers, std::memory_order_seq_cst);  // publishes job
  }
  void join() {
    active.fetch_add(1, std::memory_order_seq_cst);
    int s = slots.load(std::memory_order_seq_cst);
    while (s > 0 && !slots.compare_exchange_weak(s, s - 1, std::memory_order_seq_cst)) {}
    if (s > 0) (*job)(next_t.fetch_add(1, std::memory_order_relaxed));
    active.fetch_sub(1, std::memory_order_seq_cst);
  }
  void close() {
    slots.store(0, std::memory_order_seq_cst);  // no helper joins from here on
    for (int spin = 0; active.load(std::memory_order_seq_cst) > 0; ++spin) spin_pause(spin);
  }
};

// Threads 1 .. threads - 1 running g(t), appended to *pool; the exception that stopped the
// starts, or null (std::system_error where pthread_create fails with EAGAIN: a limit on
// the process's, the user's or the cgroup's threads). The threads started before it run.
template <class G>
std::exception_ptr start_threads(int threads, G& g, std::vector<std::thread>* pool) {
  try {
    pool->reserve(threads - 1);
    for (int t = 1; t < threads; ++t) pool->emplace_back(std::ref(g), t);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// Run fn(thread_index) on `threads` threads started for the call (the caller is thread 0)
// and join. For work that needs every thread at once, meeting at `barrier` (the fused
// LSTM's); work claimed dynamically goes through join_parallel below, which needs no
// thread started. An exception in any of them (std::bad_alloc of a scratch buffer, say)
// aborts the barrier and is rethrown here, after the join, for the FFI handler to turn
// into an error instead of a hang or std::terminate. So is a thread that fails to start:
// the caller then runs nothing, and the threads started meet the aborted barrier (a
// std::thread left joinable as the exception unwound past it called std::terminate).
template <class F>
void parallel(int threads, F&& fn, Barrier* barrier = nullptr) {
  Guarded<std::remove_reference_t<F>> guarded(fn, barrier);
  std::vector<std::thread> pool;
  if (std::exception_ptr failed = start_threads(threads, guarded, &pool)) guarded.fail(failed);
  if (!guarded.failed()) guarded(0);
  for (auto& t : pool) t.join();
  guarded.rethrow();
}

// XLA's intra-op thread pool, for the FFI call in progress on this thread: a handler that
// binds `.Ctx<ffi::ThreadPool>()` opens an XlaPool::Scope on it for its extent.
class XlaPool {
 public:
  class Scope {
   public:
    explicit Scope(ffi::ThreadPool* pool) : saved_(slot()) { slot() = pool; }
    ~Scope() { slot() = saved_; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ffi::ThreadPool* saved_;
  };
  // The pool, or null outside a call or where XLA gives the call no threads.
  static ffi::ThreadPool* current() {
    ffi::ThreadPool* pool = slot();
    return pool != nullptr && pool->num_threads() > 0 ? pool : nullptr;
  }

 private:
  static ffi::ThreadPool*& slot() {
    static thread_local ffi::ThreadPool* pool = nullptr;
    return pool;
  }
};

// fn(t) on the caller (t = 0) and on up to threads - 1 of XLA's intra-op threads (t >= 1)
// that join while the caller works; the work inside fn must be claimed dynamically, as a
// helper may join late or never. XLA's own threads, not threads of the kernel's: an XLA
// worker spins for a while after its last fusion, and a kernel thread started or woken
// beside it shared a core with it (a [2048, 2048 -> 512] int8 product after an XLA
// elementwise op took 1-2 ms longer than alone; the w8a8 LM prefill of the quant
// benchmark ran 122 ms with the int8 kernel's own helper threads, 108 on XLA's, measured
// interleaved in one process on a Xeon, model 207). A task may start after the call has
// returned (its worker busy until then), so the join slots live on the heap, shared.
template <class F>
void run_joined(ffi::ThreadPool& xla, int threads, F& fn) {
  auto join = std::make_shared<JoinSlots>();
  Guarded<F> guarded(fn);
  const std::function<void(int)> job = std::ref(guarded);
  join->open(&job, threads - 1);
  for (int i = 1; i < threads; ++i) xla.Schedule([join] { join->join(); });
  job(0);
  join->close();
  guarded.rethrow();
}

// fn(t) on the caller and on helpers that join (as run_joined: work claimed dynamically):
// XLA's intra-op threads inside an FFI call that has them, else up to threads - 1
// threads started for the call. As the work is claimed, a thread that fails to start
// (start_threads) leaves it to those that did, with no error.
template <class F>
void join_parallel(int threads, F&& fn) {
  if (threads <= 1) return fn(0);
  if (ffi::ThreadPool* xla = XlaPool::current()) return run_joined(*xla, threads, fn);
  Guarded<std::remove_reference_t<F>> guarded(fn);
  std::vector<std::thread> pool;
  start_threads(threads, guarded, &pool);
  guarded(0);
  for (auto& t : pool) t.join();
  guarded.rethrow();
}

inline int clamp_threads(int64_t threads, int64_t shares) {
  return static_cast<int>(std::max<int64_t>(1, std::min(threads, shares)));
}

#if defined(__AMX_TILE__)
// AMX (Intel Sapphire Rapids and later): tile products, 16 times the work of a vector
// instruction (tdpbf16ps for bfloat16 in flash_cpu.cc, tdpbusd for int8 in qgemm.cc).
// Linux grants the tile state per process on request (arch_prctl, kernel >= 5.16; it may
// refuse). A thread loads the tile configuration on its first tile product of a pass and
// releases the tiles (release_tiles) when its share of the pass is done, so a pass never
// relies on a configuration another library may have loaded in that thread since, and
// XLA's threads do not keep 8 KB of tile state live between calls. Where the request
// fails, amx_ready() is false and the kernels keep to vector registers.
//
// In an unnamed namespace: each kernel library keeps its own flag and grant (as internal
// symbols), never one another library's (inline functions' statics would otherwise be
// shared across every loaded library, GNU unique symbols).
namespace {
thread_local bool amx_configured = false;

inline bool amx_ready() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  if (!permitted) return false;
  struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  };
  // Palette 1: 8 tiles of 16 rows x 64 bytes. A static table: a stack copy built at run
  // time was partly optimized away (the compiler does not see ldtilecfg read it).
  static const TileConfig config = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                    {16, 16, 16, 16, 16, 16, 16, 16}};
  if (!amx_configured) {
    _tile_loadconfig(&config);
    amx_configured = true;
  }
  return true;
}

inline void release_tiles() {
  if (amx_configured) {
    _tile_release();
    amx_configured = false;
  }
}
}  // namespace
#else
inline void release_tiles() {}
#endif

// Releases the thread's tiles when a thread's share of a pass ends, however it ends (a
// failed allocation in an item included), so no later pass finds the flag set on tiles
// another library has since released or configured.
struct TilesReleased {
  TilesReleased() = default;
  TilesReleased(const TilesReleased&) = delete;
  TilesReleased& operator=(const TilesReleased&) = delete;
  ~TilesReleased() { release_tiles(); }
};

// Items [begin, end) of `items` for thread p of `threads` (near-equal static shares).
inline void share(int items, int threads, int p, int* begin, int* end) {
  *begin = static_cast<int>(int64_t(items) * p / threads);
  *end = static_cast<int>(int64_t(items) * (p + 1) / threads);
}

// The whole pages of [p, p + bytes) that are not resident yet, in pieces of at most 1 MB
// appended to *pieces. XLA used to map large buffers fresh on every call; with freed
// memory reused (hpnlp.xla_workarounds' malloc setting) a buffer is usually resident
// already, and populating it again walked every page for nothing: 2 ms of a 5 ms
// [2048, 1024 -> 4096] binary product's output. One mincore() call per buffer finds the
// missing pages (about 20 us for 32 MB); where mincore fails, the whole range is taken.
inline void missing_pages(const void* p, size_t bytes,
                          std::vector<std::pair<uintptr_t, uintptr_t>>* pieces) {
  constexpr uintptr_t kPage = 4096, kPiece = uintptr_t(1) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kPage - 1) & ~(kPage - 1),
                  end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kPage - 1);
  if (end <= begin) return;
  const size_t pages = (end - begin) / kPage;
  thread_local std::vector<unsigned char> resident;
  resident.resize(pages);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0)
    std::fill(resident.begin(), resident.end(), 0);
  for (size_t i = 0; i < pages;) {
    if (resident[i] & 1) {
      ++i;
      continue;
    }
    size_t j = i + 1;
    while (j < pages && !(resident[j] & 1) && j - i < kPiece / kPage) ++j;
    pieces->emplace_back(begin + i * kPage, begin + j * kPage);
    i = j;
  }
}

// Fault in the missing pages of several buffers ({pointer, floats} each) with one
// MADV_POPULATE_WRITE system call per 1 MB piece, the pieces claimed by the threads that
// join (join_parallel). Touching fresh pages one by one costs a trap per 4 KB, which for
// the LSTM's saved activations took as long as their gate arithmetic. Where the system
// lacks MADV_POPULATE_WRITE (Linux < 5.14) the pages fault on first touch, as without it.
inline void populate(std::initializer_list<std::pair<float*, size_t>> buffers, int threads) {
#ifdef MADV_POPULATE_WRITE
  std::vector<std::pair<uintptr_t, uintptr_t>> pieces;
  for (const auto& [p, floats] : buffers) missing_pages(p, floats * sizeof(float), &pieces);
  if (pieces.empty()) return;
  std::atomic<size_t> next{0};
  join_parallel(clamp_threads(threads, int64_t(pieces.size())), [&](int) {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();)
      madvise(reinterpret_cast<void*>(pieces[i].first), pieces[i].second - pieces[i].first,
              MADV_POPULATE_WRITE);
  });
#else
  (void)buffers, (void)threads;
#endif
}

// Inside a catch: the caught exception as an FFI error naming the kernel (handlers are
// function-try-blocks, so a failed scratch allocation or thread start becomes a Python
// exception instead of std::terminate).
inline ffi::Error exception_error(const char* kernel) {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kernel) + ": out of memory for its scratch buffers; use a "
                      "smaller batch or sequence length");
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(kernel) + ": " + e.what());
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(kernel) + ": unknown error");
  }
}

// An InvalidArgument error naming the kernel and the operand unless dims == want.
inline ffi::Error check_dims(const char* kernel, const char* what, ffi::Span<const int64_t> dims,
                             std::vector<int64_t> want) {
  if (dims.size() != want.size() || !std::equal(want.begin(), want.end(), dims.begin()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": bad shape of " + what);
  return ffi::Error::Success();
}

}  // namespace HPNLP_VECTOR_ABI
}  // namespace hpnlp
