// Exact maximum inner product search as one XLA FFI CPU kernel: the products and each
// query's top k in the same pass, so no [Q, block] score matrix ever goes to memory.
// hpnlp/retrieval/exact.py packs the database once and keeps the XLA twin. A second
// target, hpnlp_ivf_scan (the IVF's scan of probed chunks, hpnlp/retrieval/ivf.py), uses
// the same panels, tile and sorted lists; it is described at its section below.
//
// The database is packed (in Python, once per add) into panels of NP rows, transposed:
// [P][D][NP], so one step d of a panel is NP consecutive rows' d-th coordinate, NP / 16
// vectors. A register tile of MR queries x NP rows (BLIS-style: AVX-512 8 x 32, 16 zmm
// accumulators; AVX2 6 x 16, 12 ymm) loads those vectors and broadcasts each query's d-th
// coordinate from its block's packed copy ([tiles][D][MR], zero rows past Q).
//
// Loop order: a thread takes a block of qb queries (packed, held in L2: 128 KB at qb = 256,
// D = 128), walks the database's panels in id order (each, 16 KB at D = 128, stays in L1
// across the block's tiles), and runs every query tile on the panel; the database streams
// from memory once per query block. qb is tuned per CPU (hpnlp.kernels.tuning, 64 to 1024;
// on a 2-core Zen 4 they came within 5% of each other and the default 256 was kept), since
// the kernel is bound by its FMAs, not the stream (0.8 GB/s a core at N = 1M). Each tile's epilogue compares its scores with each
// query's current k-th best (one vector compare -> a bit mask); only a set bit (rare, once
// the list is full) inserts into that query's sorted list of k. Ties: a query scans its
// rows in increasing id, a candidate enters only if the list has room or it beats the k-th
// score strictly, and it is inserted after equal scores: the lower id stays ahead, as in
// `exact_reference`. Rows >= count (padding of the last panel) are masked out.
//
// Threads: work items are (query block, database range), claimed one at a time. With at
// least as many query blocks as threads the database is one range and each query's list
// is the output row; with fewer (a handful of queries), the panels are split into ranges,
// each range keeps its own lists, and they are merged in range (= id) order at the end.
// Inside an XLA call the helpers are XLA's intra-op threads (hpnlp::join_parallel: they
// join while the caller works, and the caller takes whatever none joined for).
// The vector type and FFI checks come from hpnlp/kernels/simd.h.

#include <chrono>
#include <cmath>
#include <limits>

#include "simd.h"

namespace ffi = xla::ffi;
using namespace hpnlp;  // NOLINT: the kernels' vocabulary (vf, parallel, share, ...)

namespace {

#if defined(__AVX512F__)
// 16 accumulators of 32 floats. 12 x 32 (24 accumulators, fewer broadcasts a product)
// measured no faster on Zen 4: its double-pumped FMAs, not the loads, are the limit.
constexpr int MR = 8, NV = 2, PATH = 2;
#elif defined(__AVX2__)
constexpr int MR = 6, NV = 1, PATH = 1;  // a vf is two ymm: 12 accumulators of 16
#else
constexpr int MR = 6, NV = 1, PATH = 0;
#endif
constexpr int NP = NV * NR;  // rows per panel

// Bits of the lanes where a > t (a >= t with kOrEqual; lane i -> bit i).
template <bool kOrEqual = false>
inline uint32_t gt_mask(vf a, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(a), _mm512_set1_ps(t),
                            kOrEqual ? _CMP_GE_OQ : _CMP_GT_OQ);
#elif defined(__AVX2__)
  constexpr int cmp = kOrEqual ? _CMP_GE_OQ : _CMP_GT_OQ;
  __m256 lo, hi;
  std::memcpy(&lo, &a, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + sizeof lo, sizeof hi);
  const __m256 tv = _mm256_set1_ps(t);
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(lo, tv, cmp))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(hi, tv, cmp))) << 8;
#else
  uint32_t m = 0;
  for (int i = 0; i < NR; ++i) m |= uint32_t(kOrEqual ? a[i] >= t : a[i] > t) << i;
  return m;
