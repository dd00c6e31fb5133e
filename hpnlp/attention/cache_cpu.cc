// Exact attention of a few new queries over a key/value cache, as one XLA FFI kernel: the
// attention of a causal LM's decoding step.
//
// Why a kernel: built from XLA ops, q [B, 1, H, D] against the cache k [B, T, H, D] is a
// product batched over (b, h), and XLA:CPU's dot runs batched products only with the
// batch dimensions leading, so every step it transposes both whole caches to [B, H, D, T]
// and [B, H, T, D] before two products of one row each: at 16 rows and 512 positions that
// is 2 x 16 MB copied per layer per token, most of the step. Here each thread reads the
// cache where it lies, by rows, and only the positions written so far.
//
// Layouts: q, o [B, L, H, D]; k, v [B, T, G, D], G dividing H (G < H: grouped-query
// attention, query head h reads cache head h / (H / G)); index: int32, a scalar or [B] (each
// row's own), the cache position of the first query: row b's query j sees keys
// 0 .. min(index[b] + j, T - 1) (a query that sees no key, index + j < 0, outputs zeros).
// Any D. float32, or bfloat16 widened to float32 (float32 products, softmax and
// accumulation; the output rounded to bfloat16 once).
//
// An int8 cache (hpnlp_cached_attention_i8: quant.kv_cache='int8'): k, v int8 codes with
// float32 scales k_scale, v_scale [B, T, G], one per position and key/value head, so key t
// is k[t] * k_scale[t]; q and o float32. A score is the int8 row's dot with q, times its
// scale; a value row's scale folds into its softmax weight. The codes are widened to float32
// in registers: the cache is read at a quarter of float32's bytes, which is what decoding at
// a large batch waits for.

#include <cmath>
#include <limits>
#include <type_traits>

#define HPNLP_NATIVE_VECTORS  // whole vectors of NR floats (simd.h)
#include "simd.h"

namespace ffi = xla::ffi;
using namespace hpnlp;  // NOLINT: the kernel's vocabulary (vf, load, ...)

namespace {

inline vf load_e(const float* p) { return load(p); }
inline vf load_e(const bf16* p) { return load_bf16(p); }
inline vf load_e(const int8_t* p) { return load_i8(p); }
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x); }
inline float to_float(int8_t x) { return float(x); }
inline void store_e(float* p, vf x) { store(p, x); }
inline void store_e(bf16* p, vf x) { store_bf16(p, x); }
inline void set_e(float* p, float x) { *p = x; }
inline void set_e(bf16* p, float x) { *p = float_to_bf16(x); }

// A thread per this many cache floats read. The helpers are XLA's intra-op threads
// (hpnlp::join_parallel), which join within microseconds; on a 2-core Xeon (model 207),
// caches [B, T, 8, 64] read whole took, on one thread and on two (us): [1, 64] 5.2 and
// 9.2, [1, 128] 9.5 and 8.4, [1, 512] 63 and 36, [2, 512] 216 and 75. (Threads started
// per call cost 30-50 us each, and this was 1M floats.)
constexpr int64_t kFloatsPerThread = int64_t(1) << 17;

struct Problem {
  int64_t B, L, T, H, G, D;
  const int32_t* index;  // one position (index_step 0) or one per row (index_step 1)
  int64_t index_step;
  float scale;
};

// Rows ahead of the one a loop reads that it asks the memory for: a head's rows lie G * D
// elements apart, one to four cache lines each, too far apart for the hardware prefetchers
// to run ahead, and a decoding step at a large batch waits on these reads.
constexpr int64_t kPrefetchRows = 16;

template <class C>
inline void prefetch_row(const C* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * int64_t(sizeof(C)); b += 64) __builtin_prefetch(p + b);
}

// cnt heads' scores, rows of s sstep apart (n scores each, maxima m) -> exp(s - m), padded
// with zeros to whole vectors; the reciprocal of each row's sum in inv; and for an int8
// cache, value t's scale (vs[t * sstride]) folded into its weight.
template <bool coded>
inline void softmax_rows(int cnt, float* s, int64_t sstep, int64_t n, const float* m,
                         const float* vs, ptrdiff_t sstride, float* inv) {
  for (int h = 0; h < cnt; ++h) {
    float* sh = s + h * sstep;
    for (int64_t t = n; t < sstep; ++t) sh[t] = -std::numeric_limits<float>::infinity();
    vf total{};
    for (int64_t t = 0; t < sstep; t += NR) {
      const vf e = vexp0(load(sh + t) - m[h]);
      store(sh + t, e);
      total += e;
    }
    inv[h] = 1.0f / hsum(total);
    if constexpr (coded)
      for (int64_t t = 0; t < n; ++t) sh[t] *= vs[t * sstride];
  }
}

