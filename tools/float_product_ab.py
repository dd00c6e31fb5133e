"""hpnlp's own VJPs for float products and LayerNorm against autodiff's, in one process.

    python tools/float_product_ab.py [--rounds 7]

Every float product in hpnlp's Transformers (qkv, attention out, the MLP's two Dense
layers, low-rank factors) goes through `hpnlp.compress.qlinear.float_product`, whose
custom VJP computes dW = x^T g in the weight's own layout and db = 1^T g as products, and
every Transformer LayerNorm is `hpnlp.models.transformer.LayerNorm`, whose VJP sums its
scale and bias gradients the same way. This script builds each train step below twice: as
hpnlp runs it, and as it ran before both (products differentiated by JAX's autodiff,
flax's own `nn.LayerNorm`; XLA:CPU then transposes each layer's output gradient and sums
the bias, scale and shift gradients by reduce-window trees). It times
them interleaved (a round times each variant once, in turn; the median of the rounds), and
checks that both give the same outputs. Steps: the default byte LM
(`experiments/lm.py:bytes`), the text classifier (`experiments/lra.py:text` at 256 bytes, as
the compress bench trains it), and the byte LM at low rank 42 (the compress bench's
half-parameter factorization). The README quotes this script's output.
"""

import argparse

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import flax.linen as nn
import jax
import jax.numpy as jnp

from ablib import at_least, compare, print_header, print_row, trainer
from hpnlp.compress import qlinear
from hpnlp.models import transformer
from hpnlp.train.step import make_train_step, step_compiler_options


def autodiff_product(x, w, bias, n_contract, preferred_element_type=None):
    """float_product's values, differentiated by autodiff (the test's reference too)."""
    y = jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n_contract, x.ndim)),
                                    tuple(range(n_contract))), ((), ())),
                            preferred_element_type=preferred_element_type)
    return y if bias is None else y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def compiled_step(tr, state, batch, product, layer_norm):
    """The train step as Trainer builds it, traced with `product` as qeinsum's float product
    and `layer_norm` as the Transformer's LayerNorm class."""
    own = qlinear.float_product, transformer.LayerNorm
    qlinear.float_product, transformer.LayerNorm = product, layer_norm
    try:
        fn = jax.jit(make_train_step(tr.model, tr.tx, tr.cfg.train, tr.carries), donate_argnums=0)
        return fn.lower(state, batch).compile(compiler_options=step_compiler_options())
    finally:
        qlinear.float_product, transformer.LayerNorm = own


def ab(name: str, tr, state, batch, *, rounds: int, calls: int) -> None:
    variants = {"own VJP": (qlinear.float_product, transformer.LayerNorm),
                "autodiff": (autodiff_product, nn.LayerNorm)}
    compiled = {k: compiled_step(tr, state, batch, *v) for k, v in variants.items()}

    med, diff = compare(compiled, lambda: (jax.tree.map(jnp.copy, state), batch),
                        rounds=rounds, calls=calls)
    print_row(name, med["autodiff"], med["own VJP"], diff, 30, ", after one step")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=7)
    args = parser.parse_args()
    print_header(("autodiff", "own VJP", "speedup"), 30, label="train step")
    for label, (exp, arg, model) in {
            "byte LM": ("lm.py", "bytes", {}),
            "text classifier": ("lra.py", "text", {}),
            "byte LM, low rank 42": ("lm.py", "bytes", {"model.lowrank.rank": 42})}.items():
        tr, state, batch = trainer(exp, arg, **model)
        ab(label, tr, state, batch, rounds=args.rounds, calls=3)


if __name__ == "__main__":
    main()
