// Quantized products as XLA FFI CPU kernels (inference only): int8 x int8 -> int32 (w8a8),
// binary x binary (XNOR-popcount) and float x int4 weight-only. hpnlp/compress/kernels.py
// wraps them, packs the weights once into the panels below, and keeps their XLA twins.
//
// All three are register-blocked GEMMs over weight *panels*: a weight is packed once (in
// Python) into [panels][k groups][NB columns][KP], so the kernel streams a panel
// contiguously while a block of activation rows broadcasts into it. Work items are
// (row chunk of mc rows, panel) pairs, in row-chunk-major order, claimed one at a time by
// the threads: all walk one chunk's panels together (its activations stay in each core's
// L2), and a panel's k-run stays in L1 across the chunk's register blocks.
// An item covers the whole contraction (partial sums, where a panel is read in k-blocks,
// stay within the item), so the epilogue (the int32 result, or its float rescaling)
// writes every output once.
//
// Paths, chosen at build time by the CPU's features (-march=native):
//   int8:   AVX-512 VNNI  vpdpbusd on (x + 128) as u8 times w as s8, 4 k a lane, minus
//                         128 * colsum(w) (precomputed at packing): exact.
//           AVX2          x and w widened to int16 (w at packing, x once per call) and
//                         vpmaddwd: 2 k a lane, exact. vpmaddubsw (u8 x s8 -> s16, 4 k a
//                         lane) saturates for full-range operands (2 * 255 * 127 > 32767);
//                         the |x| / sign(w, x) trick that avoids it needs vpsignb +
//                         vpmaddubsw + vpmaddwd(1) + vpaddd per 32 products against
//                         vpmaddwd + vpaddd per 16, the same multiply-port count, plus
//                         an extra instruction: no faster on Zen 3 and more code.
//           portable      plain loops over the AVX2 layout.
//           AMX           where the CPU has it and Linux grants it, from 16 rows: 32-row
//                         blocks x whole 64-k tiles by tdpbusd on the VNNI operands, the
//                         activations re-laid in blocks (i8_amx_tiles); the k past the
//                         last whole tile by vpdpbusd.
//   binary: AMX           where the CPU has it and Linux grants it: the +-1 values as int8
//                         by tdpbssd (b_amx_item), the weight's bits in the tiles' order.
//           AVX-512 VPOPCNTDQ  vpxorq + vpopcntq + vpaddq on 8 columns' 64-bit words; with
//                         DQ the outputs leave from registers (b_block_out).
//           AVX2          nibble-LUT popcount (vpshufb, Mula): x's nibbles split once per
//                         call, w's per k-word per register block; byte counts summed by
//                         vpsadbw every 31 words (31 * 8 <= 255). Scalar popcnt measured
//                         slower (3 ALU ops per 64 bits against 6 vector ops per 256).
//           portable      __builtin_popcountll.
//   int4:   one zmm or two ymm of 16 columns: 16 packed bytes sign-extended to int32,
//           the low nibble kept in place as n * 2^28 (v << 28) and the high as n * 16
//           (v & ~15), to float, FMA with activations pre-scaled by 2^-28 and 2^-4 (exact)
//           into per-group accumulators, times the group scale once a group. Nothing float
//           is stored.
//
// Threads: XLA's intra-op threads join a call (hpnlp::run_joined; Pool's own helpers
// outside XLA), work is claimed in grains, so a call never waits for a helper that has not
// started.
// Activation scratch is reused across calls by the calling thread (scratch()).
// The vector type and FFI checks come from hpnlp/kernels/simd.h.

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>

#include <unistd.h>

#include "simd.h"

namespace ffi = xla::ffi;
using namespace hpnlp;  // NOLINT: the kernels' vocabulary (vf, parallel, share, ...)

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HPNLP_I8_VNNI 1
constexpr int I8_KP = 4, I8_NB = 32, I8_MR = 8, I8_PATH = 2;
typedef int8_t I8W;   // packed weight element
typedef uint8_t I8X;  // activation element (x + 128)
#define HPNLP_I8W_FFI ffi::S8
inline I8X i8_x(int q) { return static_cast<uint8_t>(q + 128); }
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define HPNLP_I8_AMX 1
#endif
#else
constexpr int I8_KP = 2, I8_NB = 16, I8_MR = 6;
#if defined(__AVX2__)
constexpr int I8_PATH = 1;
#else
constexpr int I8_PATH = 0;
#endif
typedef int16_t I8W;
typedef int16_t I8X;
#define HPNLP_I8W_FFI ffi::S16
inline I8X i8_x(int q) { return static_cast<int16_t>(q); }
#endif

// B_NB columns per binary panel: four zmm of 64-bit words with VPOPCNTDQ (a register
// block of R rows x 32 columns loads each x word once for four popcounts, so broadcasts
// and the epilogue are spread over 4x the products), two ymm on AVX2.
#if defined(__AVX512VPOPCNTDQ__) && defined(__AVX512F__)
constexpr int B_PATH = 2, B_MR = 6, B_XW = 1, B_NB = 32;  // B_XW: words per k-word
#elif defined(__AVX2__)
constexpr int B_PATH = 1, B_MR = 4, B_XW = 2, B_NB = 8;  // (low nibbles, high nibbles)
#else
constexpr int B_PATH = 0, B_MR = 4, B_XW = 1, B_NB = 8;
#endif

#if defined(HPNLP_I8_AMX) && defined(__AVX512VPOPCNTDQ__) && defined(__AVX512BW__)
// The binary products on AMX tiles (b_amx_item) where Linux grants them: the +-1 values
// as int8, 1024 products a cycle by tdpbssd against 512 per 1.5 cycles by xor, popcount
// and add on the vector ports (the README's "Quantization" has the bound).
#define HPNLP_B_AMX 1
#endif

constexpr int I4_NB = 16;  // columns per int4 panel: one vf
#if defined(__AVX512F__)
constexpr int I4_MR = 8;
#else
constexpr int I4_MR = 4;
#endif
constexpr int I4_MC = 64;             // rows per int4 work item

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint64_t load_u64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Calls f(std::integral_constant<int, R>) for r = R in [1, MAX].
template <int MAX, class F>
inline void dispatch(int r, F&& f) {
  if constexpr (MAX == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    if (r == MAX) return f(std::integral_constant<int, MAX>{});
    dispatch<MAX - 1>(r, f);
  }
}

// Rows [m0, m1) in near-equal register blocks of <= mr rows: f(r0, integral_constant R).
template <int MAX, class F>
inline void row_blocks(int m0, int m1, int mr, F&& f) {
  const int rows = m1 - m0, blocks = (rows + mr - 1) / mr;
  for (int i = 0, r0 = m0; i < blocks; ++i) {
    const int R = rows / blocks + (i < rows % blocks);
    dispatch<MAX>(R, [&](auto rr) { f(r0, rr); });
    r0 += R;
  }
}

// Helper threads that live across calls, for the kernels run outside an XLA call (the
// tuning probes): inside one, the helpers are XLA's own intra-op threads
// (hpnlp::run_joined, the same join protocol), which ran the w8a8 LM prefill 1.13x and its
// batch-16 decoding 1.23x as fast as these (a Xeon, model 207, interleaved in one
// process), as a thread of the kernel's own shared a core with an XLA worker that was
// still spinning after the fusion before. Starting threads per call (std::thread in
// hpnlp::parallel) cost 0.15-3 ms a call on a loaded 2-core machine: the caller joins a
// helper that the scheduler starts only after another process's time slice, which made a
// [64, 128 -> 256] int8 layer 10x slower than float XLA. Here a call only opens join slots
// for helpers and never waits for one to arrive: the work is claimed dynamically (below), a
// late helper finds none left, and the caller waits only for helpers that joined (and so
// are running claimed work). A caller that finds the pool busy (another XLA thread's
// kernel) runs alone.
//
// A helper that finishes spins for kSpin before it parks on the condition variable: a
// decoding step calls the kernels every few tens of microseconds, and waking a parked
// thread (a futex round trip, then the scheduler) took about as long as a [1, 512 -> 2048]
// int4 product itself, so two threads ran it slower than one. A spinning helper joins
// within a microsecond. After its first few hundred polls it yields the core on every
// poll (to XLA's threads or another kernel's, if any is runnable), and after kSpin it
// parks, so an idle process gives its cores back.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool;  // never destroyed: parked helpers outlive main()
    return *pool;
  }

  // fn(t) on the caller (t = 0) and on up to threads - 1 helpers (t >= 1) that join: XLA's
  // intra-op threads inside a kernel's call (hpnlp::run_joined), this pool's elsewhere.
  template <class F>
  void run(int threads, F&& fn) {
    if (threads <= 1) return fn(0);
    if (ffi::ThreadPool* xla = XlaPool::current()) return run_joined(*xla, threads, fn);
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return fn(0);
    Guarded<std::remove_reference_t<F>> guarded(fn);
    const std::function<void(int)> job = std::ref(guarded);
    {
      std::lock_guard<std::mutex> lk(mu_);
      try {
        while (int(helpers_.size()) < threads - 1)
          helpers_.emplace_back([this] { loop(); }), helpers_.back().detach();
      } catch (const std::exception&) {
        // a helper that fails to start (pthread_create's EAGAIN at a limit on threads):
        // the work is claimed, so the helpers there are (or the caller alone) do it
      }
    }
    join_.open(&job, threads - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);  // a helper parks under mu_: none is missed
      if (parked_ > 0) wake_.notify_all();
    }
    job(0);
    join_.close();
    guarded.rethrow();
  }

 private:
  static constexpr std::chrono::microseconds kSpin{200};

  // A helper waits for open slots, then joins (hpnlp::JoinSlots).
  void loop() {
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spin = 0; join_.slots.load(std::memory_order_seq_cst) == 0; ++spin) {
        if (spin < 256) {
          spin_pause(0);
          continue;
        }
        const auto idle = std::chrono::steady_clock::now() - start;
        if (idle > kSpin) {
          std::unique_lock<std::mutex> lk(mu_);
          ++parked_;
          wake_.wait(lk, [&] { return join_.slots.load(std::memory_order_seq_cst) > 0; });
          --parked_;
          start = std::chrono::steady_clock::now(), spin = 0;
        } else {
          std::this_thread::yield();  // a runnable thread (XLA's, another kernel's) goes first
        }
      }
      join_.join();
    }
  }

  std::mutex busy_, mu_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  JoinSlots join_;
  int parked_ = 0;  // under mu_
};

// Items (row chunk of mc rows, panel) in groups of pg panels (all P: one group), row
// chunk by row chunk within a group, claimed by up to `threads` threads: a thread walks
// one group's panels, whose weights stay in its L2, for chunk after chunk, rather than
// streaming all the weights from L3 (or memory) again for every chunk. setup(r0, r1)
// fills the activation scratch of rows [r0, r1) (x quantized, binarized or pre-scaled)
// and item(m0, m1, panel) computes them. A chunk's rows
// are set up by the first thread that needs them, and each thread sets up the next chunk
// it will reach as soon as it starts one, so the setup overlaps the products instead of
// preceding them all (it read every activation once: 0.6 ms of a [2048, 512 -> 2048] int8
// product's 5.5 on a Xeon, model 207), and a chunk's activations are fresh in cache when
// its items run. No thread waits for a helper that has not started.
template <class Setup, class Item>
void run_items(int M, int P, int mc, int pg, int threads, Setup&& setup, Item&& item) {
  const int chunks = (M + mc - 1) / mc;
  const int64_t items = int64_t(chunks) * P;
  // item i: panel group g (pg panels; the last may have fewer), then chunk, then panel
  const int64_t per_group = int64_t(chunks) * pg;
  auto locate = [&](int64_t i, int* c, int* p) {
    const int64_t g = i / per_group, r = i % per_group;
    const int n = int(std::min<int64_t>(pg, P - g * pg));
    *c = int(r / n), *p = int(g * pg + r % n);
  };
  const int nt = clamp_threads(threads, std::max<int64_t>(items, 1));
  auto rows = [&](int c, auto&& fn) { fn(c * mc, std::min(M, (c + 1) * mc)); };
  if (nt == 1) {
    TilesReleased released;  // the AMX tile state an int8 item may take (simd.h)
    for (int p0 = 0; p0 < P; p0 += pg)
      for (int c = 0; c < chunks; ++c) {
        if (p0 == 0) rows(c, setup);
        for (int p = p0; p < std::min(P, p0 + pg); ++p)
          rows(c, [&](int m0, int m1) { item(m0, m1, p); });
      }
    return;
  }
  // state[c]: 0 not started, 1 being set up, 2 ready, 3 failed (its setup threw: the call
  // fails with that exception, and a thread that waited on the chunk would wait forever)
  std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[chunks]);
  for (int c = 0; c < chunks; ++c) state[c].store(0, std::memory_order_relaxed);
  auto start = [&](int c) {  // set chunk c up unless another thread has begun to
    int expect = 0;
    if (!state[c].compare_exchange_strong(expect, 1, std::memory_order_acq_rel)) return false;
    try {
      rows(c, setup);
    } catch (...) {
      state[c].store(3, std::memory_order_release);
      throw;
    }
    state[c].store(2, std::memory_order_release);
    return true;
  };
  auto ready = [&](int c) {  // false: chunk c failed, and this thread stops
    int st = state[c].load(std::memory_order_acquire);
    if (st == 2 || (st == 0 && start(c))) return true;
    for (int spin = 0; (st = state[c].load(std::memory_order_acquire)) == 1; ++spin)
      spin_pause(spin);
    return st == 2;
  };
  // Items [front, back) are left; the caller (t = 0) claims from the front, helpers from
  // the back, so over repeated calls on the same shapes (decoding) each core keeps
  // computing about the same panels, whose weights then stay in its own L2.
  // Claims take `grain` items at a time: every claim moves the counter's cache line
  // between the cores (about 0.1 us each), which cost a [1, 512 -> 2048] int4 product
  // (128 items of 0.4 us) a third of its time when each item was a claim.
  std::atomic<uint64_t> ends{uint64_t(items) << 32};
  const int64_t grain = std::max<int64_t>(1, items / (8 * nt));
  auto claim = [&](bool front, int64_t* first, int64_t* last) -> bool {
    uint64_t e = ends.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = int64_t(e & 0xffffffffu), hi = int64_t(e >> 32);
      if (lo >= hi) return false;
      const int64_t n = std::min(grain, hi - lo);
      const uint64_t next = front ? e + uint64_t(n) : e - (uint64_t(n) << 32);
      if (ends.compare_exchange_weak(e, next, std::memory_order_relaxed)) {
        *first = front ? lo : hi - n, *last = *first + n;
        return true;
      }
    }
  };
  Pool::get().run(nt, [&](int t) {
    TilesReleased released;
    const bool front = t == 0;
    int current = -1;
    for (int64_t first, last; claim(front, &first, &last);)
      for (int64_t k = 0; k < last - first; ++k) {
        const int64_t i = front ? first + k : last - 1 - k;
        int c, p;
        locate(i, &c, &p);
        if (c != current) {
          if (!ready(c)) return;
          const int next = front ? c + 1 : c - 1;  // the chunk this thread reaches next
          if (next >= 0 && next < chunks) start(next);
          current = c;
        }
        rows(c, [&](int m0, int m1) { item(m0, m1, p); });
      }
  });
}

