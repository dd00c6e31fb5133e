"""Mixture of experts (hpnlp.moe): routing, dispatch and combine against per-token loops,
capacity priority, dropless, the balance loss, padding, the models, training, config errors.
(Expert parallelism on 8 simulated devices: test_moe_parallel.py.)"""

import dataclasses
import json
import os

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import ConfigError, MoEConfig, ModelConfig, from_configdict, validate
from hpnlp.moe import dispatch, routing
from hpnlp.moe.layer import ROUTES, MoE
from hpnlp.train.carry import AUX

B, L, M, F, X = 2, 8, 8, 16, 4  # rows, length, width, expert width, experts


def layer(quant=None, **moe):
    moe = {"num_experts": X, "capacity_factor": 1.0, "eval_capacity_factor": 1.0,
           "groups": B, **moe}
    m = ModelConfig(width=M, mlp_dim=F, dropout=0.0, moe=MoEConfig(**moe))
    if quant is not None:
        m = dataclasses.replace(m, quant=quant)
    return MoE(m, deterministic=False)


def inputs(lengths=(L, L), seed=0):
    x = jax.random.normal(jax.random.key(seed), (B, L, M))
    seg = (np.arange(L)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return x, jnp.asarray(seg)


def init_params(mod, x, seg, router_scale=1.0):
    """Parameters with a router sharp enough that choices are well separated (no ties)."""
    p = jax.jit(mod.init)(jax.random.key(1), x, seg)["params"]
    p = jax.tree.map(lambda a: a.unbox() if hasattr(a, "unbox") else a, p,
                     is_leaf=lambda a: hasattr(a, "unbox"))
    ks = jax.random.split(jax.random.key(2), 2)
    p = dict(p, router=jax.random.normal(ks[0], p["router"].shape) * router_scale,
             bi=jax.random.normal(ks[1], p["bi"].shape) * 0.1)
    return p


def apply(mod, p, x, seg):
    """(output, the layer's reported dict), jitted."""
    y, aux = jax.jit(lambda p, x, seg: mod.apply({"params": p}, x, seg, mutable=[AUX]))(p, x, seg)
    return y, jax.tree.map(lambda a: a, aux[AUX]["moe"][0])


def expert(p, e, x_M):
    return jax.nn.gelu(x_M @ p["wi"][e] + p["bi"][e]) @ p["wo"][e] + p["bo"][e]


def loop_choices(p, x, seg, *, k, capacity, groups=B):
    """Per-token Python loop, part 1 (not differentiated): top-k by numpy, and the capacity
    priority simulated (first choices of every token, then second choices; token order
    within each). -> (choice [G, S, k], kept [G, S, k])."""
    probs = jax.nn.softmax(jnp.einsum("blm,mx->blx", x, p["router"]), -1)
    X = p["router"].shape[1]
    pn = np.asarray(probs).reshape(groups, -1, X)
    valid = np.asarray(seg).reshape(groups, -1) > 0
    S = pn.shape[1]
    choice = np.argsort(-pn, axis=-1, kind="stable")[..., :k]
    kept = np.zeros((groups, S, k), bool)
    for g in range(groups):
        used = [0] * X
        for j in range(k):
            for s in range(S):
                e = choice[g, s, j]
                if valid[g, s] and (capacity is None or used[e] < capacity):
                    kept[g, s, j] = True
                    used[e] += 1
    return choice, kept


def loop_reference(p, x, choice, kept, *, renormalize, expert=expert):
    """Part 2, differentiable in p and x: y_t = sum over kept choices of gate * expert(x_t).
    Each expert (its definition on one token) is mapped over every token (jax.vmap) and each
    token's chosen rows gathered, so the traced program holds X experts, not a copy of one
    per token and choice."""
    groups, S, k = choice.shape
    M, X = p["router"].shape
    xs = x.reshape(groups * S, M)
    ps = jax.nn.softmax(xs @ p["router"], -1)
    c = choice.reshape(-1, k)
    chosen = jnp.take_along_axis(ps, jnp.asarray(c), -1)
    gate = chosen / jnp.sum(chosen, -1, keepdims=True) if renormalize else chosen
    ys = jnp.stack([jax.vmap(lambda x_M, e=e: expert(p, e, x_M))(xs) for e in range(X)])
    picked = ys[c, np.arange(len(c))[:, None]]  # [T, k, M]: token t's choice j
    y = jnp.sum(jnp.where(kept.reshape(-1, k, 1), gate[..., None] * picked, 0.0), 1)
    return y.reshape(x.shape)


@pytest.mark.parametrize("dispatch_kind", ["capacity", "dropless"])
def test_all_experts_unlimited_capacity_equals_gate_weighted_sum(dispatch_kind):
    mod = layer(router="top_k", top_k=X, dispatch=dispatch_kind)
    x, seg = inputs()
    p = init_params(mod, x, seg)
    y, _ = apply(mod, p, x, seg)
    probs = jax.nn.softmax(x.reshape(-1, M) @ p["router"], -1)  # top_k = X: gates = probs
    want = dispatch.reference(x.reshape(-1, M), probs, p["wi"], p["bi"], p["wo"], p["bo"])
    np.testing.assert_allclose(y.reshape(-1, M), want, atol=1e-5)


@pytest.mark.parametrize("router,k,dispatch_kind,factor", [
    ("switch", 1, "capacity", 1.0), ("top_k", 2, "capacity", 0.75), ("top_k", 2, "dropless", 1.0)])
def test_dispatch_and_combine_equal_a_per_token_loop(router, k, dispatch_kind, factor):
    """Outputs and gradients (input, router, experts), padding and drops included."""
    mod = layer(router=router, top_k=k, dispatch=dispatch_kind, capacity_factor=factor)
    x, seg = inputs(lengths=(L, 5))
    p = init_params(mod, x, seg)
    S = L
    cap = None if dispatch_kind == "dropless" else routing.capacity(S, experts=X, top_k=k,
                                                                    factor=factor)
    r = jax.random.normal(jax.random.key(3), x.shape)
    y, stats = apply(mod, p, x, seg)
    choice, kept = loop_choices(p, x, seg, k=k, capacity=cap)
    y_ref = loop_reference(p, x, choice, kept, renormalize=router == "top_k")
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    valid = int(np.sum(seg))
    assert float(stats["moe_dropped"]) == valid * k - kept.sum()
    if cap is not None and factor < 1.0:
        assert kept.sum() < valid * k  # this case does drop

    def loss(p, x):
        return jnp.sum(mod.apply({"params": p}, x, seg, mutable=[AUX])[0] * r)

    def loss_ref(p, x):
        return jnp.sum(loop_reference(p, x, choice, kept, renormalize=router == "top_k") * r)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
    g_ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(p, x)  # the loop, traced once
    chex.assert_trees_all_close(g, g_ref, atol=1e-5)


@pytest.mark.parametrize("decode,router,k,shape", [(True, "switch", 1, (3, 1)),
                                                   (False, "top_k", 2, (1, 2))])
def test_dropless_few_tokens_many_experts_equal_a_per_token_loop(decode, router, k, shape):
    """Review r5: dropless rows (decoding's among them) reserved a block for every expert,
    72 rows through 9 experts' weights for one decoded token of 8 experts. Now only the
    experts that can get a choice are counted, and here the bound is tight: every choice
    is an expert of its own, one block each (3 and 4 blocks), so one block fewer
    would lose a choice (checked: it does)."""
    Xw = 16
    mod = layer(router=router, top_k=k, dispatch="dropless", num_experts=Xw, groups=1)
    mod = mod.clone(deterministic=True, decode=decode)
    x = jax.random.normal(jax.random.key(0), (*shape, M))
    seg = jnp.ones(shape, jnp.int32)
    p = init_params(mod, x, seg)
    y, stats = apply(mod, p, x, seg)
    choice, kept = loop_choices(p, x, seg, k=k, capacity=None, groups=1)
    assert len(np.unique(choice)) == choice.size  # each choice a block of its own
    assert dispatch.block_rows(choice.size, Xw) == (8, 8 * choice.size)
    np.testing.assert_allclose(y, loop_reference(p, x, choice, kept, renormalize=k > 1),
                               atol=1e-5)
    assert float(stats["moe_dropped"]) == 0.0


def test_block_rows_bound_every_choice_and_reserve_no_block_per_empty_expert():
    """Review r5: block_rows(1, 8) was (8, 72). R is the worst case of the sum over experts
    of ceil(choices / b) blocks: checked against it, found by dynamic programming over how
    P choices can split among X experts."""
    assert dispatch.block_rows(1, 8) == (8, 8)  # one decoded token: one block
    # an expert gets at most one choice a token: blocks no longer than the tokens (one
    # decoded token's choice one row, not 8)
    assert dispatch.block_rows(1, 8, tokens=1) == (1, 1)
    assert dispatch.block_rows(6, 8, tokens=3) == (3, 18)
    assert dispatch.block_rows(64 * 2, 8, tokens=64) == (8, 8 * 8 + 120)
    assert dispatch.block_rows(1, 8, 256, tokens=1) == (1, 1)  # model.moe.block_size's too
    assert dispatch.block_rows(1, 64)[1] <= 16
    for b in (1, 2, 3, 8):
        for X_ in (1, 2, 3, 5, 8):
            worst = [0] * 41  # worst[p]: the most blocks p choices take over the experts so far
            for _ in range(X_):
                worst = [max(-(-s // b) + worst[p - s] for s in range(p + 1)) for p in range(41)]
            for P in range(1, 41):  # enough rows, and not a block more
                assert dispatch.block_rows(P, X_, b) == (b, b * worst[P]), (P, X_, b)


def test_router_logits_are_products_at_highest_precision():
    """Review r5: the router's logits (and noisy gating's noise scale) took the default
    matmul precision, TF32 on a GPU and one bf16 pass on a TPU, so top-k flipped near-tied
    experts there. Both [G, S, X] products ask for HIGHEST (read from the traced program:
    the CPU computes float32 whatever the precision, so values cannot show it)."""
    mod = layer(noisy=True)
    x, seg = inputs()
    p = init_params(mod, x, seg)
    jaxpr = jax.make_jaxpr(lambda p: mod.apply({"params": p}, x, seg, mutable=[AUX],
                                               rngs={"dropout": jax.random.key(0)}))(p)

    def dots(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from dots(sub)
    router = [e.params["precision"] for e in dots(jaxpr.jaxpr)
              if e.outvars[0].aval.shape == (B, L, X)]  # [G, S, X]: groups = B rows here
    assert router == [(jax.lax.Precision.HIGHEST,) * 2] * 2, router


# 3.1 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_capacity_drops_exactly_the_choices_past_capacity_in_priority_order():
    """Every token prefers expert 0: its C slots go to the first C tokens of each group,
    the rest are dropped; dropless drops none. (Each expert here gets choices of one rank
    only, so this checks token order within a rank; across ranks: the test below.)"""
    x, seg = inputs()
    for kind in ("capacity", "dropless"):
        mod = layer(router="top_k", top_k=2, dispatch=kind, capacity_factor=1.0)
        p = init_params(mod, x, seg)
        router = np.zeros((M, X), np.float32)
        p = dict(p, router=jnp.asarray(router))
        x_skew = x.at[..., 0].set(10.0)  # logits = 10 * row 0 of the router
        router[0] = [3.0, 2.0, -1.0, -2.0]  # every token: expert 0, then expert 1
        p["router"] = jnp.asarray(router)
        y, stats = apply(mod, p, x_skew, seg)
        C = routing.capacity(L, experts=X, top_k=2, factor=1.0)  # = 4 of 8 tokens
        choice, kept = loop_choices(p, x_skew, seg, k=2, capacity=None if kind == "dropless" else C)
        y_ref = loop_reference(p, x_skew, choice, kept, renormalize=True)
        np.testing.assert_allclose(y, y_ref, atol=1e-5)
        if kind == "dropless":
            assert float(stats["moe_dropped"]) == 0.0 and kept.all()
        else:
            first, second = kept[..., 0], kept[..., 1]
            first_c = np.broadcast_to(np.arange(L) < C, (B, L))  # the first C tokens of a group
            np.testing.assert_array_equal(first, first_c)  # expert 0's slots
            np.testing.assert_array_equal(second, first_c)  # expert 1's
            assert float(stats["moe_dropped"]) == 2 * B * (L - C)
        np.testing.assert_allclose(stats["moe_load"], [B * L, B * L, 0, 0])  # demand, not kept


def test_slots_fill_in_priority_order():
    """routing.slots_from_choices against hand-worked cases: expert 0 has 2 slots, then 1."""
    expert = jnp.array([[[0, 1], [0, 2], [1, 0], [0, 1]]])  # [G=1, S=4, K=2]
    gate = jnp.full((1, 4, 2), 0.5)
    valid = jnp.array([[True, True, False, True]])
    slots, kept = routing.slots_from_choices(routing.Choices(expert, gate), valid, experts=3,
                                             slots=2)
    # Expert 0: first choices of tokens 0, 1 (token 2 is padding, token 3 is past capacity).
    np.testing.assert_array_equal(slots.token_GXC[0], [[0, 1], [0, 3], [1, 4]])
    np.testing.assert_array_equal(kept[0], [[1, 1], [1, 1], [0, 0], [0, 1]])
    # Across ranks (review r12 F3: above, the only cross-rank choices are padding's), the
    # same shapes (no new compiles): expert 0's 2 slots go to the first choices of tokens 1
    # and 2, not token 0's earlier second choice; expert 2's to token 3's first choice and
    # token 1's second, not token 2's.
    expert = jnp.array([[[1, 0], [0, 2], [0, 2], [2, 1]]])
    slots, kept = routing.slots_from_choices(routing.Choices(expert, gate), jnp.ones_like(valid),
                                             experts=3, slots=2)
    np.testing.assert_array_equal(slots.token_GXC[0], [[1, 2], [0, 3], [3, 1]])
    np.testing.assert_array_equal(kept[0], [[1, 0], [1, 1], [1, 0], [1, 1]])


def test_capacity_serves_every_first_choice_before_any_second_choice():
    """The layer's own routes (review r12 F3: no test had an expert get choices of two
    ranks, and the layer was held only through its output against the loop's `kept`). Even
    tokens choose expert 0 then 1, odd tokens 1 then 0: each expert gets the first choices
    of half the group's tokens, exactly its C slots, and the second choices of the other
    half. Every first choice is kept and every second dropped; a queue in token order keeps
    tokens 0-3's choices and drops 4-7's instead (as many: `moe_dropped` cannot tell)."""
    mod = layer(router="top_k", top_k=2, dispatch="capacity", capacity_factor=1.0)
    x, seg = inputs()
    p = init_params(mod, x, seg)
    router = np.zeros((M, X), np.float32)
    router[0] = [2.5, 2.5, -1.0, -2.0]  # logits = 10 * row 0 +- 10 * row 1
    router[1] = [0.5, -0.5, 0.0, 0.0]
    p = dict(p, router=jnp.asarray(router))
    even = np.arange(L) % 2 == 0
    x_alt = x.at[..., 0].set(10.0).at[..., 1].set(jnp.asarray(np.where(even, 10.0, -10.0)))
    y, out = jax.jit(lambda p, x, seg: mod.apply({"params": p}, x, seg, mutable=[AUX, ROUTES])
                     )(p, x_alt, seg)
    C = routing.capacity(L, experts=X, top_k=2, factor=1.0)
    assert C == L // 2
    first = np.where(even, 0, 1)  # each token's first choice; its second is the other one
    weights_BLX = np.asarray(out[ROUTES]["weights"][0])
    tokens = np.arange(L)
    assert (weights_BLX[:, tokens, first] > 0).all(), weights_BLX  # kept
    np.testing.assert_array_equal(weights_BLX[:, tokens, 1 - first], 0.0)  # dropped
    assert float(out[AUX]["moe"][0]["moe_dropped"]) == B * L
    choice = np.broadcast_to(np.stack([first, 1 - first], -1), (B, L, 2))
    kept = np.broadcast_to(np.array([True, False]), (B, L, 2))
    np.testing.assert_allclose(y, loop_reference(p, x_alt, choice, kept, renormalize=True),
                               atol=1e-5)
    # ...and the test's own loop agrees (the other tests hold the layer to it)
    loop_choice, loop_kept = loop_choices(p, x_alt, seg, k=2, capacity=C)
    np.testing.assert_array_equal(loop_choice, choice)
    np.testing.assert_array_equal(loop_kept, kept)


def test_expert_choice_takes_each_experts_top_tokens():
    mod = layer(router="expert_choice", top_k=1, capacity_factor=1.0)
    x, seg = inputs(lengths=(L, 6))
    p = init_params(mod, x, seg)
    y, stats = apply(mod, p, x, seg)
    probs = np.asarray(jax.nn.softmax(jnp.einsum("blm,mx->blx", x, p["router"]), -1))
    C = routing.capacity(L, experts=X, top_k=1, factor=1.0)
    want = np.zeros((B, L, M), np.float32)
    unchosen = 0
    for b in range(B):
        valid = np.asarray(seg[b]) > 0
        chosen = np.zeros(L, bool)
        for e in range(X):
            score = np.where(valid, probs[b, :, e], -1.0)
            for t in np.argsort(-score, kind="stable")[:C]:
                if valid[t]:
                    want[b, t] += probs[b, t, e] * np.asarray(expert(p, e, x[b, t]))
                    chosen[t] = True
        unchosen += int(np.sum(valid & ~chosen))
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert float(stats["moe_dropped"]) == unchosen
    # Every expert fills min(C, valid tokens) slots in each group.
    np.testing.assert_allclose(stats["moe_load"], [min(C, L) + min(C, 6)] * X)


def test_expert_choice_evaluates_at_the_capacity_it_trained_with():
    """Review r4: evaluation took eval_capacity_factor (2.0 against 1.25 here: 4 slots per
    expert and group against 3), and with expert choice the capacity is the routing, so
    every token summed more experts than training gave it. Evaluation now routes as training
    does, and a new run setting eval_capacity_factor with expert choice is refused (below)."""
    mod = layer(router="expert_choice", top_k=1, capacity_factor=1.25, eval_capacity_factor=2.0)
    x, seg = inputs(lengths=(L, 6))
    p = init_params(mod, x, seg)
    y_train, stats_train = apply(mod, p, x, seg)
    y_eval, stats_eval = apply(mod.clone(deterministic=True), p, x, seg)
    np.testing.assert_allclose(y_eval, y_train, atol=1e-6)
    C = routing.capacity(L, experts=X, top_k=1, factor=1.25)
    np.testing.assert_allclose(stats_eval["moe_load"], [min(C, L) + min(C, 6)] * X)


def test_balance_loss_formula_uniform_and_collapsed():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 16, X)).astype(np.float32) * 2
    valid = rng.random((2, 16)) > 0.2
    probs = jax.nn.softmax(jnp.asarray(logits), -1)
    ch = routing.top_k(probs, top_k=2)
    got = float(routing.balance_loss(probs, ch.expert_GSK, jnp.asarray(valid)))
    pv, ev = np.asarray(probs)[valid], np.asarray(ch.expert_GSK)[valid]
    f = np.array([(ev == i).sum() for i in range(X)]) / ev.size
    np.testing.assert_allclose(got, X * np.sum(f * pv.mean(0)), rtol=1e-5)

    uniform = jnp.full((2, 16, X), 1.0 / X)
    spread = jnp.asarray(np.arange(32).reshape(2, 16, 1) % X)  # balanced routing
    assert float(routing.balance_loss(uniform, spread, jnp.ones((2, 16), bool))) == pytest.approx(1.0)
    # At the uniform router the loss is stationary (its gradient in the logits vanishes).
    g = jax.grad(lambda z: routing.balance_loss(jax.nn.softmax(z, -1), spread,
                                                jnp.ones((2, 16), bool)))(jnp.zeros((2, 16, X)))
    assert float(jnp.abs(g).max()) < 1e-7
    collapsed = jax.nn.softmax(jnp.zeros((2, 16, X)).at[..., 0].set(30.0), -1)
    assert float(routing.balance_loss(collapsed, jnp.zeros((2, 16, 1), jnp.int32),
                                      jnp.ones((2, 16), bool))) == pytest.approx(X, rel=1e-4)
    # Random routers sit above the uniform one (one compile for the five).
    @jax.jit
    def switch_loss(z):
        pr = jax.nn.softmax(z, -1)
        return routing.balance_loss(pr, routing.switch(pr, top_k=1).expert_GSK,
                                    jnp.ones((1, 256), bool))

    for seed in range(5):
        z = jnp.asarray(np.random.default_rng(seed).normal(size=(1, 256, X)) * 2, jnp.float32)
        assert float(switch_loss(z)) > 1.0


def test_router_z_loss_value_and_its_weight_in_the_layers_loss():
    """ST-MoE's router z-loss: routing.z_loss is the mean over valid tokens of
    logsumexp(logits)^2; the layer reports it for its router's logits (padding left out) and
    adds it to its loss times model.moe.z_loss (review r18: neither was checked)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 16, X)) * 3
    valid = rng.random((2, 16)) > 0.3
    z = np.log(np.sum(np.exp(logits[valid]), -1))  # float64
    np.testing.assert_allclose(
        float(routing.z_loss(jnp.asarray(logits, jnp.float32), jnp.asarray(valid))),
        np.mean(z ** 2), rtol=1e-5)
    mod = layer(router="top_k", top_k=2, z_loss=0.25, balance_loss=0.5)
    x, seg = inputs(lengths=(L, 5))
    p = init_params(mod, x, seg)
    _, stats = apply(mod, p, x, seg)
    real = np.asarray(seg) > 0
    logits = np.asarray(x, np.float64)[real] @ np.asarray(p["router"], np.float64)
    want_z = np.mean(np.log(np.sum(np.exp(logits), -1)) ** 2)
    np.testing.assert_allclose(float(stats["loss_moe_z"]), want_z, rtol=1e-5)
    np.testing.assert_allclose(
        float(stats["loss"]),
        0.25 * float(stats["loss_moe_z"]) + 0.5 * float(stats["loss_moe_balance"]), rtol=1e-6)


@pytest.mark.parametrize("router,k,kind", [("switch", 1, "capacity"), ("top_k", 2, "dropless"),
                                           ("expert_choice", 1, "capacity")])
def test_padding_is_routed_nowhere_and_counts_in_no_statistic(router, k, kind):
    mod = layer(router=router, top_k=k, dispatch=kind, capacity_factor=1.0)
    x, seg = inputs(lengths=(L, 5))
    p = init_params(mod, x, seg)
    y, stats = apply(mod, p, x, seg)
    pad = np.asarray(seg) == 0
    assert float(jnp.abs(y[pad]).max()) == 0.0  # the residual alone
    x2 = jnp.where(pad[..., None], 100.0 * jax.random.normal(jax.random.key(9), x.shape), x)
    y2, stats2 = apply(mod, p, x2, seg)
    np.testing.assert_allclose(y2, y, atol=1e-6)
    chex.assert_trees_all_close(stats2, stats, atol=1e-5)
    valid = int(np.sum(seg))
    assert float(stats["moe_tokens"]) == valid
    if router != "expert_choice":  # the demand of valid tokens only (expert choice: above)
        assert float(np.sum(stats["moe_load"])) == valid * k


# -- Models and training ------------------------------------------------------------------

from test_models import BATCHES, V, init, lm_batch, make_cfg  # noqa: E402


def moe_model(kind="lm", **moe):
    moe = {"num_experts": X, "every": 2, "eval_capacity_factor": float(X), **moe}
    cfg = make_cfg(kind, moe=MoEConfig(**moe))
    return cfg


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_every_model_kind_takes_moe_blocks(kind):
    cfg = moe_model(kind, shared_experts=1)
    batch = BATCHES[kind]()
    model, params = init(cfg, batch)
    blocks = params["trunk"]
    assert "mlp_in" in blocks["block_0"] and "moe" in blocks["block_1"]
    assert set(blocks["block_1"]["moe"]) == {"router", "wi", "bi", "wo", "bo", "shared_in", "shared_out"}
    sums, aux = jax.jit(lambda p: model.apply({"params": p}, batch, mutable=[AUX]))(params)
    chex.assert_tree_all_finite((sums, aux))
    # one call: the dual encoder's trunk encodes both texts at once (review r1), their tokens
    (report,) = aux[AUX]["trunk"]["block_1"]["moe"]["moe"]
    segs = [v for k, v in batch.items() if k.startswith("segment_ids")]
    assert float(report["moe_tokens"]) == sum(int(np.sum(s > 0)) for s in segs)


# 4.8 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_decode_with_moe_matches_the_forward_pass_and_generates():
    """Decoding routes each token alone (dropless); with eval capacity for every token the
    teacher-forced forward pass routes the same, so their log-probs agree."""
    cfg = moe_model("lm", router="top_k", top_k=2)
    batch = lm_batch(lengths=(16, 16))
    model, params = init(cfg, batch)
    full = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))(params, batch)
    dec = models.build(cfg, deterministic=True, decode=True)
    cache = jax.jit(lambda tok: dec.init(jax.random.key(0), tok, method="decode_step")["cache"])(
        jnp.zeros((B, 1), jnp.int32))  # jitted: one compile, not one per primitive
    step = jax.jit(lambda p, c, tok: dec.apply({"params": p, "cache": c}, tok, method="decode_step",
                                              mutable=["cache"]))
    got = []
    for t in range(16):
        lp, upd = step(params, cache, batch["inputs"][:, t:t + 1])
        cache = upd["cache"]
        got.append(lp)
    np.testing.assert_allclose(jnp.stack(got, 1), full, atol=2e-5)
    out = models.generate(cfg, params, batch["inputs"][:, :4], jnp.array([4, 4]), length=8)
    assert out.shape == (B, 8) and int(out.max()) < V


def tensorboard_tags(directory) -> set:
    """Scalar tags in the TensorBoard event files of `directory` (TFRecord framing: length,
    its CRC, an Event proto, its CRC), read with tensorboardX's own protos."""
    import struct
    from tensorboardX.proto import event_pb2
    tags = set()
    for name in os.listdir(directory):
        data = open(os.path.join(directory, name), "rb").read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            tags.update(v.tag for v in event.summary.value)
            i += 12 + n + 4
    return tags


def _tiny_moe(**moe):
    from test_train import tiny
    cd = tiny(steps=12, log_every=4, checkpoint_every=6)
    cd.model.depth = 2
    cd.model.moe.update(num_experts=X, every=2, **moe)
    return cd


@pytest.mark.slow  # over 10 s on a 2-core EPYC Zen 3
def test_training_logs_routing_statistics_and_resumes_exactly(tmp_path):
    """A tiny MoE LM trains; metrics.jsonl and TensorBoard carry the router losses, drops,
    entropy and per-expert load; the compiled step is reused (no recompiles); a run stopped
    at a checkpoint mid-window resumes to the same log lines."""
    from hpnlp.train import Trainer
    from test_train import read_jsonl
    cd = _tiny_moe(router="top_k", top_k=2)
    tr = Trainer(from_configdict(cd), str(tmp_path / "full"))
    summary = tr.run()
    assert tr.train_step._cache_size() == 1  # one compile for every step
    lines = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    train = [l for l in lines if not l.get("eval")]
    ev = [l for l in lines if l.get("eval")][-1]
    assert train[-1]["loss"] < train[0]["loss"]
    for l in train + [ev]:
        assert {"loss_moe_balance", "loss_moe_z", "moe_dropped_frac", "moe_router_entropy",
                "moe_load_max_vs_mean"} <= set(l)
        load = np.asarray(l["moe_load"])
        assert load.shape == (1, X) and abs(load.sum() - 1.0) < 1e-3
        assert 0.0 <= l["moe_dropped_frac"] <= 1.0 and 0.0 < l["moe_router_entropy"] <= np.log(X)
    assert "loss_aux" in train[0] and "loss_aux" not in ev  # eval reports the task's loss
    tags = tensorboard_tags(tmp_path / "full" / "tensorboard")
    assert {"train/moe_load/0/0", "train/loss_moe_balance", "eval/moe_dropped_frac"} <= tags
    assert summary["final_step"] == 12

    # Lose everything after the step-6 checkpoint (inside the second log window), resume.
    import shutil
    shutil.rmtree(tmp_path / "full" / "checkpoints" / "12")
    again = Trainer(from_configdict(cd), str(tmp_path / "full"))
    _, loop = again.initial_state()
    assert loop["routing_groups"] == 1 and again._groups_said(loop) == ""
    # resumed on other devices, model.moe.groups=0 routes in other groups: said (a bug hunt)
    assert again._groups_said({"routing_groups": 4}) == (
        "; its MoE routing groups follow the devices (model.moe.groups=0): 4 before, 1 now, so "
        "capacity keeps other tokens (set model.moe.groups=4 to route as before)")
    with pytest.MonkeyPatch.context() as m:  # from 1 group to 4 shards: 1 is refused there
        m.setattr(again, "routing_groups", lambda: 4)
        assert again._groups_said({"routing_groups": 1}).endswith(
            "(model.moe.groups must be a multiple of the 4 data-parallel shards here, so a "
            "layout of 1 shard routes as before)")
    again.run()
    resumed = [l for l in read_jsonl(tmp_path / "full" / "metrics.jsonl") if not l.get("eval")]
    for a, b in zip(train, resumed, strict=True):
        for key in ("loss", "loss_moe_balance", "moe_dropped_frac", "moe_load"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5)


# 6.5, 6.1, 6.3 and 7.2 s in four suites on the 2-core Zen 3 (2026-12-01) with two of its three
# runs, the README's command over 10 min there from an empty kernel cache: CI's slow part runs it
@pytest.mark.slow
def test_router_aux_losses_reach_the_gradient(tmp_path):
    """The router's auxiliary losses are part of the objective: its gradient changes with the
    balance weight and with the z-loss weight (review r18: z_loss was always 0 here), the
    experts' does not (the task loss alone reaches them)."""
    from hpnlp.train import Trainer
    from hpnlp.train.loop import _global
    grads = {}
    for w in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):  # (balance_loss, z_loss)
        cd = _tiny_moe(balance_loss=w[0], z_loss=w[1])
        cd.model.dropout = 0.0
        tr = Trainer(from_configdict(cd), str(tmp_path / "_".join(map(str, w))))
        state, _ = tr.initial_state()
        batch = _global(next(tr.train_iter), tr.batch_sharding)
        from hpnlp.train import carry as carry_lib
        loss_fn = carry_lib.objective(tr.model, tr.carries)

        def objective(p):
            sums, _ = loss_fn(p, state.carry, batch, {"dropout": jax.random.key(0)})
            return sums["loss"] + sums["loss_aux"]
        grads[w] = jax.jit(jax.grad(objective))(state.params)["trunk"]["block_1"]["moe"]
    for w in ((1.0, 0.0), (0.0, 1.0)):
        assert float(jnp.abs(grads[w]["router"] - grads[0.0, 0.0]["router"]).max()) > 1e-6, w
        np.testing.assert_allclose(grads[w]["wi"], grads[0.0, 0.0]["wi"], atol=1e-7, err_msg=str(w))


# The capacity dispatch unfactorized in the default run; the other three pairings (5-7 s each
# on the 2-core Zen 3; the factorized dropless one 4.4 s on the Xeon model 167 stepping 1,
# 2026-12-06, where the suite read 6 min 16 s for 1729 tests) in CI's slow part.
@pytest.mark.parametrize("dispatch_kind,factor,rank", [
    ("capacity", 0.75, 0), pytest.param("dropless", 1.0, 0, marks=pytest.mark.slow),
    pytest.param("capacity", 0.75, 3, marks=pytest.mark.slow),
    pytest.param("dropless", 1.0, 3, marks=pytest.mark.slow)])
def test_quantized_experts_are_each_experts_quantized_mlp(dispatch_kind, factor, rank):
    """Under quant.* covering `mlp`, each expert is its own quantized MLP: its weights per
    output channel, its inputs (the token, then its hidden row) per token; the router stays
    float. Outputs and STE gradients equal the per-token loop of that definition; the export
    packs wi and wo as [K, X, N] weights that decode to the same outputs; served, the
    capacity slots, the dropless blocks and decoding's slots run each expert on the int8
    kernel and compute the same. Factorized experts (rank 3: model.lowrank's U [X, K, r],
    V [X, r, N]) the same with two quantized products per weight, x U read per token, and
    two kernel calls per weight served."""
    from hpnlp.compress import formats, kernels
    from hpnlp.compress.qlinear import Factored, QWeight, Served
    from hpnlp.config import QuantConfig
    mod = layer(quant=QuantConfig(weights="int8", activations="int8"), router="top_k", top_k=2,
                dispatch=dispatch_kind, capacity_factor=factor)
    x, seg = inputs(lengths=(L, 5))
    p = init_params(mod, x, seg)
    fq = formats.fake_quant
    if rank:  # each expert's weights as two random factors
        ks = iter(jax.random.split(jax.random.key(4), 4))
        p = dict(p, **{n: Factored(jax.random.normal(next(ks), (X, K, rank)) / K ** 0.5,
                                   jax.random.normal(next(ks), (X, rank, N)) / rank ** 0.5,
                                   lead=1) for n, K, N in (("wi", M, F), ("wo", F, M))})

    def product(x_K, w, e):  # x (quantized per token) against expert e's quantized weight
        if rank:
            t = fq(x_K, "int8", (-1,)) @ fq(w.u[e], "int8", (0,))
            return fq(t, "int8", (-1,)) @ fq(w.v[e], "int8", (0,))
        return fq(x_K, "int8", (-1,)) @ fq(w[e], "int8", (0,))

    def quantized(p, e, x_M):
        h = jax.nn.gelu(product(x_M, p["wi"], e) + p["bi"][e])
        return product(h, p["wo"], e) + p["bo"][e]
    cap = None if dispatch_kind == "dropless" else routing.capacity(L, experts=X, top_k=2,
                                                                    factor=factor)
    choice, kept = loop_choices(p, x, seg, k=2, capacity=cap)
    r = jax.random.normal(jax.random.key(3), x.shape)

    def loss(p, x):
        return jnp.sum(mod.apply({"params": p}, x, seg, mutable=[AUX])[0] * r)

    def loss_ref(p, x):
        return jnp.sum(loop_reference(p, x, choice, kept, renormalize=True,
                                      expert=quantized) * r)
    (l, g), (l_ref, g_ref) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(p, x)
                              for f in (loss, loss_ref))
    np.testing.assert_allclose(float(l), float(l_ref), rtol=1e-5)
    chex.assert_trees_all_close(g, g_ref, atol=1e-5)
    float_y, _ = apply(layer(router="top_k", top_k=2, dispatch=dispatch_kind,
                             capacity_factor=factor), p, x, seg)
    y, got = jax.jit(lambda p: mod.apply({"params": p}, x, seg, mutable=[AUX, "qexport"]))(p)
    assert not np.allclose(np.asarray(y), np.asarray(float_y), atol=1e-4)  # it did quantize
    packed = dict(p, **got["qexport"])
    if rank:  # U [K, X, r] and V [r, X, N], contraction first
        wi, wo = packed["wi"], packed["wo"]
        assert isinstance(wi, Factored) and wi.lead == 1 and isinstance(wi.u, QWeight)
        assert wi.u.shape == (M, X, rank) and wi.v.shape == (rank, X, F)
        assert wo.u.scale.shape == (1, X * rank) and wo.v.scale.shape == (1, X * M)
    else:
        assert isinstance(packed["wi"], QWeight) and packed["wi"].shape == (M, X, F)
        assert packed["wo"].scale.shape == (1, X * M)  # one scale per expert's output channel
    run = jax.jit(lambda p: mod.apply({"params": p}, x, seg, mutable=[AUX])[0])
    y_packed = run(packed)
    np.testing.assert_allclose(np.asarray(y_packed), np.asarray(y), rtol=1e-6, atol=1e-6)
    if not kernels.available():
        return
    # ptq.serve's pass: each expert's weights prepared for the int8 kernel; capacity slots
    # and dropless blocks run on it (the kernel quantizes each row as the definition does)
    served = dict(p, **jax.jit(lambda p: mod.apply({"params": p}, x, seg,
                                                   mutable=[AUX, "qserve"])[1]["qserve"])(packed))
    if rank:
        assert isinstance(served["wi"].u, Served) and served["wi"].v.shape == (rank, X, F)
    else:
        assert isinstance(served["wi"], Served) and served["wi"].shape == (M, X, F)
    np.testing.assert_allclose(np.asarray(run(served)), np.asarray(y_packed), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(y_packed).max()))
    calls = run.lower(served).as_text().count("hpnlp_int8_linear")
    # capacity: each expert's two products; dropless: the two in the loop over blocks (a
    # factorized weight's are two each)
    per = 2 * (2 if rank else 1)
    assert calls == (per if dispatch_kind == "dropless" else per * X), calls
    m = mod.model  # a capacity this small would drop choices: decoding drops none
    dec = MoE(dataclasses.replace(m, moe=dataclasses.replace(m.moe, eval_capacity_factor=0.25)),
              deterministic=True, decode=True)
    # decoding serves the experts with a slot per token in every expert where a step has as
    # many choices as experts (2 x 8 tokens x 2 >= 4: each product's X calls), else with
    # dropless blocks, one a choice (one token's 2 choices: the products' calls in the loop
    # over blocks, 2 blocks of 1 row; it had been X calls, X - 2 of them on empty slots)
    for x_d, seg_d, count in ((x, seg, per * X), (x[:1, :1], seg[:1, :1], per)):
        if count == per * X and dispatch_kind != "dropless":
            continue  # the slots' case runs in the slow part
        run = jax.jit(lambda p: dec.apply({"params": p}, x_d, seg_d, mutable=[AUX])[0])
        want = run(packed)
        np.testing.assert_allclose(np.asarray(run(served)), np.asarray(want), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(want).max()))
        assert run.lower(served).as_text().count("hpnlp_int8_linear") == count


