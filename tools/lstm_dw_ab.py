"""The fused LSTM's weight gradients: XLA's two products against the kernel's, in one process.

    python tools/lstm_dw_ab.py [--rounds 7]

The fused LSTM's backward (`hpnlp.rnn.fused`) computes dW_h = hp^T dz and dW_x = x^T dz
over all L*B rows. They were two einsums, which XLA:CPU runs in Eigen (a product that
contracts both operands' leading axis); now they are one call of the kernel library's
packed product (`lstm_weight_grads`). This script builds each program below both ways
(the einsums patched in at trace time), times them interleaved (a round times each
variant once, in turn; the median of the rounds) and checks that both give the same
outputs: the two products alone, and the LSTM layer's forward+backward as
`python -m hpnlp.bench rnn` builds it (B=32, L=256, E=H=512), each compiled with XLA's
default options (as the rnn bench) and as hpnlp's train steps are (YNN fusions off).
"""

import argparse
import contextlib

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp

from ablib import at_least, compare, print_header, print_row
from hpnlp import rnn
from hpnlp.rnn import fused
from hpnlp.train.step import step_compiler_options


def einsum_weight_grads(hp_LBH, x_LBE, dz_LBG, **_):
    """The weight gradients as they were: two einsums over the N = L*B rows, each operand
    reshaped to [N, .] first (one contracted axis: XLA lowers "lbh,lbg->hg" differently)."""
    N = hp_LBH.shape[0] * hp_LBH.shape[1]
    dz_NG = dz_LBG.reshape(N, -1)
    mm = lambda s, a, b: jnp.einsum(s, a, b, preferred_element_type=jnp.float32)  # noqa: E731
    return (mm("nh,ng->hg", hp_LBH.reshape(N, -1), dz_NG),
            mm("ne,ng->eg", x_LBE.reshape(N, -1), dz_NG))


@contextlib.contextmanager
def weight_grads_as(fn):
    own = fused.lstm_weight_grads
    fused.lstm_weight_grads = fn
    try:
        yield
    finally:
        fused.lstm_weight_grads = own


def ab(name: str, fn, args, options, *, rounds: int, calls: int) -> None:
    variants = {"einsums": einsum_weight_grads, "kernel": fused.lstm_weight_grads}
    compiled = {}
    for k, wg in variants.items():
        with weight_grads_as(wg):  # a fresh function per variant: jit would reuse the first trace
            compiled[k] = jax.jit(lambda *a: fn(*a)).lower(*args).compile(compiler_options=options)
    med, diff = compare(compiled, lambda: args, rounds=rounds, calls=calls)
    print_row(name, med["einsums"], med["kernel"], diff, 44)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=7)
    args = parser.parse_args()
    print_header(("einsums", "kernel", "speedup"), 44,
                 f"; weight-gradient blocking {fused.TUNINGS['dw'].config()}")
    B, L, E, H = 32, 256, 512, 512
    ks = jax.random.split(jax.random.key(0), 4)
    hp, x_LBE = (jax.random.normal(ks[0], (L, B, H)), jax.random.normal(ks[1], (L, B, E)))
    dz = jax.random.normal(ks[2], (L, B, 4 * H))
    x = jax.random.normal(ks[3], (B, L, E))
    layer = rnn.RNNLayer(kind="lstm", hidden=H)
    params = layer.init(jax.random.key(0), x)
    grad = jax.grad(lambda p, x: jnp.sum(layer.apply(p, x)[0]), (0, 1))
    for label, options in (("XLA defaults", None), ("train-step options", step_compiler_options())):
        ab(f"weight gradients ({label})", lambda h, x, d: fused.lstm_weight_grads(h, x, d),
           (hp, x_LBE, dz), options, rounds=args.rounds, calls=3)
        ab(f"LSTM forward+backward ({label})", grad, (params, x), options, rounds=args.rounds,
           calls=1)


if __name__ == "__main__":
    main()