// Fault in the missing pages of an output buffer up front (missing_pages: 1 MB pieces
// claimed by the threads, one MADV_POPULATE_WRITE each), before the kernel writes it.
// Where XLA's large outputs are fresh mappings (glibc's default malloc), faulting a
// [2048, 4096] float32 output page by page took 20 ms here, as long as the binary product
// itself. Small outputs are left alone.
inline void populate_out(void* p, size_t bytes, int threads) {
#ifdef MADV_POPULATE_WRITE
  if (bytes < 16 * 4096) return;
  std::vector<std::pair<uintptr_t, uintptr_t>> pieces;
  missing_pages(p, bytes, &pieces);
  if (pieces.empty()) return;
  std::atomic<size_t> next{0};
  Pool::get().run(clamp_threads(threads, int64_t(pieces.size())), [&](int) {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();)
      madvise(reinterpret_cast<void*>(pieces[i].first), pieces[i].second - pieces[i].first,
              MADV_POPULATE_WRITE);
  });
#else
  (void)p, (void)bytes, (void)threads;
#endif
}

// Whether a float (or int32) [M, N] output is written with streaming (non-temporal)
// stores: only where it is large (kStreamBytes, past the L2 of every core and much of an
// L3, so it would not stay cached for its reader anyway), its rows start 32-byte aligned,
// and AVX2 has the stores. They skip reading each line before overwriting it: the binary
// [2048, 1024 -> 4096] product, whose 32 MB output is a third of its time, ran 5.36 ->
// 4.94 ms (median of 15, timed between other layers' calls) on a 2-core EPYC. The int8
// product on vpdpbusd, 4x longer for the same output, gained little; on AMX tiles (a Xeon,
// model 167) its int8_linear ran 6.0 -> 5.0 ms, and int8_matmul, whose int32 outputs then
// also left from registers instead of a scalar copy, 10.5 -> 5.8 ms.
constexpr size_t kStreamBytes = size_t(8) << 20;
inline bool stream_out(const void* out, int M, int N) {
#if defined(__AVX2__)
  return sizeof(float) * size_t(M) * N >= kStreamBytes && N % 8 == 0 &&  // 4-byte elements
         reinterpret_cast<uintptr_t>(out) % 32 == 0;
#else
  (void)out, (void)M, (void)N;
  return false;
#endif
}

// The per-core size of data cache level 1 or 2 as the OS reports it (glibc reads CPUID),
// or `fallback` where it does not.
inline size_t cache_bytes(int level, size_t fallback) {
  const long v = sysconf(level == 1 ? _SC_LEVEL1_DCACHE_SIZE : _SC_LEVEL2_CACHE_SIZE);
  return v > 0 ? size_t(v) : fallback;
}

// Blocking by cache size (a panel: one weight panel's bytes over the whole contraction).
// k_block: k-groups per pass of a register block over a panel, so that the pass (at most
// 2/3 of L1, in equal blocks) stays in L1 across the row blocks that read it beside their
// activations. A [2048, 2048 -> 4096] int8 product's 64 KB panels, read whole, ran at 69%
// of vpdpbusd's peak on one core of a Xeon (model 207, 48 KB L1), against 99% for 32 KB.
// panel_group: panels per group of run_items, half of L2 of weights.
inline int k_block(int kq, size_t panel_bytes) {
  static const size_t room = cache_bytes(1, size_t(32) << 10) * 2 / 3;
  // K = 0: one (empty) block; a division by zero blocks killed the process (found in review)
  const int64_t blocks = std::max<int64_t>(1, int64_t((panel_bytes + room - 1) / room));
  return int((kq + blocks - 1) / blocks);
}
inline int panel_group(size_t panel_bytes, int P) {
  static const size_t room = cache_bytes(2, size_t(1) << 20) / 2;
  return int(std::clamp<size_t>(room / std::max<size_t>(panel_bytes, 1), 1, std::max(P, 1)));
}

// A scratch buffer of at least n elements, reused by the calling thread across calls
// (a fresh multi-megabyte vector per call is a fresh mapping: a page fault per 4 KB).
template <class T, int TAG>
T* scratch(size_t n) {
  static thread_local std::vector<T> buf;
  if (buf.size() < n) {
    buf.clear();
    buf.shrink_to_fit();
    buf.resize(n);
  }
  return buf.data();
}

// p rounded up to a multiple of 64 bytes (of a scratch of 64 bytes more than it needs):
// tile rows that start mid-line read two cache lines each.
template <class T>
inline T* align64(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// ------------------------------------------------------------------------------ int8

// t[r][c] = sum over kq k-groups of the panel at p of x[r] . w[:, c], for R rows at x (row
// stride ldx elements); added to t's sums when `add` (a later block of k).
template <int R>
inline void i8_block(const I8X* x, size_t ldx, const I8W* p, int kq, int32_t (*t)[I8_NB],
                     bool add) {
#if defined(HPNLP_I8_VNNI)
  // Named accumulators, rows unrolled by hand, and vpdpbusd as inline assembly that
  // updates its accumulator in place: with an accumulator array and the intrinsic, GCC 12
  // copied every accumulator into a scratch register and back around each vpdpbusd (two
  // moves per product) and kept two on the stack, so the loop issued about 50
  // instructions per 16 products; [2048, 1024 -> 4096] on one core of a Xeon (model 207)
  // ran 440 GOP/s, and 550 this way (vpdpbusd's peak there: 733).
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
          c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00,
          c60 = c00, c61 = c00, c70 = c00, c71 = c00;
  if (add) {
#define HPNLP_I8_LOAD(r, lo, hi) \
    if constexpr (R > r) lo = _mm512_loadu_si512(t[r]), hi = _mm512_loadu_si512(t[r] + 16);
    HPNLP_I8_LOAD(0, c00, c01) HPNLP_I8_LOAD(1, c10, c11) HPNLP_I8_LOAD(2, c20, c21)
    HPNLP_I8_LOAD(3, c30, c31) HPNLP_I8_LOAD(4, c40, c41) HPNLP_I8_LOAD(5, c50, c51)
    HPNLP_I8_LOAD(6, c60, c61) HPNLP_I8_LOAD(7, c70, c71)
#undef HPNLP_I8_LOAD
  }
  const I8X* x0 = x;
  for (int k = 0; k < kq; ++k, p += I8_NB * I8_KP, x0 += I8_KP) {
    const __m512i b0 = _mm512_loadu_si512(p), b1 = _mm512_loadu_si512(p + 64);
#define HPNLP_I8_ROW(r, lo, hi)                                          \
    if constexpr (R > r) {                                               \
      const __m512i a = _mm512_set1_epi32(load_i32(x0 + r * ldx));       \
      __asm__("vpdpbusd %2, %1, %0" : "+v"(lo) : "v"(a), "v"(b0));       \
      __asm__("vpdpbusd %2, %1, %0" : "+v"(hi) : "v"(a), "v"(b1));       \
    }
    HPNLP_I8_ROW(0, c00, c01)
    HPNLP_I8_ROW(1, c10, c11)
    HPNLP_I8_ROW(2, c20, c21)
    HPNLP_I8_ROW(3, c30, c31)
    HPNLP_I8_ROW(4, c40, c41)
    HPNLP_I8_ROW(5, c50, c51)
    HPNLP_I8_ROW(6, c60, c61)
    HPNLP_I8_ROW(7, c70, c71)
#undef HPNLP_I8_ROW
  }
  const __m512i acc[8][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                             {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
  static_assert(R <= 8, "the VNNI int8 block unrolls at most 8 rows");
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(t[r], acc[r][0]);
    _mm512_storeu_si512(t[r] + 16, acc[r][1]);
  }
#elif defined(__AVX2__)
  // Rows unrolled by hand, two (and the k step) at a time: with a loop over rows and an
  // accumulator array GCC kept 8 of R = 6's 12 accumulators on the stack (a load and a
  // store each, every k step), which made mr = 6 slower than 4.
  __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
          c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  if (add) {
#define HPNLP_I8_LOAD(r, lo, hi)                                                  \
    if constexpr (R > r) lo = _mm256_loadu_si256(reinterpret_cast<__m256i*>(t[r])), \
                         hi = _mm256_loadu_si256(reinterpret_cast<__m256i*>(t[r] + 8));
    HPNLP_I8_LOAD(0, c00, c01) HPNLP_I8_LOAD(1, c10, c11) HPNLP_I8_LOAD(2, c20, c21)
    HPNLP_I8_LOAD(3, c30, c31) HPNLP_I8_LOAD(4, c40, c41) HPNLP_I8_LOAD(5, c50, c51)
#undef HPNLP_I8_LOAD
  }
  const I8X* x0 = x;
  for (int k = 0; k < kq; ++k, p += I8_NB * I8_KP, x0 += 2) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
#define HPNLP_I8_ROW(r, lo, hi)                                          \
    if constexpr (R > r) {                                               \
      const __m256i a = _mm256_set1_epi32(load_i32(x0 + r * ldx));       \
      lo = _mm256_add_epi32(lo, _mm256_madd_epi16(a, b0));               \
      hi = _mm256_add_epi32(hi, _mm256_madd_epi16(a, b1));               \
    }
    HPNLP_I8_ROW(0, c00, c01)
    HPNLP_I8_ROW(1, c10, c11)
    HPNLP_I8_ROW(2, c20, c21)
    HPNLP_I8_ROW(3, c30, c31)
    HPNLP_I8_ROW(4, c40, c41)
    HPNLP_I8_ROW(5, c50, c51)
#undef HPNLP_I8_ROW
  }
  const __m256i acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  static_assert(R <= 6, "the AVX2 int8 block unrolls at most 6 rows");
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[r]), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[r] + 8), acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < I8_NB; ++c) t[r][c] = add ? t[r][c] : 0;
  for (int k = 0; k < kq; ++k, p += I8_NB * I8_KP)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < I8_NB; ++c)
        for (int j = 0; j < I8_KP; ++j)
          t[r][c] += int32_t(x[r * ldx + size_t(k) * I8_KP + j]) * int32_t(p[c * I8_KP + j]);
#endif
}


struct I8Gemm {
  int M, K, N, kq, P;
  int mc, mr;
  const I8W* w;           // [P][kq][I8_NB][I8_KP]
  const int32_t* colsum;  // [P * I8_NB]: sum over k of w (the VNNI offset's correction)
  I8X* xq;                // [M][kq * I8_KP] scratch (blocked on AMX: i8_amx_x)
  int32_t* out_i;         // [M, N] (int8_matmul) or null
  float* out_f;           // [M, N] (int8_linear) or null
  const float* ws;        // [N] weight scales (int8_linear)
  float* xs;              // [M] activation scales (int8_linear, scratch)
  const float* bias = nullptr;  // [N] added after rescaling (int8_linear), or null
  int act = 0;                  // then the activation: 0 none, 1 GELU (tanh form)
  int kb = 0;                   // k-groups per pass over a panel (i8_run sets it)
  bool stream = false;          // out_f or out_i written with streaming stores (stream_out)
  // On AMX (i8_run sets them): xq in 32-row blocks of whole k-tiles (i8_amx_x), the k
  // groups past the last whole k-tile (kq16 of them are in tiles) in xt, [M][kq - kq16]
  bool blocked = false;
  int kq16 = 0;
  I8X* xt = nullptr;
  bool amx_ok = true;  // false: the vector path only (the tuning probe times its blocks)
};

