// The LSTM recurrence as XLA FFI CPU kernels: the forward scan, the backward scan, and the
// weight gradients' product over all steps (at the end of the file).
//
// Why: in an XLA-built scan every time step is several kernel launches (the [B, H] x
// [H, 4H] product, then the gate arithmetic as separate fusions), each a dispatch to the
// thread pool and a round trip of the [B, 4H] pre-activations through memory. Here one
// call runs all L steps. Each thread owns a share of the tiles of NR hidden units (the
// same share every step, so its part of the matrix stays near its core; taking tiles from
// a shared counter instead measured 3% slower, and no faster once the input projection
// joined the product), computes a tile's four gates for a block of rows in registers (a
// register-blocked product of h_{t-1} with W_h, packed once per call so that every step
// streams it contiguously, its accumulators started from the input projection x_t W_x,
// which `input_projection` computes for blocks of steps beforehand), applies the
// gate arithmetic to the accumulators directly, and meets the others at one barrier per
// step (the next step needs every unit of h). The backward scan does the same with the
// transposed matrix: a thread turns the incoming gradient of its tiles into their gate
// gradient dz (elementwise, written straight into the [L, B, 4H] output that the weight
// gradients read: writing it transposed instead, 4H scattered runs per step, cost a third
// of the backward kernel in TLB misses), and after a barrier computes dz @ W^T for the
// same tiles, in groups of 4, each group's gate gradients for the step before following
// its product at once, and then its share of the input gradient dz @ W_x^T.
//
// Gates are ordered (i, f, o, g) as in hpnlp.rnn.cells: pre = x W_x + b + h_prev @ W,
// i, f, o = sigmoid(pre[:3H]), g = tanh(pre[3H:]), c = f c_prev + i g, h = o tanh(c).
// Rows with valid == 0 keep their state and output 0 (padding).
//
// The vector type, exp, threads and barrier come from hpnlp/kernels/simd.h.

#include <sys/mman.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#define HPNLP_NATIVE_VECTORS  // whole vectors of NR floats (simd.h)
#include "simd.h"

namespace ffi = xla::ffi;
using namespace hpnlp;  // NOLINT: the kernel's vocabulary (vf, load, vexp, ...)

namespace {

// The packed recurrent matrix (4 MB at H = 512), which every step streams through the
// cache, on 2 MB pages where the kernel grants them (transparent huge pages in `madvise`
// mode, the common default): its walk through 1024 pages of 4 KB cost each scan about a
// tenth of its time in the kernels' C probe (tools/kernel_ab.py, a 2-core Xeon model
// 167); in the layer's jitted pass the gain was within the run-to-run spread.
// A matrix of 2 MB or more is mapped afresh for each call, 2 MB aligned, and unmapped
// after it: from malloc it would reuse pages already faulted in at 4 KB (hpnlp keeps
// freed memory for reuse, `hpnlp.kernels.reuse_freed_memory`), which madvise does not
// convert. Smaller ones are plain 64-byte aligned memory.
template <class T>
struct HugeAlloc {
  static constexpr size_t HUGE_PAGE = size_t(2) << 20;
  using value_type = T;
  HugeAlloc() = default;
  template <class U> HugeAlloc(const HugeAlloc<U>&) {}
  static size_t mapped(size_t n) {  // bytes mapped for n elements, or 0: from malloc
    const size_t bytes = n * sizeof(T);
    return bytes >= HUGE_PAGE ? (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE : 0;
  }
  T* allocate(size_t n) {
    if (const size_t len = mapped(n)) {  // map one huge page more, keep the aligned part
      void* m = mmap(nullptr, len + HUGE_PAGE, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) throw std::bad_alloc();
      char* base = static_cast<char*>(m);
      char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + HUGE_PAGE - 1) &
                                        ~uintptr_t(HUGE_PAGE - 1));
      if (p > base) munmap(base, p - base);
      munmap(p + len, HUGE_PAGE - (p - base));
#ifdef MADV_HUGEPAGE
      madvise(p, len, MADV_HUGEPAGE);
#endif
      return reinterpret_cast<T*>(p);
    }
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (const size_t len = mapped(n)) munmap(p, len);
    else std::free(p);
  }
  template <class U> bool operator==(const HugeAlloc<U>&) const { return true; }
  template <class U> bool operator!=(const HugeAlloc<U>&) const { return false; }
};
using HugeVec = std::vector<float, HugeAlloc<float>>;

// 1 / x for x >= 1 (the gates' denominators), to about 1 ulp: the 14-bit estimate and one
// Newton step, a quarter of a division's time. The gate arithmetic (five exps and five
// divisions per unit) took as long as the recurrent product itself.
inline vf vrcp(vf x) {
#if defined(__AVX512F__)
  const __m512 xv = reinterpret_cast<__m512>(x);
  const __m512 r = _mm512_rcp14_ps(xv);
  return reinterpret_cast<vf>(_mm512_mul_ps(r, _mm512_fnmadd_ps(xv, r, _mm512_set1_ps(2.0f))));
#else
  return 1.0f / x;
#endif
}

// exp(-x) below 88 (so 1 + it stays finite) by the 12-instruction vexp0.
inline vf vsigmoid(vf x) {
  const vf nx = -x;
  return vrcp(1.0f + vexp0(nx > 88.0f ? splat(88.0f) : nx));
}

inline vf vtanh(vf x) {
  vf ax = x < 0.0f ? -x : x;
  vf e = vexp0(-2.0f * ax);
  vf big = (1.0f - e) * vrcp(1.0f + e);
  big = x < 0.0f ? -big : big;
  vf x2 = x * x;  // |x| < 0.0625: the series, where 1 - e would cancel
  vf small = x * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315))));
  return ax < 0.0625f ? small : big;
}

constexpr int MR = 6;  // the most rows per register block: 6 x 4 accumulators + 4 panel vectors

