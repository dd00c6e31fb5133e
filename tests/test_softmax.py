"""Output layers: normalization, loss = -log p(target), masking, tying."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.models.transformer as T
import hpnlp.softmax as S
from hpnlp.config import ModelConfig

V, E = 37, 16


def _setup(**kw):
    layer = S.get("full")(vocab_size=V, **kw)
    h = jax.random.normal(jax.random.key(0), (3, 5, E))
    t = jax.random.randint(jax.random.key(1), (3, 5), 0, V)
    params = layer.init(jax.random.key(2), h)
    return layer, params, h, t


def test_registry():
    assert "full" in S.names()
    with pytest.raises(ValueError, match="choose one of"):
        S.get("nope")


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_full_log_prob_normalized_and_loss_matches(z_loss):
    layer, params, h, t = _setup(z_loss=z_loss)
    logp = layer.apply(params, h, method="log_prob")
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)
    loss = layer.apply(params, h, t, None, method="loss")
    nll = -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]
    if z_loss == 0:
        np.testing.assert_allclose(loss, nll, atol=1e-5)
    else:
        assert bool(jnp.all(loss >= nll))


def test_mask_zeroes_padding_and_top_k():
    layer, params, h, t = _setup()
    mask = jnp.asarray([[1, 1, 0, 0, 0]] * 3, bool)
    loss = layer.apply(params, h, t, mask, method="loss")
    assert float(jnp.abs(loss[:, 2:]).max()) == 0.0
    vals, idx = layer.apply(params, h, 4, method="top_k")
    assert idx.shape == (3, 5, 4)
    np.testing.assert_array_equal(idx[..., 0], jnp.argmax(layer.apply(params, h, method="log_prob"), -1))


def test_tied_embedding_shares_weights():
    m = ModelConfig(vocab_size=V, width=E)

    class Tied(T.nn.Module):
        def setup(self):
            self.embed = T.make_embed(m)
            self.out = S.get("full")(vocab_size=V, embed=self.embed)

        def __call__(self, tok, h):
            return self.embed(tok), self.out.log_prob(h)

    variables = Tied().init(jax.random.key(0), jnp.zeros((2,), jnp.int32), jnp.zeros((2, E)))
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    kernels = [p for p, x in flat if x.ndim == 2 or (hasattr(x, "value") and x.value.ndim == 2)]
    assert len(kernels) == 1, kernels  # one [V, E] matrix serves both