// GELU in its tanh form, flax's nn.gelu: y * (1 + tanh(c (y + 0.044715 y^3))) / 2, written
// y / (1 + exp(-2 c (y + 0.044715 y^3))) (the same function: one exp and one division). The
// exponent is clipped at 80 (y below about -10), and there the result is y * 0: -0, and NaN
// for y = -inf, what the twin's y (1 + tanh) / 2 gives where tanh is -1 (a bug hunt (session
// 99): the clipped quotient y / (1 + e^80) is not -0 but y * 1.8e-35, -18 at y = -1e36). With
// AVX-512 the division is the reciprocal estimate (relative error 2^-14) refined by one
// Newton step (then within a few ulp) and the exp is `vexp0`: a 16-lane vdivps issues once
// every 16 cycles or so on Intel cores, and with it and `vexp` the epilogue took 1.5 ms
// of a [2048, 512 -> 2048] layer's 7 ms on a Xeon (model 207).
constexpr float GELU_2C = 1.5957691216057308f;            // 2 sqrt(2 / pi)
constexpr float GELU_2C3 = 1.5957691216057308f * 0.044715f;  // 2 sqrt(2 / pi) 0.044715
inline vf gelu_tanh(vf y) {
  const vf u = -y * (splat(GELU_2C) + splat(GELU_2C3) * y * y);
#if defined(__AVX512F__)
  const vf d = 1.0f + vexp0(u < 80.0f ? u : splat(80.0f));
  const vf r = reinterpret_cast<vf>(_mm512_rcp14_ps(reinterpret_cast<__m512>(d)));
  return u > 80.0f ? y * 0.0f : y * (r * (2.0f - d * r));
#else
  return u > 80.0f ? y * 0.0f : y / (1.0f + vexp(u < 80.0f ? u : splat(80.0f)));
#endif
}
// The same on one AVX2 register (without AVX-512 a 16-float vf is lowered lane by lane).
inline v8f gelu_tanh8(v8f y) {
  const v8f u = -y * (GELU_2C + GELU_2C3 * y * y);
  const v8f cap = v8f{} + 80.0f;
  return u > cap ? y * 0.0f : y / (1.0f + vexp_t<v8f, v8i>(u < cap ? u : cap));
}
// The epilogue's vectors: whole registers on every build. With AVX-512 one 16-float vf; else
// 8 floats, one ymm on AVX2 (two xmm on the portable build), since without AVX-512 GCC
// lowers a 16-float vf lane by lane.
#if defined(__AVX512F__)
constexpr int EW = NR;
typedef vf EV;
typedef vi EVI;
inline EV gelu_ev(EV y) { return gelu_tanh(y); }
#else
constexpr int EW = 8;
typedef v8f EV;
typedef v8i EVI;
inline EV gelu_ev(EV y) { return gelu_tanh8(y); }
#endif
typedef float ev_u __attribute__((vector_size(EW * sizeof(float)), aligned(alignof(float))));
typedef int32_t evi_u __attribute__((vector_size(EW * sizeof(int32_t)), aligned(alignof(int32_t))));
// One epilogue vector (EW floats or int32 sums) to p, by streaming stores where `stream`
// (p 32-byte aligned: stream_out); stream_fence after a thread's streamed stores.
template <class T, class V>
inline void put_ev(T* p, V v, bool stream) {
  static_assert(sizeof(T) == 4 && sizeof(V) == EW * 4, "EW lanes of 4 bytes");
#if defined(__AVX512F__)
  if (stream) {
    const __m512i z = reinterpret_cast<__m512i>(v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(z));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p + 8), _mm512_extracti64x4_epi64(z, 1));
    return;
  }
#elif defined(__AVX2__)
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(v));
    return;
  }
#endif
  (void)stream;
  typedef V unaligned __attribute__((aligned(alignof(T))));
  *reinterpret_cast<unaligned*>(p) = v;
}
inline void stream_fence(bool stream) {
#if defined(__AVX2__)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}
inline float gelu_tanh(float y) {
  const float u = -y * (GELU_2C + GELU_2C3 * y * y);
  return u > 80.0f ? y * 0.0f : y / (1.0f + std::exp(std::min(u, 80.0f)));
}

// int8_linear's epilogue for one row's whole panel, from its int32 sums t: (acc * x scale) *
// w scale (the twin's order), + bias, then the activation, EW columns at a time, the same
// code for every build. Written as a scalar loop over the panel, GCC 12 extracted every sum
// to the stack and converted it alone (vpextrd, vcvtsi2ss) on AVX2 builds: 8% of perf's
// samples in a [2048, 1024 -> 4096] int8_linear on an EPYC Zen 3, where it then took 1.05x
// int8_matmul's time; in registers it takes about the same time as int8_matmul there.
inline void i8_row_epilogue(const I8Gemm& g, int row, int n0, const int32_t* t) {
  static_assert(I8_NB % EW == 0, "the epilogue runs whole vectors");
  const float xs = g.xs[row];
  float* out = g.out_f + size_t(row) * g.N + n0;
  for (int c = 0; c < I8_NB; c += EW) {
    EVI acc = *reinterpret_cast<const evi_u*>(t + c);
    if (I8_PATH == 2)  // the VNNI operand's + 128 offset: 128 * colsum
      acc -= *reinterpret_cast<const evi_u*>(g.colsum + n0 + c) * 128;
    EV f = __builtin_convertvector(acc, EV) * xs * *reinterpret_cast<const ev_u*>(g.ws + n0 + c);
    if (g.bias) f += *reinterpret_cast<const ev_u*>(g.bias + n0 + c);
    put_ev(out + c, g.act == 1 ? gelu_ev(f) : f, g.stream);
  }
}

#if defined(HPNLP_I8_AMX)
// Row m's 64 bytes of k-tile j (64 k) in the blocked activations: each 32-row block holds its
// k-tiles one after another, a k-tile's 32 rows of 64 bytes together, so a tile of 16 rows
// is 1 KB in a row and a block's tiles are read in order (the binary path's b_amx_x).
inline I8X* i8_amx_x(const I8Gemm& g, int m, int j) {
  return g.xq + ((size_t(m / 32) * (g.kq16 / 16) + j) * 32 + m % 32) * 64;
}

// AMX (Intel Sapphire Rapids and later; amx_ready in simd.h): one tdpbusd multiplies a
// 16 x 64 tile of u8 activations by a 64 x 16 tile of s8 weights into 16 x 16 int32 sums,
// 16 times the work of a vpdpbusd. The VNNI panel is already the right-hand tile's layout:
// its k-group row holds 32 columns x 4 k (128 bytes), so a tile is 16 k-groups of 16
// columns at a 128-byte stride; the activations (x + 128, the same colsum offset) are
// blocked (i8_amx_x). The sums of one block (NI tiles of 16 rows from row m) over k-tiles
// [j0, j1) of panel p into t, starting from zero (init null) or from init's sums; step()
// after each k-tile's products. Tiles 0-3 accumulate, 4-5 hold activations (read by
// tileloaddt1: they pass through, the panel's k-block stays in L1), 6-7 weights. GCC's
// tile intrinsics are asm without memory operands: the barriers tell the compiler that the
// tile loads read memory written before and the stores write t.
template <int NI, class Step>
inline void i8_amx_tiles(const I8Gemm& g, int m, const I8W* p, int j0, int j1,
                         int32_t (*t)[I8_NB], const int32_t (*init)[I8_NB], Step&& step) {
  static_assert(sizeof(I8X) == 1, "AMX reads 8-bit activations");
  constexpr size_t sb = I8_NB * I8_KP, sc = I8_NB * sizeof(int32_t);
  __asm__ volatile("" ::: "memory");
  if (init) {
    _tile_loadd(0, init[0], sc);
    _tile_loadd(1, init[0] + 16, sc);
    if constexpr (NI == 2) {
      _tile_loadd(2, init[16], sc);
      _tile_loadd(3, init[16] + 16, sc);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NI == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const I8X* x = i8_amx_x(g, m, 0);
  for (int j = j0; j < j1; ++j) {
    const I8W* pk = p + size_t(j) * 16 * sb;
    const I8X* xk = x + size_t(j) * 32 * 64;
    _tile_stream_loadd(4, xk, 64);
    _tile_loadd(6, pk, sb);
    _tile_loadd(7, pk + 64, sb);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if constexpr (NI == 2) {
      _tile_stream_loadd(5, xk + 16 * 64, 64);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
    step();
  }
  _tile_stored(0, t[0], sc);
  _tile_stored(1, t[0] + 16, sc);
  if constexpr (NI == 2) {
    _tile_stored(2, t[16], sc);
    _tile_stored(3, t[16] + 16, sc);
  }
  __asm__ volatile("" ::: "memory");
}

// Rows [m0, m1) (m0 a multiple of 32) against panel p on AMX tiles, 32 rows a block (rows
// past m1, in the scratch's tail past M, are computed and not finished), handed to
// finish(row, 1, t) a row at a time. The panel is read a k-block at a time, which stays in
// L1 (k_block), the sums waiting in memory between k-blocks; the k groups past the last
// whole k-tile are added by vpdpbusd. Each block's rows are finished while the tiles
// compute the next block, a step of rows after each k-tile (as b_amx_item), so the vector
// units and the tiles overlap.
template <class Finish>
void i8_amx_sums(const I8Gemm& g, int m0, int m1, const I8W* p, Finish&& finish) {
  constexpr size_t sb = I8_NB * I8_KP;
  const int nkt = g.kq16 / 16;
  const int kb = k_block(nkt, size_t(nkt) * 16 * sb);
  int32_t(*acc)[32][I8_NB] = nullptr;  // each block's sums between k-blocks
  if (kb < nkt)
    acc = reinterpret_cast<int32_t(*)[32][I8_NB]>(
        align64(scratch<int32_t, 8>(size_t(m1 - m0 + 31) / 32 * 32 * I8_NB + 16)));
  amx_ready();  // this thread's tile configuration
  alignas(64) int32_t tb[2][32][I8_NB];
  const size_t ldt = size_t(g.kq - g.kq16) * I8_KP;
  for (int j0 = 0; j0 < nkt; j0 += kb) {
    const int j1 = std::min(nkt, j0 + kb);
    const bool last = j1 == nkt;
    int cur = 0, prev_m = -1, prev_rows = 0, r = 0;
    const int per = (32 + (j1 - j0) - 1) / (j1 - j0);  // rows finished per k-tile
    auto step = [&] {
      for (const int r1 = std::min(prev_rows, r + per); r < r1; ++r)
        finish(prev_m + r, std::integral_constant<int, 1>{}, tb[cur ^ 1] + r);
    };
    for (int m = m0; m < m1; m += 32) {
      const int rows = std::min(32, m1 - m);
      int32_t(*t)[I8_NB] = last ? tb[cur] : acc[(m - m0) / 32];
      const int32_t(*init)[I8_NB] = j0 > 0 ? acc[(m - m0) / 32] : nullptr;
      if (rows > 16) i8_amx_tiles<2>(g, m, p, j0, j1, t, init, step);
      else i8_amx_tiles<1>(g, m, p, j0, j1, t, init, step);
      if (!last) continue;
      if (g.kq16 < g.kq)
        row_blocks<I8_MR>(m, m + rows, g.mr, [&](int r0, auto rr) {
          i8_block<decltype(rr)::value>(g.xt + size_t(r0) * ldt, ldt,
                                        p + size_t(g.kq16) * sb, g.kq - g.kq16, t + (r0 - m),
                                        true);
        });
      for (; r < prev_rows; ++r)  // what the k-tiles' steps left
        finish(prev_m + r, std::integral_constant<int, 1>{}, tb[cur ^ 1] + r);
      prev_m = m, prev_rows = rows, r = 0, cur ^= 1;
    }
    for (; r < prev_rows; ++r)
      finish(prev_m + r, std::integral_constant<int, 1>{}, tb[cur ^ 1] + r);
  }
}
#endif

void i8_item(const I8Gemm& g, int m0, int m1, int panel) {
  const size_t ldx = size_t(g.kq) * I8_KP;
  const I8W* p = g.w + size_t(panel) * g.kq * I8_NB * I8_KP;
  const int n0 = panel * I8_NB, nn = std::min(I8_NB, g.N - n0);
  // The sums of rows [m0, m1) against the panel, handed a register block at a time to
  // finish(r0, R, t): t[r] the int32 sums of row r0 + r.
  auto sums = [&](auto&& finish) {
#if defined(HPNLP_I8_AMX)
    if (g.blocked) {
      i8_amx_sums(g, m0, m1, p, finish);
      return;
    }
#endif
    if (g.kb >= g.kq) {  // the whole contraction in one pass of each register block
      row_blocks<I8_MR>(m0, m1, g.mr, [&](int r0, auto rr) {
        constexpr int R = decltype(rr)::value;
        alignas(64) int32_t t[R][I8_NB];
        i8_block<R>(g.xq + size_t(r0) * ldx, ldx, p, g.kq, t, false);
        finish(r0, rr, t);
      });
      return;
    }
    // kb k-groups at a time: every register block passes over one block of the panel,
    // which stays in L1 across them, before the next; partial sums wait in memory
    auto* t = reinterpret_cast<int32_t(*)[I8_NB]>(scratch<int32_t, 5>(size_t(m1 - m0) * I8_NB));
    for (int k0 = 0; k0 < g.kq; k0 += g.kb)
      row_blocks<I8_MR>(m0, m1, g.mr, [&](int r0, auto rr) {
        i8_block<decltype(rr)::value>(g.xq + size_t(r0) * ldx + size_t(k0) * I8_KP, ldx,
                                      p + size_t(k0) * I8_NB * I8_KP,
                                      std::min(g.kb, g.kq - k0), t + (r0 - m0), k0 > 0);
      });
    row_blocks<I8_MR>(m0, m1, g.mr, [&](int r0, auto rr) { finish(r0, rr, t + (r0 - m0)); });
  };
  if (g.out_f && nn == I8_NB) {  // a whole panel of int8_linear: the epilogue in registers
    sums([&](int r0, auto rr, const int32_t(*t)[I8_NB]) {
      for (int r = 0; r < decltype(rr)::value; ++r) i8_row_epilogue(g, r0 + r, n0, t[r]);
    });
    stream_fence(g.stream);
    return;
  }
  if (g.out_i && nn == I8_NB) {  // a whole panel of int8_matmul: the offset in registers
    sums([&](int r0, auto rr, const int32_t(*t)[I8_NB]) {
      for (int r = 0; r < decltype(rr)::value; ++r) {
        int32_t* out = g.out_i + size_t(r0 + r) * g.N + n0;
        for (int c = 0; c < I8_NB; c += EW) {
          EVI acc = *reinterpret_cast<const evi_u*>(t[r] + c);
          if (I8_PATH == 2) acc -= *reinterpret_cast<const evi_u*>(g.colsum + n0 + c) * 128;
          put_ev(out + c, acc, g.stream);
        }
      }
    });
    stream_fence(g.stream);
    return;
  }
  sums([&](int r0, auto rr, const int32_t(*t)[I8_NB]) {
    for (int r = 0; r < decltype(rr)::value; ++r) {
      const size_t row = size_t(r0 + r) * g.N + n0;
      int32_t v[I8_NB];
      for (int c = 0; c < I8_NB; ++c)
        v[c] = t[r][c] - (I8_PATH == 2 ? 128 * g.colsum[n0 + c] : 0);
      if (g.out_i) {
        std::memcpy(g.out_i + row, v, sizeof(int32_t) * nn);
      } else {
        const float xs = g.xs[r0 + r];
        for (int c = 0; c < nn; ++c) {
          float y = float(v[c]) * xs * g.ws[n0 + c];
          if (g.bias) y += g.bias[n0 + c];
          g.out_f[row + c] = g.act == 1 ? gelu_tanh(y) : y;
        }
      }
    }
  });
}

// max |x| over n floats (order-free: exact however it is split); NaN if any x is NaN, as
// the twin's jnp.max (a bug hunt (session 97): maxps returns its second operand where one
// is NaN, so a NaN was dropped, or kept, by where it fell, and the row's scale was finite).
// One unordered compare of the two loads finds a NaN in either: O(n) beside the O(n N)
// product.
inline float absmax(const float* x, int n) {
  int k = 0;
  float m = 0.0f;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  __mmask16 unord = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512 u = _mm512_loadu_ps(x + k), v = _mm512_loadu_ps(x + k + 16);
    a0 = _mm512_max_ps(a0, _mm512_abs_ps(u));
    a1 = _mm512_max_ps(a1, _mm512_abs_ps(v));
    unord |= _mm512_cmp_ps_mask(u, v, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  nan = unord != 0;
#endif
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), unord8 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    const __m256 u = _mm256_loadu_ps(x + k), v = _mm256_loadu_ps(x + k + 8);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, u));
    b = _mm256_max_ps(b, _mm256_andnot_ps(sign, v));
    unord8 = _mm256_or_ps(unord8, _mm256_cmp_ps(u, v, _CMP_UNORD_Q));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_max_ps(a, b));
  for (float v : t) m = std::max(m, v);
  nan = nan || _mm256_movemask_ps(unord8) != 0;
#endif
  for (; k < n; ++k) {
    m = std::max(m, std::fabs(x[k]));
    nan = nan || std::isnan(x[k]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// sum |x| over n floats, in 16 interleaved partial sums.
inline float abssum(const float* x, int n) {
  int k = 0;
#if defined(__AVX512F__)
  vf acc = vf{};
  for (; k + NR <= n; k += NR) {
    const vf v = load(x + k);
    acc += v < 0.0f ? -v : v;
  }
  float s = hsum(acc);
#else
  v8f a = v8f{}, b = v8f{};  // two registers: 16 interleaved partial sums, as above
  for (; k + 16 <= n; k += 16) {
    const v8f u = load8(x + k), v = load8(x + k + 8);
    a += u < 0.0f ? -u : u;
    b += v < 0.0f ? -v : v;
  }
  float s = hsum(join8(a, b));  // the same 16 lanes, summed by the same tree
#endif
  for (; k < n; ++k) s += std::fabs(x[k]);
  return s;
}

constexpr float kQuantTiny = 1e-30f;  // formats.TINY

// binary_linear's per-row scale beta = mean |x|, NaN where that is not finite (a NaN or an
// inf in the row, or a sum past FLT_MAX), 0 where it is at most formats.TINY, as the twin's
// and formats.py's binary scale (a bug hunt (session 103): an inf kept beta = inf, and the
// row's outputs +-inf, not NaN; review r8: a mean of 1e-31 was kept, where formats' is 0).
inline float binary_beta(const float* x, int n) {
  const float beta = abssum(x, n) / float(n);
  if (!std::isfinite(beta)) return std::numeric_limits<float>::quiet_NaN();
  return beta > kQuantTiny ? beta : 0.0f;
}

// The per-row int8 scale s = max |x| * fl(1 / 127) (0 for a row of zeros; NaN or inf as
// the row's max) into *scale; returns the factor that quantizes, fl(1 / s): q =
// round(x * fl(1 / s)) is formats.py's int8 rule as XLA computes it (round(x / s), whose
// division by a broadcast scale XLA makes a product with the scale's reciprocal, as it makes
// max |x| / 127 one with fl(1 / 127)), which QAT and the packed model decoded in XLA run:
// code for code (a review (r5): the factor fl(127 / max |x|) differed from fl(1 / s) in its
// last bit at some rows, and rounded a value near a half-step the other way). The factor
// is 0, every code of the row 0, as formats' and the twin's, where max |x| is 0, NaN, inf,
// or at most formats.TINY (1e-30): that takes in the rows where 127 / max |x| overflowed
// (review r5: an inf factor made x * inf NaN at the row's zeros, and each loop below
// converted NaN its own way: 0, -128 or -32768 by the column), and keeps s a normal float
// and 1 / s finite.
inline float quantize_scale(const float* x, int n, float* scale) {
  const float amax = absmax(x, n);
  *scale = amax * (1.0f / 127.0f);
  return amax > kQuantTiny && std::isfinite(amax) ? 1.0f / *scale : 0.0f;
}

// Sign bits of 64 floats from x (element b of the word: x[b] > 0), n <= 64 of them real.
inline uint64_t sign_word(const float* x, int n) {
  uint64_t word = 0;
  int b = 0;
#if defined(__AVX2__)
  const __m256 zero = _mm256_setzero_ps();
  for (; b + 8 <= n; b += 8)
    word |= uint64_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + b), zero, _CMP_GT_OQ))) << b;
#endif
  for (; b < n; ++b) word |= uint64_t(x[b] > 0.0f) << b;
  return word;
}

