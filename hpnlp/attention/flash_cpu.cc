// Exact softmax attention on the CPU as two XLA FFI kernels, forward and backward
// (FlashAttention-2, Dao 2023): O(L) memory, no [L, S] matrix, one pass over the keys
// per block of queries forward, one pass over the queries per block of keys backward.
//
// Why a kernel: built from XLA ops, each [Q, K] tile is a separate product, a separate
// exp fusion and another product, each a round trip through memory and a parallel
// region split over both cores. Here one thread owns a (batch, head) or a block of its
// queries at a time, so every tile it makes stays in its core's cache between the product
// that makes it and the ones that read it, and the softmax arithmetic runs on the tile
// while it is hot.
//
// Every product is C (+)= A B with B row-major and A read by broadcasts along its rows, in
// register blocks of 6 rows x 64 columns (6 x 16 with AVX2), its operands in 64-byte
// aligned scratch (a vector load that spans two cache lines slowed both passes ~1.1x on a
// Xeon model 167). The forward tile is query-major, S = Q K^T [queries, keys], so both of
// its products read their left operand by rows (a column-wise read runs ~15% slower),
// against a K^T packed once per head in blocks. The backward tiles are key-major, S^T = K
// Q^T [keys, queries]: their products read rows and the per-query logsumexp and delta are
// lane-wise vector operations; dQ is made transposed, dQ^T += K^T dS^T against each key
// block's K^T packed once (dQ += dS K read dS^T by columns: the pass ran 1.03x faster
// transposed there). Its queries and dO are packed transposed, [D, Q], once per query
// block and work item (packed again for every key block, the scalar transposes took 5% of
// the pass; once, the bfloat16 pass's four packings, it ran 1.18x faster on a Xeon model
// 207). Operands are first copied contiguous per head: in [B, L, H, D] rows sit H*D floats
// apart, which maps them onto a few L1 sets. The softmax runs in base 2 (vexp2_0 in
// simd.h), its scores scaled by log2 e with the queries.
//
// Masks: causal (query i sees keys <= i) and segment ids (0 = padding; a query sees keys
// of its own nonzero segment). A tile that no query may see is skipped, a tile that all
// may see runs unmasked, and only the tiles the diagonal or a segment edge crosses are
// masked elementwise. Rows that see no key output zeros, with logsumexp +inf.
//
// Layouts: q, o, dq [B, L, H, D]; k, v, dk, dv [B, S, H, D]; lse [B, H, L] (base 2); segment ids
// [B, L] and [B, S] int32 (used when the attribute `segments` is set). D a multiple of 16.

#include <array>
#include <chrono>
#include <memory>
#include <cmath>
#include <limits>
#include <type_traits>

#define HPNLP_NATIVE_VECTORS  // whole vectors of NR floats (simd.h)
#include "simd.h"

namespace ffi = xla::ffi;
using namespace hpnlp;  // NOLINT: the kernel's vocabulary (vf, load, ...)

namespace {

constexpr int MR = 6;    // rows per register block: 6 x 4 accumulators + 4 panel vectors
constexpr int KC = 256;  // k per cache block of a product

// C[R, NV*NR] (+)= A[R, K] B[K, NV*NR]; A(i, k) = a[i*lda + k], B row-major (ldb). `Acc`
// (add to C) is a template argument: a runtime choice makes GCC keep the accumulators on
// the stack around the loop.
template <int R, int NV, bool Acc>
void tile(const float* a, ptrdiff_t lda, int K, const float* b, ptrdiff_t ldb, float* c,
          ptrdiff_t ldc) {
#if defined(__AVX512F__)
  reg_tile<R, NV, Acc>(a, lda, 1, K, b, ldb, c, ldc);
#else
  // AVX2's 16 registers hold R x 2 accumulators (the classic 6 x 16 tile), not R x 4.
  if constexpr (NV > 2) {
    reg_tile<R, 2, Acc>(a, lda, 1, K, b, ldb, c, ldc);
    reg_tile<R, NV - 2, Acc>(a, lda, 1, K, b + 2 * NR, ldb, c + 2 * NR, ldc);
  } else {
    reg_tile<R, NV, Acc>(a, lda, 1, K, b, ldb, c, ldc);
  }
#endif
}

using TileFn = void (*)(const float*, ptrdiff_t, int, const float*, ptrdiff_t, float*, ptrdiff_t);
using TileTable = std::array<std::array<std::array<TileFn, MR>, 4>, 2>;  // [acc][NV - 1][R - 1]

template <bool Acc, int NV, int... R>
constexpr std::array<TileFn, MR> row_table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, NV, Acc>...};
}

template <bool Acc, int... NV>
constexpr std::array<std::array<TileFn, MR>, 4> nv_table(std::integer_sequence<int, NV...>) {
  return {row_table<Acc, NV + 1>(std::make_integer_sequence<int, MR>{})...};
}

constexpr TileTable kTiles = {nv_table<false>(std::make_integer_sequence<int, 4>{}),
                              nv_table<true>(std::make_integer_sequence<int, 4>{})};

// C[M, N] (+)= A[M, K] B[K, N], A and B row-major (lda, ldb), N % NR == 0. Register
// blocks of up to MR rows (near-equal: 128 rows are 18 blocks of 6 and 4 of 5, not 21 of
// 6 and one of 2) x 4 vectors; k in blocks of KC, so a block of B (at most KC x 64 floats)
// stays in L1 while every block of rows passes over it.
void gemm(int M, int N, int K, const float* a, ptrdiff_t lda, const float* b, ptrdiff_t ldb,
          float* c, ptrdiff_t ldc, bool accumulate) {
  if (K == 0) {
    if (!accumulate)
      for (int i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return;
  }
  const int blocks = (M + MR - 1) / MR;
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int kc = std::min(KC, K - k0);
    const bool acc_in = accumulate || k0 > 0;
    for (int n0 = 0; n0 < N; n0 += 4 * NR) {
      const auto& fns = kTiles[acc_in][std::min(4, (N - n0) / NR) - 1];
      for (int blk = 0, i = 0; blk < blocks; ++blk) {
        const int rows = M / blocks + (blk < M % blocks);
        fns[rows - 1](a + i * lda + k0, lda, kc, b + k0 * ldb + n0, ldb, c + i * ldc + n0, ldc);
        i += rows;
      }
    }
  }
}

constexpr float kInf = std::numeric_limits<float>::infinity();
// The softmax runs in base 2 (vexp2_0): scores scaled by log2 e, the running max m and
// the saved logsumexp in base 2 (only the backward pass reads it). Saved in base e and
// converted back there, each probability took two more roundings of a number of the
// scores' size: at scores near 1e4, dV was off by 1.1e-3 to 1.6e-3 of its largest entry
// over 8 draws, against at most 5.9e-4 in base 2 (found in review; the test
// test_gradients_hold_float32_accuracy_at_large_scores).
constexpr float kLog2e = 1.44269504088896341f;

struct Problem {
  int64_t B, L, S, H, D;
  bool causal;
  float scale;
  const float *q, *k, *v;        // [B, L, H, D], [B, S, H, D] x2 (float32 kernel)
  const int32_t *qseg, *kseg;    // [B, L], [B, S], or null
  int bq, bk;                    // block sizes, multiples of NR
  const bf16 *q16 = nullptr, *k16 = nullptr, *v16 = nullptr;  // the same (bfloat16 kernel)
  bool widen = false;  // the bfloat16 kernel's products widened to float32 (dot2_wide), not
                       // the CPU's own bfloat16 instructions (vdpbf16ps, AMX)
  // Row r of head (b, h) of a [B, n, H, D] array.
  size_t row(int64_t b, int64_t n, int64_t h, int64_t r) const { return ((b * n + r) * H + h) * D; }
};

enum class Vis { kSkip, kFull, kPartial };

