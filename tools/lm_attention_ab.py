"""An experiment's train step and eval forward with `dense` attention (XLA) against
`chunked` (on a CPU, the fused flash kernel), both exact, timed interleaved.

    python tools/lm_attention_ab.py [--rounds 15] [--experiment lm.py:bytes | lra.py:text]

The default byte LM (`experiments/lm.py:bytes`, the README's first command) and the text
classifier (`lra.py:text`, at 256 bytes as the compress bench trains it) train with
`attention.name = "dense"`, the oracle every variant is tested against. This measures what
`--config.attention.name=chunked` changes for them on this CPU: each program compiled
with the compiler options of hpnlp's steps, each round times every program (3 calls
each, on the same state and batch) in a new random order, and the table gives the
medians over rounds and the median of the paired ratio. The largest relative difference between the two variants' outputs (the
updated parameters; the eval sums) shows they compute the same thing.
"""

import argparse

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import numpy as np

from ablib import at_least, interleaved_times, largest_relative_difference, print_cpu, trainer
from hpnlp.bench import harness
from hpnlp.train.step import make_train_step, step_compiler_options

VARIANTS = ("dense", "chunked")


def programs(experiment: str, arg: str) -> dict:
    """{(what, attention): (compiled program, its arguments)}."""
    opts, out = step_compiler_options(), {}
    for attention in VARIANTS:
        tr, state, batch = trainer(experiment, arg, **{"attention.name": attention})
        step = jax.jit(make_train_step(tr.model, tr.tx, tr.cfg.train, tr.carries))
        out["train step", attention] = (step.lower(state, batch).compile(compiler_options=opts),
                                        (state, batch))
        evaluate = jax.jit(lambda p, b, tr=tr: tr.eval_model.apply({"params": p}, b,
                                                                   method="evaluate"))
        out["eval forward", attention] = (
            evaluate.lower(state.params, batch).compile(compiler_options=opts),
            (state.params, batch))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=at_least(1), default=15)
    ap.add_argument("--experiment", default="lm.py:bytes", help="FILE:ARG in experiments/")
    args = ap.parse_args()
    experiment, _, arg = args.experiment.partition(":")
    try:  # before any compile: a file or argument that is not there, in one line
        harness.experiment_module(experiment).get_config(arg)
    except (ValueError, OSError) as e:
        ap.error(f"--experiment {args.experiment}: {e}")
    built = programs(experiment, arg)
    outs = {k: jax.block_until_ready(fn(*a)) for k, (fn, a) in built.items()}  # warm-up
    times = interleaved_times({k: (fn, lambda a=a: a) for k, (fn, a) in built.items()},
                              rounds=args.rounds, calls=3, shuffle=True)
    print_cpu(f"; {args.experiment}; {args.rounds} rounds")
    print("| program | dense ms | chunked ms | speed-up (medians) | paired ratio, median (min-max) "
          "| largest relative difference |")
    print("|---|---|---|---|---|---|")
    for what in ("train step", "eval forward"):
        d, c = times[what, "dense"], times[what, "chunked"]
        ratios = [a / b for a, b in zip(d, c)]
        diff = largest_relative_difference(outs[what, "dense"], outs[what, "chunked"])
        print(f"| {what} | {np.median(d) * 1e3:.1f} ({min(d) * 1e3:.1f}-{max(d) * 1e3:.1f}) | "
              f"{np.median(c) * 1e3:.1f} ({min(c) * 1e3:.1f}-{max(c) * 1e3:.1f}) | "
              f"{np.median(d) / np.median(c):.3f}x | {np.median(ratios):.3f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {diff:.1e} |")


if __name__ == "__main__":
    main()
