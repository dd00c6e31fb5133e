"""`python -m hpnlp.bench ENTRY --out DIR [--quick] [--profile DIR]`.

Each entry writes DIR/results.json, DIR/results.md and PNG plots. `--quick` runs a small
version in a few minutes; `--profile DIR` also writes a jax.profiler trace of the run
(open with TensorBoard's profile plugin or https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# On a GPU, JAX otherwise takes 75% of its memory at start in every process: the bench's own,
# each isolated worker's and PyTorch's peers would compete for the rest. Allocate on demand
# (read when JAX starts its GPU backend; nothing changes on a CPU).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from hpnlp.bench import (attention, compress, data, distill_recipes, lra, memory, moe, quant, retrieval,
                         rnn, softmax, speculative, train, tricks)

ENTRIES = {"attention": attention, "softmax": softmax, "train": train, "lra": lra, "rnn": rnn,
           "tricks": tricks, "memory": memory, "quant": quant, "compress": compress, "moe": moe,
           "retrieval": retrieval, "data": data, "distill_recipes": distill_recipes,
           "speculative": speculative}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m hpnlp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="entry", required=True)
    for name, mod in ENTRIES.items():
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        sp.add_argument("--out", required=True, help="output folder")
        sp.add_argument("--quick", action="store_true", help="small sizes; a few minutes")
        sp.add_argument("--profile", default=None, help="write a jax.profiler trace here")
        mod.add_arguments(sp)
    args = p.parse_args(argv)
    from hpnlp.paths import check_writable_dir
    for flag in ("out", "profile", "workdir"):  # before any training or compiling
        if getattr(args, flag, None):
            try:
                check_writable_dir(getattr(args, flag), f"--{flag}")
            except ValueError as e:
                p.error(str(e))
    ctx = contextlib.nullcontext()
    if args.profile:
        import jax
        ctx = jax.profiler.trace(args.profile)
    with ctx:
        ENTRIES[args.entry].main(args)
    print(f"wrote {args.out}/results.json, results.md and plots", file=sys.stderr)


if __name__ == "__main__":
    main()