// Activations to the kernel's operand: int8 values as they are, float rows quantized per
// row (x * fl(1 / s), s = max|x| * fl(1 / 127), round to nearest even, clip to [-127,
// 127]): what the XLA twin and formats.py's int8 compute, operation for operation.
void i8_quantize_rows(const I8Gemm& g, const int8_t* x8, const float* xf, int r0, int r1) {
  const size_t ldx = size_t(g.kq) * I8_KP;
  // blocked (AMX): a row is quantized here, then copied to its k-tiles and tail
  I8X* row = g.blocked ? align64(scratch<I8X, 9>(ldx + 64)) : nullptr;
  for (int m = r0; m < r1; ++m) {
    I8X* q = g.blocked ? row : g.xq + m * ldx;
    if (x8) {
      const int8_t* xr = x8 + size_t(m) * g.K;
      for (int k = 0; k < g.K; ++k) q[k] = i8_x(xr[k]);
    } else {
      const float* xr = xf + size_t(m) * g.K;
      const float inv = quantize_scale(xr, g.K, &g.xs[m]);
      int k = 0;
      if (inv == 0.0f)  // zeros, a NaN or inf in the row, or a max |x| of at most 1e-30:
        // every q is 0, so the row's output is 0 * its scale, NaN where that is NaN or inf,
        // as the twin's (a bug hunt (session 97): x * 0 is NaN for those, converted to
        // -32768 or 0 by the build)
        for (; k < g.K; ++k) q[k] = i8_x(0);
      // cvtps rounds by the current mode (to nearest even, as nearbyint below and XLA's
      // round); the clip comes first, which rounding an integer bound does not change.
#if defined(__AVX512F__)
      // 16 at a time, narrowed by vpmovdb/vpmovdw (the values are in range) and the u8
      // offset (q + 128) as a flip of the sign bit: a third of the AVX2 loop's
      // instructions per float (this setup took a fifth of a [2048, 2048 -> 512] product)
      const __m512 vinv16 = _mm512_set1_ps(inv), lo16 = _mm512_set1_ps(-127.0f),
                   hi16 = _mm512_set1_ps(127.0f);
      for (; k + 16 <= g.K; k += 16) {
        const __m512i q32 = _mm512_cvtps_epi32(_mm512_min_ps(
            hi16, _mm512_max_ps(lo16, _mm512_mul_ps(_mm512_loadu_ps(xr + k), vinv16))));
        if constexpr (sizeof(I8X) == 2)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(q32));
        else
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k),
                           _mm_xor_si128(_mm512_cvtepi32_epi8(q32), _mm_set1_epi8(char(0x80))));
      }
#endif
#if defined(__AVX2__)
      const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
      for (; k + 8 <= g.K; k += 8) {
        const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv)));
        const __m256i q32 = _mm256_cvtps_epi32(v);
        __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
        if constexpr (sizeof(I8X) == 2) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), q16);
        } else {
          q16 = _mm_add_epi16(q16, _mm_set1_epi16(128));
          _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packus_epi16(q16, q16));
        }
      }
#endif
      for (; k < g.K; ++k) {
        const float v = std::min(127.0f, std::max(-127.0f, xr[k] * inv));
        q[k] = i8_x(int(std::nearbyint(v)));
      }
    }
    for (size_t k = g.K; k < ldx; ++k) q[k] = i8_x(0);
#if defined(HPNLP_I8_AMX)
    if (g.blocked) {
      for (int j = 0; j < g.kq16 / 16; ++j) std::memcpy(i8_amx_x(g, m, j), q + 64 * j, 64);
      const size_t ldt = ldx - size_t(g.kq16) * I8_KP;
      std::memcpy(g.xt + m * ldt, q + size_t(g.kq16) * I8_KP, ldt * sizeof(I8X));
    }
#endif
  }
}

// Whether this build has AMX and Linux grants this process the tiles (asked once; the
// asking thread's tiles released): then the int8 products run on them
// (hpnlp_qgemm_int8_products), and the binary ones where the build has their path too.
inline bool i8_amx_products() {
#if defined(HPNLP_I8_AMX)
  static const bool on = [] {
    const bool ready = amx_ready();
    release_tiles();
    return ready;
  }();
  return on;
#else
  return false;
#endif
}

