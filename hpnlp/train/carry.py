"""State beyond parameters: the one mechanism for what a method carries from step to step.

`TrainState.carry` maps a name to a pytree. Each entry belongs to a `Carry`, chosen by the
config (`for_config`); the train step and the Trainer know only this interface, so a new
method is one class here or beside its own code, not a new branch in the loop:

- `init(model, params, batch, batch_size)`: the entry's initial value, with logical axis
  names where it should be sharded (traced inside the state's init after the parameters,
  which it may read, so it gets shardings like them; `batch` is the init batch);
- `start(value, params)`: its value at a fresh start, on the host, after init and after
  `train.init_from` restored the parameters (the distillation teacher's trained parameters
  are restored here); resumed runs read it from the checkpoint;
- `loss(model, inner)`: wraps the loss `inner(params, carry, batch, rngs) -> (sums, carry)`
  (Transformer-XL threads its memory through it; distillation adds the teacher's terms);
- `evaluate(model, inner)`: wraps the evaluation `inner(params, carry, batch, rngs) -> sums`
  (the eval step's, with the eval model and the state's carry): what a method's model needs
  at evaluation from its entry (the classifier's key-value memory reads the trained memory);
- `gradients(value, grads) -> grads`: the gradients the optimizer is given (its clipping,
  its moments and the logged grad_norm read them): pruning zeroes the pruned entries' here,
  as the model computes with W' = W * M; `after_update` still gets the step's own;
- `after_update(value, params, grads, step, features) -> (params, value)`: runs after the
  optimizer update (pruning applies and advances its masks here; mining re-mines hard
  negatives here, with `features`, the random-feature draw the step trained with);
- `skipped(new, old, applied) -> value`: the entry after a float16 step that loss scaling
  may skip (by default the old one where it was skipped; Transformer-XL's memory moves on
  with the stream);
- `start_params(value, params, batches) -> params`: the parameters a fresh run starts from,
  after `start` (distillation's DistilBERT initialization copies teacher blocks here);
  `batches(n)` gives the run's first n training batches, read by an iterator of their own,
  so the run's data order is untouched (Minitron's importance reads the teacher on them);
- `for_member(key)`: the carry as member i of a seed ensemble runs it, `key` the PRNG key
  of that member's seed, jax.random.key(cfg.seed + i) (traced): what it draws from cfg.seed
  in a plain run it draws from `key` (random pruning's scores), so member i is the plain
  run of its seed; by default the carry itself;
- `trainable(model, params, batch, key)`: parameters the method trains beside the model's
  (distillation's hidden-state projection), or None. They sit in the state's parameters
  under `carry_<name>` (`TRAINABLE_PREFIX`), so the optimizer, the gradient and the
  checkpoints treat them like any other; the model ignores keys it does not define, and
  `model_params` strips them wherever the model alone is wanted (its size, `train.init_from`,
  export).

Entries are saved in every checkpoint with the rest of the state, so a resumed run continues
exactly. The carries in use today: `memory` (Transformer-XL on a stream, with the
Compressive Transformer's compressed memory when model.comp_mem_len > 0,
models/transformer_xl.py; its evaluation threads the eval stream's own fresh memory, so the
Trainer keeps a separate eval step for it), `teacher` (hpnlp.compress.distill), `prune`
(hpnlp.compress.prune), `kv_memory` (the classifier's key-value memory with ages,
hpnlp.retrieval.memory), `negatives` (a bi-encoder's mined hard negatives,
hpnlp.retrieval.mining; after `prune`, so it mines with the weights pruning leaves).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from hpnlp.config import Config

LossFn = Callable[..., tuple[dict, dict]]  # (params, carry, batch, rngs) -> (sums, carry)
EvalFn = Callable[..., dict]  # (params, carry, batch, rngs) -> sums

TRAINABLE_PREFIX = "carry_"  # no model names a top-level module so


def model_params(params):
    """`params` without the carries' trainable entries (module doc): the model's own."""
    return {k: v for k, v in params.items() if not str(k).startswith(TRAINABLE_PREFIX)}


def trainable_params(params) -> dict:
    """The carries' trainable entries of `params`: {"carry_<name>": tree}."""
    return {k: v for k, v in params.items() if str(k).startswith(TRAINABLE_PREFIX)}


