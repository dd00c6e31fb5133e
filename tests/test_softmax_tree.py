"""class_based and hierarchical: contract, exact loss and gradients, the trees themselves."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import softmax_testlib as lib

import hpnlp.softmax.tree as tree
import hpnlp.softmax as S

RNG = np.random.default_rng(0)
UNSORTED = S.Frequencies.of(RNG.integers(0, 50, lib.V), lib.V)  # ties, zeros, not sorted

VARIANTS = [
    ("class_based", {}),
    ("class_based", dict(counts=UNSORTED, num_classes=5, bin_power=0.5, chunk_tokens=4)),  # ragged chunk
    ("hierarchical", {}),
    ("hierarchical", dict(counts=UNSORTED, chunk_tokens=4)),
]


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_contract(name, kw):
    layer = S.get(name)(vocab_size=lib.V, **kw)
    lib.check_normalized(layer)
    lib.check_exact_loss(layer)
    lib.check_padding(layer)
    lib.check_rejects_out_of_vocab(layer)


@pytest.mark.parametrize("name,kw", VARIANTS[1::2])
def test_loss_gradients_equal_exact_twin(name, kw):
    """The path/class-restricted loss has the gradients of -log_prob[target] (params and h)."""
    layer = S.get(name)(vocab_size=lib.V, **kw)
    h, t = lib.inputs()
    params = lib.init(layer, h, t)
    mask = jnp.arange(5)[None, :] < jnp.asarray([5, 3, 1])[:, None]

    def fast(p, h):
        return jnp.sum(layer.apply(p, h, t, mask, method="loss"))

    def exact(p, h):
        logp = layer.apply(p, h, method="log_prob")
        return -jnp.sum(jnp.where(mask, jnp.take_along_axis(logp, t[..., None], -1)[..., 0], 0.0))

    v0, g0 = jax.jit(jax.value_and_grad(fast, argnums=(0, 1)))(params, h)
    v1, g1 = jax.jit(jax.value_and_grad(exact, argnums=(0, 1)))(params, h)
    np.testing.assert_allclose(v0, v1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g0, g1)


# --------------------------------------------------------------------------- Huffman tree


def naive_huffman(weights):
    """Textbook Huffman (heap of the two lightest, recursive read-out): codes and node paths."""
    vocab = len(weights)
    heap = [(w, v) for v, w in enumerate(weights)]
    heapq.heapify(heap)
    children = {}
    while len(heap) > 1:
        (w0, a), (w1, b) = heapq.heappop(heap), heapq.heappop(heap)
        node = vocab + len(children)
        children[node] = (a, b)
        heapq.heappush(heap, (w0 + w1, node))
    out = {}

    def walk(node, code, path):
        if node < vocab:
            out[node] = (code, path)
            return
        a, b = children[node]
        walk(a, code + "0", path + [node - vocab])
        walk(b, code + "1", path + [node - vocab])

    walk(heap[0][1], "", [])
    return [out[v] for v in range(vocab)]


def test_huffman_matches_naive_construction():
    """Distinct weights (and sums) make the Huffman tree unique: codes and node ids must agree."""
    weights = RNG.random(29)
    built = tree.huffman_tree(S.Frequencies.of(weights, 29))
    for v, (code, path) in enumerate(naive_huffman(weights.tolist())):
        assert built.codes()[v] == code
        depth = built.depth_V[v]
        assert built.node_DV[:depth, v][::-1].tolist() == path
        assert not built.node_DV[depth:, v].any() and not built.sign_DV[depth:, v].any()


@pytest.mark.parametrize("counts", [S.Frequencies.zipf(300).counts, RNG.integers(0, 20, 300).astype(float),
                                    np.ones(300), np.r_[np.zeros(150), np.ones(150)]])
def test_huffman_is_an_optimal_prefix_code(counts):
    """With ties the tree is not unique; any Huffman tree is a complete prefix code, gives
    shorter-or-equal codes to more frequent ids and has the optimal expected length."""
    built = tree.huffman_tree(S.Frequencies.of(counts, len(counts)))
    codes = built.codes()
    assert len(set(codes)) == len(codes)
    ordered = sorted(codes)
    assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))  # prefix-free
    np.testing.assert_allclose(sum(2.0 ** -len(c) for c in codes), 1.0)  # complete: Kraft equality
    more_frequent = counts[:, None] > counts[None, :]
    assert not np.any(more_frequent & (built.depth_V[:, None] > built.depth_V[None, :]))
    naive = naive_huffman(counts.tolist())
    np.testing.assert_allclose(counts @ built.depth_V, sum(c * len(code) for c, (code, _) in zip(counts, naive)))


def test_tables_cached_by_content():
    counts = RNG.integers(1, 9, 40)
    a = tree.cached_tables(tree.huffman_tree, S.Frequencies.of(counts, 40), 40)
    b = tree.cached_tables(tree.huffman_tree, S.Frequencies.of(counts.copy(), 40), 40)
    c = tree.cached_tables(tree.huffman_tree, S.Frequencies.of(counts + 1, 40), 40)
    assert a is b and a is not c


# --------------------------------------------------------------------------- class bins


def rnnlm_bins(probs_sorted, num_classes):
    """Mikolov's rnnlm loop, the reference for the vectorized binning; ids of zero mass
    (last in the order) then fill classes of ceil(V / C) ids after the loop's."""
    seen = int(np.count_nonzero(probs_sorted > 0))
    out = rnnlm_walk(probs_sorted[:seen], num_classes)
    size = -(-len(probs_sorted) // num_classes)
    return np.concatenate([out, out[-1] + 1 + np.arange(len(probs_sorted) - seen) // size])


def rnnlm_walk(probs_sorted, num_classes):
    a, mass, out = 0, 0.0, []
    for p in probs_sorted:
        mass = min(mass + p, 1.0)
        out.append(a)
        if mass > (a + 1) / num_classes and a < num_classes - 1:
            a += 1
    return np.asarray(out)


@pytest.mark.parametrize("vocab,classes", [(37, 6), (200, 14), (50, 49), (300, 300)])
@pytest.mark.parametrize("kind", ["zipf", "random"])
def test_class_bins(vocab, classes, kind):
    freqs = S.Frequencies.zipf(vocab) if kind == "zipf" else S.Frequencies.of(RNG.integers(0, 30, vocab), vocab)
    bins = tree.class_bins(freqs, classes)
    probs = freqs.probs()
    # every id in exactly one class; classes are runs of consecutive frequency ranks
    np.testing.assert_array_equal(np.sort(bins.order_V), np.arange(vocab))
    np.testing.assert_array_equal(bins.order_V[bins.rank_V], np.arange(vocab))
    zeros = int(np.sum(freqs.counts == 0))
    assert bins.size_C.sum() == vocab and bins.size_C.min() >= 1
    assert bins.num_classes <= classes + -(-zeros // -(-vocab // classes))
    for c in range(bins.num_classes):
        members = bins.order_V[bins.start_C[c]:bins.start_C[c] + bins.size_C[c]]
        np.testing.assert_array_equal(bins.class_V[members], c)
        # balanced mass: under 1/C except for the id that closes the class
        assert probs[members].sum() < 1 / classes + probs[members].max() + 1e-12
    np.testing.assert_array_equal(bins.class_V[bins.order_V], rnnlm_bins(probs[bins.order_V], classes))


def test_class_bins_equal_mass_when_flat():
    bins = tree.class_bins(S.Frequencies.of(np.ones(100), 100), 10)
    assert bins.num_classes == 10 and np.abs(bins.size_C - 10).max() <= 1  # rounding of the cuts


def test_unseen_ids_fill_classes_of_their_own():
    """Ids with no training count (most of a large BPE vocabulary on a small corpus) get
    classes of ceil(V / C) after the mass walk's, not one class as wide as all of them."""
    counts = np.zeros(1000)
    counts[:400] = S.Frequencies.zipf(400).counts
    bins = tree.class_bins(S.Frequencies.of(counts, 1000), 32)
    unseen = bins.class_V[400:]
    assert set(np.unique(unseen)).isdisjoint(bins.class_V[:400])
    np.testing.assert_array_equal(np.bincount(unseen)[np.unique(unseen)], [32] * 18 + [24])
    assert bins.max_size < 100


def test_class_based_sqrt_binning_shrinks_largest_class():
    freqs = S.Frequencies.zipf(4096)
    assert tree.class_bins(freqs, 64, 0.5).max_size < tree.class_bins(freqs, 64, 1.0).max_size / 3


# --------------------------------------------------------------------------- edge cases


def _log_prob_and_loss(layer, vocab):
    @jax.jit  # one compile instead of one per eager op
    def run(h, t):
        params = lib.init(layer, h, t)
        logp = layer.apply(params, h, method="log_prob")
        loss = layer.apply(params, h, t, None, method="loss")
        return logp, loss, -jnp.take_along_axis(logp, t[..., None], -1)[..., 0]

    return run(*lib.inputs(vocab=vocab))


def test_vocab_one_and_two():
    """V=1: class_based is the certain distribution, hierarchical has no tree and says so."""
    logp, loss, _ = _log_prob_and_loss(S.get("class_based")(vocab_size=1), 1)
    np.testing.assert_array_equal(logp, 0.0)
    np.testing.assert_array_equal(loss, 0.0)
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        _log_prob_and_loss(S.get("hierarchical")(vocab_size=1), 1)
    for name in ("class_based", "hierarchical"):
        logp, loss, nll = _log_prob_and_loss(S.get(name)(vocab_size=2), 2)
        np.testing.assert_allclose(jnp.exp(logp).sum(-1), 1.0, atol=1e-6)
        np.testing.assert_allclose(loss, nll, atol=1e-5)
    assert sorted(tree.huffman_tree(S.Frequencies.zipf(2)).codes()) == ["0", "1"]


def test_bad_fields_rejected():
    with pytest.raises(ValueError, match="num_classes=50"):
        lib.check_normalized(S.get("class_based")(vocab_size=lib.V, num_classes=50))
    with pytest.raises(ValueError, match="bin_power"):
        lib.check_normalized(S.get("class_based")(vocab_size=lib.V, bin_power=0.0))
    with pytest.raises(ValueError, match="shape"):
        lib.check_normalized(S.get("hierarchical")(vocab_size=lib.V, counts=np.ones(5)))