// o[a * NR, + NR) = inv * sum over t < n of s[t] * v[t * stride + a * NR, + NR), a < NA: NA
// accumulators, each value row read once.
template <int NA, class E, class C>
inline void weighted_rows(const float* s, const C* v, ptrdiff_t stride, int64_t n, float inv,
                          E* o) {
  vf acc[NA] = {};
  for (int64_t t = 0; t < n; ++t) {
    const vf w = vf{} + s[t];
    const C* vt = v + t * stride;
    for (int a = 0; a < NA; ++a) acc[a] += w * load_e(vt + a * NR);
  }
  for (int a = 0; a < NA; ++a) store_e(o + a * NR, acc[a] * inv);
}

// One query row of one head: q (D values), keys and values k, v (elements C: E, or int8
// codes whose scales are ks[t * sstride], vs[t * sstride]) at rows t * stride for t < n,
// the output row o. qs and s are scratch of D + NR and n + NR floats.
template <class E, class C>
void attend(const Problem& p, const E* q, const C* k, const C* v, const float* ks,
            const float* vs, ptrdiff_t stride, ptrdiff_t sstride, int64_t n, E* o, float* qs,
            float* s) {
  constexpr bool coded = std::is_same_v<C, int8_t>;
  const int64_t D = p.D, Dv = D / NR * NR;
  if (n <= 0) {
    for (int64_t d = 0; d < D; ++d) set_e(o + d, 0.0f);
    return;
  }
  for (int64_t d = 0; d < D; ++d) qs[d] = to_float(q[d]) * p.scale;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchRows < n) {  // this key row's successor, and the value row for later
      prefetch_row(k + (t + kPrefetchRows) * stride, D);
      prefetch_row(v + (t + kPrefetchRows) * stride, D);
    }
    const C* kt = k + t * stride;
    vf acc{};
    for (int64_t d = 0; d < Dv; d += NR) acc += load(qs + d) * load_e(kt + d);
    float x = hsum(acc);
    for (int64_t d = Dv; d < D; ++d) x += qs[d] * to_float(kt[d]);
    if constexpr (coded) x *= ks[t * sstride];
    s[t] = x;
    m = std::max(m, x);
  }
  float inv;
  softmax_rows<coded>(1, s, (n + NR - 1) / NR * NR, n, &m, vs, sstride, &inv);
  for (int64_t d = 0; d < Dv;) {  // up to 8 vectors of the row at once
    switch (std::min<int64_t>(8, (Dv - d) / NR)) {
      case 8: weighted_rows<8>(s, v + d, stride, n, inv, o + d), d += 8 * NR; break;
      case 7: weighted_rows<7>(s, v + d, stride, n, inv, o + d), d += 7 * NR; break;
      case 6: weighted_rows<6>(s, v + d, stride, n, inv, o + d), d += 6 * NR; break;
      case 5: weighted_rows<5>(s, v + d, stride, n, inv, o + d), d += 5 * NR; break;
      case 4: weighted_rows<4>(s, v + d, stride, n, inv, o + d), d += 4 * NR; break;
      case 3: weighted_rows<3>(s, v + d, stride, n, inv, o + d), d += 3 * NR; break;
      case 2: weighted_rows<2>(s, v + d, stride, n, inv, o + d), d += 2 * NR; break;
      default: weighted_rows<1>(s, v + d, stride, n, inv, o + d), d += NR; break;
    }
  }
  for (int64_t d = Dv; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t t = 0; t < n; ++t) acc += s[t] * to_float(v[t * stride + d]);
    set_e(o + d, acc * inv);
  }
}

// Query heads sharing one key/value head (grouped-query attention), up to heads_at_once<NV>()
// of them, one query row each, with D = NV vectors: each cached row is read, and int8 codes
// widened, once for all of them, where `attend` read it once a head (for a multi-query
// cache's 8 heads, 8 times from the core's cache). The queries stay in registers while the
// keys stream past, then the outputs' accumulators while the values do. The same operations
// in the same order as `attend`, so the same results. q, o: cnt rows of D (contiguous heads);
// s: scratch of heads_at_once<NV>() rows of T + NR floats, then as many rows of D.
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