class Carry:
    """A method's entry in `TrainState.carry` (module doc). Subclasses override what they use."""

    name: str = ""

    def init(self, model, params, batch, batch_size: int) -> Any:
        raise TypeError(f"{type(self).__name__} must define init")

    def start(self, value, params):
        return value

    def loss(self, model, inner: LossFn) -> LossFn:
        return inner

    def evaluate(self, model, inner: EvalFn) -> EvalFn:
        return inner

    def gradients(self, value, grads):
        return grads

    def after_update(self, value, params, grads, step, features=None):
        return params, value

    def skipped(self, new, old, applied):
        """The entry after a float16 step that overflowed (`applied` False, traced) or not:
        by default the step's update is undone, the entry kept as it was."""
        return jax.tree.map(lambda a, b: jnp.where(applied, a, b), new, old)

    def start_params(self, value, params, batches):
        return params

    def for_member(self, key) -> "Carry":
        return self

    def trainable(self, model, params, batch, key):
        return None

    def report(self, value, params) -> dict | None:
        """What the run's summary.json says of this carry at the end ("carries": {name:
        report}); None: nothing."""
        return None


def for_config(cfg: Config, *, token_counts=None, workdir: str | None = None,
               tokenizer_sha256: str | None = None,
               text_digest: str | None = None) -> list[Carry]:
    """The carries `cfg` asks for, in the order their losses wrap the model's; `workdir`:
    the run's (where a carry keeps what it needs of another run's folder);
    `tokenizer_sha256`, `text_digest`: its subword model's and its training text's
    (data.task_tokenizer_sha256, data.task_text_digest), for a teacher's."""
    from hpnlp.models import transformer_xl as xl

    out: list[Carry] = []
    if xl.carries_memory(cfg):
        out.append(xl.MemoryCarry(cfg))
    if cfg.model.memory.size:  # the classifier's key-value memory: it replaces the model's loss,
        from hpnlp.retrieval.memory import KVMemoryCarry  # so it comes first (prune's L1 wraps it)
        out.append(KVMemoryCarry(cfg))
    if cfg.train.distill.teacher:
        from hpnlp.compress.distill import TeacherCarry
        out.append(TeacherCarry(cfg, token_counts=token_counts, workdir=workdir,
                                tokenizer_sha256=tokenizer_sha256, text_digest=text_digest))
    if cfg.train.prune.method != "none":
        from hpnlp.compress.prune import PruneCarry
        out.append(PruneCarry(cfg))
    if cfg.model.kind == "bi_encoder" and cfg.model.encoder.mine_every:
        # after pruning: `after_update` runs in this order, and mining embeds the pool with
        # the encoder that trains next, masked (or rewound) by pruning's (review r10, session
        # 108: it mined with the weights pruning then zeroed). Their losses commute: mining's
        # adds batch keys, pruning's L1 adds to loss_aux
        from hpnlp.retrieval.mining import NegativesCarry
        out.append(NegativesCarry(cfg))
    return out


AUX = "aux"  # the collection layers `sow` auxiliary losses and statistics into (hpnlp.moe)
AUX_LOSS = "loss_aux"  # their summed loss in the sums: the train step minimizes loss + loss_aux


def _natural(path) -> list:
    import re
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", jax.tree_util.keystr(path))]


