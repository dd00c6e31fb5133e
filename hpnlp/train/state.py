"""Train state and optimizer.

`TrainState` is a pytree of step, params, optimizer state and the RNG key. The key is
stored as raw key data (uint32) so checkpoints hold it like any array; every step draws
`fold_in(key, step)`, so a resumed run gets the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from hpnlp.config import TrainConfig


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 [], optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 key data of the run's base key
    # Dynamic loss scaling (float16 compute only; None otherwise): the current scale and
    # the number of overflow-free steps since it last changed.
    loss_scale: Any = None  # float32 []
    good_steps: Any = None  # int32 []
    # What methods carry from step to step (hpnlp.train.carry): name -> pytree, e.g. the
    # Transformer-XL memory, a distillation teacher's parameters, pruning masks.
    carry: Any = flax.struct.field(default_factory=dict)

    def step_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

    def features_key(self, redraw_every: int) -> jax.Array:
        """Key of the `features` draw the parameters were trained with, the last train step's:
        draw `(step - 1) // redraw_every` (draw 0 at step 0, the one the first step trains
        with); a new draw every `redraw_every` steps (0: never). Eval, ensembles and decoding
        read it, so they score the parameters under the draw that made them, and a resumed run
        reads the same from its saved step. `train_features_key` is the next step's draw: at
        a step that is a multiple of `redraw_every`, one no step has trained with yet (a
        review, r7: evals read that one, and the final eval of every Performer run whose
        train.steps was a multiple of train.feature_redraw_every scored an untrained draw)."""
        return self._draw_key(jnp.maximum(self.step, 1) - 1, redraw_every)

    def host_features_key(self, redraw_every: int) -> jax.Array:
        """`features_key` from the host's copy of the replicated rng and step, so a pass
        outside the run's mesh (a tool's evaluation, a compressed model's) can read it."""
        rng, step = jax.device_get((self.rng, self.step))
        return self.replace(rng=rng, step=step).features_key(redraw_every)

    def train_features_key(self, redraw_every: int) -> jax.Array:
        """Key of the draw the next train step (from `step` to `step + 1`) trains with, draw
        `step // redraw_every`: after that step, `features_key` is this one."""
        return self._draw_key(self.step, redraw_every)

    def _draw_key(self, step, redraw_every: int) -> jax.Array:
        draw = step // redraw_every if redraw_every else jnp.zeros((), jnp.int32)
        base = jax.random.fold_in(jax.random.wrap_key_data(self.rng), 2**31 - 1)  # not a step key
        return jax.random.fold_in(base, draw)


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine / linear decay to `lr * end_lr_frac`, by
    optimizer count: step s (1 .. train.steps) applies the rate at count s - 1, so the first
    step of a warmup applies 0, the peak comes at count warmup_steps, and the decay reaches
    `lr * end_lr_frac` at count train.steps, one past the last step's. (Recorded runs trained
    so; `check_new_run` refuses a run of one step with a warmup, which would train nothing.)"""
    end = t.lr * t.end_lr_frac
    if t.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, max(t.steps, 1), end)
    warm = optax.linear_schedule(0.0, t.lr, t.warmup_steps)
    if t.schedule == "constant":
        decay = optax.constant_schedule(t.lr)
    else:
        decay = optax.linear_schedule(t.lr, end, max(t.steps - t.warmup_steps, 1))
    return optax.join_schedules([warm, decay], [t.warmup_steps])


# What weight decay leaves out, by what a parameter is rather than by its rank (a bug hunt,
# session 101: the rank rule decayed the LSTM/GRU biases and gains, [directions, ...] and
# [directions, gates, H], MoE experts' biases [experts, ...], and with model.stack_layers
# every norm and bias [depth, ...], so a stacked run was not the unstacked one's optimization):
# - a module's own name for a bias, a norm's scale or gain, an RNN's learned initial state,
#   and the per-head biases named below: Transformer-XL's global content and position biases
#   u, v [H, D] (models/transformer_xl.py), the dense synthesizer's b1 [H, F] and b2 [H, M]
#   (attention/synthesizer.py), MoE experts' bi [X, F] and bo [X, M] (moe/layer.py) (a bug
#   hunt, session 101: u, v, b1 and b2 were decayed as matrices; bi and bo were kept out by
#   their axis names alone). No matrix of another module is named so under a dict key;
#   `_name` reads dict keys only, so a factorized kernel's factors (Factored.u, .v) are its
#   kernel's.
_NO_DECAY_NAMES = ("bias", "scale", "init_c", "init_h", "u", "v", "b1", "b2", "bi", "bo")
_NO_DECAY_SUFFIXES = ("_bias", "_gain")
# - and of the rest, those with fewer than two axes besides the ones that index copies of one
#   array (logical names: stacked blocks, experts).
_COPY_AXES = ("layers", "expert")


def _name(path) -> str:
    """A parameter's own name: its last dict key (a factorized kernel's `u` is `kernel`)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(keys[-1]) if keys else ""