template <int NV>
constexpr int heads_at_once() {
  return std::max(1, std::min(8, kVectorRegisters / 2 / NV));
}

// o_h[0, CW vectors) += s_h[t] * v[t][0, CW vectors) for t in [t0, t1) and cnt <= J heads h,
// the running sums read from and written back to acc (h * D apart): the value pass of
// attend_heads (all rows, all of a head's vectors) and of attend_heads_wide (blocks of rows,
// a few vectors at a time).
template <int J, int CW, class C>
inline void weighted_rows_heads(int cnt, const float* s, int64_t sstep, const C* v,
                                ptrdiff_t stride, int64_t t0, int64_t t1, float* acc,
                                int64_t D) {
  vf a[J][CW];
  for (int h = 0; h < J; ++h)
    for (int c = 0; c < CW; ++c) a[h][c] = h < cnt ? load(acc + h * D + c * NR) : vf{};
  for (int64_t t = t0; t < t1; ++t) {
    const C* vt = v + t * stride;
    vf vr[CW];
    for (int c = 0; c < CW; ++c) vr[c] = load_e(vt + c * NR);
    for (int h = 0; h < J; ++h) {
      if (h >= cnt) break;
      const vf w = vf{} + s[h * sstep + t];
      for (int c = 0; c < CW; ++c) a[h][c] += w * vr[c];
    }
  }
  for (int h = 0; h < cnt; ++h)
    for (int c = 0; c < CW; ++c) store(acc + h * D + c * NR, a[h][c]);
}

template <int NV, class E, class C>
void attend_heads(const Problem& p, int cnt, const E* q, const C* k, const C* v, const float* ks,
                  const float* vs, ptrdiff_t stride, ptrdiff_t sstride, int64_t n, E* o,
                  float* s) {
  constexpr bool coded = std::is_same_v<C, int8_t>;
  constexpr int J = heads_at_once<NV>();
  constexpr int64_t D = int64_t(NV) * NR;
  if (n <= 0) {
    for (int64_t i = 0; i < cnt * D; ++i) set_e(o + i, 0.0f);
    return;
  }
  const int64_t sstep = (n + NR - 1) / NR * NR;
  vf qv[J][NV];
  float m[J];
  for (int h = 0; h < J; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    for (int a = 0; a < NV; ++a)
      qv[h][a] = h < cnt ? load_e(q + h * D + a * NR) * p.scale : vf{};
  }
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchRows < n) {
      prefetch_row(k + (t + kPrefetchRows) * stride, D);
      prefetch_row(v + (t + kPrefetchRows) * stride, D);
    }
    const C* kt = k + t * stride;
    vf kr[NV];
    for (int a = 0; a < NV; ++a) kr[a] = load_e(kt + a * NR);
    for (int h = 0; h < J; ++h) {
      if (h >= cnt) break;
      vf acc{};
      for (int a = 0; a < NV; ++a) acc += qv[h][a] * kr[a];
      float x = hsum(acc);
      if constexpr (coded) x *= ks[t * sstride];
      s[h * sstep + t] = x;
      m[h] = std::max(m[h], x);
    }
  }
  float inv[J];
  softmax_rows<coded>(cnt, s, sstep, n, m, vs, sstride, inv);
  float* acc = s + J * (p.T + NR);  // after the scores (run() allots 2 J D floats there)
  for (int64_t i = 0; i < cnt * D; ++i) acc[i] = 0.0f;
  weighted_rows_heads<J, NV>(cnt, s, sstep, v, stride, 0, n, acc, D);
  for (int h = 0; h < cnt; ++h)
    for (int a = 0; a < NV; ++a) store_e(o + h * D + a * NR, load(acc + h * D + a * NR) * inv[h]);
}

// Heads at once of attend_heads_wide, and the output vectors its value pass holds per head
// (8 heads x kWideChunk accumulators, a value vector and a weight in the registers).
constexpr int kWideHeads = 8;
constexpr int kWideChunk = kVectorRegisters == 32 ? 3 : 1;

// rows of a block the value pass runs all its chunks over, from the core's L1 cache (about
// 32 KB of float rows), before it moves to the next
inline int64_t wide_block_rows(int64_t D) { return std::max<int64_t>(4, 8192 / D); }