# -- Config errors, one line before anything compiles ------------------------------------

@pytest.mark.parametrize("moe,mesh,field", [
    ({"top_k": 5}, {}, "model.moe.top_k"),
    ({"router": "hash"}, {}, "model.moe.router"),
    ({"capacity_factor": 0.0}, {}, "model.moe.capacity_factor"),
    ({"eval_capacity_factor": -1.0}, {}, "model.moe.eval_capacity_factor"),
    ({"capacity_factor": float("inf")}, {}, "model.moe.capacity_factor"),  # session 92: took,
    ({"eval_capacity_factor": float("nan")}, {}, "model.moe.eval_capacity_factor"),  # then failed
    ({"router": "top_k", "top_k": 1}, {}, "model.moe.router"),
    ({"router": "switch", "top_k": 2}, {}, "model.moe.router"),
    ({"num_experts": 6}, {"data": 1, "expert": 4}, "model.moe.num_experts"),
    ({"dispatch": "dropless"}, {"data": 2, "expert": 2}, "model.moe.dispatch"),
    ({"groups": 3}, {}, "model.moe.groups"),
    ({"num_experts": 0, "top_k": 2, "router": "top_k"}, {}, "model.moe.top_k"),  # was dense, silently
    ({"dispatch": "dropless", "capacity_factor": 2.0}, {}, "model.moe.capacity_factor"),  # ignored
    ({"router": "expert_choice", "balance_loss": 0.1}, {}, "model.moe.balance_loss"),  # ignored
    # capacity dispatch: ignored, but by a token-choice LM's decoding (a review, session 114)
    ({"block_size": 64, "router": "expert_choice"}, {}, "model.moe.block_size"),
    ({}, {"data": 2, "pipeline": 2}, "mesh.pipeline"),  # (review, session 100: the checks
    ({"num_experts": 0}, {"data": 2, "expert": 2, "rules": {"batch": "data"}},
     "mesh.expert"),  # of the mesh, moved)
    # the crash hunt (session 110): XLA:CPU's compiler aborted the process
    ({"dtype": "bfloat16"}, {"data": 2, "expert": 2}, "model.dtype"),
])
def test_bad_moe_fields_fail_before_compile(moe, mesh, field, monkeypatch):
    from test_train import tiny
    cd = tiny()
    moe = dict(moe)
    if "dtype" in moe:
        cd.model.dtype = moe.pop("dtype")
        # refused on the CPU backend alone (where XLA aborted), also when the suite runs on
        # a GPU (JAX_PLATFORMS=cuda,cpu; a re-read, session 111)
        monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    cd.model.moe.update(**{"num_experts": X, **moe})
    cd.mesh.update(**mesh)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        validate(from_configdict(cd), num_devices=4)
    assert "\n" not in str(e.value)


