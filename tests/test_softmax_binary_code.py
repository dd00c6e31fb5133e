"""binary_code (plain, hybrid, ecc): contract, codes, BCE loss, normalization, error correction."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import softmax_testlib as lib

import hpnlp.softmax.binary_code as bc
import hpnlp.softmax as S

V = lib.V
UNSORTED = S.Frequencies.of(np.random.default_rng(0).integers(0, 50, V), V)
VARIANTS = [dict(mode="plain"), dict(mode="hybrid", softmax_size=5, counts=UNSORTED),
            dict(mode="ecc", redundancy=3, counts=UNSORTED)]


def _layer(**kw):
    return S.get("binary_code")(vocab_size=V, **kw)


def _ranks(kw):
    counts = kw.get("counts")
    return np.arange(V) if counts is None else np.argsort(np.argsort(-counts.counts, kind="stable"))


def naive_codeword(index, data_bits, redundancy):
    """Data bits MSB first; ecc: a shift-register convolutional encoder (6 zero tail bits)."""
    bits = [int(b) for b in format(index, f"0{data_bits}b")]
    if not redundancy:
        return bits
    register, out = [0] * bc.CONSTRAINT, []
    for u in bits + [0] * (bc.CONSTRAINT - 1):
        register = [u] + register[:-1]
        for octal in bc.GENERATORS[redundancy]:
            taps = [int(b) for b in format(octal, f"0{bc.CONSTRAINT}b")]
            out.append(sum(t * r for t, r in zip(taps, register)) % 2)
    return out


def _naive(kw, params, h, t):
    """Loss and normalized log-probs from numpy loops over ids, as the paper defines them."""
    mode, size = kw["mode"], kw.get("softmax_size", 0) if kw["mode"] == "hybrid" else 0
    red = kw.get("redundancy", 2) if mode == "ecc" else 0
    p = jax.tree.map(np.asarray, nn.meta.unbox(params))["params"]
    h = np.asarray(h, np.float64).reshape(-1, h.shape[-1])
    s = h @ p["bits"]["kernel"].T + p["bits"]["bias"]
    logsig = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    ranks, data_bits = _ranks(kw), max(1, (V - size - 1).bit_length())
    code = {r: np.asarray(naive_codeword(r - size, data_bits, red)) for r in range(size, V)}
    bits_lp = {r: logsig((2 * c - 1) * s).sum(-1) for r, c in code.items()}
    rest = np.stack([bits_lp[r] for r in range(size, V)], -1)
    rest_lse = np.log(np.exp(rest - rest.max(-1, keepdims=True)).sum(-1)) + rest.max(-1)
    head = None
    if size:
        z = h @ p["head"]["kernel"].T + p["head"]["bias"]
        head = z - (np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1))[:, None]
    logp = np.zeros((h.shape[0], V))
    for v in range(V):
        r = ranks[v]
        if r < size:
            logp[:, v] = head[:, r]
        else:
            logp[:, v] = bits_lp[r] - rest_lse + (head[:, size] if size else 0.0)
    loss = np.zeros(h.shape[0])
    for n, v in enumerate(np.asarray(t).reshape(-1)):
        r = ranks[v]
        loss[n] = -head[n, min(r, size)] if size else 0.0
        if r >= size:
            loss[n] -= bits_lp[r][n]
    return loss.reshape(t.shape), logp.reshape(*t.shape, V)


@pytest.mark.parametrize("kw", VARIANTS)
def test_contract_and_naive_twin(kw):
    layer = _layer(**kw)
    params, logp = lib.check_normalized(layer)
    lib.check_padding(layer)
    lib.check_rejects_out_of_vocab(layer)
    h, t = lib.inputs()
    loss = layer.apply(params, h, t, None, method="loss")
    naive_loss, naive_logp = _naive(kw, params, h, t)
    np.testing.assert_allclose(loss, naive_loss, rtol=1e-5, atol=1e-5)  # bit-wise BCE (+ softmax)
    np.testing.assert_allclose(logp, naive_logp, rtol=1e-5, atol=1e-5)  # renormalized over V
    nll = -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]
    assert bool(jnp.all(loss >= nll - 1e-5))  # renormalizing only raises valid codes' mass
    if kw["mode"] == "hybrid":  # softmax ids: the loss is exactly -log_prob
        head = _ranks(kw)[np.asarray(t)] < kw["softmax_size"]
        assert head.any()
        np.testing.assert_allclose(loss[head], nll[head], atol=1e-5)


@pytest.mark.parametrize("kw", VARIANTS + [dict(mode="ecc")])
def test_codes_unique(kw):
    layer = _layer(**kw)
    h, t = lib.inputs()
    codes = layer.bind({}).codes
    size = codes.softmax_size
    words = np.asarray(codes.encode(jnp.arange(V - size)))
    assert len({tuple(w) for w in words}) == V - size
    assert codes.data_bits == int(np.ceil(np.log2(V - size)))
    assert words.shape[1] == (codes.data_bits if kw["mode"] != "ecc" else
                              kw.get("redundancy", 2) * (codes.data_bits + bc.CONSTRAINT - 1))
    if kw["mode"] == "ecc":  # free distance of the code: 10 (rate 1/2), 15 (rate 1/3)
        dist = (words[:, None] != words[None]).sum(-1) + np.eye(V - size, dtype=int) * 999
        assert dist.min() >= 5 * kw.get("redundancy", 2)


def test_ecc_corrects_flipped_bits_plain_does_not():
    """Bit scores of the true codeword with a few signs flipped: ecc still ranks it first,
    the plain code (distance 1) decodes to a neighbour."""
    rng = np.random.default_rng(1)
    top1 = {}
    for mode, flips in (("ecc", 3), ("plain", 1)):
        layer = _layer(mode=mode)
        codes = layer.bind({}).codes
        width = codes.code_bits
        params = {"params": {"bits": {"kernel": jnp.eye(width), "bias": jnp.zeros(width)}}}
        targets = np.arange(0, V - 1, 2)  # even ids: flipping the last plain bit stays in range
        code_TC = np.asarray(codes.encode(jnp.asarray(targets)))
        score_TC = 3.0 * (2 * code_TC - 1)
        for row in score_TC:
            pos = rng.choice(width, flips, replace=False) if mode == "ecc" else [width - 1]
            row[pos] *= -1
        _, ids = layer.apply(params, jnp.asarray(score_TC, jnp.float32), 1, method="top_k")
        top1[mode] = np.asarray(ids[:, 0])
        np.testing.assert_allclose(jnp.exp(layer.apply(params, jnp.asarray(score_TC, jnp.float32))).sum(-1), 1,
                                   atol=1e-5)
    np.testing.assert_array_equal(top1["ecc"], targets)
    np.testing.assert_array_equal(top1["plain"], targets + 1)


@pytest.mark.parametrize("kw", [dict(mode="plain"), dict(mode="hybrid", softmax_size=4), dict(mode="ecc")])
def test_tiny_training_run(kw):
    """SGD on fixed inputs (one random vector per id): the loss falls and accuracy rises."""
    vocab, width, steps = 12, 16, 150
    layer = S.get("binary_code")(vocab_size=vocab, **kw)
    targets = jnp.tile(jnp.arange(vocab), 4)
    centers = jax.random.normal(jax.random.key(0), (vocab, width))
    hidden = centers[targets] + 0.1 * jax.random.normal(jax.random.key(1), (targets.size, width))
    params = layer.init(jax.random.key(2), hidden, targets, method="loss")

    def metrics(p):
        loss = jnp.mean(layer.apply(p, hidden, targets, method="loss"))
        acc = jnp.mean(jnp.argmax(layer.apply(p, hidden), -1) == targets)
        return loss, acc

    def step(p, _):
        grads = jax.grad(lambda p: jnp.mean(layer.apply(p, hidden, targets, method="loss")))(p)
        return jax.tree.map(lambda w, g: w - 0.5 * g, p, grads), None

    @jax.jit
    def run(p):
        before = metrics(p)
        p, _ = jax.lax.scan(step, p, None, length=steps)
        return before, metrics(p)

    (loss0, acc0), (loss1, acc1) = run(params)
    assert float(loss1) < 0.3 * float(loss0)
    assert float(acc1) > float(acc0) and float(acc1) >= 0.95


def test_small_vocabularies():
    for vocab, kw in ((1, dict(mode="plain")), (2, dict(mode="ecc")), (2, dict(mode="hybrid"))):
        layer = S.get("binary_code")(vocab_size=vocab, **kw)

        @jax.jit  # one compile instead of one per eager op
        def run(h, t):
            params = lib.init(layer, h, t)
            return layer.apply(params, h, method="log_prob"), layer.apply(params, h, t, None, method="loss")

        logp, loss = run(*lib.inputs(vocab=vocab))
        np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-5)
        assert bool(jnp.all(jnp.isfinite(loss)))


@pytest.mark.parametrize("kw,match", [(dict(mode="huffman"), "mode='huffman'"),
                                      (dict(mode="hybrid", softmax_size=V), "softmax_size=37"),
                                      (dict(mode="ecc", redundancy=5), "redundancy=5"),
                                      (dict(mode="ecc", redundancy=2.0), "redundancy=2.0")])
def test_bad_fields_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        _layer(**kw).init(jax.random.key(0), *lib.inputs(), method="loss")


def test_a_float_redundancy_is_refused_by_the_config_check():
    """A bug hunt (session 103): redundancy=2.0 passed both checks (2.0 == 2) and failed at
    init with numpy's TypeError, naming no field."""
    from hpnlp.config import ConfigError
    with pytest.raises(ConfigError, match=r"`output.options.redundancy` = 2.0 is not allowed"):
        S.check_config("binary_code", {"mode": "ecc", "redundancy": 2.0}, vocab_size=V,
                       frequency_sorted=True)
    S.check_config("binary_code", {"mode": "ecc", "redundancy": 2}, vocab_size=V,
                   frequency_sorted=True)