// attend_heads_wide's key pass for J heads: s[h * sstep + t] = (scaled query h) . key t,
// and each head's running max m[h].
template <int J, class C>
inline void wide_scores(const float* qs, const C* k, const C* v, const float* ks,
                        ptrdiff_t stride, ptrdiff_t sstride, int64_t n, int64_t D, float* s,
                        int64_t sstep, float* m) {
  const int64_t NV = D / NR;
  for (int64_t t = 0; t < n; ++t) {
    if (t + kPrefetchRows < n) {
      prefetch_row(k + (t + kPrefetchRows) * stride, D);
      if (v != k) prefetch_row(v + (t + kPrefetchRows) * stride, D);
    }
    const C* kt = k + t * stride;
    vf sums[J] = {};
    for (int64_t a = 0; a < NV; ++a) {
      const vf kr = load_e(kt + a * NR);
      for (int h = 0; h < J; ++h) sums[h] += load(qs + h * D + a * NR) * kr;
    }
    for (int h = 0; h < J; ++h) {
      float x = hsum(sums[h]);
      if constexpr (std::is_same_v<C, int8_t>) x *= ks[t * sstride];
      s[h * sstep + t] = x;
      m[h] = std::max(m[h], x);
    }
  }
}

// attend_heads for rows of more than 8 vectors (multi-head latent attention's latent row,
// C + R numbers, is keys and values of every head): up to kWideHeads heads, whose queries
// no longer fit the registers. Each key row is read once for them all, its vectors loaded
// one at a time and multiplied into every head's sum (the queries read from the core's L1
// cache); the value pass runs over blocks of rows that stay in L1, kWideChunk output
// vectors of every head at a time, the sums kept in scratch between chunks. Every sum runs
// over the same terms in the same order as `attend`'s, so the results are the same.
// s: scratch of kWideHeads rows of n + NR floats, then 2 kWideHeads rows of D floats.
template <class E, class C>
void attend_heads_wide(const Problem& p, int cnt, const E* q, const C* k, const C* v,
                       const float* ks, const float* vs, ptrdiff_t stride, ptrdiff_t sstride,
                       int64_t n, E* o, float* s) {
  constexpr bool coded = std::is_same_v<C, int8_t>;
  const int64_t D = p.D, NV = D / NR;
  if (n <= 0) {
    for (int64_t i = 0; i < cnt * D; ++i) set_e(o + i, 0.0f);
    return;
  }
  const int64_t sstep = (n + NR - 1) / NR * NR;
  float* qs = s + kWideHeads * (p.T + NR);
  float* acc = qs + kWideHeads * D;
  float m[kWideHeads];
  for (int h = 0; h < cnt; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    for (int64_t d = 0; d < D; ++d) qs[h * D + d] = to_float(q[h * D + d]) * p.scale;
  }
  switch (cnt) {  // the heads' count a constant, so their sums stay in registers
#define HPNLP_WIDE_SCORES(j) \
  case j: wide_scores<j>(qs, k, v, ks, stride, sstride, n, D, s, sstep, m); break;
    HPNLP_WIDE_SCORES(1) HPNLP_WIDE_SCORES(2) HPNLP_WIDE_SCORES(3) HPNLP_WIDE_SCORES(4)
    HPNLP_WIDE_SCORES(5) HPNLP_WIDE_SCORES(6) HPNLP_WIDE_SCORES(7)
    default: wide_scores<kWideHeads>(qs, k, v, ks, stride, sstride, n, D, s, sstep, m); break;
#undef HPNLP_WIDE_SCORES
  }
  float inv[kWideHeads];
  softmax_rows<coded>(cnt, s, sstep, n, m, vs, sstride, inv);
  for (int64_t i = 0; i < cnt * D; ++i) acc[i] = 0.0f;
  const int64_t block = wide_block_rows(D);
  for (int64_t t0 = 0; t0 < n; t0 += block) {
    const int64_t t1 = std::min(n, t0 + block);
    for (int64_t a = 0; a < NV;) {
      const int64_t d = a * NR, cw = std::min<int64_t>(kWideChunk, NV - a);
      if (cw == 3)
        weighted_rows_heads<kWideHeads, 3>(cnt, s, sstep, v + d, stride, t0, t1, acc + d, D);
      else if (cw == 2)
        weighted_rows_heads<kWideHeads, 2>(cnt, s, sstep, v + d, stride, t0, t1, acc + d, D);
      else
        weighted_rows_heads<kWideHeads, 1>(cnt, s, sstep, v + d, stride, t0, t1, acc + d, D);
      a += cw;
    }
  }
  for (int h = 0; h < cnt; ++h)
    for (int64_t a = 0; a < NV; ++a)
      store_e(o + h * D + a * NR, load(acc + h * D + a * NR) * inv[h]);
}

