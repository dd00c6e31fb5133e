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
        """Key of the `features` stream: constant between redraws, shared by train and eval."""
        draw = self.step // redraw_every if redraw_every else jnp.zeros((), jnp.int32)
        base = jax.random.fold_in(jax.random.wrap_key_data(self.rng), 2**31 - 1)  # not a step key
        return jax.random.fold_in(base, draw)


def learning_rate_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine / linear decay to `lr * end_lr_frac`."""
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
# - a module's own name for a bias, a norm's scale or gain, an RNN's learned initial state;
_NO_DECAY_NAMES = ("bias", "scale", "init_c", "init_h")
_NO_DECAY_SUFFIXES = ("_bias", "_gain")
# - and of the rest, those with fewer than two axes besides the ones that index copies of one
#   array (logical names: stacked blocks, experts).
_COPY_AXES = ("layers", "expert")
# The logical axis names of every parameter the optimizer's init has seen, by (path, shape):
# the update's gradients carry none (the step unboxes the state; the ensemble's vmap takes
# the member axis off the shapes, as its members' init had none).
_LOGICAL_AXES: dict[tuple[str, tuple], tuple] = {}


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


def _decay_mask(params):
    """Weight decay on matrices and tables, not on biases, norms, gains (`decays`).

    At `tx.init` the parameters are boxed with their logical axis names (nn.LogicallyPartitioned),
    and the names are kept by path; `tx.update` gets them unboxed and looks them up (a
    parameter the init never saw, e.g. a model without names, is judged by its shape)."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731

    def leaf(path, x):
        key = (jax.tree_util.keystr(path), tuple(jnp.shape(x.value if is_box(x) else x)))
        if is_box(x):
            _LOGICAL_AXES[key] = tuple(getattr(x, "names", None) or (None,) * len(key[1]))
        return decays(path, key[1], _LOGICAL_AXES.get(key))
    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_box)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping (optax; nothing here is rewritten by hand)."""
    adamw = optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2,
                        weight_decay=t.weight_decay, mask=_decay_mask)
    if t.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(t.clip_norm), adamw)
    return adamw


def init_params(model, rng: jax.Array, batch):
    """The model's initial (boxed) parameters, as `init_state` draws them from `rng`."""
    params_rng, dropout_rng, _ = jax.random.split(rng, 3)
    return model.init({"params": params_rng, "dropout": dropout_rng}, batch)["params"]


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
    params_rng, _, run_rng = jax.random.split(rng, 3)
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
    if extra:
        params = {**params, **extra}
    # From the boxed params: Adam moments inherit the logical axis names, so FSDP / tensor
    # rules shard them like the parameters instead of replicating them.
    opt_state = tx.init(params)
    scaling = {} if loss_scale is None else {"loss_scale": jnp.asarray(loss_scale, jnp.float32),
                                             "good_steps": jnp.zeros((), jnp.int32)}
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                      rng=jax.random.key_data(run_rng),
                      carry={c.name: c.init(model, params, batch, batch_size) for c in carries},
                      **scaling)
