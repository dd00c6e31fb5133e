"""Stacked Transformer blocks, and GPipe pipeline parallelism over the `pipeline` mesh axis.

GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism"): the `depth` blocks are cut into P stages of depth/P consecutive
layers, one stage per device along the `pipeline` mesh axis, and the batch into M
microbatches. At tick t stage s applies its layers to microbatch t - s and hands the
result to stage s + 1 (`lax.ppermute`), so after a fill of P - 1 ticks all stages work
at once. The one idea that makes it pay: while one stage holds the activations of
microbatch m, the others work on m +- 1, so a step costs M + P - 1 stage-ticks instead
of M x P, and the idle "bubble" is the fraction (P - 1) / (M + P - 1) of each stage's
time (more microbatches, smaller bubble). Gradients are plain autodiff through the
`shard_map`, the tick `scan` and `ppermute` (whose transpose sends cotangents back one
stage): the backward pass is the reverse pipeline.

`stack_layers=True` keeps the blocks as ONE parameter tree with a leading `layers` axis
(logical name `layers`, mapped to mesh axis `pipeline`), applied with `nn.scan`: one
compiled block instead of `depth` copies. With no pipeline axis of size > 1 in the
current mesh, in decode mode (one token per call: nothing to pipeline; the scan then
runs over all layers and GSPMD gathers the stages' parameters), and at `init`, that scan
is what runs. Only the blocks are pipelined; embeddings, the final norm and the output
layer stay outside, under the automatic (GSPMD) sharding of the other mesh axes.

What holds: with dropout off, the pipelined trunk computes the same function as the
stacked scan (tested to 1e-5 on losses and parameters after training steps) for every
attention variant that draws no random features (nor noise: `sinkhorn` draws its Gumbel
noise in training from the dropout stream whatever the rate, so it matches
`gpipe_reference` only); `clustered` is refused (its centroids'
k-means gradient is added whatever cotangent reaches it, so the idle ticks would add
theirs). With dropout on, `gpipe` equals its slow
twin `gpipe_reference` (every microbatch through all layers in turn), masks included: keys
fold in the global layer index (features) and the layer and microbatch index (dropout), so
for a given M they do not depend on P. They are not the keys `nn.scan` splits in the
unpipelined run, so with dropout > 0 the masks differ from the mesh.pipeline = 1 run, and
they change with M; and the variants that draw random features from the `features` stream
(LSH's rotations, Performer's projections) draw other ones per layer than the mesh.pipeline
= 1 run, so the same weights evaluate otherwise there (found in review: eval losses 1-2%
apart on a tiny LM). Evaluate such a run under the mesh.pipeline it trained with. Decoding
always runs the scan, so `generate` refuses a run whose decoding draws (`check_decodes`:
Performer with redraw; LSH decodes by full attention). The keys stay as they are: deriving
them otherwise would change every saved run's draw.

Shape letters: B batch, b microbatch rows (B / M), M microbatches, L length, E width,
P pipeline stages.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as PS

from hpnlp import kernels

AXIS = "pipeline"
RNG_STREAMS = ("dropout", "features")
# Like the mesh and the logical-axis rules, the microbatch count is a parallelism setting
# that the model code does not carry: the trainer sets it from mesh.pipeline_microbatches.
_MICROBATCHES = contextvars.ContextVar("pipeline_microbatches", default=0)


@contextlib.contextmanager
def use_microbatches(n: int):
    """Within this context pipelined trunks split the batch into `n` microbatches (0: P)."""
    token = _MICROBATCHES.set(_microbatch_count(n))
    try:
        yield
    finally:
        _MICROBATCHES.reset(token)


def _microbatch_count(n) -> int:
    """`n` as a microbatch count, a whole number >= 0 (0: one per stage); a ValueError naming
    it otherwise (a review, session 114: -2 passed `B % -2` and failed in a reshape, 2.0 as
    a float shape)."""
    if not kernels.is_integer(n) or n < 0:
        raise ValueError(f"pipeline: microbatches={n!r}; give a whole number >= 0 (0: one per "
                         "stage, mesh.pipeline_microbatches)")
    return int(n)


def pipeline_stages(axis: str = AXIS) -> int:
    """Size of the `pipeline` axis of the current (abstract) mesh; 1 when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


