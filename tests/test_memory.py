"""Activation memory tools: named remat policies and reversible blocks.

Each is checked against its exact twin (remat policies against no remat; the reversible
stack's custom VJP against plain autodiff of the same blocks), and for what it saves:
saved residuals for remat, compiled temp memory for reversible blocks.
"""

import contextlib
import dataclasses
import importlib
import io
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import (REMAT_NAMES, AttentionConfig, ModelConfig, default_configdict,
                          from_configdict)
from hpnlp.models.reversible import ReversibleStack
from hpnlp.train import Trainer
from hpnlp.train.loop import _global
from test_models import B, L, V, lm_batch

E = 16


def make_cfg(**model_kw):
    cfg = from_configdict(default_configdict())
    model = dict(kind="lm", vocab_size=V, width=E, depth=2, num_heads=2, mlp_dim=32, max_len=L,
                 dropout=0.1)
    model.update(model_kw)
    return dataclasses.replace(cfg, model=ModelConfig(**model))


RNGS = {"dropout": jax.random.key(1), "features": jax.random.key(2)}
POLICIES = ["full", "dots_saveable", "names:qkv,mlp_in", "elementwise"]


# Compile-time savers (LLVM effort only; HLO passes and buffer assignment are untouched):
# these tests measure results and memory, never speed.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compile_fast(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)


def run_fast(fn, *args):
    return compile_fast(fn, *args)(*args)


def random_params(module, *args, scale=0.3):
    """Parameters of `module` drawn on the host: no compile of the random initializers."""
    shapes = jax.eval_shape(lambda: module.init({"params": jax.random.key(0),
                                                 "dropout": jax.random.key(1)}, *args))["params"]
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, scale, s.shape), s.dtype),
                        nn.unbox(shapes))


def lm_loss(remat, **kw):
    model = models.build(make_cfg(remat=remat, **kw), deterministic=False)
    return lambda params, batch: model.apply({"params": params}, batch, rngs=RNGS)["loss"]


@pytest.fixture(scope="module")
def lm_params():
    return random_params(models.build(make_cfg(), deterministic=True), lm_batch())


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_every_remat_policy_gives_the_same_loss_and_gradients(lm_params):
    # One compile for all policies (each compile costs seconds on a busy CPU).
    out = run_fast(lambda p, b: {pol: jax.value_and_grad(lm_loss(pol))(p, b)
                                 for pol in ["none"] + POLICIES}, lm_params, lm_batch())
    loss, grads = out["none"]
    assert float(jnp.abs(jax.tree.leaves(grads)[0]).sum()) > 0
    for policy in POLICIES:  # dropout on: the recompute must draw the same masks
        loss2, grads2 = out[policy]
        np.testing.assert_allclose(loss2, loss, rtol=1e-5, err_msg=policy)
        chex.assert_trees_all_close(grads2, grads, atol=1e-5, rtol=1e-5, custom_message=policy)


