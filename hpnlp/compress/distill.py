"""Knowledge distillation: a student trains against a frozen teacher in the same jitted step.

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/student \\
        --config.model.depth=1 --config.train.distill.teacher=/tmp/hpnlp/lm_bytes

The teacher is any hpnlp run of the same task and vocabulary (its `config.json` and newest
checkpoint). Its parameters are the `teacher` carry of the student's train state
(hpnlp.train.carry): restored once at a fresh start, sharded like the student's by their
logical axis names, never updated, and saved in the student's checkpoints so a resumed run
continues exactly (the teacher's workdir may change meanwhile); a teacher of random-feature
attention (Performer, LSH) runs under the draw it trained with, held beside them.

The loss per token (LM) or example (classifier, dual encoder), Hinton et al. 2015:

    (1 - alpha) * hard + alpha * T^2 * CE(softmax(z_t / T), softmax(z_s / T))

`hard` is the student's own training objective on the labels (whatever its output layer
trains with); the soft term is the cross-entropy against the teacher's distribution at
temperature T (its gradient is the KL's; T^2 keeps its size comparable across T). Both
models' distributions come from their output layers' exact `log_prob`, so any output layer
distills and is distilled; log_softmax(log_prob / T) is log_softmax(logits / T). For an LM
the soft term runs over chunks of tokens (`train.distill.chunk_tokens`) inside a
`jax.checkpoint`ed `lax.map`, so teacher and student [tokens, V] exist one chunk at a time,
as output `full` chunks its loss. The sums report `loss_hard` and `loss_soft` beside `loss`.

Beside the soft targets (Transformer students; widths may differ: see `hidden` and the
inits):

- `train.distill.hidden` (TinyBERT / MobileBERT): plus `hidden` times the squared error
  between each student block's output and its teacher block's (`layer_map`), mean over
  features and block pairs, per real token (`loss_hidden` in the sums). Block outputs are
  read with flax's `capture_intermediates`, so no model code changes. Where the widths
  differ the student's states go through a learned projection W_h [student width, teacher
  width] (TinyBERT), this carry's trainable entry (hpnlp.train.carry): trained with the
  student, saved in its checkpoints, left out of its size and of anything exported. Under
  `init = "pca"` it is there at every width and starts at P^T, the rotation the student's
  stream was given (s = x P, below), so s W_h is the teacher's state (at the teacher's
  width) or its part on the kept components (narrower), not a random map of it.
- `train.distill.init = "every_other"` (DistilBERT): the student starts as the teacher with
  one block of every Lt / Ls (`init_map`): embeddings, positions, norms and output layer
  copied, so its shapes must be the teacher's but for depth.
- `train.distill.init = "select"` (weight selection, Xu et al. 2024, "Initializing Models
  with Larger Ones"): the same blocks, for a student that is also narrower: each of its
  weights is the leading slice of the teacher's twin along every axis (the first heads,
  the first MLP neurons, the first width channels). The slice is the same along every
  axis that meets the residual stream, so the selected channels are consistent from the
  embedding through every block to the output layer (the paper's consistent selection).
  Model dimensions may be the teacher's or smaller, never larger.
- `train.distill.init = "importance"` (Minitron: Muralidharan et al. 2024, "Compact Language
  Models via Pruning and Knowledge Distillation"): as `select`, but the kept units are the
  teacher's most important ones, not the first, by their activations on the run's first
  `train.distill.importance_batches` training batches (`unit_importance`): a head by the
  norm of its attention output (before the output projection), an MLP neuron by its
  activation (after gelu, the value that weights its output row), a width channel by the
  LayerNorm outputs summed over every norm. Each unit's magnitude is averaged over an
  example's real tokens, then combined over examples by their L2 norm (the paper's best
  aggregation). Kept units stay in the teacher's order; a student of the teacher's width,
  heads and MLP width keeps all of them, so it starts exactly as `every_other` does. An
  MoE block's experts have no neuron scores here: their MLP axes take the leading slice,
  as `select` does. (Scaling the token table by sqrt(teacher width / student width), so
  that the kept channels of the student's first residual stream would be the teacher's,
  lost on the classifier's validation split in a scratch run that is not recorded: 0.60 of
  the gap closed against 0.69 without, in distill_recipes' setting.)
- `train.distill.init = "pca"` (SliceGPT: Ashkboos et al. 2024, "SliceGPT: Compress Large
  Language Models by Deleting Rows and Columns"): importance's heads and MLP neurons, but
  the width by rotation, not selection: the student's residual stream is the teacher's
  mean direction and the leading principal components of its LayerNorm inputs on the same
  batches, every weight that writes the stream projected onto them and every weight that
  reads a norm with the norm's scale and bias folded in (hpnlp.compress.slicing). At the
  teacher's shapes the student computes the teacher's function (but for a tied output
  layer's final norm, a least-squares fit unless it scales every channel alike).
- `train.distill.init_blocks`: which teacher blocks the student's start as (`init_map`):
  `first` (DistilBERT's 0, Lt/Ls, ...) or `last` (Lt/Ls - 1, ..., Lt - 1: ending at the
  block whose output the teacher's final norm and output layer read, TinyBERT's layer map).

- `train.distill.attention` (TinyBERT / MobileBERT): plus `attention` times the KL between
  the teacher's and the student's attention distributions of each mapped block pair, per
  real query, mean over heads (head-averaged maps where the head counts differ;
  `loss_attention`). Variants that return their probabilities (`returns_probabilities`:
  `dense`) sow them when an apply asks for the `attention_probs` collection; any other
  variant, in the teacher or the student, is refused with one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import Config, ConfigError, config_error, validate
from hpnlp.train.carry import (AUX, TRAINABLE_PREFIX, Carry, fold_aux, model_params,
                               trainable_params)


def soft_cross_entropy(logp_teacher, logp_student, temperature: float):
    """Per-row CE(softmax(t / T), softmax(s / T)) * T^2 from two [..., V] log-probabilities
    (or logits: both are shifted by a per-row constant, which the softmax removes)."""
    t = jax.nn.log_softmax(logp_teacher.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(logp_student.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(t) * s, axis=-1) * temperature ** 2


def _output_log_prob(module, hidden):
    return module.output.log_prob(hidden)


def _lm_hidden_and_hard(module, batch):
    """(hard-label sums like the LM's `__call__`, hidden [B, L, E]). A Transformer-XL
    student (pack or pad batches: a fresh memory each batch, as its `__call__`) returns
    (hidden, new memory) from `hidden` (a review, session 107: the tuple reached the output
    layer and the first step's trace failed); its loss masks as `loss_and_memory` does."""
    mask_BL = batch["segment_ids"] > 0
    h_BLE = module.hidden(batch)
    if isinstance(h_BLE, tuple):
        h_BLE = h_BLE[0]
    loss_BL = module.output.loss(h_BLE, batch["targets"], mask_BL,
                                 deterministic=module.deterministic)
    return {"loss": jnp.sum(jnp.where(mask_BL, loss_BL, 0.0), dtype=jnp.float32),
            "weight": jnp.sum(mask_BL, dtype=jnp.float32)}, h_BLE


def _logits(module, batch):
    return module.logits(batch)


def lm_soft_loss(student, params, teacher, teacher_params, h_BLE, t_BLE, mask_BL, *,
                 temperature: float, chunk: int):
    """Summed soft-target loss over real tokens, `chunk` tokens of [tokens, V] at a time."""
    from hpnlp.softmax.base import map_token_chunks

    def one_chunk(h_CE, t_CE):
        logp_s = student.apply({"params": params}, h_CE, method=_output_log_prob)
        logp_t = teacher.apply({"params": teacher_params}, t_CE, method=_output_log_prob)
        return soft_cross_entropy(jax.lax.stop_gradient(logp_t), logp_s, temperature)

    soft_BL = map_token_chunks(one_chunk, mask_BL.shape, chunk, h_BLE, t_BLE)
    return jnp.sum(jnp.where(mask_BL, soft_BL, 0.0))


def layer_map(student_depth: int, teacher_depth: int) -> list[int]:
    """The teacher block each student block's output matches (TinyBERT's uniform mapping:
    student block i of Ls, 0-based, to teacher block (i + 1) Lt / Ls - 1, rounded down)."""
    return [(i + 1) * teacher_depth // student_depth - 1 for i in range(student_depth)]


def init_map(student_depth: int, teacher_depth: int, blocks: str = "first") -> list[int]:
    """The teacher block each student block starts as (`train.distill.init`): one of every
    Lt / Ls, from the first (`blocks="first"`, DistilBERT's: 0, Lt/Ls, ...) or ending at the
    last (`"last"`: Lt/Ls - 1, ..., Lt - 1, `layer_map`'s)."""
    if blocks == "last":
        return layer_map(student_depth, teacher_depth)
    return [i * teacher_depth // student_depth for i in range(student_depth)]


def _is_block(module, method_name: str) -> bool:
    return method_name == "__call__" and (module.name or "").startswith("block_")


def intermediates(module_def, variables, batch, method, *, blocks: bool = False,
                  probs: bool = False, aux: bool = False, **kw):
    """(method's output, {"blocks": [each Transformer block's output], "probs": [each block's
    attention distributions [B, H, L, S]], "aux": what layers reported (MoE routers;
    hpnlp.train.carry.fold_aux)}, in block order) of one apply; what is not asked for is not
    collected (and the apply is the plain one)."""
    if not (blocks or probs or aux):
        return module_def.apply(variables, batch, method=method, **kw), {}
    mutable = ((["intermediates"] if blocks else []) + (["attention_probs"] if probs else [])
               + ([AUX] if aux else []))
    out, state = module_def.apply(variables, batch, method=method, mutable=mutable,
                                  capture_intermediates=_is_block if blocks else False, **kw)

    def collect(tree, leaf_name):
        found = {}

        def walk(t, block):
            for name, sub in t.items():
                if name == leaf_name and block is not None:
                    found[block] = sub[0]
                elif isinstance(sub, Mapping):
                    walk(sub, int(name[len("block_"):]) if name.startswith("block_") else block)
        walk(tree, None)
        return [found[i] for i in sorted(found)]

    got = {"aux": state.get(AUX)} if aux else {}
    if blocks:
        got["blocks"] = collect(state["intermediates"], "__call__")
    if probs:
        got["probs"] = collect(state["attention_probs"], "probs")
    return out, got


IMPORTANCE_MODULES = ("attn", "mlp_in", "norm1", "norm2", "final_norm")


def _importance_capture(module, method_name: str) -> bool:
    return method_name == "__call__" and module.name in IMPORTANCE_MODULES


def unit_importance(module_def, variables, batches, method, *, microbatches: int = 1,
                    rngs=None) -> dict:
    """{"embed": [E], "block_i/heads": [H], "block_i/mlp": [F]}: each unit's
    importance (module doc; squared, so ranking it ranks the L2 norm) summed over `batches`,
    from the activations one apply per batch captures (`method`: the model's trunk output),
    `microbatches` rows at a time as the train step splits them (train.grad_accum).
    Replicated on every device (under a mesh), so every process reads the same ranking.
    `rngs`: the apply's (`TeacherCarry.variables`: a random-feature teacher's trained draw)."""
    def micro(variables, batch):
        _, state = module_def.apply(variables, batch, method=method, mutable=["intermediates"],
                                    capture_intermediates=_importance_capture, rngs=rngs)
        w_BL = token_weights(batch)
        per_token = w_BL / jnp.maximum(w_BL.sum(1, keepdims=True), 1.0)

        def score(a):  # [B, L, U] or [B, L, H, D] (a head's norm) -> sum of squares over B
            a = a.astype(jnp.float32)
            mag = jnp.linalg.norm(a, axis=-1) if a.ndim == 4 else jnp.abs(a)
            real = (w_BL > 0).reshape(w_BL.shape + (1,) * (mag.ndim - 2))
            mag = jnp.where(real, mag, 0.0)  # padding's activations never count, not even NaN
            return jnp.sum(jnp.square(jnp.einsum("bl,bl...->b...", per_token, mag)), axis=0)

        out: dict = {}

        def walk(tree, path):
            for name, sub in tree.items():
                if name != "__call__":
                    walk(sub, path + (name,))
                    continue
                block = next((p for p in reversed(path) if p.startswith("block_")), None)
                kind = path[-1]
                if kind in ("norm1", "norm2", "final_norm"):
                    key = "embed"
                elif kind == "attn" and block and path[-2:] == ("attention", "attn"):
                    key = f"{block}/heads"
                elif kind == "mlp_in" and block and path[-2] == block:
                    key = f"{block}/mlp"
                else:  # another module of the same name (an MoE expert's, a variant's own)
                    continue
                out[key] = out.get(key, 0.0) + score(sub[0])
        walk(state["intermediates"], ())
        return out

    total: dict = {}
    for got in per_batch(micro, variables, batches, microbatches):
        for k, v in got.items():
            total[k] = total[k] + v if k in total else v
    return total


def token_weights(batch):
    """[B, L] float32: 1 on real tokens, 0 on padding (and on padding examples' rows)."""
    w_BL = (batch["segment_ids"] > 0).astype(jnp.float32)
    if batch.get("weight") is not None and batch["weight"].ndim == 1:  # padding examples
        w_BL = w_BL * batch["weight"][:, None].astype(jnp.float32)
    return w_BL


def per_batch(micro, variables, batches, microbatches: int = 1):
    """`micro(variables, batch)` of each of `batches`, jitted, summed over the batch's
    `microbatches` as the train step splits it (train.grad_accum); replicated on every
    device (under a mesh), so every process reads the same values. A generator."""
    def one(variables, batch):
        if microbatches == 1:
            return micro(variables, batch)
        from hpnlp.train.step import _split_microbatches
        parts = jax.lax.map(lambda mb: micro(variables, mb),
                            _split_microbatches(batch, microbatches))
        return jax.tree.map(lambda x: jnp.sum(x, axis=0), parts)

    from jax.sharding import PartitionSpec
    one = jax.jit(one, out_shardings=None if jax.sharding.get_abstract_mesh().empty
                  else PartitionSpec())
    for batch in batches:
        yield one(variables, batch)


def keep_top(score, n: int) -> np.ndarray:
    """The indices of the `n` largest of `score`, in increasing order (ties to the lower)."""
    order = np.argsort(-np.asarray(score, np.float64), kind="stable")
    return np.sort(order[:n])


def attention_loss(student_probs, teacher_probs, query_weight):
    """Summed over real queries (weighted by `query_weight` [B, L]) of the mean over mapped
    block pairs and heads of KL(teacher || student) between each query's distributions over
    the keys (TinyBERT / MobileBERT); where the head counts differ, of the head-averaged
    distributions."""
    pairs = layer_map(len(student_probs), len(teacher_probs))
    total = 0.0
    for s_BHLS, j in zip(student_probs, pairs):
        t_BHLS = jax.lax.stop_gradient(teacher_probs[j]).astype(jnp.float32)
        s_BHLS = s_BHLS.astype(jnp.float32)
        if s_BHLS.shape[1] != t_BHLS.shape[1]:
            s_BHLS, t_BHLS = s_BHLS.mean(1, keepdims=True), t_BHLS.mean(1, keepdims=True)
        log_ratio = jnp.log(jnp.maximum(t_BHLS, 1e-30)) - jnp.log(jnp.maximum(s_BHLS, 1e-30))
        kl_BHL = jnp.sum(jnp.where(t_BHLS > 0, t_BHLS * log_ratio, 0.0), axis=-1)
        total = total + jnp.sum(jnp.mean(kl_BHL, axis=1) * query_weight)
    return total / len(pairs)


def hidden_loss(student_blocks, teacher_blocks, token_weight, proj=None):
    """Summed over real tokens (weighted by `token_weight` [B, L]) of the mean over mapped
    block pairs of the squared error per teacher feature, mean over features; `proj`
    [student width, teacher width] maps the student's states first (widths that differ, or
    a rotated stream: `TeacherCarry.projects`)."""
    pairs = layer_map(len(student_blocks), len(teacher_blocks))
    total = 0.0
    for s_BLE, j in zip(student_blocks, pairs):
        t_BLT = jax.lax.stop_gradient(teacher_blocks[j]).astype(jnp.float32)
        s_BLT = s_BLE.astype(jnp.float32)
        if proj is not None:
            s_BLT = s_BLT @ proj.astype(jnp.float32)
        err_BL = jnp.mean(jnp.square(s_BLT - t_BLT), axis=-1)
        total = total + jnp.sum(err_BL * token_weight)
    return total / len(pairs)


TEACHER_CONFIG = "teacher_config.json"  # in a student's workdir: its teacher's config.json


def trained_features_key(workdir: str, redraw_every: int, *, field: str):
    """The key of the `features` draw the newest checkpoint in `workdir` trained with
    (`TrainState.features_key` of its saved rng and step; `redraw_every`: that run's
    train.feature_redraw_every), read without the rest of its state; `field` names
    `workdir` in an error."""
    import orbax.checkpoint as ocp

    from hpnlp.train.checkpoint import _newest, _quiet_aborted_reads, _unreadable
    from hpnlp.train.state import TrainState
    manager, step = _newest(workdir)
    data = jax.random.key_data(jax.random.key(0))
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # replicated in the run
    item = {"rng": jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=one),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=one)}
    _quiet_aborted_reads()
    try:
        out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True)))["state"]
    except Exception as e:  # noqa: BLE001 (whatever orbax raises: the step cannot be read)
        raise _unreadable(os.path.join(manager.directory, str(step)), e,
                          f"move it aside to read the step before it ({field}={workdir})") from e
    finally:
        manager.close()
    # on the host: restored onto one device, they failed every op under the student's mesh
    # of several (the crash hunt, session 114: a Performer or LSH teacher on mesh.data=2)
    state = TrainState(step=np.asarray(out["step"]), params=None, opt_state=None,
                       rng=np.asarray(out["rng"]))
    return state.features_key(redraw_every)


