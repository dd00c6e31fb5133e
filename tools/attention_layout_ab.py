"""Dense attention's value product in two layouts, in one process.

    python tools/attention_layout_ab.py [--rounds 7]

`hpnlp.attention.base.attend` weights the values by the attention distributions as the
batched product with its batch axes leading everywhere: values transposed to [B, H, S, D],
the product into [B, H, L, D], that transposed to [B, L, H, D]. Before, it was the one
einsum "bhls,bshd->blhd", which XLA:CPU ran 1.8x slower at the byte LM's shape. This
script builds each program below both ways (the old einsum patched in at trace time),
times them interleaved (a round times each variant once, in turn; the median of the
rounds), and checks that both give the same outputs: the value product alone and dense
attention at the default byte LM's shape (B=32, L=128, H=4, D=32, causal, with segments),
forward and forward+backward, compiled as hpnlp's steps are; then the byte LM's train step
and its eval forward.
"""

import argparse
import contextlib

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp

from ablib import at_least, compare, print_header, print_row, trainer
from hpnlp.attention import base, dense
from hpnlp.train.step import make_train_step, step_compiler_options


def einsum_attend(p_BHLS, v_BSHD, dtype):
    """`attend` as it was: one einsum into [B, L, H, D]."""
    return jnp.einsum("bhls,bshd->blhd", p_BHLS, v_BSHD.astype(jnp.float32)).astype(dtype)


@contextlib.contextmanager
def attend_as(fn):
    """`fn` as dense attention's `attend` (base and dense; the Synthesizer and Transformer-XL
    keep theirs: the byte LM uses neither)."""
    own = base.attend, dense.attend
    base.attend = dense.attend = fn
    try:
        yield
    finally:
        base.attend, dense.attend = own


def ab(name: str, build, fresh, *, rounds: int, calls: int) -> None:
    """`build()` -> a compiled program (traced under each `attend`); `fresh()` -> its args."""
    variants = {"einsum to BLHD": einsum_attend, "batch axes leading": base.attend}
    compiled = {}
    for k, fn in variants.items():
        with attend_as(fn):
            compiled[k] = build()
    med, diff = compare(compiled, fresh, rounds=rounds, calls=calls)
    print_row(name, med["einsum to BLHD"], med["batch axes leading"], diff, 34, digits=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least(1), default=7)
    args = parser.parse_args()
    print_header(("einsum", "batch lead", "speedup"), 34)
    opts = step_compiler_options()
    B, L, H, D = 32, 128, 4, 32
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(ks[i], (B, L, H, D)) for i in range(3))
    p = jax.nn.softmax(jax.random.normal(ks[3], (B, H, L, L)), axis=-1)
    seg = jnp.ones((B, L), jnp.int32).at[:, 100:].set(2)

    def attention(q, k, v, seg):
        return base.masked_softmax_attention(q, k, v, base.segment_mask(seg, seg, causal=True))

    def compiled(fn, *a):  # a fresh function per variant: jit would reuse the first trace
        return lambda: jax.jit(lambda *x: fn(*x)).lower(*a).compile(compiler_options=opts)

    ab("value product", compiled(lambda p, v: base.attend(p, v, jnp.float32), p, v),
       lambda: (p, v), rounds=args.rounds, calls=5)
    ab("dense attention forward", compiled(attention, q, k, v, seg), lambda: (q, k, v, seg),
       rounds=args.rounds, calls=5)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(attention(q, k, v, s) ** 2), (0, 1, 2))
    ab("dense attention forward+backward", compiled(grad, q, k, v, seg), lambda: (q, k, v, seg),
       rounds=args.rounds, calls=3)

    tr, state, batch = trainer("lm.py", "bytes")
    ab("byte LM train step",
       lambda: jax.jit(make_train_step(tr.model, tr.tx, tr.cfg.train, tr.carries),
                       donate_argnums=0).lower(state, batch).compile(compiler_options=opts),
       lambda: (jax.tree.map(jnp.copy, state), batch), rounds=args.rounds, calls=3)

    def evaluate(params, batch):
        return tr.eval_model.apply({"params": params}, batch, method="evaluate")
    ab("byte LM eval forward", compiled(evaluate, state.params, batch),
       lambda: (state.params, batch), rounds=args.rounds, calls=3)


if __name__ == "__main__":
    main()
