"""Per-example losses and gradient norms by vmap equal a loop over unpadded examples."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpnlp import models
from hpnlp.config import default_configdict, from_configdict, validate
from hpnlp.train.per_example import per_example_grad_norms, per_example_grads, per_example_losses


def _model_and_batch(B=3, L=12):
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=L)
    cd.model.update(kind="lm", width=16, depth=1, num_heads=2, mlp_dim=32, max_len=L, dropout=0.0)
    cfg = validate(from_configdict(cd), num_devices=1)
    model = models.build(cfg, deterministic=True)
    rng = np.random.default_rng(0)
    lengths = np.array([L, 3, 7][:B])
    tokens = rng.integers(0, 256, size=(B, L + 1)).astype(np.int32)
    seg = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
    batch = {"inputs": tokens[:, :-1] * seg, "targets": tokens[:, 1:] * seg, "segment_ids": seg,
             "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()}
    params = model.init(jax.random.key(1), jax.tree.map(lambda x: x[:1], batch))["params"]
    return model, params, batch, lengths


def _unpadded(batch, b, n):
    return {k: v[b:b + 1, :n] for k, v in batch.items()}


def _mean_loss(model, params, ex):
    sums = model.apply({"params": params}, ex)
    return sums["loss"] / sums["weight"]


def _loop_reference(model, params, batch, lengths):
    """Loss and gradient of each unpadded example, one jitted call per example."""
    fn = jax.jit(jax.value_and_grad(lambda p, ex: _mean_loss(model, p, ex)))
    return [fn(params, _unpadded(batch, b, n)) for b, n in enumerate(lengths)]


@pytest.mark.slow
def test_vmapped_losses_and_grad_norms_equal_a_loop_over_unpadded_examples():
    model, params, batch, lengths = _model_and_batch()
    losses = jax.jit(lambda p, b: per_example_losses(model, p, b))(params, batch)
    norms = jax.jit(lambda p, b: per_example_grad_norms(model, p, b))(params, batch)
    grads = jax.jit(lambda p, b: per_example_grads(model, p, b))(params, batch)
    for b, (loss, g) in enumerate(_loop_reference(model, params, batch, lengths)):
        np.testing.assert_allclose(losses[b], loss, rtol=1e-5)
        np.testing.assert_allclose(norms[b], optax.tree.norm(g), rtol=1e-5)
        jax.tree.map(lambda a, r: np.testing.assert_allclose(a[b], r, rtol=1e-4, atol=1e-6), grads, g)
    # Different lengths really give different values (the mask is not ignoring them).
    assert len({round(float(x), 4) for x in losses}) == len(lengths)


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_mean_of_per_example_grads_weighted_by_tokens_is_the_batch_gradient():
    model, params, batch, lengths = _model_and_batch()
    grads = jax.jit(lambda p, b: per_example_grads(model, p, b))(params, batch)
    w = jnp.asarray(lengths, jnp.float32) / lengths.sum()
    combined = jax.tree.map(lambda g: jnp.tensordot(w, g, axes=1), grads)
    full = jax.jit(jax.grad(lambda p: _mean_loss(model, p, batch)))(params)
    jax.tree.map(lambda a, r: np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6), combined, full)