def checkpoint_pipeline_stages(workdir: str) -> int | None:
    """The pipeline stages the newest checkpoint in `workdir` trained in (its loop item's
    "pipeline_stages"), None where it is not recorded or cannot be read."""
    import orbax.checkpoint as ocp

    from hpnlp.train.checkpoint import _newest, has_checkpoint
    if not has_checkpoint(workdir):  # (a manager made on a missing folder would create it)
        return None
    try:
        manager, step = _newest(workdir)
    except Exception:  # noqa: BLE001 (no checkpoint: nothing recorded)
        return None
    try:
        loop = manager.restore(step, args=ocp.args.Composite(loop=ocp.args.JsonRestore()))["loop"]
    except Exception:  # noqa: BLE001 (an unreadable step: said where its state is read)
        return None
    finally:
        manager.close()
    stages = loop.get("pipeline_stages") if isinstance(loop, dict) else None
    return stages if type(stages) is int and stages > 0 else None


def trained_rngs(cfg: Config, workdir: str, *, field: str) -> dict:
    """A pass's rngs for `cfg`'s model with the parameters of the run in `workdir`:
    {"features": the draw that run trained with} where the model reads that stream
    (hpnlp.retrieval.knnlm.reads_features: without it, a pass falls back to its seed's
    draw, which the parameters never trained with), else {} (its checkpoint is not opened)."""
    from hpnlp.retrieval.knnlm import reads_features
    if not reads_features(cfg):
        return {}
    from hpnlp.train.checkpoint import load_run_config
    redraw = load_run_config(workdir, field=field).train.feature_redraw_every
    return {"features": trained_features_key(workdir, redraw, field=field)}