#endif
}

// *p in every lane (simd.h's splat(x) is 0 + x, an add GCC may not drop: -0 + 0 = +0).
inline vf bcast(const float* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(*p));
#else
  vf v;
  for (int i = 0; i < NR; ++i) v[i] = *p;
  return v;
#endif
}

// acc[r][v] = sum over d of q[d][r] * panel[d][v * NR + lane]: MR queries (packed [D][MR])
// against one panel ([D][NP]). The loops have constant bounds, so GCC keeps acc in
// registers (checked in the assembly: no spills in the d loop).
inline void tile(const float* __restrict q, const float* __restrict panel, int D,
                 vf (&acc)[MR][NV]) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Named ymm accumulators: with vf (two ymm each) GCC kept them on the stack.
  static_assert(MR == 6 && NV == 1, "the AVX2 tile is 6 x 16");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int d = 0; d < D; ++d, q += MR, panel += NP) {
    const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
#define HPNLP_MIPS_ROW(r, lo, hi)                   \
    {                                               \
      const __m256 a = _mm256_broadcast_ss(q + r);  \
      lo = _mm256_fmadd_ps(a, b0, lo);              \
      hi = _mm256_fmadd_ps(a, b1, hi);              \
    }
    HPNLP_MIPS_ROW(0, c00, c01)
    HPNLP_MIPS_ROW(1, c10, c11)
    HPNLP_MIPS_ROW(2, c20, c21)
    HPNLP_MIPS_ROW(3, c30, c31)
    HPNLP_MIPS_ROW(4, c40, c41)
    HPNLP_MIPS_ROW(5, c50, c51)
#undef HPNLP_MIPS_ROW
  }
  const __m256 c[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < MR; ++r) std::memcpy(&acc[r][0], c[r], sizeof acc[r][0]);
#else
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int d = 0; d < D; ++d, q += MR, panel += NP) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(panel + v * NR);
    for (int r = 0; r < MR; ++r) {
      const vf a = bcast(q + r);
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#endif
}

// One query's best k so far: scores best first, ids, how many are held.
struct List {
  float* s;
  int32_t* id;
  int held;
};

// Insert (score, id) into a list that has room or whose k-th score is below `score`:
// after every equal score (ids arrive increasing, so the lower id stays ahead).
inline void insert(List& l, int k, float score, int32_t id) {
  int p = l.held < k ? l.held++ : k - 1;
  for (; p > 0 && l.s[p - 1] < score; --p) l.s[p] = l.s[p - 1], l.id[p] = l.id[p - 1];
  l.s[p] = score, l.id[p] = id;
}

struct Search {
  int Q, D, P, k, qb, ranges;
  int64_t count;
  const float* q;   // [Q, D]
  const float* db;  // [P][D][NP]
  float* s;         // [ranges][Q][k]: the output itself when ranges == 1
  int32_t* id;
};

