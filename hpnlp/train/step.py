"""The pure training and evaluation steps.

`train_step(state, batch) -> (state, metrics)` computes gradients of the *summed* loss,
accumulated over `grad_accum` microbatches inside one `lax.scan`, and divides once by
the number of real tokens (or examples) in the whole batch: the update is the same as
one big batch, and the step counter counts optimizer steps. Metrics come back as sums
plus `weight`, so they add across devices and steps.

Where a loss is not a sum of per-token (or per-example) terms, microbatches are not one
big batch. MoE's auxiliary losses (hpnlp.moe) are each microbatch's own: its per-token
means weighted by its `weight` (its tokens in an LM, its examples in a classifier, so there
not by its tokens); the balance loss is not linear in the tokens anyway, and capacity
dispatch groups and drops within a microbatch (a bug hunt, session 101: a padded MoE
classifier's router moved 0.002 apart at grad_accum 4). The bi-encoder's in-batch
negatives would shrink to a microbatch's: config.validate refuses accumulation there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpnlp import xla_workarounds
from hpnlp.config import TrainConfig
from hpnlp.train import carry as carry_lib
from hpnlp.train.state import TrainState, clipped_part, learning_rate_schedule


# `jax.checkpoint` (`model.remat`) keeps a block's backward-pass recomputation apart from
# its forward twin with optimization barriers. XLA's CPU pipeline (jaxlib 0.10.2) removes
# those barriers before its CSE pass (`cse_barrier_expander`), and CSE then merges the
# recomputation back into the forward pass: on CPU, remat saved no memory at all (same
# temporaries, same dot count as without it). Train steps compile with that pass off;
# a program without barriers compiles exactly as before. This was found and checked on
# CPU only, so other backends keep XLA's default pipeline.
CPU_REMAT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


# XLA:CPU (jaxlib 0.10.2) hands dots together with their elementwise and reduction
# neighbours to YNNPACK as "YNN fusions"; on the models hpnlp trains these ran slower than
# XLA's own loop fusions around its dots. `python tools/xla_ynn_ab.py` compiles each step
# both ways in one process and times them interleaved (docs/xla_defects.md): with YNN
# fusions off, train steps 1.05x (byte LM), 1.24x (text classifier) and 1.05x (width-512
# LM) as fast, eval steps 1.56x, 1.66x and 1.04x, to the same outputs (eval sums equal to
# the last bit, a train step's to 2e-6 relative). Train and eval steps compile with them
# off. Left at XLA's default elsewhere: the width-512 LM's `log_probs` prefill ran 0.90x
# as fast without them. `HPNLP_XLA_WORKAROUNDS=0` keeps XLA's default here too.
CPU_NO_YNN_FUSION_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def _xla_knows(options: tuple) -> bool:
    """Whether this jaxlib's XLA accepts `options` (an experimental flag may be renamed)."""
    try:
        jax.jit(lambda x: x + 1).lower(jnp.zeros(2)).compile(compiler_options=dict(options))
        return True
    except Exception:  # noqa: BLE001 (an unknown option: compile without it)
        return False


def step_compiler_options() -> dict | None:
    """XLA options every train and eval step is compiled with (`jax.jit(...,
    compiler_options=)`): on CPU, the remat fix and YNN fusions off (see above)."""
    if jax.default_backend() != "cpu":
        return None
    options = dict(CPU_REMAT_COMPILER_OPTIONS)
    if (not xla_workarounds.switched_off()
            and _xla_knows(tuple(CPU_NO_YNN_FUSION_OPTIONS.items()))):
        options.update(CPU_NO_YNN_FUSION_OPTIONS)
    return options


