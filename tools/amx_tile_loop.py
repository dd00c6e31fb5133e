"""The AMX int8 tile loop of the quantized products (qgemm.cc b_amx_item, i8_amx_tiles)
alone, on one core: how fast the 2 x 2 tile block runs with its activations laid out in
rows or in blocks, read by tileloadd or tileloaddt1.

    python tools/amx_tile_loop.py [--rows 1024] [--kw 16] [--panels 128]

A C++ loop (compiled here with g++ -O2 -mamx-tile -mamx-int8) multiplies `rows` activation
rows of 64 kw int8 by one weight panel of 32 columns (16 kw tile rows of 128 bytes, 32 KB
at kw = 16: it stays in L1) `panels` times, 32 rows a block: per 64 k, two activation
tiles, two weight tiles and four tdpbssd, as the kernels do. It prints int8 TOPS (2 ops a
multiply-add) for:

- tiles from L1: every tile load from the same 4 KB, the rest of the loop as it is (its
  block stores included): the loop's own ceiling;
- rows: activations in rows of 64 kw bytes, a tile's 16 rows that far apart (the layout
  before 2026-12-03);
- blocked: each 32-row block's k-tiles one after another, a tile 1 KB in a row;
- rows, tileloaddt1 / blocked, tileloaddt1: the same, the activations read with the
  non-temporal hint, so the panel, which every block reads again, stays in L1.

On one core of the Xeon model 167 (2026-12-03, the defaults, three runs): tiles from L1
4.68-4.72, rows 3.08-3.25, blocked 3.01-3.17, rows with tileloaddt1 4.15-4.28, blocked
with tileloaddt1 4.56-4.62 TOPS: blocked and hinted, the loop runs within 3% of its
ceiling, in rows a third below it. Runs there vary by up to a fifth with the VM's speed
(one later run read 4.45, 2.39, 2.65, 3.17 and 3.89): compare modes within one run.
"""

import argparse
import os
import subprocess
import sys
import tempfile

from ablib import at_least, print_cpu

SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct alignas(64) Cfg {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int MODE>  // 0 peak, 1 rows, 2 blocked, 3 rows + dt1, 4 blocked + dt1
double run(int rows, int kw, int panels) {
  const size_t ldx = size_t(kw) * 64;
  int8_t* x = static_cast<int8_t*>(aligned_alloc(64, rows * ldx));
  int8_t* e = static_cast<int8_t*>(aligned_alloc(64, size_t(kw) * 16 * 128));
  memset(x, 1, rows * ldx);
  memset(e, 1, size_t(kw) * 16 * 128);
  static Cfg c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
  alignas(64) static int32_t tb[32][32];
  const auto t0 = std::chrono::steady_clock::now();
  for (int p = 0; p < panels; ++p)
    for (int m = 0; m < rows; m += 32) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int j = 0; j < kw; ++j) {
        const int8_t* ek = MODE == 0 ? e : e + size_t(j) * 16 * 128;
        const int8_t* xa;  // the first activation tile
        size_t sx;
        if (MODE == 0) xa = x, sx = 64;
        else if (MODE == 1 || MODE == 3) xa = x + m * ldx + j * 64, sx = ldx;
        else xa = x + (size_t(m) * kw + size_t(j) * 32) * 64, sx = 64;
        const int8_t* xb = xa + 16 * sx;
        if (MODE >= 3) _tile_stream_loadd(4, xa, sx); else _tile_loadd(4, xa, sx);
        _tile_loadd(6, ek, 128);
        _tile_loadd(7, ek + 64, 128);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        if (MODE >= 3) _tile_stream_loadd(5, xb, sx); else _tile_loadd(5, xb, sx);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(0, tb[0], 128); _tile_stored(1, tb[0] + 16, 128);
      _tile_stored(2, tb[16], 128); _tile_stored(3, tb[16] + 16, 128);
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  free(x);
  free(e);
  return double(panels) * rows * kw * 64 * 32 * 2 / s / 1e12;
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    fprintf(stderr, "Linux refused the AMX tile state to this process\n");
    return 2;
  }
  const int rows = atoi(argv[1]), kw = atoi(argv[2]), panels = atoi(argv[3]);
  const char* names[] = {"tiles from L1", "rows", "blocked", "rows, tileloaddt1",
                         "blocked, tileloaddt1"};
  double (*fns[])(int, int, int) = {run<0>, run<1>, run<2>, run<3>, run<4>};
  for (int i = 0; i < 5; ++i) {
    fns[i](rows, kw, 4);  // warm up
    printf("%-22s %5.2f int8 TOPS\n", names[i], fns[i](rows, kw, panels));
  }
  return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=at_least(32), default=1024,
                    help="activation rows (whole 32-row blocks are timed)")
    ap.add_argument("--kw", type=at_least(1), default=16, help="64-k tiles of the contraction")
    ap.add_argument("--panels", type=at_least(1), default=128, help="passes over the rows")
    args = ap.parse_args()
    rows = args.rows // 32 * 32
    print_cpu(f"; rows {rows}, K = {64 * args.kw}, one core")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "loop.cc"), os.path.join(tmp, "loop")
        with open(src, "w") as f:
            f.write(SOURCE)
        built = subprocess.run(["g++", "-O2", "-std=c++17", "-mamx-tile", "-mamx-int8",
                                "-mavx512f", src, "-o", exe], capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"amx_tile_loop: g++ could not build the AMX loop (a compiler without "
                     f"-mamx-int8?):\n{built.stderr[-2000:]}")
        with open("/proc/cpuinfo") as f:
            if "amx_int8" not in f.read():
                sys.exit("amx_tile_loop: this CPU has no AMX int8 tiles (no amx_int8 in "
                         "/proc/cpuinfo): nothing to time")
        ran = subprocess.run([exe, str(rows), str(args.kw), str(args.panels)], text=True,
                             capture_output=True)
        if ran.returncode != 0:
            sys.exit(f"amx_tile_loop: {ran.stderr.strip() or 'the loop failed'}")
        print(ran.stdout, end="")


if __name__ == "__main__":
    main()
