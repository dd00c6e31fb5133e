"""The bi-encoder (hpnlp.models.bi_encoder), hard-negative mining (hpnlp.retrieval.mining),
inverse-frequency embedding gradients (models/transformer.py) and the verse_pairs task."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import data
from hpnlp.config import ConfigError, DataConfig, from_configdict, validate
from hpnlp.models import bi_encoder as be
from hpnlp.models.transformer import batch_count_weights, corpus_count_weights, scaled_take
from hpnlp.retrieval import mining


def _unit(rng, *shape):
    x = rng.normal(size=shape).astype(np.float32)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _lse(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def test_in_batch_loss_equals_its_formula():
    rng = np.random.default_rng(0)
    q, d, n = _unit(rng, 6, 8), _unit(rng, 6, 8), _unit(rng, 6, 8)
    valid = np.array([1, 1, 1, 1, 1, 0], bool)  # a filler row: a candidate for nobody
    pos = valid & np.array([1, 1, 0, 1, 1, 1], bool)  # row 2 a label-0 pair: a candidate only
    nv = np.array([1, 0, 1, 1, 0, 0], bool)
    T = 0.1
    got = be.in_batch_loss(q, d, valid, pos, T, symmetric=True, n_NE=n, n_valid_N=nv)
    s = q @ d.T / T
    want = np.zeros(6)
    for i in np.flatnonzero(pos):
        cand_q = np.concatenate([s[i, valid], (q[i] @ n.T / T)[nv]])
        cand_d = s[valid, i]
        want[i] = 0.5 * ((_lse(cand_q, 0) - s[i, i]) + (_lse(cand_d, 0) - s[i, i]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    one_way = be.in_batch_loss(q, d, valid, pos, T, symmetric=False)
    want1 = [(_lse(s[i, valid], 0) - s[i, i]) if pos[i] else 0.0 for i in range(6)]
    np.testing.assert_allclose(one_way, want1, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda q: be.in_batch_loss(q, d, valid, pos, T).sum())(jnp.asarray(q))
    assert np.isfinite(np.asarray(g)).all()
    clash = np.zeros((6, 6), bool)
    clash[0, 2] = True  # the negative mined for row 2 is row 0's match: not a negative of row 0
    got = be.in_batch_loss(q, d, valid, pos, T, symmetric=False, n_NE=n, n_valid_N=nv, n_clash_BN=clash)
    keep = nv & ~clash[0]
    want0 = _lse(np.concatenate([s[0, valid], (q[0] @ n.T / T)[keep]]), 0) - s[0, 0]
    np.testing.assert_allclose(got[0], want0, rtol=1e-5)


def _text_batch(qs, ds, labels):
    """A pair batch of byte texts (as the batches hold them: padded, segment id 1 on text)."""
    L = max(map(len, qs + ds))
    out = {"label": np.array(labels, np.int32), "weight": np.ones(len(qs), np.float32)}
    for k, texts in (("1", qs), ("2", ds)):
        tok, seg = np.zeros((len(texts), L), np.int32), np.zeros((len(texts), L), np.int32)
        for i, t in enumerate(texts):
            tok[i, :len(t)], seg[i, :len(t)] = list(t.encode()), 1
        out["inputs" + k], out["segment_ids" + k] = tok, seg
    return out


def test_a_batchs_own_matches_are_no_negatives():
    """A bug hunt (session 102): a d of the same text as the row's d, or the d of a pair
    whose q reads as the row's q, was trained as the row's negative (mining and its clash
    mask take both as positives). Each row's loss is as if that pair were not in the batch."""
    lord = "And the LORD spake unto Moses,"
    qs = [lord, "In the beginning", "Let there be", "God saw", lord, lord]
    ds = ["Speak unto the", "And the earth", "And it was so", "And the earth", "Command", "x"]
    labels = [1, 1, 1, 1, 1, 0]  # row 5 is not a pair: its d is no match of row 0's q
    batch = _text_batch(qs, ds, labels)
    pos = jnp.asarray(batch["label"] == 1)
    match = np.asarray(be.batch_matches(batch, pos))
    want = np.zeros((6, 6), bool)
    want[[1, 3], [3, 1]] = True  # one d text
    want[[0, 4], [4, 0]] = True  # one q text, both pairs positive
    want[5, [0, 4]] = True  # q_5 reads as q_0 and q_4, whose d match it (row 5 counts no loss)
    np.testing.assert_array_equal(match, want)
    rng = np.random.default_rng(7)
    q, d = _unit(rng, 6, 8), _unit(rng, 6, 8)
    d[3], q[4], q[5] = d[1], q[0], q[0]  # equal texts, equal vectors
    valid, T, none = np.ones(6, bool), 0.1, np.zeros((6, 6), bool)
    loss = jax.jit(be.in_batch_loss, static_argnames=("temperature", "symmetric"))  # 2 compiles
    s = q @ d.T / T
    for sym in (False, True):
        got = np.asarray(loss(q, d, valid, pos, T, symmetric=sym, match_BB=match))
        want = [_lse(s[i, ~match[i]], 0) - s[i, i] for i in range(6)]
        if sym:
            want = [0.5 * (w + _lse(s[~match[:, i], i], 0) - s[i, i]) for i, w in enumerate(want)]
        np.testing.assert_allclose(got, np.where(pos, want, 0.0), rtol=1e-5, atol=1e-6)
        # a pair's copies (rows 1 and 3), or one way a pair sharing the q (row 4 for row 0;
        # the d-side of q_0 also leaves out q_5): as if the other row were not in the batch
        for row, drop in ((1, 3), (3, 1)) + (() if sym else ((0, 4), (4, 0))):
            keep = np.arange(6) != drop
            alone = loss(q, d, keep, pos & keep, T, symmetric=sym, match_BB=none)
            np.testing.assert_allclose(got[row], alone[row], rtol=1e-5)
        if not sym:  # identical d texts: without the mask, neither row's loss goes below log 2
            unmasked = np.asarray(loss(q, d, valid, pos, T, symmetric=False, match_BB=none))
            assert (unmasked[[1, 3]] >= np.log(2) - 1e-6).all()
            assert (got[[1, 3]] < unmasked[[1, 3]]).all()
    # the triplet loss's hardest in-batch d is no match either
    got = np.asarray(be.triplet_loss(q, d, valid, pos, 0.3, match_BB=match))
    s = np.where(match | np.eye(6, dtype=bool), -np.inf, q @ d.T)
    want = np.maximum(0.0, 0.3 + s.max(1) - np.sum(q * d, 1)) * pos
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_model_leaves_a_batchs_copies_out_of_loss_and_accuracy():
    """The wiring (a bug hunt, session 102): two rows of one pair are each other's match, so
    each has only itself to rank (loss 0) and both count as correct (the later row was never
    counted: its argmax tied to the first). A bag model: one small compile."""
    from hpnlp import models
    cfg = validate(_cfg("local,bag"))
    lord = "And the LORD spake unto Moses, saying,"
    batch = _text_batch([lord, lord, "x"], ["Speak unto", "Speak unto", "y"], [1, 1, 1])
    batch["weight"][2] = 0.0  # a filler row
    model = models.build(cfg, deterministic=True)
    shapes = jax.eval_shape(model.init, jax.random.key(0), batch)  # one compile, the apply's
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), shapes)
    out = jax.jit(model.apply)(params, batch)
    assert float(out["correct"]) == float(out["weight"]) == 2.0
    assert abs(float(out["loss"])) < 1e-5


