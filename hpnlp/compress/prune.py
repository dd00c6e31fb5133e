"""Pruning: masks in the train state, applied after every optimizer update (`train.prune.*`).

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/pruned \\
        --config.train.prune.method=magnitude --config.train.prune.sparsity=0.75 \\
        --config.train.prune.schedule=cubic

The masks are the `prune` carry of the train state (hpnlp.train.carry), saved in every
checkpoint with the rest of it. After each optimizer update the step multiplies every pruned
weight by its mask, so a pruned weight is exactly zero in every step's parameters and in
every checkpoint, whatever the optimizer's moments would have made of it. (jaxpruner, the
field's JAX pruning library, does the same with a `post_gradient_update` after the optax
update; it is not on the package registry this project installs from, so this is hpnlp's
own, in its shape.)

Which weights: the product weights the model declares (`qlinear.note_product`, the same
record quantization uses), of the kinds `train.prune.layers` names: an MoE layer's experts
(`mlp`, each expert's weights along its own contraction), and a factorized product's U
and V (model.lowrank) as two weights. Biases, norms and (by default) embeddings and the
output layer stay dense, and so do latent attention's `k_up` and `v_up` (its `q` and
`kv_down` are its qkv products). Transformer-XL's attention declares no products (a new
run is refused qkv and out there: compress_checks._check_new_prune). With
`output.tie_embeddings`, naming `output` prunes the input embedding table too: the tied output
layer declares the Embed's table as its product, so the lookup reads the pruned rows' zeros.

- Criteria: `magnitude` (|W|), `random` (a fixed random score per weight: the control) and
  `movement` (Sanh et al. 2020: scores learned by Adam on the straight-through
  estimator's gradient, `movement_update`; the carry then also holds the scores, their
  moments and the dense weights, and under `cubic` a pruned weight can come back; a
  one-shot mask is made once, from the scores of the steps up to `start_step`, which must
  not be 0: after one step every score is that batch's gradient sign, +-1);
  L1-regularized training adds `l1 * sum |W|` over the pruned products to the per-token
  objective (`train.prune.l1`; an auxiliary loss beside the model's, which `loss` and `ppl`
  still log; the sum is logged as `loss_l1`), so magnitude masks find what it drove to zero.
  A pruned weight's score is -inf, and a recompute prunes at least what the masks already do,
  so masks only ever lose entries: gradual schedules nest, and a target lowered on resume (a
  longer train.steps moves the cubic schedule and imp's rounds) keeps them until it passes
  them.
- Scope: `layer` (each weight pruned to the target on its own, each expert of an MoE
  layer too: `Product.lead`) or `global` (one ranking of every pruned weight's score, |W|
  or the method's; layers end at different sparsities).
- Structure: unstructured, or N:M (N kept in every M consecutive weights along the
  contraction, as 2:4 sparse hardware wants); N:M masks are made once, at `start_step`.
  Or `structured`: whole attention heads and MLP neurons (`group_layout`), the same
  fraction of each block's heads and of its neurons (at least one of each kept), ranked
  by the L2 norm of all the weights a unit owns (a head: its slices of qkv and out; a
  neuron: its mlp_in column and bias and its mlp_out row) or at random. The carry then also
  holds each block's unit masks (`groups`), and `shrink` / `python -m hpnlp.compress shrink`
  removes what they pruned: a smaller dense Transformer of the same config class
  (`model.num_heads`, `model.mlp_dim` smaller, `model.head_dim` kept) computing what the
  masked model computed.
  An MoE layer's experts are MLPs of their own: each expert's neurons rank among
  themselves and every expert keeps the same count (a neuron owns its column of the
  expert's `wi` and `bi`, its row of `wo`), as do its shared experts (model.moe.shared_
  experts, one wider MLP: S experts' neurons side by side), so the shrunk layer's experts
  stack as before, `model.moe.mlp_dim` smaller. The router is kept: with a pruned neuron's
  weights zero its gelu reads 0 and it adds nothing, so every expert computes what it did.
  An LSTM/GRU's units are its `model.width` channels (`rnn_layout`), which size the
  embedding and every layer's state alike, so unit j is hidden unit j of every layer at
  once, as width pruning of a Transformer's residual stream removes a channel from every
  block (CoFi, Xia et al. 2022); `combine='sum'` and `'residual'` add the layers' channels,
  so they could not be pruned apart anyway. Unit j owns the embedding's column j (the tied
  output's row j), in every layer its K gate columns of the input and recurrent kernels,
  its row of the recurrent kernel, its gate biases (GRU: and `hn_bias`), its learned
  initial state and its input row (the first layer's reads the embedding); and the
  consumer's row j (the LM's untied `full` output kernel, the classifier's head and memory
  query). Units rank like heads (an entry on a unit's row and column counted once). With
  all of them zero the unit's pre-activations are 0, so from a zero state an LSTM keeps
  c = 0.5 c_prev = 0 and h = 0.5 tanh(0) = 0, a GRU h = 0.5 h_prev + 0.5 tanh(0) = 0
  (dropout, zoneout and padding only scale or keep zeros): the unit outputs exactly zero,
  and removing it changes nothing. The shrunk model's `model.width` is the kept count; its
  first layer's input rows absorb sqrt(width / kept), the embedding's input scale.
  Refused (config.validate): layer norm (it normalizes over all units, so removing one
  renormalizes the rest), bidirectional layers, and consumers other than those above.
- Schedules: `oneshot` (the target after the update of step `start_step`), `cubic`
  (Zhu & Gupta 2017): s_t = s_f (1 - (1 - (t - t0) / (t1 - t0))^3) for t0 <= t <= t1
  (t1: `end_step`, or the run's last step; from t1 on, s_f, even where t1 is t0), masks
  recomputed every `every` steps and at t1, and `imp`: iterative magnitude pruning
  with weight rewinding (lottery tickets: Frankle & Carbin 2019, Frankle et al. 2020) in
  one run. The model's weights after `rewind_step` updates are kept in the carry; the steps
  after them split into `rounds` + 1 segments (`imp_boundaries`), and at the end of each but
  the last the masks prune the same share of what remains (round j of n ends at sparsity
  1 - (1 - s)^(j/n)), ranked by the weights the round ended with, and every weight (pruned
  products' survivors, embeddings, norms, biases) goes back to its kept value. Unlike the
  papers' separate runs per round, the learning-rate schedule and the optimizer's moments
  run on through the rounds rather than restarting. Each recompute is one the schedule
  has come to since the last (the carry keeps its step, `updates_due`), so a step whose
  update float16 loss scaling skipped (the state is kept as it was) does not lose it: it
  happens at the next step that updates. And masks that prune less than the schedule asks
  after that step (a resume that raised `train.prune.sparsity`: the counts tell, as they
  are exact) are recomputed at the next step too.

Counts are exact: a target s prunes round(s * n) of a weight's n entries (ties broken by
position), or round(s * total) of all of them in global scope, the product taken in float32
(a review, session 118: past 2^24 entries it may be one off the exact round(s * n), the
same count wherever it is computed: the masks and `holds_target` agree).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import NamedTuple

import flax.linen as nn
import flax.traverse_util as traverse
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.compress import qlinear
from hpnlp.compress.qlinear import Factored
from hpnlp.config import QUANT_LAYERS, Config, PruneConfig
from hpnlp.train.carry import AUX_LOSS, Carry


def sparsity_at(p: PruneConfig, step, total_steps: int):
    """Target sparsity after the update of step `step` (0-based; a traced int works)."""
    final = final_sparsity(p)
    t0 = p.start_step
    if p.schedule == "oneshot":
        return jnp.where(step >= t0, final, 0.0).astype(jnp.float32)
    if p.schedule == "imp":  # round j of n ends at 1 - (1 - s)^(j / n): the same share each round
        done = jnp.sum(step >= jnp.asarray(imp_boundaries(p, total_steps)))
        return (1.0 - (1.0 - final) ** (done / p.rounds)).astype(jnp.float32)
    t1 = cubic_end(p, total_steps)
    # the target from t1 on, even where t1 is t0 (a bug hunt, session 99: a schedule starting
    # on the run's last step, its end clamped there, pruned nothing, unsaid)
    frac = jnp.where(step >= t1, 1.0, jnp.clip((step - t0) / max(t1 - t0, 1), 0.0, 1.0))
    return (final * (1.0 - (1.0 - frac) ** 3)).astype(jnp.float32)


def final_sparsity(p: PruneConfig) -> float:
    """The sparsity the schedule ends at: `sparsity`, or 1 - N/M for N:M."""
    return 1.0 - p.nm()[0] / p.nm()[1] if p.nm() is not None else p.sparsity


def short_of_target(p: PruneConfig, step: int, total_steps: int) -> str | None:
    """What a run saved at `step` (updates done) lacks of its schedule's sparsity, said as
    a line (a run stopped mid-schedule, then shrunk), or None where it reached it. Its
    masks are those of the schedule's latest recompute before `step`."""
    final, last = final_sparsity(p), int(last_update(p, step - 1, total_steps))
    reached = float(sparsity_at(p, last, total_steps)) if last >= 0 else 0.0
    if reached >= final - 1e-6:
        return None
    field = (f"train.prune.structure={p.structure!r}" if p.nm() is not None else
             f"train.prune.sparsity={final:g}")
    return (f"the run was saved at step {step}, before its pruning schedule reached "
            f"{field}: its masks hold {reached:.3g}; train it on to "
            f"train.steps={total_steps} (rerun its command) for the target")


