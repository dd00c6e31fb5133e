"""Models: shapes, finiteness, causality, padding invariance, decoding, dtypes, remat."""

import dataclasses
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import (AttentionConfig, ModelConfig, OutputConfig, QuantConfig, default_configdict,
                          from_configdict)
from hpnlp.models.transformer import Trunk, positions_of

B, L, V = 2, 16, 40


def make_cfg(kind="lm", attention="dense", **model_kw):
    cfg = from_configdict(default_configdict())
    model = dict(kind=kind, vocab_size=V, num_classes=3, width=32, depth=2, num_heads=4,
                 mlp_dim=64, max_len=L, dropout=0.0)
    model.update(model_kw)
    opts = {"block_q": 8, "block_k": 8} if attention == "chunked" else {}
    return dataclasses.replace(cfg, model=ModelConfig(**model),
                               attention=AttentionConfig(attention, opts))


def lm_batch(lengths=(L, 11), seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, (B, L)).astype(np.int32)
    seg = (np.arange(L)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return {"inputs": toks, "targets": np.roll(toks, -1, 1), "segment_ids": seg,
            "positions": np.asarray(positions_of(seg))}


def cls_batch(lengths=(L, 9), seed=0):
    b = lm_batch(lengths, seed)
    return {"inputs": b["inputs"], "segment_ids": b["segment_ids"],
            "label": np.array([0, 2], np.int32), "weight": np.ones(B, np.float32)}


def match_batch():
    a, b = cls_batch(seed=0), cls_batch((7, L), seed=1)
    return {"inputs1": a["inputs"], "segment_ids1": a["segment_ids"], "inputs2": b["inputs"],
            "segment_ids2": b["segment_ids"], "label": a["label"] % 2, "weight": a["weight"]}


BATCHES = {"lm": lm_batch, "classifier": cls_batch, "dual_encoder": match_batch}


def init(cfg, batch):
    model = models.build(cfg, deterministic=True)
    # jitted: an eager init runs the model op by op, compiling every primitive separately
    return model, jax.jit(lambda key: nn.unbox(model.init(key, batch)["params"]))(jax.random.key(0))


# Every model kind with the reference attention; the other two in the causal LM and the
# padded classifier (every variant runs inside the models in its own test file too).
@pytest.mark.parametrize("kind,attention", [(k, "dense") for k in sorted(BATCHES)] + [
    ("lm", "xla"), ("classifier", "xla"), ("lm", "chunked"), ("classifier", "chunked")])
def test_sums_shapes_and_finite(kind, attention):
    cfg = make_cfg(kind, attention)
    batch = BATCHES[kind]()
    model, params = init(cfg, batch)
    def loss_and_sums(p):
        sums = model.apply({"params": p}, batch)
        return sums["loss"], sums
    (_, sums), grads = jax.jit(jax.value_and_grad(loss_and_sums, has_aux=True))(params)
    chex.assert_tree_all_finite(sums)
    chex.assert_shape(list(sums.values()), ())
    expected_weight = batch["segment_ids"].sum() if kind == "lm" else B
    assert float(sums["weight"]) == expected_weight
    chex.assert_trees_all_equal_shapes(grads, params)
    chex.assert_tree_all_finite(grads)


def test_a_dual_encoder_encodes_both_texts_with_one_draw_of_random_features():
    """Review r1: the shared trunk ran once per text, and flax's make_rng counter gave each
    call of it another Performer draw: the same text on both sides got two vectors. One
    trunk call for both now: equal, and `encode`'s own."""
    cfg = dataclasses.replace(make_cfg("dual_encoder", depth=1),
                              attention=AttentionConfig("performer", {"num_features": 16}))
    batch = match_batch()
    batch.update(inputs2=batch["inputs1"], segment_ids2=batch["segment_ids1"])
    model, params = init(cfg, batch)
    rngs = {"features": jax.random.key(3)}
    u, v = jax.jit(lambda p: model.apply({"params": p}, batch, method="sides", rngs=rngs))(params)
    np.testing.assert_array_equal(u, v)
    alone = jax.jit(lambda p: model.apply({"params": p}, batch["inputs1"], batch["segment_ids1"],
                                          method="encode", rngs=rngs))(params)
    np.testing.assert_allclose(u, alone, atol=1e-5)


def test_batch_frequency_gradients_do_not_count_padding():
    """A review (session 103): embed_grad_scale='batch' counted padded slots, which hold id 0,
    so the amount of padding after a row scaled the gradient of id 0's row (word_lm's and the
    subword vocabularies' most frequent token). The same rows padded 3 slots further: equal."""
    cfg = make_cfg("lm", embed_grad_scale="batch", depth=1, max_len=L + 3)
    batch = lm_batch((L, 11))
    batch["inputs"][:, :4] = 0  # id 0 among the real tokens
    wide = {k: np.pad(v, ((0, 0), (0, 3))) for k, v in batch.items()}  # padding: id 0, seg 0
    model, params = init(cfg, wide)
    grad = jax.jit(jax.grad(lambda p, b: model.apply({"params": p}, b)["loss"]))
    np.testing.assert_allclose(grad(params, wide)["embed"]["embedding"],
                               grad(params, batch)["embed"]["embedding"], rtol=1e-5, atol=2e-6)


# 2.9 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, session 109, --durations:
# the suite read 6 min 12 s for 1775 tests in CI): CI's slow part runs it
@pytest.mark.slow
def test_evaluate_refuses_targets_and_labels_out_of_range():
    # their gathers read an id past the vocabulary or classes as NaN (the LM's loss refused it)
    cfg = make_cfg("lm")
    batch = lm_batch()
    model, params = init(cfg, batch)
    bad = dict(batch, targets=np.where(np.arange(L) == 3, V, batch["targets"]).astype(np.int32))
    with pytest.raises(ValueError, match=f"target id {V} is outside the vocabulary"):
        model.apply({"params": params}, bad, method="evaluate")
    # Transformer-XL's too (a review, session 114: NaN, said nowhere)
    model, params = init(make_cfg("lm", arch="transformer_xl"), batch)
    with pytest.raises(ValueError, match=f"target id {V} is outside the vocabulary"):
        model.apply({"params": params}, bad, method="evaluate")
    cfg = make_cfg("classifier")
    batch = cls_batch()
    model, params = init(cfg, batch)
    bad = dict(batch, label=np.array([0, 3], np.int32))
    for method in ("__call__", "evaluate"):
        with pytest.raises(ValueError, match=r"label 3 is outside the classes \[0, 3\)"):
            model.apply({"params": params}, bad, method=method)


class _Identity(nn.Module):
    """Stands in for the embedding so gradients can flow to per-position inputs."""

    def __call__(self, x):
        return x


@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_lm_causality_by_gradient(attention):
    cfg = make_cfg("lm", attention)
    trunk = Trunk(cfg.model, cfg.attention, causal=True)
    x = jax.random.normal(jax.random.key(0), (B, L, cfg.model.width))
    seg = jnp.ones((B, L), jnp.int32)
    params = jax.jit(lambda k: trunk.init(k, _Identity(), x, seg, positions_of(seg)))(jax.random.key(1))
    t = 6
    g = jax.jit(jax.grad(lambda x: jnp.sum(trunk.apply(params, _Identity(), x, seg, positions_of(seg))[:, t])))(x)
    assert float(jnp.abs(g[:, t + 1:]).max()) == 0.0
    assert float(jnp.abs(g[:, : t + 1]).max()) > 0.0


def assert_padding_tokens_change_nothing(cfg, kind):
    """Changing the tokens (and LM targets) under padding leaves every sum unchanged."""
    batch = BATCHES[kind]()
    model, params = init(cfg, batch)
    other = dict(batch)
    pad = batch["segment_ids"] == 0
    other["inputs"] = np.where(pad, (batch["inputs"] + 7) % V, batch["inputs"])
    if kind == "lm":
        other["targets"] = np.where(pad, (batch["targets"] + 3) % V, batch["targets"])
    apply = jax.jit(model.apply)
    chex.assert_trees_all_close(apply({"params": params}, batch), apply({"params": params}, other),
                                atol=1e-5)


@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_padding_tokens_change_nothing(kind):
    assert_padding_tokens_change_nothing(make_cfg(kind), kind)


@pytest.mark.parametrize("tie", [False, True])
def test_decode_matches_forward_and_greedy_generation(tie):
    cfg = make_cfg("lm")
    cfg = dataclasses.replace(cfg, output=OutputConfig("full", tie_embeddings=tie))
    batch = lm_batch(lengths=(L, L))
    model, params = init(cfg, batch)
    log_probs = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))
    full = log_probs(params, batch)
    dec = models.build(cfg, deterministic=True, decode=True)
    cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])(
        jnp.zeros((B, 1), jnp.int32))  # jitted: one compile, not one per primitive
    step = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok, method="decode_step",
                                              mutable=["cache"]))
    steps = []
    for t in range(L):
        lp, upd = step(params, cache, batch["inputs"][:, t:t + 1])
        cache = upd["cache"]
        steps.append(lp)
    np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5)
    # K tokens in one call (speculative decoding's verification), after 5 single steps
    many = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok,
                                               method="decode_tokens", mutable=["cache"]))
    cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])(
        jnp.zeros((B, 1), jnp.int32))
    for t in range(5):
        cache = step(params, cache, batch["inputs"][:, t:t + 1])[1]["cache"]
    lp, upd = many(params, cache, batch["inputs"][:, 5:12])
    np.testing.assert_allclose(lp, full[:, 5:12], atol=2e-5)
    assert int(upd["cache"]["position"]) == 12

    prompt = batch["inputs"][:, :4]
    out = models.generate(cfg, params, prompt, jnp.array([4, 4]), length=10)
    np.testing.assert_array_equal(out[:, :4], prompt)
    # Greedy: each generated token is the argmax of the full forward pass on the prefix.
    for t in range(4, 10):
        b = lm_batch(lengths=(L, L))
        b["inputs"] = np.zeros((B, L), np.int32)
        b["inputs"][:, :t] = np.asarray(out[:, :t])
        lp = log_probs(params, b)
        np.testing.assert_array_equal(out[:, t], jnp.argmax(lp[:, t - 1], -1))


