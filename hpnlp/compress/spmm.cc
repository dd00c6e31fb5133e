// A pruned weight's product as an XLA FFI CPU kernel (inference only): float32 x [M, K]
// times a sparse weight W [K, N] stored by columns (CSC: col_ptr [N + 1], and for each
// nonzero its row k and value, rows ascending within a column) -> y [M, N] float32.
// hpnlp/compress/spmm.py wraps it, builds the CSC arrays from a masked weight, and keeps
// its XLA twin (the dense product of the weight the arrays describe).
//
// A column of W touches the x columns of its nonzeros' rows, so the kernel makes the rows
// of x its vector lanes: a block of MB = V * NR rows of x is transposed once into scratch
// (xt [K][MB], a k's MB values contiguous), then each output column n is
//   acc[V vectors] += value[j] * xt[row[j]][0..MB) over n's nonzeros j,
// one broadcast, V loads and V FMAs per nonzero, whatever the sparsity pattern: no
// gather, no scatter, no work for a zero. The accumulators of NR consecutive columns go
// to a small tile (yt [NR][MB], in L1) that is transposed into y's rows. The transposes
// cost M (K + N) moves against M nnz multiply-adds, which is why a CSC product wins only
// where the weight is sparse enough (see `python -m hpnlp.bench sparse`).
//
// MB (the block's rows) is the tunable: more rows amortize a nonzero's index and value
// loads over more FMAs, fewer keep xt (K * MB floats) in L1. Chosen per CPU on first use
// (hpnlp.kernels.tuning; spmm.py's TUNING). Threads claim row blocks dynamically (XLA's
// intra-op threads join the call: hpnlp::join_parallel); each keeps its scratch across
// calls.
//
// Vectors are the build's registers (HPNLP_NATIVE_VECTORS: 16 floats with AVX-512, 8
// with AVX2 only), so MB is a multiple of NR on each build.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#define HPNLP_NATIVE_VECTORS
#include "simd.h"

namespace ffi = xla::ffi;

namespace hpnlp {
namespace {

struct Csc {
  int M, K, N;
  const float* x;
  const int32_t* col_ptr;
  const int32_t* row;
  const float* val;
  float* y;
};

// Scratch of the calling thread, kept across calls (a thread's block of xt and yt), on
// 64-byte boundaries: on 16-byte aligned scratch the product ran 1.20-1.54x slower on a Xeon
// model 167 (`python tools/kernel_ab.py --rev 9f87d28 --kernel spmm --rounds 15`, paired).
float* scratch(size_t floats) {
  thread_local Scratch buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// dst[c * ldd + r] = src[r * lds + c] for r < R, c < C (R, C <= NR): a whole NR x NR
// tile in registers (AVX-512: 16 x 16, AVX2: 8 x 8, by unpacks and lane shuffles), a
// partial one element by element.
inline void transpose(const float* src, ptrdiff_t lds, float* dst, ptrdiff_t ldd, int R, int C) {
#if defined(__AVX512F__)
  if (R == 16 && C == 16) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2)
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {  // r[i + j]: lane L holds column 4L + j of rows i..i+3
      auto d = [&](int a) { return _mm512_castps_pd(t[a]); };
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(d(i), d(i + 2)));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(d(i), d(i + 2)));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(d(i + 1), d(i + 3)));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(d(i + 1), d(i + 3)));
    }
    for (int j = 0; j < 4; ++j) {
      t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
      t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
      t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
      t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
      _mm512_storeu_ps(dst + (4 + j) * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD));
      _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));
      _mm512_storeu_ps(dst + (12 + j) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD));
    }
    return;
  }
#elif defined(__AVX2__)
  if (R == 8 && C == 8) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2)
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
      auto d = [&](int a) { return _mm256_castps_pd(t[a]); };
      r[i] = _mm256_castpd_ps(_mm256_unpacklo_pd(d(i), d(i + 2)));
      r[i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(d(i), d(i + 2)));
      r[i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(d(i + 1), d(i + 3)));
      r[i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(d(i + 1), d(i + 3)));
    }
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
      _mm256_storeu_ps(dst + (4 + j) * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
    }
    return;
  }