def decays(path, shape, names=None) -> bool:
    """Whether weight decay applies to the parameter at tree path `path` of shape `shape`: a
    matrix or a table (the rules above); `names`: its logical axis names, where known."""
    name = _name(path)
    if name in _NO_DECAY_NAMES or name.endswith(_NO_DECAY_SUFFIXES):
        return False
    names = (None,) * len(shape) if names is None else names
    return sum(n not in _COPY_AXES for n in names) >= 2


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def decay_mask(params):
    """Weight decay's mask (`decays`), a static bool tree over the parameters as they train
    (unboxed), drawn once from `params` boxed with their logical axis names as the model's
    init makes them (nn.LogicallyPartitioned; abstract will do: `jax.eval_shape`'s). A
    parameter without names (a carry's trainable projection) is judged by its shape.

    A bug hunt (session 101): the mask was drawn at every `tx.init` and `tx.update`, the
    update's from names a module-level registry kept from the process's inits, by path and
    shape, never cleared: a miss (an update no init had seen) fell back to the rank rule,
    unsaid, and a stale entry of an earlier model answered for another."""
    def leaf(path, x):
        names = getattr(x, "names", None) if _is_box(x) else None
        shape = jnp.shape(x.value if _is_box(x) else x)
        return decays(path, shape, None if names is None else tuple(names))
    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=_is_box)


def _decay_by_name_and_shape(params):
    """`decay_mask` without logical axis names, the same at init (boxed) and update."""
    return decay_mask(nn.unbox(params))


# What global-norm clipping and the logged grad_norm leave out: a parameter whose gradient is
# not the objective's. `clustered` attention's centroids get a k-means step through their
# backward (attention/clustered.py), about 2|mu| ~ 2 sqrt(head dim) per token: a review
# (session 109, tools/grad_norm_parts.py) measured it at 95-100% of the global norm, so default
# clipping scaled every other gradient by 1/8 to 1/21 through the byte LM's run (whose task
# gradient alone needed no clip from step 25 on) and by 7.3e-4 at the LRA ListOps classifier's
# first step, and grad_norm logged the k-means term.
_NO_CLIP_NAMES = ("centroids",)


def clips(path) -> bool:
    """Whether global-norm clipping reads and scales the gradient at tree path `path`."""
    return _name(path) not in _NO_CLIP_NAMES


def clipped_part(grads):
    """`grads` with the leaves clipping leaves out (`clips`) as zeros: the norm clipping
    reads, and the logged grad_norm."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: g if clips(path) else jnp.zeros_like(g), grads)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` of the leaves `clips` names; the others pass unscaled.
    Its state is optax's own (EmptyState), so every saved optimizer state reads as before
    (`optax.masked` would wrap it in another node)."""
    inner = optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        scaled, state = inner.update(clipped_part(updates), state, params)
        return jax.tree_util.tree_map_with_path(
            lambda path, c, u: c if clips(path) else u, scaled, updates), state
    return optax.GradientTransformation(inner.init, update)


def make_optimizer(t: TrainConfig, params=None) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (optax; nothing here is rewritten by hand; clipping
    reads the objective's gradients, `clips`).

    `params`: the parameters it trains, boxed with their logical axis names (as
    `train_params` makes them; abstract will do), which weight decay's mask is drawn from
    once (`decay_mask`); the trainer, the ensemble (each member's tree) and the benchmark
    pass them. Without them (a test that only writes an initial state) each parameter is
    judged by its name and shape alone, which would decay a stacked or expert array of one
    axis besides the copies (no model here has one outside the names above)."""
    mask = _decay_by_name_and_shape if params is None else decay_mask(params)
    adamw = optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2,
                        weight_decay=t.weight_decay, mask=mask)
    if t.clip_norm > 0:
        return optax.chain(clip_by_global_norm(t.clip_norm), adamw)
    return adamw


def init_params(model, rng: jax.Array, batch):
    """The model's initial (boxed) parameters, as `init_state` draws them from `rng`."""
    params_rng, dropout_rng, _ = jax.random.split(rng, 3)
    return model.init({"params": params_rng, "dropout": dropout_rng}, batch)["params"]


def train_params(model, rng: jax.Array, batch, *, carries=(), transform=None, params=None):
    """The (boxed) parameters a run trains, as `init_state` makes them from `rng`: the model's
    (`params` when already drawn), `transform`ed, with the carries' trainable entries."""
    params_rng = jax.random.split(rng, 3)[0]
    if params is None:
        params = init_params(model, rng, batch)
    if transform is not None:
        params = transform(params)
    from hpnlp.train.carry import TRAINABLE_PREFIX
    extra = {}
    for i, c in enumerate(carries):  # what methods train beside the model (carry.py)
        value = c.trainable(model, params, batch, jax.random.fold_in(params_rng, 1 + i))
        if value is not None:
            extra[TRAINABLE_PREFIX + c.name] = value
    return {**params, **extra} if extra else params


def init_state(model, tx, rng: jax.Array, batch, *, loss_scale: float | None = None,
               carries=(), batch_size: int = 1, transform=None, params=None) -> TrainState:
    """Parameters and optimizer state (still boxed with logical axis names).

    `loss_scale`: the initial dynamic loss scale (float16 compute), None for no scaling.
    `carries`: hpnlp.train.carry entries, initialized for `batch_size` (the train batch).
    `transform`: maps the model's initial (boxed) parameters to the ones the run trains
    (low-rank factorization: hpnlp.compress.lowrank.init_transform).
    `params`: `init_params(model, rng, batch)` when already drawn (the trainer draws them
    in a program of their own, which every run of the same model shares), else drawn here.
    """
    run_rng = jax.random.split(rng, 3)[2]
    params = train_params(model, rng, batch, carries=carries, transform=transform,
                          params=params)
    # From the boxed params: Adam moments inherit the logical axis names, so FSDP / tensor
    # rules shard them like the parameters instead of replicating them.
    opt_state = tx.init(params)
    scaling = {} if loss_scale is None else {"loss_scale": jnp.asarray(loss_scale, jnp.float32),
                                             "good_steps": jnp.zeros((), jnp.int32)}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      rng=jax.random.key_data(run_rng),
                      carry={c.name: c.init(model, params, batch, batch_size) for c in carries},
                      **scaling)