// Which pairs of query block [q0, q0+nq) and key block [k0, k0+nk) of batch row b may attend.
Vis classify(const Problem& p, int64_t b, int64_t q0, int nq, int64_t k0, int nk) {
  bool full = true;
  if (p.causal) {
    if (k0 > q0 + nq - 1) return Vis::kSkip;
    full = k0 + nk - 1 <= q0;
  }
  if (p.qseg == nullptr) return full ? Vis::kFull : Vis::kPartial;
  const int32_t* qs = p.qseg + b * p.L + q0;
  const int32_t* ks = p.kseg + b * p.S + k0;
  int32_t qmin = qs[0], qmax = qs[0];
  for (int i = 1; i < nq; ++i) qmin = std::min(qmin, qs[i]), qmax = std::max(qmax, qs[i]);
  bool any_key = false, any_pad = false;
  int32_t kmin = 0, kmax = 0;
  for (int i = 0; i < nk; ++i) {
    if (ks[i] == 0) { any_pad = true; continue; }
    kmin = any_key ? std::min(kmin, ks[i]) : ks[i];
    kmax = any_key ? std::max(kmax, ks[i]) : ks[i];
    any_key = true;
  }
  if (!any_key || qmax < kmin || qmin > kmax) return Vis::kSkip;
  if (full && !any_pad && qmin == qmax && kmin == kmax && qmin == kmin) return Vis::kFull;
  return Vis::kPartial;
}

// Set the scores of pairs that may not attend to -inf: query q0+c, key k0+r at
// t[r * ld + c] (KeysAreRows: an S^T tile) or t[c * ld + r] (an S tile). Padding lanes
// past nq or nk are left alone. Each row of the tile is one query (or key): the causal
// rule leaves a contiguous range of its lanes, and the segment rule is one compare per
// lane against the row's own segment, a loop the compiler vectorizes (a scalar test per
// pair took a fifth of the forward at L = 128, where most tiles straddle the diagonal).
template <bool KeysAreRows>
void mask_tile(const Problem& p, int64_t b, int64_t q0, int nq, int64_t k0, int nk, float* t,
               int ld) {
  const int32_t* qs = p.qseg ? p.qseg + b * p.L + q0 : nullptr;
  const int32_t* ks = p.kseg ? p.kseg + b * p.S + k0 : nullptr;
  const int rows = KeysAreRows ? nk : nq, lanes = KeysAreRows ? nq : nk;
  const int32_t* lane_seg = KeysAreRows ? qs : ks;
  for (int i = 0; i < rows; ++i) {
    float* row = t + size_t(i) * ld;
    int lo = 0, hi = lanes;  // causal: query q0+c sees key k0+r iff q0 + c >= k0 + r
    if (p.causal) {
      if (KeysAreRows)
        lo = int(std::clamp<int64_t>(k0 + i - q0, 0, lanes));
      else
        hi = int(std::clamp<int64_t>(q0 + i - k0 + 1, 0, lanes));
    }
    const int32_t own = qs ? (KeysAreRows ? ks[i] : qs[i]) : 1;
    if (own == 0) lo = hi = 0;  // a padding key or query: nothing in its row may attend
    std::fill(row, row + lo, -kInf);
    if (qs)  // a lane's segment 0 (padding) never equals a nonzero own segment
      for (int j = lo; j < hi; ++j) row[j] = lane_seg[j] == own ? row[j] : -kInf;
    std::fill(row + std::max(lo, hi), row + lanes, -kInf);
  }
}

// Head (b, h) of x [B, len, H, D] as contiguous rows, out [len, D]. Rows H*D apart map
// to a few L1 sets (a 2 KB stride at H*D = 512), so every operand a product streams is
// copied contiguous first.
void gather_head(const Problem& p, const float* x, int64_t len, int64_t b, int64_t h, float* out) {
  for (int64_t r = 0; r < len; ++r)
    std::memcpy(out + r * p.D, x + p.row(b, len, h, r), sizeof(float) * p.D);
}

// Rows [0, n) of x [n, D] (contiguous), transposed and scaled into out [D, ld]; columns
// past n are zero.
void pack_t(const float* x, int n, int64_t D, float scale, float* out, int ld) {
  for (int64_t d = 0; d < D; ++d) std::fill(out + d * ld + n, out + (d + 1) * ld, 0.0f);
  for (int c = 0; c < n; ++c)
    for (int64_t d = 0; d < D; ++d) out[d * ld + c] = x[c * D + d] * scale;
}

// ---------------------------------------------------------------------------- forward

inline void put(float* dst, vf v) { store(dst, v); }
inline void put(bf16* dst, vf v) { store_bf16(dst, v); }

// One query row of a forward tile, online softmax in base 2: row holds its scores S
// scaled by log2 e (`lanes` wide, keys past nk set to -inf here; multiplied by `scale`
// first when Scale), P = 2^(S - m) goes to prow (float or bfloat16; 0 while no key is
// visible), the running max m and sum l move on, and the row's unnormalized output
// acc_row [D] is rescaled to the new max.
template <bool Scale, class T>
void softmax_row(float* row, T* prow, int nk, int lanes, float scale, float& m, float& l,
                 float* acc_row, int64_t D) {
  for (int r = nk; r < lanes; ++r) row[r] = -kInf;  // keys past S
  vf mx = splat(-kInf);
  for (int r = 0; r < lanes; r += NR) {
    vf x = load(row + r);
    if constexpr (Scale) {
      x *= scale;
      store(row + r, x);
    }
    mx = x > mx ? x : mx;
  }
  const float m_new = std::max(m, hmax(mx));
  if (m_new == -kInf) {  // nothing visible yet: P = 0 (the row holds -inf)
    std::fill(prow, prow + lanes, T(0));
    return;
  }
  vf sum = vf{};
  for (int r = 0; r < lanes; r += NR) {
    const vf e = vexp2_0(load(row + r) - m_new);
    put(prow + r, e);
    sum += e;
  }
  const float corr = m == -kInf ? 0.0f : std::exp2(m - m_new);
  l = l * corr + hsum(sum);
  m = m_new;
  if (corr != 1.0f)
    for (int64_t d = 0; d < D; d += NR) store(acc_row + d, load(acc_row + d) * corr);
}

// The finished rows [0, nq) of query block q0 of head bh: out = acc / l and the
// logsumexp; a row that saw no key outputs zeros with logsumexp +inf (so that P =
// exp(s - inf) = 0 in the backward pass).
template <class T>
void finish_rows(const Problem& p, int64_t bh, int64_t q0, int nq, const float* acc,
                 const float* m, const float* l, T* o, float* lse) {
  const int64_t D = p.D;
  for (int c = 0; c < nq; ++c) {
    T* out = o + p.row(bh / p.H, p.L, bh % p.H, q0 + c);
    // a row that saw a key: a NaN sum too, written as the XLA twin writes it (a review,
    // session 116: it counted as no key, its output zeros)
    if (!(l[c] == 0.0f)) {
      const vf inv = splat(1.0f / l[c]);
      for (int64_t d = 0; d < D; d += NR) put(out + d, load(acc + c * D + d) * inv);
      lse[bh * p.L + q0 + c] = m[c] + std::log2(l[c]);  // base 2, as m
    } else {
      std::fill(out, out + D, T(0));
      lse[bh * p.L + q0 + c] = kInf;
    }
  }
}

// Head (b, h) of x [B, len, H, D] transposed in blocks of bk rows, out [ceil(len/bk), D, bk]
// (columns past len zero): the right-hand operand of S = Q K^T, a block at a time.
void gather_head_t(const Problem& p, const float* x, int64_t len, int64_t b, int64_t h, int bk,
                   float* out) {
  const int64_t blocks = (len + bk - 1) / bk;
  if (blocks == 0) return;
  std::fill(out + (blocks - 1) * p.D * bk, out + blocks * p.D * bk, 0.0f);  // the last block's tail
  for (int64_t r = 0; r < len; ++r) {
    const float* src = x + p.row(b, len, h, r);
    float* dst = out + (r / bk) * p.D * bk + r % bk;
    for (int64_t d = 0; d < p.D; ++d) dst[d * bk] = src[d];
  }
}