// Queries [q0, q1) against panels [p0, p1): each query's list at s / id + (range Q + q) k.
void item(const Search& w, int q0, int q1, int range, int p0, int p1) {
  const int tiles = (q1 - q0 + MR - 1) / MR, D = w.D, k = w.k;
  static thread_local std::vector<float> qbuf;
  static thread_local std::vector<List> lists;
  if (qbuf.size() < size_t(tiles) * D * MR) qbuf.resize(size_t(tiles) * D * MR);
  if (lists.size() < size_t(q1 - q0)) lists.resize(q1 - q0);
  float* qp = qbuf.data();
  std::fill(qp, qp + size_t(tiles) * D * MR, 0.0f);
  for (int i = q0; i < q1; ++i) {  // pack: tile t holds queries q0 + t MR + r as [D][MR]
    const int t = (i - q0) / MR, r = (i - q0) % MR;
    for (int d = 0; d < D; ++d) qp[(size_t(t) * D + d) * MR + r] = w.q[size_t(i) * D + d];
    const size_t row = (size_t(range) * w.Q + i) * k;
    lists[i - q0] = {w.s + row, w.id + row, 0};
  }
  for (int p = p0; p < p1; ++p) {
    const float* panel = w.db + size_t(p) * D * NP;
    const int64_t base = int64_t(p) * NP;
    uint32_t valid[NV];  // lanes holding rows < count
    for (int v = 0; v < NV; ++v) {
      const int64_t n = std::min<int64_t>(NR, std::max<int64_t>(0, w.count - base - v * NR));
      valid[v] = n == NR ? (1u << NR) - 1 : (1u << n) - 1;
    }
    for (int t = 0; t < tiles; ++t) {
      vf acc[MR][NV];
      tile(qp + size_t(t) * D * MR, panel, D, acc);
      const int rows = std::min(MR, q1 - q0 - t * MR);
      for (int r = 0; r < rows; ++r) {
        List& l = lists[t * MR + r];
        for (int v = 0; v < NV; ++v) {
          uint32_t m = l.held < k ? valid[v] : gt_mask(acc[r][v], l.s[k - 1]) & valid[v];
          if (!m) continue;
          float sc[NR];
          std::memcpy(sc, &acc[r][v], sizeof sc);
          for (; m; m &= m - 1) {  // lanes in increasing id
            const int lane = __builtin_ctz(m);
            if (l.held < k || sc[lane] > l.s[k - 1])
              insert(l, k, sc[lane], int32_t(base + v * NR + lane));
          }
        }
      }
    }
  }
  for (int i = 0; i < q1 - q0; ++i)  // a range with fewer than k rows: fillers rank last
    for (List& l = lists[i]; l.held < k; ++l.held)
      l.s[l.held] = -std::numeric_limits<float>::infinity(), l.id[l.held] = INT32_MAX;
}

// Each query's lists of the ranges (s, id: [ranges][Q][k]) merged by (score desc, id asc)
// into out, for queries [q0, q1).
void merge(int ranges, int Q, int k, const float* s, const int32_t* id, float* out_s,
           int32_t* out_id, int q0, int q1) {
  std::vector<int> head(ranges);
  for (int i = q0; i < q1; ++i) {
    std::fill(head.begin(), head.end(), 0);
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float bs = 0.0f;
      int32_t bi = 0;
      for (int r = 0; r < ranges; ++r) {
        if (head[r] >= k) continue;
        const size_t at = (size_t(r) * Q + i) * k + head[r];
        if (best < 0 || s[at] > bs || (s[at] == bs && id[at] < bi)) best = r, bs = s[at], bi = id[at];
      }
      ++head[best];
      out_s[size_t(i) * k + j] = bs, out_id[size_t(i) * k + j] = bi;
    }
  }
}

// merge() over up to `threads` threads (the caller and the helpers that join:
// hpnlp::join_parallel), claiming a quarter of a thread's share of the queries at a time.
void merge_all(int ranges, int Q, int k, const float* s, const int32_t* id, float* out_s,
               int32_t* out_id, int threads) {
  const int nt = clamp_threads(threads, Q), grain = std::max(1, Q / (4 * nt));
  std::atomic<int> next{0};
  join_parallel(nt, [&](int) {
    for (int q0; (q0 = next.fetch_add(grain, std::memory_order_relaxed)) < Q;)
      merge(ranges, Q, k, s, id, out_s, out_id, q0, std::min(Q, q0 + grain));
  });
}