def cubic_end(p: PruneConfig, total_steps: int) -> int:
    """The step (0-based) after whose update the cubic schedule reaches its sparsity:
    `end_step`, or the run's last step (end_step 0, or train.steps: step train.steps never
    runs, and a schedule ending there left the run short of its target)."""
    return min(p.end_step or total_steps, total_steps - 1)


def final_prunes_units(p: PruneConfig, layout: dict) -> bool:
    """Whether the schedule's final target removes a unit of some group (`layout`'s): a run
    that removed none is then one that has not trained far enough (saved at its start_step,
    before that step's update, or at a cubic target too small for a whole unit; a review,
    session 116: such runs were told to prune to a higher sparsity, not to train on)."""
    return any(int(units_pruned(final_sparsity(p), g.units)) > 0 for g in layout.values())


def other_draw(cfg, step: int) -> str | None:
    """A line where the run saved at `step` trained with another random-feature draw than
    draw 0, which a new run shrunk from it reads at its step 0 (Performer's redrawn features,
    LSH's rotations: `TrainState.features_key`), else None. A review (session 116): its eval
    was set beside the masked model's, under the trained draw, as the same function."""
    from hpnlp.retrieval.knnlm import reads_features
    every = cfg.train.feature_redraw_every
    draw = (max(step, 1) - 1) // every if every else 0
    if not reads_features(cfg) or draw == 0:
        return None
    return (f"attention.name={cfg.attention.name!r} draws its random features by step "
            f"(train.feature_redraw_every={every}): the run's step {step} trained with draw "
            f"{draw}, and the shrunk run, a new run at step 0, reads draw 0, so it computes with "
            "other features than the masked model (summary.json: eval against eval_masked); "
            "fine-tune it (train.init_from=OUT) to train its weights under its own draws")