def test_triplet_loss_equals_its_formula():
    rng = np.random.default_rng(1)
    q, d, n = _unit(rng, 5, 4), _unit(rng, 5, 4), _unit(rng, 5, 4)
    valid = np.array([1, 1, 1, 1, 0], bool)
    nv = np.array([1, 0, 0, 1, 0], bool)
    m = 0.3
    got = be.triplet_loss(q, d, valid, valid, m, n_NE=n, n_valid_N=nv)
    s = q @ d.T
    want = np.zeros(5)
    for i in range(4):
        neg = q[i] @ n[i] if nv[i] else max(s[i, j] for j in range(4) if j != i)
        want[i] = max(0.0, m + neg - s[i, i])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batch_frequency_scaling_equals_pytorch_scale_grad_by_freq():
    rng = np.random.default_rng(2)
    V, E = 11, 4
    table = rng.normal(size=(V, E)).astype(np.float32)
    ids = np.array([[3, 3, 5, 0], [3, 7, 5, 10]], np.int32)
    up = rng.normal(size=ids.shape + (E,)).astype(np.float32)
    f = lambda t: jnp.sum(scaled_take(t, ids, batch_count_weights(ids, V)) * up)  # noqa: E731
    got = np.asarray(jax.grad(f)(jnp.asarray(table)))
    np.testing.assert_allclose(np.asarray(scaled_take(table, ids, jnp.ones(V))), table[ids])
    try:
        import torch
    except ImportError:  # the definition itself: each row's summed gradient / its count
        counts = np.bincount(ids.ravel(), minlength=V)
        want = np.zeros_like(table)
        np.add.at(want, ids.ravel(), up.reshape(-1, E))
        want /= np.maximum(counts, 1)[:, None]
    else:
        t = torch.tensor(table, requires_grad=True)
        out = torch.nn.functional.embedding(torch.tensor(ids, dtype=torch.long), t,
                                            scale_grad_by_freq=True)
        (out * torch.tensor(up)).sum().backward()
        want = t.grad.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_batch_frequency_counts_an_id_over_every_text_of_a_row():
    """Review r13 (README): since session 108 a row's texts are embedded in one call
    (`heads.encode_sides`), so model.embed_grad_scale='batch' divides an id's gradient by its
    count over q, d and the mined negatives together, not over its own side: the gradient
    under 'none' divided by that count. A bag model: the forward is the same under both."""
    import dataclasses

    from hpnlp import models
    batch = _text_batch(["abca", "bd"], ["cab", "aadb"], [1, 1])
    batch.update(inputs3=batch["inputs2"][::-1], segment_ids3=batch["segment_ids2"][::-1],
                 neg_weight=np.ones(2, np.float32))
    grads = []
    for scale in ("none", "batch"):
        cfg = validate(_cfg("local,bag"))
        model = models.build(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, embed_grad_scale=scale)), deterministic=True)
        shapes = jax.eval_shape(model.init, jax.random.key(0), batch)
        rng = np.random.default_rng(0)
        params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), shapes)
        g = jax.jit(jax.grad(lambda p: model.apply(p, batch)["loss"]))(params)
        grads.append(np.asarray(jax.tree.leaves(g["params"]["embed"])[0]))
    ids = np.concatenate([batch["inputs" + t][batch["segment_ids" + t] > 0] for t in "123"])
    count = np.bincount(ids, minlength=grads[0].shape[0])
    assert count[ord("a")] == 8 and np.abs(grads[0][ord("a")]).max() > 0
    np.testing.assert_allclose(grads[1], grads[0] / np.maximum(count, 1)[:, None], rtol=1e-5,
                               atol=1e-7)


def test_corpus_frequency_table():
    counts = np.array([0, 1, 10, 1000, 100_000])
    w = corpus_count_weights(counts, tokens_per_batch=1000)
    expected = counts * 1000 / counts.sum()  # an id's expected count in a batch
    np.testing.assert_allclose(w, 1.0 / np.maximum(expected, 1.0), rtol=1e-6)
    table = np.ones((5, 2), np.float32)
    ids = np.array([4, 4, 1])
    g = jax.grad(lambda t: scaled_take(t, ids, jnp.asarray(w)).sum())(jnp.asarray(table))
    np.testing.assert_allclose(np.asarray(g)[:, 0], [0, w[1], 0, 0, 2 * w[4]], rtol=1e-6)


def test_the_corpus_table_is_the_optimizer_steps_not_a_microbatchs():
    """A bug hunt (session 102): the "corpus" table was built from one microbatch's tokens,
    so train.grad_accum changed the update of the same batch (which accumulation must not);
    the table is the whole step's batch's, whatever grad_accum. Built only: nothing runs."""
    import dataclasses
    from hpnlp import models
    from hpnlp.config import ModelConfig, default_configdict
    counts = np.array([0, 1, 10, 1000, 100_000])
    base = from_configdict(default_configdict())
    tables = []
    for accum in (1, 4):
        cfg = dataclasses.replace(
            base, model=ModelConfig(kind="lm", vocab_size=5, embed_grad_scale="corpus"),
            train=dataclasses.replace(base.train, batch_size=8, grad_accum=accum),
            data=dataclasses.replace(base.data, seq_len=16))
        tables.append(models.build(cfg, deterministic=True, token_counts=counts)
                      .embed_weights.weights)
    np.testing.assert_array_equal(tables[0], tables[1])
    np.testing.assert_array_equal(tables[0], corpus_count_weights(counts, 8 * 16))


