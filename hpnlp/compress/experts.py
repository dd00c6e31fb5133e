"""A trained run into a mixture of experts of another size, by `train.init_from`: fewer
experts (expert pruning) or a dense run's MLPs copied into experts (sparse upcycling).

    # keep the 4 most-routed of each MoE layer's 8 experts, then fine-tune
    python -m hpnlp.main --config experiments/lm.py:bytes,moe --workdir /tmp/hpnlp/moe4 \\
        --config.model.moe.num_experts=4 --config.train.init_from=/tmp/hpnlp/moe8 \\
        --config.train.steps=200 --config.train.warmup_steps=20
    # every expert a copy of the dense run's MLP (sparse upcycling)
    python -m hpnlp.main --config experiments/lm.py:bytes,moe --workdir /tmp/hpnlp/up8 \\
        --config.model.moe.router=top_k --config.model.moe.top_k=2 \\
        --config.train.init_from=/tmp/hpnlp/lm_bytes --config.train.steps=200

**Expert pruning.** A run of `model.moe.num_experts` X' that starts from a run of X > X'
experts (the same model otherwise) keeps X' of each MoE layer's experts: their weights,
and their router columns (so the router ranks the kept experts as it did, its softmax over
fewer of them), every other weight as it is. `train.init_experts` chooses which:
"routed" keeps the experts whose outputs carried the most gate weight over
`train.init_expert_batches` training batches, routed in evaluation as the source run
routes them (the usage criterion of expert-pruning work, e.g. Lu et al. 2024, "Not All
Experts are Equal"; the least-used experts are the least missed); "random" keeps a uniform
draw per layer (from the run's seed), the control. Kept experts stay in their order.

**Sparse upcycling** (Komatsuzaki et al. 2023). A run with `model.moe` that starts from a
dense run (no MoE, the same model otherwise) takes each MoE block's experts as copies of
that block's dense MLP (`mlp_in` -> `wi`, `bi`; `mlp_out` -> `wo`, `bo`), its router (and
noise weights) freshly initialized, every other weight as it is. With gates that sum to one
(`router='top_k'`) and nothing dropped (`dispatch='dropless'`) the upcycled model computes
exactly what the dense one did; Switch's gate (the router probability) scales each token's
MLP output by it, and capacity drops pass tokens through, until training adapts.

Refused in one line, before anything is read: more experts from fewer (upcycle from the
dense run instead), experts of another width than the dense MLP, shared experts when
upcycling (no dense weight to start them from that keeps the model's function), stacked
layers (routing statistics are per block), and an expert change together with a key/value
conversion (hpnlp.compress.gqa; convert in two runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hpnlp.config import Config, ModelConfig, config_error

DRAW = 0x6b656570  # folded into the init key for the random draw of kept experts
EXPERT_LAST = ("router", "noise")  # [M, X]: the expert axis last; every other leaf first
DENSE = {"wi": ("mlp_in", "kernel"), "bi": ("mlp_in", "bias"),
         "wo": ("mlp_out", "kernel"), "bo": ("mlp_out", "bias")}  # an expert <- the dense MLP


def change(src: ModelConfig, dst: ModelConfig, workdir: str) -> str:
    """How this run (`dst`) takes the experts of the `train.init_from` run in `workdir`
    (model `src`): "prune" (fewer experts), "upcycle" (a dense run into experts), or ""
    (as they are, or another shape altogether, which `check_params_match` names). A change
    it cannot make is a ConfigError."""
    xs, xd = src.moe.num_experts, dst.moe.num_experts
    if xs == xd or not xd:
        return ""  # the same experts, or an MoE run into a dense one (other parameters)
    if xs and xd > xs:
        raise config_error("model.moe.num_experts", xd, f"train.init_from={workdir} has {xs} "
                           "experts, and a run can keep fewer of them, not grow more; "
                           "upcycle from the dense run instead, or set num_experts <= "
                           f"{xs}")
    from hpnlp.compress.gqa import refuse_factorized
    refuse_factorized(src, dst, workdir, made="the experts are taken",
                      first="change the experts")
    if dst.stack_layers:
        raise config_error("train.init_from", workdir, "changing the experts converts each "
                           "MoE block on its own, which stacked layers (model.stack_layers="
                           "True) hold as one; set model.stack_layers=False in both runs")
    if not xs:
        if dst.moe.shared_experts:
            raise config_error("model.moe.shared_experts", dst.moe.shared_experts, "upcycling "
                               f"copies train.init_from={workdir}'s dense MLP into the routed "
                               "experts, and a shared expert beside them has no dense weights "
                               "that keep the model's function; set it to 0")
        if dst.moe.expert_dim(dst) != src.mlp_dim:
            raise config_error("model.moe.mlp_dim", dst.moe.mlp_dim, f"upcycled experts are "
                               f"copies of train.init_from={workdir}'s dense MLP of width "
                               f"{src.mlp_dim}; set it to 0 (model.mlp_dim) or {src.mlp_dim}")
        return "upcycle"
    return "prune"


def source_config(cfg: Config, src: ModelConfig) -> Config:
    """`cfg` with the `train.init_from` run's experts: the shapes it is restored in."""
    moe = src.moe if not src.moe.num_experts else dataclasses.replace(
        cfg.model.moe, num_experts=src.moe.num_experts)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))