def test_expert_choice_eval_capacity_factor_is_refused_for_a_new_run():
    """Review r4: expert choice evaluates at capacity_factor (its capacity is its routing), so
    its eval_capacity_factor is not read. A new run setting it is refused in one line
    (`check_new_run`); a saved run's config.json that set it before the rule (the workaround)
    still validates, so the run resumes and its tools read it (a diff review, session 105:
    refused in validate, none of them could). Token choice still reads the field."""
    from test_train import tiny

    from hpnlp.config.checks import check_new_run

    def cfg(**moe):
        cd = tiny()
        cd.model.moe.update(num_experts=X, **moe)
        return validate(from_configdict(cd), num_devices=1)

    saved = cfg(router="expert_choice", eval_capacity_factor=1.25)  # validates
    with pytest.raises(ConfigError, match=r"^config field `model\.moe\.eval_capacity_factor` = "
                       r"1\.25 is not allowed: is ignored with router='expert_choice', .*; "
                       r"leave it at its default 2\.0 \(model\.moe\.capacity_factor sets both\)$"):
        check_new_run(saved)
    check_new_run(cfg(router="expert_choice"))
    check_new_run(cfg(router="top_k", top_k=2, eval_capacity_factor=1.25))
    # a review (session 114): a token-choice LM of capacity dispatch decodes through
    # dropless blocks of model.moe.block_size, which was refused as ignored
    check_new_run(cfg(router="top_k", top_k=2, block_size=64))