template <class E, class C>
using HeadsFn = void (*)(const Problem&, int, const E*, const C*, const C*, const float*,
                         const float*, ptrdiff_t, ptrdiff_t, int64_t, E*, float*);

// attend_heads for D = NV vectors (and how many heads it takes at once), attend_heads_wide
// for more than 8 whole vectors, or null where D is not whole vectors.
template <class E, class C>
HeadsFn<E, C> heads_kernel(int64_t D, int* at_once) {
  if (D % NR) return nullptr;
  if (D / NR > 8) {  // at 8 vectors attend_heads' 2 heads at once in registers ran faster
    *at_once = kWideHeads;
    return attend_heads_wide<E, C>;
  }
  switch (D / NR) {
#define HPNLP_HEADS_CASE(nv) \
  case nv:                   \
    *at_once = heads_at_once<nv>(); \
    return attend_heads<nv, E, C>;
    HPNLP_HEADS_CASE(1) HPNLP_HEADS_CASE(2) HPNLP_HEADS_CASE(3) HPNLP_HEADS_CASE(4)
    HPNLP_HEADS_CASE(5) HPNLP_HEADS_CASE(6) HPNLP_HEADS_CASE(7) HPNLP_HEADS_CASE(8)
#undef HPNLP_HEADS_CASE
    default:
      return nullptr;
  }
}

// Keys row b's query j may see.
inline int64_t visible(const Problem& p, int64_t b, int64_t j) {
  return std::min(p.T, std::max<int64_t>(0, int64_t(p.index[b * p.index_step]) + j + 1));
}

template <class E, class C>
void run(const Problem& p, const E* q, const C* k, const C* v, const float* ks, const float* vs,
         E* o, int threads) {
  int64_t seen = 0;  // keys the rows' last queries see, over the batch
  for (int64_t b = 0; b < p.B; ++b) seen += visible(p, b, p.L - 1);
  const int64_t floats = p.H * 2 * p.D * seen * p.L;
  const int use = clamp_threads(std::min<int64_t>(threads, 1 + floats / kFloatsPerThread),
                                p.B * p.H);
  // An item is some of one (b, group)'s query heads, run one after the other by one thread:
  // the first reads the group's keys and values from memory, the rest find them in its cache.
  // (Items of one head each, with the group's heads on different threads at once, each
  // waited for the same rows from memory: 4 key/value heads of 8 decoded no faster than 8.)
  // Groups are split only where they do not share out evenly over the threads: fewer groups
  // than threads into one piece a thread (1 group on 2 threads: 2 items), more into two
  // pieces a thread (3 groups on 2 threads: 6 items, not 2 + 1).
  const int64_t per_group = p.H / p.G, groups = p.B * p.G;
  const int64_t pieces = groups < use ? use : 2 * use;
  const int64_t split = groups % use == 0
                            ? 1
                            : std::min<int64_t>(per_group, (pieces + groups - 1) / groups);
  const int64_t per_item = (per_group + split - 1) / split, items = groups * split;
  // An item of several heads runs them a few at once (attend_heads) where the head dim is 1
  // to 8 whole vectors, up to 8 at once (attend_heads_wide) where it is more whole vectors;
  // otherwise (and for one head) one at a time (attend).
  int at_once = 1;
  const HeadsFn<E, C> heads = per_item > 1 ? heads_kernel<E, C>(p.D, &at_once) : nullptr;
  std::atomic<int64_t> next{0};
  join_parallel(use, [&](int) {
    // attend's q and scores; a heads kernel's scores (and attend_heads_wide's queries and sums)
    std::vector<float> scratch(size_t(p.D + NR) + size_t(at_once) * size_t(p.T + NR + 2 * p.D));
    float *qs = scratch.data(), *s = qs + p.D + NR;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = i / split / p.G, g = i / split % p.G;
      const int64_t first = g * per_group + i % split * per_item;
      const int64_t last = std::min(first + per_item, (g + 1) * per_group);
      const ptrdiff_t stride = p.G * p.D;
      const int64_t head = b * p.T * p.G + g;
      const C *kh = k + head * p.D, *vh = v + head * p.D;
      const float *ksh = ks ? ks + head : nullptr, *vsh = vs ? vs + head : nullptr;
      if (heads) {
        for (int64_t j = 0; j < p.L; ++j)
          for (int64_t h = first; h < last; h += at_once) {
            const int64_t row = ((b * p.L + j) * p.H + h) * p.D;
            heads(p, int(std::min<int64_t>(at_once, last - h)), q + row, kh, vh, ksh, vsh,
                  stride, p.G, visible(p, b, j), o + row, s);
          }
        continue;
      }
      for (int64_t h = first; h < last; ++h)
        for (int64_t j = 0; j < p.L; ++j) {
          const int64_t row = ((b * p.L + j) * p.H + h) * p.D;
          attend(p, q + row, kh, vh, ksh, vsh, stride, p.G, visible(p, b, j), o + row, qs, s);
        }
    }
  });
}