def _gqa_as_mha(params, H, G):
    """The multi-head parameters that compute what grouped-query `params` compute: each block's
    q and kv stacked into qkv, every key/value head repeated for its H / G query heads."""
    def fix(tree):
        if isinstance(tree, dict) and "q" in tree and "kv" in tree:
            rep = lambda x: jnp.repeat(x, H // G, axis=1)  # noqa: E731  [E, G, D] -> [E, H, D]
            qkv = jnp.stack([tree["q"], rep(tree["kv"][:, 0]), rep(tree["kv"][:, 1])], 1)
            return {**{k: v for k, v in tree.items() if k not in ("q", "kv")}, "qkv": qkv}
        return {k: fix(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
    return fix(params)


@pytest.mark.slow  # 8.8 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_grouped_query_attention_is_multi_head_with_shared_key_value_heads():
    """num_kv_heads=G: the LM computes what the multi-head LM computes with each key/value
    head repeated (loss and gradients: a shared head's gradient is its query heads' sum), its
    decoding (the exact cache of G heads; `sparse`'s own cache of repeated heads) matches its
    forward pass, and `chunked` trains the same values as `dense`. (G = 1, multi-query: the
    decoding kernel's own test.)"""
    H, G = 4, 2
    cfg = make_cfg("lm", num_kv_heads=G)
    batch = lm_batch()
    model, params = init(cfg, batch)
    att = params["trunk"]["block_0"]["attention"]
    assert "qkv" not in att and att["q"].shape == (32, H, 8) and att["kv"].shape == (32, 2, G, 8)
    mha_model, _ = init(make_cfg("lm"), batch)
    mha = _gqa_as_mha(params, H, G)
    loss = lambda m: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p: m.apply({"params": p}, batch)["loss"]))
    (l_g, g_g), (l_m, g_m) = loss(model)(params), loss(mha_model)(mha)
    np.testing.assert_allclose(l_g, l_m, rtol=1e-6)
    g_att, m_att = g_g["trunk"]["block_0"]["attention"], g_m["trunk"]["block_0"]["attention"]
    np.testing.assert_allclose(g_att["q"], m_att["qkv"][:, 0], rtol=1e-5, atol=1e-5)
    summed = m_att["qkv"][:, 1:].reshape(32, 2, G, H // G, 8).sum(3)
    np.testing.assert_allclose(g_att["kv"], summed, rtol=1e-5, atol=1e-5)
    chunked, _ = init(make_cfg("lm", attention="chunked", num_kv_heads=G), batch)
    np.testing.assert_allclose(loss(chunked)(params)[0], l_g, rtol=1e-5)

    batch = lm_batch(lengths=(L, L))  # decoding sees no padding: compare whole rows
    full = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))(params, batch)
    for attention in ("dense", "sliding_window"):
        c = make_cfg("lm", attention=attention, num_kv_heads=G)
        if attention == "sliding_window":  # a window of every key: exact, its own ring cache
            c = dataclasses.replace(c, attention=AttentionConfig(attention, {"block_size": 8,
                                                                             "window": L}))
        dec = models.build(c, deterministic=True, decode=True)
        cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])(
            jnp.zeros((B, 1), jnp.int32))
        k_cache = jax.tree.leaves(cache["trunk"]["block_0"]["attention"])
        assert any(x.ndim == 4 and x.shape[2] == (G if attention == "dense" else H) for x in k_cache)
        step = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok,
                                                  method="decode_step", mutable=["cache"]))
        steps = []
        for t in range(L):
            lp, upd = step(params, cache, batch["inputs"][:, t:t + 1])
            cache = upd["cache"]
            steps.append(lp)
        np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5, err_msg=attention)


