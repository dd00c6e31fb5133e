"""A trained run into a mixture of experts of another size, by `train.init_from`: fewer
experts (expert pruning) or a dense run's MLPs copied into experts (sparse upcycling).

    # keep the 4 most-routed of each MoE layer's 8 experts (the README's /tmp/hpnlp/lm_moe:
    # python -m hpnlp.main --config experiments/lm.py:bytes,moe), then fine-tune
    python -m hpnlp.main --config experiments/lm.py:bytes,moe --workdir /tmp/hpnlp/moe4 \\
        --config.model.moe.num_experts=4 --config.train.init_from=/tmp/hpnlp/lm_moe \\
        --config.train.steps=200 --config.train.warmup_steps=20
    # every expert a copy of the dense run's MLP (sparse upcycling)
    python -m hpnlp.main --config experiments/lm.py:bytes,moe --workdir /tmp/hpnlp/up8 \\
        --config.model.moe.router=top_k --config.model.moe.top_k=2 \\
        --config.train.init_from=/tmp/hpnlp/lm_bytes --config.train.steps=200

**Expert pruning.** A run of `model.moe.num_experts` X' that starts from a run of X > X'
experts (the same model otherwise) keeps X' of each MoE layer's experts: their weights,
and their router (and noise) columns (so the router ranks the kept experts as it did, its
softmax over fewer of them), every other weight as it is; a run that turns
`model.moe.noisy` on starts its noise weights fresh, one that turns it off has none.
`train.init_experts` chooses which: "routed" keeps the experts whose outputs carried the
most gate weight over `train.init_expert_batches` training batches, routed in evaluation
as the source run routes them (its router, dispatch and capacity, in this run's routing
groups; the usage criterion of expert-pruning work, e.g. Lu et al. 2024, "Not All Experts
are Equal"; the least-used experts are the least missed); "random" keeps a uniform draw
per layer (from the run's seed), the control. Kept experts stay in their order.

**Expert merging** (`train.init_experts='merged'`; MC-SMoE, Li et al. 2024, "Merge, Then
Compress", without its later compression): the most routed experts are kept as dominant
ones, and every other expert joins the dominant one whose router probabilities over the
calibration tokens are most alike (cosine of the columns). Each group becomes one expert:
its members' neurons permuted to match the dominant expert's (a linear assignment on their
weights, as weight matching does; an MLP's neurons may be permuted without changing it),
then averaged, weighted by the gate weight each carried. The router keeps the dominant
experts' columns. What pruning would drop is folded into what stays.

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
layers (routing statistics are per block), a cut that also changes the experts' width,
`every` or shared experts (a cut changes their number alone; narrower experts: cut, then
prune and shrink), and an expert change together with a key/value conversion
(hpnlp.compress.gqa; convert in two runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hpnlp.config import Config, ModelConfig, config_error

DRAW = 0x6b656570  # folded into the init key for the random draw of kept experts
# An MoE layer's per-expert parameters: the expert axis last ([M, X]) or first; the rest
# (shared experts) is no expert's
EXPERT_LAST, EXPERT_FIRST = ("router", "noise"), ("wi", "bi", "wo", "bo")
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
    refuse_factorized(src, dst, workdir, made="the experts are taken from dense MLP weights",
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
        if dst.moe.mlp_dim and dst.moe.mlp_dim != src.mlp_dim:  # else check_params_match
            raise config_error("model.moe.mlp_dim", dst.moe.mlp_dim, f"upcycled experts are "
                               f"copies of train.init_from={workdir}'s dense MLP of width "
                               f"{src.mlp_dim}; set it to 0 (model.mlp_dim) or {src.mlp_dim}")
        return "upcycle"
    refuse_reshaped(src, dst, workdir)
    return "prune"


def refuse_reshaped(src: ModelConfig, dst: ModelConfig, workdir: str) -> None:
    """A cut of the experts changes their number alone: a bug hunt (session 98) found one
    that also changed their width, `every` or the shared experts passed `check_params_match`
    (the source is restored with its own moe fields), then failed at the first step (a flax
    shape error) or in a many-line device_put error naming no field."""
    cut = f"cutting train.init_from={workdir}'s {src.moe.num_experts} experts to " \
          f"{dst.moe.num_experts} keeps"
    if dst.moe.every != src.moe.every:
        raise config_error("model.moe.every", dst.moe.every, f"{cut} that run's MoE blocks "
                           f"(every {src.moe.every}); set it to {src.moe.every}")
    if dst.moe.shared_experts != src.moe.shared_experts:
        raise config_error("model.moe.shared_experts", dst.moe.shared_experts, f"{cut} that "
                           f"run's {src.moe.shared_experts} shared experts; set it to "
                           f"{src.moe.shared_experts}")
    was, now = src.moe.expert_dim(src), dst.moe.expert_dim(dst)
    if was != now:
        raise config_error("model.moe.mlp_dim", dst.moe.mlp_dim, f"{cut} each expert {was} "
                           f"wide, and this run's are {now}; set it to {was} (that run's "
                           "experts' width), and for narrower experts convert in two runs: cut "
                           "the experts first, then prune that run's neurons (train.prune) "
                           "and shrink it (python -m hpnlp.compress shrink)")


def source_config(cfg: Config, src: ModelConfig) -> Config:
    """`cfg` with the `train.init_from` run's experts: the shapes it is restored in, routed
    as that run evaluates (its router, top_k, dispatch and capacity; a bug hunt, session
    94: the source was rebuilt with this run's router, and which experts were kept depended
    on it), in this run's routing groups (the source's were checked against that run's
    batch and mesh; the layer pads a batch to whole groups, and runs experts this run's
    mesh does not split without its all-to-all). A review (session 107): a token-choice
    source took this run's dispatch, so a capacity source cut by a dropless run counted the
    choices its evaluation drops, and a dropless one cut by a capacity run lost choices at
    an eval_capacity_factor it never used. (Session 103: an expert-choice source given this
    run's `dispatch='dropless'` refused it, in an error about this run's field.)"""
    here, moe = cfg.model.moe, src.moe
    if here.enabled():
        moe = dataclasses.replace(moe, groups=here.groups)
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


def usage(model, params, batches, rngs=None) -> dict:
    """{path of each MoE layer: (weight [X], gram [X, X])}: the gate weight each expert's
    outputs carried, and the Gram matrix P^T P of the router probabilities P [tokens, X] at
    the real tokens (segment id > 0), summed over `batches` as `model` (evaluation) routes
    them (`hpnlp.moe.ROUTES`): every text the trunk call routes (a dual or bi-encoder's two
    or three, in one call: `heads.stack_sides`), each at its own segment ids. A bug hunt
    (session 103): only the first text was read, and a dual encoder's batch (segment_ids1,
    segment_ids2) counted its padding.
    `rngs`: the passes' (`gqa.with_trained_draw`: the random-feature draw the source trained
    with)."""
    from hpnlp.compress.gqa import real_tokens, summed_over_batches
    from hpnlp.models.heads import stack_sides
    from hpnlp.moe import ROUTES, texts

    def one(params, batch):
        _, got = model.apply({"params": params}, batch, method="evaluate", mutable=[ROUTES],
                             rngs=rngs)
        segs = [batch.get("segment_ids" + t) for t in texts(batch)]
        seg = segs[0] if len(segs) == 1 else stack_sides(*segs)  # as the trunk call reads them
        out = {}

        def walk(tree, path):
            if "weights" in tree and "probs" in tree:
                if len(tree["probs"]) != 1:
                    raise ValueError(f"the MoE layer at {'/'.join(path)} routed "
                                     f"{len(tree['probs'])} calls; expert calibration reads "
                                     "one call of every text")
                p_BLX = tree["probs"][0].astype(jnp.float32)
                real = real_tokens(seg, p_BLX.shape[:2])
                p_NX = (p_BLX * real[..., None]).reshape(-1, p_BLX.shape[-1])
                weight = jnp.sum(tree["weights"][0].astype(jnp.float32), axis=(0, 1))
                out[path] = (weight, p_NX.T @ p_NX)
                return
            for k, v in tree.items():
                walk(v, path + (k,))
        walk(got[ROUTES], ())
        return out
    return summed_over_batches(one, params, batches)


def _used(stats: dict, path: tuple):
    if path not in stats:
        raise ValueError(f"no routing was captured for the MoE layer at {'/'.join(path)}")
    return stats[path]


def _top(weight, experts: int):
    """The `experts` indices of the largest `weight` (ties to the first), in order."""
    _, top = jax.lax.top_k(weight, experts)
    return jnp.sort(top)


def keep(params, experts: int, stats: dict | None, key):
    """`params` with each MoE layer's `experts` X' experts kept: those of the largest routed
    weight (`stats`, from `usage`) or, without it, a uniform draw per layer from `key` (the
    run's init key: a seed ensemble's member draws as the plain run of its seed); in their
    order."""
    out = params
    for i, (path, layer) in enumerate(sorted(_moe_layers(params).items())):
        X = layer["router"].shape[-1]
        if stats is None:
            score = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, DRAW), i), (X,))
        else:
            score = _used(stats, path)[0]
        kept = _top(score, experts)
        out = _replace(out, path, {**layer, **{
            k: jnp.take(layer[k], kept, axis=-1 if k in EXPERT_LAST else 0)
            for k in EXPERT_LAST + EXPERT_FIRST if k in layer}})
    return out


def merge_plan(experts: int):
    """`calibrate` of `train.init_experts='merged'`: {path of each MoE layer: `plan_layer`
    of its `usage`}. On the host (scipy)."""
    def calibrate(model, params, batches, rngs=None):
        stats = usage(model, params, batches, rngs)
        return {path: plan_layer(*_used(stats, path), layer, experts)
                for path, layer in sorted(_moe_layers(params).items())}
    return calibrate


def plan_layer(weight, gram, layer: dict, experts: int) -> dict:
    """How one MoE layer's X experts merge into `experts` X' (`weight` [X] routed, `gram`
    [X, X] router probabilities' P^T P, from `usage`): {"weight": `weight`, "kept": [X'] the
    dominant experts (the most routed, ties to the first, in order), "group": [X] the kept
    slot each expert merges into (its own for a dominant one; else the dominant one whose
    router probabilities over the tokens are most alike, by the cosine of their columns),
    "perm": [X, F] each expert's neurons in the order that best matches its dominant one's
    (a linear assignment maximizing the summed inner products of matched neurons' weights:
    `wi` columns, `bi`, `wo` rows; the identity for a dominant one)}."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment
    weight, gram = np.asarray(weight, np.float64), np.asarray(gram, np.float64)
    kept = np.sort(np.argsort(-weight, kind="stable")[:experts])
    norm = np.sqrt(np.maximum(np.diag(gram), 1e-30))
    group = np.argmax((gram / norm[:, None] / norm[None, :])[:, kept], axis=1)
    group[kept] = np.arange(experts)
    wi, bi, wo = (np.asarray(layer[k], np.float64) for k in ("wi", "bi", "wo"))
    perm = np.tile(np.arange(wi.shape[-1]), (len(weight), 1))
    for j in range(len(weight)):
        d = kept[group[j]]
        if d != j:
            score = wi[d].T @ wi[j] + np.outer(bi[d], bi[j]) + wo[d] @ wo[j].T
            perm[j] = linear_sum_assignment(score, maximize=True)[1]
    return {"weight": weight.astype(np.float32), "kept": kept.astype(np.int32),
            "group": group.astype(np.int32), "perm": perm.astype(np.int32)}


