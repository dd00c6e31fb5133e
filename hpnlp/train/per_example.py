"""Per-example quantities, written for one example and batched with `jax.vmap`.

A model's loss is a sum over the batch. Per-example losses (each normalized by that
example's own number of real tokens) and per-example gradient norms (what DP-SGD clips;
a common probe for noisy or mislabeled data) come from a function of ONE example, lifted
to the batch by `jax.vmap`: one compiled program computes all B of them at once, where a
Python loop would make B calls (and, with ragged lengths, compile once per length).
Examples of different lengths are padded to one length; their segment ids mask the
padding, so a padded example gives exactly what the unpadded one gives
(tests/test_per_example.py). `python -m hpnlp.bench tricks` times the loop against vmap.

A float16 model's gradient of an example's *mean* loss carries 1/n of each token's own
cotangent for n real tokens, and past a few thousand tokens float16 rounds the small ones
away (measured against the same params in float32, session 108: each parameter's gradient
within 2e-3 of its norm up to n=1024, also with a 32768-word table; 6e-3, 2e-2, 6e-2 and
0.19 off at the cotangents of 4K, 16K, 64K and 256K tokens, a 64-token mean times 2^-6 to
2^-12, where the global norm was off only 1.5e-3: its large entries round, small ones flush).
So the mean is differentiated times a power of 2 (1 up to EXACT_TOKENS tokens, past that
their count / EXACT_TOKENS rounded up) and the gradient divided by it in float32, exactly: a
token's cotangent never falls below 1/EXACT_TOKENS of its own. Not the train step's dynamic
scale (hpnlp.train.step: `loss_scale`, from train.loss_scale_init, times 2^-ceil(log2 of the
batch's terms), halved at a step it skips on an overflow, doubled after clean steps): here
there is no step to skip, so the scale must never overflow, and a fixed 2^15 did (a one-token
example of a width-128 LM overflowed float16 at it; at 2^12 it did not;
tests/test_per_example.py).

Random draws: each example gets `rngs` folded with its index, so under dropout each draws its
own mask (and its own sampled negatives), as each row of the batch forward does; one key for
all had given every example the same mask (a review, r10). The `features` stream (a
random-feature projection or LSH rotation, one draw the whole batch shares) is left whole.

The quantities are of the task loss alone (`sums["loss"]`): the layers' auxiliary losses the
train step adds (MoE's balance and z-losses, the Compressive Transformer's reconstruction
loss, `full`'s z-loss, sown into the AUX collection, which `apply` here does not make
mutable) are left out.
They are batch statistics (MoE's balance loss is of the experts' load over all the batch's
tokens) with no per-example share. For such a model the token-weighted mean of per-example
gradients is the task loss's batch gradient, not that of the objective the step trains.

    >>> losses_B = per_example_losses(model, params, batch)          # doctest: +SKIP
    >>> norms_B = per_example_grad_norms(model, params, batch)       # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

SHARED_STREAMS = ("features",)  # drawn once for the batch, so not folded per example


def _as_batch_of_one(example):
    return jax.tree.map(lambda x: jnp.asarray(x)[None], example)


def _example_rngs(rngs, i):
    """`rngs` of the i-th example: each stream but SHARED_STREAMS folded with i."""
    return rngs and {s: k if s in SHARED_STREAMS else jax.random.fold_in(k, i)
                     for s, k in rngs.items()}


def _over_examples(fn, batch, rngs):
    """[B] of fn(example, its rngs), by one vmap."""
    B = np.shape(jax.tree.leaves(batch)[0])[0]
    return jax.vmap(lambda ex, i: fn(ex, _example_rngs(rngs, i)))(batch, jnp.arange(B))


def _check_per_example(model) -> None:
    """A ValueError for a model whose loss is not a sum over its examples: the bi-encoder's
    reads the batch's other pairs as negatives, so one example alone scored 0 (in-batch) or
    nothing (triplet), every gradient 0, unsaid (a review, session 116)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.model.kind == "bi_encoder":
        raise ValueError("per-example losses of a model.kind='bi_encoder' model: its loss is "
                         "defined over a whole batch (the other pairs are each pair's "
                         "negatives), so one example alone has none; use a classifier, a "
                         "dual encoder or an LM")


def example_loss(model, params, example, rngs=None):
    """Mean loss over one example's real tokens (or its weight, for classifiers)."""
    _check_per_example(model)
    sums = model.apply({"params": params}, _as_batch_of_one(example), rngs=rngs)
    return sums["loss"] / jnp.maximum(sums["weight"], 1.0)


def per_example_losses(model, params, batch, rngs=None):
    """[B] mean loss of each example of `batch` (a dict of [B, ...] arrays)."""
    return _over_examples(lambda ex, r: example_loss(model, params, ex, r), batch, rngs)


EXACT_TOKENS = 1024  # an example's tokens whose mean's gradient needs no scale (see above)


def _scaled_grad(model):
    """(params, example, rngs) -> (the gradient of example_loss times `scale`, scale): the
    mean differentiated times a power of 2 (see above), for the caller to divide in float32."""
    _check_per_example(model)

    def scaled(params, example, rngs):
        sums = model.apply({"params": params}, _as_batch_of_one(example), rngs=rngs)
        weight = jnp.maximum(sums["weight"], 1.0)
        log2_excess = jnp.ceil(jnp.log2(weight / EXACT_TOKENS))  # log2 may round up: harmless
        # ldexp: an exact power of 2 (exp2 is exp(x ln 2), a re-read found: not exactly one)
        scale = jax.lax.stop_gradient(jnp.ldexp(jnp.ones((), jnp.float32), jnp.maximum(
            log2_excess, 0.0).astype(jnp.int32)))
        return sums["loss"] / weight * scale, scale
    return jax.grad(scaled, has_aux=True)


def per_example_grads(model, params, batch, rngs=None):
    """Gradient of each example's mean loss: every parameter gets a leading [B] axis."""
    def one(example, example_rngs):
        grads, scale = _scaled_grad(model)(params, example, example_rngs)
        return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)
    return _over_examples(one, batch, rngs)


def per_example_grad_norms(model, params, batch, rngs=None):
    """[B] global L2 norm of each example's gradient, without keeping B gradients at once
    beyond what one vmapped step needs: the norm the train step clips and logs
    (`train.state.clipped_part`: `clustered` attention's injected k-means step left out)."""
    from hpnlp.train.state import clipped_part

    def one(example, example_rngs):
        grads, scale = _scaled_grad(model)(params, example, example_rngs)
        return optax.tree.norm(clipped_part(grads)) / scale  # float32: a power of 2 divides exactly
    return _over_examples(one, batch, rngs)
