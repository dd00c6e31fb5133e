"""Output layers: normalization, loss = -log p(target), masking, tying."""

import flax.linen as nn
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


def _z_penalty(layer, params, h, t, mask):
    """(per-token loss, the z-loss penalty `loss` sowed into AUX, or None where none)."""
    loss, aux = layer.apply({"params": params["params"]}, h, t, mask, method="loss",
                            mutable=["aux"])
    if not aux:
        return loss, None
    (report,) = aux["aux"]["z_loss"]
    assert report.keys() == {"loss", "loss_output_z"}  # the objective's and the logged one
    return loss, report["loss"]


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_full_log_prob_normalized_and_loss_matches(z_loss):
    layer, params, h, t = _setup(z_loss=z_loss)
    logp = layer.apply(params, h, method="log_prob")
    np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)
    mask = jnp.arange(5)[None, :] < jnp.asarray([5, 3, 1])[:, None]
    loss, penalty = _z_penalty(layer, params, h, t, mask)
    nll = -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]
    # the NLL alone, z_loss or not (review r8: the penalty was in it, so train lines logged
    # it as loss and exp of it as ppl)
    np.testing.assert_allclose(loss, jnp.where(mask, nll, 0.0), atol=1e-5)
    if z_loss == 0:
        assert penalty is None
    else:
        # review r18: `loss >= nll` passed with the z-loss dropped or taken as z * lse; its
        # value is z * lse^2, lse from the params (not from the layer's own log_prob), here
        # its mean over the real tokens, which the train step adds times their count
        table = nn.unbox(params)["params"]["table"]
        logits = jnp.einsum("ble,ve->blv", h, table["kernel"]) + table["bias"][None, None]
        lse = jax.nn.logsumexp(logits, axis=-1)
        want = z_loss * jnp.sum(jnp.where(mask, lse**2, 0.0)) / jnp.sum(mask)
        np.testing.assert_allclose(penalty, want, rtol=1e-5)


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

    def total(layer):  # the objective: the NLL, and the z-loss penalty times the real tokens
        def objective(p, h):
            loss, penalty = _z_penalty(layer, p, h, t, mask)
            return jnp.sum(loss) + (0.0 if penalty is None else penalty * jnp.sum(mask))
        return objective

    v0, g0 = jax.value_and_grad(total(layer), argnums=(0, 1))(params, h)
    v1, g1 = jax.value_and_grad(total(chunked), argnums=(0, 1))(params, h)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)


def test_full_chunked_loss_multiplies_a_factored_table_through_its_rank(monkeypatch):
    """The chunked training loss took `weights()`, the densified [V, E] of a `model.lowrank`
    table (U V); each chunk takes the two products through the rank now, with the values and
    gradients of the unchunked loss (which `logits` computes so)."""
    from hpnlp.compress.qlinear import Factored
    layer, params, h, t = _setup()
    chunked = S.get("full")(vocab_size=V, chunk_tokens=4)
    u = jax.random.normal(jax.random.key(5), (V, 3))
    v = jax.random.normal(jax.random.key(6), (3, h.shape[-1])) * h.shape[-1] ** -0.5
    params = {"params": {**params["params"],
                         "table": {**params["params"]["table"], "kernel": Factored(u, v)}}}

    def total(layer):
        return lambda p, h: jnp.sum(layer.apply(p, h, t, method="loss"))

    v0, g0 = jax.value_and_grad(total(layer), argnums=(0, 1))(params, h)
    monkeypatch.setattr(Factored, "dense", lambda self: pytest.fail("the table was densified"))
    v1, g1 = jax.value_and_grad(total(chunked), argnums=(0, 1))(params, h)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g1, g0)


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


@pytest.mark.parametrize("lead,chunk", [((3, 10), 4), ((3, 10), 8), ((2, 7), 6), ((20,), 6),
                                        ((3, 10), 0), ((6, 5), 4), ((7, 3), 2), ((8, 3), 5)])