def merge(params, experts: int, plans: dict):
    """`params` with each MoE layer's experts merged into `experts` X' by `merge_plan`'s
    plan (MC-SMoE, Li et al. 2024, "Merge, Then Compress"): each kept expert becomes the
    average of its group's experts, neurons aligned to it, weighted by their routed weight
    (evenly where the group carried none); the router keeps the dominant experts' columns."""
    out = params
    for path, layer in sorted(_moe_layers(params).items()):
        plan = _used(plans, path)
        perm_XF = plan["perm"]
        aligned = {"wi": jnp.take_along_axis(layer["wi"], perm_XF[:, None, :], axis=2),
                   "bi": jnp.take_along_axis(layer["bi"], perm_XF, axis=1),
                   "wo": jnp.take_along_axis(layer["wo"], perm_XF[:, :, None], axis=1),
                   "bo": layer["bo"]}
        member_XK = jax.nn.one_hot(plan["group"], experts, dtype=jnp.float32)
        w_XK = member_XK * plan["weight"][:, None]
        total_1K = jnp.sum(w_XK, axis=0, keepdims=True)
        coef_XK = jnp.where(total_1K > 0, w_XK / jnp.where(total_1K > 0, total_1K, 1.0),
                            member_XK / jnp.sum(member_XK, axis=0, keepdims=True))
        merged = {k: jnp.einsum("xk,x...->k...", coef_XK, v.astype(jnp.float32)).astype(v.dtype)
                  for k, v in aligned.items()}
        merged.update({k: jnp.take(layer[k], plan["kept"], axis=-1)
                       for k in EXPERT_LAST if k in layer})
        out = _replace(out, path, {**layer, **merged})
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