def counts_shape_output(cfg: Config) -> bool:
    """Whether `cfg`'s LM output layer is laid out by its task's token counts (a Huffman
    tree, frequency classes or ranks, adaptive clusters): one that takes `counts`, but the
    sampled objectives, which read them only to draw negatives and to start their bias."""
    import dataclasses

    from hpnlp import softmax as softmax_lib
    from hpnlp.softmax.sampled import SampledObjective
    if cfg.model.kind != "lm":  # (models.build gives the counts to an LM's output only)
        return False
    cls = softmax_lib.get(cfg.output.name)
    return ("counts" in {f.name for f in dataclasses.fields(cls)}
            and not issubclass(cls, SampledObjective))


def refuse_other_counts(cfg: Config, source: Config, field: str, value, fix: str, *,
                        my_text: str | None = None) -> None:
    """Refuse (naming `field` = `value`) a run `source` whose output layer is laid out by
    its token counts (`counts_shape_output`) and whose training text is not `cfg`'s, so
    that this run, building it from its own task's counts, would lay it out otherwise under
    its trained weights (a bug hunt, session 103: another Huffman tree, unsaid). `my_text`:
    this run's `data.train_text_digest` where its task holds it (else read here)."""
    from hpnlp.data import different_text, train_text_digest
    if not counts_shape_output(source):
        return
    why = different_text(cfg.data, source.data, value,  # (`value`: that run's folder)
                         my_text or train_text_digest(cfg.data))
    if why:
        raise config_error(field, value, f"that run's output layer (output.name="
                           f"{source.output.name!r}) is laid out by the token counts of its "
                           f"training text, and it was trained with {why}, so this run's "
                           f"counts would lay it out otherwise under its weights; {fix}")


