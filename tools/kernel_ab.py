"""A CPU kernel at a git revision against the working tree's, timed interleaved in one
process through each build's plain C tuning probe (one forward or backward pass on fixed
inputs, no XLA), on this CPU's tuned blocks.

    python tools/kernel_ab.py --rev HEAD~1 [--kernel flash|lstm|spmm] [--rounds 9]
        [--length L] [--threads T] [--shape B,H,D] [--causal] [--bfloat16 [--widen 0|1]]
        [--fwd-blocks Q,K] [--bwd-blocks Q,K] [--rev-fwd-blocks Q,K] [--rev-bwd-blocks Q,K]
        [--dw-blocks KC,MC] [--rev-dw-blocks KC,MC]

Both libraries are built here the way `hpnlp.kernels` builds them (its flags, each with
its own revision's `simd.h`). Shapes: flash attention at the attention bench's (B=1,
H=8, D=64, L=4096; `--shape 32,4,32 --length 128 --causal` is the byte LM's), the fused
LSTM at the rnn bench's (B=32, H=512, L=256; from 2e2f035 its forward probe includes the
input projection, and from 9231e00 its backward the input gradient, so a revision before
them times less work: compare revisions on the same side; its third pass, the weight
gradients over all L*B rows, needs 7ef6a01 or later; `--rev-dw-blocks` gives the --rev
build its own blocks there; `--rev-fwd-blocks`/`--rev-bwd-blocks` do so for flash attention,
so `--rev HEAD` with different blocks on each side compares two block choices of one
kernel). The sparse product (`--kernel spmm`) runs its probe at `SPMM_SHAPES` on its
tuned `vectors`. A round runs every (build, pass) once, in a new random
order, after one untimed warm-up round; the table gives each median with its min-max,
and the median over rounds of the paired ratio (old / new in the same round), which
drifts of the machine's speed affect less.
"""

import argparse
import ctypes
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from ablib import print_cpu

SOURCES = {"flash": "hpnlp/attention/flash_cpu.cc", "lstm": "hpnlp/rnn/fused_lstm.cc",
           "spmm": "hpnlp/compress/spmm.cc"}
# The sparse product's passes: x [M, K] times a [K, N] CSC weight of per_col nonzeros a
# column (its tuning probe's shape, then two larger ones).
SPMM_SHAPES = ((1024, 512, 512, 26), (4096, 512, 2048, 52), (4096, 2048, 512, 102))
HEADER = "hpnlp/kernels/simd.h"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(files: dict[str, bytes], source: str, where: str) -> ctypes.CDLL:
    """Write `files` (name -> contents) into `where` and compile `source` (one of them)
    as `hpnlp.kernels` does, against the simd.h among them."""
    from hpnlp import kernels
    os.makedirs(where)
    for name, data in files.items():
        with open(os.path.join(where, name), "wb") as f:
            f.write(data)
    out = os.path.join(where, "kernel.so")
    try:
        kernels.compile_library(os.path.join(where, source), out, header_dir=where)
    except RuntimeError as e:
        sys.exit(f"kernel_ab: {e}")
    return ctypes.CDLL(out)


def read(paths, rev: str | None) -> dict[str, bytes]:
    """Each path's contents at git revision `rev` (None: the working tree's), by base name."""
    out = {}
    for p in paths:
        if rev is None:
            with open(os.path.join(ROOT, p), "rb") as f:
                out[os.path.basename(p)] = f.read()
        else:
            proc = subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, capture_output=True)
            if proc.returncode != 0:
                sys.exit(f"kernel_ab: no {p} at revision {rev!r}: "
                         f"{proc.stderr.decode().strip()}")
            out[os.path.basename(p)] = proc.stdout
    return out


def _blocks(flag: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in flag.split(",")) if flag else None