def test_rotary_is_a_rotation_that_sees_only_relative_positions():
    """RoPE keeps every head's norm, leaves position 0 as is, and q_m . k_n depends on m - n
    only: shifting both positions by the same amount changes no dot product."""
    from hpnlp.models.transformer import rotary
    q, k = jax.random.normal(jax.random.key(0), (2, 1, L, 3, 8))
    pos = jnp.asarray(np.arange(L)[None] * 7, jnp.int32)  # angles past 2 pi too
    rq, rk = rotary(q, pos), rotary(k, pos)
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(rotary(q, jnp.zeros_like(pos)), q)
    dots = lambda a, b: jnp.einsum("blhd,bshd->bhls", a, b)  # noqa: E731
    shift = 1000 + pos  # every position moved by 1000
    np.testing.assert_allclose(dots(rotary(q, shift), rotary(k, shift)), dots(rq, rk), atol=2e-4)
    # ...and it is not the identity: rotated dots differ from the plain ones
    assert float(jnp.max(jnp.abs(dots(rq, rk) - dots(q, k)))) > 1e-2
    # same m - n from other pairs: query at 5 against key at 2 == query at 9 against key at 6
    one = lambda x, p: rotary(x[:, :1], jnp.full((1, 1), p, jnp.int32))  # noqa: E731
    np.testing.assert_allclose(dots(one(q, 5), one(k, 2)), dots(one(q, 9), one(k, 6)), atol=1e-5)


def _decoder(cfg):
    dec = models.build(cfg, deterministic=True, decode=True)
    cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])(
        jnp.zeros((B, 1), jnp.int32))
    many = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok,
                                               method="decode_tokens", mutable=["cache"]))
    return cache, many


# 0-dense: 8.0 s in the suite on the 2-core Zen 3 (2026-12-02); CI's slow part runs it (the
# grouped heads' dense and sliding-window cases stay). 2-dense: 7.5 s; a fresh clone's .ci/run
# of 07fb7bc read the README's command at 10 min 0.9 s: CI's slow part runs it too (the
# grouped heads' sliding-window case stays)
@pytest.mark.parametrize("kv_heads,attention", [pytest.param(0, "dense", marks=pytest.mark.slow),
                                                pytest.param(2, "dense", marks=pytest.mark.slow),
                                                (2, "sliding_window")])
def test_rope_lm_decodes_like_its_forward_pass(kv_heads, attention):
    """pos_emb='rope': token-by-token decoding, K tokens a call (prefill), rows at positions of
    their own (speculative decoding's rewind) and generate's prefill all match the forward
    pass; with grouped key/value heads (the exact cache keeps G rotated heads) and with a
    variant's own cache (sliding_window's ring of repeated heads)."""
    cfg = make_cfg("lm", pos_emb="rope", num_kv_heads=kv_heads)
    if attention == "sliding_window":  # a window of every key: exact, its own ring cache
        cfg = dataclasses.replace(cfg, attention=AttentionConfig(attention, {"block_size": 8,
                                                                             "window": L}))
    batch = lm_batch(lengths=(L, L))
    model, params = init(cfg, batch)
    assert "pos_embedding" not in params["trunk"]
    assert_decodes_like_forward(cfg, model, params, batch, exact=attention == "dense")


