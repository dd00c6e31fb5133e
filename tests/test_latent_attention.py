"""Multi-head latent attention (`model.kv_latent_dim`; DeepSeek-AI 2024): its forward pass
against a reference written out here, its absorbed decoding (the latent cache) against the
forward pass, and its config refusals."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp.config import AttentionConfig, QuantConfig, default_configdict, from_configdict, validate
from hpnlp.models.transformer import rotary
from test_models import B, L, _decoder, assert_decodes_like_forward, init, lm_batch, make_cfg

C = 12  # latent dims (heads: 4 of 8)


def _reference_block_attention(p, x_BLE, pos_BL, *, C, R, H, D):
    """One block's latent attention written out: keys and values expanded per head, causal
    softmax attention, the output projection."""
    down = x_BLE @ p["kv_down"]
    c = down[..., :C]
    if "kv_norm" in p:  # model.kv_latent_norm
        mu, var = c.mean(-1, keepdims=True), c.var(-1, keepdims=True)
        c = ((c - mu) / jnp.sqrt(var + 1e-6) * p["kv_norm"]["scale"][None, None]
             + p["kv_norm"]["bias"][None, None])
    q = jnp.einsum("ble,ehd->blhd", x_BLE, p["q"])
    k = jnp.einsum("blc,chd->blhd", c, p["k_up"])
    v = jnp.einsum("blc,chd->blhd", c, p["v_up"])
    if R:
        kr = rotary(down[..., None, C:], pos_BL)
        q = jnp.concatenate([q[..., :D - R], rotary(q[..., D - R:], pos_BL)], -1)
        k = jnp.concatenate([k, jnp.broadcast_to(kr, k.shape[:3] + (R,))], -1)
    s = jnp.einsum("blhd,bshd->bhls", q, k) / np.sqrt(D)
    Lx = x_BLE.shape[1]
    s = jnp.where(np.tril(np.ones((Lx, Lx), bool)), s, -jnp.inf)
    o = jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(s, -1), v)
    return jnp.einsum("blhd,hde->ble", o, p["out"])


# learned-True: 3.1 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the
# suite read 7 min 58 s for 1838 tests): CI's slow part runs it (rope-True and learned-False
# stay)
@pytest.mark.parametrize("pos_emb,norm", [pytest.param("learned", True, marks=pytest.mark.slow),
                                           ("rope", True), ("learned", False)])
def test_latent_attention_computes_its_definition(pos_emb, norm):
    """The block's attention output equals keys and values expanded from the layer-normed
    latent per head (with RoPE: each head's last R dims rotated, the rotary key shared by
    every head), written out in plain jnp; with model.kv_latent_norm off, from the latent as
    projected (no kv_norm parameters)."""
    from hpnlp.models.transformer import MultiHeadAttention
    cfg = make_cfg("lm", pos_emb=pos_emb, kv_latent_dim=C, kv_latent_norm=norm)
    m = cfg.model
    R = m.latent_rope_dims()
    assert R == (4 if pos_emb == "rope" else 0)  # D / 2 by default
    mha = MultiHeadAttention(m, cfg.attention, causal=True)
    x = jax.random.normal(jax.random.key(1), (B, L, m.width))
    pos = jnp.broadcast_to(jnp.arange(L) * 3, (B, L))
    seg = jnp.ones((B, L), jnp.int32)
    params = mha.init(jax.random.key(0), x, seg, pos)["params"]
    params = nn.unbox(params)
    assert params["kv_down"].shape == (m.width, C + R) and params["k_up"].shape == (C, 4, 8 - R)
    assert "qkv" not in params and ("kv_norm" in params) == norm
    got = mha.apply({"params": params}, x, seg, pos)
    want = _reference_block_attention(params, x, pos, C=C, R=R, H=4, D=8)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.slow  # 22-26 s, its 4 cases, on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
@pytest.mark.parametrize("pos_emb,kv_cache,attention", [
    ("learned", "none", "dense"), ("rope", "none", "dense"), ("rope", "int8", "dense"),
    ("rope", "none", "sliding_window")])
def test_latent_lm_decodes_like_its_forward_pass(pos_emb, kv_cache, attention):
    """Absorbed decoding through the latent cache (one row of C + R numbers per position, keys
    and values both; the CPU kernel reads it for every head) equals the forward pass: one
    token a step, a prefill, rows rewound to positions of their own (speculative decoding),
    generate's prefill; with the int8 cache (the forward pass fake-quantizes the row as the
    cache stores it); and a variant with a cache of its own decodes the expanded heads."""
    cfg = make_cfg("lm", pos_emb=pos_emb, kv_latent_dim=C, quant=QuantConfig(kv_cache=kv_cache))
    if attention == "sliding_window":  # a window of every key: exact, its own ring cache
        cfg = dataclasses.replace(cfg, attention=AttentionConfig(attention, {"block_size": 8,
                                                                             "window": L}))
    R = cfg.model.latent_rope_dims()
    batch = lm_batch(lengths=(L, L))
    model, params = init(cfg, batch)
    cache0, _ = _decoder(cfg)
    state = cache0["trunk"]["block_0"]["attention"]["state"]
    if attention == "dense":  # the latent row only: no value buffer, one "head"
        assert state["k"].shape == (B, L, 1, C + R) and "v" not in state
        assert state["k"].dtype == (jnp.int8 if kv_cache == "int8" else jnp.float32)
    assert_decodes_like_forward(cfg, model, params, batch, exact=attention == "dense")


# 3.4 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_latent_lm_decodes_in_bfloat16():
    """bfloat16 compute: the latent cache is bfloat16 (the kernel's bfloat16 path) and the
    decode steps stay near the forward pass (bfloat16 rounds the absorbed query and the
    expanded keys at different points: 0.03 here, against 0.007 for multi-head)."""
    cfg = make_cfg("lm", pos_emb="rope", kv_latent_dim=C, dtype="bfloat16")
    batch = lm_batch(lengths=(L, L))
    model, params = init(cfg, batch)
    full = jax.jit(lambda p, b: model.apply({"params": p}, b, method="log_probs"))(params, batch)
    cache, many = _decoder(cfg)
    assert cache["trunk"]["block_0"]["attention"]["state"]["k"].dtype == jnp.bfloat16
    lp, _ = many(params, cache, batch["inputs"])  # a prefill: every position at once
    assert float(jnp.max(jnp.abs(lp - full))) < 0.06


def _validate(**model):
    cd = default_configdict()
    cd.data.task = "byte_lm"
    cd.model.update(model)
    return validate(from_configdict(cd), task_info={"kind": "lm", "vocab_size": 256,
                                                    "num_classes": 0})


@pytest.mark.parametrize("fields,needle", [
    (dict(kv_latent_dim=-1), "model.kv_latent_dim"),
    (dict(kv_latent_dim=16, num_kv_heads=2), "set model.num_kv_heads=0"),
    (dict(kv_latent_dim=16, arch="lstm"), "model.arch='transformer'"),
    (dict(kv_latent_rope_dim=4), "set model.kv_latent_dim too"),
    (dict(kv_latent_dim=16, kv_latent_rope_dim=4), "model.pos_emb='learned' rotates nothing"),
    (dict(kv_latent_dim=16, pos_emb="rope", kv_latent_rope_dim=3), "must be even"),
    (dict(kv_latent_dim=16, pos_emb="rope", kv_latent_rope_dim=32), "below its 32 dims"),
    (dict(kv_latent_norm=False), "set model.kv_latent_dim too, or leave it true"),
])
def test_latent_config_refusals(fields, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _validate(**fields)
    assert _validate(kv_latent_dim=16, pos_emb="rope").model.latent_rope_dims() == 16


def test_latent_refuses_structured_head_pruning():
    cd = default_configdict()
    cd.data.task = "byte_lm"
    cd.model.kv_latent_dim = 16
    cd.train.prune.update(method="magnitude", sparsity=0.5, structure="structured")
    with pytest.raises(ValueError, match="one shared latent"):
        validate(from_configdict(cd), task_info={"kind": "lm", "vocab_size": 256, "num_classes": 0})