def last_update(p: PruneConfig, step, total_steps: int):
    """The latest step <= `step` after whose update the schedule recomputes masks (module
    doc), -1 before the first (a traced int works)."""
    t0 = p.start_step
    if p.schedule == "oneshot" or p.nm() is not None:
        return jnp.where(step >= t0, t0, -1)
    if p.schedule == "imp":
        bounds = jnp.asarray(imp_boundaries(p, total_steps))
        return jnp.max(jnp.where(bounds <= step, bounds, -1))
    t1 = cubic_end(p, total_steps)
    return jnp.where(step < t0, -1,
                     jnp.where(step >= t1, t1, t0 + (step - t0) // p.every * p.every))


def updates_at(p: PruneConfig, step, total_steps: int):
    """Whether `step` is one after whose update the schedule recomputes masks."""
    return last_update(p, step, total_steps) == step


def updates_due(p: PruneConfig, last, step, total_steps: int):
    """Whether masks are recomputed after the update of step `step`, the last recompute
    having been after step `last` (-1: none yet): some scheduled step has come since. A
    step whose update was skipped (float16 loss scaling on an overflow) leaves the whole
    state as it was, `last` included, so its recompute happens at the next step that
    updates, instead of being lost (as a one-shot pruning at step 0 was)."""
    return last_update(p, step, total_steps) > last


def imp_boundaries(p: PruneConfig, total_steps: int) -> list[int]:
    """The steps (0-based) after whose update iterative magnitude pruning prunes and rewinds:
    the steps after `rewind_step` split into `rounds` + 1 equal segments, a boundary at the
    end of each but the last."""
    seg = (total_steps - p.rewind_step) // (p.rounds + 1)
    return [p.rewind_step + j * seg - 1 for j in range(1, p.rounds + 1)]


def _keep_top(score_n, prune_count):
    """Mask over a flat score vector keeping all but the `prune_count` lowest (ties: the
    earlier position is pruned first)."""
    rank = jnp.argsort(jnp.argsort(score_n, stable=True), stable=True)
    return rank >= prune_count


def _nm_groups(x, contraction: tuple[int, ...], m: int):
    """`x` as [K / M, M, rest]: every M consecutive entries along the contraction axes (moved
    first and flattened)."""
    k_axes = tuple(a % x.ndim for a in contraction)
    rest = tuple(a for a in range(x.ndim) if a not in k_axes)
    moved = jnp.transpose(x, k_axes + rest)
    return moved.reshape(math.prod(moved.shape[:len(k_axes)]) // m, m, -1)


def nm_mask(score, contraction: tuple[int, ...], n: int, m: int):
    """Keep the N highest scores in every M consecutive entries along the contraction axes
    (moved first and flattened)."""
    k_axes = tuple(a % score.ndim for a in contraction)
    rest = tuple(a for a in range(score.ndim) if a not in k_axes)
    moved = jnp.transpose(score, k_axes + rest)
    K = math.prod(moved.shape[:len(k_axes)])
    if not 0 < n < m or K % m:  # else the groups would straddle the contraction's rows silently
        raise ValueError(f"{n}:{m} mask of a weight {tuple(score.shape)} contracted over axes "
                         f"{contraction} (K={K}): needs 0 < N < M and M dividing K")
    groups = _nm_groups(score, contraction, m)
    order = jnp.argsort(-groups, axis=1, stable=True)  # highest first
    rank = jnp.argsort(order, axis=1, stable=True)
    keep = (rank < n).reshape(moved.shape)
    return jnp.transpose(keep, np.argsort(k_axes + rest))


def seed_key(seed):
    """The key random scores draw from: `jax.random.key(seed)` of an int seed (the run's
    cfg.seed), or `seed` itself where it is a key (a seed ensemble member's: `for_member`)."""
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    return jax.random.key(seed)


def scores(method: str, weights: dict, seed, movement: dict | None = None) -> dict:
    """Per-weight criterion: |W| (`magnitude`), a fixed uniform draw per entry (`random`,
    from `seed`: an int or a key, `seed_key`), or the accumulated movement scores
    (`movement`, passed in)."""
    if method == "movement":
        return movement
    if method == "magnitude":
        return {k: jnp.abs(w.astype(jnp.float32)) for k, w in weights.items()}
    base = seed_key(seed)
    return {k: jax.random.uniform(jax.random.fold_in(base, i), w.shape)
            for i, (k, w) in enumerate(sorted(weights.items()))}


def compute_masks(p: PruneConfig, weights: dict, masks: dict, sparsity, products: dict,
                  seed, movement: dict | None = None, leads: Mapping | None = None) -> dict:
    """New masks for `weights` (path -> array) at target `sparsity`. Magnitude and random
    masks never revive an entry `masks` already pruned: they prune at least as many as
    `masks` do (a target below theirs keeps them); movement masks are the top scores afresh
    each time, at the target (a pruned weight whose score climbs comes back, as in Sanh et
    al.). `leads`: {path: Product.lead} where a weight's leading axes index a batch of
    weights (an MoE layer's experts), each pruned to the target on its own in layer scope."""
    s = scores(p.method, weights, seed, movement)
    if p.method != "movement":
        s = {k: jnp.where(masks[k], v, -jnp.inf) for k, v in s.items()}
    if p.nm() is not None:
        n, m = p.nm()
        keep = masks if p.method != "movement" else {k: True for k in s}
        return {k: nm_mask(v, products[k], n, m) & keep[k] for k, v in s.items()}

    def count(size, pruned):
        # a review: a scheduled recompute after a resume with a longer train.steps (a lower
        # target) pruned only round(s * n) of the -inf entries, reviving the rest by position
        n = jnp.round(sparsity * size).astype(jnp.int32)
        return n if p.method == "movement" else jnp.maximum(n, pruned)

    if p.scope == "layer":  # each weight on its own; each expert of an MoE layer too (a
        # review: its experts were ranked as one, so one of small weights lost nearly all)
        out = {}
        for k, v in s.items():
            rows = v.reshape(math.prod(v.shape[:(leads or {}).get(k, 0)]), -1)
            pruned = jnp.sum(~masks[k].reshape(rows.shape), axis=1)
            n = jnp.broadcast_to(count(rows.shape[1], pruned), pruned.shape)
            out[k] = jax.vmap(_keep_top)(rows, n).reshape(v.shape)
        return out
    keys = sorted(s)
    flat = jnp.concatenate([s[k].reshape(-1) for k in keys])
    keep = _keep_top(flat, count(flat.size, sum(jnp.sum(~masks[k]) for k in keys)))
    out, at = {}, 0
    for k in keys:
        out[k] = keep[at:at + s[k].size].reshape(s[k].shape)
        at += s[k].size
    return out


def _path(key: str) -> tuple[str, ...]:
    return tuple(key.split("/"))


# A factorized weight (model.lowrank's Factored U, V) is pruned as its two factors, each a
# weight of its own under its path + one of these (U contracts what the weight contracts,
# V its rank axis); `_flatten` opens every Factored into them, `_unflatten` closes them.
FACTORS = ("factor_u", "factor_v")


def _open(tree):
    if isinstance(tree, Factored):
        return dict(zip(FACTORS, (tree.u, tree.v)))
    if isinstance(tree, Mapping):
        return {k: _open(v) for k, v in tree.items()}
    return tree


def _close(tree, like):
    """`tree` with the factor pairs `_open` made of `like`'s Factored weights closed again
    (each keeping its own static fields: an MoE layer's experts' `lead`)."""
    if isinstance(like, Factored):
        return like.replace(u=tree[FACTORS[0]], v=tree[FACTORS[1]])
    if isinstance(tree, Mapping):
        return {k: _close(v, like[k]) for k, v in tree.items()}
    return tree


def _flatten(params) -> dict:
    """traverse.flatten_dict, each Factored weight as its two factors."""
    return traverse.flatten_dict(_open(params))


def _unflatten(flat: dict, like):
    """The inverse of `_flatten(like)`, with `flat`'s leaves."""
    return _close(traverse.unflatten_dict(flat), like)


def targets(cfg: Config, model, params, batch) -> dict:
    """{"a/b/kernel": Product} of the weights `train.prune` prunes (a factorized weight's
    "a/b/kernel/factor_u" and ".../factor_v")."""
    p = cfg.train.prune
    found = qlinear.products(model, params, batch)
    flat = traverse.flatten_dict(params, is_leaf=lambda _, x: isinstance(x, Factored))
    out = {}
    for k, v in sorted(found.items()):
        if v.kind not in QUANT_LAYERS or not p.applies(v.kind):  # not "embed": a lookup
            continue
        if isinstance(flat.get(k), Factored):  # V contracts its rank axis (after the lead)
            out["/".join(k + (FACTORS[0],))] = v
            out["/".join(k + (FACTORS[1],))] = qlinear.Product(v.kind, (flat[k].lead,),
                                                                flat[k].lead)
        else:
            out["/".join(k)] = v
    return out


def apply_masks(params, masks: dict):
    """`params` with every masked weight multiplied by its mask (exact zeros)."""
    flat = _flatten(params)
    for k, mask in masks.items():
        path = _path(k)
        flat[path] = jnp.where(mask, flat[path], jnp.zeros((), flat[path].dtype))
    return _unflatten(flat, params)


def sparsity_report(params, masks: dict) -> dict:
    """{path: fraction of exact zeros} for every pruned weight, and "total"."""
    flat = _flatten(params)
    out, zeros, size = {}, 0, 0
    for k in masks:
        w = np.asarray(flat[_path(k)])
        z = int(np.sum(w == 0))
        out[k] = z / w.size
        zeros, size = zeros + z, size + w.size
    out["total"] = zeros / max(size, 1)
    return out


# ---------------------------------------------------------------- structured pruning

# A product kind -> the logical axis its units lie along (parameters carry logical axis
# names, hpnlp.models.transformer), and what a unit of that axis is called. An MoE layer's
# neurons (its experts' and its shared experts') are "expert_mlp": they size
# model.moe.mlp_dim where a dense block's size model.mlp_dim.
GROUP_AXIS = {"qkv": "heads", "out": "heads", "mlp": "mlp"}
UNIT_NAME = {"heads": "heads", "mlp": "neurons", "expert_mlp": "expert neurons",
             "width": "hidden units"}
RNN_ARCHS = ("lstm", "gru")
RNN_UNITS = "trunk/rnn/units"  # the one group of an LSTM/GRU model (module doc)


class Group(NamedTuple):
    """One set of units `structured` pruning ranks: `rows` x `units` of them, each row
    ranked on its own and keeping the same count (an MoE layer's experts are its rows; a
    dense block's heads or neurons are one row). Its mask is bool [units] (one row) or
    [rows, units]. `members`: {parameter path: its unit axes}; `row_axes`: {path: the axis
    that indexes the rows} for members that hold one (the experts' weights); a member
    without one holds the rows one after another along its unit axis (the shared experts'
    one wider MLP: expert r's neurons are r * units + j)."""

    axis: str
    units: int
    members: dict
    rows: int = 1
    row_axes: dict = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.units,) if self.rows == 1 else (self.rows, self.units)


def _axes(ax) -> tuple[int, ...]:
    """A member's unit axes: one index (a head or neuron slice) or a tuple (an LSTM/GRU
    recurrent kernel holds unit j along its rows and its columns)."""
    return (ax,) if isinstance(ax, int) else tuple(ax)


def rnn_layout(cfg: Config, boxed_params) -> dict:
    """{RNN_UNITS: Group("width", model.width, {member path: unit axes})}: the hidden units
    of an LSTM/GRU model as `structured` pruning sees them (module doc). Inside the stack
    the units lie along the logical "mlp" axes (hidden) and "embed" (the first layer's
    input), plus the recurrent kernel's rows, which carry no name (naming them "mlp" too
    would shard both axes of one array over one mesh axis); outside it along "embed"."""
    flat = traverse.flatten_dict(boxed_params)
    width, members = cfg.model.width, {}
    for path, leaf in sorted(flat.items()):
        names = tuple(getattr(leaf, "names", ()) or ())
        inside = path[:2] == ("trunk", "rnn")
        axes = tuple(i for i, n in enumerate(names) if n == "embed" or (inside and n == "mlp"))
        if inside and path[-1] == "recurrent_kernel":  # [D, H, K, H]: h_j feeds every gate
            axes = (1,) + axes
        key = "/".join(path)
        if inside and not axes:  # config.validate refuses what could get here (layer norm)
            raise ValueError(f"structured pruning cannot remove hidden units from {key}: it has "
                             "no per-unit axis")
        shape = nn.unbox(leaf).shape
        if any(shape[a] != width for a in axes):
            raise ValueError(f"{key} {shape}: its unit axes {axes} are not model.width={width}")
        if axes:
            members[key] = axes
    return {RNN_UNITS: Group("width", width, members)}


def _names(leaf) -> tuple:
    return tuple(getattr(leaf, "names", ()) or ())


def group_layout(products: dict, boxed_params) -> dict:
    """{group key: Group}: every block's heads and MLP neurons as `structured` pruning sees
    them. A group is one module's parent (a Transformer block) and a logical axis ("heads"
    or "mlp"); its members are the parameters of that block's modules (qkv, out; mlp_in's
    kernel and bias, mlp_out's kernel) whose logical names hold the axis. An MoE layer has
    two: its experts' neurons ("<block>/moe/expert_neurons": wi, bi, wo, one row per expert
    along their "expert" axis) and, with model.moe.shared_experts S, its shared experts'
    ("<block>/moe/neurons": shared_in, shared_out, S rows of model.moe's expert width).
    `products` maps parameter paths ("a/b/kernel") to Products."""
    flat = traverse.flatten_dict(boxed_params)

    def expert_shape(module):  # (experts, their width) of an MoE layer's module, else None
        for p, leaf in flat.items():
            names = _names(leaf)
            if p[:-1] == module and "expert" in names and "mlp" in names:
                shape = nn.unbox(leaf).shape
                return shape[names.index("expert")], shape[names.index("mlp")]
        return None

    out = {}
    for key_path, prod in sorted(products.items()):
        path = _path(key_path)
        axis = GROUP_AXIS.get(prod.kind)
        if axis is None:
            raise ValueError(f"train.prune.structure='structured': a {prod.kind!r} product "
                             f"({key_path}) has no heads or neurons to remove; set "
                             "train.prune.layers to qkv,out,mlp")
        module = path[:-1]
        experts = "expert" in _names(flat[path])
        parent, depth = (module, 1) if experts else (path[:-2], 2)
        key = "/".join(parent + ("expert_neurons" if experts else UNIT_NAME[axis],))
        if key in out:
            continue
        inner = sorted("/".join(p) for p in flat if p[:len(module)] == module
                       and len(p) > len(module) + 1)
        if axis == "heads" and inner:  # config.validate refuses such variants first
            raise ValueError(f"structured pruning cannot remove heads of {'/'.join(module)}: its "
                             f"attention variant has parameters of its own ({inner[:3]})")
        members, row_axes, sizes = {}, {}, set()
        for p, leaf in flat.items():
            names = _names(leaf)
            if p[:len(parent)] == parent and len(p) == len(parent) + depth and axis in names:
                members["/".join(p)] = names.index(axis)
                sizes.add(nn.unbox(leaf).shape[names.index(axis)])
                if experts:
                    row_axes["/".join(p)] = names.index("expert")
        if len(sizes) != 1:
            raise ValueError(f"the {UNIT_NAME[axis]} of {'/'.join(parent)} have no single size "
                             f"across {sorted(members)}")
        units = sizes.pop()
        if experts:
            out[key] = Group("expert_mlp", units, members, expert_shape(module)[0], row_axes)
        elif axis == "mlp" and (shape := expert_shape(parent)):  # the shared experts' MLP
            out[key] = Group("expert_mlp", shape[1], members, units // shape[1])
        else:
            out[key] = Group(axis, units, members)
    return out


def _on_rows(g: Group, w, path: str):
    """Member `w`'s sums per unit (its unit axis, and its row axis where it has one, kept;
    every other axis summed) as the group's [rows, units] / [units] shape."""
    ax = _axes(g.members[path])[0]
    r = g.row_axes.get(path)
    keep = (ax,) if r is None else (r, ax)
    v = jnp.sum(w, axis=tuple(i for i in range(w.ndim) if i not in keep))
    if r is not None and r > ax:
        v = v.T
    return v.reshape(g.shape)


def group_scores(method: str, flat: dict, layout: dict, seed) -> dict:
    """{group key: score of the group's shape} (`flat`: {"a/b/kernel": weight}): the sum of
    squares of every weight a unit owns (`magnitude`) or a fixed uniform draw per unit
    (`random`, from `seed`: an int or a key, `seed_key`)."""
    out = {}
    base = seed_key(seed)
    for i, (key, g) in enumerate(sorted(layout.items())):
        if method == "random":
            out[key] = jax.random.uniform(jax.random.fold_in(base, i), g.shape)
            continue
        total = jnp.zeros(g.shape, jnp.float32)
        for path, ax in g.members.items():
            w = jnp.square(flat[path].astype(jnp.float32))
            axes = _axes(ax)
            if len(axes) == 1:
                total = total + _on_rows(g, w, path)
                continue
            for a in axes:  # an LSTM/GRU recurrent kernel (one row)
                total = total + jnp.sum(w, axis=tuple(i for i in range(w.ndim) if i != a))
            # an entry on unit j's row and column is counted once
            total = total - jnp.sum(jnp.diagonal(w, axis1=axes[0], axis2=axes[1]),
                                    axis=tuple(range(w.ndim - 2)))
        out[key] = total
    return out


def units_pruned(sparsity, units: int):
    """How many of a row's `units` structured pruning at `sparsity` removes: rounded, never
    all of them (an int32 array: `sparsity` may be traced)."""
    return jnp.minimum(jnp.round(sparsity * units).astype(jnp.int32), units - 1)


def group_masks(p: PruneConfig, flat: dict, layout: dict, groups: dict, sparsity, seed) -> dict:
    """New unit masks at `sparsity` of each row's units (`units_pruned`), the same count in
    every row of a group; units already pruned stay pruned (each row prunes at least those:
    a lower target keeps them, as in `compute_masks`)."""
    s = group_scores(p.method, flat, layout, seed)
    out = {}
    for key, g in layout.items():
        before = jnp.sum(~jnp.asarray(groups[key]).reshape(g.rows, g.units), axis=1)
        count = jnp.maximum(units_pruned(sparsity, g.units), before)  # [rows]
        score = jnp.where(groups[key], s[key], -jnp.inf).reshape(g.rows, g.units)
        out[key] = jax.vmap(_keep_top)(score, count).reshape(g.shape)
    return out


def _member_view(g: Group, mask, path: str, ndim: int):
    """A group's mask (or index array) [rows, units] / [units] laid out along a member's
    axes: unit axis and row axis where it has one, every other axis of size 1."""
    ax = _axes(g.members[path])[0]
    r = g.row_axes.get(path)
    view = [1] * ndim
    if r is None:  # the rows one after another along the unit axis
        view[ax] = mask.size
        return mask.reshape(view)
    view[r], view[ax] = g.rows, mask.shape[-1]
    return (mask if r < ax else mask.T).reshape(view)


def expand_groups(groups: dict, layout: dict, shapes: dict) -> dict:
    """{member path: bool mask of the member's shape} from the unit masks (an entry on
    several unit axes is kept when every one of its units is)."""
    out = {}
    for key, g in layout.items():
        for path, ax in g.members.items():
            shape = shapes[path]
            if len(_axes(ax)) == 1:
                keep = _member_view(g, groups[key], path, len(shape))
            else:
                keep = jnp.ones((), bool)
                for a in _axes(ax):
                    view = [1] * len(shape)
                    view[a] = g.units
                    keep = keep & groups[key].reshape(view)
            out[path] = jnp.broadcast_to(keep, shape)
    return out


def _kept(g: Group, mask, key: str) -> np.ndarray:
    """The kept units' indices of each row, [rows, kept] (every row keeps as many)."""
    rows = np.asarray(mask).reshape(g.rows, g.units)
    counts = set(rows.sum(axis=1).tolist())
    if len(counts) != 1:
        raise ValueError(f"the experts of {key} keep different numbers of neurons "
                         f"({sorted(counts)}): one model.moe.mlp_dim needs one count")
    return np.stack([np.flatnonzero(r) for r in rows])


def _take_kept(g: Group, w, path: str, kept: np.ndarray):
    """Member `w` with only the kept units along its unit axes."""
    axes = _axes(g.members[path])
    if g.rows == 1:
        for a in axes:
            w = jnp.take(w, jnp.asarray(kept[0]), axis=a)
        return w
    if path not in g.row_axes:  # rows one after another: row r's unit j at r * units + j
        flat_idx = (np.arange(g.rows)[:, None] * g.units + kept).reshape(-1)
        return jnp.take(w, jnp.asarray(flat_idx), axis=axes[0])
    return jnp.take_along_axis(w, jnp.asarray(_member_view(g, kept, path, w.ndim)), axis=axes[0])


# train.* fields of where a run starts, which a shrunk run (its parameters given) resets
INIT_FIELDS = ("init_from", "init_params", "init_kv_heads", "init_kv_calibration",
               "init_experts", "init_expert_batches")


def shrink(cfg: Config, params, groups: dict, layout: dict):
    """(config, parameters) of the smaller dense model: every pruned head and neuron, or
    LSTM/GRU hidden unit, removed (module doc). Each block must keep the same number of
    heads and of neurons, as `train.prune.scope='layer'` makes it."""
    import dataclasses

    from hpnlp.config import DistillConfig, TrainConfig
    kept = {k: _kept(layout[k], m, k) for k, m in groups.items()}
    counts: dict[str, set] = {}
    for key, g in layout.items():
        counts.setdefault(g.axis, set()).add(kept[key].shape[1])
    for axis, c in counts.items():
        if len(c) != 1:
            raise ValueError(f"blocks keep different numbers of {UNIT_NAME[axis]} ({sorted(c)}): "
                             "a shrunk Transformer needs one model.num_heads and model.mlp_dim "
                             "(and model.moe.mlp_dim)")
    flat = dict(traverse.flatten_dict(params))
    for key, g in layout.items():
        for path in g.members:
            flat[_path(path)] = _take_kept(g, flat[_path(path)], path, kept[key])
    m = cfg.model
    if m.arch in RNN_ARCHS:
        width = counts["width"].pop()
        # The trunk scales embeddings by sqrt(model.width): the first layer's input rows
        # take the old scale's excess, so its input product is the masked model's.
        first = ("trunk", "rnn", "layer_0", "input_kernel")
        w = flat[first]
        flat[first] = (w.astype(jnp.float32) * math.sqrt(m.width / width)).astype(w.dtype)
        # num_heads is unused by a recurrent trunk; config.validate wants it to divide width
        model = dataclasses.replace(m, width=width, num_heads=math.gcd(m.num_heads, width))
        from hpnlp.rnn import fused
        if cfg.rnn.impl == "fused" and not fused.supports(width):  # the same model computed by
            # the scan (a bug hunt, session 99: the shrunk config was refused, after training)
            cfg = dataclasses.replace(cfg, rnn=dataclasses.replace(cfg.rnn, impl="auto"))
    else:
        # explicit multi-head attention (num_kv_heads = num_heads) stays multi-head: 0, which
        # follows the kept heads (a review: a stale 4 did not divide the 2 kept heads)
        model = dataclasses.replace(m, head_dim=m.dims_per_head(),
                                    num_heads=counts.get("heads", {m.num_heads}).pop(),
                                    mlp_dim=counts.get("mlp", {m.mlp_dim}).pop(),
                                    num_kv_heads=0 if m.num_kv_heads == m.num_heads
                                    else m.num_kv_heads)
        if m.moe.enabled():  # explicit: its default (0) would follow model.mlp_dim
            model = dataclasses.replace(model, moe=dataclasses.replace(
                m.moe, mlp_dim=counts.get("expert_mlp", {m.moe.expert_dim(m)}).pop()))
    # the smaller run starts from the parameters given here: no run to start from, so none of
    # the fields that choose what it takes of one (a review: train.init_params='trunk' left
    # set refused every shrunk CoFi-style fine-tune, "set train.init_from")
    start = TrainConfig()
    train = dataclasses.replace(cfg.train, prune=PruneConfig(), distill=DistillConfig(),
                                **{f: getattr(start, f) for f in INIT_FIELDS})
    return dataclasses.replace(cfg, model=model, train=train), traverse.unflatten_dict(flat)


def shrink_changes_quant(cfg: Config) -> tuple[str, object, str] | None:
    """(field, value, why) where `shrink` of this QAT run would compute another function than
    its masked model, else None. A product whose contraction `shrink` cuts (out: the pruned
    heads' rows; mlp: the neurons'; an LSTM/GRU: every product, the hidden units) loses rows
    of zeros from each channel's scale: absmax and mse (a zero quantizes to zero under every
    range) read the same, and int4 groups the cut removes whole (model.head_dim rows that
    quant.group_size divides) keep theirs; binary and ternary scale (ternary: threshold) by
    the mean |w|, percentile clips at a share of the values, and int4 groups across the cut
    rows regather other rows, all of which the zeros change (a bug hunt, session 101: a
    ternary run shrunk evaluated 4.8767 where its masked model had 4.9004, unsaid)."""
    q, m, p = cfg.model.quant, cfg.model, cfg.train.prune
    if q.weights == "none":
        return None
    from hpnlp.config import layers_name
    from hpnlp.config.compress_checks import quant_products
    if m.arch in RNN_ARCHS:
        cut = dict.fromkeys(quant_products(m), 1)
    else:
        heads = any(layers_name(p.layers, k) for k in ("qkv", "out"))
        cut = {"out": m.dims_per_head()} if heads else {}
        if layers_name(p.layers, "mlp"):
            cut["mlp"] = 1
    cut = {k: rows for k, rows in cut.items() if q.applies(k)}
    g = q.group_size
    named = ", ".join(sorted(cut))
    split = sorted(k for k, rows in cut.items() if g and rows % g)
    if split:
        rows = ", ".join(f"{k}: {cut[k]}" for k in split)
        return "quant.group_size", g, (
            f"the int4 groups of {g} rows along the contraction of its {', '.join(split)} "
            f"products would gather other rows once the pruned units' rows ({rows} each) are "
            "gone, which changes their scales")
    if cut and not g and q.weights in ("binary", "ternary"):
        return "quant.weights", q.weights, (
            f"each channel of its {named} products takes its scale"
            + (" and threshold" if q.weights == "ternary" else "") + " from the mean |w| over "
            "the contraction, the pruned rows' zeros among them, which shrink removes")
    if cut and not g and q.calibration == "percentile":
        return "quant.calibration", q.calibration, (
            f"each channel of its {named} products clips at the quant.percentile={q.percentile} "
            "of its |w|, the pruned rows' zeros among them, which shrink removes")
    return None


class PruneCarry(Carry):
    """The `prune` entry of the train state: {"masks": {path: bool mask}}, with "scores",
    their Adam state and "dense" (movement) or "rewind" (imp) beside them; structured
    pruning keeps only {"groups": {block/heads|neurons: bool [units]}} ({RNN_UNITS: bool
    [width]} for an LSTM/GRU), its weights' masks follow from them (module doc)."""

    name = "prune"

    def __init__(self, cfg: Config):
        self.cfg, self.p = cfg, cfg.train.prune
        self.seed = cfg.seed  # what random scores draw from: an int, or a member's key
        self.products: dict = {}
        self.leads: dict = {}  # {path: Product.lead}: an MoE layer's experts, each its own

    def for_member(self, key):
        """Random scores drawn from the member's key, the plain run's of its seed (a bug hunt,
        session 103: every member of a seed ensemble drew cfg.seed's masks)."""
        member = copy.copy(self)
        member.seed = key
        return member

    def init(self, model, params, batch, batch_size: int):
        del batch_size
        found = targets(self.cfg, model, nn.unbox(params), batch)
        self.products = {k: v.contraction for k, v in found.items()}
        self.leads = {k: v.lead for k, v in found.items() if v.lead}
        if not self.products:
            from hpnlp.config import config_error
            raise config_error("train.prune.layers", self.p.layers, "names no product this model "
                               "has; choose from the kinds it uses (e.g. 'mlp' or 'all')")
        flat = _flatten(params)

        def like(w, value):  # sharded like the weight
            return w.replace_boxed(value) if isinstance(w, nn.meta.AxisMetadata) else value

        if self.p.structure == "structured":  # the unit masks; weight masks derive from them
            self.layout = (rnn_layout(self.cfg, params) if self.cfg.model.arch in RNN_ARCHS
                           else group_layout(found, params))
            return {"groups": {k: jnp.ones(g.shape, bool) for k, g in self.layout.items()},
                    "last": jnp.full((), -1, jnp.int32)}
        # last: the step after whose update masks were last recomputed (updates_due)
        value = {"masks": {}, "last": jnp.full((), -1, jnp.int32)}
        if self.p.method == "movement":  # scores, their Adam moments, the dense weights
            value.update(scores={}, score_m={}, score_v={}, dense={},
                         score_steps=jnp.zeros((), jnp.int32))
        if self.p.schedule == "imp":  # every model weight goes back (`start` / step k sets them)
            from hpnlp.train.carry import model_params
            value["rewind"] = {"/".join(k): like(w, jnp.zeros(nn.unbox(w).shape, nn.unbox(w).dtype))
                               for k, w in _flatten(model_params(params)).items()}
            value["rewound"] = jnp.zeros((), bool)  # whether "rewind" holds the weights yet
        for k in self.products:
            w = flat[_path(k)]
            shape = nn.unbox(w).shape
            value["masks"][k] = like(w, jnp.ones(shape, bool))
            if self.p.method == "movement":
                for name in ("scores", "score_m", "score_v"):
                    value[name][k] = like(w, jnp.zeros(shape, jnp.float32))
                value["dense"][k] = like(w, jnp.zeros(shape, nn.unbox(w).dtype))  # `start` sets it
        return value

    def start(self, value, params):
        """Movement: the dense weights start as the run's first parameters (its init, or
        the run `train.init_from` names)."""
        flat = _flatten(params)
        # copies: the state donates its buffers to the step, and one buffer may not be
        # donated twice (as a parameter and as its dense or rewind weight)
        if self.p.method == "movement":
            value = dict(value, dense={k: jnp.array(flat[_path(k)], copy=True)
                                       for k in value["dense"]})
        if self.p.schedule == "imp" and self.p.rewind_step == 0:
            value = dict(value, rewind={k: jnp.array(flat[_path(k)], copy=True)
                                        for k in value["rewind"]}, rewound=jnp.ones((), bool))
        return value

    def loss(self, model, inner):
        if not self.p.l1:
            return inner

        def l1_loss(params, carry, batch, rngs):
            # the step divides the summed loss by the real tokens: scale the penalty by them.
            # Beside the model's loss, as the auxiliary losses are (a bug hunt, session 94:
            # in it, the logged loss and its perplexity were the penalty's)
            sums, carry = inner(params, carry, batch, rngs)
            flat = _flatten(params)
            l1 = sum(jnp.sum(jnp.abs(flat[_path(k)].astype(jnp.float32))) for k in self.products)
            penalty = self.p.l1 * l1 * sums["weight"]
            return dict(sums, **{AUX_LOSS: sums.get(AUX_LOSS, 0.0) + penalty},
                        loss_l1=l1 * sums["weight"]), carry
        return l1_loss

    def gradients(self, value, grads):
        """The optimizer's gradients: zero at the pruned entries. The model computes with
        W' = W * M, so dL/dW = dL/dW' * M (a review, session 108: the pruned entries' dL/dW'
        reached global-norm clipping, which shrank the kept weights' updates more the more
        was pruned, the logged grad_norm, and Adam's moments, which a weight movement pruning
        revives came back with). `after_update` still reads dL/dW' (movement's scores)."""
        if self.p.structure == "structured":
            shapes = {"/".join(k): v.shape for k, v in traverse.flatten_dict(grads).items()}
            return apply_masks(grads, expand_groups(value["groups"], self.layout, shapes))
        return apply_masks(grads, value["masks"])

    def after_update(self, value, params, grads, step, features=None):
        if self.p.structure == "structured":
            return self._structured_update(value, params, step)
        flat = _flatten(params)
        weights = {k: flat[_path(k)] for k in value["masks"]}
        new = dict(value)
        if self.p.method == "movement":
            weights, moved = movement_update(value, weights, grads)
            new.update(moved, dense=weights)

        def recompute(masks):
            s = sparsity_at(self.p, step, self.cfg.train.steps)
            return compute_masks(self.p, weights, masks, s, self.products, self.seed,
                                 new.get("scores"), self.leads)

        prune_now = self._due(value, step)
        masks = jax.lax.cond(prune_now, recompute, lambda m: m, value["masks"])
        new["masks"] = masks
        new["last"] = jnp.where(prune_now, step, value["last"]).astype(jnp.int32)
        if self.p.schedule == "imp":  # Frankle et al.: every weight back to its step-k value
            now = {k: flat[_path(k)] for k in value["rewind"]}
            if self.p.rewind_step > 0:  # the weights after rewind_step updates (the first
                # applied update from then on, if a float16 overflow skipped that one)
                take = (step + 1 >= self.p.rewind_step) & ~value["rewound"]
                new["rewind"] = {k: jnp.where(take, w, value["rewind"][k])
                                 for k, w in now.items()}
                new["rewound"] = value["rewound"] | take
            for k, w in now.items():
                flat[_path(k)] = jnp.where(prune_now, new["rewind"][k], w)
            params = _unflatten(flat, params)
        if self.p.method == "movement":  # pruned entries of the parameters are zero; revived
            for k, w in weights.items():  # ones come back with their dense value
                flat[_path(k)] = w
            params = _unflatten(flat, params)
        return apply_masks(params, masks), new

    def holds_target(self, value):
        """Whether the masks (structured: the unit masks) prune at least what the schedule
        asks after their last update, `value["last"]`, under this run's config (a traced
        bool): counts are exact, so masks computed at a lower target (a resume that raised
        train.prune.sparsity) prune fewer. Masks pruning more (a target lowered by a longer
        train.steps) hold: there is nothing to recompute (a scheduled recompute keeps what
        they prune, `compute_masks`, `group_masks`).
        N:M masks, once made, hold where every M consecutive entries along the contraction
        keep at most N (a review, session 116: a resume from 2:4 to 1:4, or from unstructured
        masks to 2:4, kept the old masks and reported the new target as held)."""
        last = value["last"]
        s = jnp.where(last >= 0, sparsity_at(self.p, last, self.cfg.train.steps), 0.0)
        if self.p.structure == "structured":
            ok = [jnp.all(jnp.sum(~value["groups"][k].reshape(g.rows, g.units), axis=1)
                          >= units_pruned(s, g.units)) for k, g in self.layout.items()]
        elif self.p.nm() is not None:
            n, m = self.p.nm()
            ok = [jnp.all(jnp.sum(_nm_groups(mask, self.products[k], m), axis=1) <= n)
                  for k, mask in value["masks"].items()]
            return (last < 0) | jnp.all(jnp.stack(ok))
        elif self.p.scope == "layer":  # as compute_masks counts them (each expert on its own)
            rows = {k: m.reshape(math.prod(m.shape[:self.leads.get(k, 0)]), -1)
                    for k, m in value["masks"].items()}
            ok = [jnp.all(jnp.sum(~r, axis=1) >= jnp.round(s * r.shape[1]).astype(jnp.int32))
                  for r in rows.values()]
        else:
            size = sum(m.size for m in value["masks"].values())
            ok = [sum(jnp.sum(~m) for m in value["masks"].values())
                  >= jnp.round(s * size).astype(jnp.int32)]
        return jnp.all(jnp.stack(ok))

    def _due(self, value, step):
        """Whether masks are recomputed after the update of `step`: a scheduled recompute has
        come (`updates_due`), or the masks do not hold what the schedule asks after the last
        (a bug hunt, session 99: train.prune.sparsity raised on resume after the schedule's
        end changed no mask, and summary.json called the new target reached)."""
        return (updates_due(self.p, value["last"], step, self.cfg.train.steps)
                | ~self.holds_target(value))

    def report(self, value, params) -> dict:
        """The fraction of the pruned products' entries (structured: of their units) the
        masks remove, the schedule's target after the last mask update, and that step; and
        `pending` where the masks prune less than the schedule asks (a resume that raised
        train.prune.sparsity, and trained no step since), which the next step recomputes."""
        last = np.asarray(jax.device_get(value["last"]))  # [members] in a seed ensemble
        targets = [float(sparsity_at(self.p, int(t), self.cfg.train.steps)) if t >= 0 else 0.0
                   for t in last.ravel()]
        masks = value["groups"] if self.p.structure == "structured" else value["masks"]
        # jitted: a replicated scalar, however the masks are sharded (several processes too)
        pruned = jax.jit(lambda ms: sum(jnp.sum(~m) for m in ms.values()))(masks)
        size = sum(m.size for m in masks.values())  # an ensemble's: all its members'
        one = last.ndim == 0
        held = jax.jit(self.holds_target if one else jax.vmap(self.holds_target))(
            {k: value[k] for k in ("last", "groups" if self.p.structure == "structured"
                                   else "masks")})
        out = {"sparsity": float(pruned) / max(size, 1),
               "target": targets[0] if one else targets,
               "last_update_step": int(last) if one else last.tolist(),
               "of": "units" if self.p.structure == "structured" else "weights"}
        if not bool(np.all(np.asarray(held))):
            out["pending"] = ("the masks prune less than this config's schedule asks (its "
                              "train.prune changed on resume); the next training step "
                              "recomputes them")
        return out

    def _structured_update(self, value, params, step):
        flat = {"/".join(k): v for k, v in traverse.flatten_dict(params).items()}

        def recompute(groups):
            s = sparsity_at(self.p, step, self.cfg.train.steps)
            return group_masks(self.p, flat, self.layout, groups, s, self.seed)

        prune_now = self._due(value, step)
        groups = jax.lax.cond(prune_now, recompute, lambda g: g, value["groups"])
        masks = expand_groups(groups, self.layout, {k: w.shape for k, w in flat.items()})
        return apply_masks(params, masks), {
            "groups": groups, "last": jnp.where(prune_now, step, value["last"]).astype(jnp.int32)}


# Adam's moment decays and its floor under sqrt(v) for the movement scores (Kingma & Ba)
SCORE_BETAS = (0.9, 0.999)
SCORE_EPS = 1e-12  # dL/dS = dL/dW' * W is small (|W| ~ 0.05): a floor below any real one


def movement_update(value: dict, weights: dict, grads) -> tuple[dict, dict]:
    """(dense weights, {scores and their Adam state}) after one step of movement pruning
    (Sanh et al. 2020).

    The model computes with W' = W * M. The straight-through estimator takes the mask's
    gradient as if M were the scores S, so dL/dS = dL/dW' * W, and a weight gains score
    while the gradient moves it away from zero. As in the paper the scores train by Adam,
    here at unit rate, as only their order matters: each score moves by its moments' ratio
    m / sqrt(v), so its size tells how steadily its weight moved, not how large the weight
    is. (Summing -dL/dW' * W instead, plain SGD, gives the large weights the large scores
    of either sign; on the compress bench's byte LM, Adam's scores read 2.15-2.32 loss at
    50-95% sparsity against the sum's 2.42-2.68, still behind magnitude on that task:
    `tools/movement_oneshot.py`.)
    The dense W behind a kept entry is the parameter the optimizer just updated; behind a
    pruned one it stays as it was (dL/dW = dL/dW' * M is zero there). `value["dense"]` is
    W before this update."""
    (b1, b2), g = SCORE_BETAS, _flatten(grads)
    t = (value["score_steps"] + 1).astype(jnp.float32)
    out = {"scores": {}, "score_m": {}, "score_v": {}, "score_steps": value["score_steps"] + 1}
    dense = {}
    for k, w in weights.items():
        before = value["dense"][k]
        d = g[_path(k)].astype(jnp.float32) * before.astype(jnp.float32)  # dL/dS
        m = b1 * value["score_m"][k] + (1 - b1) * d
        v = b2 * value["score_v"][k] + (1 - b2) * d * d
        step = (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + SCORE_EPS)
        out["scores"][k], out["score_m"][k], out["score_v"][k] = value["scores"][k] - step, m, v
        dense[k] = jnp.where(value["masks"][k], w, before)
    return dense, out


# What `shrink_run` writes: the new run's files (one checkpoint, step 0, and its summary),
# its tokenizer (a subword run's), its training text's digest and a distilled student's
# teacher config (a review, session 116: a rerun of a bpe run's shrink was refused its own
# earlier output, "holds a training run")
SHRUNK_FILES = ("checkpoints", "config.json", "summary.json", "tokenizer", "text.json",
                "teacher_config.json")


def _shrunk_from(out: str) -> str | None:
    """The run `out` was shrunk from (its summary.json's `source`), where `out` holds only
    `shrink_run`'s files and its one checkpoint: a shrunk run trained on since is not it."""
    import json
    import os

    from hpnlp.paths import UNFINISHED
    try:
        with open(os.path.join(out, "summary.json")) as f:
            source = json.load(f)["source"]["workdir"]
        if not (set(os.listdir(out)) <= set(SHRUNK_FILES) | {UNFINISHED}
                and os.listdir(os.path.join(out, "checkpoints")) == ["0"]):
            return None
        return os.path.realpath(source)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def shrink_run(workdir: str, out: str, *, eval_batches: int | None = None) -> dict:
    """`python -m hpnlp.compress shrink`: the structurally pruned run in `workdir` as a
    smaller dense run in `out` (config.json and a checkpoint at step 0 holding the shrunk
    parameters: `train.init_from=OUT` fine-tunes it, `quantize --workdir OUT` packs it).
    Both models are evaluated on the held-out split; OUT/summary.json has the two metrics,
    the parameter counts and the new model sizes."""
    import dataclasses
    import json
    import os
    import sys

    from hpnlp import models
    from hpnlp.config import config_error
    from hpnlp.train.loop import Trainer, mesh_for_these_devices, reader_mesh
    from hpnlp.train.checkpoint import load_run_config

    cfg = mesh_for_these_devices(load_run_config(workdir), workdir)  # the shrunk run's too
    if cfg.train.prune.method == "none" or cfg.train.prune.structure != "structured":
        raise config_error("train.prune.structure", cfg.train.prune.structure, f"the run in "
                           f"{workdir} was not pruned with train.prune.structure='structured', so "
                           "it has no heads, neurons or hidden units to remove")
    # README: the shrunk model "computes what the masked model computed", save where this
    # says otherwise: said, and kept in summary.json beside the two evals. Not refused: such
    # a run trains (validate keeps its shrunk config valid, session 94), and a shrunk model
    # is fine-tuned after (a reviewer, session 101)
    inexact = shrink_changes_quant(cfg)
    if inexact:
        field, value, why = inexact
        inexact = (f"{field}={value!r}: {why}, so the shrunk model computes another function "
                   "than the masked one (summary.json: eval against eval_masked); fine-tune it "
                   "(train.init_from=OUT), or prune in float and quantize the shrunk run")
    # a bug hunt (session 101): a batch that does not split over every device here was read
    # on fewer of them (`for_these_devices`), and the shrunk run took that reader's mesh,
    # which its training Trainer refused ("the axis sizes multiply to 2, not the device
    # count 3") after the pruned run was read and evaluated
    n = jax.device_count()
    k = reader_mesh(cfg, n)[1]
    if k < n:
        t = cfg.train
        raise config_error("train.batch_size", t.batch_size, f"the run in {workdir} is shrunk "
                           f"into a run to train on every device here, and its batch (with "
                           f"train.grad_accum={t.grad_accum}, data.eval_batch_size="
                           f"{cfg.data.eval_batch_size or t.batch_size}"
                           + (f", model.moe.groups={cfg.model.moe.groups}"
                              if cfg.model.moe.enabled() and cfg.model.moe.groups else "")
                           + f") does not split over these {n} devices; shrink it on a device "
                           f"count that splits it (e.g. {k}; on a CPU, XLA_FLAGS=--xla_force_"
                           "host_platform_device_count=N simulates N devices)")
    from hpnlp.paths import check_new_output
    earlier = _shrunk_from(out) == os.path.realpath(workdir)  # this command's, of this run
    # a new run: nothing of another run or tool written over, but this command's own earlier
    # output of this run is replaced (a bug hunt, session 99: a notebook's cell run again)
    check_new_output(out, workdir, may_replace=SHRUNK_FILES if earlier else ())
    if earlier:
        print(f"hpnlp.compress: note: --out {out} holds this command's earlier output of "
              f"{workdir}; the new one replaces it once written", file=sys.stderr)
    if inexact:  # said once every check has passed (review)
        print(f"hpnlp.compress: note: {inexact}", file=sys.stderr, flush=True)
    pruned = Trainer(cfg, workdir, read_only=True)  # (--eval_batches counts the two evals
    # alone: a review, session 115, found it written into OUT's config.json)
    step = pruned.checkpointer.latest_step()
    state, _ = pruned.initial_state()
    pruned.checkpointer.close()
    carry = next(c for c in pruned.carries if isinstance(c, PruneCarry))
    from hpnlp.train.carry import model_params
    from hpnlp.config import ConfigError, validate
    from hpnlp.config.checks import (check_new_run, check_training, of_saved_data,
                                     packs_block_aligned, without_unread)
    try:
        cfg2, params2 = shrink(pruned.cfg, model_params(jax.device_get(state.params)),
                               jax.device_get(state.carry["prune"]["groups"]), carry.layout)
        cfg2 = without_unread(cfg2)  # a field an older run took and nothing reads
        # the output run trains on every device: the run's mesh here, not its reader's (session
        # 101); checked as its Trainer will, before the masked model compiles (a review: a
        # run stopped mid-schedule under int4 groups, or kept heads that mesh.tensor does not
        # split, were refused after the evaluation, with no word of the shrink)
        cfg2 = dataclasses.replace(cfg2, mesh=cfg.mesh)
        # train-only fields a new run is refused and a saved one kept (review r10, r12 of
        # session 108), rewritten, and said: this command takes no config, and an edit of the
        # pruned run's config.json would not be that run's (a review, d1: their refusal here
        # offered a fix nothing could apply)
        t2, rewritten = cfg2.train, {}  # {field: (the run's, the shrunk run's, why)}
        if cfg2.model.embed_grad_scale == "batch" and t2.grad_accum != 1:
            rewritten["train.grad_accum"] = (t2.grad_accum, 1, "model.embed_grad_scale='batch' "
                                             "under accumulation counts each microbatch's ids")
        if t2.steps == 1 and t2.warmup_steps >= 1:
            rewritten["train.warmup_steps"] = (t2.warmup_steps, 0, "with train.steps=1 a "
                                               "warmup trains nothing")
        enc = cfg2.model.encoder
        if cfg2.model.kind == "bi_encoder" and 0 < t2.steps <= enc.mine_every:  # (a review,
            # session 115, of that session's rule)
            rewritten["model.encoder.mine_every"] = (enc.mine_every, 0, "no step of "
                                                     "train.steps would mine")
            depth = type(enc)().mine_depth
            if enc.mine_depth != depth:
                rewritten["model.encoder.mine_depth"] = (enc.mine_depth, depth, "mining alone "
                                                         "reads it")
        if packs_block_aligned(cfg2):  # (a review of session 115's rule: a run saved so is
            # read, and its new shrunk run refused)
            rewritten["data.batching"] = ("pack", "pad", f"attention {cfg2.attention.name!r} "
                                          "places its blocks from each row's first column")
        cfg2 = dataclasses.replace(cfg2, train=dataclasses.replace(
            t2, **{k[len("train."):]: v for k, (_, v, _) in rewritten.items()
                   if k.startswith("train.")}))
        if "data.batching" in rewritten:
            cfg2 = dataclasses.replace(cfg2, data=dataclasses.replace(cfg2.data, batching="pad"))
        if "model.encoder.mine_every" in rewritten:
            cfg2 = dataclasses.replace(cfg2, model=dataclasses.replace(
                cfg2.model, encoder=dataclasses.replace(enc, mine_every=0, mine_depth=depth)))
        checked = validate(cfg2, num_processes=jax.process_count(), num_devices=n)
        # and as a new run, which OUT is (a review, session 107: a run saved with bfloat16
        # master weights, or its train file as its eval file, was refused by the new run's
        # Trainer after the masked model was evaluated, not named as the shrink's)
        check_training(checked)
        with of_saved_data():  # its data is the run's: other data fields draw other examples
            check_new_run(checked)
    except ConfigError as e:  # e.g. int4 groups that the kept units do not split into
        raise ConfigError(f"the run in {workdir} cannot be shrunk: its smaller model's config "
                          f"is refused ({e})") from None
    sizes = ({"width": [cfg.model.width, cfg2.model.width]} if cfg.model.arch in RNN_ARCHS
             else {"num_heads": [cfg.model.num_heads, cfg2.model.num_heads],
                   "head_dim": cfg2.model.head_dim,
                   "mlp_dim": [cfg.model.mlp_dim, cfg2.model.mlp_dim]})
    if cfg.model.moe.enabled():
        sizes["moe.mlp_dim"] = [cfg.model.moe.expert_dim(cfg.model),
                                cfg2.model.moe.expert_dim(cfg2.model)]
    if all(v[0] == v[1] for v in sizes.values() if isinstance(v, list)):
        # a bug hunt (session 94): a run stopped before its pruning began was "shrunk" to
        # a copy of itself, unsaid
        p = cfg.train.prune
        field, value, fix = (("train.prune.start_step", p.start_step, "train it on past its "
                              "pruning steps first") if final_prunes_units(p, carry.layout)
                             else ("train.prune.sparsity", p.sparsity, "prune it to a higher "
                                   "sparsity"))
        raise config_error(field, value, f"the run in {workdir} (step {step}) has pruned no "
                           f"head, neuron or unit (its pruning starts at train.prune.start_step="
                           f"{p.start_step}, to train.prune.sparsity={p.sparsity}), so shrinking "
                           f"it removes nothing; {fix}")
    short = short_of_target(cfg.train.prune, step, cfg.train.steps)
    if short:  # a bug hunt (session 94): a run stopped mid-schedule was shrunk unsaid
        print(f"hpnlp.compress: note: {short}", file=sys.stderr)
    redrawn = other_draw(cfg, step)
    if redrawn:
        print(f"hpnlp.compress: note: {redrawn}", file=sys.stderr)
    if rewritten:
        print("hpnlp.compress: note: the shrunk run is a new run, which is refused what the "
              "run's config.json holds, so its own has " + "; ".join(
                  f"{k}={now!r} where the run has {was!r} ({why})"
                  for k, (was, now, why) in rewritten.items())
              + "; a fine-tune of it (train.init_from=OUT) sets its own train fields",
              file=sys.stderr)
    masked_eval = pruned.evaluate(state, batches=eval_batches)
    from hpnlp.paths import staged
    with staged(out) as stage:  # OUT a whole run, or nothing of this call's
        with of_saved_data():  # as checked above
            small = Trainer(cfg2, stage)
        fresh, _ = small.initial_state()
        carry2 = dict(fresh.carry)
        if "kv_memory" in carry2:  # a classifier's trained key-value memory: its keys read the
            # pooled encoding, which the shrunk model computes as the masked one did (a
            # review, session 115: OUT held an empty memory, evaluated and resumed so)
            carry2["kv_memory"] = jax.device_put(jax.device_get(state.carry["kv_memory"]),
                                                 small.state_sharding.carry["kv_memory"])
        state2 = fresh.replace(params=jax.device_put(params2, small.state_sharding.params),
                               carry=carry2)
        small.checkpointer.save(0, state2, small.train_iter.get_state(), {})
        small.checkpointer.wait()
        small.checkpointer.close()
        shrunk_eval = small.evaluate(state2, batches=eval_batches)
        summary = {
            "source": {"workdir": os.path.abspath(workdir), "step": step},
            "model": sizes,
            "params": {"pruned": models.param_count(model_params(state.params)),
                       "shrunk": models.param_count(params2)},
            "eval": shrunk_eval, "eval_masked": masked_eval,
        }
        if short:
            summary["short_of_target"] = short
        if redrawn:
            summary["features_draw"] = redrawn
        if rewritten:
            summary["config_rewritten"] = {k: [was, now]
                                           for k, (was, now, _) in rewritten.items()}
        if inexact:
            summary["inexact"] = inexact
        with open(os.path.join(stage, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary
