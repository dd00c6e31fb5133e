"""Key-value memory with ages: Kaiser, Nachum, Roy, Bengio 2017, "Learning to Remember Rare
Events" (ICLR), section 3.

The memory holds unit keys, an integer value (a label) per key and an age per slot. A query
q (a unit vector the model computes) is answered by its nearest key's value, so one example
written once is recalled the next time a similar query comes: a class seen a handful of
times is remembered without the many gradient steps a softmax head needs to move its
bias. The memory is not a parameter: it changes only by the update rule below, never by
gradients (every function here stops them at the memory), and the model learns its queries
through the margin loss.

Definitions, with n1..nk the k nearest keys of q (exact search, by similarity, ties by the
lower slot) and v the correct label:

- `margin_loss`: p the positive neighbour (the nearest key with value v), b the negative one
  (the nearest of n1..nk with a value other than v); loss = max(0, q.K[b] - q.K[p] + alpha).
  The paper: "When no positive neighbor is among the top-k, we pick any vector from memory
  with value v instead of K[n_p]". Here that vector is the *most similar* key with value v in
  the whole memory (exact: the full product is at hand), which is also the nearest positive
  among the k when there is one, so both cases are one max. The paper leaves open a memory
  with no key of value v at all; its authors' code (tensorflow/models,
  research/learning_to_remember_rare_events/memory.py) then uses similarity 0 for q.K[p], and
  so do we: the query is pushed until every wrong key among its k nearest is at least alpha
  below orthogonal. When none of the k nearest has a wrong value (an empty or one-label
  neighbourhood), b does not exist and the loss is 0.
- `update` (one example): if V[n1] = v (a hit), K[n1] <- normalize(q + K[n1]) and A[n1] <- 0;
  otherwise (q, v) is written into the oldest slot n' with A[n'] <- 0. Every other age grows
  by 1. Empty slots count as older than any written one. The paper breaks ties among the
  oldest with a small random number; here ties go to the lowest slot, deterministically
  (so a fresh memory fills slots 0, 1, 2, ... in order, and a rerun writes the same slots).
- A batch updates the memory *sequentially*, example by example in batch order (one
  `lax.scan` step each, each example seeing the memory its predecessors left), exactly as B
  steps of batch size 1 would; rows of weight 0 (padding) leave the memory untouched and
  age nothing. The authors' code does one parallel scatter per batch instead, where two
  examples hitting one slot race; the sequential order has no such conflict and costs one
  [S, D] product per example, small beside the model for memories of thousands of slots.

The classifier head uses it (`model.memory.*`, hpnlp/models/heads.py); `KVMemoryCarry`
threads it through training as the train state's `kv_memory` carry (hpnlp/train/carry.py),
so checkpoints hold it and evaluation reads the trained memory.

    >>> mem = empty(size=1024, key_dim=64)
    >>> q_BD = normalize(jnp.ones((2, 64)))
    >>> mem = update(mem, q_BD, jnp.array([3, 5]))
    >>> sims_BN, ids_BN, vals_BN = lookup(mem, q_BD, k=4)
    >>> loss_B = margin_loss(mem, q_BD, jnp.array([3, 5]), k=4, margin=0.1)

Shape letters: S memory slots, D key dimension, B queries, N the k neighbours.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.train.carry import AUX_LOSS, Carry

EMPTY = -1  # the value of an empty slot (labels are >= 0)
AGE_MAX = np.iinfo(np.int32).max - 1  # ages saturate here instead of wrapping around


class Memory(NamedTuple):
    """The memory (a pytree, carried across train steps)."""

    keys_SD: jax.Array  # float32 unit rows; zeros in empty slots
    values_S: jax.Array  # int32 label of each slot; EMPTY where nothing was written
    ages_S: jax.Array  # int32 memory steps since the slot was last written or hit


def empty(size: int, key_dim: int) -> Memory:
    """A memory of `size` empty slots of `key_dim`-wide keys."""
    return Memory(jnp.zeros((size, key_dim), jnp.float32), jnp.full((size,), EMPTY, jnp.int32),
                  jnp.zeros((size,), jnp.int32))


def normalize(x, eps: float = 1e-12):
    """Rows scaled to unit L2 norm (in float32); a zero row stays zero."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