def test_the_corpus_table_counts_every_text_a_row_embeds():
    """Review r1: a pair model's row holds 2 texts (3 with mined negatives), each embedded,
    and the table counted 1, so its expected counts were 2-3x too low (the clip at 1 moved).
    Built only: nothing runs."""
    import dataclasses
    from hpnlp import models
    counts = np.array([0, 1, 10, 1000, 100_000] + [1] * 251)
    for args, kind, texts in (("local,bag", "bi_encoder", 2), ("local,bag,mine", "bi_encoder", 3),
                              ("local", "dual_encoder", 2)):
        cfg = _cfg(args, **{"model.vocab_size": 256})
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, kind=kind, embed_grad_scale="corpus",  # (a dual encoder's 2 classes)
            num_classes=2 if kind == "dual_encoder" else cfg.model.num_classes))
        B, L = cfg.train.batch_size, cfg.data.seq_len
        got = models.build(cfg, deterministic=True, token_counts=counts).embed_weights.weights
        np.testing.assert_array_equal(got, corpus_count_weights(counts, texts * B * L),
                                      err_msg=f"{args} {kind}")


# 2.8 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_mined_negatives_never_include_the_positive():
    rng = np.random.default_rng(3)
    P, L, E = 40, 6, 8
    tok = rng.integers(1, 50, size=(P, L)).astype(np.int32)
    tok[[5, 17, 30]] = tok[5]  # the same text under three numbers
    qtok = rng.integers(1, 50, size=(P, L)).astype(np.int32)
    qtok[[2, 9]] = qtok[2]  # one query opening two pairs: d_9 is q_2's match too
    seg = np.ones((P, L), np.int32)
    group, qgroup = mining.duplicate_groups(tok, seg), mining.duplicate_groups(qtok, seg)
    assert group[17] == group[30] == 5 and len(set(group)) == P - 2 and qgroup[9] == 2
    emb = jnp.asarray(_unit(rng, 64, E))

    def encode(params, t, s):  # a bag of random unit vectors: q_i nearest to its own d_i
        return be.normalize(jnp.sum(params[t] * (s > 0)[..., None], axis=1))
    rows = mining.QUERY_BLOCK
    pad = lambda a: np.pad(a, ((0, rows - P), (0, 0)))  # noqa: E731
    q_near = np.where(np.arange(P)[:, None] == 9, tok[2], tok)  # q_9 reads like d_2 ...
    q_near[2] = tok[9]  # ... and q_2 like d_9: without the query groups d_9 would be mined for q_2
    for depth in (1, 3, 50):
        neg = np.asarray(mining.mine(encode, emb, pad(q_near), pad(seg), pad(tok), pad(seg), group,
                                     qgroup, depth, jax.random.key(depth)))
        assert neg.shape == (P,) and (neg >= 0).all() and (neg < P).all()
        assert (group[neg] != group).all()  # never the positive, nor a copy of its text
        assert (qgroup[neg] != qgroup).all()  # nor the match of the same query text
        if depth == 1:  # the nearest non-positive, by brute force
            s = np.asarray(encode(emb, q_near, seg)) @ np.asarray(encode(emb, tok, seg)).T
            s[(group[None, :] == group[:, None]) | (qgroup[None, :] == qgroup[:, None])] = -np.inf
            np.testing.assert_array_equal(neg, s.argmax(1))
    z = jnp.zeros(2, jnp.int32)
    none = mining.pick_negatives(jnp.zeros((2, 3), jnp.int32), z, z, 2, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(none), [-1, -1])  # only positives found


def test_a_label_0_pairs_d_is_mined_and_clashes_as_a_negative(monkeypatch):
    """Review r13: mining took the d of every pair whose q reads as q_i for q_i's match, a
    label-0 pair's too, so the hardest negatives of a match task with label-0 rows were never
    mined, and masked (`neg_clash`) when mined for another row, while the same d in a batch
    stayed a negative (`batch_matches`). The carry's query groups are the positive pairs'
    only: pair 1 (label 0) opens with q_0's text and its d is q_0's nearest non-positive."""
    import types

    from hpnlp import data as data_lib
    from hpnlp.data.task import Examples, concat
    pairs = [("ab", "ab", 1), ("ab", "abz", 0), ("xy", "zzzz", 1), ("pq", "rst", 1),
             ("ab", "aab", 1)]  # pair 4: a positive of q_0's text, nearer than d_1
    tokens, starts, lengths = concat([np.frombuffer(t.encode(), np.uint8)
                                      for q, d, _ in pairs for t in (q, d)])
    ex = Examples(tokens, starts.reshape(-1, 2), lengths.reshape(-1, 2),
                  np.array([label for *_, label in pairs], np.int32))
    monkeypatch.setattr(data_lib, "make_task",
                        lambda cfg: types.SimpleNamespace(train=ex, token_counts=None))
    carry = mining.NegativesCarry(validate(_cfg("local,bag,mine")))
    emb = jnp.asarray(_unit(np.random.default_rng(5), 256, 16))

    def encode(params, t, s):  # a bag of random unit vectors
        return be.normalize(jnp.sum(params[t] * (s > 0)[..., None], axis=1))

    @jax.jit  # one compile each (eagerly, a hundred small ones)
    def run(q_tok, q_seg, d_tok, d_seg):
        return (encode(emb, q_tok[:1], q_seg[:1]) @ encode(emb, d_tok[:5], d_seg[:5]).T,
                mining.mine(encode, emb, q_tok, q_seg, d_tok, d_seg, carry.group,
                            carry.qgroup, 1, jax.random.key(0)))
    s, neg = run(carry.q_tok, carry.q_seg, carry.d_tok, carry.d_seg)
    assert list(np.argsort(-np.asarray(s[0]))[:3]) == [0, 4, 1]
    assert int(neg[0]) == 1
    # rows 0, 2, 3 of a batch holding the negatives mined for them: d_1, d_4, d_1
    got = jax.jit(carry.loss(None, lambda params, carry, batch, rngs: batch))(
        None, {"negatives": jnp.array([1, 0, 4, 1, 2])}, {"index": np.array([0, 2, 3])}, None)
    want = np.zeros((3, 3), bool)
    want[0, 1] = True  # d_4 is q_0's match (a positive pair of its q's text); d_1 is not
    np.testing.assert_array_equal(np.asarray(got["neg_clash"]), want)