// Query block i of head bh, from the head's blocked K^T (`kt`, see gather_head_t) and
// contiguous values vh [S, D]: its output rows and logsumexp. The forward tile is
// query-major, S = Q K^T [Q, K], so that both of its products read their left operand
// by rows (a column-wise read of the left operand runs ~15% slower).
void forward_block(const Problem& p, int64_t bh, int64_t i, const float* kt, const float* vh,
                   float* o, float* lse, Scratch& scratch) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D;
  const int bq = p.bq, bk = p.bk;
  const int64_t q0 = i * bq;
  const int nq = int(std::min<int64_t>(bq, p.L - q0));
  scratch.resize(size_t(bq) * (2 * D + bk + 2));
  float* qs = scratch.data();                      // [bq, D] scaled queries
  float* st = qs + size_t(bq) * D;                 // [bq, bk] S, then P
  float* acc = st + size_t(bq) * bk;               // [bq, D] unnormalized output
  float* m = acc + size_t(bq) * D;                 // [bq] running max
  float* l = m + bq;                               // [bq] running sum
  for (int c = 0; c < nq; ++c) {
    const float* src = p.q + p.row(b, p.L, h, q0 + c);
    for (int64_t d = 0; d < D; ++d) qs[c * D + d] = src[d] * (p.scale * kLog2e);
  }
  std::fill(acc, acc + size_t(bq) * D, 0.0f);
  std::fill(m, m + bq, -kInf);
  std::fill(l, l + bq, 0.0f);
  for (int64_t k0 = 0; k0 < p.S; k0 += bk) {
    const int nk = int(std::min<int64_t>(bk, p.S - k0)), lanes = (nk + NR - 1) / NR * NR;
    const Vis vis = classify(p, b, q0, nq, k0, nk);
    if (vis == Vis::kSkip) {
      if (p.causal && k0 > q0 + nq - 1) break;  // every later key block is in the future
      continue;
    }
    gemm(nq, lanes, int(D), qs, D, kt + (k0 / bk) * D * bk, bk, st, bk, false);  // S = Q K^T
    if (vis == Vis::kPartial) mask_tile<false>(p, b, q0, nq, k0, nk, st, bk);
    for (int c = 0; c < nq; ++c) {  // P over S in place (the queries came scaled)
      float* row = st + size_t(c) * bk;
      softmax_row<false>(row, row, nk, lanes, 1.0f, m[c], l[c], acc + c * D, D);
    }
    gemm(nq, int(D), nk, st, bk, vh + k0 * D, D, acc, D, true);  // acc += P V
  }
  finish_rows(p, bh, q0, nq, acc, m, l, o, lse);
}

// --------------------------------------------------------------------------- backward

template <class T>  // float or bf16: the inputs' and gradients' type
struct GradsT {
  const T* o;
  const float* lse;
  const T* d_o;
  T *dq, *dk, *dv;
};
using Grads = GradsT<float>;



// Head bh, key blocks [kb0, kb1): dk, dv of those keys by key blocks (dK, dV accumulate in
// scratch for the block) and, inside, query blocks (dQ^T accumulates over the key blocks,
// [nqb, D, bq] by query blocks). dQ goes to g.dq (scaled) when the range is all key
// blocks, else to dq_part [L, D] (unscaled), this range's share, which `run_backward` sums.
void backward_head(const Problem& p, const Grads& g, int64_t bh, int64_t kb0, int64_t kb1,
                   float* dq_part, Scratch& scratch) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D, L = p.L, S = p.S;
  const int bq = p.bq, bk = p.bk;
  const int64_t nqb = (L + bq - 1) / bq;
  scratch.resize(size_t(D) * (2 * L + 2 * S + 3 * nqb * bq + 3 * bk) + 2 * size_t(bk) * bq +
                 2 * bq + L);
  float* qh = scratch.data();             // [L, D] this head's queries
  float* doh = qh + L * D;                // [L, D] its output gradient
  float* kh = doh + L * D;                // [S, D]
  float* vh = kh + S * D;                 // [S, D]
  float* qt_all = vh + S * D;             // [nqb, D, bq] scaled Q^T by query blocks
  float* dot_all = qt_all + nqb * D * bq; // [nqb, D, bq] dO^T
  float* dqt_all = dot_all + nqb * D * bq;  // [nqb, D, bq] dQ^T (unscaled)
  float* pt = dqt_all + nqb * D * bq;     // [bk, bq] P^T
  float* dst = pt + size_t(bk) * bq;      // [bk, bq] dP^T, then dS^T
  float* dk = dst + size_t(bk) * bq;      // [bk, D]
  float* dv = dk + size_t(bk) * D;        // [bk, D]
  float* ktb = dv + size_t(bk) * D;       // [D, bk] the key block's K^T
  float* lse_b = ktb + size_t(bk) * D;    // [bq]
  float* delta_b = lse_b + bq;            // [bq]
  float* delta = delta_b + bq;            // [L] rowsum(dO * O) = rowsum(P * dP)
  gather_head(p, p.q, L, b, h, qh);
  gather_head(p, g.d_o, L, b, h, doh);
  gather_head(p, p.k, S, b, h, kh);
  gather_head(p, p.v, S, b, h, vh);
  std::fill(dqt_all, dqt_all + nqb * D * bq, 0.0f);
  for (int64_t r = 0; r < L; ++r) {
    const float* orow = g.o + p.row(b, L, h, r);
    vf s = vf{};
    for (int64_t d = 0; d < D; d += NR) s += load(orow + d) * load(doh + r * D + d);
    delta[r] = hsum(s);
  }
  const float* lse = g.lse + bh * L;
  std::vector<bool> packed(nqb, false);  // a query block's Q^T and dO^T, packed at first use
  for (int64_t k0 = kb0 * bk; k0 < std::min(S, kb1 * bk); k0 += bk) {
    const int nk = int(std::min<int64_t>(bk, S - k0));
    const float *kb = kh + k0 * D, *vb = vh + k0 * D;
    std::fill(dk, dk + size_t(bk) * D, 0.0f);
    std::fill(dv, dv + size_t(bk) * D, 0.0f);
    pack_t(kb, nk, D, 1.0f, ktb, bk);
    for (int64_t q0 = 0; q0 < L; q0 += bq) {
      const int nq = int(std::min<int64_t>(bq, L - q0));
      const Vis vis = classify(p, b, q0, nq, k0, nk);
      if (vis == Vis::kSkip) continue;
      const float *qb = qh + q0 * D, *dob = doh + q0 * D;
      float *qt = qt_all + (q0 / bq) * D * bq, *dot = dot_all + (q0 / bq) * D * bq;
      float* dqt = dqt_all + (q0 / bq) * D * bq;
      if (!packed[q0 / bq]) {  // once per item, not once per key block (5% of the pass)
        pack_t(qb, nq, D, p.scale * kLog2e, qt, bq);  // S^T in base 2
        pack_t(dob, nq, D, 1.0f, dot, bq);
        packed[q0 / bq] = true;
      }
      for (int c = 0; c < bq; ++c) {  // padding columns: P = 0, dS = 0
        lse_b[c] = c < nq ? lse[q0 + c] : kInf;
        delta_b[c] = c < nq ? delta[q0 + c] : 0.0f;
      }
      gemm(nk, bq, int(D), kb, D, qt, bq, pt, bq, false);    // S^T = K Q^T
      if (vis == Vis::kPartial) mask_tile<true>(p, b, q0, nq, k0, nk, pt, bq);
      gemm(nk, bq, int(D), vb, D, dot, bq, dst, bq, false);  // dP^T = V dO^T
      for (int r = 0; r < nk; ++r) {
        float *prow = pt + size_t(r) * bq, *drow = dst + size_t(r) * bq;
        for (int c = 0; c < bq; c += NR) {
          vf pv = vexp2_0(load(prow + c) - load(lse_b + c));
          store(prow + c, pv);
          store(drow + c, pv * (load(drow + c) - load(delta_b + c)));
        }
      }
      gemm(nk, int(D), nq, pt, bq, dob, D, dv, D, true);     // dV += P^T dO
      gemm(nk, int(D), nq, dst, bq, qb, D, dk, D, true);     // dK += dS^T Q (unscaled)
      gemm(int(D), bq, nk, ktb, bk, dst, bq, dqt, bq, true);  // dQ^T += K^T dS^T
    }
    for (int r = 0; r < nk; ++r) {
      float *dkr = g.dk + p.row(b, S, h, k0 + r), *dvr = g.dv + p.row(b, S, h, k0 + r);
      for (int64_t d = 0; d < D; ++d) {
        dkr[d] = dk[r * D + d] * p.scale;  // dK = dS^T (scale Q); the product used Q
        dvr[d] = dv[r * D + d];
      }
    }
  }
  for (int64_t r = 0; r < L; ++r) {  // dQ from its blocks of dQ^T
    const float* col = dqt_all + (r / bq) * D * bq + r % bq;
    float* row = dq_part != nullptr ? dq_part + r * D : g.dq + p.row(b, L, h, r);
    const float s = dq_part != nullptr ? 1.0f : p.scale;
    for (int64_t d = 0; d < D; ++d) row[d] = col[d * bq] * s;
  }
}