def test_dropless_routing_groups_are_refused_for_a_new_run_and_divide_no_batch():
    """Review r1: dropless routes (and the router's losses, summed over the groups) are the
    same in any routing groups, and the layer pads rows they do not split, yet validate took
    groups=4, and refused groups=3 for not dividing the batch, a field nothing reads. A new
    run is refused a non-zero groups (`check_new_run`); a saved run's config.json that set
    it still validates, so the run resumes and its tools read it. Capacity dispatch, whose
    capacity binds per group, still takes groups that divide its batches and no others."""
    from test_train import tiny

    from hpnlp.config.checks import check_new_run, without_unread

    def cfg(**moe):
        cd = tiny()
        cd.model.moe.update(num_experts=X, router="top_k", top_k=2, **moe)
        cd.mesh.data = 4
        return validate(from_configdict(cd), num_devices=4)

    saved = cfg(dispatch="dropless", groups=3)  # validates: 3 groups, 8 rows, 4 shards
    with pytest.raises(ConfigError, match=r"^config field `model\.moe\.groups` = 3 is not "
                       r"allowed: model\.moe\.dispatch='dropless' computes every choice of "
                       r"every token: .*; use model\.moe\.dispatch='capacity', whose capacity "
                       r"binds per group, or leave it at its default "
                       r"\(--config\.model\.moe\.groups=0\)$"):
        check_new_run(saved)
    check_new_run(without_unread(saved))  # what `compress shrink` writes of such a run
    check_new_run(cfg(dispatch="dropless"))
    check_new_run(cfg(groups=8))
    with pytest.raises(ConfigError, match=r"`model\.moe\.groups` = 3 .*must divide the rows"):
        cfg(groups=3)