def keep_teacher_config(cfg: Config, workdir: str) -> None:
    """Copy the teacher's config.json into the student's `workdir` (TEACHER_CONFIG), where
    it differs, whole or not at all: with the teacher's parameters in the student's
    checkpoints, the run needs nothing more of the teacher's folder."""
    import contextlib
    import tempfile

    from hpnlp.train.checkpoint import has_checkpoint
    src = os.path.join(cfg.train.distill.teacher, "config.json")
    dst = os.path.join(workdir, TEACHER_CONFIG)
    if not os.path.isfile(src):
        return
    with open(src, "rb") as f:
        data = f.read()
    if os.path.isfile(dst):
        with open(dst, "rb") as f:
            if f.read() == data:
                return
        if has_checkpoint(workdir):  # the teacher its checkpoints hold stays described (a
            # bug hunt, session 94: a teacher folder trained anew as another model overwrote
            # the copy, and the student could no longer be resumed or read)
            if jax.process_index() == 0:
                print(f"hpnlp: warning: train.distill.teacher={cfg.train.distill.teacher} now "
                      "holds another config than the teacher whose parameters this run's "
                      f"checkpoints hold ({dst}); the run goes on with the teacher it "
                      "started with", file=sys.stderr, flush=True)
            return
    os.makedirs(workdir, exist_ok=True)
    # each process of a multi-process run its own file (a review, session 115: named by its
    # pid, which another host's process may share, as each container's first process does)
    fd, tmp = tempfile.mkstemp(dir=workdir, prefix=f".{TEACHER_CONFIG}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        from hpnlp import kernels  # mkstemp's 0600: readable as a copy under the umask is
        os.chmod(tmp, kernels.readable_mode(0o644))  # (a review of session 115's change)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class TeacherCarry(Carry):
    """The `teacher` entry of the train state: the teacher's parameters (module doc); for a
    teacher whose attention draws random features from the run's `features` stream
    (hpnlp.retrieval.knnlm.reads_features: Performer, LSH), {"params": them, "features": the
    key data of the draw it trained with}, read from its checkpoint at the start, so that
    every teacher pass runs the function whose loss the teacher's run reported, and a resume
    has it without the teacher's folder (a review, session 107: passes ran its seed's draw).
    Other teachers keep the parameters alone, as runs saved before did; so does a student
    whose newest checkpoint holds such a teacher's parameters alone (saved before the draw
    was kept), whose teacher runs under its seed's draw, the one that student trained with."""

    name = "teacher"

    def __init__(self, cfg: Config, *, token_counts=None, workdir: str | None = None,
                 tokenizer_sha256: str | None = None, text_digest: str | None = None):
        """`tokenizer_sha256`: the student's subword model's, compared with the teacher's;
        `text_digest`: its training text's (`data.task_text_digest`; else read here).
        `workdir`: the student's, whose checkpoints hold the teacher's parameters and
        whose TEACHER_CONFIG copy its config (`keep_teacher_config`): a run that has saved
        a checkpoint resumes, and is read (quantize, sparsify, shrink), with the teacher's
        folder moved or deleted (a bug hunt: each failed, saying to train a teacher there)."""
        from hpnlp import models
        from hpnlp.train.checkpoint import (NoCheckpoint, config_file, has_checkpoint,
                                            is_stacked, load_run_config, run_members)

        self.cfg, self.d = cfg, cfg.train.distill
        self.workdir = self.d.teacher
        copy = os.path.join(workdir, TEACHER_CONFIG) if workdir else ""
        held = copy and os.path.isfile(copy) and has_checkpoint(workdir)
        if held:  # the teacher it holds
            tcfg = config_file(copy)
        else:
            try:
                tcfg = load_run_config(self.workdir, field="train.distill.teacher")
            except NoCheckpoint as e:  # a bug hunt (session 96): a saved run that lost its
                if not (copy and has_checkpoint(workdir)):  # copy blamed the moved teacher
                    raise
                why = (f"no run in {self.workdir}" if not os.path.exists(os.path.join(
                    self.workdir, "config.json")) else str(e))
                raise NoCheckpoint(f"{copy} is missing: the teacher's config, which this run's "
                                   f"checkpoints are read with, and its teacher cannot give it "
                                   f"({why}); restore {copy}, or the teacher's folder") from None
        # It runs in this run's step, on this run's mesh, and reads this run's batches: the
        # layout it trained on is not read, so its config is checked as one device's (a bug
        # hunt, session 95: a teacher trained on 4 devices was refused on 1, its mesh blamed
        # as this run's; review: checked on this run's mesh, it met this run's own rules)
        import dataclasses

        from hpnlp.config import MeshConfig
        # what cannot run on this run's devices (a GPU teacher's cuDNN attention, a fused
        # kernel on several devices) is read by its portable twin, said in one line (a bug
        # hunt, session 100: refused, naming the teacher's file as edited)
        from hpnlp.config.checks import portable_here
        tcfg, notes = portable_here(tcfg, jax.device_count())
        if jax.process_index() == 0:
            for note in notes:
                print(f"hpnlp: train.distill.teacher={self.workdir}: {note}", file=sys.stderr,
                      flush=True)
        trained_stages = tcfg.mesh.pipeline  # (-1: every device there)
        self.teacher_cfg = tcfg = validate(dataclasses.replace(tcfg, mesh=MeshConfig()),
                                           num_devices=1)
        for field, mine, theirs in (("data.task", cfg.data.task, tcfg.data.task),
                                    ("model.kind", cfg.model.kind, tcfg.model.kind),
                                    ("model.vocab_size", cfg.model.vocab_size, tcfg.model.vocab_size),
                                    ("model.num_classes", cfg.model.num_classes,
                                     tcfg.model.num_classes)):
            if mine != theirs:
                raise config_error("train.distill.teacher", self.workdir,
                                   f"the teacher was trained with {field}={theirs!r}, this run has "
                                   f"{mine!r}; distill from a run of the same task and vocabulary")
        from hpnlp.data import different_encoding, saw_eval, saw_validation, train_text_digest
        # this run's tokenizer against the teacher's, at the start; a resume holds the
        # teacher it was checked with, whose folder may since hold another (a bug hunt
        # (session 102): a student's own tokenizer, of an edited data.train_path, was not
        # read, and one of other pieces passed)
        my_text = None if held else text_digest or train_text_digest(cfg.data)  # (read once)
        # (held: not the teacher's folder, which may hold another run now; a review,
        # session 118: its kept tokenizer was read)
        why = different_encoding(cfg.data, tcfg.data, None if held else self.workdir,
                                 None if held else tokenizer_sha256, my_text)
        if why:
            raise config_error("train.distill.teacher", self.workdir, f"the teacher was trained "
                               f"with {why}, so its tokens are not this run's; distill from a run "
                               "of the same task and tokenizer")
        if not held:  # at the start: a run that holds its teacher is read as it trained
            refuse_other_counts(cfg, tcfg, "train.distill.teacher", self.workdir, "distill from "
                                "a teacher trained on this run's text, or with "
                                "output.name='full'", my_text=my_text)
        if tcfg.model.pos_emb == "learned" and tcfg.model.max_len < cfg.data.seq_len:
            raise config_error("train.distill.teacher", self.workdir, f"the teacher's position "
                               f"table (model.max_len={tcfg.model.max_len}) is shorter than this "
                               f"run's data.seq_len={cfg.data.seq_len}; lower data.seq_len to "
                               f"{tcfg.model.max_len} or distill from a teacher of longer inputs")
        if tcfg.data.seq_len != cfg.data.seq_len:  # found in review: a teacher whose own
            # length limits (linformer's or synthesizer's max_len, ...) this run's inputs pass
            # failed inside the first compile, naming the teacher's field as if it were ours
            try:
                validate(dataclasses.replace(tcfg, data=dataclasses.replace(
                    tcfg.data, seq_len=cfg.data.seq_len)), num_devices=1)
            except ConfigError as e:
                raise config_error("train.distill.teacher", self.workdir, f"the teacher cannot "
                                   f"read this run's data.seq_len={cfg.data.seq_len} (its own "
                                   f"run refuses it: {e}); lower data.seq_len to "
                                   f"{tcfg.data.seq_len} or distill from a teacher of longer "
                                   "inputs") from None
        if not held and cfg.data.batching == "pack" and tcfg.model.arch == "transformer":
            # a review (session 115): a teacher whose attention cannot separate the documents
            # of a packed row (it trained on 'pad') read this run's, each document's soft
            # targets and states with the others' context in them
            from hpnlp import attention
            a = attention.get(tcfg.attention.name)
            if not a.supports_segments or a.block_aligned(tcfg.attention.options):
                raise config_error("data.batching", "pack", f"the teacher's attention "
                                   f"{tcfg.attention.name!r} cannot read packed rows as its "
                                   "documents alone, and it would read this run's; use "
                                   "data.batching='pad'")
        recurrent = ("lstm", "gru")  # read a packed row as one stream, the state carried on
        if not held and cfg.data.batching == "pack" and tcfg.model.arch in recurrent and \
                cfg.model.arch not in recurrent:  # a review (session 117), as above
            raise config_error("data.batching", "pack", f"the teacher's model.arch="
                               f"{tcfg.model.arch!r} reads a packed row as one stream (its "
                               "state crosses the documents), so each document's soft targets "
                               "would hold the others' context, which this run's model does "
                               "not see; use data.batching='pad'")
        # found in review: restored into one model's shapes, deep in Orbax; a 1-member
        # ensemble too (review, session 105: the Trainer's mismatch, naming no field); not
        # for a student that holds its teacher, whose folder may hold an ensemble now (a
        # review, session 118)
        members = 1 if held else run_members(self.workdir)
        if is_stacked(members):
            raise config_error("train.distill.teacher", self.workdir, f"holds a seed ensemble "
                               f"of {members} member{'s' if members > 1 else ''} "
                               "(EnsembleTrainer), whose checkpoints stack its parameters "
                               "member by member; distill from a plain run (python -m "
                               "hpnlp.main)")
        if saw_validation(cfg.data, tcfg.data):
            raise config_error("train.distill.teacher", self.workdir, "the teacher may have "
                               "trained on the examples this run holds out for data.eval_split="
                               "'validation'; train the teacher with data.eval_split='validation' "
                               "too (and, for ListOps, the same generator settings)")
        # generated ListOps (review r2); at the start, as init_from's twin: a student saved
        # before the rule is resumed and read as it trained (a review, d1: refused, its fix,
        # another listops_num_train, one its checkpoints' data state refuses)
        if not held and saw_eval(cfg.data, tcfg.data):
            n, theirs = cfg.data.listops_num_train, tcfg.data.listops_num_train
            raise config_error("train.distill.teacher", self.workdir, "the teacher trained on "
                               "the generated ListOps examples this run evaluates on (the same "
                               f"data.seed and generator fields, data.listops_num_train={theirs}, "
                               f"this run's {n}); distill from a teacher of data.listops_num_train"
                               f" <= {n} or of another data.seed, or set this run's "
                               f"data.listops_num_train={theirs}")
        if tcfg.model.arch == "transformer_xl":
            raise config_error("train.distill.teacher", self.workdir, "a Transformer-XL teacher "
                               "needs its memory; distill from a model.arch='transformer' run")
        sm, tm = cfg.model, tcfg.model
        # Its stacked blocks run in this run's step, so under this run's pipeline stages
        # (parallel.pipeline.stacked_blocks), which must split its depth as they split the
        # student's (review r4: the first step's trace failed, naming model.depth as ours)
        from hpnlp.train.loop import reader_device_count
        stages = cfg.mesh.axis_sizes(reader_device_count(cfg))["pipeline"]
        if stages > 1 and tm.stack_layers and tm.depth % stages:
            raise config_error("train.distill.teacher", self.workdir, f"the teacher's "
                               f"{tm.depth} stacked layers (its model.depth) run in this run's "
                               f"mesh.pipeline={stages} stages, which do not split them; "
                               f"distill from a teacher whose model.depth {stages} divides (or "
                               "one of model.stack_layers=False), or set mesh.pipeline to one "
                               f"that divides both {sm.depth} and {tm.depth}")
        moe = tm.moe
        if stages > 1 and tm.stack_layers and moe.enabled() and (
                moe.dispatch == "capacity" or moe.router == "expert_choice"):
            # a review (session 117): in pipeline stages each microbatch is routed alone, so
            # its capacity binds over other tokens than the teacher's own evaluation
            raise config_error("train.distill.teacher", self.workdir, "the teacher's MoE "
                               "layers route by capacity, which this run's "
                               f"mesh.pipeline={stages} stages would bind over each "
                               "microbatch alone, another function than the teacher's; set "
                               "mesh.pipeline=1, or distill from a teacher of "
                               "model.stack_layers=False or dropless token choice")
        from hpnlp.attention import draws_features
        from hpnlp.attention import get as attention_class
        per_layer = tm.stack_layers and draws_features(tcfg.attention.name,
                                                       tcfg.attention.options)
        if not held and per_layer:
            # the stages its checkpoint trained in, else its config's count (-1 took every
            # device there: how many, the config does not say); at the start only: a resume
            # holds the teacher it started with, whose folder may since hold another run
            trained_stages = checkpoint_pipeline_stages(self.workdir) or trained_stages
        if per_layer and isinstance(trained_stages, int) and trained_stages > 0 \
                and (stages > 1) != (trained_stages > 1):
            one_draw = (", or distill from a teacher of attention.options.redraw=False"
                        if hasattr(attention_class(tcfg.attention.name), "redraw") else "")
            # a review (session 116): pipeline stages key the `features` stream per layer
            # otherwise than one stage does (parallel/pipeline.py), so the teacher's soft
            # targets came from other projections or rotations than it trained with
            raise config_error("train.distill.teacher", self.workdir, f"the teacher's "
                               f"attention.name={tcfg.attention.name!r} draws random features "
                               f"per layer, which it drew in mesh.pipeline={trained_stages} and "
                               f"this run's {stages} stage{'s' * (stages > 1)} would draw "
                               "otherwise; set mesh.pipeline" + (" > 1" if stages == 1 else
                                                                 "=1") + " as the teacher "
                               f"trained{one_draw}")
        self._check_ring_teacher(cfg, tcfg)
        if self.d.attention:
            from hpnlp import attention as attention_lib
            if not attention_lib.get(tcfg.attention.name).returns_probabilities:
                raise config_error("train.distill.attention", self.d.attention, f"the teacher's "
                                   f"attention variant {tcfg.attention.name!r} does not return its "
                                   "probabilities; distill attention maps from a 'dense' teacher")
            if sm.causal and not tm.causal:  # the student's maps are 0 past each query, where
                # the teacher's weigh every key: a KL no causal student can lower
                raise config_error("train.distill.attention", self.d.attention, "the student "
                                   "attends causally (model.causal) but the teacher reads both "
                                   "ways, so its maps weigh keys the student cannot see; "
                                   "distill attention from a model.causal=true teacher or set "
                                   "model.causal=false")
        blocks = self.d.matches_blocks()
        if blocks:
            if tm.arch != "transformer" or tm.stack_layers or tm.reversible or sm.stack_layers \
                    or sm.reversible:
                d = self.d  # every field that matches blocks, so one fix is enough (review)
                off = ", ".join(f"train.distill.{f}={v}" for f, v, on in (
                    ("hidden", 0, d.hidden), ("attention", 0, d.attention),
                    ("init", "'none'", d.init != "none")) if on)
                raise config_error(*blocks, "matches the blocks of plain Transformers "
                                   "(model.stack_layers and model.reversible off, in the teacher "
                                   f"and the student); set {off} (soft targets need no block "
                                   "match), or distill between plain Transformers")
            if sm.depth > tm.depth:
                raise config_error(*blocks, f"the student (model.depth={sm.depth}) is deeper "
                                   f"than the teacher ({tm.depth})")
        if self.d.init != "none":
            def shapes(m):
                return {"width": m.width, "num_heads": m.num_heads, "head_dim": m.dims_per_head(),
                        "num_kv_heads": m.kv_heads(), "mlp_dim": m.mlp_dim, "max_len": m.max_len,
                        "kv_latent_dim": m.kv_latent_dim,
                        "kv_latent_rope_dim": m.latent_rope_dims()}
            mine, theirs = shapes(sm), shapes(tm)
            select = self.d.init in ("select", "importance", "pca")
            if bool(sm.moe.num_experts) != bool(tm.moe.num_experts):  # a bug hunt
                # (session 94): "the student's ... has no teacher twin (None)"
                def mlp(m):
                    return (f"a mixture of {m.moe.num_experts} experts every {m.moe.every} "
                            "block(s)" if m.moe.num_experts else "dense")
                raise config_error("train.distill.init", self.d.init, f"copies the teacher's "
                                   f"MLPs, and the teacher's are {mlp(tm)} where the student's "
                                   f"are {mlp(sm)}; give the student the teacher's model.moe "
                                   "num_experts and every, or use init='none'")
            if sm.moe.num_experts:
                self._check_moe_blocks_map(sm, tm)
            if self.d.init == "pca":
                from hpnlp.compress import slicing
                slicing.check(cfg, tcfg)
            if select and (sm.kv_latent_dim or tm.kv_latent_dim):
                raise config_error("train.distill.init", self.d.init, "keeps leading slices of "
                                   "heads and dims, but model.kv_latent_dim derives every head's "
                                   "keys and values from one layer-normed latent (here or in the "
                                   "teacher), which no slice of it reproduces; use "
                                   "init='every_other' with the teacher's widths, or 'none'")
            grouped = sm.kv_heads() < sm.num_heads or tm.kv_heads() < tm.num_heads
            if grouped and self.d.init in ("importance", "pca"):
                raise config_error("train.distill.init", self.d.init, "ranks heads one by one, "
                                   "but model.num_kv_heads shares key/value heads among them "
                                   "(here or in the teacher); use init='select'")
            if grouped and select and (sm.num_heads * tm.kv_heads()
                                       != tm.num_heads * sm.kv_heads()):
                raise config_error("train.distill.init", self.d.init, "keeps the leading heads "
                                   "with their key/value heads, so the student's query heads per "
                                   f"key/value head ({sm.num_heads}/{sm.kv_heads()}) must be the "
                                   f"teacher's ({tm.num_heads}/{tm.kv_heads()})")
            if select and sm.pos_emb == "rope" and mine["head_dim"] != theirs["head_dim"]:
                raise config_error("train.distill.init", self.d.init, "keeps the leading dims of "
                                   "each teacher head, but RoPE pairs dim r with r + D/2 at a "
                                   "frequency set by D, so they are no smaller rotary head; keep "
                                   f"model.head_dim the teacher's ({theirs['head_dim']}) and drop "
                                   "heads instead")
            for f in mine:
                if mine[f] > theirs[f] if select else mine[f] != theirs[f]:
                    raise config_error("train.distill.init", self.d.init, f"copies the teacher's "
                                       f"blocks, so model.{f} must be "
                                       f"{'at most ' if select else ''}the teacher's "
                                       f"({theirs[f]!r}); this run has {mine[f]!r}")
            for f, mine, theirs in (("model.pos_emb", sm.pos_emb, tm.pos_emb),
                                    ("output.name", cfg.output.name, tcfg.output.name),
                                    ("output.tie_embeddings", cfg.output.tie_embeddings,
                                     tcfg.output.tie_embeddings)):
                if mine != theirs:
                    raise config_error("train.distill.init", self.d.init, f"copies the teacher's "
                                       f"embeddings and output layer, so {f} must be the "
                                       f"teacher's ({theirs!r}); this run has {mine!r}")
        self.teacher = models.build(tcfg, deterministic=True, token_counts=token_counts)
        self._token_counts = token_counts
        from hpnlp.retrieval.knnlm import reads_features
        self.draws = reads_features(tcfg) and not self._saved_without_draw(workdir)
        # whether the hidden-state loss reads the student's states through `hidden_proj`:
        # where the widths differ, and under init='pca' at any width, whose stream is the
        # teacher's rotated (a review, r8: unprojected at the teacher's width, the loss of a
        # student that computes the teacher was large and pushed it to undo the rotation)
        self.projects = bool(self.d.hidden) and (sm.width != tm.width or
                                                 self._projects_at_width(workdir))

    def _check_ring_teacher(self, cfg: Config, tcfg: Config) -> None:
        """A ring-attention teacher runs its ring over this run's mesh and batches, so its
        `block` must divide each device's share of this run's lengths (a review, session
        116: a teacher of block=64 under this run's mesh.sequence=4 at seq_len=128 failed at
        the first trace, naming attention.options.block, which is this run's and fine)."""
        if tcfg.attention.name != "ring":
            return
        from hpnlp.train.loop import reader_device_count
        axis = tcfg.attention.options.get("axis", "sequence")
        n = cfg.mesh.axis_sizes(reader_device_count(cfg)).get(axis, 1)
        block = tcfg.attention.options.get("block")
        if n <= 1 or not isinstance(block, int):
            return
        from hpnlp.data.batching import bucket_boundaries
        widths = bucket_boundaries(cfg.data) if cfg.data.batching == "bucket" else [
            cfg.data.seq_len]
        odd = [w for w in widths if (w // n) % block]
        if odd:
            raise config_error("train.distill.teacher", self.workdir, f"the teacher's ring "
                               f"attention (attention.options.block={block}) runs over this "
                               f"run's mesh.{axis}={n} devices, whose shares of the lengths "
                               f"{odd} ({', '.join(str(w // n) for w in odd)} positions) it "
                               f"does not divide; set mesh.{axis} so that each share is a "
                               f"multiple of {block}, or distill from a teacher of another block")

    def _check_moe_blocks_map(self, sm, tm) -> None:
        """Every student block starts as its teacher block (`init_map`): an MoE block must
        come from an MoE block and a dense one from a dense one (review r10, session 108:
        comparing model.moe.every passed a depth-2 student of a depth-4 teacher, every=2,
        whose blocks map onto the teacher's of the other kind, and the start failed late,
        "has no teacher twin (None)"); a different `every` that maps kind to kind is taken."""
        def kinds(blocks):
            src = init_map(sm.depth, tm.depth, blocks)
            return [(i, src[i]) for i in range(sm.depth)
                    if sm.moe.applies(i) != tm.moe.applies(src[i])]
        bad = kinds(self.d.init_blocks)
        if not bad:
            return
        i, j = bad[0]
        kind = lambda moe: "MoE" if moe else "dense"  # noqa: E731
        other = "last" if self.d.init_blocks == "first" else "first"
        fixes = ([f"train.distill.init_blocks={other!r} (which maps MoE onto MoE)"]
                 if not kinds(other) else [])
        # the teacher is trained: only the student's fields are the user's to change (a
        # review, d1: "model.moe.every=1 in both" was offered beside a teacher of every=2)
        moe_blocks = [j for j in range(tm.depth) if tm.moe.applies(j)]
        fixes += [f"a student model.depth or model.moe.every whose MoE blocks start as the "
                  f"teacher's MoE blocks {moe_blocks} and whose dense ones as its others"
                  if moe_blocks else "a dense student (model.moe.num_experts=0: the teacher "
                  "has no MoE block)", "init='none'"]
        raise config_error("train.distill.init", self.d.init, f"copies the teacher's blocks "
                           f"{init_map(sm.depth, tm.depth, self.d.init_blocks)} into the "
                           f"student's (train.distill.init_blocks={self.d.init_blocks!r}), and "
                           f"student block {i} is {kind(sm.moe.applies(i))} where teacher block "
                           f"{j} is {kind(tm.moe.applies(j))} (model.moe.every={sm.moe.every}, "
                           f"the teacher's {tm.moe.every}); use " + ", or ".join(fixes))

    def _saved_without_draw(self, workdir: str | None) -> bool:
        """Whether the student's newest checkpoint in `workdir` holds the teacher's
        parameters without the draw (read from its metadata): saved before the carry kept it,
        so it resumes, and is read, in that layout, under the seed's draw it trained with (a
        review, session 107: its restore was refused as another layout, naming no fix)."""
        if not workdir:
            return False
        from hpnlp.train.checkpoint import saved_state_tree
        saved = (saved_state_tree(workdir) or {}).get("carry")
        held = saved.get(self.name) if isinstance(saved, dict) else None
        if not isinstance(held, dict) or set(held) == {"params", "features"}:
            return False
        if jax.process_index() == 0:
            print(f"hpnlp: train.distill.teacher={self.workdir}: the checkpoints in {workdir} "
                  "hold the teacher without the random-feature draw it trained with (saved by "
                  "an older hpnlp), so its passes keep its seed's draw, as this run's steps "
                  "did; a new --workdir distills under its trained draw", file=sys.stderr,
                  flush=True)
        return True

    def _projects_at_width(self, workdir: str | None) -> bool:
        """Whether a student of the teacher's width reads its states through a projection:
        as its newest checkpoint in `workdir` holds them (train.distill.init is read only
        when a run starts, so a resume may leave it out or change it: a review, session 117,
        found a pca student resumed without the flag refused as "another version"), else
        under init='pca'. A pca student saved with none (by an older hpnlp) resumes, and is
        read, in that layout: its states matched unprojected, as its steps matched them."""
        saved = None
        if workdir:
            from hpnlp.train.checkpoint import saved_state_tree
            saved = (saved_state_tree(workdir) or {}).get("params")
        if not isinstance(saved, dict):
            return self.d.init == "pca"
        projects = TRAINABLE_PREFIX + self.name in saved
        if self.d.init == "pca" and not projects and jax.process_index() == 0:
            print(f"hpnlp: train.distill.init='pca': the checkpoints in {workdir} hold no "
                  "hidden-state projection (saved by an older hpnlp, or started with another "
                  "train.distill.init), so it resumes in that layout: the student's states "
                  "are matched with the teacher's unprojected, as its steps matched them; a "
                  "new --workdir matches a rotated student's through the rotation",
                  file=sys.stderr, flush=True)
        return projects

    def variables(self, value):
        """(the teacher's parameters, the rngs of its passes) of the carry's `value`."""
        if not self.draws:
            return value, {}
        return value["params"], {"features": jax.random.wrap_key_data(value["features"])}

    def init(self, model, params, batch, batch_size: int):
        """Zeros in the teacher's parameters' shapes and logical axes (so shardings), as its
        model initializes them; `start` restores the trained values into them. Zeros, not a
        random draw that `start` overwrites: the draw cost the init program a compile."""
        del model, params, batch_size

        def draw(batch):
            value = self.teacher.init({"params": jax.random.key(0)}, batch)["params"]
            if self.teacher_cfg.model.lowrank.enabled():  # a factorized teacher's factors
                from hpnlp.compress import lowrank
                value = lowrank.init_transform(self.teacher_cfg, self.teacher, batch)(value)
            return value
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(draw, batch))
        if not self.draws:
            return zeros
        return {"params": zeros, "features": jnp.zeros_like(jax.random.key_data(
            jax.random.key(0)))}

    def start(self, value, params):
        """The teacher's trained parameters, restored into `value`'s shapes and shardings
        (and the key data of the random-feature draw they trained with: `variables`)."""
        del params
        from hpnlp.train.checkpoint import restore_params
        field = "train.distill.teacher"
        if not self.draws:
            return restore_params(self.workdir, value, field=field)
        key = trained_features_key(self.workdir, self.teacher_cfg.train.feature_redraw_every,
                                   field=field)
        return {"params": restore_params(self.workdir, value["params"], field=field),
                "features": jax.random.key_data(key)}

    def trainable(self, model, params, batch, key):
        """The hidden-state projection [student width, teacher width] (TinyBERT's W_h, one for
        every block pair), trained with the student, when the widths differ or the stream is
        rotated (`projects`): a random start here, which `start_params` replaces with P^T
        under init='pca' (a resumed run reads its trained one from its checkpoint)."""
        del model, params, batch
        if not self.projects:
            return None
        e_s, e_t = self.cfg.model.width, self.teacher_cfg.model.width
        return {"hidden_proj": jax.random.normal(key, (e_s, e_t), jnp.float32) * e_s ** -0.5}

    def start_params(self, value, params, batches):
        """`train.distill.init`: the student's parameters as the teacher's, block i from
        teacher block `init_map(...)[i]` (DistilBERT), each the leading slice of its twin
        where the student is narrower (`select`), or its slice of the teacher's most
        important units (`importance`, on `batches(importance_batches)`), or rotated into
        the leading components of its stream (`pca`). The carries' trainable entries (the
        hidden-state projection) have no teacher twin and keep their own start, but under
        `pca`, where the projection starts at P^T: the student's states s = x P mapped back
        to the teacher's basis, x P P^T (x itself at the teacher's width)."""
        if self.d.init == "none":
            return params
        import flax.traverse_util as traverse
        src = init_map(self.cfg.model.depth, self.teacher_cfg.model.depth, self.d.init_blocks)
        from hpnlp.compress import lowrank
        value, rngs = self.variables(value)
        teacher = {k: t.dense() if lowrank.is_factored(t) else t  # a factorized teacher's U V
                   for k, t in traverse.flatten_dict(value).items()}
        select = self.d.init in ("select", "importance", "pca")
        kept, scores, names = {}, {}, {}  # kept: (unit key, count) -> indices, made once
        if self.d.init in ("importance", "pca"):
            data = batches(self.d.importance_batches)
            method = "hidden" if self.cfg.model.kind == "lm" else "pooled"
            scores = {k: np.asarray(v) for k, v in unit_importance(
                self.teacher, {"params": value}, data, method, rngs=rngs,
                microbatches=self.cfg.train.grad_accum).items()}  # on the host, fetched once
            bad = sorted(k for k, v in scores.items() if not np.all(np.isfinite(v)))
            if bad:
                raise config_error("train.distill.init", self.d.init, f"the teacher's "
                                   f"activations are not finite on the first training batches "
                                   f"({', '.join(bad)}), so they rank nothing; check the "
                                   "teacher's run, or use init='select'")
            boxed = jax.eval_shape(lambda b: self.teacher.init({"params": jax.random.key(0)},
                                                               b)["params"], data[0])
            names = {p: tuple(getattr(b, "names", ()) or ())
                     for p, b in traverse.flatten_dict(boxed).items()}
        if self.d.init == "pca":  # the width by rotation (hpnlp.compress.slicing), not a cut
            import dataclasses

            from hpnlp import models
            from hpnlp.compress import slicing
            tcfg = self.teacher_cfg  # the same parameters without remat, whose own trace
            # would hold what the covariance pass grabs (`stream_covariance`)
            plain = models.build(dataclasses.replace(tcfg, model=dataclasses.replace(
                tcfg.model, remat="none")), deterministic=True, token_counts=self._token_counts)
            basis = slicing.stream_basis(slicing.stream_covariance(
                plain, {"params": value}, data, method, rngs=rngs,
                microbatches=self.cfg.train.grad_accum), self.cfg.model.width)
            # the teacher's weights whole on the host, which the rotation reads: on a mesh
            # across processes (mesh.fsdp) each holds a part (a review, session 115: "spans
            # non-addressable devices" in every process)
            from jax.experimental import multihost_utils
            teacher = {k: np.asarray(t if t.is_fully_addressable or t.is_fully_replicated
                                     else multihost_utils.process_allgather(t, tiled=True))
                       for k, t in teacher.items()}
        out, cut = traverse.flatten_dict(trainable_params(params)), {}
        student = traverse.flatten_dict(model_params(params))
        for path, w in student.items():
            tpath = tuple(f"block_{src[int(p[len('block_'):])]}" if p.startswith("block_") else p
                          for p in path)
            t = teacher.get(tpath)
            fits = t is not None and (t.shape == w.shape or select and len(t.shape) == len(
                w.shape) and all(a <= b for a, b in zip(w.shape, t.shape)))
            if not fits:
                raise config_error("train.distill.init", self.d.init, f"the student's "
                                   f"{'/'.join(path)} {w.shape} has no teacher twin of "
                                   f"{'a shape that contains it' if select else 'its shape'} "
                                   f"({None if t is None else t.shape})")
            block = next((p for p in tpath if p.startswith("block_")), None)
            for axis, n in enumerate(w.shape):
                name = names[tpath][axis] if names.get(tpath) else None
                key = "embed" if name == "embed" else f"{block}/{name}"
                if key == "embed" and self.d.init == "pca":
                    continue  # whole: `slicing.rotate` maps it below
                if n == t.shape[axis] or key not in scores:  # all of it, or the leading slice
                    t = jax.lax.slice_in_dim(t, 0, n, axis=axis)
                    continue
                if (key, n) not in kept:
                    kept[key, n] = keep_top(scores[key], n)
                t = jnp.take(t, jnp.asarray(kept[key, n]), axis=axis)
            cut[path] = tpath, t
        if self.d.init == "pca":
            try:
                rotated = slicing.rotate(cut, teacher, basis,
                                         tied=self.cfg.output.tie_embeddings)
            except ValueError as e:
                raise config_error("train.distill.init", self.d.init, f"rotates a plain "
                                   f"Transformer's residual stream and does not know the "
                                   f"teacher's weight {e}; use init='importance'") from None
            cut = {path: (tpath, rotated[path]) for path, (tpath, _) in cut.items()}
            if self.projects:
                out[TRAINABLE_PREFIX + self.name, "hidden_proj"] = jnp.asarray(basis.T,
                                                                               jnp.float32)
        for path, (tpath, t) in cut.items():
            w = student[path]
            if lowrank.is_factored(w):  # a factorized student: its rank's SVD of the copy
                f = lowrank.svd_factors(t, w.u.ndim - 1 - w.lead, w.rank, w.lead)
                out[path] = w.replace(u=f.u.astype(w.u.dtype), v=f.v.astype(w.v.dtype))
            else:
                out[path] = jnp.array(t, dtype=w.dtype, copy=True)
        return traverse.unflatten_dict(out)

    def loss(self, student, inner):
        d, lm = self.d, self.cfg.model.kind == "lm"
        if not (d.alpha or d.hidden or d.attention):  # the teacher only starts the student
            return inner  # (train.distill.init): its own loss, no teacher forward
        del inner  # the distillation loss contains the student's own hard-label loss
        teacher = self.teacher

        def distill_loss(params, carry, batch, rngs):
            tparams, trngs = self.variables(carry["teacher"])
            own = params.get(TRAINABLE_PREFIX + self.name) or {}
            want = dict(blocks=bool(d.hidden), probs=bool(d.attention))
            token_weight = None  # what the hidden and attention losses weigh tokens by
            if lm:
                (hard, h_BLE), s_int = intermediates(student, {"params": params}, batch,
                                                     _lm_hidden_and_hard, rngs=rngs, aux=True,
                                                     **want)
                t_BLE, t_int = intermediates(teacher, {"params": tparams}, batch, "hidden",
                                             rngs=trngs, **want)
                t_BLE = jax.lax.stop_gradient(t_BLE)
                mask_BL = batch["segment_ids"] > 0
                chunk = d.chunk_tokens
                if chunk < 0:
                    from hpnlp.softmax.full import auto_chunk_tokens
                    chunk = auto_chunk_tokens(mask_BL.size, 2 * self.cfg.model.vocab_size)
                soft = lm_soft_loss(student, params, teacher, tparams, h_BLE, t_BLE, mask_BL,
                                    temperature=d.temperature, chunk=chunk)
                token_weight = mask_BL.astype(jnp.float32)
            else:
                from hpnlp.models.heads import _classification_sums
                z_s, s_int = intermediates(student, {"params": params}, batch, _logits,
                                           rngs=rngs, aux=True, **want)
                z_t, t_int = intermediates(teacher, {"params": tparams}, batch, _logits,
                                           rngs=trngs, **want)
                z_t = jax.lax.stop_gradient(z_t)
                hard = _classification_sums(z_s, batch["label"], batch["weight"])
                soft = jnp.sum(soft_cross_entropy(z_t, z_s, d.temperature) * batch["weight"])
                if d.hidden or d.attention:  # a classifier's (validate refuses a dual
                    # encoder's: its batches hold two texts, segment_ids1 and segment_ids2)
                    real_BL = (batch["segment_ids"] > 0).astype(jnp.float32)
                    token_weight = batch["weight"][:, None] * real_BL / jnp.maximum(
                        real_BL.sum(1, keepdims=True), 1.0)  # each example's tokens weigh 1
            total = (1.0 - d.alpha) * hard["loss"] + d.alpha * soft
            extra = {}
            if d.hidden:
                extra["loss_hidden"] = hidden_loss(s_int["blocks"], t_int["blocks"], token_weight,
                                                   own.get("hidden_proj"))
                total = total + d.hidden * extra["loss_hidden"]
            if d.attention:
                extra["loss_attention"] = attention_loss(s_int["probs"], t_int["probs"],
                                                         token_weight)
                total = total + d.attention * extra["loss_attention"]
            sums = dict(hard, loss=total, loss_hard=hard["loss"], loss_soft=soft, **extra)
            return fold_aux(sums, s_int["aux"]), carry  # an MoE student's router losses
        return distill_loss
