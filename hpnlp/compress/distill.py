"""Knowledge distillation: a student trains against a frozen teacher in the same jitted step.

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/student \\
        --config.model.depth=1 --config.train.distill.teacher=/tmp/hpnlp/lm_bytes

The teacher is any hpnlp run of the same task and vocabulary (its `config.json` and newest
checkpoint). Its parameters are the `teacher` carry of the student's train state
(hpnlp.train.carry): restored once at a fresh start, sharded like the student's by their
logical axis names, never updated, and saved in the student's checkpoints so a resumed run
continues exactly (the teacher's workdir may change meanwhile).

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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hpnlp.config import Config, config_error, validate
from hpnlp.train.carry import Carry


def soft_cross_entropy(logp_teacher, logp_student, temperature: float):
    """Per-row CE(softmax(t / T), softmax(s / T)) * T^2 from two [..., V] log-probabilities
    (or logits: both are shifted by a per-row constant, which the softmax removes)."""
    t = jax.nn.log_softmax(logp_teacher.astype(jnp.float32) / temperature, axis=-1)
    s = jax.nn.log_softmax(logp_student.astype(jnp.float32) / temperature, axis=-1)
    return -jnp.sum(jnp.exp(t) * s, axis=-1) * temperature ** 2


def _output_log_prob(module, hidden):
    return module.output.log_prob(hidden)


def _lm_hidden_and_hard(module, batch):
    """(hard-label sums like TransformerLM.__call__, hidden [B, L, E])."""
    mask_BL = batch["segment_ids"] > 0
    h_BLE = module.hidden(batch)
    loss_BL = module.output.loss(h_BLE, batch["targets"], mask_BL, deterministic=module.deterministic)
    return {"loss": jnp.sum(loss_BL, dtype=jnp.float32),
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


class TeacherCarry(Carry):
    """The `teacher` entry of the train state: the teacher's parameters (module doc)."""

    name = "teacher"

    def __init__(self, cfg: Config, *, token_counts=None):
        from hpnlp import models
        from hpnlp.train.checkpoint import load_run_config

        self.cfg, self.d = cfg, cfg.train.distill
        self.workdir = self.d.teacher
        self.teacher_cfg = tcfg = validate(load_run_config(self.workdir))
        for field, mine, theirs in (("data.task", cfg.data.task, tcfg.data.task),
                                    ("model.kind", cfg.model.kind, tcfg.model.kind),
                                    ("model.vocab_size", cfg.model.vocab_size, tcfg.model.vocab_size),
                                    ("model.num_classes", cfg.model.num_classes,
                                     tcfg.model.num_classes)):
            if mine != theirs:
                raise config_error("train.distill.teacher", self.workdir,
                                   f"the teacher was trained with {field}={theirs!r}, this run has "
                                   f"{mine!r}; distill from a run of the same task and vocabulary")
        if tcfg.model.arch == "transformer_xl":
            raise config_error("train.distill.teacher", self.workdir, "a Transformer-XL teacher "
                               "needs its memory; distill from a model.arch='transformer' run")
        self.teacher = models.build(tcfg, deterministic=True, token_counts=token_counts)

    def init(self, model, params, batch, batch_size: int):
        """The teacher's parameters as its model initializes them: the entry's shapes and
        logical axes (so shardings); `start` restores the trained values into them."""
        del model, params, batch_size
        return self.teacher.init({"params": jax.random.key(0)}, batch)["params"]

    def start(self, value, params):
        """The teacher's trained parameters, restored into `value`'s shapes and shardings."""
        del params
        from hpnlp.train.checkpoint import restore_params
        return restore_params(self.workdir, value)

    def loss(self, student, inner):
        del inner  # the distillation loss contains the student's own hard-label loss
        d, lm = self.d, self.cfg.model.kind == "lm"
        teacher = self.teacher

        def distill_loss(params, carry, batch, rngs):
            tparams = carry["teacher"]
            if lm:
                hard, h_BLE = student.apply({"params": params}, batch, method=_lm_hidden_and_hard,
                                            rngs=rngs)
                t_BLE = jax.lax.stop_gradient(teacher.apply({"params": tparams}, batch,
                                                            method="hidden"))
                mask_BL = batch["segment_ids"] > 0
                chunk = d.chunk_tokens
                if chunk < 0:
                    from hpnlp.softmax.full import auto_chunk_tokens
                    chunk = auto_chunk_tokens(mask_BL.size, 2 * self.cfg.model.vocab_size)
                soft = lm_soft_loss(student, params, teacher, tparams, h_BLE, t_BLE, mask_BL,
                                    temperature=d.temperature, chunk=chunk)
            else:
                from hpnlp.models.heads import _classification_sums
                z_s = student.apply({"params": params}, batch, method=_logits, rngs=rngs)
                z_t = jax.lax.stop_gradient(teacher.apply({"params": tparams}, batch,
                                                          method=_logits))
                hard = _classification_sums(z_s, batch["label"], batch["weight"])
                soft = jnp.sum(soft_cross_entropy(z_t, z_s, d.temperature) * batch["weight"])
            sums = dict(hard, loss=(1.0 - d.alpha) * hard["loss"] + d.alpha * soft,
                        loss_hard=hard["loss"], loss_soft=soft)
            return sums, carry
        return distill_loss
