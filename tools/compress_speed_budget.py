"""Where the byte LM's eval forward spends its time, for the compress bench's speed targets.

    python tools/compress_speed_budget.py [--rounds 15]

`python -m hpnlp.bench compress` times the eval forward of each compressed byte LM against
its teacher (`structured_half_params_speedup`, `lowrank_half_params_speedup`: at least
1.6x at half the parameters). This script builds the same forward (the default byte LM,
`experiments/lm.py:bytes`, one eval batch of 32 x 128 bytes, compiled as hpnlp's eval step
is) for the teacher and for the half-parameter shapes the bench trains: low rank 42 on
qkv, out and the MLP, and the structured model's 2 heads and 205 MLP neurons; and a bound
on factorizing attention too, the shape a per-head SVD of each query-key and value-output
map at rank 16 would give (4 heads of width 16: half of qkv and out, and half of the
scores' and weighted values' products) with the MLP at rank 41, also half the parameters.
Each also
with `attention.name=chunked` (the fused CPU kernel) in place of the default `dense`, so
the difference shows attention's share. Weights are random: speed does not depend on
them. It prints parameters, XLA's FLOP count of the compiled forward, and the median
time over interleaved rounds (as the bench's `measure_forward`: every model warmed, then
each round times every model in turn, 3 calls each, in a new order each round), with each
model's speed-up over the teacher of the same attention.

Read with the FLOP ratio: low rank halves the weight products but leaves attention
whole, while the structured model halves the heads and so attention too. XLA's count
leaves out what runs in a custom call, so with `chunked` it omits attention's products.

On the 2-core Zen 3 (2026-11-26, two runs in a slow stretch of that machine),
milliseconds per forward and speed-up over the teacher:

| attention | teacher | low rank 42 | structured |
|---|---|---|---|
| dense | 78.1, 75.6 | 64.6, 62.3 (1.21x, 1.21x) | 35.2, 36.0 (2.22x, 2.10x) |
| chunked | 63.8, 60.6 | 50.4, 49.9 (1.27x, 1.21x) | 30.4, 29.4 (2.10x, 2.06x) |

On the 2-core Zen 5 (2026-11-26, `--rounds 9`; its float32 products 2.3x the Zen 4's):
dense 18.99 / 15.38 (1.24x) / 9.97 ms (1.91x), chunked 14.33 / 10.76 (1.33x) / 7.56 ms
(1.90x). Rounding the rank to the vector width does not help: with `chunked`, ranks 32,
40, 42, 48 and 64 ran 1.26x, 1.21x, 1.21x, 1.21x and 1.11x (one run, 9 rounds).

On the 2-core Xeon model 167 (2026-12-02, `--rounds 9`), milliseconds and speed-up:

| attention | teacher | low rank 42 | structured | heads of width 16, MLP rank 41 |
|---|---|---|---|---|
| dense | 32.07 | 26.60 (1.21x) | 17.37 (1.85x) | 23.95 (1.34x) |
| chunked | 23.57 | 18.88 (1.25x) | 13.33 (1.77x) | 16.43 (1.43x) |

The last has the structured model's FLOPs (2.01x and 2.04x fewer than the teacher's) and
still runs 1.2-1.4x slower than it: four heads' softmax over the scores against two, and the
MLP's 512-wide gelu against 205. So even with attention's maps factorized, low rank at half
the parameters stays below the 1.6x target on this CPU.

Low rank's products are as many multiply-adds as the structured model's weight products
(86,016 against 85,248 per token per block), but the structured model also halves
attention. By the table's differences attention is roughly half of the teacher's dense
forward (an estimate, not a measurement of attention alone).
"""

import argparse

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import numpy as np

from ablib import at_least, interleaved_times, print_cpu, trainer
from hpnlp import data as data_lib
from hpnlp.train.step import step_compiler_options

SHAPES = {"teacher": {},
          "low rank 42": {"model.lowrank.rank": 42},
          "structured: 2 heads, MLP 205": {"model.num_heads": 2, "model.head_dim": 32,
                                           "model.mlp_dim": 205},
          # the bound of factorizing attention too: each head's query-key and value-output
          # maps at rank 16 (4 heads of width 16: qkv and out at half their parameters,
          # scores and weighted values at half their products), the MLP at rank 41
          "heads of width 16, MLP rank 41": {"model.head_dim": 16, "model.lowrank.rank": 41,
                                             "model.lowrank.layers": "mlp"}}


def forward(fields: dict):
    """(compiled eval forward, its arguments, parameter count, XLA's FLOPs)."""
    tr, state, _ = trainer("lm.py", "bytes", **fields)
    batch = next(iter(data_lib.make_iterator(tr.task, tr.cfg.data, split="eval",
                                             batch_size=tr.cfg.train.batch_size)))
    batch = jax.device_put(batch)
    fn = jax.jit(lambda p, b: tr.eval_model.apply({"params": p}, b, method="evaluate"))
    compiled = fn.lower(state.params, batch).compile(compiler_options=step_compiler_options())
    params = sum(x.size for x in jax.tree.leaves(state.params))
    flops = (compiled.cost_analysis() or {}).get("flops", 0.0)
    return compiled, (state.params, batch), params, flops


def medians(programs: dict, *, rounds: int, calls: int) -> dict:
    """Median seconds per call of each (compiled, args): each called once to warm, then
    each round times every one in turn, in a new order each round."""
    for fn, a in programs.values():
        jax.block_until_ready(fn(*a))
    times = interleaved_times({k: (fn, lambda a=a: a) for k, (fn, a) in programs.items()},
                              rounds=rounds, calls=calls, shuffle=True)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=15)
    args = parser.parse_args()
    print_cpu()
    built = {}
    for attention in ("dense", "chunked"):
        for name, fields in SHAPES.items():
            built[(attention, name)] = forward({**fields, "attention.name": attention})
    med = medians({k: (b[0], b[1]) for k, b in built.items()}, rounds=args.rounds, calls=3)
    print(f"{'attention':9s} {'model':30s} {'params':>8s} {'GFLOP':>6s} {'FLOP ratio':>10s} "
          f"{'ms':>7s} {'speed-up':>8s}")
    for attention, name in built:
        teacher = (attention, "teacher")
        _, _, params, flops = built[(attention, name)]
        ratio = f"{built[teacher][3] / flops:9.2f}x" if flops else f"{'-':>10s}"
        print(f"{attention:9s} {name:30s} {params:8d} {flops / 1e9:6.2f} {ratio} "
              f"{med[(attention, name)] * 1e3:7.2f} {med[teacher] / med[(attention, name)]:7.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