def assert_decodes_like_forward(cfg, model, params, batch, *, exact: bool):
    """One token a step matches the forward pass's log-probs; with the exact key/value cache
    (`exact`: several tokens a call) so do a prefill, rows rewound to positions of their own
    (speculative decoding) and generate with its prefill against one token a step."""
    from hpnlp.models.speculative import rewind
    full = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))(params, batch)
    cache0, many = _decoder(cfg)
    cache, steps = cache0, []
    for t in range(L):
        lp, upd = many(params, cache, batch["inputs"][:, t:t + 1])
        cache = upd["cache"]
        steps.append(lp[:, 0])
    np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5)
    if not exact:
        return
    lp, upd = many(params, cache0, batch["inputs"][:, :10])  # prefill
    np.testing.assert_allclose(lp, full[:, :10], atol=2e-5)
    # rows rewound to positions of their own, then 4 tokens each from there
    start = jnp.asarray([3, 6], jnp.int32)
    toks = jnp.stack([batch["inputs"][0, 3:7], batch["inputs"][1, 6:10]])
    lp, _ = many(params, rewind(upd["cache"], start), toks)
    np.testing.assert_allclose(lp[0], full[0, 3:7], atol=2e-5)
    np.testing.assert_allclose(lp[1], full[1, 6:10], atol=2e-5)
    prompt = batch["inputs"][:, :5]  # generate with the prefill == one token a step
    np.testing.assert_array_equal(models.generate(cfg, params, prompt, length=12),
                                  models.generate(cfg, params, prompt, jnp.array([5, 5]), length=12))


@pytest.mark.parametrize("attention", ["dense", "chunked"])
def test_rope_packed_segments_equal_separate_rows(attention):
    """Under packing each segment's positions restart at 0 (`pos_BL`), so with rope a row
    packing two sequences gives each the log-probs it gets alone in its own row."""
    cfg = make_cfg("lm", attention, pos_emb="rope")
    a, b = 7, 9  # two sequences filling one row of L = 16
    toks = np.asarray(lm_batch()["inputs"])
    packed_seg = np.asarray([[1] * a + [2] * b] * B, np.int32)
    packed = {"inputs": np.stack([np.concatenate([toks[0, :a], toks[1, :b]])] * B),
              "segment_ids": packed_seg, "positions": np.tile(np.r_[np.arange(a), np.arange(b)], (B, 1)).astype(np.int32)}
    alone_seg = (np.arange(L)[None] < np.asarray([[a], [b]])).astype(np.int32)
    alone = {"inputs": np.stack([np.pad(toks[0, :a], (0, L - a)), np.pad(toks[1, :b], (0, L - b))]),
             "segment_ids": alone_seg, "positions": np.asarray(positions_of(alone_seg))}
    for bt in (packed, alone):
        bt["targets"] = bt["inputs"]
    model, params = init(cfg, packed)
    log_probs = jax.jit(lambda b: model.apply({"params": params}, b, method="log_probs"))
    lp_packed, lp_alone = log_probs(packed), log_probs(alone)
    np.testing.assert_allclose(lp_packed[0, :a], lp_alone[0, :a], atol=2e-5)
    np.testing.assert_allclose(lp_packed[0, a:], lp_alone[1, :b], atol=2e-5)


def test_sinusoidal_and_rope_run_past_max_len():
    """Rows longer than model.max_len (which config allows for both): the same log-probs as
    with a table long enough (the sinusoidal table once read NaN past max_len; rope computes
    its angles from the positions, and a table of max_len rows would read NaN here too)."""
    batch = lm_batch()
    for pos_emb in ("sinusoidal", "rope"):
        model, params = init(make_cfg("lm", pos_emb=pos_emb), batch)
        short = models.build(make_cfg("lm", pos_emb=pos_emb, max_len=L // 2), deterministic=True)
        want, got = (jax.jit(lambda b, m=m: m.apply({"params": params}, b, method="log_probs"))(batch)
                     for m in (model, short))
        np.testing.assert_allclose(got, want, atol=1e-6)


# 6.3, 7.5, 5.6 and 7.1 s in four suites on the 2-core Zen 3 (2026-12-01), the README's command
# over 10 min there from an empty kernel cache: CI's slow part runs it
@pytest.mark.slow
def test_int8_kv_cache_decodes_what_the_forward_pass_computes():
    """quant.kv_cache='int8' (grouped heads): the cache holds int8 codes and a scale per
    position and head; decoding one token a step, and a prefill of every token in one call,
    compute the forward pass with the same setting (keys and values fake-quantized per
    position and head), which is near the float model's; greedy generation runs through it."""
    G = 2
    cfg = make_cfg("lm", num_kv_heads=G, quant=QuantConfig(kv_cache="int8"))
    batch = lm_batch(lengths=(L, L))
    model, params = init(cfg, batch)
    log_probs = lambda c: jax.jit(lambda p, b: models.build(c, deterministic=True).apply(  # noqa: E731
        {"params": p}, b, method="log_probs"))
    full = log_probs(cfg)(params, batch)
    err = float(jnp.max(jnp.abs(full - log_probs(make_cfg("lm", num_kv_heads=G))(params, batch))))
    assert 0 < err < 0.05, err  # quantized: near the float model, not equal
    dec = models.build(cfg, deterministic=True, decode=True)
    new_cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])
    cache = new_cache(jnp.zeros((B, 1), jnp.int32))
    att = cache["trunk"]["block_0"]["attention"]["state"]
    assert att["k"].dtype == jnp.int8 and att["k"].shape == (B, L, G, 8)
    assert att["v_scale"].shape == (B, L, G)
    run = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok,
                                              method="decode_tokens", mutable=["cache"]))
    steps = []
    for t in range(L):
        lp, upd = run(params, cache, batch["inputs"][:, t:t + 1])
        cache = upd["cache"]
        steps.append(lp)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-5)
    prefill, _ = run(params, new_cache(jnp.zeros((B, 1), jnp.int32)), batch["inputs"])
    np.testing.assert_allclose(prefill, full, atol=2e-5)
    out = models.generate(cfg, params, batch["inputs"][:, :4], length=10)
    assert out.shape == (B, 10)