def probes(args) -> tuple[str, dict]:
    """(what it is, {pass: (its probe symbol, its argument list, its blocks)}) of
    args.kernel."""
    from hpnlp import kernels
    if args.kernel == "spmm":
        from hpnlp.compress import spmm
        threads = args.threads or kernels.cores()
        vectors = spmm.TUNING.config()["vectors"]
        return (f"the sparse product (CSC), {threads} threads",
                {f"M={M} K={K} N={N} per_col={c}": ("hpnlp_spmm_probe",
                                                    [M, K, N, c, vectors, threads],
                                                    {"vectors": vectors})
                 for M, K, N, c in SPMM_SHAPES})
    if args.kernel == "lstm":
        from hpnlp.rnn import fused
        B, H, L = 32, 512, args.length or 256
        threads = args.threads or fused.default_threads(B, H)
        passes = {}
        for name, backward in (("forward", 0), ("backward", 1)):
            cfg = fused.TUNINGS["bwd" if backward else "fwd"].config()
            passes[name] = ("hpnlp_lstm_probe", [B, H, L, cfg["kc"], cfg["mr"], backward,
                                                 threads], cfg)
        cfg = fused.TUNINGS["dw"].config()
        if args.dw_blocks:
            cfg = dict(zip(("kc", "mc"), (int(x) for x in args.dw_blocks.split(","))))
        # the weight gradients over all L*B rows, E = H, on every core (from 7ef6a01 on)
        passes["weight gradients"] = ("hpnlp_lstm_dw_probe", [L * B, H, H, cfg["kc"], cfg["mc"],
                                                              args.threads or kernels.cores()], cfg)
        return f"the fused LSTM, B={B} H={H} L={L}, {threads} threads", passes
    from hpnlp.attention import flash_cpu as F
    B, H, D = (int(x) for x in args.shape.split(","))
    L = args.length or 4096
    threads = args.threads or kernels.cores()
    fwd, bwd = F.tuned_blocks(args.bfloat16, F.regime(L, L, args.causal))
    fwd, bwd = _blocks(args.fwd_blocks) or fwd, _blocks(args.bwd_blocks) or bwd
    wide = (F.tuned_widen(F.regime(L, L, args.causal)) if args.bfloat16 else (0, 0))
    if args.widen is not None:
        wide = (args.widen,) * 2
    # widen: the last argument, which a revision before it (10 arguments) ignores
    passes = {name: ("hpnlp_flash_probe", [B, L, H, D, bq, bk, backward, threads,
                                           int(args.bfloat16), int(args.causal), int(w)],
                     {"bq": bq, "bk": bk, "widen": int(w)})
              for name, backward, (bq, bk), w in (("forward", 0, fwd, wide[0]),
                                                  ("backward", 1, bwd, wide[1]))}
    what = (f"flash attention, B={B} L={L} H={H} D={D}, "
            f"{'bfloat16' if args.bfloat16 else 'float32'}, causal={args.causal}, "
            f"{threads} threads")
    return what, passes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare against")
    ap.add_argument("--kernel", choices=sorted(SOURCES), default="flash")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--length", type=int, default=0, help="0: the bench's")
    ap.add_argument("--threads", type=int, default=0, help="0: the kernel's default")
    ap.add_argument("--shape", default="1,8,64",
                    help="flash attention: BATCH,HEADS,HEAD_DIM (default: the bench's 1,8,64; "
                         "the byte LM's is 32,4,32 at --length 128)")
    ap.add_argument("--causal", action="store_true", help="flash attention only")
    ap.add_argument("--bfloat16", action="store_true", help="flash attention only")
    for side in ("", "rev-"):
        for p, name in (("fwd", "forward"), ("bwd", "backward")):
            ap.add_argument(f"--{side}{p}-blocks",
                            help=f"flash attention: QUERIES,KEYS of the {name}"
                                 + (f" for the --rev build alone (default: --{p}-blocks')"
                                    if side else " (default: tuned)"))
    ap.add_argument("--dw-blocks", help="the fused LSTM: KC,MC of its weight gradients' "
                                        "product (default: tuned)")
    ap.add_argument("--rev-dw-blocks", help="the fused LSTM: KC,MC for the --rev build's weight "
                                            "gradients alone (default: --dw-blocks'), each "
                                            "build at its own best blocks")
    ap.add_argument("--widen", type=int, choices=(0, 1),
                    help="flash attention, --bfloat16: 1 widens the products to float32, 0 runs "
                         "them on the CPU's bfloat16 instructions (default: tuned; a revision "
                         "before the choice always runs the CPU's own)")
    args = ap.parse_args()
    flash_blocks = ("fwd_blocks", "bwd_blocks", "rev_fwd_blocks", "rev_bwd_blocks")
    if args.kernel != "flash" and (args.causal or args.bfloat16
                                  or any(getattr(args, f) for f in flash_blocks)
                                  or args.widen is not None
                                  or args.shape != ap.get_default("shape")):
        ap.error("--causal, --bfloat16, --shape, --widen and the --*fwd-blocks/--*bwd-blocks "
                 "are flash attention's options")
    if args.kernel == "spmm" and args.length:  # a bug hunt: taken, and never read
        ap.error("--length: the sparse product runs at its fixed SPMM_SHAPES; leave it out "
                 "with --kernel spmm")
    if args.widen is not None and not args.bfloat16:
        ap.error("--widen chooses the bfloat16 kernel's products: give --bfloat16 too")
    if (not re.fullmatch(r"[1-9]\d*,[1-9]\d*,[1-9]\d*", args.shape)
            or int(args.shape.split(",")[2]) % 16):
        ap.error(f"--shape {args.shape!r}: give positive BATCH,HEADS,HEAD_DIM, HEAD_DIM a multiple "
                 "of 16, e.g. 32,4,32")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for flag in ("length", "threads"):  # the probe would fail only after both builds
        if getattr(args, flag) < 0:
            ap.error(f"--{flag} {getattr(args, flag)}: give a positive number (0: the default)")
    for flag in flash_blocks:
        value = getattr(args, flag)
        if value is not None and (not re.fullmatch(r"[1-9]\d*,[1-9]\d*", value)
                                  or any(int(x) % 16 for x in value.split(","))):
            ap.error(f"--{flag.replace('_', '-')} {value!r}: give QUERIES,KEYS, two positive "
                     "multiples of 16, e.g. 64,128")
    sys.path.insert(0, ROOT)
    from hpnlp.kernels import tuning

    for flag in ("dw_blocks", "rev_dw_blocks"):
        value = getattr(args, flag)
        if value is not None and (args.kernel != "lstm"
                                  or not re.fullmatch(r"[1-9]\d*,[1-9]\d*", value)):
            ap.error(f"--{flag.replace('_', '-')} {value!r}: give KC,MC, two positive numbers, "
                     "with --kernel lstm")
    what, passes = probes(args)
    source = SOURCES[args.kernel]
    tmp = tempfile.mkdtemp(prefix="kernel_ab_")
    try:
        libs = {rev or "working tree": build(read((source, HEADER), rev),
                                             os.path.basename(source), os.path.join(tmp, str(i)))
                for i, rev in enumerate((args.rev, None))}
    finally:  # the libraries stay loaded; their files are no longer needed
        shutil.rmtree(tmp, ignore_errors=True)
    calls = {(lib, p): probe for lib in libs for p, probe in passes.items()}
    for p, (symbol, probe_args, cfg) in passes.items():  # the --rev build's own blocks
        if p == "weight gradients" and args.rev_dw_blocks:
            probe_args = probe_args[:3] + list(_blocks(args.rev_dw_blocks)) + probe_args[5:]
        rev_blocks = _blocks({"forward": args.rev_fwd_blocks,
                              "backward": args.rev_bwd_blocks}.get(p))
        if symbol == "hpnlp_flash_probe" and rev_blocks:
            probe_args = probe_args[:4] + list(rev_blocks) + probe_args[6:]
        calls[args.rev, p] = (symbol, probe_args, cfg)
    times = {call: [] for call in calls}
    for r in range(args.rounds + 1):  # round 0: warm-up, not kept
        order = list(times)
        random.shuffle(order)
        for lib, p in order:
            symbol, probe_args, cfg = calls[lib, p]
            t = tuning.run_probe(libs[lib], symbol, probe_args, what, cfg)
            if r > 0:
                times[lib, p].append(t)
    print_cpu(f"; {what}; blocks: " + ", ".join(f"{p} {cfg}" for p, (_, _, cfg) in passes.items())
              + (f" ({args.rev}'s: {args.rev_dw_blocks})" if args.rev_dw_blocks else "")
              + "".join(f" ({args.rev}'s {p}: {v})" for p, v in (
                  ("forward", args.rev_fwd_blocks), ("backward", args.rev_bwd_blocks)) if v)
              + f"; {args.rounds} rounds")
    old_lib, new_lib = libs
    print(f"| pass | {old_lib} ms | {new_lib} ms | speed-up (medians) | paired ratio, median "
          "(min-max) |")
    print("|---|---|---|---|---|")

    def cell(ts):  # milliseconds, 3 decimals under 10 ms (the sparse product's passes)
        digits = 1 if statistics.median(ts) >= 0.01 else 3
        return (f"{statistics.median(ts) * 1e3:.{digits}f} "
                f"({min(ts) * 1e3:.{digits}f}-{max(ts) * 1e3:.{digits}f})")

    for p in passes:
        old, new = times[old_lib, p], times[new_lib, p]
        ratios = [o / n for o, n in zip(old, new)]
        print(f"| {p} | {cell(old)} | {cell(new)} | "
              f"{statistics.median(old) / statistics.median(new):.3f}x | "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