// The blocking of the products, chosen per CPU (hpnlp.kernels.tuning): k per cache block
// (a kc x 4 NR panel block should stay in L1: 32 KB at kc = 128 with AVX-512, all of an
// EPYC's L1) and rows per register block (<= MR).
struct Blocking {
  int kc, mr;
};

// acc[r][q] (+)= sum over k in [k0, k1) of a[r * lda + k] * p[(k * 4 + q) * NR ...]: four
// vectors of a packed panel per k, each row's value a broadcast operand of the FMA.
#if defined(__AVX512F__)
template <int R>
inline void micro(vf (&acc)[R][4], const float* a, size_t lda, const float* p, int k0, int k1) {
  p += size_t(k0) * 4 * NR;
  for (int k = k0; k < k1; ++k, p += 4 * NR) {
    vf b0 = load(p), b1 = load(p + NR), b2 = load(p + 2 * NR), b3 = load(p + 3 * NR);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
      acc[r][2] += x * b2;
      acc[r][3] += x * b3;
    }
  }
}
#else
// AVX2's 16 registers hold R x 2 accumulators, not R x 4: two gates at a time, the
// accumulators passing through memory between them.
template <int R>
inline void micro(vf (&acc)[R][4], const float* a, size_t lda, const float* p, int k0, int k1) {
  for (int q = 0; q < 4; q += 2)
    reg_tile<R, 2, true>(a + k0, lda, 1, k1 - k0, p + size_t(k0) * 4 * NR + q * NR, 4 * NR,
                         reinterpret_cast<float*>(&acc[0][q]), 4 * NR);
}
#endif

struct NoHook {
  void operator()() const {}
};