def _split_microbatches(batch, n: int):
    """[B, ...] -> [n, B/n, ...], microbatch i = rows i, i+n, ... (every device keeps a share)."""
    def split(x):
        return x.reshape((x.shape[0] // n, n) + x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, batch)


def per_term(batch) -> float:
    """1 / the terms the batch's loss sums, rounded up to a power of 2 (which scales exactly):
    its examples where it weighs each ("weight": a classifier, an encoder), else its positions
    (rows x length of its largest array: tokens). float16's loss scale multiplies this mean."""
    terms = (math.prod(np.shape(batch["weight"])) if "weight" in batch else
             max(math.prod(np.shape(x)[:2]) for x in jax.tree.leaves(batch)))
    return 2.0 ** -math.ceil(math.log2(max(terms, 1)))


FLOOR_SKIPS = 4  # non-finite steps in a row at loss scale 1 that stop a float16 run
MAX_LOSS_SCALE = 2.0**64  # where float16's dynamic loss scale stops doubling (see train_step)


def make_train_step(model, tx: optax.GradientTransformation, t: TrainConfig, carries=()):
    """The jittable step; `carries` (hpnlp.train.carry) wrap its loss and follow its update."""
    schedule = learning_rate_schedule(t)
    loss_fn = carry_lib.objective(model, list(carries))

    def sum_loss(params, carry, batch, rng, features, scale):
        sums, carry = loss_fn(params, carry, batch, {"dropout": rng, "features": features})
        objective = sums["loss"] + sums.get(carry_lib.AUX_LOSS, 0.0)  # layers' auxiliary losses
        return objective * scale, (sums, carry)

    grad_fn = jax.value_and_grad(sum_loss, has_aux=True)

    def train_step(state: TrainState, batch):
        rng = state.step_key()
        features = state.train_features_key(t.feature_redraw_every)
        scaling = state.loss_scale is not None
        scale = state.loss_scale if scaling else jnp.ones((), jnp.float32)
        # of the mean loss per token (or example), not of the sum (a bug hunt, session 98:
        # summed over 2048 x 128 tokens float16 products overflowed at scale 1, the floor, and
        # every step was skipped); by a power of 2: the same gradients
        applied = scale * per_term(batch) if scaling else scale
        if t.grad_accum == 1:
            (_, (sums, carry)), grads = grad_fn(state.params, state.carry, batch, rng, features,
                                                applied)
        else:  # config.validate keeps carries that cannot accumulate (XL memory) at 1 here
            micro = _split_microbatches(batch, t.grad_accum)
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (_, (sums0, _)), _ = jax.eval_shape(grad_fn, state.params, state.carry,
                                                jax.tree.map(lambda x: x[0], micro), rng, features,
                                                applied)
            init = (zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums0))

            def body(acc, xs):
                i, mb = xs
                (_, (s, _)), g = grad_fn(state.params, state.carry, mb, jax.random.fold_in(rng, i),
                                         features, applied)
                return jax.tree.map(jnp.add, acc, (g, s)), None

            (grads, sums), _ = jax.lax.scan(body, init, (jnp.arange(t.grad_accum), micro))
            carry = state.carry
        denom = jnp.maximum(sums["weight"], 1.0) * applied
        grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
        # what the optimizer trains: a carry may hold entries out (pruning's masks), so that
        # clipping, Adam's moments and the logged grad_norm are of the weights that train
        opt_grads = carry_lib.gradients(carries, carry, grads)
        updates, opt_state = tx.update(opt_grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params, carry = carry_lib.after_update(carries, carry, params, grads, state.step,
                                               features)
        # `finite` checks the gradients and the *updated* params element by element (a norm
        # can overflow while every value is finite): the loop refuses to checkpoint a state
        # whose update blew up even when this step's loss was still finite.
        all_finite = lambda tree: jnp.all(jnp.asarray(
            [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
        grads_ok = all_finite(grads)
        extra, new = {}, {}
        if scaling:
            # An overflow under scaling is expected, not fatal: skip the update, halve the
            # scale; after `loss_scale_period` clean steps, try double.
            keep = lambda new_tree, old_tree: jax.tree.map(  # noqa: E731
                lambda a, b: jnp.where(grads_ok, a, b), new_tree, old_tree)
            # ... but the learning-rate schedule's count advances with the step, as
            # train.steps does (a bug hunt, session 99: each skipped step delayed the whole
            # schedule, and the logged `lr` was not the rate applied)
            sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
            params = keep(params, state.params)
            opt_state = jax.tree.map(lambda a, b: a if sched(a) else keep(a, b), opt_state,
                                     state.opt_state, is_leaf=sched)
            carry = carry_lib.skipped(carries, carry, state.carry, grads_ok)
            # good_steps counts clean steps since the last skip, or (negative) the skips in a
            # row at the scale's floor, 1, where halving fixes nothing, or at an inf scale,
            # which halving never moves (a review, r10: an init scale past float32's range
            # was inf, every step skipped, `finite` 1, and the run "finished" untrained)
            floor = (scale <= 1.0) | ~jnp.isfinite(scale)
            good = jnp.where(grads_ok, jnp.maximum(state.good_steps, 0) + 1,
                             jnp.where(floor, jnp.minimum(state.good_steps, 0) - 1, 0))
            grow = good >= t.loss_scale_period
            # capped: 2^64 lifts a gradient of 2^-88 into float16 (whose least is 2^-24), far
            # past what training feels, while doubling on (scaled gradients that never
            # overflow) would reach float32's inf, 2^128, and stick there as above
            new = {"loss_scale": jnp.where(grads_ok, jnp.where(grow, jnp.minimum(
                       scale * 2, MAX_LOSS_SCALE), scale), jnp.maximum(scale / 2, 1.0)),
                   "good_steps": jnp.where(grow, 0, good)}
            extra = {"loss_scale": scale, "skipped": 1.0 - grads_ok.astype(jnp.float32)}
            # A skipped step leaves the state as it was: finite. But FLOOR_SKIPS in a row at
            # the floor are no overflow a scale can fix (a NaN from 0 * inf or sqrt at 0, a
            # real blow-up): reported, so the loop stops as in bfloat16 (a review, session
            # 107: every later step was skipped, and the run "finished"); one such spike is
            # skipped as any overflow (a re-read of that fix: it stopped the run at once)
            grads_ok = grads_ok | (good > -FLOOR_SKIPS)
        tokens = sum(jnp.sum(v != 0, dtype=jnp.float32) for k, v in batch.items()
                     if k.startswith("segment_ids"))
        # the norm clipping reads (state.clips: a k-means step injected into clustered
        # attention's centroids is no gradient of the objective)
        metrics = dict(sums, **extra, grad_norm=optax.tree.norm(clipped_part(opt_grads)),
                       param_norm=optax.tree.norm(params),
                       finite=(grads_ok & all_finite(params)).astype(jnp.float32),
                       tokens=tokens, lr=schedule(state.step))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, **new,
                             carry=carry), metrics

    return train_step


def make_eval_step(model, t: TrainConfig, *, memory: bool = False, carries=()):
    """eval_step(state, batch) -> sums, with the `features` draw state.params were trained
    with (`TrainState.features_key`: the last train step's, not the next one's);
    `carries` (hpnlp.train.carry) wrap the evaluation and read their entries of state.carry
    (the classifier's key-value memory answers from the trained memory).

    memory=True (Transformer-XL on a stream): eval_step(state, batch, memory) -> (sums,
    memory), the eval stream's own memory threaded through the pass by the caller."""
    if memory:
        def eval_memory_step(state: TrainState, batch, mem):
            return model.apply({"params": state.params}, batch, mem, method="evaluate_and_memory",
                               rngs={"features": state.features_key(t.feature_redraw_every)})
        return eval_memory_step

    evaluate = carry_lib.evaluation(model, list(carries))  # sums with the task's loss alone

    def eval_step(state: TrainState, batch):
        return evaluate(state.params, state.carry, batch,
                        {"features": state.features_key(t.feature_redraw_every)})
    return eval_step


def finalize(sums: dict, *, lm: bool, output: str | None = None) -> dict:
    """Host-side: sums -> means. `loss` per real token / example; `ppl` for LMs.

    `output`: the LM's output layer (its registry name) where the sums are of its training
    `loss` (train lines): `ppl` only if that loss is -log p (`softmax.trains_nll`; review
    r2: exp of hard_negative's hinge, of NCE's logistic loss, of vmf's NLLvMF was logged as
    a perplexity). None: the sums are the exact NLL (evaluation's)."""
    w = max(float(sums["weight"]), 1.0)
    out = {"loss": float(sums["loss"]) / w}
    if "correct" in sums:
        out["accuracy"] = float(sums["correct"]) / w
    for k in sums:  # other predictions' hits (the memory's and the head's): accuracy_<name>
        if k.startswith("correct_"):
            out["accuracy_" + k[len("correct_"):]] = float(sums[k]) / w
    if lm and output is not None:  # a training loss: exp of it is a perplexity only of -log p
        from hpnlp import softmax
        lm = softmax.trains_nll(output)
    if lm:  # of the model's own loss on the labels: distillation's `loss` mixes in the
        import math  # teacher's soft targets at T^2 (a bug hunt, session 94: ppl 3e6)
        task = float(sums["loss_hard"]) / w if "loss_hard" in sums else out["loss"]
        out["ppl"] = math.exp(min(task, 50.0))
    for k in sums:  # a method's parts of the loss (distillation: loss_hard, loss_soft)
        if k.startswith("loss_") and k != "loss_scale":
            out[k] = float(sums[k]) / w
    for k in ("grad_norm", "param_norm", "lr", "loss_scale"):
        if k in sums:
            out[k] = float(sums[k])
    from hpnlp.moe import summarize  # routing statistics of MoE layers, when there are any
    out.update(summarize(sums))
    return out