void i8_run(I8Gemm& g, const int8_t* x8, const float* xf, int threads) {
  const size_t ldx = size_t(g.kq) * I8_KP;
  g.xs = scratch<float, 1>(g.M);
  const size_t panel = size_t(g.kq) * I8_NB * I8_KP * sizeof(I8W);
  g.kb = k_block(g.kq, panel);
  int mc = g.mc;
  // On AMX from 16 rows and 64 k: every row in tiles of the blocked activations (rows
  // rounded up to whole 32-row blocks, the scratch's rows past M computed and not
  // written), in row chunks of whole blocks whose activations fill half of L2 (the tuned
  // mc and mr are the vector path's, which the tuning probe times: amx_ok). On 2 cores of the
  // Xeon model 167 (python tools/qgemm_ab.py --rev de04987 --kind int8 --shapes ...),
  // against 64-byte rows read whole (the tuned chunks, the panel whole,
  // the rows past the last 16-row tile on vpdpbusd), int8_linear's [2048, 1024 -> 4096]
  // ran 4.4-4.5 -> 3.6-3.8 ms, [2048, 2048 -> 2048] 4.4 -> 4.0-4.2, [2048, 1000 -> 1024]
  // 1.6 -> 1.35; [2048, 4096 -> 1024] about the same (5.3-5.9 against 5.4-6.2), and
  // [2048, 4096 -> 32], where re-laying the rows outweighs the tiles, 1.25 -> 1.45.
  g.kq16 = g.kq / 16 * 16;
  g.blocked = g.amx_ok && i8_amx_products() && g.kq16 > 0 && g.M >= 16;
  if (g.blocked) {
    const size_t rows = size_t(g.M + 31) / 32 * 32;
    g.xq = align64(scratch<I8X, 0>(rows * g.kq16 * I8_KP + 64));
    g.xt = scratch<I8X, 10>(size_t(g.M) * (g.kq - g.kq16) * I8_KP + 1);
    const size_t room = cache_bytes(2, size_t(1) << 20) / 2;
    mc = int(std::clamp<size_t>(room / ldx / 32 * 32, 32, 1 << 20));
  } else {
    g.xq = align64(scratch<I8X, 0>(size_t(g.M) * ldx + 64));
  }
  run_items(g.M, g.P, mc, panel_group(panel, g.P), threads,
            [&](int r0, int r1) { i8_quantize_rows(g, x8, xf, r0, r1); },
            [&](int m0, int m1, int p) { i8_item(g, m0, m1, p); });
}

ffi::Error check_blocking(const char* kernel, int64_t mc, int64_t mr, int max_mr) {
  if (mc <= 0 || mr < 1 || mr > max_mr)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      std::string(kernel) + ": mc must be positive and mr in [1, " +
                          std::to_string(max_mr) + "]");
  return ffi::Error::Success();
}

ffi::Error i8_setup(I8Gemm* g, ffi::Span<const int64_t> x, ffi::Span<const int64_t> w,
                    ffi::Span<const int64_t> colsum, ffi::Span<const int64_t> out, int64_t mc,
                    int64_t mr) {
  const char* kernel = "int8 matmul";
  if (x.size() != 2 || out.size() != 2 || out[0] != x[0])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "int8 matmul: bad shape of x or out");
  const int64_t M = x[0], K = x[1], N = out[1], P = (N + I8_NB - 1) / I8_NB;
  const int64_t kq = (K + I8_KP - 1) / I8_KP;
  for (auto e : {check_blocking(kernel, mc, mr, I8_MR),
                 check_dims(kernel, "the packed weight", w, {P, kq, I8_NB, I8_KP}),
                 check_dims(kernel, "colsum", colsum, {P * I8_NB})})
    if (e.failure()) return e;
  *g = I8Gemm{int(M), int(K), int(N), int(kq), int(P), int(mc), int(mr), nullptr, nullptr,
              nullptr, nullptr, nullptr, nullptr, nullptr};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------- binary

#if defined(__AVX512VPOPCNTDQ__) && defined(__AVX512F__)
// acc[r][c] = 64-bit popcounts over kw words of x[r] xor the panel's columns 8c..8c+7 (one
// zmm of 8 columns' words), for R rows of the x scratch (row stride ldx uint64).
template <int R>
inline void b_counts(const uint64_t* x, size_t ldx, const uint8_t* p, int kw, __m512i (*acc)[B_NB / 8]) {
  constexpr int C = B_NB / 8;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int k = 0; k < kw; ++k) {
    __m512i w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(p + (size_t(k) * B_NB + 8 * c) * 8);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi64(static_cast<long long>(x[r * ldx + k]));
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_add_epi64(acc[r][c], _mm512_popcnt_epi64(_mm512_xor_si512(a, w[c])));
    }
  }
}
#endif

// t[r][c] = popcount over kw words of x[r] xor w[:, c], for R rows of the x scratch (row
// stride ldx uint64, B_XW words per k-word) and the panel at p ([kw][B_XW][B_NB] words).
template <int R>
inline void b_block(const uint64_t* x, size_t ldx, const uint8_t* p, int kw, int32_t (*t)[B_NB]) {
  if constexpr (B_PATH == 2) {
#if defined(__AVX512VPOPCNTDQ__) && defined(__AVX512F__)
    constexpr int C = B_NB / 8;
    __m512i acc[R][C];
    b_counts<R>(x, ldx, p, kw, acc);
    for (int r = 0; r < R; ++r)  // counts <= K < 2^31: the low dwords
      for (int c = 0; c < C; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[r] + 8 * c), _mm512_cvtepi64_epi32(acc[r][c]));
#endif
  } else if constexpr (B_PATH == 1) {
#if defined(__AVX2__)
    const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2,
                                         1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
    const __m256i zero = _mm256_setzero_si256();
    __m256i tot[R][2];  // int64 counts of columns 0-3 and 4-7
    for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = zero;
    for (int k0 = 0; k0 < kw; k0 += 31) {  // byte counts grow by <= 8 a word
      const int k1 = std::min(kw, k0 + 31);
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero;
      for (int k = k0; k < k1; ++k) {
        // The weight's nibbles were split at packing: [low words of 8 columns][high
        // words], read as memory operands of the xors (registers stay for accumulators).
        const __m256i* pk = reinterpret_cast<const __m256i*>(p + size_t(k) * 2 * B_NB * 8);
        for (int r = 0; r < R; ++r) {
          const uint64_t* xr = x + r * ldx + size_t(k) * 2;
          const __m256i al = _mm256_set1_epi64x(static_cast<long long>(xr[0]));
          const __m256i ah = _mm256_set1_epi64x(static_cast<long long>(xr[1]));
          acc[r][0] = _mm256_add_epi8(acc[r][0], _mm256_add_epi8(
              _mm256_shuffle_epi8(lut, _mm256_xor_si256(al, _mm256_loadu_si256(pk))),
              _mm256_shuffle_epi8(lut, _mm256_xor_si256(ah, _mm256_loadu_si256(pk + 2)))));
          acc[r][1] = _mm256_add_epi8(acc[r][1], _mm256_add_epi8(
              _mm256_shuffle_epi8(lut, _mm256_xor_si256(al, _mm256_loadu_si256(pk + 1))),
              _mm256_shuffle_epi8(lut, _mm256_xor_si256(ah, _mm256_loadu_si256(pk + 3)))));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) tot[r][h] = _mm256_add_epi64(tot[r][h], _mm256_sad_epu8(acc[r][h], zero));
    }
    // Columns 0-3 in the even dwords, 4-7 in the odd ones, then in order.
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int r = 0; r < R; ++r) {
      const __m256i both = _mm256_blend_epi32(tot[r][0], _mm256_slli_epi64(tot[r][1], 32), 0xAA);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t[r]), _mm256_permutevar8x32_epi32(both, order));
    }
#endif
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < B_NB; ++c) {
        int32_t s = 0;
        for (int k = 0; k < kw; ++k)
          s += __builtin_popcountll(x[r * ldx + k] ^ load_u64(p + (size_t(k) * B_NB + c) * 8));
        t[r][c] = s;
      }
  }
}

struct BGemm {
  int M, K, N, kw, P;
  int mc, mr;
  const uint8_t* w;  // [P][kw][B_XW][B_NB][8 bytes]: column c's k-word (bit j = element
                     // 64 kw + j), as (low, high) nibbles where B_XW = 2
  uint64_t* xw;      // [M][kw][B_XW] scratch
  int32_t* out_i;
  float* out_f;
  const float* alpha;  // [N]
  float* beta;         // [M] scratch
  bool stream = false;  // the output written with streaming stores (stream_out; out_i
                        // only from registers, b_block_out)
  bool amx = false;     // the AMX path: w in its bit order (b_amx_expand), x as int8 in xa
  int8_t* xa = nullptr;  // [round_up(M, 32) / 32][kw][32 rows][64] scratch (b_amx_x): +-1,
                         // 0 past K; rows past M as they were
};

#if defined(__AVX512VPOPCNTDQ__) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define HPNLP_B_FUSED_OUT 1
// b_block's VPOPCNTDQ path ending in the output: the float one (K < 2^24), out[r][c] =
// (K - 2 count) * beta[r] * alpha[c], or the int32 one (out_i), K - 2 count, converted
// from the 64-bit counts in registers (vcvtqq2ps, exact below 2^24; vpmovqd) instead of
// through an int32 tile in memory: at [2048, 1024 -> 4096] the
// epilogue had been about a sixth of the block's vector instructions, and this path ran
// the layer 1.17-1.20x faster on a Zen 5 (median of 15, two alternations). The same float
// operations in the same order as the tile path, on the same exact counts. Writes rows
// r0..r0+R and the full panel of columns at n0 (its words at p) of g's output.
template <int R>
inline void b_block_out(const BGemm& g, const uint8_t* p, int r0, int n0) {
  constexpr int C = B_NB / 8;
  const size_t ldx = size_t(g.kw) * B_XW;
  __m512i acc[R][C];
  b_counts<R>(g.xw + r0 * ldx, ldx, p, g.kw, acc);
  const size_t ldo = size_t(g.N), at = size_t(r0) * ldo + n0;
  const bool stream = g.stream;
  if (g.out_i) {
    int32_t* out_i = g.out_i + at;
    const __m512i kk = _mm512_set1_epi64(g.K);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        const __m256i v = _mm512_cvtepi64_epi32(_mm512_sub_epi64(kk, _mm512_slli_epi64(acc[r][c], 1)));
        __m256i* q = reinterpret_cast<__m256i*>(out_i + r * ldo + 8 * c);
        if (stream) _mm256_stream_si256(q, v);
        else _mm256_storeu_si256(q, v);
      }
    return;
  }
  float* out = g.out_f + at;
  const float* alpha = g.alpha + n0;
  const __m256 kf = _mm256_set1_ps(float(g.K)), two = _mm256_set1_ps(2.0f);
  for (int r = 0; r < R; ++r) {
    const __m256 b = _mm256_set1_ps(g.beta[r0 + r]);
    for (int c = 0; c < C; ++c) {
      const __m256 v = _mm256_fnmadd_ps(two, _mm512_cvtepi64_ps(acc[r][c]), kf);
      const __m256 o = _mm256_mul_ps(_mm256_mul_ps(v, b), _mm256_loadu_ps(alpha + 8 * c));
      if (stream) _mm256_stream_ps(out + r * ldo + 8 * c, o);
      else _mm256_storeu_ps(out + r * ldo + 8 * c, o);
    }
  }
}
#endif

void b_item(const BGemm& g, int m0, int m1, int panel) {
  const size_t ldx = size_t(g.kw) * B_XW;
  const uint8_t* p = g.w + size_t(panel) * g.kw * B_XW * B_NB * 8;
  const int n0 = panel * B_NB, nn = std::min(B_NB, g.N - n0);
  row_blocks<B_MR>(m0, m1, g.mr, [&](int r0, auto rr) {
    constexpr int R = decltype(rr)::value;
#ifdef HPNLP_B_FUSED_OUT
    if (nn == B_NB && (g.out_i || g.K < (1 << 24))) {
      b_block_out<R>(g, p, r0, n0);
      return;
    }
#endif
    int32_t t[R][B_NB];
    b_block<R>(g.xw + size_t(r0) * ldx, ldx, p, g.kw, t);
    for (int r = 0; r < R; ++r) {
      const size_t row = size_t(r0 + r) * g.N + n0;
#if defined(__AVX2__)
      if (nn == B_NB && g.out_f && g.K < (1 << 24)) {  // 8 columns a step: (K - 2 count) * beta * alpha
        const __m256 beta = _mm256_set1_ps(g.beta[r0 + r]), kf = _mm256_set1_ps(float(g.K));
        for (int c = 0; c < B_NB; c += 8) {
          const __m256 cnt = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t[r] + c)));
          const __m256 v = _mm256_fnmadd_ps(_mm256_set1_ps(2.0f), cnt, kf);  // exact: |v| <= K < 2^24
          const __m256 o = _mm256_mul_ps(_mm256_mul_ps(v, beta), _mm256_loadu_ps(g.alpha + n0 + c));
          if (g.stream) _mm256_stream_ps(g.out_f + row + c, o);
          else _mm256_storeu_ps(g.out_f + row + c, o);
        }
        continue;
      }
#endif
      int32_t v[B_NB];
      for (int c = 0; c < B_NB; ++c) v[c] = g.K - 2 * t[r][c];  // padding bits are 0 in both
      if (g.out_i) {
        std::memcpy(g.out_i + row, v, sizeof(int32_t) * nn);
      } else if (nn == B_NB) {
        const float beta = g.beta[r0 + r];
        for (int c = 0; c < B_NB; ++c) g.out_f[row + c] = float(v[c]) * beta * g.alpha[n0 + c];
      } else {
        const float beta = g.beta[r0 + r];
        for (int c = 0; c < nn; ++c) g.out_f[row + c] = float(v[c]) * beta * g.alpha[n0 + c];
      }
    }
  });
  stream_fence(g.stream);
}

