"""The MoE feed-forward layer: a router, X expert MLPs, dispatch, combine, statistics.

Shape letters as in `routing.py` (B batch, L length too). The Transformer block asks
`hpnlp.models.transformer.feed_forward` for its MLP, which is this layer in the blocks
`model.moe` names.

Routing groups are the batch's rows split into G equal blocks (`model.moe.groups`, default
one per data-parallel shard), and capacity is per group, so with an explicit
`model.moe.groups` a run routes the same way on one device and on many; the default follows
the device count. A batch of rows G does not divide (a pass with a row count of its own: a
one-row init, the bi-encoder's pool evaluation and mining, the kNN-LM) is padded with empty
rows, routed nowhere, up to whole groups. The empty rows count toward their group's
capacity, as a row's padding tokens do (C is sized for the group's S tokens), so the real
tokens of a padded group get slightly more room than those of a full one: token choice
drops fewer, expert choice gives each token more experts (at groups=3, the last group of the
kNN-LM's 64 rows holds 20 real rows in room for 22). With `mesh.expert` > 1 the experts are
sharded over the `expert` mesh axis and the capacity buffers move by all-to-all inside
`shard_map` (GShard): each device routes its own groups, sends each expert's slots to the
device holding it, runs its X / mesh.expert experts on every device's slots, and sends the
results back; a model traced under a mesh that does not split its experts or groups (a
distillation teacher, `train.init_from`'s source) runs as GSPMD lays it out instead.

Every call reports into the `aux` collection (`sow`, read by hpnlp.train.carry's
`fold_aux`): the auxiliary loss to add (per-token mean, weighted by the config), and sums
for the metrics: routed load per expert, dropped choices, router entropy.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hpnlp.compress import formats, qlinear
from hpnlp.config import ModelConfig, check_moe_fields
from hpnlp.models.transformer import _init, dtypes, mlp
from hpnlp.moe import dispatch, routing
from hpnlp.train.carry import AUX  # the collection layers report auxiliary losses into


def _batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the `batch` logical rule splits the batch over, in this mesh."""
    axes = nn.logical_to_mesh_axes(("batch",))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return tuple(a for a in axes if a in mesh.axis_names)


def batch_shards() -> int:
    """Data-parallel shards of the current mesh and logical rules (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape[a] for a in _batch_axes(mesh))


def _mesh_experts() -> int:
    """The current mesh's `expert` axis size (1 without a mesh or the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]


def _expert_axis(experts: int, groups: int) -> tuple[int, tuple[str, ...]]:
    """(experts' shards over the `expert` mesh axis, the batch's mesh axes) for a layer of
    `experts` experts routing `groups` groups, or (1, ()) where they do not split over those
    axes: that layer runs its experts as GSPMD lays them out (the same result, without the
    all-to-all). A review (session 107): the config checks this run's experts and groups
    against its mesh, but a model of another number of experts or groups is traced under
    it too (train.init_from's source when cutting experts, a distillation teacher), and
    shard_map refused it in a JAX error naming no field."""
    mesh, ep = jax.sharding.get_abstract_mesh(), _mesh_experts()
    if ep == 1:
        return 1, ()
    axes = _batch_axes(mesh)
    if experts % ep or "expert" not in axes or groups % math.prod(mesh.shape[a] for a in axes):
        return 1, ()
    return ep, axes


ROUTES = "moe_routes"  # what `hpnlp.moe.route` reads: each token's weight on each expert