def noise_as(params, fresh):
    """`params` with each MoE layer's noise weights (`model.moe.noisy`) as `fresh` (this
    run's initial parameters) has them: its own where both have them, `fresh`'s where only
    `fresh` does, none where `fresh` has none. A bug hunt (session 103): a cut that turned
    noisy gating on or off kept the source's, a tree that failed in device_put naming no
    field."""
    want = _moe_layers(fresh)
    out = params
    for path, layer in _moe_layers(params).items():
        if path in want and ("noise" in layer) != ("noise" in want[path]):
            rest = {k: v for k, v in layer.items() if k != "noise"}
            out = _replace(out, path, {**rest, **{k: v for k, v in want[path].items()
                                                  if k == "noise"}})
    return out


def conversion(cfg: Config, src: ModelConfig, workdir: str):
    """A `gqa.Conversion` that changes the experts of the `train.init_from` run (model
    `src`) into this run's, or None when they stay (module doc)."""
    from hpnlp.compress.gqa import Conversion, with_trained_draw
    how = change(src, cfg.model, workdir)
    t, X = cfg.train, cfg.model.moe.num_experts
    does = ("copies that run's dense MLP into every expert" if how == "upcycle" else
            f"keeps that run's {src.moe.num_experts} experts as they are"
            if src.moe.num_experts else "has no experts to cut")
    if how != "prune" and t.init_experts != "routed":
        raise config_error("train.init_experts", t.init_experts, f"chooses which experts of "
                           f"train.init_from={workdir} a run of fewer keeps, and this run "
                           f"{does}; leave it 'routed'")
    default_batches = type(t)().init_expert_batches
    if how != "prune" and t.init_expert_batches != default_batches:
        # a review (session 116): taken and read by nothing, as init_experts was
        raise config_error("train.init_expert_batches", t.init_expert_batches, f"routes "
                           f"batches through train.init_from={workdir} to choose which experts "
                           f"a run of fewer keeps, and this run {does}; leave it "
                           f"{default_batches}")
    if how == "upcycle":
        return Conversion(source_config(cfg, src),
                          lambda p, stats, fresh, key: upcycle(p, fresh, X))
    if how == "prune" and t.init_experts == "merged":
        return Conversion(source_config(cfg, src),
                          lambda p, plans, fresh, key: noise_as(merge(p, X, plans), fresh),
                          calibrate=with_trained_draw(merge_plan(X), workdir),
                          batches=t.init_expert_batches)
    if how == "prune":
        routed = t.init_experts == "routed"
        return Conversion(source_config(cfg, src),
                          lambda p, stats, fresh, key: noise_as(keep(p, X, stats, key),
                                                                fresh),
                          calibrate=with_trained_draw(usage, workdir) if routed else None,
                          batches=t.init_expert_batches if routed else 0)
    return None