// C[rows, 4 NR] = A[rows, K] P[K, 4 NR] for all B rows, one register block of rows at a
// time, K in cache blocks (partial sums wait in `part`, [B][4][NR]); `done(r0, R, acc)`
// receives each finished block of rows, and `between()` runs after every register block
// (the backward scan issues its next step's prefetches there). Rows are split into
// near-equal blocks of <= mr.
template <class Done, class Between = NoHook>
void panel_product(const float* a, size_t lda, const float* p, int B, int K, float* part,
                   Blocking blk, Done&& done, Between&& between = NoHook{}, bool init = false) {
  const int blocks = (B + blk.mr - 1) / blk.mr;
  for (int k0 = 0; k0 < K; k0 += blk.kc) {
    const int k1 = std::min(K, k0 + blk.kc);
    for (int i = 0, r0 = 0; i < blocks; ++i) {
      const int R = B / blocks + (i < B % blocks);
      auto run = [&](auto rows) {
        constexpr int RR = decltype(rows)::value;
        vf acc[RR][4];
        for (int r = 0; r < RR; ++r)
          for (int q = 0; q < 4; ++q)
            acc[r][q] = k0 == 0 && !init ? vf{} : load(part + (size_t(r0 + r) * 4 + q) * NR);
        micro<RR>(acc, a + size_t(r0) * lda, lda, p, k0, k1);
        if (k1 == K) {
          done(r0, RR, &acc[0][0]);
        } else {
          for (int r = 0; r < RR; ++r)
            for (int q = 0; q < 4; ++q) store(part + (size_t(r0 + r) * 4 + q) * NR, acc[r][q]);
        }
        between();
      };
      switch (R) {
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
      r0 += R;
    }
  }
}

// ---------------------------------------------------------------------------- forward

struct Fwd {
  int L, B, H, E;
  bool save;    // write hp, cc and act (what the backward pass reads)
  bool stream;  // out, hp, cc, act are 64-byte aligned: non-temporal stores
  Blocking blk;
  const float *x, *bias, *wx, *w, *valid;  // x [L, B, E], wx [E, 4H], w [H, 4H]
  float *out;            // [B, L, H], batch-major like the layer's output
  float *hp, *cc, *act;  // [L, B, H] h entering each step, [L, B, H] c after it, [L, B, 4H]
  float *h;    // h entering each step, double-buffered: [2][B, H] (h_t written by step t)
  float *c;    // [2][B, H]
  HugeVec wp;  // per unit tile: [E + H][4 gates][NR], wx's rows and then w's
};

// Unit tile u of step t: z = x_t W_x + h_prev W for the 4 gates of its NR units (the
// product h_prev W over K = H, its accumulators starting from x_t W_x in `xw`, see
// input_projection; the input projection is computed here rather than by XLA for all
// steps before the call, which wrote and read back an [L, B, 4H] array), then the cell
// update straight from the accumulators. Stream: the outputs that nothing in this call
// reads again go past the cache (a template argument: chosen at run time, the store
// was an indirect call that spilled the gates around it).
template <bool Stream>
void fwd_tile(const Fwd& s, int t, int u, float* xw) {
  const int H = s.H, G = 4 * H, K = s.E + H, j = u * NR;
  const size_t BH = size_t(s.B) * H;
  const float *a = s.h + (t & 1) * BH, *c_prev = s.c + (t & 1) * BH;
  float *h_next = s.h + ((t + 1) & 1) * BH, *c_next = s.c + ((t + 1) & 1) * BH;
  panel_product(a, H, s.wp.data() + (size_t(u) * K + s.E) * 4 * NR, s.B, H, xw, s.blk,
                [&](int r0, int R, const vf* acc) {
    for (int r = 0; r < R; ++r, acc += 4) {
      const int b = r0 + r;
      const size_t row_g = (size_t(t) * s.B + b) * G, row_h = (size_t(t) * s.B + b) * H;
      const float* bias = s.bias;
      vf i = vsigmoid(acc[0] + load(bias + j));
      vf f = vsigmoid(acc[1] + load(bias + H + j));
      vf o = vsigmoid(acc[2] + load(bias + 2 * H + j));
      vf g = vtanh(acc[3] + load(bias + 3 * H + j));
      vf cp = load(c_prev + size_t(b) * H + j), hp = load(a + size_t(b) * H + j);
      vf c = cp, h = hp, y = vf{};
      if (s.valid[size_t(t) * s.B + b] > 0.0f) {  // padding keeps the state, outputs 0
        c = f * cp + i * g;
        h = o * vtanh(c);
        y = h;
      }
      store(c_next + size_t(b) * H + j, c);
      store(h_next + size_t(b) * H + j, h);
      auto put = [](float* p, vf v) {
        if constexpr (Stream) stream(p, v); else store(p, v);
      };
      put(s.out + (size_t(b) * s.L + t) * H + j, y);
      if (s.save) {
        float* act = s.act + row_g;
        put(act + j, i);
        put(act + H + j, f);
        put(act + 2 * H + j, o);
        put(act + 3 * H + j, g);
        put(s.hp + row_h + j, hp);
        put(s.cc + row_h + j, c);
      }
    }
  }, NoHook{}, s.E > 0);
}

// Steps per block of the input products (x_t W_x forward, dz_t W_x^T backward): one product
// per unit tile over the block's steps * B rows (about 256), so that W_x's panel passes
// through the cache once per block rather than once per step. With the input projection in
// each step's product ([x_t | h_{t-1}] against [W_x; W]), the cores of a 2-core Xeon model
// 207 (2 MB of L2 each) read the whole 8 MB panel from L3 every step, and its products
// ran at 0.83x of the same product on a panel held in L2; by blocks, the forward probe ran
// 1.04-1.27x faster there (tools/kernel_ab.py --kernel lstm, four runs; 128 to 512 rows per
// block within noise of each other).
inline int chunk_steps(int B) { return std::clamp(256 / std::max(B, 1), 1, 64); }

// x_t W_x for steps [t0, t0 + n) and this thread's unit tiles [u0, u1), into xw
// [n][u1 - u0][B][4][NR]: each (step, tile)'s starting partial sums of the step's product.
void input_projection(const Fwd& s, int t0, int n, int u0, int u1, float* xw, float* part) {
  const int K = s.E + s.H, B = s.B;
  for (int u = u0; u < u1; ++u)
    panel_product(s.x + size_t(t0) * B * s.E, s.E, s.wp.data() + size_t(u) * K * 4 * NR, n * B,
                  s.E, part, s.blk, [&](int r0, int R, const vf* acc) {
      for (int r = 0; r < R; ++r) {
        const int row = r0 + r, tt = row / B, b = row % B;
        float* dst = xw + ((size_t(tt) * (u1 - u0) + (u - u0)) * B + b) * 4 * NR;
        for (int q = 0; q < 4; ++q) store(dst + q * NR, acc[r * 4 + q]);
      }
    });
}

void run_fwd(Fwd& s, int threads) {
  const int H = s.H, E = s.E, K = E + H, G = 4 * H, tiles = H / NR;
  s.wp.resize(size_t(K) * G);
  Barrier barrier(threads);
  // with the barrier: a thread whose scratch below fails to allocate aborts it (simd.h),
  // where the others waited for it at the first wait forever
  parallel(threads, [&](int p) {
    int u0, u1;
    share(tiles, threads, p, &u0, &u1);
    const int nt = u1 - u0;
    const int chunk = chunk_steps(s.B);
    std::vector<float> part(size_t(chunk) * s.B * 4 * NR);
    std::vector<float> xw(size_t(chunk) * std::max(nt, 1) * s.B * 4 * NR);
    for (int u = u0; u < u1; ++u)  // pack this thread's tiles: [k][gate][unit]
      for (int k = 0; k < K; ++k) {
        const float* row = k < E ? s.wx + size_t(k) * G : s.w + size_t(k - E) * G;
        for (int g = 0; g < 4; ++g)
          std::memcpy(&s.wp[((size_t(u) * K + k) * 4 + g) * NR], row + g * H + u * NR,
                      NR * sizeof(float));
      }
    barrier.wait();  // h_0 is in place
    for (int t = 0; t < s.L; ++t) {
      if (t % chunk == 0 && s.E > 0)
        input_projection(s, t, std::min(chunk, s.L - t), u0, u1, xw.data(), part.data());
      for (int u = u0; u < u1; ++u) {
        float* xwu = xw.data() + (size_t(t % chunk) * nt + (u - u0)) * s.B * 4 * NR;
        s.stream ? fwd_tile<true>(s, t, u, xwu) : fwd_tile<false>(s, t, u, xwu);
      }
      barrier.wait();  // every unit of h_t is written before any is read
    }
#if defined(__x86_64__)
    if (s.stream) __builtin_ia32_sfence();  // the streamed outputs are visible on return
#endif
  }, &barrier);
}

// --------------------------------------------------------------------------- backward

struct Bwd {
  int L, B, H, E;
  Blocking blk;
  const float *act, *cc, *c0, *w, *wx, *valid, *d_out;  // wx [E, G], d_out [B, L, H]
  float *dz, *db;  // every step's gate gradients [L, B, G], and their sum over L, B
  float *dh, *dc;  // the running carry gradients [B, H] (start as d_final)
  float *dx;       // [L, B, E]: dz_t W_x^T, step by step
};

// The gate gradients of unit tile u, all rows, step t (dz, and their sum over rows in
// db); the carry gradients move to t-1 (the c part here, the h part in bwd_group).
void bwd_gates(Bwd& s, int t, int u) {
  const int H = s.H, G = 4 * H, j = u * NR, B = s.B;
  vf db[4] = {vf{}, vf{}, vf{}, vf{}};
  for (int b = 0; b < B; ++b) {
    const size_t row_g = (size_t(t) * B + b) * G, row_h = (size_t(t) * B + b) * H;
    float* dz = s.dz + row_g;
    float* dh_p = s.dh + size_t(b) * H + j;
    float* dc_p = s.dc + size_t(b) * H + j;
    if (!(s.valid[size_t(t) * B + b] > 0.0f)) {  // the state passed through unchanged
      for (int q = 0; q < 4; ++q) store(dz + q * H + j, vf{});
      continue;
    }
    const float* act = s.act + row_g;
    vf i = load(act + j), f = load(act + H + j), o = load(act + 2 * H + j), g = load(act + 3 * H + j);
    vf c = load(s.cc + row_h + j);
    vf cp = load((t == 0 ? s.c0 : s.cc + size_t(t - 1) * s.B * H) + size_t(b) * H + j);
    vf dh = load(dh_p) + load(s.d_out + (size_t(b) * s.L + t) * H + j);
    vf tc = vtanh(c);
    vf dc = load(dc_p) + dh * o * (1.0f - tc * tc);
    vf do_ = dh * tc, di = dc * g, dg = dc * i, df = dc * cp;
    const vf d[4] = {di * i * (1.0f - i), df * f * (1.0f - f), do_ * o * (1.0f - o),
                     dg * (1.0f - g * g)};
    for (int q = 0; q < 4; ++q) {
      store(dz + q * H + j, d[q]);
      db[q] += d[q];
    }
    store(dc_p, dc * f);
  }
  for (int q = 0; q < 4; ++q) store(s.db + q * H + j, load(s.db + q * H + j) + db[q]);
}

// The lines bwd_gates(t) reads and writes for one group's unit tiles [u0, u1), issued
// as prefetches a few at a time between the register blocks of step t+1's product: the
// gates stream act, c and d_out from memory (the forward wrote them past the cache) and
// write dz, and prefetched in one burst beside the gates' loads (as before), or by the
// hardware, that traffic stalled the gates for a third of the backward scan instead of
// overlapping the product's arithmetic. Per row: 4 runs of act, c_{t-1} (c_t was read at
// t+1 as the c before it), d_out, and 4 runs of dz to write.
struct Ahead {
  static constexpr int RUNS = 10;
  const Bwd* s;
  int t, u0, tiles, next = 0, total = 0, per = 0;  // per: lines a call of issue()

  // `blocks`: the register blocks of the product that calls issue() after each
  Ahead(const Bwd& bwd, int step, int first, int last, int blocks)
      : s(&bwd), t(step), u0(first), tiles(last - first) {
    total = step >= 0 ? bwd.B * RUNS * tiles : 0;
    per = (total + blocks - 1) / blocks;
  }
  void issue() {
    const int H = s->H, B = s->B;
    const size_t G = 4 * size_t(H);
    for (const int end = std::min(total, next + per); next < end; ++next) {
      const int run = next / tiles, b = run / RUNS, k = run % RUNS;
      const size_t j = size_t(u0 + next % tiles) * NR;
      const size_t row_g = (size_t(t) * B + b) * G;
      if (k < 4) {
        __builtin_prefetch(s->act + row_g + k * H + j);
      } else if (k == 4) {
        __builtin_prefetch((t == 0 ? s->c0 : s->cc + size_t(t - 1) * B * H) + size_t(b) * H + j);
      } else if (k == 5) {
        __builtin_prefetch(s->d_out + (size_t(b) * s->L + t) * H + j);
      } else {
        __builtin_prefetch(s->dz + row_g + (k - 6) * H + j, 1);
      }
    }
  }
};

// dh_{t-1} = dz_t W^T for the n <= 4 unit tiles from u (packed panel wt) on valid rows;
// invalid rows keep dh (their h passed through unchanged). Some of the next step's lines
// are prefetched after each register block (`ahead`).
void bwd_group(Bwd& s, int t, int u, int n, const float* wt, float* part, Ahead& ahead) {
  const int H = s.H, G = 4 * H;
  panel_product(s.dz + size_t(t) * s.B * G, G, wt, s.B, G, part, s.blk,
                [&](int r0, int R, const vf* acc) {
    for (int r = 0; r < R; ++r, acc += 4) {
      const int b = r0 + r;
      if (!(s.valid[size_t(t) * s.B + b] > 0.0f)) continue;
      for (int q = 0; q < n; ++q) store(s.dh + size_t(b) * H + (u + q) * NR, acc[q]);
    }
  }, [&] { ahead.issue(); });
}

// dx_t = dz_t W_x^T for steps [t, t + steps) and the input columns of x tiles [u, u + n)
// (packed panel wxt), all rows (padding rows have dz = 0, so dx = 0); the last tile may be
// short of NR columns. `part` holds steps * B rows.
void bwd_dx_group(Bwd& s, int t, int steps, int u, int n, const float* wxt, float* part) {
  const int E = s.E, G = 4 * s.H;
  panel_product(s.dz + size_t(t) * s.B * G, G, wxt, steps * s.B, G, part, s.blk,
                [&](int r0, int R, const vf* acc) {
    for (int r = 0; r < R; ++r, acc += 4) {
      float* dx = s.dx + (size_t(t) * s.B + r0 + r) * E;
      for (int q = 0; q < n; ++q) {
        const int j = (u + q) * NR;
        if (j + NR <= E) {
          store(dx + j, acc[q]);
        } else {
          for (int m = 0; m < E - j; ++m) dx[j + m] = acc[q][m];
        }
      }
    }
  });
}

// `m`^T's rows [NR u0, NR (u0 + 4 groups)) as panels of 4 tiles: [group][k in G][tile
// q][unit], zeros past `rows` (a short last tile or group). m is [rows, G].
void pack_transposed(const float* m, int rows, int G, int g0, int g1, float* out) {
  for (int gi = g0; gi < g1; ++gi) {
    float* dst = out + size_t(gi) * G * 4 * NR;
    for (int k = 0; k < G; ++k)
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < NR; ++i) {
          const int row = (4 * gi + q) * NR + i;
          dst[(size_t(k) * 4 + q) * NR + i] = row < rows ? m[size_t(row) * G + k] : 0.0f;
        }
  }
}