def _weights(slots: routing.Slots, experts: int):
    """[G, S, X] weight of each expert's output in each token (0: not routed or dropped)."""
    X, C = experts, slots.token_GXC.shape[-1]
    expert_GSJ = jnp.minimum(slots.slot_GSJ // C, X - 1)
    return jnp.einsum("gsjx,gsj->gsx", jax.nn.one_hot(expert_GSJ, X),
                      jnp.where(slots.slot_GSJ < X * C, slots.gate_GSJ, 0.0))


def expert_weight(module: nn.Module, name: str, w_XKN, q):
    """An expert weight [X, K, N] as the experts multiply it. Under `quant.*` covering `mlp`
    (the experts are MLPs) it is quantized as each expert's own product weight: per expert
    and output channel (int4 groups along K), fake-quantized in training and QAT; in export
    (`qexport`) packed as [K, X, N], contraction first like every product weight, so one
    column's scale is one expert's output channel; a packed weight decodes back in XLA. In
    `ptq.serve`'s pass a packed weight that an integer kernel computes is prepared for it,
    expert by expert (`serve_experts`); such a `Served` weight is returned as it is.
    Declared a product weight of kind `mlp` contracting its K axis (`note_product`), so
    `train.prune` masks it as it masks a dense MLP's kernels, and `model.lowrank` factorizes
    it expert by expert (a `Factored` with lead 1: `expert_factors`)."""
    qlinear.note_product(module, name, "mlp", (1,), lead=1)
    if isinstance(w_XKN, qlinear.Factored):
        return expert_factors(module, name, w_XKN, q)
    if isinstance(w_XKN, qlinear.Served):
        return w_XKN
    if isinstance(w_XKN, qlinear.QWeight):
        if module.is_mutable_collection("qserve") and (served := serve_experts(w_XKN, q)):
            module.put_variable("qserve", name, served)
        return _as_float(w_XKN)
    if not q.applies("mlp") or q.weights == "none":
        return w_XKN
    return jnp.moveaxis(qlinear.quant_weight(jnp.moveaxis(w_XKN, 1, 0), 1, q, module, name), 0, 1)


def expert_factors(module: nn.Module, name: str, w: qlinear.Factored, q) -> qlinear.Factored:
    """A factorized expert weight (model.lowrank: U [X, K, r], V [X, r, N], `hpnlp.moe.
    dispatch` multiplies (x U[e]) V[e]) as the experts multiply it. Under `quant.*` covering
    `mlp` each factor is quantized as `expert_weight` quantizes an expert weight: per expert
    and output channel (U per rank column, V per output), packed as [K, X, r] and [r, X, N]
    in export (a `Factored` of two QWeights, lead 1), prepared expert by expert for their
    kernel in `ptq.serve`'s pass (a `Factored` of two `Served`, returned as it is); the rank
    input x U is quantized per token like the experts' other inputs (`expert_inputs`, which
    `dispatch` applies between the two products)."""
    if isinstance(w.u, qlinear.Served):
        return w
    if isinstance(w.u, qlinear.QWeight):  # a quantized file's factors, contraction first
        if module.is_mutable_collection("qserve"):
            served = [serve_experts(f, q) for f in (w.u, w.v)]
            if all(served):
                module.put_variable("qserve", name, qlinear.Factored(*served, lead=1))
        return _as_float(w)
    if not q.applies("mlp") or q.weights == "none":
        return w
    factors = [jnp.moveaxis(f, 1, 0) for f in (w.u, w.v)]  # [K, X, r], [r, X, N]
    if qlinear._mutable(module, "qexport"):
        module.put_variable("qexport", name, qlinear.Factored(
            *(qlinear.pack_weight(f, q, 1) for f in factors), lead=1))
    return qlinear.Factored(*(jnp.moveaxis(qlinear.quant_weight(f, 1, q), 0, 1)
                              for f in factors), lead=1)


def serve_experts(w: qlinear.QWeight, q) -> qlinear.Served | None:
    """A packed expert weight [K, X, N] as X prepared kernel weights [K, N], their arrays
    stacked on a leading expert axis (`Served.w`; `packed` keeps the [K, X, N] QWeight), or
    None where no integer kernel computes the product as `q` defines it."""
    K, X, N = w.shape
    one = lambda e: qlinear.QWeight(  # noqa: E731 (expert e's columns, x N + n)
        codes=w.codes[:, e * N:(e + 1) * N], scale=w.scale[:, e * N:(e + 1) * N], fmt=w.fmt,
        shape=(K, N))
    per = [qlinear.prepare(one(e), q) for e in range(X)]
    if not isinstance(per[0], qlinear.Served):
        return None
    return qlinear.Served(w=jax.tree.map(lambda *a: jnp.stack(a), *(p.w for p in per)),
                          fmt=w.fmt, shape=w.shape, packed=w, experts=X)


def served_linear(dtype):
    """`dispatch.linear` for `Served` expert weights: expert e's product by its integer
    kernel, which quantizes each row itself, per token, as `expert_inputs` does (int8: the
    bias and GELU in the kernel's pass over its output); factorized (a `Factored` of two
    `Served`), x U[e] and then (x U[e]) V[e], each by the kernel. `e`: an int, or a traced
    index."""
    def one(x_TK, w: qlinear.Served, b_N, e, activation=None):
        K, _, N = w.shape
        w_e = qlinear.Served(w=jax.tree.map(lambda a: a[e], w.w), fmt=w.fmt, shape=(K, N))
        return qlinear.served_product(x_TK, w_e, 1, dtype, b_N, qlinear.Epilogue(activation))

    def linear(x_TK, w, b_XN, e, activation=None):
        if isinstance(w, qlinear.Factored):  # two kernel products through the rank
            return one(one(x_TK, w.u, None, e), w.v, b_XN[e], e, activation)
        return one(x_TK, w, b_XN[e], e, activation)
    return linear


def served_block_linear(dtype):
    """`dispatch.dropless`'s `linear` for `Served` expert weights: block n's product is
    `served_linear`'s with expert e[n] (indexed inside a loop over the blocks)."""
    one = served_linear(dtype)

    def linear(x_NbK, w, b_XN, e_N, activation=None):
        return jax.lax.map(lambda xe: one(xe[0], w, b_XN, xe[1], activation), (x_NbK, e_N))
    return linear


def expert_inputs(q):
    """The experts' product inputs as they read them: rows quantized per token (dynamic)
    where `quant.activations` covers `mlp`, else unchanged. Applied before dispatch (the
    tokens) and to each expert's hidden rows; an empty slot's zero row stays zero."""
    if not q.applies("mlp") or q.activations == "none":
        return lambda x: x
    return lambda x: formats.fake_quant(x, q.activations, (-1,))


def _is_served(w) -> bool:
    """Whether an expert weight runs on its kernels (`Served`, or factors that are)."""
    return isinstance(w.u if isinstance(w, qlinear.Factored) else w, qlinear.Served)


def _as_float(w):
    """A packed or served expert weight [K, X, N] (or factor pair) decoded to the float
    layout the experts multiply, [X, K, N]; a float one as it is."""
    if isinstance(w, qlinear.Factored):
        return w.replace(u=_as_float(w.u), v=_as_float(w.v))
    if isinstance(w, (qlinear.QWeight, qlinear.Served)):
        return jnp.moveaxis(w.dequantize(), 0, 1)
    return w


class MoE(nn.Module):
    """Mixture-of-experts MLP (Shazeer et al. 2017; Switch, GShard): parameters grow with
    the experts, the compute per token stays that of `top_k` expert MLPs (expert choice:
    `top_k` x `capacity_factor` on average, some tokens taking none)."""

    model: ModelConfig
    deterministic: bool = True
    decode: bool = False

    @nn.compact
    def __call__(self, x_BLM, seg_BL):
        m, c = self.model, self.model.moe
        check_moe_fields(c)  # at trace time: a layer built directly skips `config.validate`
        dt, pdt = dtypes(m)
        if self.decode and c.router == "expert_choice":
            raise ValueError("model.moe.router='expert_choice' ranks each expert's tokens over a "
                             "whole group, which one decoded token at a time does not have; "
                             "generate with a token-choice router ('switch' or 'top_k')")
        B, L, M = x_BLM.shape
        X, F = c.num_experts, c.expert_dim(m)
        lecun = functools.partial(nn.initializers.lecun_normal, in_axis=1, out_axis=2,
                                  batch_axis=0)
        w_router = self.param("router", _init(nn.initializers.normal(0.02), ("embed", None)),
                              (M, X), jnp.float32)
        wi = qlinear.param(self, "wi", _init(lecun(), ("expert", "embed", "mlp")), (X, M, F), pdt)
        bi = self.param("bi", _init(nn.initializers.zeros, ("expert", "mlp")), (X, F), pdt)
        wo = qlinear.param(self, "wo", _init(lecun(), ("expert", "mlp", "embed")), (X, F, M), pdt)
        bo = self.param("bo", _init(nn.initializers.zeros, ("expert", "embed")), (X, M), pdt)
        wi, wo = (expert_weight(self, name, w, m.quant) for name, w in (("wi", wi), ("wo", wo)))
        dropless = c.router != "expert_choice" and (c.dispatch == "dropless" or self.decode)
        # Served experts (ptq.serve) run on their kernels, on one device: the capacity
        # dispatch's slots, dropless blocks (each block's kernel call with its expert's
        # weights), and in decoding whichever takes fewer kernel calls of the two that drop
        # nothing: a slot for every token in every expert (X calls a product, each reading
        # its expert's weights once a step) or dropless blocks (one a choice while the step
        # has fewer choices than experts: one decoded token of top-1 routing ran 8 calls, 7
        # of them on an empty slot, and trailed XLA's dropless decoding; docs/moe.md).
        served = _is_served(wi) and _mesh_experts() == 1
        if served and self.decode:
            b, R = dispatch.block_rows(B * L * c.top_k, X, c.block_size, tokens=B * L)
            dropless = dropless and R // b < X
        if not served:
            wi, wo = (_as_float(w) for w in (wi, wo))
        experts = [w if _is_served(w) else w.astype(dt) for w in (wi, bi, wo, bo)]
        x_BLM = x_BLM.astype(dt)

        # One group per row block; decoding (one token per row) routes the batch as one.
        G = 1 if self.decode else (c.groups or batch_shards())
        # Rows the groups do not split (a one-row init or probe, the bi-encoder's 256-row pool
        # evaluation, mining's 512, the kNN-LM's 64) get empty rows up to whole groups, routed
        # nowhere. Review r4: a valid groups=3 run died at such a pass (it was refused here).
        # They count in S, so in C: a padded group's real tokens get a little more room than
        # a full group's (fewer dropped; with expert choice, more experts each).
        pad = -B % G
        S = (B + pad) * L // G
        x_GSM = jnp.pad(x_BLM, ((0, pad), (0, 0), (0, 0))).reshape(G, S, M)
        valid_GS = jnp.pad(seg_BL > 0, ((0, pad), (0, 0))).reshape(G, S)
        # Float32 products in fact: the default precision is TF32 on a GPU and one bf16 pass
        # on a TPU, and top-k over logits ~1e-3 off flips near-tied experts (routing that
        # differs from the CPU's). The product costs M * X per token. Review r5.
        router_logits = functools.partial(jnp.einsum, "gsm,mx->gsx",
                                          precision=jax.lax.Precision.HIGHEST)
        logits_GSX = router_logits(x_GSM.astype(jnp.float32), w_router)
        if c.noisy:  # trained through the noise it scales; used in training only
            w_noise = self.param("noise", _init(nn.initializers.zeros, ("embed", None)), (M, X),
                                 jnp.float32)
            if not self.deterministic:
                std_GSX = jax.nn.softplus(router_logits(x_GSM.astype(jnp.float32), w_noise))
                logits_GSX = logits_GSX + std_GSX * jax.random.normal(
                    self.make_rng("dropout"), logits_GSX.shape)
        probs_GSX = jax.nn.softmax(logits_GSX, axis=-1)

        stats = {"moe_tokens": jnp.sum(valid_GS, dtype=jnp.float32),
                 "moe_entropy": routing.entropy_sum(probs_GSX, valid_GS),
                 "loss_moe_z": routing.z_loss(logits_GSX, valid_GS)}
        aux = c.z_loss * stats["loss_moe_z"]
        # Expert choice evaluates at the capacity it trained with: its capacity is its routing
        # (a larger C gives every token more experts), where token choice only drops less.
        # Review r4: eval_capacity_factor 2.0 summed 1.6x the experts training did.
        factor = (c.capacity_factor if not self.deterministic or c.router == "expert_choice"
                  else c.eval_capacity_factor)
        C = S if served and self.decode else routing.capacity(S, experts=X, top_k=c.top_k,
                                                               factor=factor)
        if c.router == "expert_choice":
            slots = routing.expert_choice(probs_GSX, valid_GS, slots=C)
            chosen_GS = jnp.any(slots.slot_GSJ < X * C, axis=-1)
            stats.update(moe_load=jnp.sum(slots.token_GXC < S, axis=(0, 2), dtype=jnp.float32),
                         moe_assigned=stats["moe_tokens"],  # dropped: tokens no expert took
                         moe_dropped=jnp.sum(valid_GS & ~chosen_GS, dtype=jnp.float32))
        else:
            choices = routing.ROUTERS[c.router](probs_GSX, top_k=c.top_k)
            w_GS = valid_GS.astype(jnp.float32)
            stats["moe_load"] = jnp.sum(jax.nn.one_hot(choices.expert_GSK, X)
                                        * w_GS[..., None, None], axis=(0, 1, 2))
            stats["moe_assigned"] = stats["moe_tokens"] * c.top_k
            stats["loss_moe_balance"] = routing.balance_loss(probs_GSX, choices.expert_GSK, valid_GS)
            aux = aux + c.balance_loss * stats["loss_moe_balance"]
        # the experts' first products read each token quantized (served: their kernels do)
        act = (lambda x: x) if served else expert_inputs(m.quant)
        xq_GSM = act(x_GSM)
        if dropless:
            rows = dispatch.sort_rows(jax.tree.map(lambda a: a.reshape(G * S, -1), choices),
                                      valid_GS.reshape(-1), experts=X, block=c.block_size)
            y_GSM = dispatch.dropless(xq_GSM.reshape(G * S, M), rows, *experts, act=act,
                                      linear=(served_block_linear(dt) if served else
                                              functools.partial(dispatch.block_linear,
                                                                rank_act=act))
                                      ).reshape(G, S, M)
            stats["moe_dropped"] = jnp.zeros((), jnp.float32)
            weights = lambda: jnp.einsum(  # noqa: E731
                "gskx,gsk->gsx", jax.nn.one_hot(choices.expert_GSK, X),
                choices.gate_GSK * valid_GS[..., None])
        else:
            if c.router != "expert_choice":
                slots, kept_GSK = routing.slots_from_choices(choices, valid_GS, experts=X, slots=C)
                stats["moe_dropped"] = jnp.sum(valid_GS[..., None] & ~kept_GSK, dtype=jnp.float32)
            linear = (served_linear(dt) if served
                      else functools.partial(dispatch.linear, rank_act=act))
            y_GSM = self._capacity_experts(xq_GSM, slots, experts, act, linear)
            weights = lambda: _weights(slots, X)  # noqa: E731
        if self.is_mutable_collection(ROUTES):  # asked for (hpnlp.moe.route): what went where
            self.sow(ROUTES, "weights", weights().reshape(B + pad, L, X)[:B])
            self.sow(ROUTES, "probs", probs_GSX.reshape(B + pad, L, X)[:B])
        y_BLM = y_GSM.reshape(B + pad, L, M)[:B]
        if c.shared_experts:  # DeepSeekMoE: experts every token uses, as one wider MLP
            y_BLM = y_BLM + mlp(m, x_BLM, width=c.shared_experts * F, name="shared")
        self.sow(AUX, "moe", {"loss": aux, **stats})
        return y_BLM

    def _capacity_experts(self, x_GSM, slots: routing.Slots, experts, act, linear):
        """Slot buffers through the experts and back to tokens; over the expert mesh axis
        (all-to-all in shard_map) when `mesh.expert` > 1 splits the experts and the groups
        (`_expert_axis`). `act`: the experts' hidden activations as their second products
        read them (`expert_inputs`); `linear`: each product (`dispatch.expert_mlp`)."""
        def local(x_GSM, token_GXC, slot_GSJ, gate_GSJ, wi, bi, wo, bo, *, ep: int):
            buf_GXCM = dispatch.gather(x_GSM, token_GXC)
            if ep > 1:  # my groups' slots of every expert -> every group's slots of my experts
                buf_GXCM = jax.lax.all_to_all(buf_GXCM, "expert", 1, 0, tiled=True)
            out_GXCM = dispatch.expert_mlp(buf_GXCM, wi, bi, wo, bo, act=act, linear=linear)
            if ep > 1:
                out_GXCM = jax.lax.all_to_all(out_GXCM, "expert", 0, 1, tiled=True)
            return dispatch.combine(out_GXCM, slot_GSJ, gate_GSJ)

        ep, batch_axes = _expert_axis(slots.token_GXC.shape[1], x_GSM.shape[0])
        if ep == 1 or self.decode:
            return local(x_GSM, *slots, *experts, ep=1)
        g, e = P(batch_axes), P("expert")
        fn = jax.shard_map(functools.partial(local, ep=ep), in_specs=(g, g, g, g, e, e, e, e),
                           out_specs=g, axis_names=frozenset(batch_axes) | {"expert"})
        return fn(x_GSM, *slots, *experts)