def test_pool_metrics_ranks_exactly():
    rng = np.random.default_rng(4)
    q, d = _unit(rng, 30, 8), _unit(rng, 50, 8)
    got = be.pool_metrics(q, d, block=16)
    s = q @ d.T
    own = np.diag(s[:, :30])[:, None]
    lower = np.arange(50)[None, :] < np.arange(30)[:, None]
    rank = 1 + ((s > own) | ((s == own) & lower)).sum(1)  # the documented rank
    assert got["recall@1"] == pytest.approx(np.mean(rank <= 1))
    assert got["recall@10"] == pytest.approx(np.mean(rank <= 10))
    assert got["mrr"] == pytest.approx(np.mean(1 / rank)) and got["pool"] == 50
    assert be.pool_metrics(d[:30], d)["recall@1"] == 1.0
    twice = np.concatenate([d, d])  # every item twice: its copy has the higher id
    assert be.pool_metrics(d, twice) == {"recall@1": 1.0, "recall@10": 1.0, "mrr": 1.0, "pool": 100}
    same = np.ones((20, 8), np.float32) / np.sqrt(8)  # a collapsed encoder: ranked by id, at chance
    got = be.pool_metrics(same, same)
    assert got["recall@1"] == 1 / 20 and got["recall@10"] == 10 / 20
    # a review (session 114): a query or an item gone NaN ranked first (a NaN compares
    # false with everything): the query now ranks last, the item ahead of every other's own
    nan_q = d[:30].copy()
    nan_q[3] = np.nan
    got = be.pool_metrics(nan_q, d)
    assert got["recall@10"] == 29 / 30 and got["mrr"] == pytest.approx((29 + 1 / 50) / 30)
    nan_d = d.copy()
    nan_d[40] = np.nan
    assert be.pool_metrics(d[:30], nan_d)["recall@1"] == 0.0
    assert be.pool_metrics(d[:30], nan_d)["recall@10"] == 1.0


def test_verse_pairs_task():
    t = data.make_task(DataConfig(task="verse_pairs", seq_len=64))
    assert t.kind == "match" and (t.train.labels == 1).all() and len(t.eval) > 1000
    a, b = t.train.example(0)
    assert t.decode(a).startswith("In the beginning God") and t.decode(b).startswith("And the earth")
    assert t.token_counts.sum() == len(t.train.tokens)
    info = data.task_info(DataConfig(task="verse_pairs"))
    assert (info["kind"], info["vocab_size"]) == (t.kind, t.vocab_size)