// ------------------------------------------------------------------------------- FFI

template <ffi::DataType T>  // F32 or BF16
ffi::Error make_problem(const char* kernel, ffi::Buffer<T>& q, ffi::Buffer<T>& k,
                        ffi::Buffer<T>& v, ffi::Buffer<ffi::S32>& qseg,
                        ffi::Buffer<ffi::S32>& kseg, bool segs, bool causal, float scale, int64_t block_q,
                        int64_t block_k, bool widen, Problem* p) {
  auto d = q.dimensions();
  if (d.size() != 4 || d[3] % TILE != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": q must be [B, L, H, D] with D a multiple of 16");
  if (block_q <= 0 || block_q % TILE != 0 || block_k <= 0 || block_k % TILE != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": block_q and block_k must be positive multiples of 16");
  const int64_t B = d[0], L = d[1], H = d[2], D = d[3];
  auto kd = k.dimensions();
  if (kd.size() != 4)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(kernel) + ": k must be 4-D");
  const int64_t S = kd[1];
  for (auto e : {check_dims(kernel, "k", kd, {B, S, H, D}), check_dims(kernel, "v", v.dimensions(), {B, S, H, D}),
                 check_dims(kernel, "qseg", qseg.dimensions(), {segs ? B : 0, segs ? L : 0}),
                 check_dims(kernel, "kseg", kseg.dimensions(), {segs ? B : 0, segs ? S : 0})})
    if (e.failure()) return e;
  *p = Problem{B, L, S, H, D, causal, scale, nullptr, nullptr, nullptr,
               segs ? qseg.typed_data() : nullptr, segs ? kseg.typed_data() : nullptr,
               int(block_q), int(block_k)};
  p->widen = widen;
  if constexpr (T == ffi::DataType::BF16) {
    p->q16 = q.typed_data(), p->k16 = k.typed_data(), p->v16 = v.typed_data();
  } else {
    p->q = q.typed_data(), p->k = k.typed_data(), p->v = v.typed_data();
  }
  return ffi::Error::Success();
}

// Work items 0..n-1 over up to `threads` threads (the caller and the helpers that join:
// hpnlp::join_parallel), each taking the next from a shared counter. Each thread gives
// back the AMX tile state it may have taken when it is done.
template <class F>
void for_items(int threads, int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  join_parallel(clamp_threads(threads, n), [&](int) {
    TilesReleased released;
    Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i, scratch);
  });
}

// The forward pass: every head's K^T (in blocks) and V made contiguous once, then
// (head, query block) items.
void run_forward(const Problem& p, float* out, float* lse_out, int threads) {
  const int64_t nqb = (p.L + p.bq - 1) / p.bq;
  const int64_t KT = (p.S + p.bk - 1) / p.bk * p.bk * p.D, SD = p.S * p.D;
  auto kv = aligned_array<float>(size_t(p.B * p.H) * (KT + SD));  // all overwritten
  for_items(threads, p.B * p.H, [&](int64_t bh, Scratch&) {
    float* kt = kv.get() + bh * (KT + SD);
    gather_head_t(p, p.k, p.S, bh / p.H, bh % p.H, p.bk, kt);
    gather_head(p, p.v, p.S, bh / p.H, bh % p.H, kt + KT);
  });
  populate({{out, size_t(p.B) * p.L * p.H * p.D}}, clamp_threads(threads, p.B * p.H));
  for_items(threads, p.B * p.H * nqb, [&](int64_t item, Scratch& scratch) {
    const float* kt = kv.get() + (item / nqb) * (KT + SD);
    forward_block(p, item / nqb, item % nqb, kt, kt + KT, out, lse_out, scratch);
  });
}

// -------------------------------------------------------------------------- bfloat16
//
// The same two passes on bfloat16 q, k, v, o and dO: every product takes bfloat16 operands
// in pairs along its k (vdpbf16ps with AVX-512 BF16, see dot2 in simd.h) and accumulates in
// float32; the softmax statistics (max, sum, logsumexp, delta) and the tiles S, P, dP, dS
// are float32, and P and dS are rounded to bfloat16 only as operands of the products that
// follow (as FlashAttention does on GPUs). The scale is applied to the float32 S.
//
// Products: the CPU's own bfloat16 instructions (AMX tiles, vdpbf16ps) where it has them,
// or the pairs widened to float32 and two FMAs (dot2_wide) when Problem::widen says so or
// it has neither. Which is faster depends on the CPU, so the choice is tuned per pass with
// its blocks (`widen` in flash_cpu.py's bfloat16 tunings): on a Xeon model 207 with AVX-512
// BF16, vdpbf16ps ran both passes about 1.2x slower than widening.
//
// Layouts: a product's left operand is bfloat16 rows, read a pair at a time; its right
// operand is packed in pairs of k, row k2 holding (B(2 k2, n), B(2 k2 + 1, n)) for every n,
// so one 64-byte load feeds 16 lanes of a vdpbf16ps. Every k of a product is even (D, the
// block sizes; a tail block's pairs are padded with zeros).

