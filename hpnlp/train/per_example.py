"""Per-example quantities, written for one example and batched with `jax.vmap`.

A model's loss is a sum over the batch. Per-example losses (each normalized by that
example's own number of real tokens) and per-example gradient norms (what DP-SGD clips;
a common probe for noisy or mislabeled data) come from a function of ONE example, lifted
to the batch by `jax.vmap`: one compiled program computes all B of them at once, where a
Python loop would make B calls (and, with ragged lengths, compile once per length).
Examples of different lengths are padded to one length; their segment ids mask the
padding, so a padded example gives exactly what the unpadded one gives
(tests/test_per_example.py). `python -m hpnlp.bench tricks` times the loop against vmap.

    >>> losses_B = per_example_losses(model, params, batch)          # doctest: +SKIP
    >>> norms_B = per_example_grad_norms(model, params, batch)       # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _as_batch_of_one(example):
    return jax.tree.map(lambda x: jnp.asarray(x)[None], example)


def example_loss(model, params, example, rngs=None):
    """Mean loss over one example's real tokens (or its weight, for classifiers)."""
    sums = model.apply({"params": params}, _as_batch_of_one(example), rngs=rngs)
    return sums["loss"] / jnp.maximum(sums["weight"], 1.0)


def per_example_losses(model, params, batch, rngs=None):
    """[B] mean loss of each example of `batch` (a dict of [B, ...] arrays)."""
    return jax.vmap(lambda ex: example_loss(model, params, ex, rngs))(batch)


def per_example_grads(model, params, batch, rngs=None):
    """Gradient of each example's mean loss: every parameter gets a leading [B] axis."""
    grad = jax.grad(lambda p, ex: example_loss(model, p, ex, rngs))
    return jax.vmap(grad, in_axes=(None, 0))(params, batch)


def per_example_grad_norms(model, params, batch, rngs=None):
    """[B] global L2 norm of each example's gradient, without keeping B gradients at once
    beyond what one vmapped step needs."""
    grad = jax.grad(lambda p, ex: example_loss(model, p, ex, rngs))
    return jax.vmap(lambda ex: optax.tree.norm(grad(params, ex)))(batch)
