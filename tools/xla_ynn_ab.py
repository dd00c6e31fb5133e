"""XLA:CPU's YNN fusions on and off, for hpnlp's train and eval steps, in one process.

    python tools/xla_ynn_ab.py [--rounds 7]

hpnlp compiles its train and eval steps with `xla_cpu_experimental_ynn_fusion_type=""`
(`hpnlp.train.step.step_compiler_options`). This compiles each step below twice, with
XLA's default and with hpnlp's options, then times them interleaved (a round times every
variant once, in turn; the median of the rounds), and checks that both give the same
outputs. Steps: the byte LM (`experiments/lm.py:bytes`) and the text classifier
(`experiments/lra.py:text`, at 256 bytes as the compress bench trains it), and a width-512,
depth-4 LM (the quantization bench's size; 8 rows of 256 bytes), plus that LM's
`log_probs` prefill of 4 x 512 bytes as the quantization bench runs it, which hpnlp leaves at
XLA's default. docs/xla_defects.md quotes this script's output.
"""

import argparse
import os

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from ablib import at_least, compare, print_header, print_row, trainer
from hpnlp import models
from hpnlp.train.loop import dummy_batch
from hpnlp.train.step import (CPU_NO_YNN_FUSION_OPTIONS, CPU_REMAT_COMPILER_OPTIONS,
                              make_eval_step, make_train_step)

VARIANTS = {"XLA default": CPU_REMAT_COMPILER_OPTIONS,
            "YNN fusions off": {**CPU_REMAT_COMPILER_OPTIONS, **CPU_NO_YNN_FUSION_OPTIONS}}


def ab(name: str, fn, args, *, rounds: int, calls: int, donate: bool = False) -> None:
    """Time `fn(*args)` compiled both ways; `donate`: args[0] is donated (a train state)."""
    compiled = {k: fn.lower(*args).compile(compiler_options=o) for k, o in VARIANTS.items()}
    fresh = (lambda: (jax.tree.map(jnp.copy, args[0]),) + tuple(args[1:])) if donate else (lambda: args)
    med, diff = compare(compiled, fresh, rounds=rounds, calls=calls)
    print_row(name, med["XLA default"], med["YNN fusions off"], diff, 38)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=7)
    args = parser.parse_args()
    print_header(("XLA default", "YNN off", "speedup"), 38,
                 f"; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    wide = {"model.width": 512, "model.depth": 4, "model.num_heads": 8, "model.mlp_dim": 2048,
            "train.batch_size": 8, "data.seq_len": 256, "model.max_len": 512}
    for label, (exp, arg, model) in {"byte LM": ("lm.py", "bytes", {}),
                                     "text classifier": ("lra.py", "text", {}),
                                     "width-512 LM": ("lm.py", "bytes", wide)}.items():
        tr, state, batch = trainer(exp, arg, **model)
        calls = 1 if model else 2
        # the steps as Trainer builds them, jitted here without its compiler options
        train_step = jax.jit(make_train_step(tr.model, tr.tx, tr.cfg.train, tr.carries), donate_argnums=0)
        eval_step = jax.jit(make_eval_step(tr.eval_model, tr.cfg.train, carries=tr.carries))
        ab(f"{label}: train step", train_step, (state, batch), rounds=args.rounds, calls=calls,
           donate=True)
        ab(f"{label}: eval step", eval_step, (state, batch), rounds=args.rounds, calls=calls)
        ab(f"{label}: eval forward", jax.jit(lambda p, b, m=tr.eval_model: m.apply(
            {"params": p}, b, method="evaluate")), (state.params, batch), rounds=args.rounds, calls=calls)
        if model:  # the quantization bench's prefill: left at XLA's default by hpnlp
            b = dummy_batch("lm", 4, 512)  # the quantization bench's prefill shape
            b["inputs"] = np.asarray(jax.random.randint(jax.random.key(1), (4, 512), 0, 256), np.int32)
            lm = models.build(tr.cfg, deterministic=True)
            ab(f"{label}: log_probs prefill (4x512)", jax.jit(lambda p, x: lm.apply(
                {"params": p}, x, method="log_probs")), (state.params, b), rounds=args.rounds, calls=1)


if __name__ == "__main__":
    main()