// C[R, NV*NR] (+)= A[R, K] B[K, NV*NR] with A(i, k) = a[i*ar + k] and B in pairs of k
// (`ldb` bfloat16 per pair row), K even; Wide: by dot2_wide whatever the CPU has.
template <int R, int NV, bool Acc, bool Wide>
void tile2(const bf16* a, ptrdiff_t ar, int K, const bf16* b, ptrdiff_t ldb, float* c,
           ptrdiff_t ldc) {
#if !defined(__AVX512F__)
  // AVX2: one column of vectors at a time (R accumulators, the widened pairs of b and of the
  // broadcast in registers; see dot2).
  if constexpr (NV > 1) {
    tile2<R, 1, Acc, Wide>(a, ar, K, b, ldb, c, ldc);
    tile2<R, NV - 1, Acc, Wide>(a, ar, K, b + 2 * NR, ldb, c + NR, ldc);
    return;
  }
#endif
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Acc ? load(c + r * ldc + v * NR) : vf{};
  for (int k = 0; k < K; k += 2, b += ldb) {
    vf bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load(reinterpret_cast<const float*>(b) + v * NR);
    for (int r = 0; r < R; ++r) {
      const vf x = splat_pair(a + r * ar + k);
      for (int v = 0; v < NV; ++v)
        acc[r][v] = Wide ? dot2_wide(acc[r][v], x, bv[v]) : dot2(acc[r][v], x, bv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(c + r * ldc + v * NR, acc[r][v]);
}

using Tile2Fn = void (*)(const bf16*, ptrdiff_t, int, const bf16*, ptrdiff_t, float*, ptrdiff_t);

template <bool Acc, bool Wide, int NV, int... R>
constexpr std::array<Tile2Fn, MR> row_table2(std::integer_sequence<int, R...>) {
  return {&tile2<R + 1, NV, Acc, Wide>...};
}

template <bool Acc, bool Wide, int... NV>
constexpr std::array<std::array<Tile2Fn, MR>, 4> nv_table2(std::integer_sequence<int, NV...>) {
  return {row_table2<Acc, Wide, NV + 1>(std::make_integer_sequence<int, MR>{})...};
}

// kTiles2[wide][accumulate][NV - 1][R - 1]
using Tiles2 = std::array<std::array<std::array<Tile2Fn, MR>, 4>, 2>;
constexpr std::array<Tiles2, 2> kTiles2 = {
    Tiles2{nv_table2<false, false>(std::make_integer_sequence<int, 4>{}),
           nv_table2<true, false>(std::make_integer_sequence<int, 4>{})},
    Tiles2{nv_table2<false, true>(std::make_integer_sequence<int, 4>{}),
           nv_table2<true, true>(std::make_integer_sequence<int, 4>{})}};

// C[M, N] (+)= A[M, K] B[K, N], A bfloat16 rows (row stride ar), B in pairs of k (ldb
// bfloat16 per pair row, >= 2 N), K even, N % NR == 0: vector registers (widen: dot2_wide).
void gemm2_vec(int M, int N, int K, const bf16* a, ptrdiff_t ar, const bf16* b, ptrdiff_t ldb,
               float* c, ptrdiff_t ldc, bool accumulate, bool widen) {
  if (K == 0) {
    if (!accumulate)
      for (int i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return;
  }
  for (int k0 = 0; k0 < K; k0 += KC) {
    const int kc = std::min(KC, K - k0);
    const bool acc_in = accumulate || k0 > 0;
    for (int n0 = 0; n0 < N; n0 += 4 * NR) {
      const auto& fns = kTiles2[widen][acc_in][std::min(4, (N - n0) / NR) - 1];
      for (int i = 0; i < M; i += MR)
        fns[std::min(MR, M - i) - 1](a + i * ar + k0, ar, kc, b + (k0 / 2) * ldb + 2 * n0, ldb,
                                     c + i * ldc + n0, ldc);
    }
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// AMX (amx_ready, release_tiles: simd.h): one tdpbf16ps multiplies a 16 x 32 bfloat16 tile
// by a 32 x 16 one (16 pair rows, the layout gemm2's B already has) into 16 x 16 float32,
// 16 times the work of a vdpbf16ps.
// Rows [i, i + 16 NI) x columns [n, n + 16 NJ) of C over k in [0, K), K % 32 == 0: tiles 0-3
// accumulate, 4-5 hold A, 6-7 hold B.
template <int NI, int NJ>
void amx_block(int K, const bf16* a, ptrdiff_t ar, const bf16* b, ptrdiff_t ldb, float* c,
               ptrdiff_t ldc, bool accumulate) {
  // GCC's tile intrinsics are asm without memory operands: tell the compiler the tile
  // loads read memory written before (the packed operands, C) and the stores write C
  __asm__ volatile("" ::: "memory");
  const ptrdiff_t sa = ar * 2, sb = ldb * 2, sc = ldc * 4;
  float* c1 = c + 16 * ldc;
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if constexpr (NJ == 2) _tile_loadd(1, c + 16, sc);
    if constexpr (NI == 2) _tile_loadd(2, c1, sc);
    if constexpr (NI == 2 && NJ == 2) _tile_loadd(3, c1 + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NJ == 2) _tile_zero(1);
    if constexpr (NI == 2) _tile_zero(2);
    if constexpr (NI == 2 && NJ == 2) _tile_zero(3);
  }
  for (int k = 0; k < K; k += 32) {
    const bf16* bk = b + (k / 2) * ldb;
    _tile_loadd(4, a + k, sa);
    _tile_loadd(6, bk, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ == 2) {
      _tile_loadd(7, bk + 32, sb);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NI == 2) {
      _tile_loadd(5, a + 16 * ar + k, sa);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NJ == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, sc);
  if constexpr (NJ == 2) _tile_stored(1, c + 16, sc);
  if constexpr (NI == 2) _tile_stored(2, c1, sc);
  if constexpr (NI == 2 && NJ == 2) _tile_stored(3, c1 + 16, sc);
  __asm__ volatile("" ::: "memory");
}
#endif

// gemm2_vec's product: rows and k in whole tiles on AMX where the CPU has it, the rest
// (a tail of rows, a tail of k) in vector registers; widen: all of it by dot2_wide.
void gemm2(int M, int N, int K, const bf16* a, ptrdiff_t ar, const bf16* b, ptrdiff_t ldb,
           float* c, ptrdiff_t ldc, bool accumulate, bool widen) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  const int M16 = M / 16 * 16, K32 = K / 32 * 32;
  if (!widen && M16 > 0 && K32 > 0 && amx_ready()) {
    for (int i = 0; i < M16; i += 32) {
      const bool two_i = i + 32 <= M16;
      for (int n = 0; n < N; n += 32) {
        const bool two_n = n + 32 <= N;
        const bf16* ai = a + i * ar;
        const bf16* bn = b + 2 * n;
        float* cin = c + i * ldc + n;
        if (two_i && two_n) amx_block<2, 2>(K32, ai, ar, bn, ldb, cin, ldc, accumulate);
        else if (two_i) amx_block<2, 1>(K32, ai, ar, bn, ldb, cin, ldc, accumulate);
        else if (two_n) amx_block<1, 2>(K32, ai, ar, bn, ldb, cin, ldc, accumulate);
        else amx_block<1, 1>(K32, ai, ar, bn, ldb, cin, ldc, accumulate);
      }
    }
    if (K32 < K)
      gemm2_vec(M16, N, K - K32, a + K32, ar, b + (K32 / 2) * ldb, ldb, c, ldc, true, false);
    if (M16 < M)
      gemm2_vec(M - M16, N, K, a + M16 * ar, ar, b, ldb, c + M16 * ldc, ldc, accumulate, false);
    return;
  }
#endif
  gemm2_vec(M, N, K, a, ar, b, ldb, c, ldc, accumulate, widen);
}

// Rows [0, n) of x (row stride ld, `cols` wide) in pairs of rows: out[r/2][c][r%2] =
// x[r][c], rows n..n_pad-1 zero (n_pad even).
void pack_row_pairs(const bf16* x, ptrdiff_t ld, int n, int n_pad, int64_t cols, bf16* out) {
  for (int r = 0; r < n_pad; ++r) {
    bf16* dst = out + size_t(r / 2) * 2 * cols + (r & 1);
    if (r < n) {
      const bf16* src = x + r * ld;
      for (int64_t c = 0; c < cols; ++c) dst[2 * c] = src[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[2 * c] = 0;
    }
  }
}

// Rows [0, n) of x (row stride ld, D wide) transposed into pairs of d: out[d/2][j][d%2] =
// x[j][d], for j < n_pad (zero past n). A 32-bit transpose: each pair moves whole.
void pack_col_pairs(const bf16* x, ptrdiff_t ld, int n, int n_pad, int64_t D, bf16* out) {
  auto* dst = reinterpret_cast<bf16x2_u*>(out);
  for (int j = 0; j < n_pad; ++j) {
    const auto* src = reinterpret_cast<const bf16x2_u*>(x + j * ld);
    for (int64_t d2 = 0; d2 < D / 2; ++d2) dst[d2 * n_pad + j] = j < n ? src[d2] : 0u;
  }
}

inline int even(int n) { return (n + 1) & ~1; }

// Query block i of head bh: kt holds the head's key blocks packed in pairs of d (each
// block [D/2][bk][2]), vp its values in pairs of keys ([S_pad/2][D][2]).
void forward_block_bf16(const Problem& p, int64_t bh, int64_t i, const bf16* kt, const bf16* vp,
                        bf16* o, float* lse, Scratch& scratch) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D;
  const int bq = p.bq, bk = p.bk;
  const int64_t q0 = i * bq;
  const int nq = int(std::min<int64_t>(bq, p.L - q0));
  scratch.resize(size_t(bq) * (D + bk + bk / 2 + D / 2 + 2));
  float* st = scratch.data();                                  // [bq, bk] S
  float* acc = st + size_t(bq) * bk;                           // [bq, D] unnormalized output
  float* m = acc + size_t(bq) * D;                             // [bq] running max
  float* l = m + bq;                                           // [bq] running sum
  bf16* pb = reinterpret_cast<bf16*>(l + bq);                  // [bq, bk] P in bfloat16
  bf16* qs = pb + size_t(bq) * bk;                             // [bq, D] the queries
  for (int c = 0; c < nq; ++c)
    std::memcpy(qs + c * D, p.q16 + p.row(b, p.L, h, q0 + c), sizeof(bf16) * D);
  std::fill(acc, acc + size_t(bq) * D, 0.0f);
  std::fill(m, m + bq, -kInf);
  std::fill(l, l + bq, 0.0f);
  for (int64_t k0 = 0; k0 < p.S; k0 += bk) {
    const int nk = int(std::min<int64_t>(bk, p.S - k0)), lanes = (nk + NR - 1) / NR * NR;
    const Vis vis = classify(p, b, q0, nq, k0, nk);
    if (vis == Vis::kSkip) {
      if (p.causal && k0 > q0 + nq - 1) break;
      continue;
    }
    // S = Q K^T
    gemm2(nq, lanes, int(D), qs, D, kt + (k0 / bk) * D * bk, 2 * bk, st, bk, false, p.widen);
    if (vis == Vis::kPartial) mask_tile<false>(p, b, q0, nq, k0, nk, st, bk);
    for (int c = 0; c < nq; ++c)  // P in bfloat16 beside the float32 S
      softmax_row<true>(st + size_t(c) * bk, pb + size_t(c) * bk, nk, lanes, p.scale * kLog2e,
                        m[c], l[c], acc + c * D, D);
    gemm2(nq, int(D), lanes, pb, bk, vp + k0 * D, 2 * D, acc, D, true, p.widen);  // acc += P V
  }
  finish_rows(p, bh, q0, nq, acc, m, l, o, lse);
}

void run_forward_bf16(const Problem& p, bf16* out, float* lse_out, int threads) {
  const int64_t nqb = (p.L + p.bq - 1) / p.bq, nkb = (p.S + p.bk - 1) / p.bk;
  const int64_t KT = nkb * p.bk * p.D, VP = nkb * p.bk * p.D;  // bfloat16 per head, each
  auto kv = aligned_array<bf16>(size_t(p.B * p.H) * (KT + VP));
  for_items(threads, p.B * p.H, [&](int64_t bh, Scratch&) {
    const int64_t b = bh / p.H, h = bh % p.H;
    bf16 *kt = kv.get() + bh * (KT + VP), *vp = kt + KT;
    const ptrdiff_t ld = p.H * p.D;
    for (int64_t j = 0; j < nkb; ++j) {
      const int nk = int(std::min<int64_t>(p.bk, p.S - j * p.bk));
      pack_col_pairs(p.k16 + p.row(b, p.S, h, j * p.bk), ld, nk, p.bk, p.D, kt + j * p.D * p.bk);
      pack_row_pairs(p.v16 + p.row(b, p.S, h, j * p.bk), ld, nk, p.bk, p.D, vp + j * p.bk * p.D);
    }
  });
  populate({{reinterpret_cast<float*>(out), size_t(p.B) * p.L * p.H * p.D / 2}},
           clamp_threads(threads, p.B * p.H));
  for_items(threads, p.B * p.H * nqb, [&](int64_t item, Scratch& scratch) {
    const bf16* kt = kv.get() + (item / nqb) * (KT + VP);
    forward_block_bf16(p, item / nqb, item % nqb, kt, kt + KT, out, lse_out, scratch);
  });
}

// Head bh, key blocks [kb0, kb1), as backward_head with bfloat16 operands.
void backward_head_bf16(const Problem& p, const GradsT<bf16>& g, int64_t bh, int64_t kb0,
                        int64_t kb1, float* dq_part, Scratch& scratch) {
  const int64_t b = bh / p.H, h = bh % p.H, D = p.D, L = p.L, S = p.S;
  const int bq = p.bq, bk = p.bk;
  const int64_t S2 = even(int(S));
  // float32 part, then bfloat16 part (counted in floats: two per float)
  const size_t f32n = size_t(D) * (L + 2 * bk) + 2 * size_t(bk) * bq + 2 * bq + L;
  const int64_t nqb = (L + bq - 1) / bq;
  const size_t b16n = size_t(D) * (2 * L + 2 * S + S2 + 4 * nqb * bq) + 3 * size_t(bk) * bq;
  scratch.resize(f32n + (b16n + 1) / 2);
  float* dqh = scratch.data();            // [L, D] dQ (unscaled)
  float* pt = dqh + L * D;                // [bk, bq] S^T, then P^T
  float* dst = pt + size_t(bk) * bq;      // [bk, bq] dP^T
  float* dk = dst + size_t(bk) * bq;      // [bk, D]
  float* dv = dk + size_t(bk) * D;        // [bk, D]
  float* lse_b = dv + size_t(bk) * D;     // [bq]
  float* delta_b = lse_b + bq;            // [bq]
  float* delta = delta_b + bq;            // [L]
  bf16* qh = reinterpret_cast<bf16*>(scratch.data() + f32n);  // [L, D]
  bf16* doh = qh + L * D;                 // [L, D]
  bf16* kh = doh + L * D;                 // [S, D]
  bf16* vh = kh + S * D;                  // [S, D]
  bf16* kp = vh + S * D;                  // [S2/2, D, 2] keys in pairs (dQ += dS K)
  // by query blocks, each packed at its first use (once per item, not once per key block):
  bf16* qt_all = kp + S2 * D;             // [nqb, D/2, bq, 2] Q^T in pairs of d
  bf16* dot_all = qt_all + nqb * D * bq;  // [nqb, D/2, bq, 2] dO^T
  bf16* qp_all = dot_all + nqb * D * bq;  // [nqb, bq/2, D, 2] Q in pairs of queries
  bf16* dop_all = qp_all + nqb * D * bq;  // [nqb, bq/2, D, 2] dO
  bf16* ptb = dop_all + nqb * D * bq;     // [bk, bq] P^T
  bf16* dstb = ptb + size_t(bk) * bq;     // [bk, bq] dS^T
  bf16* dsb = dstb + size_t(bk) * bq;     // [bq, bk] dS
  for (int64_t r = 0; r < L; ++r) {
    std::memcpy(qh + r * D, p.q16 + p.row(b, L, h, r), sizeof(bf16) * D);
    std::memcpy(doh + r * D, g.d_o + p.row(b, L, h, r), sizeof(bf16) * D);
  }
  for (int64_t r = 0; r < S; ++r) {
    std::memcpy(kh + r * D, p.k16 + p.row(b, S, h, r), sizeof(bf16) * D);
    std::memcpy(vh + r * D, p.v16 + p.row(b, S, h, r), sizeof(bf16) * D);
  }
  pack_row_pairs(kh, D, int(S), int(S2), D, kp);
  std::fill(dqh, dqh + L * D, 0.0f);
  for (int64_t r = 0; r < L; ++r) {
    const bf16* orow = g.o + p.row(b, L, h, r);
    vf s = vf{};
    for (int64_t d = 0; d < D; d += NR) s += load_bf16(orow + d) * load_bf16(doh + r * D + d);
    delta[r] = hsum(s);
  }
  const float* lse = g.lse + bh * L;
  const vf scale = splat(p.scale), scale2 = splat(p.scale * kLog2e);  // scale2: S in base 2
  std::vector<bool> packed(nqb, false);
  for (int64_t k0 = kb0 * bk; k0 < std::min(S, kb1 * bk); k0 += bk) {
    const int nk = int(std::min<int64_t>(bk, S - k0)), nk2 = even(nk);
    const bf16 *kb = kh + k0 * D, *vb = vh + k0 * D;
    std::fill(dk, dk + size_t(bk) * D, 0.0f);
    std::fill(dv, dv + size_t(bk) * D, 0.0f);
    for (int64_t q0 = 0; q0 < L; q0 += bq) {
      const int nq = int(std::min<int64_t>(bq, L - q0));
      const Vis vis = classify(p, b, q0, nq, k0, nk);
      if (vis == Vis::kSkip) continue;
      const bf16 *qb = qh + q0 * D, *dob = doh + q0 * D;
      const int64_t at = (q0 / bq) * D * bq;
      bf16 *qt = qt_all + at, *dot = dot_all + at, *qp = qp_all + at, *dop = dop_all + at;
      if (!packed[q0 / bq]) {
        pack_col_pairs(qb, D, nq, bq, D, qt);
        pack_col_pairs(dob, D, nq, bq, D, dot);
        pack_row_pairs(qb, D, nq, bq, D, qp);
        pack_row_pairs(dob, D, nq, bq, D, dop);
        packed[q0 / bq] = true;
      }
      for (int c = 0; c < bq; ++c) {  // padding columns: P = 0, dS = 0
        lse_b[c] = c < nq ? lse[q0 + c] : kInf;
        delta_b[c] = c < nq ? delta[q0 + c] : 0.0f;
      }
      gemm2(nk, bq, int(D), kb, D, qt, 2 * bq, pt, bq, false, p.widen);   // S^T = K Q^T (unscaled)
      if (vis == Vis::kPartial) mask_tile<true>(p, b, q0, nq, k0, nk, pt, bq);
      gemm2(nk, bq, int(D), vb, D, dot, 2 * bq, dst, bq, false, p.widen);  // dP^T = V dO^T
      for (int r = 0; r < nk; ++r) {
        const float *prow = pt + size_t(r) * bq, *drow = dst + size_t(r) * bq;
        bf16 *pbr = ptb + size_t(r) * bq, *dbr = dstb + size_t(r) * bq;
        for (int c = 0; c < bq; c += NR) {
          const vf pv = vexp2_0(load(prow + c) * scale2 - load(lse_b + c));
          store_bf16(pbr + c, pv);
          store_bf16(dbr + c, pv * (load(drow + c) - load(delta_b + c)));
        }
      }
      gemm2(nk, int(D), bq, ptb, bq, dop, 2 * D, dv, D, true, p.widen);  // dV += P^T dO
      gemm2(nk, int(D), bq, dstb, bq, qp, 2 * D, dk, D, true, p.widen);  // dK += dS^T Q (unscaled)
      for (int c = 0; c < nq; ++c) {                       // dS = (dS^T)^T, keys past nk zero
        bf16* row = dsb + size_t(c) * bk;
        for (int r = 0; r < nk; ++r) row[r] = dstb[size_t(r) * bq + c];
        if (nk2 > nk) row[nk] = 0;
      }
      // dQ += dS K
      gemm2(nq, int(D), nk2, dsb, bk, kp + k0 * D, 2 * D, dqh + q0 * D, D, true, p.widen);
    }
    for (int r = 0; r < nk; ++r) {
      bf16 *dkr = g.dk + p.row(b, S, h, k0 + r), *dvr = g.dv + p.row(b, S, h, k0 + r);
      for (int64_t d = 0; d < D; d += NR) {
        store_bf16(dkr + d, load(dk + r * D + d) * scale);
        store_bf16(dvr + d, load(dv + r * D + d));
      }
    }
  }
  if (dq_part != nullptr) {
    std::memcpy(dq_part, dqh, sizeof(float) * L * D);
    return;
  }
  for (int64_t r = 0; r < L; ++r) {
    bf16* row = g.dq + p.row(b, L, h, r);
    for (int64_t d = 0; d < D; d += NR) store_bf16(row + d, load(dqh + r * D + d) * scale);
  }
}

// How many ranges of key blocks each head's backward is split into. One per head while
// the heads share out evenly over the threads; with fewer heads than threads (or an
// uneven share) a thread would idle, so each head's key blocks are split into ranges
// whose dQ shares are summed after.
int64_t key_splits(const Problem& p, int threads) {
  const int64_t BH = p.B * p.H, nkb = (p.S + p.bk - 1) / p.bk;
  if (threads <= 1 || BH % threads == 0 || BH >= 4 * threads) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(nkb, (4 * threads + BH - 1) / BH));
}

template <class T, class Head>
void run_backward(const Problem& p, const GradsT<T>& g, int threads, Head&& backward_head) {
  const int64_t BH = p.B * p.H, L = p.L, D = p.D, nkb = (p.S + p.bk - 1) / p.bk;
  const size_t nq = size_t(p.B) * L * p.H * D, nk = size_t(p.B) * p.S * p.H * D;
  const int64_t splits = key_splits(p, threads);
  auto floats = [](T* x) { return reinterpret_cast<float*>(x); };  // populate counts floats
  const size_t fq = nq * sizeof(T) / sizeof(float), fk = nk * sizeof(T) / sizeof(float);
  populate({{floats(g.dq), fq}, {floats(g.dk), fk}, {floats(g.dv), fk}},
           clamp_threads(threads, BH * splits));
  if (splits == 1) {
    for_items(threads, BH, [&](int64_t bh, Scratch& scratch) {
      backward_head(p, g, bh, 0, nkb, nullptr, scratch);
    });
    return;
  }
  auto part = aligned_array<float>(size_t(BH * splits) * L * D);  // all overwritten
  for_items(threads, BH * splits, [&](int64_t item, Scratch& scratch) {
    const int64_t c = item % splits;
    backward_head(p, g, item / splits, c * nkb / splits, (c + 1) * nkb / splits,
                  part.get() + size_t(item) * L * D, scratch);
  });
  constexpr int64_t kRows = 64;  // dQ = scale * the sum of the shares, by blocks of rows
  const int64_t blocks = (L + kRows - 1) / kRows;
  for_items(threads, BH * blocks, [&](int64_t item, Scratch&) {
    const int64_t bh = item / blocks, r0 = item % blocks * kRows, r1 = std::min(L, r0 + kRows);
    const float* base = part.get() + size_t(bh * splits) * L * D;
    for (int64_t r = r0; r < r1; ++r) {
      T* row = g.dq + p.row(bh / p.H, L, bh % p.H, r);
      for (int64_t d = 0; d < D; d += NR) {
        vf s = load(base + r * D + d);
        for (int64_t c = 1; c < splits; ++c) s += load(base + (c * L + r) * D + d);
        put(row + d, s * p.scale);
      }
    }
  });
}

template <ffi::DataType T>  // F32 or BF16 q, k, v, o
ffi::Error FwdImpl(ffi::ThreadPool xla, bool segments, bool causal, float scale, int64_t block_q,
                   int64_t block_k, int64_t threads, bool widen,
                   ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                   ffi::Buffer<ffi::S32> qseg, ffi::Buffer<ffi::S32> kseg,
                   ffi::ResultBuffer<T> o, ffi::ResultBuffer<ffi::F32> lse) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "flash attention forward";
  Problem p;
  if (auto e = make_problem(kernel, q, k, v, qseg, kseg, segments, causal, scale, block_q, block_k,
                            widen, &p);
      e.failure())
    return e;
  for (auto e : {check_dims(kernel, "o", o->dimensions(), {p.B, p.L, p.H, p.D}),
                 check_dims(kernel, "lse", lse->dimensions(), {p.B, p.H, p.L})})
    if (e.failure()) return e;
  if constexpr (T == ffi::DataType::BF16)
    run_forward_bf16(p, o->typed_data(), lse->typed_data(), int(threads));
  else
    run_forward(p, o->typed_data(), lse->typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("flash attention forward");
}

template <ffi::DataType T>  // F32 or BF16 q, k, v, o, do and the gradients
ffi::Error BwdImpl(ffi::ThreadPool xla, bool segments, bool causal, float scale, int64_t block_q,
                   int64_t block_k, int64_t threads, bool widen,
                   ffi::Buffer<T> q, ffi::Buffer<T> k, ffi::Buffer<T> v,
                   ffi::Buffer<ffi::S32> qseg, ffi::Buffer<ffi::S32> kseg,
                   ffi::Buffer<T> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<T> d_o,
                   ffi::ResultBuffer<T> dq, ffi::ResultBuffer<T> dk,
                   ffi::ResultBuffer<T> dv) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "flash attention backward";
  Problem p;
  if (auto e = make_problem(kernel, q, k, v, qseg, kseg, segments, causal, scale, block_q, block_k,
                            widen, &p);
      e.failure())
    return e;
  for (auto e : {check_dims(kernel, "o", o.dimensions(), {p.B, p.L, p.H, p.D}),
                 check_dims(kernel, "lse", lse.dimensions(), {p.B, p.H, p.L}),
                 check_dims(kernel, "do", d_o.dimensions(), {p.B, p.L, p.H, p.D}),
                 check_dims(kernel, "dq", dq->dimensions(), {p.B, p.L, p.H, p.D}),
                 check_dims(kernel, "dk", dk->dimensions(), {p.B, p.S, p.H, p.D}),
                 check_dims(kernel, "dv", dv->dimensions(), {p.B, p.S, p.H, p.D})})
    if (e.failure()) return e;
  GradsT<std::remove_cv_t<std::remove_pointer_t<decltype(q.typed_data())>>> g{
      o.typed_data(), lse.typed_data(), d_o.typed_data(), dq->typed_data(), dk->typed_data(),
      dv->typed_data()};
  if constexpr (T == ffi::DataType::BF16)
    run_backward(p, g, int(threads), backward_head_bf16);
  else
    run_backward(p, g, int(threads), backward_head);
  return ffi::Error::Success();
} catch (...) {
  return exception_error("flash attention backward");
}

}  // namespace

// exp(x[i]) by `vexp0` (base2 = 0) or 2^x[i] by `vexp2_0` (base2 != 0) for i < n, as
// this library's vectors compute them (the tests check each build's path: AVX-512, AVX2).
extern "C" void hpnlp_flash_vexp0(const float* x, float* y, int64_t n, int64_t base2) {
  for (int64_t i = 0; i < n; i += NR) {
    alignas(64) float in[NR] = {}, out[NR];
    std::memcpy(in, x + i, sizeof(float) * std::min<int64_t>(NR, n - i));
    store(out, base2 ? vexp2_0(load(in)) : vexp0(load(in)));
    std::memcpy(y + i, out, sizeof(float) * std::min<int64_t>(NR, n - i));
  }
}

// How the bfloat16 kernel's products run in this process: 2 on AMX tiles, 1 by vdpbf16ps
// (AVX-512 BF16), 0 by widening to float32 (the portable path).
extern "C" int64_t hpnlp_flash_bf16_products() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx_ready()) {
    release_tiles();
    return 2;
  }
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// The tuning probe (hpnlp.kernels.tuning): seconds for one forward (backward = 0) or
// backward pass with blocks (bq, bk) on `threads` threads, over fixed pseudo-random
// [B, L, H, D] inputs of unit-variance logits, bidirectional or causal (causal != 0), no
// segments; the bfloat16 kernel's products widened where widen != 0. Plain C: called
// through ctypes, without XLA. Negative on failure.
extern "C" double hpnlp_flash_probe(int64_t B, int64_t L, int64_t H, int64_t D, int64_t bq,
                                    int64_t bk, int64_t backward, int64_t threads,
                                    int64_t bfloat16, int64_t causal, int64_t widen) try {
  if (D % TILE != 0 || bq <= 0 || bq % TILE != 0 || bk <= 0 || bk % TILE != 0) return -1.0;
  const size_t n = size_t(B) * L * H * D;
  std::vector<float> q(n), k(n), v(n), o(n), d_o(n), dq(n), dk(n), dv(n), lse(size_t(B) * H * L);
  uint32_t state = 12345;
  const float amp = std::pow(float(D), -0.25f) * 1.7320508f;  // uniform, variance D^-1/2
  for (auto* x : {&q, &k, &v, &d_o})
    for (float& e : *x) {
      state = state * 1664525u + 1013904223u;
      e = amp * (float(state >> 8) * (2.0f / 16777216.0f) - 1.0f);
    }
  Problem p{B, L, L, H, D, causal != 0, 1.0f / std::sqrt(float(D)), q.data(), k.data(), v.data(),
            nullptr, nullptr, int(bq), int(bk)};
  p.widen = widen != 0;
  if (bfloat16) {  // the same values rounded; o and the gradients in bfloat16 too
    std::vector<bf16> h(7 * n);
    for (size_t i = 0; i < n; ++i)
      h[i] = float_to_bf16(q[i]), h[n + i] = float_to_bf16(k[i]), h[2 * n + i] = float_to_bf16(v[i]),
      h[3 * n + i] = float_to_bf16(d_o[i]);
    p.q16 = h.data(), p.k16 = h.data() + n, p.v16 = h.data() + 2 * n;
    bf16 *o16 = h.data() + 4 * n, *grads = h.data() + 5 * n;  // dq, dk, dv share: timing only
    const auto start = std::chrono::steady_clock::now();
    if (backward)
      run_backward(p, GradsT<bf16>{o16, lse.data(), h.data() + 3 * n, grads, grads, grads},
                   int(threads), backward_head_bf16);
    else
      run_forward_bf16(p, o16, lse.data(), int(threads));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const auto start = std::chrono::steady_clock::now();
  if (backward) {
    run_backward(p, Grads{o.data(), lse.data(), d_o.data(), dq.data(), dk.data(), dv.data()},
                 int(threads), backward_head);
  } else {
    run_forward(p, o.data(), lse.data(), int(threads));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
} catch (...) {
  return -1.0;
}

// Both passes' attributes, then q, k, v in T (F32 or BF16) and the segment ids.
template <ffi::DataType T>
auto common_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Attr<bool>("segments")
      .Attr<bool>("causal")
      .Attr<float>("scale")
      .Attr<int64_t>("block_q")
      .Attr<int64_t>("block_k")
      .Attr<int64_t>("threads")
      .Attr<bool>("widen")  // the bfloat16 kernel's products widened (Problem::widen)
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

// -> o in T, lse float32.
template <ffi::DataType T>
auto fwd_binding() {
  return common_binding<T>().template Ret<ffi::Buffer<T>>().template Ret<ffi::Buffer<ffi::F32>>();
}

// + o, lse (float32), do -> dq, dk, dv, all in T.
template <ffi::DataType T>
auto bwd_binding() {
  return common_binding<T>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<T>>()
      .template Ret<ffi::Buffer<T>>()
      .template Ret<ffi::Buffer<T>>()
      .template Ret<ffi::Buffer<T>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpFlashFwd, FwdImpl<ffi::DataType::F32>, fwd_binding<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpFlashBwd, BwdImpl<ffi::DataType::F32>, bwd_binding<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpFlashFwdBf16, FwdImpl<ffi::DataType::BF16>,
                              fwd_binding<ffi::DataType::BF16>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpFlashBwdBf16, BwdImpl<ffi::DataType::BF16>,
                              bwd_binding<ffi::DataType::BF16>());