def test_tied_embeddings_drop_the_output_matrix():
    batch = lm_batch()
    _, untied = init(make_cfg("lm"), batch)
    cfg = dataclasses.replace(make_cfg("lm"), output=OutputConfig("full", tie_embeddings=True))
    _, tied = init(cfg, batch)
    assert models.param_count(untied) - models.param_count(tied) == V * 32


def bf16_dots(hlo):
    """How many dot_generals of a lowered program multiply two bfloat16 operands."""
    return len(re.findall(r"dot_general.*: \(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>\)", hlo))


# 2.9 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_bfloat16_compute_float32_params():
    """Review r18: a model that ignored dtype="bfloat16" passed (the float32 loss is within
    the tolerance of itself). The program's matrix products run in bfloat16 (the qkv, out and
    two MLP projections of each block, and the logits) and the loss moves a little."""
    cfg = make_cfg("lm", dtype="bfloat16")
    batch = lm_batch()
    model, params = init(cfg, batch)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    sums = jax.jit(model.apply)({"params": params}, batch)
    assert sums["loss"].dtype == jnp.float32
    chex.assert_tree_all_finite(sums)
    ref_model = init(make_cfg("lm"), batch)[0]
    ref = ref_model.apply({"params": params}, batch)
    err = float(abs(sums["loss"] - ref["loss"]) / ref["loss"])
    assert 0 < err < 3e-2, err  # bfloat16 rounding: near float32's loss, not equal
    n, n_ref = (bf16_dots(jax.jit(m.apply).lower({"params": params}, batch).as_text())
                for m in (model, ref_model))
    assert n >= 4 * 2 + 1 and n_ref == 0, (n, n_ref)


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_gives_same_gradients(policy):
    batch = lm_batch()
    model, params = init(make_cfg("lm"), batch)
    remat_model = models.build(make_cfg("lm", remat=policy), deterministic=True)
    g = jax.jit(jax.grad(lambda p: model.apply({"params": p}, batch)["loss"]))(params)
    g2 = jax.jit(jax.grad(lambda p: remat_model.apply({"params": p}, batch)["loss"]))(params)
    chex.assert_trees_all_close(g, g2, atol=1e-5)


def test_dropout_is_active_only_in_training():
    cfg = make_cfg("classifier", dropout=0.5)
    batch = cls_batch()
    _, params = init(cfg, batch)
    train = models.build(cfg, deterministic=False)
    a = train.apply({"params": params}, batch, rngs={"dropout": jax.random.key(1)})
    b = train.apply({"params": params}, batch, rngs={"dropout": jax.random.key(2)})
    assert float(a["loss"]) != float(b["loss"])
    ev = models.build(cfg, deterministic=True)
    chex.assert_trees_all_equal(ev.apply({"params": params}, batch), ev.apply({"params": params}, batch))


def test_the_transformers_dropout_is_flaxs_in_float32_and_unbiased_in_bfloat16():
    """A review (session 117): flax's nn.Dropout divided a bfloat16 input by 0.9 rounded to
    0.8984375, every kept value 1.113x, the sublayers' outputs 0.17% larger in training
    than at eval. The Transformer's Dropout draws flax's mask under flax's name and computes
    flax's in float32 bit for bit (the records' runs are unchanged); in bfloat16 the kept
    elements' sum over the inputs' is 1/(1-p) to within per-element rounding."""
    import flax.linen as nn
    from hpnlp.models.transformer import Dropout
    x = jax.random.uniform(jax.random.key(2), (1 << 16,), minval=0.5, maxval=4.0)

    def run(cls, x):
        return cls(0.1).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(run(Dropout, x), run(nn.Dropout, x))
    assert Dropout(0.1).apply({}, x, deterministic=True) is x
    for cls, bias in ((nn.Dropout, 1.7e-3), (Dropout, 0.0)):  # flax's, then ours
        y = np.asarray(run(cls, x.astype(jnp.bfloat16)), np.float32)
        xf = np.asarray(x.astype(jnp.bfloat16), np.float32)
        kept = y != 0
        assert abs(y[kept].sum() / xf[kept].sum() * 0.9 - 1 - bias) < 2e-4, cls