// The whole search on `threads` threads (see the top of the file).
void run(Search w, float* out_s, int32_t* out_id, int threads) {
  const int nt0 = std::max(1, threads);
  int blocks = (w.Q + w.qb - 1) / w.qb;
  if (blocks >= nt0) blocks = (blocks + nt0 - 1) / nt0 * nt0;  // whole rounds of the threads
  const int qbe = ((w.Q + blocks - 1) / blocks + MR - 1) / MR * MR;  // near-equal blocks
  blocks = (w.Q + qbe - 1) / qbe;
  w.ranges = blocks >= nt0 ? 1 : std::min(w.P, (nt0 + blocks - 1) / blocks);
  std::vector<float> ls;
  std::vector<int32_t> li;
  if (w.ranges == 1) {
    w.s = out_s, w.id = out_id;
  } else {
    ls.resize(size_t(w.ranges) * w.Q * w.k), li.resize(ls.size());
    w.s = ls.data(), w.id = li.data();
  }
  const int items = blocks * w.ranges;
  const int nt = clamp_threads(nt0, items);
  std::atomic<int> next{0};
  join_parallel(nt, [&](int) {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int b = i / w.ranges, r = i % w.ranges;
      int p0, p1;
      share(w.P, w.ranges, r, &p0, &p1);
      item(w, b * qbe, std::min(w.Q, (b + 1) * qbe), r, p0, p1);
    }
  });
  if (w.ranges > 1) merge_all(w.ranges, w.Q, w.k, w.s, w.id, out_s, out_id, nt0);
}

// ------------------------------------------------------------------------------ IVF scan
// An inverted file's scan (hpnlp/retrieval/ivf.py): each query scores only the rows of
// the chunks it probes. The chunks are packed like the database above, [M][T][D][NP] (T
// panels a chunk), beside their ids [M][T NP] (-1: padding, never returned).
//
// Work items are (query block, range of chunks), as above: a block's probes are inverted
// into (chunk, query) pairs, sorted by chunk, so a chunk probed by several of the block's
// queries is read once, in place, for all of them (tiles of up to MR of its queries, a
// tile of fewer rows for the rest; a query's scores are the same whichever tile it is
// in), and chunks are read in increasing address. With fewer query blocks than threads
// (up to qb queries: one block) the chunks are split into ranges claimed by the threads,
// each range keeps its own lists, merged at the end: every probed chunk is then read once
// in all. Panels holding only padding are skipped (a chunk is its cell's rows, then
// padding: at twice the mean cell size, about half of it). At a few queries per probed
// chunk the scan is bound by memory, not by its FMAs.
//
// Ties: chunks are not visited in id order, so the lists order by (score desc, id asc)
// outright: a candidate whose score equals the k-th enters if its id is lower.

// acc[r][v] for the first R of a tile's MR queries (R < MR), the rest left unset.
template <int R>
inline void tile_rows(const float* __restrict q, const float* __restrict panel, int D,
                      vf (&acc)[MR][NV]) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // In ymm halves, as `tile` (a vf's arithmetic is lowered lane by lane here).
  v8f lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = v8f{};
  for (int d = 0; d < D; ++d, q += MR, panel += NP) {
    const v8f b0 = load8(panel), b1 = load8(panel + 8);
    for (int r = 0; r < R; ++r) {
      const float a = q[r];
      lo[r] += a * b0;
      hi[r] += a * b1;
    }
  }
  for (int r = 0; r < R; ++r) acc[r][0] = join8(lo[r], hi[r]);
#else
  vf c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = vf{};
  for (int d = 0; d < D; ++d, q += MR, panel += NP) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(panel + v * NR);
    for (int r = 0; r < R; ++r) {
      const vf a = bcast(q + r);
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = c[r][v];
#endif
}

// The tile for `rows` (1 to MR) queries: the full one, or one of fewer registers.
template <int R = 1>
inline void tile_upto(int rows, const float* q, const float* panel, int D, vf (&acc)[MR][NV]) {
  if constexpr (R >= MR) {
    tile(q, panel, D, acc);
  } else {
    if (rows == R) return tile_rows<R>(q, panel, D, acc);
    tile_upto<R + 1>(rows, q, panel, D, acc);
  }
}

// Bits of the NR ids at p that are real (>= 0; -1 is padding).
inline uint32_t real_mask(const int32_t* p) {
#if defined(__AVX512F__)
  return _mm512_cmpge_epi32_mask(_mm512_loadu_si512(p), _mm512_setzero_si512());
#else
  uint32_t m = 0;
  for (int i = 0; i < NR; ++i) m |= uint32_t(p[i] >= 0) << i;
  return m;
#endif
}