def whole_microbatches(rows: int) -> int:
    """`rows` rounded up to a multiple of the microbatch count a pipelined trunk splits its
    batch into here (the `use_microbatches` context's, 0 or unset: the stages P), else `rows`
    where nothing is pipelined: for passes whose batch is theirs, not the config's (a
    bi-encoder's pool evaluation and mining: review r3, session 108, found them sending
    batches that pipeline_microbatches=6 does not split, and the run died at its first eval,
    every resume again; validate checks the train and eval batches only)."""
    P = pipeline_stages()
    if P == 1:
        return rows
    M = _MICROBATCHES.get() or P  # as `stacked_blocks` reads it
    return -(-rows // M) * M


def _to_micro(x_B, M: int):
    """[B, ...] -> [M, B/M, ...]; microbatch i = rows i, i+M, ... so each keeps a share of
    every data-parallel shard (as `train.step._split_microbatches`). A tuple (segment ids
    and positions): each."""
    if isinstance(x_B, tuple):
        return tuple(_to_micro(x, M) for x in x_B)
    return x_B.reshape((x_B.shape[0] // M, M) + x_B.shape[1:]).swapaxes(0, 1)


def _block_args(seg_BL) -> tuple:
    """What every layer reads besides the activations, as the block's extra arguments:
    segment ids [B, L], or the pair (segment ids, positions) of model.pos_emb = "rope"."""
    return seg_BL if isinstance(seg_BL, tuple) else (seg_BL,)


def _from_micro(x_M):
    return x_M.swapaxes(0, 1).reshape((x_M.shape[0] * x_M.shape[1],) + x_M.shape[2:])


def scan_blocks(block: nn.Module, x_BLE, seg_BL, *, length: int):
    """`length` copies of `block` as one stacked parameter tree [layers, ...], via nn.scan.

    Activations are the carry; segment ids (and positions: `_block_args`) are broadcast to
    every layer. Each layer gets
    its own params, dropout and features keys (split_rngs) and decode cache (variable_axes).
    """
    scan = nn.scan(lambda blk, x, seg: (blk(x, *_block_args(seg)), None),
                   # quant / calib / qexport / qserve: hpnlp.compress, one entry per layer
                   # aux: what a layer reports (hpnlp.moe), one entry per layer
                   variable_axes={"params": 0, "cache": 0, "quant": 0, "calib": 0, "qexport": 0,
                                  "qserve": 0, "aux": 0},
                   split_rngs={"params": True, "dropout": True, "features": True},
                   in_axes=nn.broadcast, length=length,
                   metadata_params={nn.PARTITION_NAME: "layers"})
    x_BLE, _ = scan(block, x_BLE, seg_BL)
    return x_BLE


def apply_layers(block: nn.Module, params, x_bLE, seg_bL, rngs: dict, *, first_layer, microbatch,
                 quant=None):
    """A stage: the layers in `params` (leading axis n) applied in order with `lax.scan`.

    `block` is unbound; keys fold in the global layer index (and the microbatch, for
    dropout), so they do not depend on how the layers are cut into stages. `quant`: the
    layers' `quant` collection (hpnlp.compress's calibrated ranges, leading axis n), if any.
    """
    n = jax.tree.leaves(params)[0].shape[0]

    def layer(x_bLE, xs):
        p, q, j = xs
        keys = {s: jax.random.fold_in(k, first_layer + j) for s, k in rngs.items()}
        if "dropout" in keys:
            keys["dropout"] = jax.random.fold_in(keys["dropout"], microbatch)
        variables = {"params": p, **({"quant": q} if q is not None else {})}
        return block.apply(variables, x_bLE, *_block_args(seg_bL), rngs=keys), None

    x_bLE, _ = lax.scan(layer, x_bLE, (params, quant, jnp.arange(n)))
    return x_bLE


def gpipe(stage_fn: Callable, params, x_BLE, seg_BL, rngs: dict | None = None, *,
          microbatches: int = 0, axis: str = AXIS, mesh=None):
    """Run `stage_fn` as a GPipe pipeline over mesh axis `axis` (manual there only).

    `params`: pytree whose leaves have a leading layer axis, split over `axis` (stage s
    holds layers [s * n, (s + 1) * n)). `stage_fn(params_local, x_bLE, seg_bL, rngs,
    first_layer=, microbatch=) -> x_bLE` applies one stage. `microbatches` M (0: P) must
    divide the batch. Returns [B, L, E], the last stage's outputs in batch order.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    P = mesh.shape[axis]
    M = _microbatch_count(microbatches) or P
    B = x_BLE.shape[0]
    if B % M:
        # validate checks the train and eval batches, so these rows are the pass's own (a
        # user's model.apply, a pool, mining): the config fields are not what to change (r2)
        raise ValueError(f"pipeline: a pass's batch of {B} rows does not split into {M} "
                         f"microbatches (mesh.pipeline_microbatches, 0: mesh.{axis}); pad its "
                         f"rows to a multiple of {M} (hpnlp.parallel.pipeline.whole_microbatches)")
    depth = jax.tree.leaves(params)[0].shape[0]
    if depth % P:
        raise ValueError(f"pipeline: model.depth={depth} layers do not split over mesh.{axis}={P}")
    per_stage = depth // P
    rngs = dict(rngs or {})
    # The pipeline carries, sends and returns activations in float32 whatever the compute
    # dtype: in bfloat16, the backward pass's all-reduce of the replicated inputs' cotangent
    # crashed XLA:CPU's compiler (jaxlib 0.10.2: AllReducePromotion clones a reducer whose
    # root is a copy, "Invalid binary instruction opcode copy"; found by the crash hunt).
    # The stages still compute in the model's dtype.
    dtype = x_BLE.dtype
    x_MbLE, seg_MbL = _to_micro(x_BLE.astype(jnp.float32), M), _to_micro(seg_BL, M)
    # Inputs are replicated over stages (only stage 0 reads them) and every stage returns an
    # [M, b, L, E] buffer of which the last stage's is kept: simple, at the cost of moving
    # B x L x E activations twice per step besides the stage-to-stage sends.
    specs = (jax.tree.map(lambda _: PS(axis), params), PS(), PS(), jax.tree.map(lambda _: PS(), rngs))

    # check_vma off, as in ring attention: found in review, a stage's loops that start from
    # a fresh constant (chunked's cond, the kernel variants' fori_loop) failed its type check
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=PS(axis),
                       axis_names=frozenset({axis}), check_vma=False)
    def run(params_local, x_MbLE, seg_MbL, rngs):
        stage = lax.axis_index(axis)
        shift = [(s, s + 1) for s in range(P - 1)]  # stage 0 receives zeros: it reads inputs

        def tick(carry, t):
            held_bLE, out_MbLE = carry
            mb = t - stage  # the microbatch this stage holds at tick t
            i = jnp.clip(mb, 0, M - 1)
            in_bLE = jnp.where(stage == 0, x_MbLE[i], held_bLE)
            # Segment ids are replicated over stages: each stage reads its microbatch's rows
            # (no transfer). Positions feed the embedding, before the pipeline, and with
            # model.pos_emb = "rope" every layer (then seg_MbL is the pair).
            seg_bL = jax.tree.map(lambda a: a[i], seg_MbL)
            y_bLE = stage_fn(params_local, in_bLE.astype(dtype), seg_bL, rngs,
                             first_layer=stage * per_stage, microbatch=i).astype(jnp.float32)
            # Bubble ticks (mb outside [0, M)) compute on stale inputs; their results are
            # dropped here, so they get no gradient.
            keep = (mb >= 0) & (mb < M)
            out_MbLE = lax.dynamic_update_index_in_dim(
                out_MbLE, jnp.where(keep, y_bLE, out_MbLE[i]), i, 0)
            return (lax.ppermute(y_bLE, axis, shift), out_MbLE), None

        vary = lambda a: lax.pcast(a, axis, to="varying")  # noqa: E731 (carries differ per stage)
        init = (vary(jnp.zeros_like(x_MbLE[0])), vary(jnp.zeros_like(x_MbLE)))
        (_, out_MbLE), _ = lax.scan(tick, init, jnp.arange(M + P - 1))
        return out_MbLE  # every stage's; only the last stage's are finished

    out_PMbLE = run(params, x_MbLE, seg_MbL, rngs)
    return _from_micro(out_PMbLE[(P - 1) * M:]).astype(dtype)


def gpipe_reference(stage_fn: Callable, params, x_BLE, seg_BL, rngs: dict | None = None, *,
                    microbatches: int):
    """The slow twin of `gpipe`: each microbatch through all layers in turn, no stages, same
    keys (stage_fn sees every layer, from global layer 0)."""
    M = microbatches
    x_MbLE, seg_MbL = _to_micro(x_BLE, M), _to_micro(seg_BL, M)
    out_MbLE = lax.map(lambda a: stage_fn(params, a[0], a[1], dict(rngs or {}), first_layer=0,
                                          microbatch=a[2]), (x_MbLE, seg_MbL, jnp.arange(M)))
    return _from_micro(out_MbLE)


def stacked_blocks(parent: nn.Module, make_block: Callable[..., nn.Module], x_BLE, seg_BL, *,
                   depth: int, decode: bool = False, name: str = "blocks", pos_BL=None):
    """`depth` blocks stored as one stacked tree `name` inside `parent` (a Trunk, called
    from its compact `__call__`): a GPipe pipeline when the current mesh has a pipeline
    axis of size > 1, else (and in decode mode and at init) one `nn.scan`.

    `make_block(**kw)` builds a block (remat or not) with the module's fields bound. The
    microbatch count comes from the `use_microbatches` context (0 or unset: P). `pos_BL`
    (model.pos_emb = "rope"): every block's positions, passed beside the segment ids.
    """
    if pos_BL is not None:
        seg_BL = (seg_BL, pos_BL)
    P = pipeline_stages()
    if P == 1 or decode or parent.is_initializing():
        return scan_blocks(make_block(name=name), x_BLE, seg_BL, length=depth)
    params = nn.meta.unbox(parent.variables["params"][name])
    rngs = {s: parent.make_rng(s) for s in RNG_STREAMS if parent.has_rng(s)}
    block = make_block(parent=None)
    quant = parent.variables.get("quant", {}).get(name)
    if quant is None:
        stage = functools.partial(apply_layers, block)
        return gpipe(stage, params, x_BLE, seg_BL, rngs, microbatches=_MICROBATCHES.get())

    # The calibrated ranges (hpnlp.compress, act_scale='static') go through the stages
    # beside the params, split by layer as they are (a bug hunt (session 103): the blocks
    # got the params alone, so a pipelined run's PTQ eval failed on every static product)
    def stage(variables, *args, **kw):
        return apply_layers(block, variables["params"], *args, quant=variables["quant"], **kw)

    return gpipe(stage, {"params": params, "quant": quant}, x_BLE, seg_BL, rngs,
                 microbatches=_MICROBATCHES.get())


__all__ = ["apply_layers", "gpipe", "gpipe_reference", "pipeline_stages", "scan_blocks",
           "stacked_blocks", "use_microbatches"]
