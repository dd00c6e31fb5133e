"""The quantized products (`hpnlp.compress.kernels`: int8_linear, binary_linear,
int4_linear) at a git revision against the working tree's, through the real XLA FFI
calls, alternated between processes.

    python tools/qgemm_ab.py --rev HEAD~1 [--kind int8|binary|int4] [--rounds 3] [--calls 31]
        [--shapes 2048,1024,4096:2048,2048,2048] [--threads T]

Each side is the whole `hpnlp` package of its revision (`git archive`; the working tree's
own for the other), imported by a child process with its own kernel cache, so each builds
(and tunes) its own qgemm.cc. A round runs one child per side, in a new random order; a
child times every shape (`--calls` calls after one warm-up, their median) and prints them.
The table gives each side's median over rounds with its min-max, and the median over
rounds of the paired ratio (rev / tree in the same round), which drifts of the machine's
speed affect less. The numbers the AMX rework of 2026-12-03 quotes in qgemm.cc come from
this alternation (three rounds, 31 calls).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

from ablib import at_least, print_cpu, scratch_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
import jax, numpy as np
from hpnlp.compress import formats, kernels, packing
kind, calls, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) or None
shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[4].split(":")]
out = {}
for M, K, N in shapes:
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = jax.random.normal(jax.random.key(1), (K, N)) * K ** -0.5
    if kind == "int8":
        c, s = formats.get("int8").encode(w, (0,))
        wq = kernels.prepare_int8_weight(c, s[0])
        fn = jax.jit(lambda a, b: kernels.int8_linear(a, b, impl="kernel", threads=threads))
    elif kind == "int4":  # weight-only, group scales of 128 rows (one group where K is less)
        g = 128 if K % 128 == 0 else K
        c, s = formats.get("int4").encode(w, (0,), group=g)
        wq = kernels.prepare_int4_weight(packing.pack_int4(c.reshape(K, N)),
                                         s.reshape(K // g, N), k=K)
        fn = jax.jit(lambda a, b: kernels.int4_linear(a, b, impl="kernel", threads=threads))
    else:
        c, s = formats.get("binary").encode(w, (0,))
        wq = kernels.prepare_binary_weight(packing.pack_bits(c), s[0], k=K)
        fn = jax.jit(lambda a, b: kernels.binary_linear(a, b, impl="kernel", threads=threads))
    jax.block_until_ready(fn(x, wq))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(x, wq))
        times.append(time.perf_counter() - t)
    out[f"{M},{K},{N}"] = float(np.median(times))
print("RESULT " + json.dumps(out))
"""


def shapes_arg(text: str) -> str:
    try:
        for s in text.split(":"):
            M, K, N = (int(v) for v in s.split(","))
            if min(M, K, N) < 1:
                raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give M,K,N triples of positive integers joined by ':' "
            "(e.g. 2048,1024,4096:2048,2048,2048)") from None
    return text


def extract(rev: str, where: str) -> str:
    """The hpnlp package at `rev` under `where` (returned: the directory to put on
    PYTHONPATH)."""
    os.makedirs(where)
    archive = subprocess.run(["git", "archive", rev, "hpnlp"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"qgemm_ab: no hpnlp package at revision {rev!r}: "
                 f"{archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return where


def run_side(root: str, cache: str, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root, "HPNLP_KERNEL_CACHE": cache}
    proc = subprocess.run([sys.executable, "-c", CHILD, args.kind, str(args.calls),
                           str(args.threads), args.shapes], env=env, cwd=root,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"qgemm_ab: the child for {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision to compare with the working tree")
    ap.add_argument("--kind", choices=("int8", "binary", "int4"), default="int8")
    ap.add_argument("--shapes", type=shapes_arg, default="2048,1024,4096:2048,2048,2048")
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--calls", type=at_least(1), default=31)
    ap.add_argument("--threads", type=at_least(0), default=0, help="0: the kernels' default")
    args = ap.parse_args()
    print_cpu()
    tmp = scratch_dir("qgemm_ab_")
    sides = {args.rev: (extract(args.rev, os.path.join(tmp, "rev")), os.path.join(tmp, "c_rev")),
             "tree": (ROOT, os.path.join(tmp, "c_tree"))}
    got = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides)
        random.shuffle(order)
        for name in order:
            got[name].append(run_side(*sides[name], args))
        print(f"round {r + 1}/{args.rounds}: " + "; ".join(
            f"{name} " + " ".join(f"{v * 1e3:.2f}" for v in got[name][-1].values())
            for name in sides), flush=True)
    print(f"\n{args.kind} products, median ms over {args.rounds} rounds (min-max), "
          f"each a median of {args.calls} calls")
    print(f"| M, K, N | {args.rev} | tree | {args.rev} / tree (paired) |")
    print("|---|---|---|---|")
    for shape in got["tree"][0]:
        cells = []
        for name in sides:
            v = [g[shape] * 1e3 for g in got[name]]
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
        ratio = statistics.median(a[shape] / b[shape] for a, b in zip(got[args.rev], got["tree"]))
        print(f"| {shape} | {cells[0]} | {cells[1]} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