def _moe_layers(tree, path=()):
    """{path: the dict} of every MoE layer's parameters (a dict with `router` and `wi`)."""
    if not isinstance(tree, dict):
        return {}
    if "router" in tree and "wi" in tree:
        return {path: tree}
    out = {}
    for k, v in tree.items():
        out.update(_moe_layers(v, path + (k,)))
    return out


def _replace(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _replace(tree[path[0]], path[1:], value)}


def routed_weight(model, params, batches) -> dict:
    """{path of each MoE layer: [X] the gate weight its experts' outputs carried}, summed
    over `batches` as `model` (evaluation) routes them (`hpnlp.moe.ROUTES`)."""
    from hpnlp.moe import ROUTES

    def one(params, batch):
        _, got = model.apply({"params": params}, batch, method="evaluate", mutable=[ROUTES])
        out = {}

        def walk(tree, path):
            if "weights" in tree and not isinstance(tree["weights"], dict):
                out[path] = jnp.sum(tree["weights"][0].astype(jnp.float32), axis=(0, 1))
                return
            for k, v in tree.items():
                walk(v, path + (k,))
        walk(got[ROUTES], ())
        return out
    one = jax.jit(one)
    total: dict = {}
    for batch in batches:
        for k, v in one(params, batch).items():
            total[k] = total[k] + v if k in total else v
    return total


def keep(params, experts: int, weights: dict | None, key):
    """`params` with each MoE layer's `experts` X' experts kept: those of the largest routed
    weight (`weights`, from `routed_weight`; ties to the first) or, without it, a uniform
    draw per layer from `key` (the run's init key: a seed ensemble's member draws as the
    plain run of its seed); in their order."""
    out = params
    for i, (path, layer) in enumerate(sorted(_moe_layers(params).items())):
        X = layer["router"].shape[-1]
        if weights is None:
            score = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, DRAW), i), (X,))
        else:
            if path not in weights:
                raise ValueError(f"no routing was captured for the MoE layer at {'/'.join(path)}")
            score = weights[path]
        _, top = jax.lax.top_k(score, experts)
        kept = jnp.sort(top)
        out = _replace(out, path, {k: jnp.take(v, kept, axis=-1 if k in EXPERT_LAST else 0)
                                   for k, v in layer.items()})
    return out


def upcycle(params, fresh, experts: int):
    """`params` (a dense run) with the MLP of every block that `fresh` (this run's initial
    parameters) makes MoE copied into its `experts` experts; router and noise from `fresh`."""
    out = params
    for path, layer in _moe_layers(fresh).items():
        block = out
        for k in path[:-1]:
            block = block[k]
        moe = {k: v for k, v in layer.items() if k in EXPERT_LAST}
        for name, (module, leaf) in DENSE.items():
            w = block[module][leaf]
            moe[name] = jnp.broadcast_to(w, (experts,) + w.shape).astype(layer[name].dtype)
        rest = {k: v for k, v in block.items() if k not in ("mlp_in", "mlp_out")}
        out = _replace(out, path[:-1], {**rest, path[-1]: moe})
    return out


def conversion(cfg: Config, src: ModelConfig, workdir: str):
    """A `gqa.Conversion` that changes the experts of the `train.init_from` run (model
    `src`) into this run's, or None when they stay (module doc)."""
    from hpnlp.compress.gqa import Conversion
    how = change(src, cfg.model, workdir)
    t, X = cfg.train, cfg.model.moe.num_experts
    if how != "prune" and t.init_experts != "routed":
        raise config_error("train.init_experts", t.init_experts, f"chooses which experts of "
                           f"train.init_from={workdir} a run of fewer keeps, and this run keeps "
                           f"its {src.moe.num_experts or 'dense MLP'} as they are; leave it "
                           "'routed'")
    if how == "upcycle":
        return Conversion(source_config(cfg, src), lambda p, stats, fresh, key: upcycle(p, fresh, X))
    if how == "prune":
        routed = t.init_experts == "routed"
        return Conversion(source_config(cfg, src),
                          lambda p, stats, fresh, key: keep(p, X, stats, key),
                          calibrate=routed_weight if routed else None,
                          batches=t.init_expert_batches if routed else 0)
    return None