@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float32, None), (jnp.bfloat16, jnp.bfloat16)])
def test_layer_norm_equals_flax_values_and_gradients(dtype, out_dtype):
    """transformer.LayerNorm (its own backward: scale and bias gradients as products) against
    flax's nn.LayerNorm: the same parameters, outputs and all three gradients."""
    from hpnlp.models.transformer import LayerNorm
    k = jax.random.split(jax.random.key(0), 4)
    x = (3.0 * jax.random.normal(k[0], (3, 5, 7)) + 1.0).astype(dtype)
    cot = jax.random.normal(k[1], (3, 5, 7))
    mine, ref = LayerNorm(dtype=out_dtype), nn.LayerNorm(dtype=out_dtype)
    params = ref.init(k[2], x)
    assert jax.tree.structure(mine.init(k[2], x)) == jax.tree.structure(params)
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(k[3], p.shape), params)

    def loss(module):
        return lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32) * cot)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    y, y_ref = mine.apply(params, x), ref.apply(params, x)
    assert y.dtype == y_ref.dtype
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=tol, atol=tol)
    got = jax.grad(loss(mine), (0, 1))(params, x)
    want = jax.grad(loss(ref), (0, 1))(params, x)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.float32(g), np.float32(r), rtol=tol, atol=tol * 10)


def test_a_vocabulary_larger_than_the_tasks_takes_its_counts():
    """validate allows model.vocab_size above the task's; the task's counts then cover its
    own ids, and the table's last rows are never seen (found in review: every LM failed to
    build, the counts forced into the larger table)."""
    from hpnlp import models
    cfg = make_cfg("lm", vocab_size=V + 8)
    for name in ("full", "adaptive"):  # and a layer that reads the counts' order
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=name))
        model = models.build(cfg, deterministic=True, token_counts=np.arange(V, 0, -1))
        jax.eval_shape(model.init, jax.random.key(0), lm_batch())  # its layers take them
        assert model.token_counts.vocab_size == V + 8
        assert float(np.asarray(model.token_counts.counts)[V:].sum()) == 0.0


def test_a_model_of_vocab_size_0_is_refused_in_one_line():
    """A bug hunt (session 102): model.vocab_size 0 ("take it from the task", which validate
    resolves) failed deep in JAX on an empty jnp.take; refused by build, before any init."""
    from hpnlp.config import ConfigError
    for kind in sorted(models.MODELS):
        with pytest.raises(ConfigError, match=r"`model.vocab_size` = 0 .*config "
                           r"hpnlp.config.validate returns .*or set model.vocab_size"):
            models.build(make_cfg(kind, vocab_size=0), deterministic=True)
    # and a classifier's of no classes (a review, session 116: Dense(0), then an argmax of an
    # empty class axis inside JAX)
    for kind in ("classifier", "dual_encoder"):
        with pytest.raises(ConfigError, match=r"`model.num_classes` = 0 .*or set "
                           r"model.num_classes"):
            models.build(make_cfg(kind, num_classes=0), deterministic=True)


# 5.3 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_a_reversible_model_decodes_unless_it_redraws_random_features():
    """Found in review: decoding runs a reversible stack's blocks bound, which draw other
    random features per layer than the functional pass that trained it (log-probs 0.7
    apart for Performer); refused before anything is built. Review r4: that refused every
    random-feature variant, but LSH decodes by full attention over its cache (no draw) and
    Performer with redraw=False takes its seed's draw in both passes: each decodes what its
    forward pass computes (LSH at one bucket and one chunk, where the two are equal)."""
    prompt = jnp.zeros((1, 2), jnp.int32)
    rev = make_cfg("lm", reversible=True, depth=1)  # one block: a quicker compile
    redrawn = dataclasses.replace(rev, attention=AttentionConfig("performer", {}))
    with pytest.raises(ValueError, match=r"model.reversible=True .*'performer' .*decode a "
                       r"model.reversible=False run of it, or one trained with "
                       r"attention.options.redraw=False$"):
        models.generate(redrawn, {}, prompt, length=4)
    for arch in ("lstm", "transformer_xl"):  # no key/value cache (found in review: tracebacks)
        with pytest.raises(ValueError, match=rf"model.arch='transformer'.*{arch!r}"):
            models.generate(make_cfg("lm", arch=arch), {}, prompt, length=4)
    batch = lm_batch(lengths=(L, L))
    for name, opts in (("performer", {"redraw": False}),
                       ("lsh", {"num_buckets": 1, "chunk_size": L})):
        cfg = dataclasses.replace(rev, attention=AttentionConfig(name, opts))
        model, params = init(cfg, batch)
        assert_decodes_like_forward(cfg, model, params, batch, exact=False)
        out = models.generate(cfg, params, batch["inputs"][:, :2], length=3)  # not refused
        np.testing.assert_array_equal(out[:, :2], batch["inputs"][:, :2])


# 2.5 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_a_corpus_grad_scaled_lm_decodes_without_its_token_counts():
    """Review r4: model.embed_grad_scale='corpus' scales only the embedding's gradient (a
    fixed table from the train counts), yet generate without token_counts failed inside its
    init's trace, telling the user to pass them to models.build; decoding takes no gradient,
    so it decodes what the same parameters decode unscaled."""
    cfg = make_cfg("lm", depth=1, embed_grad_scale="corpus")
    plain = make_cfg("lm", depth=1)
    batch = lm_batch()
    # the same parameters (the table is none), from numpy: no initializers to compile
    shapes = jax.eval_shape(models.build(plain, deterministic=True).init, jax.random.key(0), batch)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), s.dtype),
                          nn.unbox(shapes["params"]))
    prompt = batch["inputs"][:, :3]
    np.testing.assert_array_equal(models.generate(cfg, params, prompt, length=8),
                                  models.generate(plain, params, prompt, length=8))