#if defined(HPNLP_B_AMX)
// The AMX path's weight: the same bytes as the popcount path's panel [kw][32 columns][8],
// in another bit order (prepare_binary_weight packs it so where binary_products is
// "amx"): k-word j of the panel holds, for half h (columns 16h..16h+15) and k-group q
// (k = 64j + 4q .. 64j + 4q + 3), a 64-bit word at [j][16h + q] whose bit 4c + i is the
// sign bit of column 16h + c at k = 64j + 4q + i: one tile row of tdpbssd's right-hand
// operand, which one masked blend expands to its 64 bytes of +1 (bit set) and -1.
// kw k-words of it (from p) expanded into e [16 kw][32 columns][4]: the int8 panel layout of
// i8_amx_tiles.
inline void b_amx_expand(const uint8_t* p, int kw, int8_t* e) {
  const __m512i plus = _mm512_set1_epi8(1), minus = _mm512_set1_epi8(-1);
  for (int j = 0; j < kw; ++j)
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 16; ++q) {
        const __mmask64 bits = load_u64(p + (size_t(j) * 32 + 16 * h + q) * 8);
        _mm512_storeu_si512(e + (size_t(j) * 16 + q) * 128 + 64 * h,
                            _mm512_mask_blend_epi8(bits, minus, plus));
      }
}

// Row m's 64 int8 at k-word j in xa, whose 32-row blocks each hold their k-words one after
// another, a k-word's 32 rows of 64 bytes together: each tile of 16 rows is then 1 KB in a
// row, and a block's tiles are read in order. In rows of 64 kw bytes (a tile's rows 64 kw
// apart), the tile loop ran at 3.1-3.3 int8 TOPS on a core of the Xeon model 167, 4.6
// blocked and read by tileloaddt1 (non-temporal: the panel's expanded weight, reused by
// every block, stays in L1 and each block's rows pass through), within 3% of the loop with
// every tile from L1 (python tools/amx_tile_loop.py).
inline int8_t* b_amx_x(const BGemm& g, int m, int j) {
  return g.xa + ((size_t(m / 32) * g.kw + j) * 32 + m % 32) * 64;
}

// Rows [r0, r1) of a block's sums t (rows from m, panel columns from n0, nn of them) into
// the output: the int32 sums (binary_matmul), or sums * beta[m] * alpha[n] (binary_linear).
inline void b_amx_out(const BGemm& g, const int32_t (*t)[32], int m, int n0, int nn, int r0, int r1) {
  const size_t ldo = size_t(g.N);
  for (int r = r0; r < r1; ++r) {
    const size_t row = size_t(m + r) * ldo + n0;
    if (nn < 32) {  // the last panel's columns
      for (int c = 0; c < nn; ++c) {
        if (g.out_i) g.out_i[row + c] = t[r][c];
        else g.out_f[row + c] = float(t[r][c]) * g.beta[m + r] * g.alpha[n0 + c];
      }
      continue;
    }
    for (int h = 0; h < 2; ++h) {  // put_ev: streamed 32 bytes a store, stream_out's alignment
      const __m512i v = _mm512_loadu_si512(t[r] + 16 * h);
      if (g.out_i) {
        put_ev(g.out_i + row + 16 * h, v, g.stream);
        continue;
      }
      put_ev(g.out_f + row + 16 * h, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v),
                                                                 _mm512_set1_ps(g.beta[m + r])),
                                                   _mm512_loadu_ps(g.alpha + n0 + 16 * h)),
             g.stream);
    }
  }
}

// Rows [m0, m1) against one panel on AMX tiles, 32 rows a block (rows past m1, in the
// scratch's tail past M, are computed and not written). The output of each block is
// written while the tiles compute the next one: a step of rows after each k-word's
// products, so the vector units and the tiles overlap (written after the products, the
// [2048, 1024 -> 4096] layer ran 4.1 ms, interleaved 3.3 ms on 2 cores of a Xeon model 167).
// The panel is expanded and read a k-block at a time, which stays in L1 (k_block) beside
// the blocks' rows passing through; between k-blocks a block's sums wait in memory (acc).
// On 2 cores of the Xeon model 167, with the panel expanded whole (128 KB at K = 4096), the
// [2048, 4096 -> 1024] product ran 4.9 ms and [512, 4096 -> 4096] 3.9, against 4.1-4.5 and
// 3.0 in k-blocks (medians of 31 calls, three builds alternated as tools/qgemm_ab.py
// does, the panel-whole build uncommitted). Setting a chunk's rows up
// in pieces that both threads take (run_items), instead of one thread while the other
// waits, gained 4% at [512, 2048 -> 2048] and lost at 64 rows: left out.
void b_amx_item(const BGemm& g, int m0, int m1, int panel) {
  const int n0 = panel * B_NB, nn = std::min(B_NB, g.N - n0);
  const int kb = k_block(g.kw, size_t(g.kw) * 16 * 128);
  int8_t* e = align64(scratch<int8_t, 6>(size_t(kb) * 16 * 128 + 64));
  amx_ready();  // this thread's tile configuration
  int32_t(*acc)[32][32] = nullptr;  // each block's sums between k-blocks
  if (kb < g.kw)
    acc = reinterpret_cast<int32_t(*)[32][32]>(
        align64(scratch<int32_t, 11>(size_t(m1 - m0 + 31) / 32 * 32 * 32 + 16)));
  alignas(64) int32_t tb[2][32][32];
  for (int k0 = 0; k0 < g.kw; k0 += kb) {
    const int k1 = std::min(g.kw, k0 + kb);
    const bool last = k1 == g.kw;
    b_amx_expand(g.w + (size_t(panel) * g.kw + k0) * B_NB * 8, k1 - k0, e);
    int cur = 0, prev_m = -1, prev_rows = 0;
    const int per = (32 + (k1 - k0) - 1) / (k1 - k0);  // rows of the previous block per k-word
    for (int m = m0; m < m1; m += 32) {
      const int8_t* x = b_amx_x(g, m, 0);
      int32_t(*t)[32] = last ? tb[cur] : acc[(m - m0) / 32];
      __asm__ volatile("" ::: "memory");
      if (k0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        int32_t(*a)[32] = acc[(m - m0) / 32];
        _tile_loadd(0, a[0], 128);
        _tile_loadd(1, a[0] + 16, 128);
        _tile_loadd(2, a[16], 128);
        _tile_loadd(3, a[16] + 16, 128);
      }
      int r = 0;
      for (int j = k0; j < k1; ++j) {
        const int8_t* ek = e + size_t(j - k0) * 16 * 128;
        const int8_t* xk = x + size_t(j) * 32 * 64;
        _tile_stream_loadd(4, xk, 64);
        _tile_loadd(6, ek, 128);
        _tile_loadd(7, ek + 64, 128);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_stream_loadd(5, xk + 16 * 64, 64);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
        if (prev_m >= 0 && r < prev_rows) {
          const int r1 = std::min(prev_rows, r + per);
          b_amx_out(g, tb[cur ^ 1], prev_m, n0, nn, r, r1);
          r = r1;
        }
      }
      _tile_stored(0, t[0], 128);
      _tile_stored(1, t[0] + 16, 128);
      _tile_stored(2, t[16], 128);
      _tile_stored(3, t[16] + 16, 128);
      __asm__ volatile("" ::: "memory");
      if (last) prev_m = m, prev_rows = std::min(32, m1 - m), cur ^= 1;
    }
    if (prev_m >= 0) b_amx_out(g, tb[cur ^ 1], prev_m, n0, nn, 0, prev_rows);
  }
  stream_fence(g.stream);
}

// Rows [r0, r1) of x into xa as +-1 (packed bits, or the sign of floats with beta = mean
// |x|), zeros past K. The last block reads the scratch's rows past M as they are: an output
// row depends on its own input row only, and those are not written.
void b_amx_rows(const BGemm& g, const uint8_t* xb, const float* xf, int r0, int r1) {
  const int kb = (g.K + 7) / 8;
  const __m512i plus = _mm512_set1_epi8(1), minus = _mm512_set1_epi8(-1);
  for (int m = r0; m < r1; ++m) {
    if (!xb) g.beta[m] = binary_beta(xf + size_t(m) * g.K, g.K);
    for (int j = 0; j < g.kw; ++j) {
      const int n = std::min(64, g.K - 64 * j);
      uint64_t word;
      if (xb) {
        uint8_t bytes[8] = {};
        std::memcpy(bytes, xb + size_t(m) * kb + 8 * j, std::min(8, kb - 8 * j));
        word = load_u64(bytes);
      } else {
        word = sign_word(xf + size_t(m) * g.K + 64 * j, n);
      }
      const __mmask64 real = n == 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
      _mm512_storeu_si512(b_amx_x(g, m, j), _mm512_maskz_mov_epi8(real, _mm512_mask_blend_epi8(
                                                                  __mmask64(word), minus, plus)));
    }
  }
}
#endif

// Row m's k-word j into the scratch (split into nibbles for the AVX2 popcount).
inline void b_put(const BGemm& g, int m, int j, uint64_t word) {
  uint64_t* q = g.xw + (size_t(m) * g.kw + j) * B_XW;
  if constexpr (B_XW == 2) {
    q[0] = word & 0x0f0f0f0f0f0f0f0full;
    q[1] = (word >> 4) & 0x0f0f0f0f0f0f0f0full;
  } else {
    q[0] = word;
  }
}

// Packed rows ([M, ceil(K/8)] bytes) or float rows (sign bits, beta = mean |x|).
void b_rows(const BGemm& g, const uint8_t* xb, const float* xf, int r0, int r1) {
  const int kb = (g.K + 7) / 8;
  for (int m = r0; m < r1; ++m) {
    if (xb) {
      const uint8_t* xr = xb + size_t(m) * kb;
      for (int j = 0; j < g.kw; ++j) {
        uint8_t bytes[8] = {};
        std::memcpy(bytes, xr + 8 * j, std::min(8, kb - 8 * j));
        // bits past K count for nothing (as in the twin and the AMX path), set or not
        const int n = std::min(64, g.K - 64 * j);
        b_put(g, m, j, load_u64(bytes) & (n == 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1));
      }
    } else {
      const float* xr = xf + size_t(m) * g.K;
      g.beta[m] = binary_beta(xr, g.K);
      for (int j = 0; j < g.kw; ++j) b_put(g, m, j, sign_word(xr + 64 * j, std::min(64, g.K - 64 * j)));
    }
  }
}

void b_run(BGemm& g, const uint8_t* xb, const float* xf, int threads) {
  g.beta = scratch<float, 3>(g.M);
#if defined(HPNLP_B_AMX)
  if (g.amx && g.kw > 0) {  // K = 0: both layouts are empty, the popcounts' path is right
    g.xa = align64(scratch<int8_t, 7>(size_t(g.M + 31) / 32 * 32 * g.kw * 64 + 64));
    // Row chunks of whole 32-row blocks whose int8 rows fill half of L2, walked across
    // every panel (the tuned mc and mr are the popcount path's, which the tuning probe
    // times, a quarter of this or less): on
    // 2 cores of a Xeon model 167 the [2048, 1024 -> 4096] layer ran 4.4 ms at the tuned
    // 256 rows, 3.7 at 1024
    const size_t room = cache_bytes(2, size_t(1) << 20) / 2;
    const int mc = int(std::clamp<size_t>(room / (size_t(g.kw) * 64) / 32 * 32, 32, 1 << 20));
    run_items(g.M, g.P, mc, g.P, threads, [&](int r0, int r1) { b_amx_rows(g, xb, xf, r0, r1); },
              [&](int m0, int m1, int p) { b_amx_item(g, m0, m1, p); });
    return;
  }
#endif
  g.xw = scratch<uint64_t, 2>(size_t(g.M) * g.kw * B_XW);
  run_items(g.M, g.P, g.mc, g.P, threads, [&](int r0, int r1) { b_rows(g, xb, xf, r0, r1); },
            [&](int m0, int m1, int p) { b_item(g, m0, m1, p); });
}

// Whether the binary products run on AMX tiles in this process (the weight is then packed
// in b_amx_expand's bit order: hpnlp_qgemm_binary_products).
inline bool b_amx_products() {
#if defined(HPNLP_B_AMX)
  return i8_amx_products();
#else
  return false;
#endif
}