def saved(fn, *args):
    """(bytes, {name: bytes}) of the residuals autodiff keeps between forward and backward."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    total, names = 0, {}
    sizes = {"f32": 4, "i32": 4, "u32": 4, "bf16": 2, "f16": 2, "bool": 1, "key<fry>": 8}
    for line in out.getvalue().splitlines():
        m = re.match(r"(\w+(?:<\w+>)?)\[([\d,]*)\] (.*)", line)
        assert m, line  # every line parsed: the byte counts below are complete
        size = sizes[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d]))
        total += size
        named = re.match(r"named '(\w+)'", m.group(3))
        if named:
            names[named.group(1)] = names.get(named.group(1), 0) + size
    return total, names


def test_each_remat_policy_saves_what_it_says(lm_params):
    batch = lm_batch()
    rest = "names:context,attention_out"
    kept = {p: saved(lambda params: lm_loss(p)(params, batch), lm_params)
            for p in ["none", "full", "dots_saveable", "names:qkv,mlp_in", rest, "elementwise"]}
    depth = 2
    # Exactly the named activations are saved by name: qkv [B, L, 3, H, D] and mlp_in
    # [B, L, F] of every block, float32.
    assert kept["names:qkv,mlp_in"][1] == {"qkv": depth * 4 * B * L * 3 * E,
                                           "mlp_in": depth * 4 * B * L * 32}
    assert kept[rest][1] == {"context": depth * 4 * B * L * E, "attention_out": depth * 4 * B * L * E}
    assert set(kept[rest][1]) | set(kept["names:qkv,mlp_in"][1]) == set(REMAT_NAMES)
    assert kept["full"][1] == {}
    # full (block inputs only) < names (+ qkv, mlp_in) < none (everything autodiff wants).
    assert kept["full"][0] < kept["names:qkv,mlp_in"][0] < kept["none"][0]
    assert kept["names:qkv,mlp_in"][0] - kept["full"][0] >= 0.9 * sum(kept["names:qkv,mlp_in"][1].values())
    assert kept["full"][0] < kept["dots_saveable"][0] < kept["none"][0]
    # elementwise: at least both layer norms' outputs [B, L, E] and gelu's [B, L, F] of
    # every block are no longer kept (their own intermediates go too).
    assert kept["none"][0] - kept["elementwise"][0] >= depth * 4 * B * L * (2 * E + 32)


def rev_stack(depth=2, recompute=True, causal=True, deterministic=False, dropout=0.1,
              pos_emb="learned"):
    m = make_cfg(depth=depth, dropout=dropout, reversible=True, pos_emb=pos_emb).model
    return ReversibleStack(m, AttentionConfig(), causal=causal, deterministic=deterministic,
                           recompute=recompute)


def rev_inputs(depth=2, seed=0):
    x_BLE = jax.random.normal(jax.random.key(seed), (B, L, E))
    seg_BL = jnp.asarray(lm_batch()["segment_ids"])
    return random_params(rev_stack(depth), x_BLE, seg_BL), x_BLE, seg_BL


def rev_loss(module, seg_BL, pos_BL=None):
    def loss(params, x_BLE):
        y_BLE = module.apply({"params": params}, x_BLE, seg_BL, pos_BL, rngs=RNGS)
        return jnp.sum(jnp.sin(y_BLE) * jnp.arange(E, dtype=jnp.float32).reshape(1, 1, E)), y_BLE
    return loss


# learned: 3.3 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite read
# 7 min 58 s for 1838 tests): CI's slow part runs it (rope stays)
@pytest.mark.parametrize("pos_emb", [pytest.param("learned", marks=pytest.mark.slow), "rope"])
def test_reversible_custom_vjp_matches_plain_autodiff(pos_emb):
    """(rope: the attention halves get the positions beside the segment ids, in the replayed
    backward too.)"""
    params, x_BLE, seg_BL = rev_inputs()
    pos_BL = jnp.asarray(lm_batch()["positions"]) if pos_emb == "rope" else None
    grad = lambda rec: jax.value_and_grad(  # noqa: E731
        rev_loss(rev_stack(recompute=rec, pos_emb=pos_emb), seg_BL, pos_BL),
        argnums=(0, 1), has_aux=True)
    other_key = lambda p, x: rev_stack(pos_emb=pos_emb).apply(  # noqa: E731
        {"params": p}, x, seg_BL, pos_BL, rngs={**RNGS, "dropout": jax.random.key(9)})
    ((_, y), g), ((_, y_ref), g_ref), y2 = run_fast(
        lambda p, x: (grad(True)(p, x), grad(False)(p, x), other_key(p, x)), params, x_BLE)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(g, g_ref, rtol=1e-5, atol=1e-5)  # params and inputs
    assert all(float(jnp.abs(t).max()) > 0 for t in jax.tree.leaves(g))
    # Dropout is on: another key gives other outputs (so the match above used the same masks).
    assert float(jnp.max(jnp.abs(y2 - y))) > 1e-3


# lsh: 5.8 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite read
# 7 min 58 s for 1838 tests): CI's slow part runs it (clustered stays)
@pytest.mark.parametrize("name,opts,routing_fn", [
    pytest.param("lsh", {"chunk_size": 4, "num_buckets": 4}, "hash_buckets",
                 marks=pytest.mark.slow),
    ("clustered", {"chunk_size": 4, "num_clusters": 3}, "route")])
def test_reversible_backward_reuses_the_forwards_routing(name, opts, routing_fn, monkeypatch):
    """A bug hunt (session 100): the backward replayed F on x2 = y2 - G(y1), the forward's x2
    only to rounding, and `lsh` hashed it again (`clustered` routed it again): in bfloat16
    155 of 4096 buckets moved (L=512, depth 6). Now each block's routing is chosen once, in
    the forward (counted at trace time: no compile), and the backward reuses it."""
    module = importlib.import_module(f"hpnlp.attention.{name}")
    calls = []
    real = getattr(module, routing_fn)
    monkeypatch.setattr(module, routing_fn, lambda *a: calls.append(1) or real(*a))
    _, x_BLE, seg_BL = rev_inputs()
    m = make_cfg(depth=2, dropout=0.0, reversible=True, dtype="bfloat16").model
    stack = ReversibleStack(m, AttentionConfig(name, opts), causal=True, deterministic=True)
    params = random_params(stack, x_BLE, seg_BL)
    calls.clear()  # init's
    jax.make_jaxpr(jax.grad(lambda p, x: rev_loss(stack, seg_BL)(p, x)[0], (0, 1)))(params, x_BLE)
    assert len(calls) == m.depth  # the forward's only (it was 2 * depth)
    if name == "lsh":  # and the gradients are plain autodiff's, in bfloat16
        plain = dataclasses.replace(stack, recompute=False)
        grad = lambda mod: jax.value_and_grad(rev_loss(mod, seg_BL), (0, 1), has_aux=True)
        ((_, y), g), ((_, y_ref), g_ref) = run_fast(
            lambda p, x: (grad(stack)(p, x), grad(plain)(p, x)), params, x_BLE)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(g, g_ref, rtol=1e-4, atol=1e-4)


# 2.6 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_reversible_keeps_causality_and_segments():
    """Review r18: the changes are a vector, not a constant (the layer norm in front of each
    attention cancels `+ 1.0`, so the unchanged-position checks held for any stack), and
    bidirectionality is shown, not assumed (a causal stack passed the segment checks)."""
    params, x_BLE, seg_BL = rev_inputs()
    seg_BL = jnp.asarray([[1] * 8 + [2] * 8, [1] * 11 + [0] * 5], jnp.int32)
    d_E = jax.random.normal(jax.random.key(5), (E,))
    changed_BLE = x_BLE.at[:, 11:].add(d_E)
    run = lambda causal, x: rev_stack(causal=causal, deterministic=True).apply(
        {"params": params}, x, seg_BL)
    both_BLE = x_BLE.at[0, 8:].add(d_E).at[1, 11:].add(d_E)
    # one token changed inside segment 2 of row 0 (position 12) and inside row 1's segment (5)
    inside_BLE = x_BLE.at[0, 12].add(d_E).at[1, 5].add(d_E)
    y, y2, y3, z, z2, z3 = run_fast(
        lambda x, c, b, i: (run(True, x), run(True, c), run(True, i), run(False, x), run(False, b),
                            run(False, i)),
        x_BLE, changed_BLE, both_BLE, inside_BLE)
    moved = lambda a, b: jnp.max(jnp.abs(a - b), -1)  # noqa: E731  (per position)
    np.testing.assert_allclose(y2[:, :11], y[:, :11], atol=1e-6)  # causal: the past ignores the future
    assert float(jnp.max(jnp.abs(y2[:, 11:] - y[:, 11:]))) > 1e-3
    np.testing.assert_allclose(y3[0, :12], y[0, :12], atol=1e-6)
    np.testing.assert_allclose(y3[1, :5], y[1, :5], atol=1e-6)
    assert float(jnp.min(moved(y3[0, 13:], y[0, 13:]))) > 1e-3  # ... and the future sees it
    assert float(jnp.min(moved(y3[1, 6:11], y[1, 6:11]))) > 1e-3
    # Bidirectional: packed segment 1 never sees segment 2; real tokens never see padding.
    np.testing.assert_allclose(z2[0, :8], z[0, :8], atol=1e-6)
    np.testing.assert_allclose(z2[1, :11], z[1, :11], atol=1e-6)
    assert float(jnp.max(jnp.abs(z2[0, 8:] - z[0, 8:]))) > 1e-3
    # ... and it is bidirectional: other than the causal stack at every real token, and a
    # change moves every earlier position of its own segment, and none of another segment.
    assert float(jnp.min(moved(z[0], y[0]))) > 1e-3
    assert float(jnp.min(moved(z[1, :11], y[1, :11]))) > 1e-3
    assert float(jnp.min(moved(z3[0, 8:12], z[0, 8:12]))) > 1e-3, moved(z3, z)[0]
    np.testing.assert_allclose(z3[0, :8], z[0, :8], atol=1e-6)
    assert float(jnp.min(moved(z3[1, :5], z[1, :5]))) > 1e-3, moved(z3, z)[1]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_reversible_decode_matches_forward(pos_emb):
    """Decoding runs the bound blocks; training the pure functions: the same model."""
    cfg = make_cfg(reversible=True, dropout=0.0, pos_emb=pos_emb)
    batch = lm_batch(lengths=(L, L))
    model = models.build(cfg, deterministic=True)
    params = random_params(model, batch, scale=0.1)
    full = run_fast(lambda p: model.apply({"params": p}, batch, method="log_probs"), params)
    dec = models.build(cfg, deterministic=True, decode=True)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(  # starts empty
        lambda: dec.init(jax.random.key(0), jnp.zeros((B, 1), jnp.int32), method="decode_step"))["cache"])
    step = compile_fast(lambda c, tok: dec.apply({"params": params, "cache": c}, tok,
                                                 method="decode_step", mutable=["cache"]),
                        cache, batch["inputs"][:, :1])
    steps = []
    for t in range(L):
        lp, upd = step(cache, batch["inputs"][:, t:t + 1])
        cache = upd["cache"]
        steps.append(lp)
    np.testing.assert_allclose(jnp.stack(steps, 1), full, atol=2e-5)


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_reversible_compiled_memory_below_plain_autodiff():
    depth = 8
    params, x_BLE, seg_BL = rev_inputs(depth)

    def temp_bytes(recompute):
        loss = rev_loss(rev_stack(depth, recompute=recompute, deterministic=True), seg_BL)
        grad = jax.grad(lambda p, x: loss(p, x)[0], argnums=(0, 1))
        return compile_fast(grad, params, x_BLE).memory_analysis().temp_size_in_bytes

    rev, plain = temp_bytes(True), temp_bytes(False)
    # One [B, L, E] float32 activation is 2 KiB here; plain autodiff keeps ~15 per block
    # (293 KiB at depth 8), the reversible stack about one block's worth (43 KiB).
    assert rev < plain / 3, (rev, plain)


# 8.5 s in the suite on the 2-core Zen 3 (2026-12-01 evening): CI's slow part runs it
@pytest.mark.slow
def test_tiny_reversible_model_trains(tmp_path):
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=32, depth=2, num_heads=2, mlp_dim=64, max_len=32, dropout=0.1,
                    reversible=True)
    cd.train.update(steps=20, batch_size=8, lr=3e-3, warmup_steps=3, progress=False)
    trainer = Trainer(from_configdict(cd), str(tmp_path))
    state, _ = trainer.initial_state()
    losses = []
    with trainer._context():
        for _ in range(20):
            batch = _global(next(trainer.train_iter), trainer.batch_sharding)
            state, metrics = trainer.train_step(state, batch)
            losses.append(float(metrics["loss"]) / float(metrics["weight"]))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_remat_lowers_the_compiled_train_steps_memory(tmp_path):
    """Saved residuals (above) are what JAX asks for; this checks what XLA compiles. On CPU
    XLA used to strip remat's optimization barriers and CSE the recomputation back into
    the forward pass, so a remat train step had exactly the temporaries of a plain one
    (see `train.step.CPU_REMAT_COMPILER_OPTIONS`)."""
    def temp_bytes(remat):
        cd = default_configdict()
        cd.data.update(task="byte_lm", seq_len=64, batching="pack")
        cd.model.update(kind="lm", width=32, depth=4, num_heads=2, mlp_dim=128, max_len=64,
                        dropout=0.0, remat=remat)
        cd.train.update(steps=10, warmup_steps=2, batch_size=8, progress=False)
        trainer = Trainer(from_configdict(cd), str(tmp_path / remat))
        with trainer._context():
            batch = _global(next(trainer.train_iter), trainer.batch_sharding)
            compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain, kept = temp_bytes("none"), temp_bytes("full")
    # Plain autodiff keeps every block's activations (10.5 MiB of temporaries here); full
    # remat keeps the block inputs and one block's recomputation (3.1 MiB; 10.5 MiB, the
    # same as plain, before the fix).
    assert kept < 0.6 * plain, (kept, plain)