@pytest.mark.parametrize("moe,field", [
    ({"top_k": 5, "router": "top_k"}, "model.moe.top_k"),  # was lax.top_k's ValueError
    ({"top_k": 0}, "model.moe.top_k"),  # was an output of zeros
    ({"dispatch": "scatter"}, "model.moe.dispatch"),  # was capacity dispatch, silently
    ({"capacity_factor": -1.0}, "model.moe.capacity_factor"),  # was capacity 1, silently
    ({"num_experts": 0}, "model.moe.num_experts"),  # was a ZeroDivisionError
])
def test_moe_layer_built_directly_checks_its_fields(moe, field):
    # found by the crash hunt: `MoE(ModelConfig(...))` skips config.validate
    x, seg = inputs()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        layer(**moe).init(jax.random.key(0), x, seg)
    assert "\n" not in str(e.value)


def test_rows_the_groups_do_not_split_are_padded_to_whole_groups():
    """Review r4: passes with a row count of their own (a one-row init, the bi-encoder's
    256-row pool evaluation, mining's 512, the kNN-LM's 64) were refused by the layer where
    the groups did not divide their tokens (found earlier by the crash hunt as a reshape
    TypeError), so a valid groups=3 run died at one. Padded with empty rows instead: 2 rows
    in 3 groups route as 2 rows in 2 groups (one row a group, the same capacity)."""
    x, seg = inputs(lengths=(L, 5))
    p = init_params(layer(), x, seg)
    for kw in ({"router": "switch"}, {"router": "expert_choice"},
               {"router": "top_k", "top_k": 2, "dispatch": "dropless"}):
        y3, stats3 = apply(layer(groups=3, **kw), p, x, seg)
        y2, stats2 = apply(layer(groups=2, **kw), p, x, seg)
        np.testing.assert_allclose(y3, y2, atol=1e-6)
        chex.assert_trees_all_close(stats3, stats2, atol=1e-5)