ffi::Error b_setup(BGemm* g, int64_t M, int64_t K, ffi::Span<const int64_t> w,
                   ffi::Span<const int64_t> out, int64_t mc, int64_t mr) {
  const char* kernel = "binary matmul";
  if (out.size() != 2 || out[0] != M || K < 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "binary matmul: bad shape of out");
  const int64_t N = out[1], P = (N + B_NB - 1) / B_NB, kw = (K + 63) / 64;
  for (auto e : {check_blocking(kernel, mc, mr, B_MR),
                 check_dims(kernel, "the packed weight", w, {P, kw, B_XW, B_NB, 8})})
    if (e.failure()) return e;
  *g = BGemm{int(M), int(K), int(N), int(kw), int(P), int(mc), int(mr), nullptr, nullptr,
             nullptr, nullptr, nullptr, nullptr};
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------ int4

struct I4Gemm {
  int M, K, N, kh, G, g, P;
  const float* x;      // [M, K]
  const uint8_t* w;    // [P][kh][I4_NB]: byte = row 2i (low nibble), 2i + 1 (high)
  const float* scale;  // [P][G][I4_NB]
  float* out;          // [M, N]
  float* x_ps = nullptr;  // [M, K] scratch: x pre-scaled for i4_unpack_raw
};

// Rows [r0, r1) of x into x_ps: even k times 2^-28, odd k times 2^-4.
void i4_prescale(const I4Gemm& s, int r0, int r1) {
  for (int m = r0; m < r1; ++m) {
    const float* x = s.x + size_t(m) * s.K;
    float* y = s.x_ps + size_t(m) * s.K;
    int k = 0;
    for (; k + 1 < s.K; k += 2) y[k] = x[k] * 0x1p-28f, y[k + 1] = x[k + 1] * 0x1p-4f;
    if (k < s.K) y[k] = x[k] * 0x1p-28f;
  }
}

// One register block: R rows times the panel's 16 columns over all of K. A single row
// (decoding), and every block on AVX-512, keeps the low- and high-nibble rows in separate
// accumulators, for twice the independent FMA chains: up to 8 rows there (16 of the 32
// zmm accumulating), which ran [16-63, 1024 -> 4096] 1.22-1.31x as fast as 4 rows with
// one accumulator a row (`python tools/qgemm_ab.py --kind int4`, Xeon model 167,
// 2026-12-03; 6 and 12 rows ran as 8). Vectors of 16 lanes: one zmm, or two ymm (written
// out: GCC's generic 16-lane vectors on AVX2 went through the stack here, 50x slower).
#if defined(__AVX512F__)
constexpr int I4_V = 1;
typedef __m512 I4F;
inline void i4_unpack(const uint8_t* p, const float* s_lo, const float* s_hi, I4F* lo, I4F* hi) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28)),
                        _mm512_loadu_ps(s_lo));
  hi[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 4)), _mm512_loadu_ps(s_hi));
}
inline void i4_unpack_raw(const uint8_t* p, I4F* lo, I4F* hi) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo[0] = _mm512_cvtepi32_ps(_mm512_slli_epi32(v, 28));
  hi[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(~15)));
}
inline I4F i4_load(const float* p) { return _mm512_loadu_ps(p); }
inline void i4_storev(float* p, I4F v) { _mm512_storeu_ps(p, v); }
inline I4F i4_fmav(I4F a, I4F b, I4F c) { return _mm512_fmadd_ps(a, b, c); }
inline I4F i4_fma(float x, I4F w, I4F acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
inline I4F i4_zero() { return _mm512_setzero_ps(); }
inline I4F i4_add(I4F a, I4F b) { return _mm512_add_ps(a, b); }
inline void i4_store(float* dst, const I4F* v, int n) {
  alignas(64) float t[16];
  _mm512_store_ps(t, v[0]);
  std::memcpy(dst, t, sizeof(float) * n);
}
#elif defined(__AVX2__)
constexpr int I4_V = 2;
typedef __m256 I4F;
inline void i4_unpack(const uint8_t* p, const float* s_lo, const float* s_hi, I4F* lo, I4F* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i v[2] = {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
  for (int j = 0; j < 2; ++j) {
    lo[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v[j], 28), 28)),
                          _mm256_loadu_ps(s_lo + 8 * j));
    hi[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(v[j], 4)),
                          _mm256_loadu_ps(s_hi + 8 * j));
  }
}
// Sign-extending loads (vpmovsxbd ymm, m64) of 8 bytes each: no shuffle of a 16-byte load.
inline void i4_unpack_raw(const uint8_t* p, I4F* lo, I4F* hi) {
  for (int j = 0; j < 2; ++j) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
    lo[j] = _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 28));
    hi[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(~15)));
  }
}
inline I4F i4_load(const float* p) { return _mm256_loadu_ps(p); }
inline void i4_storev(float* p, I4F v) { _mm256_storeu_ps(p, v); }
inline I4F i4_fmav(I4F a, I4F b, I4F c) { return _mm256_fmadd_ps(a, b, c); }
inline I4F i4_fma(float x, I4F w, I4F acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
inline I4F i4_zero() { return _mm256_setzero_ps(); }
inline I4F i4_add(I4F a, I4F b) { return _mm256_add_ps(a, b); }
inline void i4_store(float* dst, const I4F* v, int n) {
  alignas(32) float t[16];
  _mm256_store_ps(t, v[0]);
  _mm256_store_ps(t + 8, v[1]);
  std::memcpy(dst, t, sizeof(float) * n);
}
#else
constexpr int I4_V = 16;  // one float a "vector"
typedef float I4F;
inline void i4_unpack(const uint8_t* p, const float* s_lo, const float* s_hi, I4F* lo, I4F* hi) {
  for (int j = 0; j < 16; ++j) {
    const int v = int8_t(p[j]);
    lo[j] = float(int8_t(uint8_t(v << 4)) >> 4) * s_lo[j];
    hi[j] = float(v >> 4) * s_hi[j];
  }
}
inline void i4_unpack_raw(const uint8_t* p, I4F* lo, I4F* hi) {
  for (int j = 0; j < 16; ++j) {
    const int v = int8_t(p[j]);
    lo[j] = float(int32_t(uint32_t(v) << 28));
    hi[j] = float(v & ~15);
  }
}
inline I4F i4_load(const float* p) { return *p; }
inline void i4_storev(float* p, I4F v) { *p = v; }
inline I4F i4_fmav(I4F a, I4F b, I4F c) { return c + a * b; }
inline I4F i4_fma(float x, I4F w, I4F acc) { return acc + x * w; }
inline I4F i4_zero() { return 0.0f; }
inline I4F i4_add(I4F a, I4F b) { return a + b; }
inline void i4_store(float* dst, const I4F* v, int n) { std::memcpy(dst, v, sizeof(float) * n); }
#endif

template <int R>
inline void i4_block(const I4Gemm& s, int r0, int panel) {
  constexpr int S = R == 1 || I4_V == 1 ? 2 : 1;
  const float* x = s.x + size_t(r0) * s.K;
  const uint8_t* p = s.w + size_t(panel) * s.kh * I4_NB;
  const float* sc = s.scale + size_t(panel) * s.G * I4_NB;
  I4F acc[S][R][I4_V];
  for (int j = 0; j < S; ++j)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < I4_V; ++v) acc[j][r][v] = i4_zero();
  const int pairs = s.K / 2;
  int grp = 0, left = s.g;  // the group of row 2i and the rows left in it
  for (int i = 0; i < pairs; ++i) {
    const float* s_lo = sc + size_t(grp) * I4_NB;
    if (--left == 0) ++grp, left = s.g;
    const float* s_hi = sc + size_t(grp) * I4_NB;
    if (--left == 0) ++grp, left = s.g;
    I4F lo[I4_V], hi[I4_V];
    i4_unpack(p + size_t(i) * I4_NB, s_lo, s_hi, lo, hi);
    for (int r = 0; r < R; ++r) {
      const float xl = x[r * s.K + 2 * i], xh = x[r * s.K + 2 * i + 1];
      for (int v = 0; v < I4_V; ++v) {
        acc[0][r][v] = i4_fma(xl, lo[v], acc[0][r][v]);
        acc[S - 1][r][v] = i4_fma(xh, hi[v], acc[S - 1][r][v]);
      }
    }
  }
  if (s.K % 2) {  // the last row, alone in its byte's low nibble (the high one is 0)
    const float* s_lo = sc + size_t(grp) * I4_NB;
    I4F lo[I4_V], hi[I4_V];
    i4_unpack(p + size_t(pairs) * I4_NB, s_lo, s_lo, lo, hi);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < I4_V; ++v) acc[0][r][v] = i4_fma(x[r * s.K + s.K - 1], lo[v], acc[0][r][v]);
  }
  const int n0 = panel * I4_NB, nn = std::min(I4_NB, s.N - n0);
  for (int r = 0; r < R; ++r) {
    if constexpr (S == 2)
      for (int v = 0; v < I4_V; ++v) acc[0][r][v] = i4_add(acc[0][r][v], acc[1][r][v]);
    i4_store(s.out + size_t(r0 + r) * s.N + n0, acc[0][r], nn);
  }
}

// i4_unpack_raw leaves each nibble n where it lies, as a float: the low one as n * 2^28
// (a shift left), the high one as n * 16 (a mask), two instructions fewer than moving
// both down. The activations come pre-scaled to match (x_ps below: even k times 2^-28,
// odd k times 2^-4, exact powers of two), so every product is the same float as x * n
// where x * 2^-28 is a normal float: |x| >= 2^-98 (~3.2e-30; below it is subnormal, rounded,
// or 0 where the thread flushes denormals, as XLA's do).
//
// The same block with the scales applied per group, not per weight: the group's raw
// nibble products accumulate in registers (no scale load or multiply a weight), then
// acc += group sum * scale into a small array in L1 once a group. For groups of an even
// number of rows (pairs never straddle two groups) or a single group; i4_block does the
// rest. The unscaled sum overflows where the twin's x * (n * scale) may not, so this path
// matches the twin (up to float32 rounding) for nonzero |x| in [2^-98, FLT_MAX / (8 g)], g
// the group's rows (K for one group; ~3.3e35 at g = 128, ~4.3e37 at most): outside, it may
// lose the product (rounded or flushed below, inf or NaN above). Not guarded, to keep the
// inner loop as timed (a bug hunt (session 103)); a model's activations lie far inside.
template <int R>
inline void i4_block_grouped(const I4Gemm& s, int r0, int panel) {
  constexpr int S = R == 1 || I4_V == 1 ? 2 : 1;
  const float* x = s.x_ps + size_t(r0) * s.K;
  const uint8_t* p = s.w + size_t(panel) * s.kh * I4_NB;
  const float* sc = s.scale + size_t(panel) * s.G * I4_NB;
  alignas(64) float acc[R][I4_NB] = {};
  const int pairs = s.K / 2, per_group = s.G == 1 ? pairs + 1 : s.g / 2;
  for (int grp = 0; grp < s.G; ++grp) {
    I4F ga[S][R][I4_V];
    for (int j = 0; j < S; ++j)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < I4_V; ++v) ga[j][r][v] = i4_zero();
    const int i0 = grp * per_group, i1 = std::min(pairs, i0 + per_group);
    for (int i = i0; i < i1; ++i) {
      I4F lo[I4_V], hi[I4_V];
      i4_unpack_raw(p + size_t(i) * I4_NB, lo, hi);
      for (int r = 0; r < R; ++r) {
        const float xl = x[r * s.K + 2 * i], xh = x[r * s.K + 2 * i + 1];
        for (int v = 0; v < I4_V; ++v) {
          ga[0][r][v] = i4_fma(xl, lo[v], ga[0][r][v]);
          ga[S - 1][r][v] = i4_fma(xh, hi[v], ga[S - 1][r][v]);
        }
      }
    }
    if (s.K % 2 && grp == s.G - 1) {  // the last row, alone in its byte's low nibble
      I4F lo[I4_V], hi[I4_V];
      i4_unpack_raw(p + size_t(pairs) * I4_NB, lo, hi);
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < I4_V; ++v) ga[0][r][v] = i4_fma(x[r * s.K + s.K - 1], lo[v], ga[0][r][v]);
    }
    constexpr int W = I4_NB / I4_V;  // floats a vector
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < I4_V; ++v) {
        I4F t = ga[0][r][v];
        if constexpr (S == 2) t = i4_add(t, ga[1][r][v]);
        i4_storev(acc[r] + W * v, i4_fmav(t, i4_load(sc + size_t(grp) * I4_NB + W * v),
                                          i4_load(acc[r] + W * v)));
      }
  }
  const int n0 = panel * I4_NB, nn = std::min(I4_NB, s.N - n0);
  for (int r = 0; r < R; ++r) std::memcpy(s.out + size_t(r0 + r) * s.N + n0, acc[r], sizeof(float) * nn);
}

void i4_run(I4Gemm s, int threads) {
  const bool grouped = s.G == 1 || s.g % 2 == 0;
  if (grouped) s.x_ps = scratch<float, 4>(size_t(s.M) * s.K);
  run_items(s.M, s.P, I4_MC, s.P, threads, [&](int r0, int r1) {
    if (grouped) i4_prescale(s, r0, r1);
  }, [&](int m0, int m1, int p) {
    row_blocks<I4_MR>(m0, m1, I4_MR, [&](int r0, auto rr) {
      constexpr int R = decltype(rr)::value;
      if (grouped) {
        i4_block_grouped<R>(s, r0, p);
      } else {
        i4_block<R>(s, r0, p);
      }
    });
  });
}

// ----------------------------------------------------------------------------- probe

