"""QAT of a sampled output layer: its rows fake-quantized after the gather (`qlinear.quant_rows`,
session 113) against the whole table fake-quantized and then gathered (before), timed
interleaved in one process.

    python tools/qat_rows_ab.py [--vocab 8192,65536,262144] [--width 256] [--tokens 2048]
        [--samples 1024] [--weights int8] [--rounds 9]

Each row is one jitted loss and gradient of `sampled` (`hpnlp.softmax`, `num_samples`
shared samples) on `--tokens` hidden states, with `quant.weights` on the output layer; the
"before" twin is the same layer with `_rows_fn` gathering from the whole fake-quantized
[V, E] table, as it did before. Both compute the same loss and gradients (the tool prints
the largest difference; `tests/test_compress.py` holds them equal exactly).
"""

import argparse

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import flax.linen as nn
import jax
import jax.numpy as jnp

from ablib import at_least, compare, print_header, print_row
import hpnlp.softmax as S
from hpnlp.config import QuantConfig

Sampled = S.get("sampled")


class TableFirst(Sampled):
    """The layer as it was: every row read from the whole table, fake-quantized."""

    def _rows_fn(self, width: int, num_rows: int):
        kernel_VE, bias_V = self._decoded(*self._stored(width), width)
        return lambda ids: (jnp.take(kernel_VE, ids, axis=0), jnp.take(bias_V, ids, axis=0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="8192,65536,262144")
    p.add_argument("--width", type=at_least(1), default=256)
    p.add_argument("--tokens", type=at_least(1), default=2048)
    p.add_argument("--samples", type=at_least(1), default=1024)
    p.add_argument("--weights", default="int8")
    p.add_argument("--rounds", type=at_least(1), default=9)
    a = p.parse_args()
    q = QuantConfig(weights=a.weights, layers="output")
    E, N = a.width, a.tokens
    width = 14
    print_header(("before", "rows first", "speed"), width,
                 f"; sampled, {N} tokens, E={E}, {a.samples} samples, {a.weights} weights",
                 label="V")
    h = jax.random.normal(jax.random.key(0), (1, N, E))
    for V in (int(v) for v in a.vocab.split(",")):
        t = jax.random.randint(jax.random.key(1), (1, N), 0, V)
        new, old = (cls(vocab_size=V, num_samples=a.samples, quant=q)
                    for cls in (Sampled, TableFirst))
        params = nn.unbox(jax.jit(lambda: new.init(jax.random.key(2), h, t, None,
                                                   method="loss"))())

        def step(layer):
            def loss(p, h, t, key):
                return jnp.mean(layer.apply(p, h, t, None, method="loss",
                                            deterministic=False, rngs={"dropout": key}))
            return jax.jit(jax.value_and_grad(loss))

        def fresh():
            return params, h, t, jax.random.key(3)
        medians, diff = compare({"before": step(old), "rows first": step(new)}, fresh,
                                rounds=a.rounds, calls=3)
        print_row(str(V), medians["before"], medians["rows first"], diff, width)


if __name__ == "__main__":
    main()