// Whether (score, id) belongs in a list ordered by (score desc, id asc).
inline bool enters(const List& l, int k, float score, int32_t id) {
  return l.held < k || score > l.s[k - 1] || (score == l.s[k - 1] && id < l.id[k - 1]);
}

// Insert (score, id), which `enters`, at its (score desc, id asc) place.
inline void insert_by_id(List& l, int k, float score, int32_t id) {
  int p = l.held < k ? l.held++ : k - 1;
  for (; p > 0 && (l.s[p - 1] < score || (l.s[p - 1] == score && l.id[p - 1] > id)); --p)
    l.s[p] = l.s[p - 1], l.id[p] = l.id[p - 1];
  l.s[p] = score, l.id[p] = id;
}

struct Ivf {
  int Q, D, P, M, T, k, qb, ranges;
  const float* q;        // [Q, D]
  const int32_t* probe;  // [Q, P] chunk indices
  const float* db;       // [M][T][D][NP]
  const int32_t* ids;    // [M][T NP], -1 padding
  float* s;              // [ranges][Q][k]: the output itself when ranges == 1
  int32_t* id;
};

// Queries [q0, q1) against their probes in chunks [m0, m1): lists at s / id + (range Q + q) k.
void ivf_item(const Ivf& w, int q0, int q1, int range, int m0, int m1) {
  const int nq = q1 - q0, D = w.D, k = w.k;
  static thread_local std::vector<uint64_t> pairs;  // chunk << 32 | query in block
  static thread_local std::vector<float> qbuf;
  static thread_local std::vector<List> lists;
  pairs.clear();
  if (lists.size() < size_t(nq)) lists.resize(nq);
  for (int i = 0; i < nq; ++i) {
    const size_t row = (size_t(range) * w.Q + q0 + i) * k;
    lists[i] = {w.s + row, w.id + row, 0};
    for (int p = 0; p < w.P; ++p) {
      const int32_t m = w.probe[size_t(q0 + i) * w.P + p];
      if (m >= m0 && m < m1) pairs.push_back(uint64_t(uint32_t(m)) << 32 | uint32_t(i));
    }
  }
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());  // a probe listed twice
  const size_t tile_floats = size_t(D) * MR;
  if (qbuf.size() < (size_t(nq) + MR - 1) / MR * tile_floats)
    qbuf.resize((size_t(nq) + MR - 1) / MR * tile_floats);
  for (size_t a = 0; a < pairs.size();) {
    const uint32_t m = uint32_t(pairs[a] >> 32);
    size_t b = a;
    while (b < pairs.size() && uint32_t(pairs[b] >> 32) == m) ++b;
    const int n = int(b - a), tiles = (n + MR - 1) / MR;
    const uint64_t* member = pairs.data() + a;  // the chunk's queries, low 32 bits
    float* qp = qbuf.data();  // tile t holds members t MR + r as [D][MR]
    std::fill(qp, qp + tiles * tile_floats, 0.0f);
    for (int j = 0; j < n; ++j) {
      const float* src = w.q + size_t(q0 + uint32_t(member[j])) * D;
      float* dst = qp + (j / MR) * tile_floats + j % MR;
      for (int d = 0; d < D; ++d) dst[size_t(d) * MR] = src[d];
    }
    const float* chunk = w.db + size_t(m) * w.T * D * NP;
    const int32_t* chunk_id = w.ids + size_t(m) * w.T * NP;
    for (int t = 0; t < w.T; ++t) {
      const int32_t* pid = chunk_id + t * NP;
      uint32_t valid[NV], any = 0;  // lanes holding real rows
      for (int v = 0; v < NV; ++v) any |= valid[v] = real_mask(pid + v * NR);
      if (!any) continue;
      const float* panel = chunk + size_t(t) * D * NP;
      for (int tt = 0; tt < tiles; ++tt) {
        const int rows = std::min(MR, n - tt * MR);
        vf acc[MR][NV];
        tile_upto(rows, qp + tt * tile_floats, panel, D, acc);
        for (int r = 0; r < rows; ++r) {
          List& l = lists[uint32_t(member[tt * MR + r])];
          for (int v = 0; v < NV; ++v) {
            uint32_t mk = l.held < k ? valid[v] : gt_mask<true>(acc[r][v], l.s[k - 1]) & valid[v];
            if (!mk) continue;
            float sc[NR];
            std::memcpy(sc, &acc[r][v], sizeof sc);
            for (; mk; mk &= mk - 1) {
              const int lane = __builtin_ctz(mk);
              const int32_t row = pid[v * NR + lane];
              if (enters(l, k, sc[lane], row)) insert_by_id(l, k, sc[lane], row);
            }
          }
        }
      }
    }
    a = b;
  }
  for (int i = 0; i < nq; ++i)  // fewer than k real rows scanned
    for (List& l = lists[i]; l.held < k; ++l.held)
      l.s[l.held] = -std::numeric_limits<float>::infinity(), l.id[l.held] = -1;
}