struct Lcg {
  uint32_t state = 12345;
  uint32_t next() { return state = state * 1664525u + 1013904223u; }
  float uniform() { return float(next() >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// The build's layouts, for the Python packers: 0 the int8 path (2 VNNI, 1 AVX2, 0
// portable), 1 its k per lane group (KP), 2 its panel columns (NB), 3 its most rows per
// register block; 4 the binary path (2 VPOPCNTDQ, 1 AVX2, 0 portable), 5 its panel columns,
// 6 its most rows; 7 the int4 panel columns; 8 the binary words per k-word (2: nibbles).
extern "C" int64_t hpnlp_qgemm_layout(int64_t what) {
  const int64_t v[] = {I8_PATH, I8_KP, I8_NB, I8_MR, B_PATH, B_NB, B_MR, I4_NB, B_XW};
  return what >= 0 && what < int64_t(sizeof v / sizeof v[0]) ? v[what] : -1;
}

// How the int8 products run in this process: 3 on AMX tiles (from 16 rows; k in whole
// tiles, vpdpbusd for the rest), else the build's int8 path (hpnlp_qgemm_layout's first value).
extern "C" int64_t hpnlp_qgemm_int8_products() { return i8_amx_products() ? 3 : I8_PATH; }

// How the binary products run in this process: 3 on AMX tiles (the weight packed in
// b_amx_expand's bit order), else the build's binary path (hpnlp_qgemm_layout's value 4).
extern "C" int64_t hpnlp_qgemm_binary_products() { return b_amx_products() ? 3 : B_PATH; }

// missing_pages (hpnlp/kernels/simd.h) for a test: the pieces of [p, p + bytes) that the
// kernels would fault in before writing, as (start, end) byte offsets from p into `out`
// (room for `cap` pieces); returns how many there are.
extern "C" int64_t hpnlp_missing_pages(const void* p, int64_t bytes, int64_t* out, int64_t cap) {
  std::vector<std::pair<uintptr_t, uintptr_t>> pieces;
  missing_pages(p, size_t(bytes), &pieces);
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < pieces.size() && int64_t(i) < cap; ++i)
    out[2 * i] = int64_t(pieces[i].first - base), out[2 * i + 1] = int64_t(pieces[i].second - base);
  return int64_t(pieces.size());
}

// The tuning probe (hpnlp.kernels.tuning): seconds for one float linear layer [M, K] x
// [K, N] with blocking (mc, mr) on `threads` threads, on fixed pseudo-random operands
// (the packed weight filled directly: its layout does not change the time). kind 0: int8
// (quantizing x), 1: binary (binarizing x), 2: int4 (mc, mr unused). Plain C, called through ctypes. Negative on
// failure.
extern "C" double hpnlp_qgemm_probe(int64_t kind, int64_t M, int64_t K, int64_t N, int64_t mc,
                                    int64_t mr, int64_t threads) try {
  Lcg rng;
  std::vector<float> x(size_t(M) * K), out(size_t(M) * N), scale(N, 0.01f);
  for (float& e : x) e = rng.uniform();
  if (kind == 0) {
    if (mc <= 0 || mr < 1 || mr > I8_MR) return -1.0;
    const int64_t P = (N + I8_NB - 1) / I8_NB, kq = (K + I8_KP - 1) / I8_KP;
    std::vector<I8W> w(size_t(P) * kq * I8_NB * I8_KP);
    for (I8W& e : w) e = I8W(int(rng.next() % 255) - 127);
    std::vector<int32_t> colsum(P * I8_NB, 0);
    I8Gemm g{int(M), int(K), int(N), int(kq), int(P), int(mc), int(mr), w.data(), colsum.data(),
             nullptr, nullptr, out.data(), scale.data(), nullptr};
    g.amx_ok = false;  // the blocks tuned are the vector path's (AMX sizes its own chunks)
    const auto start = std::chrono::steady_clock::now();
    i8_run(g, nullptr, x.data(), int(threads));
    return seconds_since(start);
  }
  if (kind == 1) {
    if (mc <= 0 || mr < 1 || mr > B_MR) return -1.0;
    const int64_t P = (N + B_NB - 1) / B_NB, kw = (K + 63) / 64;
    std::vector<uint8_t> w(size_t(P) * kw * B_XW * B_NB * 8);
    for (uint8_t& e : w) e = uint8_t(rng.next() >> 24);
    BGemm g{int(M), int(K), int(N), int(kw), int(P), int(mc), int(mr), w.data(), nullptr,
            nullptr, out.data(), scale.data(), nullptr};
    const auto start = std::chrono::steady_clock::now();
    b_run(g, nullptr, x.data(), int(threads));
    return seconds_since(start);
  }
  if (kind == 2) {  // int4, groups of 128 rows or one group (mc, mr unused)
    const int64_t P = (N + I4_NB - 1) / I4_NB, kh = (K + 1) / 2, G = K % 128 ? 1 : K / 128;
    std::vector<uint8_t> w(size_t(P) * kh * I4_NB);
    for (uint8_t& e : w) e = uint8_t(rng.next() >> 24);
    std::vector<float> sc(size_t(P) * G * I4_NB, 0.01f);
    const I4Gemm s{int(M), int(K), int(N), int(kh), int(G), int(K / G), int(P), x.data(), w.data(),
                   sc.data(), out.data()};
    const auto start = std::chrono::steady_clock::now();
    i4_run(s, int(threads));
    return seconds_since(start);
  }
  return -1.0;
} catch (...) {
  return -1.0;
}

// x [M, K] int8, w packed [P, kq, NB, KP], colsum [P * NB] -> [M, N] int32 exact.
ffi::Error Int8MatmulImpl(ffi::ThreadPool xla, int64_t threads, int64_t mc, int64_t mr,
                          ffi::Buffer<ffi::S8> x, ffi::Buffer<HPNLP_I8W_FFI> w,
                          ffi::Buffer<ffi::S32> colsum, ffi::ResultBuffer<ffi::S32> out) try {
  XlaPool::Scope scope(&xla);
  I8Gemm g;
  auto e = i8_setup(&g, x.dimensions(), w.dimensions(), colsum.dimensions(), out->dimensions(), mc, mr);
  if (e.failure()) return e;
  g.w = w.typed_data(), g.colsum = colsum.typed_data(), g.out_i = out->typed_data();
  g.stream = stream_out(g.out_i, g.M, g.N);  // int32: the size of a float
  populate_out(g.out_i, sizeof(int32_t) * g.M * size_t(g.N), int(threads));
  if (g.M > 0 && g.N > 0) i8_run(g, x.typed_data(), nullptr, int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("int8 matmul");
}

// x [M, K] float32 (quantized per row inside), w packed, colsum, w_scale [N], bias [N] or
// [0] (none) -> [M, N] float32 = act(acc * x_scale[m] * w_scale[n] + bias[n]), act by
// `activation` (0 none, 1 GELU in its tanh form).
ffi::Error Int8LinearImpl(ffi::ThreadPool xla, int64_t threads, int64_t mc, int64_t mr,
                          int64_t activation, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<HPNLP_I8W_FFI> w, ffi::Buffer<ffi::S32> colsum,
                          ffi::Buffer<ffi::F32> w_scale,
                          ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out) try {
  XlaPool::Scope scope(&xla);
  I8Gemm g;
  auto e = i8_setup(&g, x.dimensions(), w.dimensions(), colsum.dimensions(), out->dimensions(), mc, mr);
  if (e.failure()) return e;
  e = check_dims("int8 linear", "w_scale", w_scale.dimensions(), {g.N});
  if (e.failure()) return e;
  if (bias.element_count() != 0) {
    e = check_dims("int8 linear", "bias", bias.dimensions(), {g.N});
    if (e.failure()) return e;
    g.bias = bias.typed_data();
  }
  if (activation < 0 || activation > 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "int8 linear: activation must be 0 or 1");
  g.act = int(activation);
  g.w = w.typed_data(), g.colsum = colsum.typed_data(), g.out_f = out->typed_data();
  g.ws = w_scale.typed_data();
  g.stream = stream_out(g.out_f, g.M, g.N);
  populate_out(g.out_f, sizeof(float) * g.M * size_t(g.N), int(threads));
  if (g.M > 0 && g.N > 0) i8_run(g, nullptr, x.typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("int8 linear");
}

// x [M, ceil(K/8)] packed bits, w packed [P, kw, XW, NB, 8] -> [M, N] int32 = K - 2 popcount.
// amx: w is in the AMX bit order (b_amx_expand), and the products run on the tiles.
ffi::Error BinaryMatmulImpl(ffi::ThreadPool xla, int64_t threads, int64_t mc, int64_t mr,
                            int64_t k, int64_t amx, ffi::Buffer<ffi::U8> x, ffi::Buffer<ffi::U8> w,
                            ffi::ResultBuffer<ffi::S32> out) try {
  XlaPool::Scope scope(&xla);
  auto d = x.dimensions();
  if (d.size() != 2 || d[1] != (k + 7) / 8)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "binary matmul: bad shape of x");
  BGemm g;
  auto e = b_setup(&g, d[0], k, w.dimensions(), out->dimensions(), mc, mr);
  if (e.failure()) return e;
  g.w = w.typed_data(), g.out_i = out->typed_data(), g.amx = amx;
  if (amx && !b_amx_products())  // the weight is in the tiles' bit order: nothing else reads it
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "binary matmul: amx=1 where this process has no AMX tiles");
  populate_out(g.out_i, sizeof(int32_t) * g.M * size_t(g.N), int(threads));
#ifdef HPNLP_B_FUSED_OUT
  g.stream = stream_out(g.out_i, g.M, g.N);  // written from registers (b_block_out) only
#endif
  if (g.M > 0 && g.N > 0) b_run(g, x.typed_data(), nullptr, int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("binary matmul");
}

// x [M, K] float32 (binarized by sign inside, beta = mean |x| per row, NaN where not
// finite: binary_beta), w packed, alpha [N] -> [M, N] float32 = (K - 2 popcount) * beta[m]
// * alpha[n].
ffi::Error BinaryLinearImpl(ffi::ThreadPool xla, int64_t threads, int64_t mc, int64_t mr,
                            int64_t amx, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                            ffi::Buffer<ffi::F32> alpha, ffi::ResultBuffer<ffi::F32> out) try {
  XlaPool::Scope scope(&xla);
  auto d = x.dimensions();
  if (d.size() != 2)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "binary linear: bad shape of x");
  BGemm g;
  auto e = b_setup(&g, d[0], d[1], w.dimensions(), out->dimensions(), mc, mr);
  if (e.failure()) return e;
  e = check_dims("binary linear", "alpha", alpha.dimensions(), {g.N});
  if (e.failure()) return e;
  g.w = w.typed_data(), g.out_f = out->typed_data(), g.alpha = alpha.typed_data(), g.amx = amx;
  if (amx && !b_amx_products())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "binary linear: amx=1 where this process has no AMX tiles");
  g.stream = stream_out(g.out_f, g.M, g.N);
  populate_out(g.out_f, sizeof(float) * g.M * size_t(g.N), int(threads));
  if (g.M > 0 && g.N > 0) b_run(g, nullptr, x.typed_data(), int(threads));
  return ffi::Error::Success();
} catch (...) {
  return exception_error("binary linear");
}

// x [M, K] float32, w packed [P, ceil(K/2), NB] int4 pairs, scales [P, G, NB] (group
// g = K / G) -> [M, N] float32 = x @ (w * scale).
ffi::Error Int4LinearImpl(ffi::ThreadPool xla, int64_t threads, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> out) try {
  XlaPool::Scope scope(&xla);
  const char* kernel = "int4 linear";
  auto d = x.dimensions(), o = out->dimensions(), sd = scale.dimensions();
  if (d.size() != 2 || o.size() != 2 || o[0] != d[0] || sd.size() != 3 || sd[1] < 1 ||
      d[1] % sd[1] != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "int4 linear: bad shape of x, out or scale");
  const int64_t M = d[0], K = d[1], N = o[1], P = (N + I4_NB - 1) / I4_NB, G = sd[1];
  for (auto e : {check_dims(kernel, "the packed weight", w.dimensions(), {P, (K + 1) / 2, I4_NB}),
                 check_dims(kernel, "scale", sd, {P, G, I4_NB})})
    if (e.failure()) return e;
  I4Gemm s{int(M), int(K), int(N), int((K + 1) / 2), int(G), int(K / G), int(P), x.typed_data(),
           w.typed_data(), scale.typed_data(), out->typed_data()};
  if (M > 0 && N > 0) {
    if (K == 0) {
      std::fill(s.out, s.out + size_t(M) * N, 0.0f);
    } else {
      populate_out(s.out, sizeof(float) * M * size_t(N), int(threads));
      i4_run(s, int(threads));
    }
  }
  return ffi::Error::Success();
} catch (...) {
  return exception_error("int4 linear");
}

#define HPNLP_BLOCKED_ATTRS \
  .Attr<int64_t>("threads").Attr<int64_t>("mc").Attr<int64_t>("mr")

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() HPNLP_BLOCKED_ATTRS
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<HPNLP_I8W_FFI>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpInt8Linear, Int8LinearImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() HPNLP_BLOCKED_ATTRS
                                  .Attr<int64_t>("activation")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<HPNLP_I8W_FFI>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpBinaryMatmul, BinaryMatmulImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() HPNLP_BLOCKED_ATTRS
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("amx")
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpBinaryLinear, BinaryLinearImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>() HPNLP_BLOCKED_ATTRS
                                  .Attr<int64_t>("amx")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HpnlpInt4Linear, Int4LinearImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("threads")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
