"""Output layers: normalization, loss = -log p(target), masking, tying."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import softmax_testlib as lib

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


def test_full_contract_via_testlib():
    layer = S.get("full")(vocab_size=lib.V)
    lib.check_normalized(layer)
    lib.check_exact_loss(layer)
    lib.check_padding(layer)
    lib.check_rejects_out_of_vocab(layer)


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_full_chunked_loss_matches_unchunked(z_loss):
    """Token-chunked loss (remat per chunk) equals the plain loss, values and gradients."""
    layer, params, h, t = _setup(z_loss=z_loss)
    chunked = S.get("full")(vocab_size=V, z_loss=z_loss, chunk_tokens=4)  # 15 tokens: ragged last chunk
    mask = jnp.arange(5)[None, :] < jnp.asarray([5, 3, 1])[:, None]

    def total(layer):
        return lambda p, h: jnp.sum(layer.apply(p, h, t, mask, method="loss"))

    v0, g0 = jax.value_and_grad(total(layer), argnums=(0, 1))(params, h)
    v1, g1 = jax.value_and_grad(total(chunked), argnums=(0, 1))(params, h)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)


def test_full_auto_chunking_keeps_logits_small():
    from hpnlp.softmax.full import CHUNK_LOGITS_BYTES, auto_chunk
    assert auto_chunk(8192, 32768) == 2048 and auto_chunk(100, 37) == 0
    chunk = auto_chunk(8192, 2**20)
    assert chunk * 2**20 * 4 <= CHUNK_LOGITS_BYTES and chunk >= 32


def test_frequencies_checks():
    f = S.Frequencies.of(np.array([5, 3, 3, 1]), 4)
    assert f.is_sorted()
    f.require_sorted("log_uniform")
    with pytest.raises(ValueError, match="id 2 .* more frequent than id 1"):
        S.Frequencies.of(np.array([5, 1, 3, 0]), 4).require_sorted("log_uniform")
    with pytest.raises(ValueError, match="shape"):
        S.Frequencies.of(np.ones(3), 4)
    with pytest.raises(ValueError, match=">= 0"):
        S.Frequencies.of(np.array([1.0, -1.0]), 2)
    np.testing.assert_allclose(S.frequencies(None, 4).probs().sum(), 1.0)


@pytest.mark.parametrize("lead,chunk", [((3, 10), 4), ((3, 10), 8), ((2, 7), 6), ((20,), 6), ((3, 10), 0)])
def test_map_token_chunks_equals_one_call_and_keeps_rows_whole(lead, chunk):
    """Chunks cut the tokens of every row (batch dim whole), padding is dropped, and the
    result (and its gradient) equals one call over all tokens."""
    x = jax.random.normal(jax.random.key(0), lead + (5,))
    t = jnp.arange(np.prod(lead)).reshape(lead) % 5
    fn = lambda h, t: jnp.sum(h * h, -1) + jnp.take_along_axis(h, t[:, None], -1)[:, 0]  # noqa: E731
    seen = []

    def spy(h, t):
        seen.append(h.shape)
        return fn(h, t)
    got = S.map_token_chunks(spy, lead, chunk, x, t)
    np.testing.assert_allclose(got, fn(x.reshape(-1, 5), t.reshape(-1)).reshape(lead), rtol=1e-6)
    if chunk and chunk < np.prod(lead) and len(lead) > 1:
        assert seen[0][0] % lead[0] == 0  # every chunk holds the same number of tokens of each row
    g = jax.grad(lambda x: jnp.sum(S.map_token_chunks(fn, lead, chunk, x, t)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(fn(x.reshape(-1, 5), t.reshape(-1))))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