def _cfg(args="local", **over):
    import importlib.util
    spec = importlib.util.spec_from_file_location("encoder_exp", os.path.join(
        os.path.dirname(__file__), "..", "experiments", "encoder.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cd = mod.get_config(args)
    cd.train.progress = False
    for k, v in over.items():
        group, field = k.split(".", 1)
        if "." in field:
            sub, field = field.split(".")
            cd[group][sub][field] = v
        else:
            cd[group][field] = v
    return from_configdict(cd)


@pytest.mark.parametrize("over, field", [
    ({"model.arch": "bag", "model.kind": "classifier", "data.task": "doc_classify"}, "model.arch"),
    ({"model.encoder.loss": "hinge"}, "model.encoder.loss"),
    ({"model.encoder.mine_every": -1}, "model.encoder.mine_every"),
    ({"model.embed_grad_scale": "inverse"}, "model.embed_grad_scale"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(_cfg(**over))


def test_a_resume_switching_mining_on_or_off_names_the_field(tmp_path):
    """A bug hunt (session 102): mining on or off adds or drops the `negatives` carry, and the
    restore refused every step as a layout naming no field ("move it aside"). Named from the
    saved config, so mining runs saved before (no such key in their shape signature) resume;
    review (session 102): as mining, not "a different model" to delete (from config.json
    alone: refused before Orbax reads the empty step)."""
    from hpnlp.config import to_json
    from hpnlp.train.checkpoint import (Checkpointer, CheckpointMismatch, _saved_differs,
                                        _shape_signature, other_model)
    plain, mine = _cfg("local,bag"), _cfg("local,bag,mine")
    assert other_model(plain, mine) == "model.encoder.mine_every: 0 and 10"
    assert other_model(mine, plain) == "model.encoder.mine_every: 10 and 0"
    assert other_model(mine, _cfg("local,bag,mine", **{"model.encoder.mine_every": 20})) == ""
    saved = {"shape_signature": _shape_signature(mine), "config": to_json(mine)}
    del saved["config"]["model"]["encoder"]["mine_every"]  # a run saved before the field: 0
    assert _saved_differs(saved, mine, _shape_signature(mine)) == {
        "model.encoder.mine_every": (0, 10)}
    os.makedirs(tmp_path / "checkpoints" / "1")
    for was, now, fix in ((plain, mine, r"off \(model.encoder.mine_every: saved 0, now 10\), "
                           r"whose train state lacks the mined negatives \(the model is the "
                           r"same\): resume it with model.encoder.mine_every = 0 as saved"),
                          (mine, plain, r"on \(model.encoder.mine_every: saved 10, now 0\), "
                           r"whose train state holds the mined negatives \(the model is the "
                           r"same\): resume it with model.encoder.mine_every > 0 as saved")):
        with open(tmp_path / "config.json", "w") as f:
            json.dump({"shape_signature": _shape_signature(was), "config": to_json(was)}, f)
        with pytest.raises(CheckpointMismatch, match=rf"^workdir {tmp_path} holds checkpoints "
                           rf"of a run trained with bi-encoder mining {fix}, or start a new "
                           rf"--workdir from its parameters with "
                           rf"--config.train.init_from={tmp_path}$"):
            Checkpointer(str(tmp_path), now, keep=1)


@pytest.mark.slow  # 9.4 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_encoder_trains_and_mines(tmp_path):
    """A tiny run with mining every 5 steps: the carry holds negatives that are never the
    positive (as restored from the checkpoint), and the held-out metrics beat the untrained
    encoder's."""
    from hpnlp.train.loop import Trainer
    cfg = _cfg("local,mine,bag,corpus_freq", **{"train.steps": 10, "model.encoder.mine_every": 5,
                                                 "train.checkpoint_every": 5, "train.eval_every": 10})
    wd = str(tmp_path / "run")
    tr = Trainer(cfg, wd)
    untrained = tr.evaluate(tr.fresh_state(jax.random.key(cfg.seed)))  # the run's first state
    summary = tr.run()
    assert summary["final_step"] == 10 and np.isfinite(summary["eval"]["loss"])
    assert {"recall@1", "recall@10", "mrr"} <= set(summary["eval"])  # the whole held-out pool
    state, _ = Trainer(cfg, wd, read_only=True).initial_state()
    neg = np.asarray(state.carry["negatives"])
    group = tr.carries[0].group
    assert (neg >= 0).all() and (group[neg] != group[np.arange(len(neg))]).all()
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    assert any(x.get("eval") for x in lines)
    model, params = tr.eval_model, jax.device_get(state.params)
    metrics = be.evaluate_pool(cfg, model, params, tr.task)
    assert set(metrics) == {"recall@1", "recall@10", "mrr", "pool", "pool_cosine"}
    assert 0 < metrics["mrr"] <= 1 and -1 <= metrics["pool_cosine"] <= 1
    assert metrics["mrr"] == pytest.approx(summary["eval"]["mrr"])
    # better than the untrained encoder, not than chance (review r1: a bag of byte embeddings
    # beats chance before any step, neighbouring verses sharing most bytes): the held-out
    # in-batch loss and the pool's recall@10 (60 -> 67 of 1,497 queries; its MRR moves only
    # after some hundred steps, docs/benchmarks/retrieval)
    assert untrained["recall@10"] > 10 / metrics["pool"]
    assert summary["eval"]["loss"] < untrained["loss"], (summary["eval"], untrained)
    assert summary["eval"]["recall@10"] > untrained["recall@10"], (summary["eval"], untrained)


# 3.4 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_moe_encoder_embeds_texts_in_whole_routing_groups():
    """Review r4: embed_texts encodes 256 rows at a time and embedding_dim traces 1, and
    with model.moe.groups=3 (valid: batches of 12) neither splits into the groups: refused by
    the MoE layer. Its rows are padded to whole groups now; with no choice dropped (eval
    capacity = X x a group's tokens) a text's vector is its own, whatever the call's rows."""
    import flax.linen as nn

    from hpnlp import models
    from hpnlp.train.loop import dummy_batch
    cfg = validate(_cfg("local", **{"model.moe.num_experts": 2, "model.moe.groups": 3,
                                     "train.batch_size": 12}))
    model = models.build(cfg, deterministic=True)
    L = cfg.data.seq_len
    params = jax.jit(lambda k: nn.unbox(model.init(k, dummy_batch("pair", 3, L))["params"]))(
        jax.random.key(0))
    assert be.embedding_dim(model, params) == cfg.model.width
    tok = np.random.default_rng(0).integers(1, 256, (5, L)).astype(np.int32)
    seg = (np.arange(L)[None] < np.array([[L], [3], [7], [L], [1]])).astype(np.int32)
    got = be.embed_texts(model, params, tok, seg, batch_size=2)  # 3 calls of 2 rows
    assert got.shape == (5, cfg.model.width)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got, be.embed_texts(model, params, tok, seg), atol=1e-5)


@pytest.mark.slow
def test_moe_encoder_trains_mines_and_evaluates_its_pool(tmp_path):
    """Review r4: model.moe.groups is checked against the train and eval batches only, and
    the Trainer's one-row init, mining (512 rows a pass) and the pool's evaluation (256) run
    the trunk on rows 3 groups do not split (nor their 16 tokens a row): the run died."""
    from hpnlp.train.loop import Trainer
    cfg = _cfg("local,mine", **{
        "model.moe.num_experts": 2, "model.moe.groups": 3, "train.batch_size": 6,
        "data.seq_len": 16, "model.max_len": 16, "train.steps": 2, "train.warmup_steps": 0,
        "train.eval_every": 2, "train.eval_batches": 1, "model.encoder.mine_every": 1,
        "train.checkpoint_every": 2})  # mining after step 1 (a 1-step run, which mines
    # none, is refused: a review, session 115)
    summary = Trainer(cfg, str(tmp_path / "run")).run()
    assert summary["final_step"] == 2 and 0 <= summary["eval"]["recall@1"] <= 1


@pytest.mark.parametrize("bidirectional", [False, True])
def test_text_search_takes_the_encoders_own_vector_width(bidirectional):
    """A bug hunt (session 96): TextSearch built its index of model.width, and a bidirectional
    LSTM's vectors (2 x width) were refused at the first add. Shapes only: nothing compiles."""
    from hpnlp import models
    from hpnlp.retrieval.encoder import TextSearch
    from hpnlp.train.loop import dummy_batch
    cfg = validate(_cfg("local,lstm", **{"rnn.bidirectional": bidirectional}))
    model = models.build(cfg, deterministic=True)
    batch = dummy_batch("pair", 2, cfg.data.seq_len)
    params = jax.eval_shape(model.init, jax.random.key(0), batch)["params"]
    want = cfg.model.width * (2 if bidirectional else 1)
    assert be.embedding_dim(model, params) == want
    assert TextSearch(cfg, model, params, None).index.dim == want
    empty = np.zeros((0, cfg.data.seq_len), np.int32)
    assert be.embed_texts(model, params, empty, empty).shape == (0, want)


# 2.8 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_a_performer_encoder_embeds_with_the_draw_it_trained_with(tmp_path, monkeypatch):
    """A review (session 106): the pool's evaluation, `python -m hpnlp.retrieval encoder` and
    TextSearch ran the encoder with no `features` key, so a Performer's (redrawn) features
    were its seed's draw, one it never trained with. They embed with the run's
    `state.features_key` now (its last train step's draw, not the next one's) and refuse to
    embed without it."""
    import types

    import flax.linen as nn

    from hpnlp import models
    from hpnlp.data.task import Examples
    from hpnlp.retrieval import RetrievalError, encoder
    from hpnlp.train.loop import dummy_batch
    from test_retrieval import fake_trained_run
    cfg = validate(_cfg("local", **{"attention.name": "performer",
                                     "attention.options": {"num_features": 16},
                                     "train.feature_redraw_every": 2}))
    model = models.build(cfg, deterministic=True)
    L = cfg.data.seq_len
    params = jax.jit(lambda k: nn.unbox(model.init(k, dummy_batch("pair", 2, L))["params"]))(
        jax.random.key(0))
    texts = ["In the beginning", "God created", "the heaven and the earth.", "And the earth",
             "was without form", "and void;"]
    encode_text = lambda t: np.frombuffer(t.encode(), np.uint8).astype(np.int32)  # noqa: E731
    ids = [encode_text(t) for t in texts]
    n = np.array([len(x) for x in ids])  # three pairs: texts 0 and 1, 2 and 3, 4 and 5
    pairs = Examples(np.concatenate(ids), (np.cumsum(n) - n).reshape(3, 2), n.reshape(3, 2),
                     np.ones(3, np.int32))
    task = types.SimpleNamespace(eval=pairs, train=pairs, name="tiny", encode=encode_text)
    state = fake_trained_run(monkeypatch, cfg, model, params, task)
    trained, other = state.features_key(2), state.train_features_key(2)
    tok, seg = np.zeros((len(ids), L), np.int32), np.zeros((len(ids), L), np.int32)
    for i, x in enumerate(ids):
        tok[i, :len(x)], seg[i, :len(x)] = x, 1
    direct = jax.jit(lambda p, t, s, key: model.apply({"params": p}, t, s, method="encode",
                                                      rngs={"features": key}))
    want, want_other = (np.asarray(direct(params, tok, seg, key)) for key in (trained, other))
    assert np.abs(want - want_other).max() > 1e-3
    np.testing.assert_allclose(be.embed_texts(model, params, tok, seg, features_key=trained),
                               want, atol=1e-5)
    search = encoder.TextSearch.from_run(str(tmp_path))
    np.testing.assert_allclose(search.embed(texts), want, atol=1e-5)
    metrics = be.evaluate_pool(cfg, model, params, task, features_key=trained)
    d = want[1::2].astype(np.float64)
    total = d.sum(0)
    assert metrics["pool_cosine"] == pytest.approx((total @ total - np.sum(d * d)) / 6, abs=1e-5)
    assert encoder.evaluate(str(tmp_path))["pool_cosine"] == metrics["pool_cosine"]
    assert be.BiEncoder.split_metrics(cfg, model, params, task, features_key=trained) == {
        k: metrics[k] for k in ("recall@1", "recall@10", "mrr")}
    no_key = (r"^attention.name='performer' draws its random features from the run's features "
              r"stream, so {} needs the draw it trained with: pass features_key=state\.")
    for call, what in ((lambda: be.embed_texts(model, params, tok, seg), "embedding texts"),
                       (lambda: be.evaluate_pool(cfg, model, params, task), "embedding texts"),
                       (lambda: encoder.TextSearch(cfg, model, params, encode_text),
                        "TextSearch")):
        with pytest.raises(RetrievalError, match=no_key.format(what)):
            call()


# 3.4 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_mining_encodes_with_the_draw_the_step_trained_with(monkeypatch):
    """A review (session 106): mining ran a Performer encoder with no `features` key, so its
    seed's draw, one it never trained with; the train step hands its carries the draw it
    trained with (`Carry.after_update`'s `features`), and mining embeds with it."""
    import flax.linen as nn

    from hpnlp.retrieval import RetrievalError, mining
    from hpnlp.train.loop import dummy_batch
    cfg = validate(_cfg("local,mine", **{
        "attention.name": "performer", "attention.options": {"num_features": 16},
        "train.feature_redraw_every": 2, "data.seq_len": 16, "model.max_len": 16,
        "model.encoder.mine_every": 1, "train.steps": 4, "train.warmup_steps": 0}))
    carry = mining.NegativesCarry(cfg)
    model = carry.encoder
    params = jax.jit(lambda k: nn.unbox(model.init(k, dummy_batch("pair", 2, 16))["params"]))(
        jax.random.key(0))
    seen = []
    monkeypatch.setattr(mining, "mine", lambda encode, *a, **k: seen.append(encode) or
                        jnp.full((carry.pairs,), -1, jnp.int32))
    tok, seg = jnp.asarray(carry.q_tok[:4]), jnp.asarray(carry.q_seg[:4])
    key, other = jax.random.key(5), jax.random.key(6)
    carry.after_update(carry.init(model, params, None, 2), params, None, jnp.asarray(0), key)
    direct = lambda k: model.apply({"params": params}, tok, seg, method="encode",  # noqa: E731
                                   rngs={"features": k})
    np.testing.assert_allclose(seen[-1](params, tok, seg), direct(key), atol=1e-6)
    assert np.abs(np.asarray(direct(key) - direct(other))).max() > 1e-3
    with pytest.raises(RetrievalError, match="mining hard negatives needs the draw"):
        carry.after_update(carry.init(model, params, None, 2), params, None, jnp.asarray(0))


# 2.8 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_mining_embeds_the_pool_with_the_weights_pruning_leaves(monkeypatch):
    """Review r10 (session 108): the carries' `after_update` ran mining before pruning, so a
    step that both pruned and mined mined with weights that pruning then zeroed (or, under
    imp, rewound); mining now reads the encoder that trains next, masked."""
    import flax.linen as nn
    import flax.traverse_util as traverse

    from hpnlp.train import carry as carry_lib
    from hpnlp.train.loop import dummy_batch
    cfg = validate(_cfg("local,mine", **{
        "model.encoder.mine_every": 1, "train.steps": 4, "train.warmup_steps": 0,
        "train.prune.method": "magnitude", "train.prune.sparsity": 0.5}))
    carries = carry_lib.for_config(cfg)
    assert [c.name for c in carries] == ["prune", "negatives"]
    model = carries[1].encoder
    batch = dummy_batch("pair", 2, cfg.data.seq_len)
    params = jax.jit(lambda k: nn.unbox(model.init(k, batch)["params"]))(jax.random.key(0))
    value = {c.name: c.start(nn.unbox(c.init(model, params, batch, 2)), params)
             for c in carries}
    seen = []
    monkeypatch.setattr(mining, "mine", lambda encode, p, *a, **k: seen.append(p) or
                        jnp.full((carries[1].pairs,), -1, jnp.int32))
    # step 0: the one-shot pruning (start_step 0) and a mining are both due
    params, value = carry_lib.after_update(carries, value, params, None, jnp.asarray(0))
    (mined,) = seen
    flat = traverse.flatten_dict(mined)
    masks = value["prune"]["masks"]
    assert masks and not all(np.all(np.asarray(m)) for m in masks.values())
    for k, m in masks.items():
        assert not np.any(np.asarray(flat[tuple(k.split("/"))])[~np.asarray(m)]), k


def test_a_mining_a_float16_step_skipped_happens_at_the_next_step_that_updates(monkeypatch):
    """Review r7: mining was due by the step number alone, and a float16 step that loss
    scaling skipped put the old negatives back, so a mining due at a skipped step was lost:
    with steps 0 and 1 skipped and mine_every 2, the pairs had no negative (all -1) until
    step 3. It is owed now, marked in the carry ([P] int32, the layout checkpoints saved
    before hold): the next step that updates mines, under its own weights, and the schedule
    goes on (step 3). An inf scale forces the overflows."""
    import flax.linen as nn

    from hpnlp.train.loop import dummy_batch
    from hpnlp.train.state import init_state, make_optimizer
    from hpnlp.train.step import make_train_step
    cfg = validate(_cfg("local,mine,bag", **{
        "model.dtype": "float16", "model.encoder.mine_every": 2, "train.steps": 6,
        "train.warmup_steps": 0}))
    carry = mining.NegativesCarry(cfg)
    model, tx, P = carry.encoder, make_optimizer(cfg.train), carry.pairs
    batch = dummy_batch("pair", 2, cfg.data.seq_len)
    batch["inputs1"][:, :3], batch["inputs2"][:, :3], batch["label"][:] = 5, 7, 1

    def fake_mine(params):  # negatives that tell which weights mined them
        leaf = jax.tree.leaves(params)[0]
        return ((jnp.arange(P) + (jnp.sum(jnp.abs(leaf)) * 1e3).astype(jnp.int32)) % P
                ).astype(jnp.int32)
    monkeypatch.setattr(mining, "mine", lambda encode, params, *a, **k: fake_mine(params))
    state = jax.jit(lambda k: nn.unbox(init_state(model, tx, k, batch, loss_scale=1.0,
                                                  carries=[carry], batch_size=2)))(
        jax.random.key(0))
    step = jax.jit(make_train_step(model, tx, cfg.train, [carry]))
    for i, scale in enumerate([np.inf, np.inf, 1.0, 1.0]):
        state, m = step(state.replace(loss_scale=jnp.float32(scale)), batch)
        value = state.carry["negatives"]
        assert value.shape == (P,) and value.dtype == jnp.int32
        assert float(m["skipped"]) == (i < 2)
        neg = np.asarray(mining.negatives_of(value))
        if i < 2:  # step 0 is not due; step 1 is, and owes its mining
            assert (neg == -1).all() and bool(mining.owed(value)) == (i == 1)
        else:  # step 2 mines what step 1 owed; step 3 is due by the schedule
            assert not mining.owed(value)
            np.testing.assert_array_equal(neg, fake_mine(state.params))
    loss = carry.loss(model, lambda params, carry, batch, rngs: batch)  # an owed carry's
    got = loss(None, {"negatives": mining.owe(jnp.array([2, -1, 0]))},  # negatives
               {"index": np.array([0, 1, 2, -1])}, None)
    np.testing.assert_array_equal(got["neg_weight"], [1, 0, 1, 0])


# about 30 s on the 2-core machine (a run and its export compile): CI's slow part runs it
@pytest.mark.slow
def test_quantize_reports_the_quantized_encoders_pool_metrics(tmp_path):
    """A bug hunt (session 110): `compress quantize` of a bi-encoder reported recall@1/10
    and MRR for the float model alone (`trainer.evaluate` adds them; the quantized side had
    the in-batch sums only). A static export: the pool's passes read the calibrated ranges."""
    from hpnlp.compress import ptq
    from hpnlp.compress.qlinear import QuantConfig
    from hpnlp.train.loop import Trainer
    cfg = _cfg("local", **{"train.steps": 1, "train.warmup_steps": 0, "train.eval_every": 1,
                           "train.eval_batches": 1, "train.checkpoint_every": 1,
                           "data.seq_len": 16, "model.max_len": 16, "model.moe.num_experts": 2})
    run = str(tmp_path / "run")
    Trainer(cfg, run).run()
    q = QuantConfig(weights="int8", activations="int8", act_scale="static", layers="qkv,out")
    # both pools in the routing groups the run's checkpoint routed in (a review, session 118:
    # the quantized pool routed in this mesh's): here as if it had saved 2
    real, groups = be.BiEncoder.split_metrics, []

    def split_metrics(cfg, model, params, task, *, features_key=None):
        groups.append(model.cfg.model.moe.groups)
        return real(cfg, model, params, task, features_key=features_key)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(be.BiEncoder, "split_metrics", staticmethod(split_metrics))
        m.setattr(Trainer, "split_groups", lambda self, step: 2)
        s = ptq.quantize(run, str(tmp_path / "q"), q, calib_batches=1, eval_batches=1, repeats=1)
    assert groups == [2, 2]
    got, want = s["eval"]["quantized"], s["eval"]["float32"]
    assert set(got) == set(want) >= {"recall@1", "recall@10", "mrr"}
    assert 0 < got["mrr"] <= 1 and got["mrr"] == pytest.approx(want["mrr"], rel=0.2)


# 2.7 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_the_trainer_evaluates_the_pool_with_the_draw_it_trained_with(tmp_path, monkeypatch):
    """The Trainer's evaluation hands the pool's metrics `state.features_key` (a review,
    session 106: it embedded a Performer encoder's pool with its seed's draw)."""
    from hpnlp.train.loop import Trainer
    cfg = validate(_cfg("local", **{
        "attention.name": "performer", "attention.options": {"num_features": 16},
        "train.feature_redraw_every": 2, "data.seq_len": 16, "model.max_len": 16,
        "train.steps": 4, "train.warmup_steps": 0, "train.eval_batches": 1}))
    seen = []
    monkeypatch.setattr(be.BiEncoder, "split_metrics", staticmethod(
        lambda cfg, model, params, task, *, features_key=None: seen.append(features_key) or {}))
    tr = Trainer(cfg, str(tmp_path / "run"))
    state, _ = tr.initial_state()
    state = state.replace(step=jnp.asarray(5, state.step.dtype))  # draw 2 trained step 5
    tr.evaluate(state)
    np.testing.assert_array_equal(jax.random.key_data(seen[-1]),
                                  jax.random.key_data(state.features_key(2)))


def test_every_side_is_encoded_with_one_draw_of_random_features():
    """Review r1: the shared trunk ran once per side, and flax's make_rng counter gave each
    call of it another Performer draw, so the same text on both sides got two vectors, and
    the pool's evaluation and mining (`encode` alone: the first draw) embedded the d side
    with a draw it never trained with. All sides go through one call now: the same text
    gives the same vector on every side (the negatives seq_len wide beside narrower sides,
    as a bucket's), and it is `encode`'s."""
    import flax.linen as nn

    from hpnlp import models
    cfg = validate(_cfg("local", **{"attention.name": "performer",
                                     "attention.options": {"num_features": 16}}))
    model = models.build(cfg, deterministic=True)
    L, W = cfg.data.seq_len, cfg.data.seq_len // 2
    rng = np.random.default_rng(0)
    tok = rng.integers(1, 256, (3, W)).astype(np.int32)
    seg = (np.arange(W)[None] < np.array([[W], [5], [9]])).astype(np.int32)
    wide = lambda a: np.pad(a, ((0, 0), (0, L - W)))  # noqa: E731
    batch = {"inputs1": tok, "segment_ids1": seg, "inputs2": tok, "segment_ids2": seg,
             "inputs3": wide(tok), "segment_ids3": wide(seg), "label": np.ones(3, np.int32),
             "weight": np.ones(3, np.float32), "neg_weight": np.ones(3, np.float32)}
    params = jax.jit(lambda k: nn.unbox(model.init(k, batch)["params"]))(jax.random.key(0))
    rngs = {"features": jax.random.key(3)}
    q, d, _, _, neg = jax.jit(lambda p: model.apply({"params": p}, batch, method="_sides",
                                                    rngs=rngs))(params)
    np.testing.assert_array_equal(q, d)
    np.testing.assert_allclose(neg["n_NE"], q, atol=1e-6)
    alone = jax.jit(lambda p: model.apply({"params": p}, wide(tok), wide(seg), method="encode",
                                          rngs=rngs))(params)
    np.testing.assert_allclose(q, alone, atol=1e-5)


def test_an_moe_encoder_reports_each_layer_once_over_every_side():
    """All sides in one trunk call (above): each MoE layer reports once a step, its
    statistics over every side's tokens, its auxiliary loss one per-token mean (two calls
    summed two). Shapes only: nothing compiles."""
    from hpnlp import models
    from hpnlp.train.carry import AUX
    from hpnlp.train.loop import dummy_batch
    cfg = validate(_cfg("local", **{"model.moe.num_experts": 2}))
    model = models.build(cfg, deterministic=True)
    batch = dummy_batch("pair", 4, cfg.data.seq_len)
    params = jax.eval_shape(model.init, jax.random.key(0), batch)["params"]
    _, aux = jax.eval_shape(lambda p: model.apply({"params": p}, batch, mutable=[AUX]), params)
    reports = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(aux[AUX])[0]
               if str(path[-1].key) == "moe_tokens"]
    assert len(reports) == cfg.model.depth, reports


# 2.8 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_pool_and_mining_passes_split_into_the_pipelines_microbatches(monkeypatch):
    """Review r3: the pool's evaluation (256 rows a call) and mining (512) sent a pipelined
    trunk batches that mesh.pipeline_microbatches=6 does not split (validate checks the train
    and eval batches), and the run died at its first eval, every resume again. Their passes
    are rounded up to whole microbatches where a pipeline runs the trunk; the same vectors
    and negatives. On an abstract pipeline mesh, with stand-in encoders: nothing compiles."""
    from jax.sharding import AbstractMesh

    from hpnlp import models
    from hpnlp.parallel.pipeline import use_microbatches
    rows = []

    def encode(params, t, s):  # a bag of random unit vectors, as a pipelined trunk splits
        rows.append(t.shape[0])
        return be.normalize(jnp.sum(params[t] * (s > 0)[..., None], axis=1))
    rng = np.random.default_rng(0)
    P, L = 300, 4
    emb = jnp.asarray(_unit(rng, 64, 8))
    tok = rng.integers(1, 64, (P, L)).astype(np.int32)
    seg = np.ones((P, L), np.int32)
    group = mining.duplicate_groups(tok, seg)
    model = models.build(validate(_cfg("local,bag")), deterministic=True)
    monkeypatch.setattr(be, "_encoder", lambda model: lambda p, t, s, rngs: encode(emb, t, s))
    pad = lambda a: np.pad(a, ((0, mining.QUERY_BLOCK - P), (0, 0)))  # noqa: E731 (as the carry)
    args = (encode, emb, pad(tok), pad(seg), pad(tok), pad(seg), group, group, 2,
            jax.random.key(0))
    want = [be.embed_texts(model, None, tok, seg), mining.mine(*args)]
    rows.clear()
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 3), ("pipeline", "data"))):
        with use_microbatches(6):
            got = [be.embed_texts(model, None, tok, seg), mining.mine(*args)]
        assert rows == [258] * 2 + [516] * 2, rows  # 2 pool calls; mining's map traces a side once
        assert be.whole_microbatches(256) == 256  # unset: M = the stages, 2
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])