@pytest.mark.parametrize("moe,field,rest", [
    ({"mlp_dim": 8}, "mlp_dim` = 8", r"each expert 16 wide, and this run's are 8; set it to 16 "
     r"\(that run's experts' width\), and for narrower experts convert in two runs: cut the "
     r"experts first, then prune .* and shrink .*"),
    ({"every": 2}, "every` = 2", r"that run's MoE blocks \(every 1\); set it to 1"),
    ({"shared_experts": 1}, "shared_experts` = 1", "that run's 0 shared experts; set it to 0"),
])
def test_fewer_experts_of_another_shape_are_refused_in_one_line(moe, field, rest):
    # a bug hunt (session 98): cutting 8 experts to 4 with another expert width, `every` or
    # shared experts passed, then failed at the first step (a flax shape error) or in a
    # many-line device_put error naming no field, after calibration and with a workdir made
    from hpnlp.compress import experts
    src = ModelConfig(width=M, mlp_dim=F, moe=MoEConfig(num_experts=8))
    dst = dataclasses.replace(src, moe=MoEConfig(num_experts=4, **moe))
    with pytest.raises(ConfigError, match=rf"^config field `model\.moe\.{field} is not allowed: "
                       rf"cutting train\.init_from=W's 8 experts to 4 keeps {rest}$") as e:
        experts.change(src, dst, "W")
    assert "\n" not in str(e.value)
    assert experts.change(src, dataclasses.replace(src, moe=MoEConfig(num_experts=4)),
                          "W") == "prune"


def test_cutting_experts_keeps_the_source_dispatch_and_this_runs_noise():
    """A cut of the experts restores the source in a config it accepts and gives the tree of
    this run: a bug hunt (session 103) found an expert-choice source given this run's
    dispatch='dropless' (refused when built, naming this run's legal field), and a change of
    model.moe.noisy keeping the source's noise weights (device_put failed naming no field)."""
    from hpnlp.compress import experts
    from hpnlp.config import check_moe_fields
    dst = moe_model("lm", router="top_k", top_k=2, dispatch="dropless")
    src = lambda **moe: dataclasses.replace(  # noqa: E731 (the source run's model, 8 experts)
        dst.model, moe=MoEConfig(num_experts=8, every=2, **moe))
    source = experts.conversion(dst, src(router="expert_choice"), "W").source.model.moe
    assert (source.router, source.dispatch) == ("expert_choice", "capacity")
    check_moe_fields(source)
    # a token-choice source keeps its own dispatch too (review, session 107: it took this
    # run's; test_cutting_experts_ranks_them_as_the_source_evaluates)
    assert experts.conversion(dst, src(), "W").source.model.moe.dispatch == "capacity"

    def tree(x, noisy, seed):
        r = jax.random.normal(jax.random.key(seed), (M, x))
        moe = {"router": r, "wi": jnp.zeros((x, M, F)), "bi": jnp.zeros((x, F)),
               "wo": jnp.zeros((x, F, M)), "bo": jnp.zeros((x, M))}
        return {"embed": jnp.ones(3), "trunk": {"block_1": {"moe": {
            **moe, **({"noise": 2.0 * r + seed} if noisy else {})}}}}
    for was, now in [(True, False), (False, True), (True, True)]:
        mine = dataclasses.replace(dst, model=dataclasses.replace(
            dst.model, moe=dataclasses.replace(dst.model.moe, noisy=now)))
        fresh = tree(X, now, 1)
        got = experts.conversion(mine, src(noisy=was), "W").convert(
            tree(8, was, 0), None, fresh, jax.random.key(2))
        assert jax.tree.structure(got) == jax.tree.structure(fresh)
        if now:  # the kept experts' noise columns where both are noisy, else this run's
            moe = got["trunk"]["block_1"]["moe"]
            want = 2.0 * moe["router"] if was else fresh["trunk"]["block_1"]["moe"]["noise"]
            np.testing.assert_array_equal(moe["noise"], want)


def test_cutting_experts_ranks_them_as_the_source_evaluates():
    """A review (session 107): a token-choice source was routed with this run's dispatch, so
    a capacity source cut by a dropless run ranked its experts by gate weight that included
    the choices its own evaluation drops (and a dropless source cut by a capacity run lost
    choices at an eval_capacity_factor it never used), where the docs promise the routes of
    the source's evaluation: `experts.usage` of the conversion's source model is the gate
    weight `hpnlp.moe.route` reports for the source run."""
    from hpnlp.compress import experts
    from hpnlp.moe import route
    dst = moe_model("lm", router="top_k", top_k=2, dispatch="dropless")
    src = dataclasses.replace(dst, model=dataclasses.replace(dst.model, moe=MoEConfig(
        num_experts=8, every=2, router="top_k", top_k=2, eval_capacity_factor=0.5)))
    source = experts.conversion(dst, src.model, "W").source
    batch = lm_batch(lengths=(16, 11))
    _, params = init(src, batch)
    got = experts.usage(models.build(source, deterministic=True), params, [batch])
    w = route(src, params, batch, num_devices=1)[1]["weights"]
    real = batch["segment_ids"] > 0
    assert ((w > 0).sum(-1)[real] < 2).any()  # the source's evaluation drops choices
    np.testing.assert_allclose(got[("trunk", "block_1", "moe")][0], w.sum((0, 1)), rtol=1e-5)


