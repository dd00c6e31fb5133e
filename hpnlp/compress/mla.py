"""Converting a multi-head run into multi-head latent attention (MHA2MLA, Ji et al. 2025;
TransMLA, Meng et al. 2025): the joint truncated SVD of each block's key and value weights.

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/hpnlp/lm_mla \\
        --config.model.kv_latent_dim=64 --config.model.kv_latent_norm=false \\
        --config.train.init_from=/tmp/hpnlp/lm_bytes --config.train.lr=3e-4 \\
        --config.train.steps=40 --config.train.warmup_steps=4

A latent run (`model.kv_latent_dim` C, `model.kv_latent_norm` off) that starts from a run
of multi-head or grouped key/value heads (`train.init_from`) takes its weights as they are,
except each block's key and value projections. Head h's key and value weights, side by side,
are the matrix M = [W_k | W_v] [E, 2 H D] (a grouped run's heads repeated to their query
heads); its truncated SVD M ~ U_C S_C V_C^T, split by `lowrank.fit_factors`, becomes
`kv_down` = U_C sqrt(S_C) [E, C] and [`k_up` | `v_up`] = sqrt(S_C) V_C^T: the latent keeps
the directions of the input that the keys and values together read most, the best rank-C
keys and values in Frobenius norm (Eckart-Young). At C = rank(M) the new model computes
what the old one did. The queries keep their own weights. Training then continues, as
grouped-query uptraining does (hpnlp.compress.gqa).

Not converted (refused in one line): a latent with its layer norm (a norm of the latent is
no linear map an SVD reproduces), RoPE models (the latent's rotary key is one key shared by
the heads, where the run rotates every head's), a latent of more dims than M's rank, and
factorized runs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hpnlp.config import Config, ModelConfig, config_error


def converts(src: ModelConfig, dst: ModelConfig, workdir: str) -> bool:
    """Whether this run (`dst`) converts the `train.init_from` run in `workdir` (model `src`)
    into its latent; False when it restores as it is or is another shape altogether (which
    `check_params_match` names). A run it cannot convert from is a ConfigError."""
    if not dst.kv_latent_dim or src.kv_latent_dim:
        return False
    if (src.arch, src.num_heads, src.dims_per_head(), src.width) != (
            dst.arch, dst.num_heads, dst.dims_per_head(), dst.width):
        return False
    C, why = dst.kv_latent_dim, "converting a run of key/value heads into a latent"
    if dst.kv_latent_norm:
        raise config_error("model.kv_latent_norm", True, f"{why} (train.init_from={workdir}) "
                           "is a linear map, the joint SVD of its key and value weights, and a "
                           "layer norm of the latent is not; set model.kv_latent_norm=false")
    if dst.pos_emb == "rope" and src.pos_emb != "rope":  # a review (session 118): said of
        # train.init_from, told to convert a run of learned positions, which it was
        raise config_error("model.pos_emb", dst.pos_emb, f"{why} (train.init_from={workdir}) "
                           "is implemented without RoPE, and that run's positions are "
                           f"{src.pos_emb!r}; convert with model.pos_emb={src.pos_emb!r}")
    if src.pos_emb == "rope":
        raise config_error("train.init_from", workdir, f"{why} is implemented without RoPE: the "
                           "latent's rotary key is one key shared by every head, where that "
                           "run rotates each head's own; train the RoPE latent model from "
                           "scratch, or convert a run with model.pos_emb='learned'")
    most = min(src.width, 2 * src.kv_heads() * src.dims_per_head())
    if C > most:
        raise config_error("model.kv_latent_dim", C, f"that run's key and value weights "
                           f"(train.init_from={workdir}) are of rank at most {most} (width "
                           f"{src.width}, {src.kv_heads()} key/value heads of "
                           f"{src.dims_per_head()}); a larger latent's extra dims would start "
                           f"at zero and never train; choose model.kv_latent_dim <= {most}")
    from hpnlp.compress.gqa import refuse_factorized
    refuse_factorized(src, dst, workdir,
                      made="the latent is converted from dense key and value weights",
                      first="convert to model.kv_latent_dim")
    return True


def source_config(cfg: Config, src: ModelConfig) -> Config:
    """`cfg` with the `train.init_from` run's attention (its key/value heads, no latent): the
    parameter shapes to restore that run into before converting."""
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, kv_latent_dim=0, kv_latent_rope_dim=0, kv_latent_norm=True,
        num_kv_heads=src.num_kv_heads))


def _key_value_matrix(tree: dict, num_heads: int):
    """(W_q [..., E, H, D], M = [W_k | W_v] [..., E, 2 H D]) of an attention's parameters:
    multi-head `qkv`, or grouped `q` and `kv` (each group's heads repeated to its H / G
    query heads, as the model reads them)."""
    from hpnlp.compress.gqa import query_and_kv
    q, kv = query_and_kv(tree)
    kv = jnp.repeat(kv, num_heads // kv.shape[-2], axis=-2)
    return q, kv.reshape(*kv.shape[:-3], -1)


def latent_from_heads(params, num_heads: int, latent: int, covs=None):
    """`params` with every attention's key and value weights converted into a latent of
    `latent` dims: `qkv` [..., E, 3, H, D] (or grouped `q`, `kv`) becomes `q` [..., E, H, D],
    `kv_down` [..., E, C], `k_up` and `v_up` [..., C, H, D] (`...`: the stacked layers'
    leading axes, each layer its own SVD). Everything else is returned as it is."""
    from hpnlp.compress.gqa import _cov_at, map_attentions
    from hpnlp.compress.lowrank import fit_factors

    def convert(tree, path):
        q, m = _key_value_matrix(tree, num_heads)
        *lead, E, HD2 = m.shape
        H, D = q.shape[-2], q.shape[-1]
        down, up = fit_factors(m, latent, _cov_at(covs, path))
        down = down.astype(m.dtype)
        up = up.reshape(*lead, latent, 2, H, D).astype(m.dtype)
        rest = {k: v for k, v in tree.items() if k not in ("qkv", "q", "kv")}
        return {**rest, "q": q, "kv_down": down, "k_up": up[..., 0, :, :],
                "v_up": up[..., 1, :, :]}
    return map_attentions(params, num_heads, convert)