void run_bwd(Bwd& s, int threads) {
  const int H = s.H, G = 4 * H, tiles = H / NR, groups = (tiles + 3) / 4;
  const int xtiles = (s.E + NR - 1) / NR, xgroups = (xtiles + 3) / 4;
  Barrier barrier(threads);
  // W^T and W_x^T in groups of 4 tiles of their rows: [group][k in G][tile q][unit], zeros
  // where the last group or tile is short.
  HugeVec wt(size_t(groups) * G * 4 * NR), wxt(size_t(xgroups) * G * 4 * NR);
  parallel(threads, [&](int p) {
    int g0, g1, x0, x1;
    share(groups, threads, p, &g0, &g1);
    share(xgroups, threads, p, &x0, &x1);
    const int chunk = chunk_steps(s.B);
    std::vector<float> part(size_t(chunk) * s.B * 4 * NR);
    pack_transposed(s.w, H, G, g0, g1, wt.data());  // this thread's groups
    pack_transposed(s.wx, s.E, G, x0, x1, wxt.data());
    // register blocks of one group's product: its k blocks x row blocks
    const int blocks = ((G - 1) / s.blk.kc + 1) * ((s.B - 1) / s.blk.mr + 1);  // B >= 1
    for (int u = 4 * g0; u < std::min(tiles, 4 * g1); ++u) bwd_gates(s, s.L - 1, u);
    for (int t = s.L - 1; t >= 0; --t) {
      barrier.wait();  // all of dz_t is written
      // dh_{t-1} for a group of this thread's tiles, then at once their gates at t-1
      // (which read only this thread's tiles of dh, just computed, and write dz_{t-1}, not
      // the dz_t that other threads may still be reading), their lines prefetched during
      // the group's product.
      for (int gi = g0; gi < g1; ++gi) {
        const int u = 4 * gi, n = std::min(4, tiles - u);
        Ahead ahead(s, t - 1, u, u + n, blocks);
        bwd_group(s, t, u, n, wt.data() + size_t(gi) * G * 4 * NR, part.data(), ahead);
        for (int q = 0; t > 0 && q < n; ++q) bwd_gates(s, t - 1, u + q);
      }
      // dx of a block of steps [t, t + chunk), which nothing in the scan waits for, once
      // its last dz_t is written (no one writes those now: the gates above write dz_{t-1}):
      // one product over chunk * B rows, so that W_x^T's panel passes through the cache
      // once per block of steps rather than once per step (the backward probe 0.89-1.22x
      // over four runs on a 2-core Xeon model 207, within its noise there; see
      // chunk_steps for the forward's, whose panel is twice the size). The
      // input gradient had been one XLA product over all steps afterwards, at 0.73x of the
      // cores' FMA peak on a 2-core EPYC Zen 4, reading all of dz back from memory.
      if (t % chunk == 0)
        for (int gi = x0; gi < x1; ++gi)
          bwd_dx_group(s, t, std::min(chunk, s.L - t), 4 * gi, std::min(4, xtiles - 4 * gi),
                       wxt.data() + size_t(gi) * G * 4 * NR, part.data());
    }
  }, &barrier);
}