// The problem the buffers pose, after checking their shapes (scales: [B, T, G], or absent).
ffi::Error make_problem(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                        ffi::Span<const int64_t> vd, ffi::Span<const int64_t> id,
                        const ffi::Span<const int64_t>* sd, float scale, const int32_t* index,
                        Problem* p) {
  const char* kernel = "cached attention";
  if (qd.size() != 4)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": q must be [B, L, H, D]");
  const int64_t B = qd[0], L = qd[1], H = qd[2], D = qd[3];
  if (kd.size() != 4)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(kernel) + ": k must be 4-D");
  const int64_t Tn = kd[1], G = kd[2];
  if (G < 1 || H % G)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": k's heads must divide q's");
  for (auto e : {check_dims(kernel, "k", kd, {B, Tn, G, D}),
                 check_dims(kernel, "v", vd, {B, Tn, G, D}),
                 id.size() == 0 ? ffi::Error::Success() : check_dims(kernel, "index", id, {B}),
                 sd ? check_dims(kernel, "k_scale and v_scale", *sd, {B, Tn, G})
                    : ffi::Error::Success()})
    if (e.failure()) return e;
  *p = Problem{B, L, Tn, H, G, D, index, id.size() == 0 ? 0 : 1, scale};
  return ffi::Error::Success();
}

template <ffi::DataType T>
ffi::Error Impl(ffi::ThreadPool xla, float scale, int64_t threads, ffi::Buffer<T> q,
                ffi::Buffer<T> k, ffi::Buffer<T> v, ffi::Buffer<ffi::S32> index,
                ffi::ResultBuffer<T> o) try {
  XlaPool::Scope scope(&xla);
  Problem p;
  ffi::Error e = make_problem(q.dimensions(), k.dimensions(), v.dimensions(), index.dimensions(),
                              nullptr, scale, index.typed_data(), &p);
  if (e.failure()) return e;
  run(p, q.typed_data(), k.typed_data(), v.typed_data(), nullptr, nullptr, o->typed_data(),
      int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("cached attention");
}

ffi::Error ImplI8(ffi::ThreadPool xla, float scale, int64_t threads, ffi::Buffer<ffi::F32> q,
                  ffi::Buffer<ffi::S8> k, ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> ks,
                  ffi::Buffer<ffi::F32> vs, ffi::Buffer<ffi::S32> index,
                  ffi::ResultBuffer<ffi::F32> o) try {
  XlaPool::Scope scope(&xla);
  Problem p;
  const ffi::Span<const int64_t> ksd = ks.dimensions();
  ffi::Error e = make_problem(q.dimensions(), k.dimensions(), v.dimensions(), index.dimensions(),
                              &ksd, scale, index.typed_data(), &p);
  if (e.success()) e = check_dims("cached attention", "v_scale", vs.dimensions(), {p.B, p.T, p.G});
  if (e.failure()) return e;
  run(p, q.typed_data(), k.typed_data(), v.typed_data(), ks.typed_data(), vs.typed_data(),
      o->typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("cached attention");
}

template <ffi::DataType T>
auto binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Attr<float>("scale")
      .Attr<int64_t>("threads")
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<T>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpCachedAttention, Impl<ffi::DataType::F32>,
                              binding<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpCachedAttentionBf16, Impl<ffi::DataType::BF16>,
                              binding<ffi::DataType::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpCachedAttentionI8, ImplI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("threads")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