def test_a_corpus_grad_scaled_model_builds_forward_only_without_its_token_counts():
    """The crash hunt (session 112): `python -m hpnlp.compress quantize` of a run with
    model.embed_grad_scale='corpus' failed in its reload check, which builds the model's
    shapes (`ptq.model_entries`) without the task's counts ("needs the task's train token
    counts"); so did `hpnlp.moe.route`. Built `forward_only` (no gradient taken: shapes,
    evaluation, routing) it has the parameters of the plain model without them; any other
    build, deterministic too (per-example gradient norms take gradients of one), still
    refuses to guess them."""
    cfg = make_cfg("lm", depth=1, embed_grad_scale="corpus")
    batch, key = lm_batch(), jax.random.key(0)
    plain = jax.eval_shape(models.build(make_cfg("lm", depth=1), deterministic=True).init, key,
                           batch)
    scaled = jax.eval_shape(models.build(cfg, deterministic=True, forward_only=True).init, key,
                            batch)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), scaled) == jax.tree.map(
        lambda s: (s.shape, s.dtype), plain)
    for deterministic in (True, False):
        with pytest.raises(ValueError, match="needs the task's train token counts"):
            jax.eval_shape(models.build(cfg, deterministic=deterministic).init, key, batch)
    from hpnlp.compress.ptq import model_entries  # the reload check's shapes
    from hpnlp.config import validate
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=8)
    cd.model.update(width=16, depth=1, num_heads=2, mlp_dim=32, max_len=8)
    cd.quant.weights = "int8"
    entries = model_entries(validate(from_configdict(cd), num_devices=1))
    cd.model.embed_grad_scale = "corpus"
    assert model_entries(validate(from_configdict(cd), num_devices=1)) == entries