# 3.2 s on the Xeon model 167 (2026-12-06): CI's slow part runs it
@pytest.mark.slow
def test_cutting_experts_of_a_random_feature_run_routes_under_its_trained_draw(tmp_path):
    """A review (session 107): the expert calibration of a Performer `train.init_from` run
    routed under its seed's projection, not the draw it trained with (its saved rng and
    step), so experts were ranked by another function's routes (as the key/value fits were,
    `gqa.calibrated_from`): the conversion's calibrate, routed and merged, reads it."""
    from hpnlp.compress import experts
    from test_compress_sparse import _distill_batch, _teacher_workdir, tiny
    cd = tiny("lm")
    cd.model.depth = 2
    cd.model.moe.update(num_experts=4, router="top_k", top_k=2)
    cd.attention.update(name="performer", options={"num_features": 8})
    cd.train.feature_redraw_every = 1
    src, model, state = _teacher_workdir(tmp_path, cd, step=3)
    batch = _distill_batch("lm", np.random.default_rng(5))
    cd.model.moe.num_experts = 2  # this run cuts the source's 4
    dst = validate(from_configdict(cd))
    routed = experts.conversion(dst, src.model, str(tmp_path)).calibrate
    got = routed(model, state.params, [batch])
    want, seed = (experts.usage(model, state.params, [batch], rngs)
                  for rngs in ({"features": state.features_key(1)}, None))
    for path in want:
        chex.assert_trees_all_close(got[path], want[path], rtol=1e-6, atol=1e-6)
    last = max(want)  # the last MoE layer reads a Performer's output
    assert not np.allclose(got[last][1], seed[last][1], rtol=1e-4)
    cd.train.update(init_from=str(tmp_path), init_experts="merged")
    plans = experts.conversion(validate(from_configdict(cd)), src.model,
                               str(tmp_path)).calibrate(model, state.params, [batch])
    np.testing.assert_allclose(plans[last]["weight"], want[last][0], rtol=1e-6)
    # hpnlp.moe.route too (a review, session 117: it routed under the seed's draw, unsaid)
    from hpnlp.moe import route
    from hpnlp.retrieval import RetrievalError
    cfg = src  # the source run's config: 4 experts
    with pytest.raises(RetrievalError, match="so hpnlp.moe.route needs the draw it trained with"):
        route(cfg, state.params, batch)
    routes = route(cfg, state.params, batch, features_key=state.features_key(1))
    b = max(routes)  # the last MoE block's index
    assert not np.allclose(routes[b]["probs"], route(
        cfg, state.params, batch, features_key=jax.random.key(0))[b]["probs"], rtol=1e-4)


def test_moe_statistics_summary():
    from hpnlp.moe import summarize
    sums = {"moe_tokens": 10.0, "moe_entropy": 5.0, "moe_assigned": 20.0, "moe_dropped": 2.0,
            "moe_load": np.array([[8.0, 4.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])}
    out = summarize(sums)
    assert out["moe_dropped_frac"] == 0.1 and out["moe_router_entropy"] == 0.5
    assert out["moe_load_max_vs_mean"] == pytest.approx(8.0 / 5.0)
    assert out["moe_load"][0] == [0.4, 0.2, 0.2, 0.2]
    json.dumps(out)
    assert dataclasses.is_dataclass(MoEConfig())


def test_route_reports_where_tokens_went():
    """hpnlp.moe.route: per token, the kept choices' gates on their experts; padding nowhere."""
    from hpnlp.moe import route
    cfg = moe_model("lm", eval_capacity_factor=0.5)  # tight: some choices dropped
    batch = lm_batch(lengths=(16, 11))
    model, params = init(cfg, batch)
    routes = route(cfg, params, batch)
    assert list(routes) == [1]
    w, probs = routes[1]["weights"], routes[1]["probs"]
    assert w.shape == probs.shape == (B, 16, X)
    pad = batch["segment_ids"] == 0
    assert np.all(w[pad] == 0.0)
    routed = (w > 0).sum(-1)
    assert routed.max() == 1 and 0 < routed.sum() < (~pad).sum()  # top-1, some dropped
    top = probs.argmax(-1)
    np.testing.assert_allclose(w.max(-1)[routed == 1], probs.max(-1)[routed == 1], rtol=1e-6)
    assert np.all(w.argmax(-1)[routed == 1] == top[routed == 1])
    # a bug hunt (session 100): with model.moe.groups=0 route() routed as one group, where
    # the run's evaluation routes one group per data-parallel shard of its mesh
    from hpnlp.moe import eval_groups
    assert cfg.model.moe.groups == 0 and eval_groups(cfg, 1) == 1 and eval_groups(cfg, 4) == 4
    mesh = lambda **axes: dataclasses.replace(cfg, mesh=dataclasses.replace(  # noqa: E731
        cfg.mesh, **axes))
    assert eval_groups(mesh(data=2, tensor=2), 4) == 2  # tensor does not split the batch
    assert eval_groups(mesh(data=1, expert=4), 4) == 4  # rules.batch names expert
    assert eval_groups(mesh(data=8), 4) == 4  # read with every device on the data axis
    # a bug hunt (session 100): the output layer ran, built without the task's counts, so a
    # class_based run's classes (as many as its counts bin, here 29) failed in flax; routing
    # reads the trunk only (one route() for both findings: each call compiles)
    cb = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name="class_based"))
    wide = dict(params, output={**params["output"], "classes": {
        "kernel": jnp.zeros((29, cfg.model.width)), "bias": jnp.zeros((29,))}})
    two = route(cb, wide, batch, num_devices=2)[1]["weights"]
    moe2 = dataclasses.replace(cfg.model.moe, groups=2)
    model2 = models.build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe2)),
                          deterministic=True)
    _, aux = jax.jit(lambda p: model2.apply({"params": p}, batch, method="evaluate",
                                            mutable=[AUX]))(params)
    dropped2 = float(aux[AUX]["trunk"]["block_1"]["moe"]["moe"][0]["moe_dropped"])
    assert ((two > 0).sum(-1) == 0)[~pad].sum() == dropped2
    assert not np.array_equal(two, w)  # other tokens dropped than in one group
    # found in review: stacked layers failed with a KeyError deep in the collection
    with pytest.raises(ValueError, match="cannot read stacked layers"):
        route(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, stack_layers=True)),
              params, batch)
    # a README walk: a dense model was a bare KeyError
    with pytest.raises(ValueError, match=r"no MoE blocks \(model.moe.num_experts=0\)"):
        route(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, moe=dataclasses.replace(cfg.model.moe, num_experts=0))), params, batch)


def test_route_of_a_dropless_run_takes_a_batch_of_any_rows():
    """Review r4: a dropless run read on 4 devices (groups=0: 4 routing groups) refused a
    2-row batch, though dropless token choice drops nothing and routes alike in any groups."""
    from hpnlp.moe import route
    cfg = moe_model("lm", router="top_k", top_k=2, dispatch="dropless", eval_capacity_factor=2.0)
    batch = lm_batch(lengths=(16, 11))
    model, params = init(cfg, batch)
    four = route(cfg, params, batch, num_devices=4)[1]
    one = route(cfg, params, batch, num_devices=1)[1]
    np.testing.assert_array_equal(four["weights"], one["weights"])
    real = batch["segment_ids"] > 0
    assert np.all((four["weights"] > 0).sum(-1)[real] == 2)  # nothing dropped