// ------------------------------------------------------------------- weight gradients

// dW_h = hp^T dz and dW_x = x^T dz over all N = L*B rows: products that contract both
// operands' leading axis, which XLA:CPU runs in Eigen (153 ms for [8192, 512]^T
// [8192, 2048] against 136 ms with the first operand transposed beforehand, on a 2-core
// EPYC Zen 3: 0.89x). Here, as in BLIS: a thread owns a range
// of dz's columns; for each block of kc rows it packs its columns of dz once, in panels of
// DW_W columns, [panel][k][DW_W], shared by both products; then for each block of mc
// rows of C it packs A^T, [row block][k][DW_R], and runs the register tile (DW_R rows x
// DW_W columns of C in registers, reg_tile) over every panel and row block, the next
// tile's rows of C prefetched meanwhile (C, 4 MB per thread at the rnn bench's shape, is
// out of L2, and each tile's first multiply-adds wait on its load). With AVX-512 the tile
// is 6 x 4 vectors (24 accumulators of 32 registers; AVX2 has 16: 6 x 2). With A packed
// row by row too, the product ran 1.17x faster on a 2-core Xeon model 207, each build at
// its own tuned blocks (tools/kernel_ab.py --kernel lstm --rev-dw-blocks), still about
// 0.8x PyTorch's A^T B of the same shape there.
#if defined(__AVX512F__)
constexpr int DW_R = 6, DW_NV = 4, DW_W = DW_NV * NR;
#else
constexpr int DW_R = 6, DW_NV = 2, DW_W = DW_NV * NR;
#endif
static_assert(4 * TILE % DW_W == 0, "dz's 4H columns (H a multiple of TILE) in whole panels");

struct DwBlocking {
  int kc, mc;
};

// c[rows, DW_W] (+)= ap^T bp over k < K, ap [K][DW_R] (rows past `rows` zero), bp [K][DW_W].
inline void dw_tile(const float* ap, const float* bp, int K, float* c, size_t ldc, bool acc,
                    int rows) {
  if (rows == DW_R) {
    if (acc) reg_tile<DW_R, DW_NV, true>(ap, 1, DW_R, K, bp, DW_W, c, ldc);
    else reg_tile<DW_R, DW_NV, false>(ap, 1, DW_R, K, bp, DW_W, c, ldc);
    return;
  }
  alignas(64) float tmp[DW_R * DW_W] = {};  // the last, short row block of C
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < DW_W; ++i) tmp[r * DW_W + i] = acc ? c[r * ldc + i] : 0.0f;
  reg_tile<DW_R, DW_NV, true>(ap, 1, DW_R, K, bp, DW_W, tmp, DW_W);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < DW_W; ++i) c[r * ldc + i] = tmp[r * DW_W + i];
}

struct Dw {
  int N, G;                // rows (L*B) and columns (4H) of dz
  int na;                  // operands: hp (and x)
  const float* a[2];       // [N, m[i]] each
  int m[2];
  const float* dz;         // [N, G]
  float* c[2];             // [m[i], G] each
  DwBlocking blk;
};