def test_map_token_chunks_equals_one_call_and_keeps_rows_whole(lead, chunk):
    """Chunks cut the tokens of every row (batch dim whole while `chunk` holds a token of
    each row, else interleaved groups of rows: a review, session 116, found B tokens a chunk
    whatever `chunk` said), padding is dropped, and the result (and its gradient) equals one
    call over all tokens."""
    x = jax.random.normal(jax.random.key(0), lead + (5,))
    t = jnp.arange(np.prod(lead)).reshape(lead) % 5
    fn = lambda h, t: jnp.sum(h * h, -1) + jnp.take_along_axis(h, t[:, None], -1)[:, 0]  # noqa: E731
    seen = []

    def spy(h, t):
        seen.append(h.shape)
        return fn(h, t)
    got = S.map_token_chunks(spy, lead, chunk, x, t)
    np.testing.assert_allclose(got, fn(x.reshape(-1, 5), t.reshape(-1)).reshape(lead), rtol=1e-6)
    if chunk and chunk < np.prod(lead):
        assert seen[0][0] <= chunk
    if chunk and chunk < np.prod(lead) and len(lead) > 1 and chunk >= lead[0]:
        assert seen[0][0] % lead[0] == 0  # every chunk holds the same number of tokens of each row
    g = jax.grad(lambda x: jnp.sum(S.map_token_chunks(fn, lead, chunk, x, t)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(fn(x.reshape(-1, 5), t.reshape(-1))))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)


def test_token_chunks_under_the_batch_take_interleaved_rows_that_split_over_the_devices(
        monkeypatch):
    """Where `chunk` is under the batch's rows, chunk j holds rows j, j + k, ... (a review,
    session 116), k the least divisor whose groups fit and divide over the batch's devices:
    each chunk's least row id, read by every token of it, is its row's id mod k."""
    from hpnlp.softmax import full
    rows = jnp.broadcast_to(jnp.arange(6)[:, None], (6, 5))
    least = S.map_token_chunks(lambda r: jnp.broadcast_to(jnp.min(r), r.shape), (6, 5), 4, rows)
    np.testing.assert_array_equal(least, rows % 2)  # k = 2: groups of 3 rows
    assert S.base._row_groups(40, 16) == 4  # groups of 10 rows
    monkeypatch.setattr(full, "batch_shards", lambda: 8)  # 5 rows a device
    assert S.base._row_groups(40, 16) == 5  # groups of 8: one row of each device
    assert S.base._row_groups(6, 4) == 2  # none divides: the least that fits


@pytest.mark.parametrize("name,kw", [
    ("full", {}), ("full", {"chunk_tokens": 4, "z_loss": 1e-3}), ("sampled", {}),
    ("nce", {"num_samples": 8}), ("negative_sampling", {}), ("hard_negative", {}),
    ("class_based", {"num_classes": 6}),
    # chunk_tokens sizes class_based's member gather: eval chunks its [C, V] logits by the
    # automatic budget all the same (found in review: 64 >= 15 tokens read [N, V] whole)
    ("class_based", {"num_classes": 6, "chunk_tokens": 64})])
def test_eval_walks_token_chunks_and_reads_log_prob(name, kw, monkeypatch):
    """Review r2: evaluation read the whole [N, V] `log_prob` (32 GiB at 8K tokens x 1M
    ids) where the loss walks chunks; it reads each token's NLL and argmax chunk by chunk."""
    lib.check_eval_chunks(S.get(name)(vocab_size=lib.V, **kw), monkeypatch)


def _with_table(layer, kernel):
    """`layer`'s init params with its output table's kernel replaced by `kernel`."""
    h, t = lib.inputs()
    params = lib.init(layer, h, t)["params"]
    return {"params": {**params, "table": {**params["table"], "kernel": kernel}}}


@pytest.mark.parametrize("name", ["full", "class_based"])
def test_eval_chunks_multiply_a_factored_table_through_its_rank(name, monkeypatch):
    """Found in review: chunked evaluation densified a low-rank output table (U V, the
    [V, E] `model.lowrank` removes) where `logits` takes two products through the rank.
    Each chunk takes those products now, and equals the log_prob path."""
    from hpnlp.compress.qlinear import Factored
    layer = S.get(name)(vocab_size=lib.V, **({"num_classes": 6} if name == "class_based" else {}))
    u = jax.random.normal(jax.random.key(5), (lib.V, 4))
    v = jax.random.normal(jax.random.key(6), (4, lib.E)) * lib.E ** -0.5
    params = _with_table(layer, Factored(u, v))
    monkeypatch.setattr(Factored, "dense", lambda self: pytest.fail("the table was densified"))
    lib.check_eval_chunks(layer, monkeypatch, params=params)