def test_knnlm_pads_its_batches_to_whole_routing_groups(tmp_path):
    """Review r4: the kNN-LM's 1-row width probe and its 4-row batches of 16 tokens, which 3
    routing groups (model.moe.groups=3) do not split, failed once the datastore's folder was
    made. Padded with empty rows to whole groups; with no choice dropped (eval capacity X),
    a training chunk's own contexts are their own nearest keys."""
    from hpnlp.data.task import lm_chunks
    from hpnlp.retrieval import knnlm
    from flax.core import FrozenDict
    cfg = moe_model("lm", groups=3)  # the kNN-LM's jitted forward is cached by its model:
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(  # options hashable
        cfg.attention, options=FrozenDict()))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, V, n).astype(np.int32) for n in rng.integers(5, 40, 8)]
    train = lm_chunks(docs, 16)
    model, params = init(cfg, next(knnlm.ordered_batches(train, rows=3, seq_len=16)))
    store = knnlm.build_datastore(model, params, train, str(tmp_path / "ds"), seq_len=16,
                                  rows=4)
    assert len(store.keys) == int(np.sum(train.lengths - 1))
    np.testing.assert_array_equal(store.values, np.concatenate(
        [train.tokens[s + 1:s + n] for s, n in zip(train.starts, train.lengths)]))
    nb = knnlm.neighbours(model, params, train, store, store.index("exact"), seq_len=16, k=1,
                          rows=4, select=[0])
    assert len(nb.hit) == train.lengths[0] - 1 and nb.hit[:, 0].mean() > 0.9
    # its keys are those of 3 groups: a model routing in others is refused it (a review,
    # session 116: one built before the run's groups were pinned was reused, unsaid)
    assert store.header["routing_groups"] == 3
    other = models.build(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, moe=dataclasses.replace(cfg.model.moe, groups=1))), deterministic=True)
    with pytest.raises(knnlm.RetrievalError, match=r"computed in 3 MoE routing group\(s\), and "
                       r"this run's model routes in 1 "):
        knnlm.datastore_for(other, params, train, str(tmp_path / "ds"), seq_len=16)
    assert knnlm.datastore_for(model, params, train, str(tmp_path / "ds"), seq_len=16)[1] is False
    # one built before the groups were recorded (their keys routed in one, outside a mesh)
    path = tmp_path / "ds" / knnlm.DATASTORE
    header = json.loads(path.read_text())
    del header["routing_groups"]
    path.write_text(json.dumps(header))
    with pytest.raises(knnlm.RetrievalError, match=r"computed in MoE routing groups it does "
                       r"not record .*, and this run's model routes in 3 "):
        knnlm.datastore_for(model, params, train, str(tmp_path / "ds"), seq_len=16)


# 2.6 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_route_and_expert_usage_read_every_text_of_a_dual_encoder():
    """A bug hunt (session 103): route() on a dual encoder's batch (inputs1, inputs2) was a
    bare KeyError 'inputs', and experts.usage (the calibration of train.init_experts) read
    the trunk's first call only, its padding counted (the batch has no `segment_ids`)."""
    from hpnlp.compress import experts
    from hpnlp.moe import route
    cfg = moe_model("dual_encoder")
    batch = BATCHES["dual_encoder"]()
    model, params = init(cfg, batch)
    routes = route(cfg, params, batch, num_devices=1)[1]
    assert sorted(routes) == ["probs1", "probs2", "weights1", "weights2"]
    weight, gram = experts.usage(model, params, [batch])[("trunk", "block_1", "moe")]
    want_w, want_g = 0.0, 0.0
    for t in "12":
        real = batch["segment_ids" + t] > 0
        assert not real.all() and np.all(routes["weights" + t][~real] == 0.0)
        p_NX = routes["probs" + t][real].astype(np.float64)
        want_w, want_g = want_w + routes["weights" + t].sum((0, 1)), want_g + p_NX.T @ p_NX
    np.testing.assert_allclose(weight, want_w, rtol=1e-5)
    np.testing.assert_allclose(gram, want_g, rtol=1e-5)


def test_fold_aux_keeps_vectors_per_layer_and_scalars_summed():
    """fold_aux: scalars summed over the reporting calls, a vector kept per call (even of
    length 1), a scanned block's leading layer axis split into its layers."""
    from hpnlp.train.carry import fold_aux
    one = {"loss": jnp.float32(0.5), "loss_moe_z": jnp.float32(2.0), "n": jnp.float32(3.0),
           "load": jnp.ones((1,))}
    scanned = {"loss": jnp.array([0.25, 0.25]), "loss_moe_z": jnp.array([1.0, 3.0]),
               "n": jnp.array([1.0, 1.0]), "load": jnp.full((2, 1), 2.0)}
    aux = {"block_10": {"moe": {"moe": (one,)}}, "block_2": {"moe": {"moe": (one,)}},
           "stack": {"moe": {"moe": (scanned,)}}}
    out = fold_aux({"loss": jnp.float32(7.0), "weight": jnp.float32(4.0)}, aux)
    assert float(out["loss"]) == 7.0 and float(out["loss_aux"]) == pytest.approx(1.5 * 4.0)
    assert float(out["loss_moe_z"]) == pytest.approx((2 + 2 + 1 + 3) / 4 * 4.0)
    assert float(out["n"]) == 8.0
    np.testing.assert_array_equal(out["load"], [[1.0], [1.0], [2.0], [2.0]])
    assert "loss_aux" not in fold_aux({"loss": 1.0, "weight": 1.0}, aux, add_loss=False)
    # a layer called twice (a shared trunk applied twice) is one layer: its loads
    # summed, its loss parts averaged (a bug hunt, session 95: 2 layers logged as 4)
    other = {**one, "loss_moe_z": jnp.float32(4.0), "load": jnp.full((1,), 3.0)}
    out = fold_aux({"loss": jnp.float32(7.0), "weight": jnp.float32(1.0)},
                   {"block_1": {"moe": {"moe": (one, other)}}})
    np.testing.assert_array_equal(out["load"], [[4.0]])
    assert float(out["loss_aux"]) == 1.0 and float(out["loss_moe_z"]) == 3.0
    assert float(out["n"]) == 6.0


def test_each_experts_weights_start_at_the_dense_mlps_fan_in():
    """A review (session 103): the experts axis counted into lecun_normal's fan-in, so with X
    experts each expert's wi [M, F] and wo [F, M] started sqrt(X) smaller than the dense MLP
    it stands for; each now has std 1 / sqrt(its own fan-in)."""
    mod = MoE(ModelConfig(width=64, mlp_dim=256, dropout=0.0, moe=MoEConfig(num_experts=8)),
              deterministic=True)
    x, seg = jnp.ones((1, 8, 64)), jnp.ones((1, 8), jnp.int32)
    p = jax.tree.map(lambda a: a.unbox() if hasattr(a, "unbox") else a,
                     jax.jit(mod.init)(jax.random.key(0), x, seg)["params"],
                     is_leaf=lambda a: hasattr(a, "unbox"))
    np.testing.assert_allclose(float(jnp.std(p["wi"])), 64 ** -0.5, rtol=0.05)
    np.testing.assert_allclose(float(jnp.std(p["wo"])), 256 ** -0.5, rtol=0.05)


def test_capacity_is_the_ceiling_of_the_factor_as_written():
    """A review (session 116): 1.1 * 720 * 1 / 8 in floats is 99 + 2^-46, so ceil gave each
    expert 100 slots, one more than the documented ceil(factor * S * k / X)."""
    assert routing.capacity(720, experts=8, top_k=1, factor=1.1) == 99
    assert routing.capacity(1440, experts=8, top_k=1, factor=1.1) == 198
    assert routing.capacity(50, experts=5, top_k=1, factor=1.1) == 11
    assert routing.capacity(64, experts=8, top_k=2, factor=1.25) == 20  # exact: unchanged
    assert routing.capacity(7, experts=8, top_k=1, factor=1.0) == 1  # at least 1
    assert routing.capacity(4, experts=2, top_k=2, factor=2.0) == 4  # at most the tokens


@pytest.mark.slow  # a Trainer and its checkpoint: 13 s alone on the Xeon model 207
def test_knnlm_reads_a_language_model_in_the_runs_routing_groups(tmp_path):
    """A review (session 116): `knnlm.load_trained` pinned the run's MoE routing groups
    (model.moe.groups=0 follows the devices) for a bi-encoder only; a language model ran in
    one group outside a mesh, so capacity dropped other tokens than the run's own
    evaluation, and the datastore's keys and perplexities were another function's."""
    from hpnlp.retrieval import knnlm
    from hpnlp.train import Trainer
    cd = _tiny_moe(eval_capacity_factor=0.5)
    workdir = str(tmp_path / "lm")
    tr = Trainer(from_configdict(cd), workdir)
    state, _ = tr.initial_state()
    # saved as a run of 2 data-parallel shards saves its routing groups (`Trainer.run`)
    tr.checkpointer.save(0, state, tr.train_iter.get_state(), {"routing_groups": 2})
    tr.checkpointer.close()
    model = knnlm.load_trained(workdir, "lm", "train one")[1]
    assert model.cfg.model.moe.groups == 2