#endif
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) dst[c * ldd + i] = src[i * lds + c];
}

// Rows [m0, m0 + rows) of the product, rows <= MB = V * NR.
template <int V>
void block(const Csc& s, int m0, int rows) {
  constexpr int MB = V * NR;
  constexpr int U = (NR == 16 || V <= 4) ? 2 : 1;  // accumulator sets (U V registers fit)
  float* xt = scratch(size_t(s.K) * MB + size_t(NR) * MB);
  float* yt = xt + size_t(s.K) * MB;
  // xt[k][i] = x[m0 + i][k]; rows past the end are zeros (their outputs are not written)
  const float* x = s.x + size_t(m0) * s.K;
  if (rows < MB) std::fill(xt, xt + size_t(s.K) * MB, 0.0f);
  for (int r0 = 0; r0 < rows; r0 += NR)
    for (int k0 = 0; k0 < s.K; k0 += NR)
      transpose(x + size_t(r0) * s.K + k0, s.K, xt + size_t(k0) * MB + r0, MB,
                std::min(NR, rows - r0), std::min(NR, s.K - k0));
  for (int n0 = 0; n0 < s.N; n0 += NR) {
    const int n1 = std::min(s.N, n0 + NR);
    for (int n = n0; n < n1; ++n) {
      // U sets of accumulators take alternate nonzeros: a column's FMAs into one register
      // form a chain, and V chains alone left the FMA units waiting on their latency
      // (Zen 4, 1024 x 512 x 512 at 95% sparsity, one thread: 0.75 ms with U = 1, 0.66
      // with U = 2 and 0.78 with U = 4, each at its best V, interleaved).
      vf acc[U][V];
      for (int u = 0; u < U; ++u)
        for (int v = 0; v < V; ++v) acc[u][v] = vf{};
      int32_t j = s.col_ptr[n];
      const int32_t end = s.col_ptr[n + 1];
      for (; end - j >= U; j += U)  // (j + U could overflow at nnz near 2^31)
        for (int u = 0; u < U; ++u) {
          const float* p = xt + size_t(s.row[j + u]) * MB;
          const vf w = splat(s.val[j + u]);
          for (int v = 0; v < V; ++v) acc[u][v] += w * load(p + v * NR);
        }
      for (; j < end; ++j) {
        const float* p = xt + size_t(s.row[j]) * MB;
        const vf w = splat(s.val[j]);
        for (int v = 0; v < V; ++v) acc[0][v] += w * load(p + v * NR);
      }
      for (int v = 0; v < V; ++v) {
        vf sum = acc[0][v];
        for (int u = 1; u < U; ++u) sum += acc[u][v];
        store(yt + (n - n0) * MB + v * NR, sum);
      }
    }
    for (int r0 = 0; r0 < rows; r0 += NR)
      transpose(yt + r0, MB, s.y + size_t(m0 + r0) * s.N + n0, s.N, n1 - n0,
                std::min(NR, rows - r0));
  }
}

constexpr int kMaxV = 8;