@pytest.mark.parametrize("name,kw", [
    ("sampled", {"num_samples": 8}), ("nce", {"num_samples": 8, "unique": True}),
    ("negative_sampling", {"num_samples": 8, "shared": False}),
    ("hard_negative", {"num_negatives": 3}), ("class_based", {"num_classes": 16})])
def test_training_losses_take_a_factored_table_through_its_rank(name, kw):
    """Review r8: the sampled objectives, hard_negative and class_based multiplied a
    `model.lowrank` table (U V) out to its [V, E] every step, and back through it in the
    backward, to gather a few rows. Rows are U[ids] V now, hard_negative's search and
    class_based's members go through the rank, and the compiled step holds no [V, E] buffer
    (V = 1031 > the 15 tokens' 135 rows); loss and gradients (of U, V, b and the hidden
    states) are the densified table's."""
    import re
    from hpnlp.compress.qlinear import Factored
    V, r = 1031, 4
    layer = S.get(name)(vocab_size=V, **kw)
    h, t = lib.inputs(vocab=V)
    params = nn.unbox(lib.init(layer, h, t))["params"]
    params["table"] = {"bias": params["table"]["bias"]}  # the kernel: U and V's, below
    u = jax.random.normal(jax.random.key(5), (V, r))
    v = jax.random.normal(jax.random.key(6), (r, lib.E)) * lib.E ** -0.5
    mask = jnp.arange(lib.L)[None, :] < jnp.asarray([5, 3, 1])[:, None]
    weight_BL = jnp.linspace(0.5, 1.5, lib.B * lib.L).reshape(lib.B, lib.L)

    def total(kernel_of):
        def f(u, v, params, h):  # deterministic: both draw the same negatives
            p = {**params, "table": {**params["table"], "kernel": kernel_of(u, v)}}
            return jnp.sum(layer.apply({"params": p}, h, t, mask, method="loss") * weight_BL)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))

    factored = total(Factored)
    hlo = factored.lower(u, v, params, h).compile().as_text()
    assert not re.search(rf"\[{V},{lib.E}\]|\[{lib.E},{V}\]", hlo), "a [V, E] buffer"
    l_f, g_f = factored(u, v, params, h)
    l_d, g_d = total(lambda u, v: u @ v)(u, v, params, h)
    np.testing.assert_allclose(l_f, l_d, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g_f, g_d)


def test_eval_chunks_of_a_served_table_run_its_integer_kernel(monkeypatch):
    """Found in review: chunked evaluation of a `ptq.serve`d output table dequantized it to
    a float [V, E] product where `logits` runs the int8 kernel; each chunk runs the kernel
    now, and equals the log_prob path (the same kernel over all tokens)."""
    from hpnlp.compress import kernels, qlinear
    from hpnlp.config import QuantConfig
    if not kernels.available():
        pytest.skip(str(kernels.unavailable_reason()))
    q = QuantConfig(weights="int8", activations="int8")  # dynamic per token: the kernel's
    layer = S.get("full")(vocab_size=lib.V, quant=q)
    w_VE = jax.random.normal(jax.random.key(5), (lib.V, lib.E)) * lib.E ** -0.5
    served = qlinear.prepare(qlinear.pack_weight(w_VE.T, q, 1), q)  # packed [E, V]
    assert isinstance(served, qlinear.Served)
    monkeypatch.setattr(qlinear.Served, "dequantize",
                        lambda self, dtype=None: pytest.fail("the table was dequantized"))
    lib.check_eval_chunks(layer, monkeypatch, params=_with_table(layer, served))


def _tiny_lm(output=None, **model):
    from hpnlp import models
    from hpnlp.config import default_configdict, from_configdict, validate
    cd = default_configdict()
    cd.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, max_len=16, dropout=0.0)
    cd.model.update(**model)
    cd.data.update(task="byte_lm", seq_len=16)
    if output is not None:
        cd.output.options = output
    return models.build(validate(from_configdict(cd)), deterministic=True)