// Blocks of about qb queries (and, with fewer blocks than threads, ranges of chunks)
// claimed by `threads` threads.
void run_ivf(Ivf w, float* out_s, int32_t* out_id, int threads) {
  const int nt0 = std::max(1, threads);
  int blocks = (w.Q + w.qb - 1) / w.qb;
  if (blocks >= nt0) blocks = (blocks + nt0 - 1) / nt0 * nt0;  // whole rounds of the threads
  const int qbe = (w.Q + blocks - 1) / blocks;
  blocks = (w.Q + qbe - 1) / qbe;
  // a few ranges a thread: chunks are probed unevenly, and claiming balances the load
  w.ranges = blocks >= nt0 ? 1 : std::min(w.M, (nt0 + blocks - 1) / blocks * 4);
  std::vector<float> ls;
  std::vector<int32_t> li;
  if (w.ranges == 1) {
    w.s = out_s, w.id = out_id;
  } else {
    ls.resize(size_t(w.ranges) * w.Q * w.k), li.resize(ls.size());
    w.s = ls.data(), w.id = li.data();
  }
  const int items = blocks * w.ranges;
  std::atomic<int> next{0};
  join_parallel(clamp_threads(nt0, items), [&](int) {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int b = i / w.ranges, r = i % w.ranges;
      int m0, m1;
      share(w.M, w.ranges, r, &m0, &m1);
      ivf_item(w, b * qbe, std::min(w.Q, (b + 1) * qbe), r, m0, m1);
    }
  });
  if (w.ranges > 1) merge_all(w.ranges, w.Q, w.k, w.s, w.id, out_s, out_id, nt0);
}

}  // namespace

// The build's layout, for the Python packer: 0 the path (2 AVX-512, 1 AVX2, 0 portable),
// 1 rows per panel (NP), 2 queries per register tile (MR).
extern "C" int64_t hpnlp_mips_layout(int64_t what) {
  const int64_t v[] = {PATH, NP, MR};
  return what >= 0 && what < 3 ? v[what] : -1;
}