template <int V>
void run_v(const Csc& s, int threads) {
  constexpr int MB = V * NR;
  const int blocks = (s.M + MB - 1) / MB;
  std::atomic<int> next{0};
  join_parallel(clamp_threads(threads, blocks), [&](int) {
    for (int b; (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks;)
      block<V>(s, b * MB, std::min(MB, s.M - b * MB));
  });
}

void run(const Csc& s, int vectors, int threads) {
  switch (vectors) {
    case 1: return run_v<1>(s, threads);
    case 2: return run_v<2>(s, threads);
    case 4: return run_v<4>(s, threads);
    default: return run_v<kMaxV>(s, threads);
  }
}

bool valid_vectors(int64_t v) { return v == 1 || v == 2 || v == 4 || v == kMaxV; }

// The CSC arrays describe a K x N matrix: col_ptr starts at 0, never decreases and ends at
// nnz, and every row index is in [0, K). Checked on every call (O(N + nnz), against the
// product's O(M nnz)): a bad index would read outside x's block.
const char* csc_error(const int32_t* col_ptr, const int32_t* row, int64_t K, int64_t N,
                      int64_t nnz) {
  if (col_ptr[0] != 0 || col_ptr[N] != nnz) return "col_ptr must start at 0 and end at nnz";
  for (int64_t n = 0; n < N; ++n)
    if (col_ptr[n + 1] < col_ptr[n]) return "col_ptr must not decrease";
  for (int64_t j = 0; j < nnz; ++j)
    if (row[j] < 0 || row[j] >= K) return "a row index is outside [0, K)";
  return nullptr;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace
}  // namespace hpnlp

using namespace hpnlp;

// One product on synthetic data for the tuning probe: x [M, K], W [K, N] with every
// column holding `per_col` nonzeros at evenly spread rows; seconds, or -1 on failure.
extern "C" double hpnlp_spmm_probe(int64_t M, int64_t K, int64_t N, int64_t per_col,
                                   int64_t vectors, int64_t threads) try {
  if (!valid_vectors(vectors) || per_col < 0 || per_col > K || N * per_col > INT32_MAX)
    return -1.0;
  std::vector<float> x(size_t(M) * K, 0.5f), val(size_t(N) * per_col, 0.25f), y(size_t(M) * N);
  std::vector<int32_t> col_ptr(N + 1), row(size_t(N) * per_col);
  for (int64_t n = 0; n <= N; ++n) col_ptr[n] = int32_t(n * per_col);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < per_col; ++j) row[n * per_col + j] = int32_t((j * K / per_col + n) % K);
  for (int64_t n = 0; n < N; ++n)
    std::sort(row.begin() + n * per_col, row.begin() + (n + 1) * per_col);
  const Csc s{int(M), int(K), int(N), x.data(), col_ptr.data(), row.data(), val.data(), y.data()};
  const auto start = std::chrono::steady_clock::now();
  run(s, int(vectors), int(threads));
  return seconds_since(start);
} catch (...) {
  return -1.0;
}

// x [M, K] float32, col_ptr [N + 1] int32, row [nnz] int32, val [nnz] float32 -> [M, N].
ffi::Error CscMatmulImpl(ffi::ThreadPool xla, int64_t threads, int64_t vectors,
                         ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> col_ptr,
                         ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::F32> val,
                         ffi::ResultBuffer<ffi::F32> out) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "sparse matmul";
  auto d = x.dimensions(), o = out->dimensions();
  if (d.size() != 2 || o.size() != 2 || o[0] != d[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "sparse matmul: bad shape of x or out");
  const int64_t M = d[0], K = d[1], N = o[1], nnz = row.element_count();
  if (M > INT32_MAX || K > INT32_MAX || N > INT32_MAX)  // the blocks index in int
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sparse matmul: M, K and N must each be below 2^31");
  for (auto e : {check_dims(kernel, "col_ptr", col_ptr.dimensions(), {N + 1}),
                 check_dims(kernel, "row", row.dimensions(), {nnz}),
                 check_dims(kernel, "val", val.dimensions(), {nnz})})
    if (e.failure()) return e;
  if (!valid_vectors(vectors))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sparse matmul: vectors must be 1, 2, 4 or 8");
  if (const char* why = csc_error(col_ptr.typed_data(), row.typed_data(), K, N, nnz))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("sparse matmul: ") + why);
  const Csc s{int(M), int(K), int(N), x.typed_data(), col_ptr.typed_data(), row.typed_data(),
              val.typed_data(), out->typed_data()};
  if (M > 0 && N > 0) run(s, int(vectors), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("sparse matmul");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpCscMatmul, CscMatmulImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("vectors")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