def _byte_batch(lengths=(16, 9)):
    rng = np.random.default_rng(0)
    seg = (np.arange(16)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    return {"inputs": rng.integers(0, 256, (len(lengths), 16)).astype(np.int32),
            "targets": rng.integers(0, 256, (len(lengths), 16)).astype(np.int32),
            "segment_ids": seg, "positions": np.tile(np.arange(16, dtype=np.int32),
                                                     (len(lengths), 1))}


def test_full_z_loss_trains_beside_the_logged_nll():
    """Review r8: `full`'s z-loss was inside the per-token loss, so train lines logged
    NLL + z E[lse^2] as `loss` and exp of it as `ppl` (2.9x the perplexity at z_loss=0.01,
    V=32K, at init), off the eval lines' scale. The train step's sums now carry the NLL the
    evaluation reads, the penalty as `loss_aux` (which the step adds) and `loss_output_z`,
    and the objective and its gradient are what the per-token penalty gave. The loss is
    chunked (4 chunks): the unchunked path's penalty is checked above."""
    from hpnlp.train import carry
    from hpnlp.train.step import finalize
    z = 0.1
    model = _tiny_lm(output={"z_loss": z, "chunk_tokens": 8})
    batch = _byte_batch()
    mask = batch["segment_ids"] > 0
    params = jax.jit(model.init)(jax.random.key(0), batch)["params"]

    def by_hand(p):  # the old per-token objective: sum over real tokens of NLL + z lse^2
        h = model.apply({"params": p}, batch, method="hidden")
        logits = model.apply({"params": p}, h, method=lambda m, h: m.output.logits(h))
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        nll, lse2 = jnp.where(mask, nll, 0.0), jnp.where(mask, lse**2, 0.0)
        return jnp.sum(nll + z * lse2), (jnp.sum(nll), jnp.sum(lse2))

    def objective(p):
        sums = carry.model_loss(model)(p, {}, batch, None)[0]
        return sums["loss"] + sums[carry.AUX_LOSS], sums

    (obj, sums), g, (want, (nll, lse2)), g_want = jax.jit(lambda p: (
        *jax.value_and_grad(objective, has_aux=True)(p),
        *jax.value_and_grad(by_hand, has_aux=True)(p)))(params)
    # the NLL, which evaluation reads too (`lm_eval_sums`: -log_prob[target] of the logits)
    np.testing.assert_allclose(sums["loss"], nll, rtol=1e-5)
    np.testing.assert_allclose(sums[carry.AUX_LOSS], z * lse2, rtol=1e-5)
    np.testing.assert_allclose(obj, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g, g_want)
    line = finalize(jax.device_get(sums), lm=True, output="full")
    assert line["ppl"] == pytest.approx(np.exp(float(nll) / 25.0), rel=1e-5)
    assert line["loss_output_z"] == pytest.approx(z * float(lse2) / 25.0, rel=1e-5)


def test_lm_eval_sums_chunked_equal_the_log_prob_ones(monkeypatch):
    """TransformerLM.evaluate over 4 chunks of tokens (padding masked) sums what the whole
    [B, L, V] log_prob gave: NLL and correct argmax of the real tokens."""
    from hpnlp.softmax import full
    model = _tiny_lm()
    batch = _byte_batch()
    seg = batch["segment_ids"]
    params = jax.jit(model.init)(jax.random.key(0), batch)
    logp = jax.jit(lambda p, b: model.apply(p, b, method="log_probs"))(params, batch)
    # every third target the model's argmax, padded positions too: some are correct
    t = np.where(np.arange(16) % 3 == 0, np.asarray(jnp.argmax(logp, -1)), batch["targets"])
    batch["targets"] = t.astype(np.int32)
    mask = seg > 0
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    correct = float(jnp.sum((jnp.argmax(logp, -1) == t) & mask))
    assert 0 < correct < float(jnp.sum(jnp.argmax(logp, -1) == t))
    # a chunk's logits budget of 8 tokens: 4 chunks of 4 tokens of each of the 2 rows, seen
    # to run (a review, session 118: nothing said the chunked path was the one compared)
    from hpnlp.softmax import base
    monkeypatch.setattr(full, "CHUNK_LOGITS_BYTES", 8 * 256 * 4)
    chunks, real = [], base.map_token_chunks

    def spy(fn, lead, chunk, *arrays, **kw):
        chunks.append(chunk)
        return real(fn, lead, chunk, *arrays, **kw)
    monkeypatch.setattr(base, "map_token_chunks", spy)
    got = jax.jit(lambda p, b: model.apply(p, b, method="evaluate"))(params, batch)
    assert chunks == [8], chunks
    assert float(got["weight"]) == 25.0
    np.testing.assert_allclose(got["loss"], jnp.sum(jnp.where(mask, nll, 0.0)), rtol=1e-6)
    assert float(got["correct"]) == correct


def test_lm_eval_of_a_million_ids_fits_where_the_chunked_loss_does():
    """Review r2: at 8K tokens x 2^20 ids the eval step's logits were 32 GiB; compiled
    (nothing run or allocated), its temporaries stay within a few chunks' logits."""
    import flax.linen as nn
    from hpnlp.softmax.full import CHUNK_LOGITS_BYTES
    model = _tiny_lm(vocab_size=2**20, max_len=128)
    batch = {k: jax.ShapeDtypeStruct((64, 128), jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    params = jax.eval_shape(lambda b: nn.unbox(model.init(jax.random.key(0), b)), batch)
    compiled = jax.jit(lambda p, b: model.apply(p, b, method="evaluate")).lower(
        params, batch).compile()
    # a chunk's product and its biased logits (two buffers); the whole [B, L, V] was 128x
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * CHUNK_LOGITS_BYTES


def test_trains_nll_marks_the_objectives_whose_exp_is_a_perplexity():
    """Review r2: train lines logged exp(loss) as `ppl` for hinge, logistic, bitwise and
    vMF objectives; only the exact ones (and evaluation's NLL) carry it."""
    from hpnlp.train.step import finalize
    exact = {"full", "class_based", "hierarchical", "adaptive"}
    assert {n for n in S.names() if S.trains_nll(n)} == exact
    sums = {"loss": 6.0, "weight": 2.0}
    for name in S.names():
        assert ("ppl" in finalize(sums, lm=True, output=name)) == (name in exact), name
    assert finalize(sums, lm=True)["ppl"] == pytest.approx(np.exp(3.0))  # eval lines
    assert "ppl" not in finalize(sums, lm=False, output="full")


# One compile per layer: 0.3-1.6 s each, 6.5 s for the eight on one core of the 2-core CPU
# (1-4 s each while the other core was busy): CI's slow part runs it. The fast suite keeps
# the layer with a hand-written backward, adaptive (test_softmax_adaptive.py, with a float16
# twin there too); vmf needs a tied holder (its custom_jvp is of float32 Bessel terms).
@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [
    ("full", {}), ("class_based", {"num_classes": 6}), ("hierarchical", {}),
    ("binary_code", {}), ("sampled", {}), ("nce", {"num_samples": 8}),
    ("negative_sampling", {}), ("hard_negative", {})])
def test_bfloat16_contract(name, kw):
    """Review r9: only `sampled`'s bfloat16 path was tested; every layer's, with float32
    losses and log_probs."""
    lib.check_half_precision(S.get(name)(vocab_size=lib.V, **kw), exact=S.trains_nll(name))


def test_hard_negative_takes_narrow_integer_targets():
    """A review (session 118): the search's id range was built in the targets' dtype, so
    uint8 targets past a vocabulary of 256 wrapped (ids 256.. read as 0..) and a target's
    aliases were left out of the negatives."""
    layer = S.get("hard_negative")(vocab_size=300, num_negatives=4, chunk_tokens=0)
    h = jax.random.normal(jax.random.key(0), (6, E))
    t = jnp.asarray([0, 1, 3, 44, 200, 255], jnp.int32)
    params = nn.unbox(layer.init(jax.random.key(1), h))
    # ids 256.. scored over the rest, so each is among the hardest negatives: a wrapped
    # range left out the target's alias t + 256
    bias = params["params"]["table"]["bias"]
    params["params"]["table"]["bias"] = bias.at[256:].add(10.0)
    wide = layer.apply(params, h, t, method="loss")
    narrow = layer.apply(params, h, t.astype(jnp.uint8), method="loss")
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))
