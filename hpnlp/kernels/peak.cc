// The cores' float32 FMA peak: every thread runs a loop of independent vector FMAs on
// registers only, no loads, no stores, no dependency chain shorter than ACC FMAs. No
// float32 kernel on this CPU can do its multiply-adds faster, whatever its blocking, so a
// benchmark report that says what a target asks of a kernel can compare that with this
// ceiling as well as with XLA's own matrix-product rate (which a drifting machine, or a
// library below the peak, can read low). Plain C entry points for ctypes
// (hpnlp.kernels.peak); no XLA FFI target.

#include <chrono>
#include <cstdint>

#define HPNLP_NATIVE_VECTORS  // whole vectors of NR floats (simd.h): AVX2 keeps them in ymm
#include "simd.h"

using namespace hpnlp;  // NOLINT: vf, splat, parallel

namespace {

// Independent accumulators: more than FMA latency x FMA units on the CPUs we know (4 x 2
// on Zen 4/5 and Xeons), and with the two operands within AVX2's 16 registers.
constexpr int ACC = 12;

}  // namespace

extern "C" {

// Floats per vector in this build (16 with AVX-512, else 8), and vector FMAs per round.
int64_t hpnlp_fma_lanes() { return NR; }
int64_t hpnlp_fma_accumulators() { return ACC; }

// Seconds for `threads` threads to run `iters` rounds of ACC vector FMAs each (2 x NR x
// ACC x iters x threads floating-point operations), or -1 for bad arguments or a thread that
// could not start (an exception may not leave a C entry point: it would abort the process).
double hpnlp_fma_peak(int64_t threads, int64_t iters) try {
  if (threads < 1 || iters < 1) return -1.0;
  float sink[64] = {};
  const auto t0 = std::chrono::steady_clock::now();
  parallel(int(threads), [&](int p) {
    vf acc[ACC];
    for (int i = 0; i < ACC; ++i) acc[i] = splat(float(i + p));
    const vf mul = splat(0.999999f), add = splat(1e-7f);
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < ACC; ++i) acc[i] = acc[i] * mul + add;  // contracted to one FMA
    vf total = vf{};
    for (int i = 0; i < ACC; ++i) total += acc[i];
    sink[p % 64] = total[0];  // the result is used: the loop cannot be dropped
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sink[0];
  (void)keep;
  return seconds;
} catch (...) {
  return -1.0;
}

}  // extern "C"
