"""Uptraining a multi-head run into grouped-query attention (Ainslie et al. 2023, "GQA:
Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints").

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/hpnlp/lm_mqa \\
        --config.model.num_kv_heads=1 --config.train.init_from=/tmp/hpnlp/lm_bytes \\
        --config.train.steps=40 --config.train.warmup_steps=4

A run with `model.num_kv_heads` G that starts from a run of more key/value heads
(`train.init_from`: multi-head, or grouped by a multiple of G) takes its weights as they are,
except each block's key and value projections: the heads of each new group are mean-pooled
into one (the paper's conversion, better than keeping one head of each group), and the
queries keep their own. Training then continues: the paper's uptraining spends 5% of the
pretraining steps. Query head h of group g = h // (H / G) sees that group's pooled head.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hpnlp.config import Config, ModelConfig, config_error


def source_kv_heads(src: ModelConfig, dst: ModelConfig, workdir: str) -> int:
    """The key/value heads the `train.init_from` run in `workdir` (model `src`) has, when
    this run (`dst`) pools them into fewer; 0 when it restores as it is (the same heads, or
    another shape altogether, which `check_params_match` names). A run it cannot pool from
    is a ConfigError."""
    g_src, g_dst = src.kv_heads(), dst.kv_heads()
    if g_src == g_dst or src.kv_latent_dim or dst.kv_latent_dim:  # a latent: compress.mla
        return 0
    if (src.arch, src.num_heads, src.dims_per_head()) != (dst.arch, dst.num_heads,
                                                         dst.dims_per_head()):
        return 0  # another shape altogether: check_params_match names the arrays
    if g_src < g_dst or g_src % g_dst:
        raise config_error("train.init_from", workdir, f"that run has {g_src} key/value heads "
                           f"and this one model.num_kv_heads={g_dst}: uptraining pools groups of "
                           "heads, so this run's must divide that run's")
    if src.lowrank.enabled():
        raise config_error("train.init_from", workdir, "that run's products are factorized "
                           "(model.lowrank), and the key/value heads are pooled from dense "
                           "weights; uptrain from the dense run it was factorized from")
    if dst.lowrank.enabled():
        raise config_error("model.lowrank.rank", dst.lowrank.rank or dst.lowrank.energy,
                           "factorize and pool key/value heads in two runs: uptrain to "
                           "model.num_kv_heads first, then factorize that run")
    return g_src


def source_config(cfg: Config, kv_heads: int) -> Config:
    """`cfg` with the `train.init_from` run's key/value heads: the parameter shapes to
    restore that run into before pooling."""
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, num_kv_heads=kv_heads if kv_heads != cfg.model.num_heads else 0))


def pool_kv_heads(params, num_heads: int, kv_heads: int):
    """`params` with every attention's key/value heads mean-pooled to `kv_heads` groups:
    `qkv` [..., E, 3, H, D] (multi-head) becomes `q` [..., E, H, D] and `kv`
    [..., E, 2, G, D]; a grouped `kv` of more heads is pooled to G. (`...`: the stacked
    layers' leading axis.) Everything else is returned as it is."""
    def pool(w_E2SD):  # [..., E, 2, S, D] -> [..., E, 2, G, D], S a multiple of G
        *lead, S, D = w_E2SD.shape
        return jnp.mean(w_E2SD.reshape(*lead, kv_heads, S // kv_heads, D), axis=-2)

    def walk(tree):
        if not isinstance(tree, dict):
            return tree
        if "qkv" in tree and tree["qkv"].shape[-2] == num_heads:
            w = tree["qkv"]
            rest = {k: v for k, v in tree.items() if k != "qkv"}
            return {**rest, "q": w[..., 0, :, :], "kv": pool(w[..., 1:, :, :])}
        if "q" in tree and "kv" in tree:
            return {**tree, "kv": pool(tree["kv"])}
        return {k: walk(v) for k, v in tree.items()}
    return walk(params)


def conversion(cfg: Config, src: ModelConfig, workdir: str):
    """(the config to restore the `train.init_from` run in `workdir` (model `src`) into, the
    function converting its parameters into this run's) when this run uptrains that run's
    key/value heads: pooled into fewer (here) or converted into a latent
    (hpnlp.compress.mla); None when it restores as it is. A run it cannot convert from is a
    ConfigError, before anything is read."""
    from hpnlp.compress import mla
    m = cfg.model
    g_src = source_kv_heads(src, m, workdir)
    if g_src:
        return source_config(cfg, g_src), lambda p: pool_kv_heads(p, m.num_heads, m.kv_heads())
    if mla.converts(src, m, workdir):
        return mla.source_config(cfg, src), lambda p: mla.latent_from_heads(
            p, m.num_heads, m.kv_latent_dim)
    return None