// Columns [n0, n1) (multiples of DW_W) of both products; bp, ap scratch.
void dw_columns(const Dw& s, int n0, int n1, Scratch& bp, Scratch& ap) {
  // Blocks no larger than the problem: the scratch is sized by them.
  const int KC = std::min(s.blk.kc, s.N), MC = std::min(s.blk.mc, std::max(s.m[0], s.m[1]));
  bp.resize(size_t(KC) * (n1 - n0));
  ap.resize(size_t(KC) * ((MC + DW_R - 1) / DW_R) * DW_R);
  for (int pc = 0; pc < s.N; pc += KC) {
    const int kc = std::min(KC, s.N - pc);
    for (int j = n0, p = 0; j < n1; j += DW_W, ++p)
      for (int k = 0; k < kc; ++k)
        std::memcpy(&bp[(size_t(p) * kc + k) * DW_W], s.dz + size_t(pc + k) * s.G + j,
                    DW_W * sizeof(float));
    for (int i = 0; i < s.na; ++i) {
      const int M = s.m[i];
      for (int ic = 0; ic < M; ic += MC) {
        const int mc = std::min(MC, M - ic), blocks = (mc + DW_R - 1) / DW_R;
        // Row by row of A (contiguous reads), DW_R floats at a time into each row block.
        for (int k = 0; k < kc; ++k) {
          const float* src = s.a[i] + size_t(pc + k) * M + ic;
          for (int q = 0; q < blocks; ++q) {
            const int rows = std::min(DW_R, mc - q * DW_R);
            float* dst = &ap[(size_t(q) * kc + k) * DW_R];
            if (rows == DW_R) {
              std::memcpy(dst, src + q * DW_R, DW_R * sizeof(float));
            } else {
              for (int r = 0; r < DW_R; ++r) dst[r] = r < rows ? src[q * DW_R + r] : 0.0f;
            }
          }
        }
        for (int j = n0, p = 0; j < n1; j += DW_W, ++p)
          for (int q = 0; q < blocks; ++q) {
            if (pc > 0 && q + 1 < blocks) {
              const float* next = s.c[i] + size_t(ic + (q + 1) * DW_R) * s.G + j;
              for (int r = 0, rows = std::min(DW_R, mc - (q + 1) * DW_R); r < rows; ++r)
                for (int l = 0; l < DW_W; l += 64 / int(sizeof(float)))
                  __builtin_prefetch(next + size_t(r) * s.G + l, 1, 3);
            }
            dw_tile(&ap[size_t(q) * kc * DW_R], &bp[size_t(p) * kc * DW_W], kc,
                    s.c[i] + size_t(ic + q * DW_R) * s.G + j, s.G, pc > 0,
                    std::min(DW_R, mc - q * DW_R));
          }
      }
    }
  }
}

// Each thread one near-equal range of the column panels, claimed from a counter (a helper
// may join late or never: hpnlp::join_parallel); N = 0 gives zeros.
void run_dw(const Dw& s, int threads) {
  if (s.N == 0) {
    for (int i = 0; i < s.na; ++i) std::fill(s.c[i], s.c[i] + size_t(s.m[i]) * s.G, 0.0f);
    return;
  }
  const int panels = s.G / DW_W;
  std::atomic<int> next{0};
  join_parallel(threads, [&](int) {
    Scratch bp, ap;
    for (int part; (part = next.fetch_add(1)) < threads;) {
      int p0, p1;
      share(panels, threads, part, &p0, &p1);
      if (p1 > p0) dw_columns(s, p0 * DW_W, p1 * DW_W, bp, ap);
    }
  });
}

ffi::Error check_dims(const char* what, ffi::Span<const int64_t> dims, std::vector<int64_t> want) {
  return hpnlp::check_dims("fused LSTM", what, dims, std::move(want));
}

}  // namespace

// x [L, B, E], wx [E, 4H], bias [4H], w [H, 4H], c0, h0 [B, H], valid [L, B] ->
// out [B, L, H] (0 on padding), c, h [B, H] (the final state) and, with save, hp [L, B, H]
// (h entering each step), cc [L, B, H] (c after each step), act [L, B, 4H] (the activated
// gates), which the backward pass reads; without save those three are empty.
// Blocking attributes checked: kc > 0, 1 <= mr <= MR.
ffi::Error check_blocking(int64_t kc, int64_t mr, Blocking* blk) {
  if (kc <= 0 || kc > INT32_MAX || mr < 1 || mr > MR)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fused LSTM: kc must be a positive int32 value and mr in [1, 6]");
  *blk = Blocking{int(kc), int(mr)};
  return ffi::Error::Success();
}

