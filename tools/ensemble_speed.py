"""A seed ensemble's train step with its members under `vmap` and one by one, in one process.

    python tools/ensemble_speed.py [--rounds 7] [--calls 3] [--members 2 3]

`hpnlp.train.ensemble.EnsembleTrainer(member_loop=...)` runs its M members batched by
`jax.vmap` or one after another in a loop inside the same jitted step. For the RNN LM
(`experiments/rnn_lm.py:local`) and the Transformer LM (`experiments/lm.py:bytes,local`), this
builds both ensembles of each size from the same initial state, checks that one step gives
the same parameters, then times them interleaved (a round times each loop once, `calls`
steps each, then the plain run of one member, in turn) and prints the median steps/s of
each, with the plain run's for scale. The module docstring of hpnlp/train/ensemble.py
quotes this script's output.
"""

import argparse

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from ablib import (at_least, interleaved_times, largest_relative_difference, print_cpu, scratch_dir,
                   trainer)
from hpnlp.train.ensemble import MEMBER_LOOPS, EnsembleTrainer

EXPERIMENTS = {"RNN LM": ("rnn_lm.py", "local"), "Transformer LM": ("lm.py", "bytes,local")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=7)
    parser.add_argument("--calls", type=at_least(1), default=3, help="steps per timing")
    parser.add_argument("--members", type=at_least(1), nargs="+", default=[2, 3])
    args = parser.parse_args()
    print_cpu(f"; backend {jax.default_backend()}; median of {args.rounds} rounds of "
              f"{args.calls} steps")
    print(f"{'':26s} {'vmap':>9s} {'map':>9s} {'map/vmap':>9s} {'plain':>9s}   (steps/s)")
    for label, (exp, arg) in EXPERIMENTS.items():
        plain, plain_state, batch = trainer(exp, arg)  # ablib's: the plain run, for scale
        cfg = plain.cfg
        for members in args.members:
            ens = {loop: EnsembleTrainer(cfg, scratch_dir(), members, member_loop=loop)
                   for loop in MEMBER_LOOPS}
            state, _ = ens["vmap"].initial_state()  # the same stacked layout for both
            copy = lambda s=state: (jax.tree.map(jnp.copy, s), batch)  # noqa: E731
            outs = [jax.block_until_ready(t.train_step(*copy())[0].params) for t in ens.values()]
            diff = largest_relative_difference(*outs)
            programs = {loop: (t.train_step, copy) for loop, t in ens.items()}
            programs["plain"] = (plain.train_step,
                                 lambda: (jax.tree.map(jnp.copy, plain_state), batch))
            for fn, fresh in programs.values():  # warm up (compiles) outside the timing
                jax.block_until_ready(fn(*fresh()))
            times = interleaved_times(programs, rounds=args.rounds, calls=args.calls)
            rate = {k: 1.0 / float(np.median(v)) for k, v in times.items()}
            print(f"{label + f', {members} members':26s} {rate['vmap']:9.2f} {rate['map']:9.2f} "
                  f"{rate['map'] / rate['vmap']:8.2f}x {rate['plain']:9.2f}   params after one "
                  f"step: largest difference {diff:.1e} (relative)", flush=True)
            for t in ens.values():
                t.checkpointer.close()
        plain.checkpointer.close()


if __name__ == "__main__":
    main()
