"""Mixture of experts: routers (`routing`), dispatch (`dispatch`: capacity and dropless),
the layer with expert parallelism (`layer`), and its metrics (`summarize`).

    >>> cfg.model.moe.num_experts = 8        # doctest: +SKIP  (a ConfigDict: every block is MoE)
"""

from __future__ import annotations

import jax
import numpy as np

from hpnlp.moe.layer import ROUTES, MoE  # noqa: F401 (MoE: the public name)


def eval_groups(cfg, num_devices: int | None = None) -> int:
    """The routing groups the run of `cfg` evaluates in on `num_devices` devices (default:
    this process's `jax.device_count()`): model.moe.groups, or where that is 0 one group per
    data-parallel shard of the run's mesh laid out on those devices as `Trainer` reads a
    saved run (`hpnlp.train.loop.reader_mesh`)."""
    import math

    from hpnlp.train.loop import reader_mesh
    if cfg.model.moe.groups:
        return cfg.model.moe.groups
    mesh, k, _ = reader_mesh(cfg, jax.device_count() if num_devices is None else num_devices)
    sizes = mesh.axis_sizes(k)
    return math.prod(sizes[a] for a in mesh.mesh_axes_of("batch"))


def route(cfg, params, batch, *, num_devices: int | None = None, features_key=None) -> dict:
    """Where each MoE block sends the tokens of `batch` in evaluation (token choice at
    eval_capacity_factor, expert choice at the capacity_factor it trained with):
    {block index: {"weights": [B, L, X] weight of each expert's output in each token (0: not
    routed, or dropped past capacity), "probs": [B, L, X] router probabilities}}. A batch of
    several texts (the dual and bi-encoder's `inputs1`, `inputs2`, `inputs3`, routed in one
    trunk call) gives each text's under its number: "weights1", "probs1", ...

    The batch is routed in the groups the run's evaluation uses on `num_devices` devices
    (default: this process's; `eval_groups`): model.moe.groups, or with groups=0 one per
    data-parallel shard of the run's mesh there, so capacity drops what `Trainer.evaluate`
    drops (computed on one device: the groups, not the devices, decide the routing).
    Dropless token choice drops nothing, so its routes are the same in any groups: its batch
    is routed as one group, whatever its rows. A model whose attention draws random features
    from the run's stream (Performer with redraws, LSH) routes under the draw it trained
    with, `features_key=state.features_key(cfg.train.feature_redraw_every)` (refused without
    it: a review, session 117, found it routed under its seed's draw, another function).

        >>> routes = hpnlp.moe.route(cfg, state.params, batch)   # doctest: +SKIP
        >>> expert_BL = routes[1]["weights"].argmax(-1)           # top-1: each token's expert
    """
    import dataclasses

    from hpnlp import models
    if not cfg.model.moe.num_experts:  # a README walk: a bare KeyError: 'moe_routes'
        raise ValueError("hpnlp.moe.route: this model has no MoE blocks "
                         "(model.moe.num_experts=0); route a run trained with experts")
    if cfg.model.stack_layers:  # found in review: a KeyError deep in the routes' collection
        raise ValueError("hpnlp.moe.route cannot read stacked layers yet "
                         "(model.stack_layers=True: the blocks run as one scan, which keeps no "
                         "routes); route a model trained with model.stack_layers=False")
    # a bug hunt (session 100): groups=0 routed the batch as one group (one device, no
    # mesh), where a run evaluated on 4 devices routes in 4 and drops other tokens
    c = cfg.model.moe
    # review r4: a dropless run's batch was refused for rows its groups did not split into
    groups = (1 if c.dispatch == "dropless" and c.router != "expert_choice"
              else eval_groups(cfg, num_devices))
    # a bug hunt (session 103): a dual encoder's batch (inputs1, inputs2) was a bare
    # KeyError 'inputs', and only its trunk's first call was read
    names = texts(batch)
    rows = batch["inputs" + names[0]].shape[0]
    if not c.groups and rows % groups:  # (review: the layer's error named groups)
        raise ValueError(f"hpnlp.moe.route: the run evaluates in {groups} routing groups on "
                         f"these devices (one per data-parallel shard), which {rows} batch "
                         f"rows do not split into; pass a batch of a multiple of {groups} "
                         "rows, or num_devices=1 to route it as one group")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, moe=dataclasses.replace(c, groups=groups)))
    from hpnlp.retrieval.knnlm import features_rngs
    rngs = features_rngs(cfg, features_key, "hpnlp.moe.route")
    model = models.build(cfg, deterministic=True, forward_only=True)
    # An LM's trunk only (a bug hunt, session 100: "evaluate" ran the output layer, which
    # built without the task's token counts has other shapes than a class_based run's:
    # flax's ScopeParamShapeError); routing never reads the output layer.
    method = "hidden" if cfg.model.kind == "lm" else "evaluate"
    # jitted: run eagerly, the model compiles every primitive separately
    _, got = jax.jit(lambda p, b: model.apply({"params": p}, b, method=method,
                                              mutable=[ROUTES], rngs=rngs))(params, batch)
    # one sown value a block: the dual and bi-encoder route all their texts in one trunk
    # call (`heads.encode_sides`, review r1), split back into the texts here
    from hpnlp.models.heads import unstack_sides
    widths = [batch["inputs" + t].shape[1] for t in names]
    out = {}
    for name, sub in got[ROUTES]["trunk"].items():
        out[int(name[len("block_"):])] = {
            k + text: x for k, (call,) in sub["moe"].items()
            for text, x in zip(names, unstack_sides(np.asarray(call), widths))}
    return dict(sorted(out.items()))


def texts(batch) -> list[str]:
    """The texts of `batch` a model routes, in the order its trunk call stacks them, by the
    suffix of their keys: [""] (`inputs`, `segment_ids`), or the dual and bi-encoder's
    ["1", "2"] and "3" where the batch holds mined negatives (`inputs3`, `segment_ids3`)."""
    if "inputs" in batch:
        return [""]
    return [t for t in ("1", "2", "3") if "inputs" + t in batch]


def summarize(sums: dict) -> dict:
    """Host-side: MoE sums (per MoE layer, summed over steps) -> metrics: the fraction of
    choices dropped, the router's mean entropy (nats), each layer's load per expert as
    fractions of its routed choices, and the largest expert's load over the mean."""
    if "moe_tokens" not in sums:
        return {}
    load_LX = np.asarray(sums["moe_load"], np.float64).reshape(-1, np.shape(sums["moe_load"])[-1])
    frac_LX = load_LX / np.maximum(load_LX.sum(-1, keepdims=True), 1.0)
    mean = load_LX.mean(-1, keepdims=True)
    return {"moe_dropped_frac": float(np.sum(sums["moe_dropped"]) / max(np.sum(sums["moe_assigned"]), 1.0)),
            "moe_router_entropy": float(np.sum(sums["moe_entropy"]) / max(np.sum(sums["moe_tokens"]), 1.0)),
            "moe_load_max_vs_mean": float(np.max(load_LX / np.maximum(mean, 1e-9))),
            "moe_load": np.round(frac_LX, 5).tolist()}