ffi::Error LstmFwdImpl(int64_t threads, int64_t kc, int64_t mr, bool save, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> wx, ffi::Buffer<ffi::F32> bias,
                       ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::F32> h0,
                       ffi::Buffer<ffi::F32> valid, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> c_fin, ffi::ResultBuffer<ffi::F32> h_fin,
                       ffi::ResultBuffer<ffi::F32> hp, ffi::ResultBuffer<ffi::F32> cc,
                       ffi::ResultBuffer<ffi::F32> act) try {
  auto d = x.dimensions(), dw = w.dimensions();
  if (d.size() != 3 || dw.size() != 2 || dw[0] % TILE != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fused LSTM: x must be [L, B, E] and w [H, 4H] with H a multiple of 16");
  const int64_t L = d[0], B = d[1], E = d[2], H = dw[0];
  Blocking blk;
  for (auto e : {check_blocking(kc, mr, &blk), check_dims("wx", wx.dimensions(), {E, 4 * H}),
                 check_dims("bias", bias.dimensions(), {4 * H}),
                 check_dims("w", w.dimensions(), {H, 4 * H}), check_dims("c0", c0.dimensions(), {B, H}),
                 check_dims("h0", h0.dimensions(), {B, H}), check_dims("valid", valid.dimensions(), {L, B}),
                 check_dims("out", out->dimensions(), {B, L, H}),
                 check_dims("hp", hp->dimensions(), {save ? L : 0, B, H}),
                 check_dims("cc", cc->dimensions(), {save ? L : 0, B, H}),
                 check_dims("act", act->dimensions(), {save ? L : 0, B, 4 * H})})
    if (e.failure()) return e;
  std::vector<float> h(size_t(2) * B * H), c(size_t(2) * B * H);
  std::memcpy(h.data(), h0.typed_data(), sizeof(float) * B * H);
  std::memcpy(c.data(), c0.typed_data(), sizeof(float) * B * H);
  if (L > 0 && B > 0) {
    const bool stream = aligned64(out->typed_data()) && (!save || (aligned64(hp->typed_data()) &&
                        aligned64(cc->typed_data()) && aligned64(act->typed_data())));
    const int nt = clamp_threads(threads, H / NR);
    // Fault the saved activations in up front (see populate in simd.h): 18% of the
    // forward call here.
    const size_t n = save ? size_t(L) * B * H : 0;
    populate({{out->typed_data(), size_t(B) * L * H}, {hp->typed_data(), n},
              {cc->typed_data(), n}, {act->typed_data(), 4 * n}}, nt);
    Fwd s{int(L), int(B), int(H), int(E), save, stream, blk, x.typed_data(), bias.typed_data(),
          wx.typed_data(), w.typed_data(), valid.typed_data(), out->typed_data(),
          hp->typed_data(), cc->typed_data(), act->typed_data(), h.data(), c.data(), {}};
    run_fwd(s, nt);
  }
  const size_t last = size_t(L & 1);  // the buffer step L-1 wrote
  std::memcpy(h_fin->typed_data(), h.data() + last * B * H, sizeof(float) * B * H);
  std::memcpy(c_fin->typed_data(), c.data() + last * B * H, sizeof(float) * B * H);
  return ffi::Error::Success();
} catch (...) {
  return exception_error("fused LSTM");
}

// act [L, B, 4H], cc [L, B, H], c0 [B, H], w [H, 4H], wx [E, 4H], valid [L, B], d_out
// [B, L, H], d_h, d_c [B, H] (gradients of the final carry) -> dz [L, B, 4H] (the gradient
// of the gate pre-activations, written step by step where the backward scan makes it; the
// weight gradients are then one product over all steps), db [4H] (its sum: the bias
// gradient), d_h0, d_c0 [B, H], dx [L, B, E] (dz W_x^T, the input's gradient).
ffi::Error LstmBwdImpl(int64_t threads, int64_t kc, int64_t mr, ffi::Buffer<ffi::F32> act, ffi::Buffer<ffi::F32> cc,
                       ffi::Buffer<ffi::F32> c0, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::F32> wx, ffi::Buffer<ffi::F32> valid,
                       ffi::Buffer<ffi::F32> d_out,
                       ffi::Buffer<ffi::F32> d_h, ffi::Buffer<ffi::F32> d_c,
                       ffi::ResultBuffer<ffi::F32> dz, ffi::ResultBuffer<ffi::F32> db,
                       ffi::ResultBuffer<ffi::F32> d_h0, ffi::ResultBuffer<ffi::F32> d_c0,
                       ffi::ResultBuffer<ffi::F32> dx) try {
  auto d = act.dimensions();
  if (d.size() != 3 || d[2] % (4 * TILE) != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fused LSTM: act must be [L, B, 4H] with H a multiple of 16");
  const int64_t L = d[0], B = d[1], H = d[2] / 4;
  auto dwx = wx.dimensions();
  if (dwx.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "fused LSTM: wx must be [E, 4H]");
  const int64_t E = dwx[0];
  Blocking blk;
  for (auto e : {check_blocking(kc, mr, &blk), check_dims("wx", dwx, {E, 4 * H}),
                 check_dims("dx", dx->dimensions(), {L, B, E}),
                 check_dims("cc", cc.dimensions(), {L, B, H}), check_dims("c0", c0.dimensions(), {B, H}),
                 check_dims("w", w.dimensions(), {H, 4 * H}), check_dims("valid", valid.dimensions(), {L, B}),
                 check_dims("d_out", d_out.dimensions(), {B, L, H}),
                 check_dims("d_h", d_h.dimensions(), {B, H}), check_dims("d_c", d_c.dimensions(), {B, H}),
                 check_dims("dz", dz->dimensions(), {L, B, 4 * H})})
    if (e.failure()) return e;
  std::memcpy(d_h0->typed_data(), d_h.typed_data(), sizeof(float) * B * H);
  std::memcpy(d_c0->typed_data(), d_c.typed_data(), sizeof(float) * B * H);
  std::fill(db->typed_data(), db->typed_data() + 4 * H, 0.0f);  // run_bwd adds to it
  if (L == 0 || B == 0) return ffi::Error::Success();
  const int nt = clamp_threads(threads, (H / NR + 3) / 4);
  populate({{dz->typed_data(), size_t(L) * B * 4 * H}, {dx->typed_data(), size_t(L) * B * E}},
           nt);
  Bwd s{int(L), int(B), int(H), int(E), blk, act.typed_data(), cc.typed_data(), c0.typed_data(),
        w.typed_data(), wx.typed_data(), valid.typed_data(), d_out.typed_data(),
        dz->typed_data(), db->typed_data(), d_h0->typed_data(), d_c0->typed_data(),
        dx->typed_data()};
  run_bwd(s, nt);
  return ffi::Error::Success();
} catch (...) {
  return exception_error("fused LSTM");
}

// hp [L, B, H] (h entering each step), x [L, B, E] (the layer's input), dz [L, B, 4H]
// (the backward scan's output) -> dw_h = hp^T dz [H, 4H], dw_x = x^T dz [E, 4H], each
// summed over all L*B rows. Blocking attributes: kc > 0 rows of dz per packed block, mc > 0
// rows of the result per packed block of the first operand.
ffi::Error LstmDwImpl(ffi::ThreadPool xla, int64_t threads, int64_t kc, int64_t mc,
                      ffi::Buffer<ffi::F32> hp, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dz,
                      ffi::ResultBuffer<ffi::F32> dw_h, ffi::ResultBuffer<ffi::F32> dw_x) try {
  XlaPool::Scope scope(&xla);
  auto d = dz.dimensions(), dx = x.dimensions();
  if (d.size() != 3 || d[2] % (4 * TILE) != 0 || dx.size() != 3)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fused LSTM: dz must be [L, B, 4H] with H a multiple of 16 and x [L, B, E]");
  if (kc <= 0 || mc <= 0 || kc > INT32_MAX || mc > INT32_MAX)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "fused LSTM: dw kc and mc must be positive int32 values");
  const int64_t L = d[0], B = d[1], G = d[2], H = G / 4, E = dx[2];
  for (auto e : {check_dims("hp", hp.dimensions(), {L, B, H}), check_dims("x", dx, {L, B, E}),
                 check_dims("dw_h", dw_h->dimensions(), {H, G}),
                 check_dims("dw_x", dw_x->dimensions(), {E, G})})
    if (e.failure()) return e;
  Dw s{int(L * B), int(G), 2, {hp.typed_data(), x.typed_data()}, {int(H), int(E)},
       dz.typed_data(), {dw_h->typed_data(), dw_x->typed_data()}, DwBlocking{int(kc), int(mc)}};
  run_dw(s, clamp_threads(threads, G / DW_W));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("fused LSTM");
}

// The weight gradients' tuning probe: seconds for dw_h and dw_x at N rows, [H, 4H] and
// [E, 4H], blocking (kc, mc), on `threads` threads. Negative on failure.
extern "C" double hpnlp_lstm_dw_probe(int64_t N, int64_t H, int64_t E, int64_t kc, int64_t mc,
                                      int64_t threads) try {
  if (H % TILE != 0 || kc <= 0 || mc <= 0 || kc > INT32_MAX || mc > INT32_MAX) return -1.0;
  const int64_t G = 4 * H;
  std::vector<float> hp(N * H), x(N * E), dz(N * G), dw_h(H * G), dw_x(E * G);
  uint32_t state = 12345;
  for (auto* v : {&hp, &x, &dz})
    for (float& e : *v) {
      state = state * 1664525u + 1013904223u;
      e = float(state >> 8) * (1.0f / 16777216.0f) - 0.5f;
    }
  Dw s{int(N), int(G), 2, {hp.data(), x.data()}, {int(H), int(E)}, dz.data(),
       {dw_h.data(), dw_x.data()}, DwBlocking{int(kc), int(mc)}};
  const auto start = std::chrono::steady_clock::now();
  run_dw(s, clamp_threads(threads, G / DW_W));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
} catch (...) {
  return -1.0;
}

// The tuning probe (hpnlp.kernels.tuning): seconds for one forward (backward = 0, saving
// what the backward reads) or backward scan of L steps at [B, H] with blocking (kc, mr)
// on `threads` threads, over fixed pseudo-random inputs. Plain C, called through ctypes.
// Negative on failure.
extern "C" double hpnlp_lstm_probe(int64_t B, int64_t H, int64_t L, int64_t kc, int64_t mr,
                                   int64_t backward, int64_t threads) try {
  if (H % TILE != 0 || kc <= 0 || kc > INT32_MAX || mr < 1 || mr > MR) return -1.0;
  const size_t BH = size_t(B) * H, G = 4 * size_t(H);
  // 64-byte aligned like XLA's buffers, so the forward streams its outputs as in a real call.
  struct Aligned {
    explicit Aligned(size_t n, float x = 0.0f) : n_(n), p_(new (std::align_val_t(64)) float[n]) {
      std::fill(p_, p_ + n, x);
    }
    ~Aligned() { ::operator delete[](p_, std::align_val_t(64)); }
    float* data() { return p_; }
    float* begin() { return p_; }
    float* end() { return p_ + n_; }
    size_t n_;
    float* p_;
  };
  // The input width E = H (the rnn bench's shape).
  Aligned w(H * G), wx(H * G), bias(G), x(L * BH), valid(L * B, 1.0f), out(BH * L);
  Aligned hp(L * BH), cc(L * BH), act(L * B * G), h(2 * BH), c(2 * BH);
  Aligned dz(L * B * G), db(G), dh(BH), dc(BH), d_out(BH * L), c0(BH);
  uint32_t state = 12345;
  auto fill = [&](Aligned& x, float lo, float hi) {
    for (float& e : x) {
      state = state * 1664525u + 1013904223u;
      e = lo + (hi - lo) * float(state >> 8) * (1.0f / 16777216.0f);
    }
  };
  const float a = 1.0f / std::sqrt(float(H));
  fill(w, -a, a), fill(wx, -a, a), fill(x, -1, 1), fill(act, 0, 1), fill(cc, -1, 1), fill(d_out, -1, 1);
  const Blocking blk{int(kc), int(mr)};
  const int nt = clamp_threads(threads, backward ? (H / NR + 3) / 4 : H / NR);
  const auto start = std::chrono::steady_clock::now();
  if (backward) {
    Bwd s{int(L), int(B), int(H), int(H), blk, act.data(), cc.data(), c0.data(), w.data(),
          wx.data(), valid.data(), d_out.data(), dz.data(), db.data(), dh.data(), dc.data(),
          x.data()};  // dx written over x: the forward does not run in this probe
    run_bwd(s, nt);
  } else {
    Fwd s{int(L), int(B), int(H), int(H), true, true, blk, x.data(), bias.data(), wx.data(),
          w.data(), valid.data(), out.data(), hp.data(), cc.data(), act.data(), h.data(),
          c.data(), {}};
    run_fwd(s, nt);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
} catch (...) {
  return -1.0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpLstmFwd, LstmFwdImpl,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("kc")
                                  .Attr<int64_t>("mr")
                                  .Attr<bool>("save")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpLstmBwd, LstmBwdImpl,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("kc")
                                  .Attr<int64_t>("mr")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpLstmDw, LstmDwImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("kc")
                                  .Attr<int64_t>("mc")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
