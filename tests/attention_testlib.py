"""Helpers shared by the per-variant attention test files (imported under their old names)."""

import flax.linen as nn
import jax
import numpy as np


def max_abs(x):
    return float(np.abs(np.asarray(x, np.float32)).max())


def rbg_key(seed):
    return jax.random.key(seed, impl="unsafe_rbg")  # compiles much faster than threefry


def fill_params(abstract, seed=1):
    """Random values for an abstract parameter tree from `jax.eval_shape` (tracing checks
    every shape; skipping the initializers' compile keeps the tests fast)."""
    rng = np.random.default_rng(seed)

    def one(x):
        scale = x.shape[-2] ** -0.5 if len(x.shape) >= 2 else 0.1
        return (rng.standard_normal(x.shape) * scale).astype(x.dtype)

    return jax.tree.map(one, nn.unbox(abstract))


def call_attention(attn, causal, params, q, k, v, mask):
    return attn.apply({"params": params}, q, k, v, mask, causal=causal, deterministic=True)


# Every test goes through this (mask always an array), so each configuration compiles once.
apply_attention = jax.jit(call_attention, static_argnums=(0, 1))


def assert_compiles_once(jitted, calls):
    """Runs `jitted(*args)` for each argument tuple of `calls`, each with its module built
    afresh from the same options (as a model, or a trainer's step, rebuilds it from its
    config), and asserts the calls added at most one program to `jitted`'s cache. A module
    that compares unequal to its twin (a field holding a list or an array, or a value drawn
    per call) compiles again on every call; an outer `jax.jit` with an `assert_max_traces`
    inside sees none of that, as its arguments never change shape (review r12 F1). At most
    one, not exactly: an earlier test of the file may have compiled this very program, which
    is how these checks cost no compile of their own."""
    before = jitted._cache_size()
    outs = [jitted(*args) for args in calls]
    grew = jitted._cache_size() - before
    assert grew <= 1, (f"{len(outs)} calls of one configuration compiled {grew} programs: the "
                       "module built for each call is not equal to (or hashes unlike) the last")
    return outs