def fold_aux(sums: dict, aux, *, add_loss: bool = True) -> dict:
    """The model's sums with what its layers reported in the `aux` collection.

    Each reporting layer sows one dict per call: `loss`, a per-token mean the train step adds
    to the model's loss, summed over the layers into `loss_aux` (times `weight`, like every
    sum) when `add_loss` (`loss` itself stays the task's); `loss_*` parts, logged as their mean
    over the layers (times `weight`); any other key a sum. Scalars are summed over the
    layers; a vector statistic (an MoE layer's load per expert) is kept per layer, [layers,
    ...], in block order. A stacked (scanned) block reports once per layer along its leading
    axis. A layer called more than once in a step (a model that applies a shared trunk twice;
    the two-sided encoders did, once per side, until session 108: `heads.encode_sides`)
    reports once: its calls' statistics summed, its `loss_*` parts their mean (a bug hunt,
    session 95: a 2-layer bi-encoder logged the load of 4 MoE layers).
    """
    if not aux:
        return sums
    calls: dict[tuple, dict] = {}  # each reporting call site's calls, in block order
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(aux)[0],
                             key=lambda pl: _natural(pl[0])):
        site = tuple(k for k in path[:-1] if not isinstance(k, jax.tree_util.SequenceKey))
        calls.setdefault(site, {}).setdefault(str(path[-1].key), []).append(leaf)
    reports = {site: {key: (sum(leaves) / len(leaves) if key.startswith("loss_") else
                            sum(leaves)) for key, leaves in report.items()}
               for site, report in calls.items()}
    entries: dict[str, list] = {}
    for report in reports.values():
        lead = jnp.ndim(report["loss"])  # a scanned block's leading layer axis, or none
        for key, leaf in report.items():  # -> [layers, ...] with the statistic's own shape
            entries.setdefault(key, []).append(jnp.reshape(leaf, (-1,) + jnp.shape(leaf)[lead:]))
    out, w = dict(sums), sums["weight"]
    for key, leaves in entries.items():
        per_layer = jnp.concatenate(leaves)
        if key == "loss":
            if add_loss:
                out[AUX_LOSS] = jnp.sum(per_layer) * w
        elif key.startswith("loss_"):
            out[key] = jnp.mean(per_layer) * w
        elif per_layer.ndim == 1:
            out[key] = jnp.sum(per_layer)
        else:
            out[key] = per_layer
    return out


def model_loss(model) -> LossFn:
    """The plain objective: the model's summed loss (with its layers' auxiliary losses),
    carry unchanged."""
    def loss(params, carry, batch, rngs):
        sums, aux = model.apply({"params": params}, batch, rngs=rngs, mutable=[AUX])
        return fold_aux(sums, aux.get(AUX)), carry
    return loss


def objective(model, carries: list[Carry]) -> LossFn:
    """The model's loss wrapped by every carry's `loss`, in order."""
    fn = model_loss(model)
    for c in carries:
        fn = c.loss(model, fn)
    return fn


def fold_eval(model, variables: dict, batch, rngs=None) -> dict:
    """The model's `evaluate` sums of `batch` under `variables` (its parameters, and what
    else it reads: a quantized model's ranges), its layers' statistics folded in, the task's
    loss alone: the float evaluation's and a quantized one's (hpnlp.compress.ptq)."""
    sums, aux = model.apply(variables, batch, method="evaluate", rngs=rngs, mutable=[AUX])
    return fold_aux(sums, aux.get(AUX), add_loss=False)


def model_eval(model) -> EvalFn:
    """The plain evaluation: the model's `evaluate` sums (its layers' statistics folded in,
    the task's loss alone), carry unused."""
    def evaluate(params, carry, batch, rngs):
        return fold_eval(model, {"params": params}, batch, rngs)
    return evaluate


def evaluation(model, carries: list[Carry]) -> EvalFn:
    """The model's evaluation wrapped by every carry's `evaluate`, in order."""
    fn = model_eval(model)
    for c in carries:
        fn = c.evaluate(model, fn)
    return fn


def skipped(carries: list[Carry], new: dict, old: dict, applied) -> dict:
    """Every carry's entry after a step loss scaling may have skipped (`Carry.skipped`)."""
    return {**new, **{c.name: c.skipped(new[c.name], old[c.name], applied) for c in carries}}


def gradients(carries: list[Carry], carry: dict, grads):
    """The gradients the optimizer is given: every carry's `gradients`, in order."""
    for c in carries:
        grads = c.gradients(carry[c.name], grads)
    return grads


def after_update(carries: list[Carry], carry: dict, params, grads, step, features=None):
    """Every carry's post-update step, in order -> (params, carry); `features`: the key of the
    random-feature draw the step trained with (`TrainState.train_features_key`)."""
    carry = dict(carry)
    for c in carries:
        params, carry[c.name] = c.after_update(carry[c.name], params, grads, step, features)
    return params, carry