def test_the_cli_decodes_by_default_no_further_than_its_learned_positions_trained(
        tmp_path, capsys):
    """Review r4: with model.pos_emb='learned' and data.seq_len below model.max_len, the
    table's rows from seq_len on take no gradient, and the CLI's default --length (max_len)
    decoded into them, unsaid. Its default is data.seq_len there (and a prompt it cannot hold
    is told why), with --draft too; a longer --length is noted; sinusoidal and rope
    positions, from no table, keep max_len. A run's config and an empty checkpoint folder:
    nothing is trained, and the weights' read fails after these checks."""
    import importlib
    import os

    from hpnlp.train.checkpoint import Checkpointer
    generate = importlib.import_module("hpnlp.models.generate")  # the module, not the function
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=8)
    cd.model.update(kind="lm", width=16, depth=1, num_heads=2, mlp_dim=32, max_len=32,
                    vocab_size=256)
    Checkpointer(str(tmp_path / "learned"), from_configdict(cd), keep=1).close()
    os.makedirs(tmp_path / "learned" / "checkpoints" / "1")
    learned = ["--workdir", str(tmp_path / "learned"), "--greedy", "--prompt", "x" * 10]
    why = "by default the run's data.seq_len: the positions its learned position table trained"
    for extra, bound in (([], "the run's model.max_len=32"),
                         (["--draft", str(tmp_path / "learned")],
                          "29 with --draft: the smaller model.max_len, less --draft-tokens - 1")):
        assert generate.main(learned + extra) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: every prompt needs 1 to 7 tokens (--length 8, {why}); these have [10]; "
            f"shorten it, or raise --length (up to {bound})")
    assert generate.main(learned + ["--length", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("note: --length 20 decodes positions 8..19, which the run's training "
                      "(data.seq_len=8) never reached: their rows of its learned position table "
                      "(model.pos_emb='learned') are untrained, so the text there may degrade; "
                      "--length 8 or less keeps to trained positions"), err
    assert len(err) == 2 and err[1].startswith("error: "), err  # the empty checkpoint's
    assert generate.trained_length(from_configdict(cd)) == 8
    # --kv-cache int8 of a run whose attention keeps a cache of its own: the fix is this
    # command's flag, not the run's fields (a review, session 115)
    cd.attention.name = "sliding_window"
    Checkpointer(str(tmp_path / "window"), from_configdict(cd), keep=1).close()
    os.makedirs(tmp_path / "window" / "checkpoints" / "1")
    assert generate.main(["--workdir", str(tmp_path / "window"), "--prompt", "x",
                          "--kv-cache", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --kv-cache int8 for ") and err.endswith(
        "; for this run, decode without --kv-cache (or with --kv-cache none)"), err
    for pos_emb in ("sinusoidal", "rope"):  # the CLI's default stays model.max_len
        cd.model.pos_emb = pos_emb
        assert generate.trained_length(from_configdict(cd)) is None


def test_decoding_random_features_of_the_run_s_stream_needs_their_key():
    """A review (r12): the quickstart notebook sampled a Performer run without its features
    key, so with its seed's draw, which it never trained with; refused before any compile."""
    from hpnlp import models
    from hpnlp.models.generate import check_features_key
    prompt = jnp.zeros((1, 2), jnp.int32)
    cfg = dataclasses.replace(make_cfg("lm"), attention=AttentionConfig("performer", {}))
    with pytest.raises(ValueError, match=r"attention.name='performer' .*pass features_key="):
        models.generate(cfg, {}, prompt, length=4)
    check_features_key(cfg, jax.random.key(0))
    # LSH decodes by full attention over its cache (`decode_step`), reading no features
    check_features_key(dataclasses.replace(cfg, attention=AttentionConfig("lsh", {})), None)
    fixed = AttentionConfig("performer", {"redraw": False})  # one draw from its seed: no key
    check_features_key(dataclasses.replace(make_cfg("lm"), attention=fixed), None)
    check_features_key(make_cfg("lm"), None)


# 2.5 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_decoding_a_frequency_based_output_layer_needs_its_train_counts():
    """A review (session 107): without token_counts, generate built a hierarchical layer's
    Huffman tree from a Zipf stand-in over the ids, not the counts it trained with, and each
    id read another's path (log-probs garbage, unsaid); class_based's classes and adaptive's
    default cutoffs failed deep in flax where their shapes differed. Refused in one line
    naming the argument; with the counts, greedy decoding is the teacher-forced argmax."""
    from hpnlp.models.generate import check_token_counts
    counts = np.random.default_rng(0).integers(1, 100, V)  # not Zipf over the ids
    cfg = dataclasses.replace(make_cfg("lm", depth=1), output=OutputConfig("hierarchical"))
    batch = lm_batch()
    model = models.build(cfg, deterministic=True, token_counts=counts)
    params = jax.jit(lambda key: nn.unbox(model.init(key, batch)["params"]))(jax.random.key(0))
    prompt = batch["inputs"][:, :3]
    with pytest.raises(ValueError, match=r"^output.name='hierarchical' builds its Huffman tree "
                       r"from the train counts .*pass token_counts=trainer.task.token_counts "):
        models.generate(cfg, params, prompt, length=8)
    out = models.generate(cfg, params, prompt, length=8, token_counts=counts)
    seg = jnp.ones_like(out)
    lp = jax.jit(lambda p: model.apply({"params": p}, {
        "inputs": out, "segment_ids": seg, "positions": jnp.cumsum(seg, 1) - 1},
        method="log_probs"))(params)
    np.testing.assert_array_equal(out[:, 3:], jnp.argmax(lp[:, 2:-1], -1))
    # the layers whose decoded tables come from the counts; not the sampled objectives', whose
    # counts only drew training negatives and set the initial bias
    for name, options, built in (("class_based", {}, "its frequency classes"),
                                 ("binary_code", {}, "its ids' codewords"),
                                 ("adaptive", {}, "its default cutoffs")):
        lm = dataclasses.replace(cfg, output=OutputConfig(name, options=options))
        with pytest.raises(ValueError, match=rf"^output.name={name!r} builds {built}"):
            check_token_counts(lm, None)
        check_token_counts(lm, counts)
    for name, options in (("adaptive", {"cutoffs": (8, 20)}), ("full", {}), ("sampled", {}),
                          ("nce", {}), ("negative_sampling", {}), ("vmf", {})):
        check_token_counts(dataclasses.replace(cfg, output=OutputConfig(name, options=options)),
                           None)


def test_a_registered_module_of_the_wrong_shape_is_named_at_trace():
    """A bug hunt (session 96): a registered attention variant of another output shape failed
    in the output projection's dot_general, naming nothing; an output layer whose loss was a
    scalar mean trained with gradients scaled down by the token count. Shapes only."""
    from hpnlp import attention as A
    from hpnlp.attention.dense import DenseAttention
    from hpnlp.softmax import base as softmax_base
    from hpnlp.softmax.full import FullSoftmax

    class Short(DenseAttention):
        def __call__(self, q, k, v, mask=None, *, causal=False, deterministic=True):
            return super().__call__(q, k, v, mask, causal=causal)[:, 1:]

    class Mean(FullSoftmax):
        def loss(self, hidden, targets, mask=None, *, deterministic=True):
            return super().loss(hidden, targets, mask).mean()
    batch = lm_batch()

    def trace(cfg):
        model = models.build(cfg, deterministic=True)
        return jax.eval_shape(lambda key: model.init(key, batch), jax.random.key(0))
    with A.registered("short_out", Short):
        with pytest.raises(ValueError, match=r"attention variant 'short_out' returned an output "
                           r"of shape \(2, 15, 4, 8\); it must return \[B, L, H, D\] = "
                           r"\(2, 16, 4, 8\)"):
            trace(make_cfg(attention="short_out"))
    with softmax_base._REGISTRY.registered("mean_loss", Mean):
        with pytest.raises(ValueError, match=r"output layer Mean.loss returned shape \(\); it "
                           r"must return each token's loss, of the targets' shape \(2, 16\)"):
            trace(dataclasses.replace(make_cfg(), output=OutputConfig("mean_loss")))
        # Transformer-XL's loss too (a review, session 118: unchecked, a [B] loss broadcast)
        with pytest.raises(ValueError, match=r"output layer Mean.loss returned shape \(\); it "
                           r"must return each token's loss, of the targets' shape \(2, 16\)"):
            trace(dataclasses.replace(make_cfg(arch="transformer_xl"),
                                      output=OutputConfig("mean_loss")))


def test_the_lm_loss_counts_no_padding_whatever_its_output_layer_returns_there():
    """Review r1: the LM summed its output layer's per-token losses unmasked, trusting the
    layer to zero the padded slots (`lm_eval_sums` masks them itself): a registered layer
    that does not added padding loss, or NaN. Masked by the model now: `full`'s sums."""
    from hpnlp.softmax import base as softmax_base
    from hpnlp.softmax.full import FullSoftmax

    class Unmasked(FullSoftmax):
        def loss(self, hidden, targets, mask=None, *, deterministic=True):
            return super().loss(hidden, targets, None)

    class NaNPadded(FullSoftmax):
        def loss(self, hidden, targets, mask=None, *, deterministic=True):
            return jnp.where(mask, super().loss(hidden, targets, mask), jnp.nan)
    batch = lm_batch()  # row 1: 5 slots of padding
    cfg = make_cfg(depth=1)
    model, params = init(cfg, batch)
    want = jax.jit(model.apply)({"params": params}, batch)
    for name, layer in (("unmasked", Unmasked), ("nan_padded", NaNPadded)):
        with softmax_base._REGISTRY.registered(name, layer):
            other = models.build(dataclasses.replace(cfg, output=OutputConfig(name)),
                                 deterministic=True)
            got = jax.jit(other.apply)({"params": params}, batch)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, err_msg=name)
        assert float(got["weight"]) == float(want["weight"])
