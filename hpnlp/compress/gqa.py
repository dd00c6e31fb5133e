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

With `train.init_kv_heads='svd'` a group's heads are fitted instead of averaged
(`svd_kv_heads`; the weight-space form of the SVD conversions of Yu et al. 2024, "Effectively
Compress KV Heads for LLM", which fit the keys and values of calibration data): the group's
key (and value) weights side by side are factorized at rank D, the new head's weights times
one D x D map per source head, and each map is folded into the query weights (keys) or the
output projection (values) of the query heads that read that source head. Where a group's
heads span D dims the model is unchanged; otherwise its keys and values are the best rank-D
fit. RoPE runs are refused (the rotation between projection and score does not commute
with the folded map).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
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
    refuse_factorized(src, dst, workdir,
                      made="the key/value heads are pooled from dense key and value weights",
                      first="uptrain to model.num_kv_heads")
    return g_src


def refuse_factorized(src: ModelConfig, dst: ModelConfig, workdir: str, *, made: str,
                      first: str) -> None:
    """A conversion (`made`: what it makes from which dense weights) reads a dense run into a
    dense one: a factorized side (model.lowrank) is refused, naming the order that works."""
    if src.lowrank.enabled():
        raise config_error("train.init_from", workdir, f"that run's products are factorized "
                           f"(model.lowrank), and {made}; start from the dense run it was "
                           "factorized from")
    if dst.lowrank.enabled():
        raise config_error("model.lowrank.rank", dst.lowrank.rank or dst.lowrank.energy,
                           f"convert and factorize in two runs: {first} first, then "
                           "factorize that run")


# Attention whose scores are products q . k (and whose output is linear in the values): a D x
# D map folded into the queries (and outputs) is exact there. The others read q or k alone
# (LSH hashes q as its keys, clustered and sinkhorn route by them, synthesizer's dense mode
# and the kernel variants map q and k through a nonlinearity).
DOT_PRODUCT_ATTENTION = ("dense", "chunked", "xla", "ring", "local", "sliding_window", "strided",
                         "bigbird", "linformer")


def check_svd(cfg: Config, workdir: str) -> None:
    """`train.init_kv_heads='svd'` folds a D x D map into each query head's weights, which
    a rotation between the projection and the scores (RoPE) would not commute with, nor
    attention that reads queries or keys other than through q . k (a review, session 116:
    LSH, the kernel variants, clustered, sinkhorn and synthesizer converted to another
    function)."""
    if cfg.attention.name not in DOT_PRODUCT_ATTENTION:
        raise config_error("train.init_kv_heads", "svd", f"folds each key head's D x D "
                           f"remainder into its query heads' weights (train.init_from="
                           f"{workdir}), exact where scores are products q . k, and "
                           f"attention.name={cfg.attention.name!r} reads queries or keys "
                           "otherwise; use train.init_kv_heads='mean'")
    if cfg.model.pos_emb == "rope":
        raise config_error("train.init_kv_heads", "svd", f"folds each key head's D x D "
                           f"remainder into its query heads' weights (train.init_from="
                           f"{workdir}), which RoPE's rotation between projection and score "
                           "does not commute with; use train.init_kv_heads='mean' with RoPE")
    m = cfg.model
    if m.width < m.dims_per_head():
        raise config_error("train.init_kv_heads", "svd", f"fits each group's keys at rank "
                           f"D={m.dims_per_head()}, above the rank model.width={m.width} allows; "
                           "use train.init_kv_heads='mean'")


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

    def convert(tree, path):
        q, kv = query_and_kv(tree)
        rest = {k: v for k, v in tree.items() if k not in ("qkv", "q", "kv")}
        return {**rest, "q": q, "kv": pool(kv)}
    return map_attentions(params, num_heads, convert)


def map_attentions(params, num_heads: int, convert):
    """`params` with every attention's parameters (a dict holding multi-head `qkv` of
    `num_heads` heads, or grouped `q` and `kv`) replaced by `convert(tree, path)`, path the
    tuple of names leading to it; everything else as it is."""
    def walk(tree, path):
        if not isinstance(tree, dict):
            return tree
        if "qkv" in tree and tree["qkv"].shape[-2] == num_heads or "q" in tree and "kv" in tree:
            return convert(tree, path)
        return {k: walk(v, path + (k,)) for k, v in tree.items()}
    return walk(params, ())


def query_and_kv(tree: dict):
    """(W_q [..., E, H, D], W_kv [..., E, 2, S, D]) of an attention's parameters: multi-head
    `qkv` (S = H) or grouped `q` and `kv`."""
    if "qkv" in tree:
        w = tree["qkv"]
        return w[..., 0, :, :], w[..., 1:, :, :]
    return tree["q"], tree["kv"]


def input_covariances(model, params, batches, *, rngs=None) -> dict:
    """{the path of each block's attention parameters: X^T X / n [E, E]}, X its input (the
    block's `norm1` output) at the n real tokens of `batches` (segment id > 0), in float32:
    what `init_kv_calibration` weights the fits by. The mean, not the sum: the fit's subspace
    is the same either way, but `fit_factors`' split W = L^-T U sqrt(S) scales with L, and a
    sum over n tokens would make W sqrt(n) times smaller and V that much larger than the
    weights' own split (an optimizer's first steps, each about the learning rate per entry,
    then throw W far off: a 2-step run at 3e-4 read 3.27 from a 1.54 start). `rngs`: the
    apply's (`calibrated_from`: the random-feature draw the source run trained with).
    A dual or bi-encoder's texts go through one trunk call (`heads.stack_sides`), read at
    their own segment ids stacked as that call lays them out, as `experts.usage` reads them
    (review r13: a pair batch has no `segment_ids`, so every padded slot of every side
    counted)."""
    from hpnlp.models.heads import stack_sides
    from hpnlp.moe import texts

    def one(params, batch):
        _, state = model.apply({"params": params}, batch, mutable=["intermediates"], rngs=rngs,
                               capture_intermediates=lambda mdl, name: (
                                   name == "__call__" and mdl.name == "norm1"))
        segs = [batch.get("segment_ids" + t) for t in texts(batch)]
        seg = segs[0] if len(segs) == 1 else stack_sides(*segs)  # as the trunk call reads them
        out = {}  # path: (X^T X, tokens)

        def walk(tree, path):
            for k, sub in tree.items():
                if k != "__call__":
                    walk(sub, path + (k,))
                    continue
                x = sub[0].astype(jnp.float32)
                real = real_tokens(seg, x.shape[:2])
                x = (x * real[..., None]).reshape(-1, x.shape[-1])
                out[path[:-1] + ("attention",)] = (x.T @ x, jnp.sum(real))
        walk(state["intermediates"], ())
        return out
    total = summed_over_batches(one, params, batches)
    return {k: xx / jnp.maximum(n, 1.0) for k, (xx, n) in total.items()}


def with_trained_draw(calibrate: Callable, workdir: str) -> Callable:
    """`calibrate(model, params, batches, rngs=...)` of the `train.init_from` run in
    `workdir` as a `Conversion`'s calibrate: its passes draw a random-feature attention's
    features (Performer, LSH) as that run trained with, not from its seed (a review, session
    107: key/value fits were weighted by another function's inputs, experts ranked by its
    routes)."""
    def with_draw(model, params, batches):
        from hpnlp.compress.distill import trained_rngs
        return calibrate(model, params, batches,
                         rngs=trained_rngs(model.cfg, workdir, field="train.init_from"))
    return with_draw


def calibrated_from(workdir: str) -> Callable:
    """`input_covariances` of the `train.init_from` run in `workdir`, under its trained draw
    (`with_trained_draw`)."""
    return with_trained_draw(input_covariances, workdir)


def real_tokens(seg, shape):
    """[B, L] 1.0 at the real tokens (segment id > 0) of a batch's `segment_ids` `seg`; all
    ones where the batch has none. Segment ids of another shape than the activations they
    mark are refused (review r13: taken as all ones, a pair batch counted every pad slot)."""
    if seg is not None and tuple(seg.shape) != tuple(shape):
        raise ValueError(f"real_tokens: seg of shape {tuple(seg.shape)} does not mark "
                         f"activations of [B, L] = {tuple(shape)}; pass the segment ids of the "
                         "call that made them (a pair model's: heads.stack_sides of each text's)")
    return jnp.ones(shape) if seg is None else (seg > 0).astype(jnp.float32)


def summed_over_batches(one, params, batches) -> dict:
    """{key: the sum over `batches` of `one(params, batch)[key]`} (a dict of arrays or of
    tuples of them), `one` jitted once."""
    one = jax.jit(one)
    total: dict = {}
    for batch in batches:
        for k, v in one(params, batch).items():
            total[k] = jax.tree.map(jnp.add, total[k], v) if k in total else v
    return total


def _cov_at(covs, path: tuple):
    """The covariance for the attention at `path`, None without calibration."""
    if covs is None:
        return None
    if path not in covs:
        raise ValueError(f"no calibration input was captured for the attention at "
                         f"{'/'.join(path)}; train.init_kv_calibration reads each block's "
                         "norm1 output, which this model does not name; set it to 0")
    return covs[path]


def svd_kv_heads(params, num_heads: int, kv_heads: int, covs=None):
    """`params` with every attention's S key/value heads made `kv_heads` (G) by truncated
    SVD (`train.init_kv_heads='svd'`): for each new group and each of keys and values, the
    weights of its S / G source heads side by side, [E, (S / G) D], factorized at rank D as
    W_g [E, D] times [A_1 ... A_{S/G}] (each D x D; U sqrt(S) and sqrt(S) V^T, by
    `lowrank.fit_factors`, whitened by `covs`), so source head j's keys are about
    x W_g A_j, the best rank-D fit (Eckart-Young; exact where the group's weights have
    rank D). The A_j of keys are
    folded into the queries (q_h . k_j = (q_h A_j^T) . k_g: W_q[h] A_j^T), those of values
    into the output projection (o_h W_out[h] = (o'_h A_j) W_out[h]: A_j W_out[h]), for each
    query head h that read source head j. `qkv` [..., E, 3, H, D] or a grouped `q`, `kv`
    becomes `q` [..., E, H, D], `kv` [..., E, 2, G, D], and `out` [..., H, D, E] changes
    too. (`...`: the stacked layers' leading axes.)"""
    import numpy as np

    from hpnlp.compress.lowrank import fit_factors

    def convert(tree, path):
        q, kv = query_and_kv(tree)
        *lead, E, _, S, D = kv.shape
        n, H = S // kv_heads, num_heads
        m = jnp.moveaxis(kv.reshape(*lead, E, 2, kv_heads, n * D), -4, -2)  # [..., 2, G, E, nD]
        w_g, a = fit_factors(m, D, _cov_at(covs, path))
        w_g = jnp.moveaxis(w_g, -2, -4)  # [..., E, 2, G, D]
        a = a.reshape(*lead, 2, kv_heads, D, n, D)
        a = jnp.swapaxes(a, -3, -2).reshape(*lead, 2, S, D, D)  # [..., 2, source head, D, D]
        a_h = a[..., np.arange(H) // (H // S), :, :]  # [..., 2, H, D, D]: query head h's
        ak, av = a_h[..., 0, :, :, :], a_h[..., 1, :, :, :]
        rest = {k: v for k, v in tree.items() if k not in ("qkv", "q", "kv", "out")}
        dt = kv.dtype
        return {**rest,
                "q": jnp.einsum("...ehd,...hfd->...ehf", q.astype(jnp.float32), ak).astype(dt),
                "kv": w_g.astype(dt),
                "out": jnp.einsum("...hdf,...hfe->...hde", av,
                                  tree["out"].astype(jnp.float32)).astype(tree["out"].dtype)}
    return map_attentions(params, num_heads, convert)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """How `train.init_from` converts a run of other shapes into this run's (key/value heads
    here and in hpnlp.compress.mla, experts in hpnlp.compress.experts): `source`, the config
    that run is restored in; `convert(params, stats, fresh, key)`, its parameters into this
    run's (`fresh`: this run's initial parameters, from `key`; jitted); what `stats` is:
    `calibrate(source eval model, params, batches)` over the run's first `batches` training
    batches, or None; and `check(source, fresh)`, given both runs' parameter shapes before
    anything is read or compiled, which raises a ConfigError where they cannot convert."""

    source: Config
    convert: Callable
    calibrate: Callable | None = None
    batches: int = 0
    check: Callable | None = None


def check_calibration_source(cfg: Config, source: Config, workdir: str) -> None:
    """A calibrated conversion (`Conversion.calibrate`: key/value covariances, expert routes)
    runs the `train.init_from` run's model as this run's config builds it, with that run's
    shapes (`source_config`): the fields that choose its function must be that run's, or the
    statistics are another function's (a review, session 116: a Performer run's covariances
    computed under this run's dense attention, its trained draw skipped; a float run's
    under this run's QAT). Refused, naming the field, before anything is read. `cfg` is the
    config the calibration builds that model from (`Conversion.source`: this run's, with that
    run's heads or experts). A review (session 118): this run's `quant.kv_cache`, its QAT
    settings past the formats (group size, calibration, layers) and its MoE routing were not
    compared, and a key/value fit read the source under them."""
    from hpnlp.train.checkpoint import EXACT_ATTENTION
    m, s = cfg.model, source.model
    a, b = cfg.attention, source.attention
    exact = a.name in EXACT_ATTENTION and b.name in EXACT_ATTENTION  # one function, any layout
    # (the variant alone: its options written otherwise, defaults spelled out or layout
    # ones such as chunk sizes, are mostly the same function, and are left to the user)
    pairs = [("attention.name", a.name, a.name if exact else b.name),
             ("model.pos_emb", m.pos_emb, s.pos_emb), ("model.causal", m.causal, s.causal)]
    quant = ["weights", "activations", "kv_cache"]
    if m.quant.weights != "none" or m.quant.activations != "none":  # (the formats come first)
        quant += ["act_scale", "group_size", "calibration", "percentile", "layers"]
    pairs += [(f"quant.{f}", getattr(m.quant, f), getattr(s.quant, f)) for f in quant]
    if m.moe.enabled() and s.moe.enabled():  # routed as it evaluates
        moe = ["router", "top_k", "dispatch", "eval_capacity_factor", "shared_experts"]
        moe += ["capacity_factor"] if "expert_choice" in (m.moe.router, s.moe.router) else []
        pairs += [(f"model.moe.{f}", getattr(m.moe, f), getattr(s.moe, f)) for f in moe]
    for field, mine, theirs in pairs:
        if mine != theirs:
            raise config_error(field, mine, f"this run's conversion of train.init_from={workdir} "
                               f"calibrates on that run's model, which has {field}={theirs!r}, "
                               f"and its statistics would be read under this run's; convert with "
                               f"{field}={theirs!r} (change it in a run after), or calibrate "
                               "nothing (train.init_kv_calibration=0, train.init_experts="
                               "'random')")


def conversion(cfg: Config, src: ModelConfig, workdir: str) -> Conversion | None:
    """The conversion of the `train.init_from` run in `workdir` (model `src`) into this
    run: its key/value heads pooled into fewer (here) or into a latent (hpnlp.compress.mla),
    or its experts changed (hpnlp.compress.experts); None when it restores as it is. A run
    it cannot convert from is a ConfigError, before anything is read."""
    from hpnlp.compress import experts
    kv = _kv_conversion(cfg, src, workdir)
    moe = experts.conversion(cfg, src, workdir)
    if kv and moe:
        raise config_error("train.init_from", workdir, "this run changes both that run's "
                           "key/value heads and its experts; convert in two runs, one change "
                           "each")
    return kv or moe


def _kv_conversion(cfg: Config, src: ModelConfig, workdir: str) -> Conversion | None:
    """The key/value part of `conversion`."""
    from hpnlp.compress import mla
    m = cfg.model
    g_src = source_kv_heads(src, m, workdir)
    calibrated = cfg.train.init_kv_calibration
    # the SVD fits weighted by the inputs' covariances, when calibrated
    fits = dict(calibrate=calibrated_from(workdir), batches=calibrated) if calibrated else {}
    if calibrated and (m.stack_layers or m.reversible):
        raise config_error("train.init_kv_calibration", calibrated, "reads each block's "
                           "attention input, which stacked or reversible blocks do not expose "
                           "per block; set it to 0 (the weights alone)")
    if g_src:
        if cfg.train.init_kv_heads == "svd":
            check_svd(cfg, workdir)
            return Conversion(source_config(cfg, g_src), lambda p, covs, fresh, key: svd_kv_heads(
                p, m.num_heads, m.kv_heads(), covs), **fits)
        if calibrated:
            raise config_error("train.init_kv_calibration", calibrated, "weights an SVD fit, "
                               "and train.init_kv_heads='mean' averages the heads; set "
                               "train.init_kv_heads='svd', or leave it 0")
        return Conversion(source_config(cfg, g_src), lambda p, covs, fresh, key: pool_kv_heads(
            p, m.num_heads, m.kv_heads()))
    if cfg.train.init_kv_heads == "svd":
        raise config_error("train.init_kv_heads", "svd", f"fits the key/value heads of a run "
                           f"of more of them into this run's model.num_kv_heads, and the run "
                           f"train.init_from={workdir} has {src.kv_heads()} (this one "
                           f"{m.kv_heads()}{', a latent' if m.kv_latent_dim else ''}): nothing "
                           "to fit; leave it 'mean'")
    if mla.converts(src, m, workdir):
        return Conversion(mla.source_config(cfg, src), lambda p, covs, fresh, key: (
            mla.latent_from_heads(p, m.num_heads, m.kv_latent_dim, covs)), **fits)
    if calibrated:
        raise config_error("train.init_kv_calibration", calibrated, f"weights the SVD fits "
                           f"that convert key/value heads, and this run keeps the key/value "
                           f"heads of train.init_from={workdir} as they are; leave it 0")
    return None