def similarities(memory: Memory, q_BD):
    """q . K for every slot [B, S]: -inf at empty slots. Gradients reach q, never the keys."""
    keys_SD = jax.lax.stop_gradient(memory.keys_SD)
    s_BS = jnp.dot(q_BD.astype(jnp.float32), keys_SD.T, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(memory.values_S[None, :] != EMPTY, s_BS, -jnp.inf)


def lookup(memory: Memory, q_BD, k: int):
    """The k nearest keys of each (unit) query, exactly: (similarities [B, N] float32,
    slots [B, N] int32, values [B, N] int32), by similarity, ties by the lower slot. Past the
    memory's written slots the similarity is -inf and the value EMPTY."""
    size = memory.values_S.shape[0]
    if not 1 <= k <= size:
        raise ValueError(f"lookup k={k}: must be in [1, memory size {size}]")
    s_BS = similarities(memory, q_BD)
    _, ids_BN = jax.lax.top_k(jax.lax.stop_gradient(s_BS), k)
    sims_BN = jnp.take_along_axis(s_BS, ids_BN, axis=1)
    vals_BN = jnp.where(jnp.isfinite(sims_BN), memory.values_S[ids_BN], EMPTY)
    return sims_BN, ids_BN.astype(jnp.int32), vals_BN


def predict(memory: Memory, q_BD):
    """The memory's answer [B]: the value of each query's nearest key (EMPTY if none)."""
    return lookup(memory, q_BD, 1)[2][:, 0]


def margin_loss(memory: Memory, q_BD, label_B, *, k: int, margin: float):
    """The paper's memory loss per query [B], max(0, q.K[b] - q.K[p] + margin) (module doc
    for p and b, and the cases without them). Differentiable in q only."""
    s_BS = similarities(memory, q_BD)
    label_B = label_B.astype(jnp.int32)
    sims_BN, _, vals_BN = lookup(memory, q_BD, k)
    wrong_BN = (vals_BN != EMPTY) & (vals_BN != label_B[:, None])
    neg_B = jnp.max(jnp.where(wrong_BN, sims_BN, -jnp.inf), axis=1)
    right_BS = memory.values_S[None, :] == label_B[:, None]
    pos_B = jnp.max(jnp.where(right_BS, s_BS, -jnp.inf), axis=1)
    pos_B = jnp.where(jnp.any(right_BS, axis=1), pos_B, 0.0)  # no key of value v: the authors' 0
    loss_B = jax.nn.relu(neg_B - pos_B + margin)
    return jnp.where(jnp.any(wrong_BN, axis=1), loss_B, 0.0)


def _update_one(memory: Memory, q_D, v, use):
    """One example's update (module doc); `use` False leaves the memory as it was."""
    keys_SD, values_S, ages_S = memory
    valid_S = values_S != EMPTY
    s_S = jnp.where(valid_S, jnp.dot(keys_SD, q_D, precision=jax.lax.Precision.HIGHEST), -jnp.inf)
    n1 = jnp.argmax(s_S)  # ties: the lower slot
    hit = valid_S[n1] & (values_S[n1] == v)
    oldest = jnp.argmax(jnp.where(valid_S, ages_S, AGE_MAX + 1))  # empty first; ties: lower slot
    slot = jnp.where(hit, n1, oldest)
    key_D = jnp.where(hit, normalize(q_D + keys_SD[n1]), q_D)
    new = Memory(keys_SD.at[slot].set(key_D), values_S.at[slot].set(v),
                 jnp.minimum(ages_S + 1, AGE_MAX).at[slot].set(0))
    return jax.tree.map(lambda a, b: jnp.where(use, a, b), new, memory)


def update(memory: Memory, q_BD, label_B, weight_B=None) -> Memory:
    """The memory after the batch's examples, one at a time in batch order (module doc).
    `q_BD` unit queries; rows with `weight_B` 0 are skipped. No gradient flows through."""
    q_BD = jax.lax.stop_gradient(q_BD).astype(jnp.float32)
    use_B = jnp.ones(label_B.shape, bool) if weight_B is None else weight_B > 0

    def step(mem, xs):
        return _update_one(mem, *xs), None

    memory, _ = jax.lax.scan(step, jax.lax.stop_gradient(memory),
                             (q_BD, label_B.astype(jnp.int32), use_B))
    return memory


def reference_lookup(keys_SD, values_S, q_BD, k: int):
    """numpy brute force of `lookup`: the twin the tests hold it to."""
    s_BS = np.asarray(q_BD, np.float64) @ np.asarray(keys_SD, np.float64).T
    s_BS = np.where(np.asarray(values_S)[None, :] != EMPTY, s_BS, -np.inf)
    ids_BN = np.argsort(-s_BS, axis=1, kind="stable")[:, :k]
    sims_BN = np.take_along_axis(s_BS, ids_BN, 1)
    vals_BN = np.where(np.isfinite(sims_BN), np.asarray(values_S)[ids_BN], EMPTY)
    return sims_BN, ids_BN, vals_BN


class KVMemoryCarry(Carry):
    """The classifier's memory as the train state's `kv_memory` carry (hpnlp.train.carry):
    each train step's loss reads the memory as the step found it (head loss + loss_weight x
    margin loss) and leaves it updated by the batch; evaluation reads the trained memory.

    A float16 step that loss scaling skips (an overflow) keeps the memory as it was
    (`Carry.skipped`'s default, by intent; review r7 asked): its batch is neither trained
    on nor written, as if the step had not run, and its examples are written when they come
    again. Unlike Transformer-XL's memory (`MemoryCarry.skipped`), which moves on because
    the next segment of its stream continues the skipped one, nothing here needs the skipped
    batch: examples are independent. And a forward pass that overflowed can give non-finite
    queries, and one written as a key gives every later query a NaN similarity: the memory
    keeps no write of a step whose update was undone."""

    name = "kv_memory"  # "memory" is Transformer-XL's

    def __init__(self, cfg):
        self.cfg = cfg
        self.m = cfg.model.memory

    def init(self, model, params, batch, batch_size: int) -> Memory:
        del model, params, batch, batch_size
        return empty(self.m.size, self.m.key_dim)  # replicated: every device holds all of it

    def loss(self, model, inner):
        del inner  # the memory's loss contains the head's (validate: no other carry replaces it)
        from hpnlp.train.carry import AUX, fold_aux
        weight = self.m.loss_weight

        def memory_loss(params, carry, batch, rngs):
            (sums, memory), aux = model.apply({"params": params}, batch, carry[self.name],
                                              method="loss_and_memory", rngs=rngs, mutable=[AUX])
            sums = fold_aux(sums, aux.get(AUX))
            sums[AUX_LOSS] = sums.get(AUX_LOSS, 0.0) + weight * sums["loss_memory"]
            return sums, {**carry, self.name: memory}
        return memory_loss

    def evaluate(self, model, inner):
        del inner
        from hpnlp.train.carry import AUX, fold_aux

        def memory_eval(params, carry, batch, rngs):
            sums, aux = model.apply({"params": params}, batch, carry[self.name],
                                    method="evaluate", rngs=rngs, mutable=[AUX])
            return fold_aux(sums, aux.get(AUX), add_loss=False)
        return memory_eval


__all__ = ["EMPTY", "KVMemoryCarry", "Memory", "empty", "lookup", "margin_loss", "normalize",
           "predict", "reference_lookup", "similarities", "update"]