// The tuning probe (hpnlp.kernels.tuning): seconds for one search of Q queries against n
// rows of dimension D, top k, query blocks of qb, on `threads` threads, pseudo-random
// operands. Plain C, called through ctypes. Negative on failure.
extern "C" double hpnlp_mips_probe(int64_t n, int64_t D, int64_t Q, int64_t k, int64_t qb,
                                   int64_t threads) try {
  if (n < 1 || D < 1 || Q < 1 || k < 1 || k > n || qb < 1) return -1.0;
  const int64_t P = (n + NP - 1) / NP;
  uint32_t state = 12345;
  auto uniform = [&] {
    state = state * 1664525u + 1013904223u;
    return float(state >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
  };
  std::vector<float> q(size_t(Q) * D), db(size_t(P) * D * NP), s(size_t(Q) * k);
  std::vector<int32_t> id(s.size());
  for (float& e : q) e = uniform();
  for (float& e : db) e = uniform();
  Search w{int(Q), int(D), int(P), int(k), int(qb), 1, n, q.data(), db.data(), nullptr, nullptr};
  const auto start = std::chrono::steady_clock::now();
  run(w, s.data(), id.data(), int(threads));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
} catch (...) {
  return -1.0;
}

// q [Q, D] float32, db packed [P, D, NP] float32, rows >= count padding -> scores [Q, k]
// float32 best first, ids [Q, k] int32 (ties: the lower id first).
ffi::Error MipsTopKImpl(ffi::ThreadPool xla, int64_t count, int64_t threads, int64_t qb,
                        ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> db,
                        ffi::ResultBuffer<ffi::F32> scores, ffi::ResultBuffer<ffi::S32> ids) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "exact MIPS";
  auto qd = q.dimensions(), dd = db.dimensions(), sd = scores->dimensions();
  if (qd.size() != 2 || dd.size() != 3 || sd.size() != 2 || sd[0] != qd[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "exact MIPS: bad shape of q, db or scores");
  const int64_t Q = qd[0], D = qd[1], P = dd[0], k = sd[1];
  for (auto e : {check_dims(kernel, "the packed database", dd, {P, D, NP}),
                 check_dims(kernel, "ids", ids->dimensions(), {Q, k})})
    if (e.failure()) return e;
  if (k < 1 || count < k || count > P * NP || qb < 1 || P * NP > INT32_MAX)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "exact MIPS: need 1 <= k <= count <= the packed rows < 2^31, qb >= 1");
  Search w{int(Q), int(D), int(P), int(k), int(qb), 1, count, q.typed_data(), db.typed_data(),
           nullptr, nullptr};
  if (Q > 0) run(w, scores->typed_data(), ids->typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("exact MIPS");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpMipsTopK, MipsTopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("qb")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// q [Q, D] float32, probe [Q, P] int32 chunk indices, db [M, T, D, NP] float32 packed chunks,
// ids [M, T NP] int32 (-1 padding) -> scores [Q, k] float32 best first, ids [Q, k] int32,
// ordered by (score desc, id asc); -inf and -1 past the real rows a query scanned.
ffi::Error IvfScanImpl(ffi::ThreadPool xla, int64_t threads, int64_t qb,
                       ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> probe,
                       ffi::Buffer<ffi::F32> db, ffi::Buffer<ffi::S32> ids,
                       ffi::ResultBuffer<ffi::F32> scores,
                       ffi::ResultBuffer<ffi::S32> out_ids) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "IVF scan";
  auto qd = q.dimensions(), pd = probe.dimensions(), dd = db.dimensions(), sd = scores->dimensions();
  if (qd.size() != 2 || pd.size() != 2 || dd.size() != 4 || sd.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "IVF scan: bad rank of q, probe, db or scores");
  const int64_t Q = qd[0], D = qd[1], P = pd[1], M = dd[0], T = dd[1], k = sd[1];
  for (auto e : {check_dims(kernel, "probe", pd, {Q, P}),
                 check_dims(kernel, "the packed chunks", dd, {M, T, D, NP}),
                 check_dims(kernel, "the chunk ids", ids.dimensions(), {M, T * NP}),
                 check_dims(kernel, "scores", sd, {Q, k}),
                 check_dims(kernel, "ids", out_ids->dimensions(), {Q, k})})
    if (e.failure()) return e;
  if (k < 1 || qb < 1 || M < 1 || M >= INT32_MAX || Q > INT32_MAX)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "IVF scan: need k >= 1, qb >= 1, 1 <= M < 2^31");
  const int32_t* pr = probe.typed_data();
  for (int64_t i = 0; i < Q * P; ++i)
    if (pr[i] < 0 || pr[i] >= M)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "IVF scan: probe " + std::to_string(pr[i]) + " is not a chunk in [0, " +
                            std::to_string(M) + ")");
  Ivf w{int(Q), int(D), int(P), int(M), int(T), int(k), int(qb), 1, q.typed_data(), pr,
        db.typed_data(), ids.typed_data(), nullptr, nullptr};
  if (Q > 0) run_ivf(w, scores->typed_data(), out_ids->typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("IVF scan");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpIvfScan, IvfScanImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("qb")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
