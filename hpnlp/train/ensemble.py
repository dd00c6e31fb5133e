"""Ensembles: seeds trained together in one step, checkpoint ensembles, weight averaging.

Three ways to combine several sets of weights, all evaluated the same way (each member,
the members' mean, and the ensemble):

* **Seed ensemble** (`EnsembleTrainer`; Lakshminarayanan et al. 2017, "Simple and Scalable
  Predictive Uncertainty Estimation using Deep Ensembles"). M members with their own init
  and dropout streams train in one jitted step on a TrainState whose params, optimizer state
  and RNG carry a leading member axis; every member sees the same batches. The step runs
  the plain train step over the member axis (`member_loop`, `--member_loop`): batched by
  `jax.vmap`, M small models as one batched model, or one member after another by a
  `fori_loop` that updates each member's slice in place, the same results up to float
  rounding (bit-identical in the CPU runs below) and the same checkpoints. Batching was
  meant to make it cheap; on CPU it did not (a bug hunt, session 102): `python
  tools/ensemble_speed.py --rounds 5 --members 2 3` (2-core AMD EPYC Zen 4, jax 0.10.2, a
  machine loaded by other work) timed the loop 1.76x (2 members) and 1.81x (3) as fast as
  vmap for the RNN LM (rnn_lm.py:local) and 0.92x and 1.04x, even, for the Transformer LM
  (lm.py:bytes,local), to the same parameters; a step cost about M plain steps or more
  either way. So "map" is the default on CPU; accelerators keep "vmap" (one batched model
  to fill a large device; not measured there). Member i is *exactly* the plain run with
  `seed = cfg.seed + i` (same init key, same dropout key, same data): member 0 of any
  ensemble is the plain run of `cfg.seed`. Seeds therefore overlap between ensembles of
  neighbouring `cfg.seed`s; space them by >= M for disjoint ensembles.
* **Checkpoint ensemble** (`checkpoint_ensemble`; Huang et al. 2017, "Snapshot Ensembles"):
  the last K checkpoints of one plain run, each evaluated, and their predictions averaged.
* **Weight averaging** (`weight_average`; Vaswani et al. 2017 average the last checkpoints'
  weights; Polyak & Juditsky 1992): one model whose params are the uniform mean of the
  last K checkpoints' params - the cost of one model at eval time.

The ensemble predicts the mean of the members' probabilities, log p = logsumexp_m(log p_m)
- log M. Its NLL is never above the members' mean NLL (Jensen: -log is convex); its
accuracy can be either side. The eval step runs members one after another under
`lax.scan`, keeping a running `logaddexp`, so no [*, V] array grows with M; an LM's also
walks token chunks as its plain evaluation does (`make_ensemble_eval_step`), so a chunk's
[C, V], not the batch's [B, L, V], is what it holds (beside every member's hidden states,
[M, B, L, E]).

    python -m hpnlp.train.ensemble --config experiments/lm.py:bytes,local \\
        --workdir /tmp/hpnlp/ens --members 3            # train a 3-seed ensemble
    python -m hpnlp.train.ensemble --config experiments/lm.py:bytes,local \\
        --workdir /tmp/hpnlp/lm_smoke --from_checkpoints 2   # combine an existing plain run

Both print a table and write `ensemble.json` in the workdir.

Shape letters: M members (or checkpoints); P prediction sites, [B, L] tokens for the LM
or [B] examples for classifiers (one or two axes); O outcomes (V vocabulary or C classes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hpnlp import models
from hpnlp.config import Config, ConfigError, TrainConfig, from_configdict
from hpnlp.config.fields import DATA_PATH_FIELDS, config_flag, same_data_path
from hpnlp.models import transformer_xl as xl
from hpnlp.paths import write_json
from hpnlp.softmax.base import log_prob_nll_and_argmax, map_token_chunks
from hpnlp.softmax.full import auto_chunk_tokens
from hpnlp.train.checkpoint import (CheckpointMismatch, CheckpointSaveFailed, NoCheckpoint,
                                    StackedMembers, is_stacked, load_run_config, run_members,
                                    write_failed)
from hpnlp.train.loop import Trainer, remove_if_empty
from hpnlp.train.state import TrainState
from hpnlp.train.step import finalize, make_train_step, step_compiler_options

MEMBERS_FILE = "members.json"  # in an ensemble's workdir: {"members": M, "seeds": [...]}
# How a seed ensemble's train step runs its members: batched by `jax.vmap`, or one after
# another in a loop (`default_member_loop`). Same results up to rounding, same state layout.
MEMBER_LOOPS = ("vmap", "map")


class NotEnoughCheckpoints(ValueError):
    """A checkpoint ensemble asked for more checkpoints than the run kept."""


# ---------------------------------------------------------------------------------------
# Evaluation of stacked members


def _targets(kind: str, batch) -> tuple[jax.Array, jax.Array]:
    """(target_P, weight_P) of a batch: next tokens and real-token mask, or label and weight."""
    if kind == "lm":
        return batch["targets"], (batch["segment_ids"] > 0).astype(jnp.float32)
    return batch["label"], batch["weight"].astype(jnp.float32)


def _sums_of(nll_P, pred_P, target_P, weight_P) -> dict:
    """Summed NLL, correct predictions and weight: the keys `finalize` reads."""
    correct_P = (pred_P == target_P).astype(jnp.float32)
    real_P = weight_P > 0
    return {"loss": jnp.sum(jnp.where(real_P, nll_P * weight_P, 0.0)),
            "correct": jnp.sum(jnp.where(real_P, correct_P * weight_P, 0.0)),
            "weight": jnp.sum(weight_P)}


def _sums(logp_PO, target_P, weight_P) -> dict:
    """`_sums_of` each site's NLL and argmax under log-probabilities [*P, O]."""
    return _sums_of(*log_prob_nll_and_argmax(logp_PO, target_P), target_P, weight_P)


def _hidden(module, batch):
    """An LM's final hidden states [B, L, E] (Transformer-XL's `hidden` also returns its new
    memory; from no memory, as its `log_probs`)."""
    h = module.hidden(batch)
    return h[0] if isinstance(h, tuple) else h


def _output_log_prob(module, hidden_NE):
    return module.output.log_prob(hidden_NE).astype(jnp.float32)


def _eval_chunk(module, num_tokens: int) -> tuple[int, int]:
    """(tokens per eval chunk, V) of an LM's output layer: the chunk its own evaluation
    walks (`eval_chunk_tokens`: one chunk's [C, V] float32 under 256 MiB per device unless
    `chunk_tokens` says otherwise), or that automatic size for the layers whose own
    evaluation reads the whole [B, L, V] (adaptive, hierarchical, binary_code)."""
    out = module.output
    own = getattr(out, "eval_chunk_tokens", None)
    return (own(num_tokens) if own is not None
            else auto_chunk_tokens(num_tokens, out.vocab_size)), out.vocab_size


def make_ensemble_eval_step(model, t: TrainConfig, kind: str):
    """eval_step(members, batch) -> {"members": sums with [M] leaves, "ensemble": sums}.

    `members` is a TrainState whose step, params and rng all have a leading member axis
    (opt_state is not read). `kind` is the task kind: "lm", "classify" or "match". Each
    member's log-probabilities are the normalized ones its plain `evaluate` scores.

    An LM is scored by token chunks, as its plain evaluation is (review, session 107: the
    whole [B, L, V] per member, a running copy and the `logaddexp` of the two were 40 GiB at
    16K tokens x 250K ids, where the plain evaluation held 256 MiB): each member's hidden
    states once ([M, B, L, E]), then per chunk of C tokens the members' output layers one
    after another on [C, E] beside a running `logaddexp` [C, V], so the peak is a few
    [C, V], whatever M and the batch's tokens, plus the members' hidden states [M, B, L, E]
    (and their copy in token-major order).
    """
    def rngs(member: TrainState) -> dict:
        return {"features": member.features_key(t.feature_redraw_every)}

    def log_probs(member: TrainState, batch):  # each example's [B, C] (classify, match)
        logits = model.apply({"params": member.params}, batch, method="logits",
                             rngs=rngs(member))
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    def per_example(members: TrainState, batch, num: int):
        target_P, weight_P = _targets(kind, batch)

        def one(logsum_PO, member):
            logp_PO = log_probs(member, batch)
            return jnp.logaddexp(logsum_PO, logp_PO), _sums(logp_PO, target_P, weight_P)

        shape = jax.eval_shape(log_probs, jax.tree.map(lambda x: x[0], members), batch)
        init_PO = jnp.full(shape.shape, -jnp.inf, jnp.float32)
        logsum_PO, per_member = jax.lax.scan(one, init_PO, members)
        ensemble_PO = logsum_PO - jnp.log(jnp.float32(num))
        return {"members": per_member, "ensemble": _sums(ensemble_PO, target_P, weight_P)}

    def per_token(members: TrainState, batch, num: int):
        target_BL, weight_BL = _targets(kind, batch)
        h_MBLE = jax.lax.map(lambda m: model.apply({"params": m.params}, batch,
                                                   method=_hidden, rngs=rngs(m)), members)
        first = jax.tree.map(lambda x: x[0], members)
        chunk, V = model.apply({"params": first.params}, target_BL.size, method=_eval_chunk)

        def one_chunk(h_CME, target_C):
            def one(logsum_CV, xs):
                member, h_CE = xs
                logp_CV = model.apply({"params": member.params}, h_CE,
                                      method=_output_log_prob, rngs=rngs(member))
                return (jnp.logaddexp(logsum_CV, logp_CV),
                        log_prob_nll_and_argmax(logp_CV, target_C))

            init_CV = jnp.full((target_C.shape[0], V), -jnp.inf, jnp.float32)
            logsum_CV, (nll_MC, pred_MC) = jax.lax.scan(
                one, init_CV, (members, jnp.moveaxis(h_CME, 1, 0)))
            nll_C, pred_C = log_prob_nll_and_argmax(logsum_CV - jnp.log(jnp.float32(num)),
                                                    target_C)
            return nll_C, pred_C, nll_MC.T, pred_MC.T

        # tokens lead ([B, L, M, E]): the chunks cut L, the batch axis stays whole in each
        nll_BL, pred_BL, nll_BLM, pred_BLM = map_token_chunks(
            one_chunk, target_BL.shape, chunk, jnp.moveaxis(h_MBLE, 0, 2), target_BL,
            remat=False)
        per_member = jax.vmap(_sums_of, in_axes=(-1, -1, None, None))(
            nll_BLM, pred_BLM, target_BL, weight_BL)
        return {"members": per_member,
                "ensemble": _sums_of(nll_BL, pred_BL, target_BL, weight_BL)}

    def eval_step(members: TrainState, batch):
        members = TrainState(step=members.step, params=members.params, opt_state=None,
                             rng=members.rng)  # what evaluation reads
        num = members.step.shape[0]
        return (per_token if kind == "lm" else per_example)(members, batch, num)

    return eval_step


def _report(sums: dict, *, lm: bool) -> dict:
    """Host sums -> {ensemble metrics at top level, "members": [...], "member_mean": {...}}.

    The ensemble's metrics sit at the top level so the training loop logs them and early
    stopping watches them like a plain run's.
    """
    num = len(sums["members"]["weight"])
    members = [finalize({k: v[i] for k, v in sums["members"].items()}, lm=lm) for i in range(num)]
    mean = {k: float(np.mean([m[k] for m in members])) for k in members[0]}
    if "ppl" in mean and "loss" in mean:  # the mean loss's (a bug hunt, session 96: the mean
        mean["ppl"] = float(np.exp(mean["loss"]))  # of the perplexities, unlike every row)
    return {**finalize(sums["ensemble"], lm=lm), "members": members, "member_mean": mean}


def _stacked(sharding: NamedSharding) -> NamedSharding:
    """The same layout with an unsharded leading member axis."""
    return NamedSharding(sharding.mesh, P(None, *sharding.spec))


def _stack(*trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _member_fields() -> list[str]:
    """TrainState fields with a member axis: all but the shared step counter (params,
    opt_state, rng, and any per-member extras such as a dynamic loss scale)."""
    return [f.name for f in dataclasses.fields(TrainState) if f.name != "step"]


# ---------------------------------------------------------------------------------------
# Seed ensemble


def _reduce_members(metrics: dict) -> dict:
    """[M] train metrics -> the scalars `Trainer.run` logs: the members' mean loss (summed
    loss over summed weight; every member saw the same batch), mean norms, and `finite`
    only if every member is finite."""
    out = {}
    for k, v in metrics.items():
        if k in ("tokens", "lr"):  # the same for every member
            out[k] = v[0]
        elif k in ("grad_norm", "param_norm", "loss_scale"):
            out[k] = jnp.mean(v)
        elif k == "finite":
            out[k] = jnp.min(v)
        else:  # additive: the model's sums (loss, weight, correct), skipped member-steps,
            out[k] = jnp.sum(v, axis=0)  # MoE's loads per layer and expert (found in review)
    return out


def default_member_loop() -> str:
    """How `EnsembleTrainer` runs its members unless told: "map" on CPU (measured faster
    there, see the module docstring), "vmap" on accelerators (not measured there)."""
    return "map" if jax.default_backend() == "cpu" else "vmap"


def _members_one_by_one(step, fields: list[str]):
    """`step` over the member axis, one member after another inside the one jitted program:
    a `fori_loop` that reads member i's slice of the stacked fields, runs the plain step on
    it (the step counter shared) and writes the slice back in place, so the stacked state is
    held once (review, session 102: under `lax.map` the loop's stacked output was a second
    copy, 20 MiB of temporaries against vmap's 12 for a 12 MiB toy state); the same (state,
    [M] metrics) as `jax.vmap(step, ...)`. `step(state, batch, i)` runs member i; `index_M`
    holds the members' indices (`jnp.arange(M)`, as vmap maps over it)."""
    def members_step(state: TrainState, batch, index_M):
        stacked = {k: getattr(state, k) for k in fields if getattr(state, k) is not None}
        M = jax.tree.leaves(stacked)[0].shape[0]

        def one(i, stacked):
            member = jax.tree.map(lambda x: x[i], stacked)
            new, metrics = step(state.replace(**member), batch, index_M[i])
            return {k: getattr(new, k) for k in member}, new.step, metrics

        metric_shapes = jax.eval_shape(one, 0, stacked)[2]
        metrics0 = jax.tree.map(lambda s: jnp.zeros((M,) + s.shape, s.dtype), metric_shapes)

        def body(i, carry):
            stacked, _, metrics = carry
            out, new_step, m = one(i, stacked)
            put = lambda a, b: a.at[i].set(b)
            return jax.tree.map(put, stacked, out), new_step, jax.tree.map(put, metrics, m)

        stacked, new_step, metrics_M = jax.lax.fori_loop(0, M, body,
                                                         (stacked, state.step, metrics0))
        return state.replace(step=new_step, **stacked), metrics_M
    return members_step


def _check_members_file(workdir: str, members: int) -> None:
    """Refuse a workdir whose checkpoints hold another number of members (or a plain run)."""
    ckpt = os.path.join(workdir, "checkpoints")
    has_ckpts = os.path.isdir(ckpt) and any(d.isdigit() for d in os.listdir(ckpt))
    path = os.path.join(workdir, MEMBERS_FILE)
    saved = None
    if has_ckpts and os.path.exists(path):  # without checkpoints it is written anew
        try:
            with open(path) as f:
                saved = json.load(f)["members"]
            ok = type(saved) is int and saved >= 1
        except (json.JSONDecodeError, UnicodeDecodeError, OSError, KeyError, TypeError):
            ok = False  # a bug hunt (session 96): a cut file was a JSON error naming no file
        if not ok:
            raise CheckpointMismatch(
                f"{path} cannot be read as {{\"members\": M, ...}}; delete it (the run's "
                "config.json says how many members its checkpoints hold) and run again")
    elif has_ckpts:  # a bug hunt (session 96): a lost members.json called an ensemble's
        # checkpoints "a plain run"; its config.json's shape signature counts the members, and
        # marks one member's as stacked (review r3: a 1-member ensemble's read as a plain run)
        saved = run_members(workdir)
        saved = saved if is_stacked(saved) else None
    if has_ckpts and saved != members:
        what = "a plain run" if saved is None else f"a {saved}-member ensemble"
        hint = "" if saved is None else f", or --members {saved} to resume it"
        raise CheckpointMismatch(
            f"workdir {workdir} holds checkpoints of {what}, not of a {members}-member "
            f"ensemble; use a new --workdir{hint}.")


class EnsembleTrainer(Trainer):
    """`members` seeds trained in one step, batched by `vmap` or in turn by a loop
    (`member_loop`: "vmap" or "map"; None, `default_member_loop()`); `run()` is `Trainer.run`.

    The state is a TrainState whose fields have a leading [M] axis, all but the shared
    step. Train metrics are the members' mean (grad_norm, and so clipped_frac, of the mean
    gradient norm; float16's skipped_steps count member-steps); `evaluate` reports every
    member, their mean and the ensemble (top level). Checkpoints hold the stacked state, so
    a rerun resumes all members; `members.json` in the workdir records M. `param_count` in
    the summary counts all members.
    """

    def __init__(self, cfg: Config, workdir: str, members: int, *,
                 member_loop: str | None = None):
        if not isinstance(members, int) or members < 1:
            raise ValueError(f"members = {members!r}: an ensemble needs an integer >= 1")
        member_loop = default_member_loop() if member_loop is None else member_loop
        if member_loop not in MEMBER_LOOPS:
            raise ValueError(f"member_loop = {member_loop!r} is not allowed: give one of "
                             f"{', '.join(map(repr, MEMBER_LOOPS))} (or None: "
                             f"{default_member_loop()!r} on this backend)")
        self.member_loop = member_loop
        _check_members_file(workdir, members)
        check_ensemble_evaluates(cfg)
        # read by Trainer.__init__ for the checkpoint signature: a StackedMembers, so that one
        # member's is told apart from a plain run's
        self.members = StackedMembers(members)
        super().__init__(cfg, workdir)
        try:
            self._init_members(members)
        except BaseException:  # the workdir this Trainer holds, released (review, session 96;
            self._release_workdir()  # its config.json written, the tokenizer beside it kept)
            raise

    def _init_members(self, members: int) -> None:
        cfg = self.cfg
        self.members = StackedMembers(members)
        self.seeds = [cfg.seed + i for i in range(members)]
        # The plain trainer's pieces stay, for one member: init and evaluate.
        self.member_sharding = single = self.state_sharding
        fields = _member_fields()
        self.state_sharding = single.replace(
            **{k: jax.tree.map(_stacked, getattr(single, k)) for k in fields})
        stack = lambda a, s: jax.ShapeDtypeStruct((members,) + a.shape, a.dtype, sharding=s)
        abstract, sharding = self.abstract_state, self.state_sharding
        self.abstract_state = abstract.replace(
            **{k: jax.tree.map(stack, getattr(abstract, k), getattr(sharding, k)) for k in fields})
        model = models.build(cfg, deterministic=False, token_counts=self.task.token_counts)
        axes = TrainState(step=None, **{k: None if getattr(abstract, k) is None else 0
                                        for k in fields})
        # Each member's carries (pruning masks, a teacher, ...) ride in its own carry slice,
        # and draw from its own seed's key, as its plain run does (a bug hunt, session 103:
        # random pruning drew every member's masks from cfg.seed's).
        # (self.tx: weight decay's mask is over each member's tree, as the trainer's)
        tx, carries = self.tx, self.carries
        keys_M2 = np.stack([np.asarray(jax.random.key_data(jax.random.key(s)))
                            for s in self.seeds])

        def step(state, batch, i):
            key = jax.random.wrap_key_data(jnp.asarray(keys_M2)[i])
            return make_train_step(model, tx, cfg.train,
                                   [c.for_member(key) for c in carries])(state, batch)

        if self.member_loop == "vmap":
            members_step = jax.vmap(step, in_axes=(axes, None, 0), out_axes=(axes, 0))
        else:
            members_step = _members_one_by_one(step, fields)
        estep = make_ensemble_eval_step(self.eval_model, cfg.train, self.task.kind)

        def train_step(state, batch):
            state, metrics_M = members_step(state, batch, jnp.arange(members))
            return state, _reduce_members(metrics_M)

        with self._context():
            self.train_step = jax.jit(
                train_step, in_shardings=(self.state_sharding, self.batch_sharding),
                out_shardings=(self.state_sharding, None), donate_argnums=0,
                compiler_options=step_compiler_options())
            self._stack_members = jax.jit(
                lambda *states: states[0].replace(
                    **{k: _stack(*(getattr(s, k) for s in states)) for k in fields}),
                out_shardings=self.state_sharding)
            self.ensemble_eval_step = jax.jit(
                lambda state, batch: estep(
                    state.replace(step=jnp.broadcast_to(state.step, (members,))), batch),
                in_shardings=(self.state_sharding, self.batch_sharding),
                compiler_options=step_compiler_options())
            self._take = jax.jit(
                lambda state, i: state.replace(
                    **{k: jax.tree.map(lambda x: x[i], getattr(state, k)) for k in fields}),
                out_shardings=single)
        if jax.process_index() == 0:
            os.makedirs(self.workdir, exist_ok=True)
            path = os.path.join(self.workdir, MEMBERS_FILE)
            try:
                write_json(path, {"members": members, "seeds": self.seeds}, indent=None)
            except OSError as e:  # a review (session 114): a traceback (a full disk)
                raise write_failed(path, e, os.path.join(self.workdir, "checkpoints")) from None

    def initial_state(self):
        """(stacked state, loop_state): restored from the newest checkpoint, or member i
        initialized (and its carries started) exactly as the plain run with seed cfg.seed + i."""
        if self.checkpointer.latest_step() is not None:
            return super().initial_state()
        states = [self.fresh_state(jax.random.key(s), self.member_sharding) for s in self.seeds]
        with self._context():
            # whatever starts them (review r10, session 108: train.distill.init copies the
            # teacher into every member, and only train.init_from's start was compared)
            if self.members > 1 and _same_params(states):
                self._say_same_start()
            return self._stack_members(*states), {}

    def _say_same_start(self) -> None:
        # a bug hunt (session 94): an ensemble started from one run trained M copies of one
        # model, unsaid, where nothing in training drew differently for its members
        if jax.process_index() == 0:
            t, m = self.cfg.train, self.cfg.model
            if t.init_from:
                cause = (f"train.init_from={t.init_from} holds one run, read whole into each",
                         "no train.init_from")
            elif t.distill.teacher and t.distill.init != "none":
                cause = (f"train.distill.init={t.distill.init!r} starts each from the weights "
                         f"of the teacher in {t.distill.teacher}, the same for every seed",
                         "train.distill.init='none'")
            else:  # no start of the model's own draws from the seed
                cause = ("nothing in their initialization draws from their seeds",
                         "initializers that draw")
            print(f"hpnlp: warning: the {self.members} members start from the same parameters "
                  f"({cause[0]}): they differ only by what their seeds draw in training "
                  f"(dropout: model.dropout={m.dropout}), and members that draw alike train "
                  "alike; keep some randomness in training (model.dropout > 0), or train "
                  f"the members from their own seeds ({cause[1]})", file=sys.stderr,
                  flush=True)

    def member_state(self, state, i: int) -> TrainState:
        """Member i of a stacked state, as the plain TrainState of its own run."""
        with self._context():
            return self._take(state, jnp.int32(i))

    def evaluate(self, state, *, batches: int | None = None) -> dict:
        """`Trainer.evaluate`'s, of the ensemble's averaged prediction (`batches`: the first
        that many eval batches; a review, session 118: the keyword was not taken)."""
        return _report(self.eval_sums(state, self.ensemble_eval_step, batches=batches),
                       lm=self.lm)


@jax.jit
def _equal(a, b):
    return jnp.stack([jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                                          jax.tree.leaves(b))]).all()


def _same_params(states: list[TrainState]) -> bool:
    """Whether every member's initial parameters equal the first's."""
    return all(bool(_equal(states[0].params, s.params)) for s in states[1:])


# ---------------------------------------------------------------------------------------
# Checkpoint ensemble and weight averaging of a plain run


def check_ensemble_evaluates(cfg: Config) -> None:
    """Refuse, before anything compiles, a model whose evaluation reads state beyond its
    parameters that the ensemble's evaluation (each batch's predicted distributions,
    averaged) does not thread."""
    if cfg.model.kind == "bi_encoder":
        raise ConfigError(
            "config field `model.kind` = 'bi_encoder' is not allowed in an ensemble: its "
            "evaluation ranks each query against the whole held-out pool (recall, MRR), not a "
            "distribution per example to average; ensemble an lm, classifier or dual_encoder run")
    if cfg.model.memory.size:
        raise ConfigError(
            f"config field `model.memory.size` = {cfg.model.memory.size} is not allowed in an "
            "ensemble: the key-value memory's nearest-neighbour answers are not a distribution to "
            "average, and its evaluation reads each run's trained memory from the train state, "
            "which the ensemble's evaluation does not; train the members as separate runs, or set "
            "model.memory.size=0")
    if xl.carries_memory(cfg):  # (a review, session 115: "use 'pack' or a Transformer" led
        # to the memory fields' refusal, and named nothing a run's checkpoints could take)
        from hpnlp.config.checks import xl_on_pack
        raise ConfigError(
            "config field `data.batching` = 'stream' is not allowed in an ensemble of "
            "Transformer-XL runs: their evaluation threads the eval stream's memory from batch to "
            "batch and the ensemble's scores each batch alone; the checkpoints of a run trained "
            "on a stream cannot be combined (evaluate each alone), and a seed ensemble (--members) "
            "of this model can train on " + xl_on_pack(cfg.model).removeprefix("use "))


def _restore_last(cfg, workdir: str, last_k: int):
    """(trainer, steps, states) of the last `last_k` checkpoints of a plain run."""
    if not isinstance(cfg, Config):
        cfg = from_configdict(cfg)
    check_ensemble_evaluates(cfg)
    if not isinstance(last_k, int) or last_k < 1:
        raise ValueError(f"last_k = {last_k!r}: the number of checkpoints to combine must be >= 1")
    keep = cfg.train.keep_checkpoints
    if os.path.exists(os.path.join(workdir, "config.json")):
        # the run's own data and the checkpoints it kept, not what the command line says
        run_cfg = load_run_config(workdir, require_checkpoint=False)
        # a path given relatively, or saved so, names the run's own file (a bug hunt, 98)
        for f in dataclasses.fields(run_cfg.data):
            mine, theirs = getattr(cfg.data, f.name), getattr(run_cfg.data, f.name)
            if f.name in DATA_PATH_FIELDS and same_data_path(theirs, mine):
                continue
            if mine != theirs:
                raise ConfigError(
                    f"config field `data.{f.name}` = {mine!r} is not allowed: the run in {workdir} "
                    f"trained with {theirs!r}, and its checkpoints are combined on its own data; "
                    f"give {config_flag(f'data.{f.name}', repr(theirs))} (or the run's own config)")
        keep = run_cfg.train.keep_checkpoints
        # its data (the paths as it saved them) and its seed, which a checkpoint's read does
        # not use (a bug hunt, session 100: another --config's seed was "a different model",
        # and the reader was told to delete the run)
        # and the interval of its random features' redraws, which picks each checkpoint's
        # draw (a review, session 115: the command line's default of 1000 scored every
        # checkpoint of a run redrawn each 50 steps with draw 0, and said nothing)
        cfg = dataclasses.replace(
            cfg, data=run_cfg.data, seed=run_cfg.seed,
            train=dataclasses.replace(
                cfg.train, feature_redraw_every=run_cfg.train.feature_redraw_every))
    if os.path.exists(os.path.join(workdir, MEMBERS_FILE)):
        raise CheckpointMismatch(
            f"workdir {workdir} holds a seed ensemble (EnsembleTrainer); checkpoint ensembles and "
            "weight averages combine the checkpoints of a plain run (python -m hpnlp.main)")
    if not os.path.exists(os.path.join(workdir, "config.json")):
        raise NotEnoughCheckpoints(
            f"no run in workdir {workdir} (no config.json): train one there first with "
            "python -m hpnlp.main --workdir ...")
    # (after those: a review, session 115, found a mistyped folder told to retrain)
    if keep < last_k:
        raise ConfigError(
            f"config field `train.keep_checkpoints` = {keep} is not allowed: a run keeps only its "
            f"last {keep} checkpoints, fewer than the {last_k} asked for; train with "
            f"--config.train.keep_checkpoints={last_k} (or more), or combine at most {keep}")
    # read only: laid out for these devices as generate reads a run (a bug hunt, session
    # 100: a run of 4 devices' mesh was refused on 1), and a mismatch is a reader's error
    trainer = Trainer(cfg, workdir, read_only=True)
    steps = sorted(trainer.checkpointer.manager.all_steps())
    if len(steps) < last_k:
        trainer.checkpointer.close()
        raise NotEnoughCheckpoints(
            f"workdir {workdir} has {len(steps)} checkpoint(s) (steps {steps}), fewer than the "
            f"{last_k} asked for; combine fewer, or train longer or with a smaller "
            "train.checkpoint_every")
    steps = steps[-last_k:]
    states = [trainer.checkpointer.restore(s, trainer.abstract_state)[0] for s in steps]
    trainer.checkpointer.close()
    return trainer, steps, states


def _ensemble_of(trainer: Trainer, states) -> dict:
    single = trainer.state_sharding
    stacked = TrainState(step=_stacked(single.step), params=jax.tree.map(_stacked, single.params),
                         opt_state=None, rng=_stacked(single.rng))
    estep = make_ensemble_eval_step(trainer.eval_model, trainer.cfg.train, trainer.task.kind)
    with trainer._context():
        members = jax.jit(lambda *s: TrainState(
            step=_stack(*(x.step for x in s)), params=_stack(*(x.params for x in s)),
            opt_state=None, rng=_stack(*(x.rng for x in s))), out_shardings=stacked)(*states)
        step = jax.jit(estep, in_shardings=(stacked, trainer.batch_sharding))
    return _report(trainer.eval_sums(members, step), lm=trainer.lm)


def checkpoint_ensemble(cfg, workdir: str, last_k: int) -> dict:
    """Evaluate the last `last_k` checkpoints of the plain run in `workdir` and the mean of
    their predictions: {ensemble metrics, "members", "member_mean", "steps"}."""
    trainer, steps, states = _restore_last(cfg, workdir, last_k)
    return {**_ensemble_of(trainer, states), "steps": steps}


def weight_average(cfg, workdir: str, last_k: int):
    """-> (report, params): the uniform mean of the last `last_k` checkpoints' params,
    evaluated. `report` is `checkpoint_ensemble`'s (the members come from the same pass)
    plus "weight_average": the averaged model's metrics. Params average in float32; a pruned
    run's average is masked by its newest checkpoint's masks."""
    trainer, steps, states = _restore_last(cfg, workdir, last_k)
    report = {**_ensemble_of(trainer, states), "steps": steps}
    mean = lambda *xs: (sum(x.astype(jnp.float32) for x in xs) / len(xs)).astype(xs[0].dtype)
    with trainer._context():
        params = jax.jit(lambda *p: jax.tree.map(mean, *p),
                         out_shardings=trainer.state_sharding.params)(*(s.params for s in states))
    # A pruned run's average keeps the newest checkpoint's masks (a review, session 117: the
    # union of the K checkpoints' kept weights, denser than any of them, was scored as one
    # of the run's models): what it prunes is zero, as in the newest checkpoint
    pruning = next((c for c in trainer.carries if c.name == "prune"), None)
    if pruning is not None:
        params = pruning.gradients(states[-1].carry["prune"], params)
    # The newest checkpoint's step and RNG: random-feature layers use its current draw.
    report["weight_average"] = trainer.evaluate(states[-1].replace(params=params))
    return report, params


# ---------------------------------------------------------------------------------------
# Command line


def format_table(report: dict) -> str:
    """Member / mean / ensemble (/ weight average) rows of a report, one per line."""
    cols = [k for k in ("loss", "accuracy", "ppl") if k in report]
    labels = ([f"seed {s}" for s in report["seeds"]] if "seeds" in report
              else [f"step {s}" for s in report["steps"]])
    rows = list(zip(labels, report["members"])) + [("member mean", report["member_mean"]),
                                                   ("ensemble", report)]
    if "weight_average" in report:
        rows.append(("weight average", report["weight_average"]))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{c:>10}" for c in cols)]
    lines += [f"{name:{width}}  " + "  ".join(f"{m[c]:10.4f}" for c in cols) for name, m in rows]
    return "\n".join(lines)


def _write_report(workdir: str, report: dict, *, read: bool = False) -> None:
    """WORKDIR/ensemble.json, whole or not at all, as the run's other files (a review, r1: a
    kill mid-write cut it); a failed write is one line (a review, session 115), as the run's
    other reports'. `read`: the report of a run's checkpoints read (--from_checkpoints),
    which a rerun reads again, resuming nothing (a review, session 117)."""
    path = os.path.join(workdir, "ensemble.json")
    try:
        write_json(path, report, indent=1)
    except OSError as e:
        if read:
            from hpnlp.train.checkpoint import CheckpointSaveFailed
            detail = (str(e).splitlines() or ["no detail"])[0][:200]
            raise CheckpointSaveFailed(f"writing {path} failed ({type(e).__name__}: {detail}); "
                                       "free space there, or make it writable, and rerun the "
                                       "same command (it reads the checkpoints again)") from None
        raise write_failed(path, e, os.path.join(workdir, "checkpoints")) from None


def seed_ensemble(cfg, workdir: str, members: int, *,
                  member_loop: str | None = None) -> EnsembleTrainer:
    """The EnsembleTrainer of `members` seeds of `cfg` (a ConfigDict or `Config`) in
    `workdir`, made where missing: a refused config leaves no empty folder behind, as
    hpnlp.train.run's (a review, r1: --members M left one)."""
    if not isinstance(cfg, Config):
        cfg = from_configdict(cfg)
    made = not os.path.exists(workdir)
    os.makedirs(workdir, exist_ok=True)
    try:
        return EnsembleTrainer(cfg, workdir, members, member_loop=member_loop)
    except Exception:  # not while another process holds it (a review, session 115)
        if made:
            remove_if_empty(workdir)
        raise


def _main(argv) -> None:
    from absl import flags, logging

    from hpnlp import main as cli
    F = flags.FLAGS
    cli.refuse_positional(argv)
    # one line each, not absl's usage dump (found by a README walk: --members 0 printed 49
    # lines ending in "give exactly one of", though one was given)
    for name in ("members", "from_checkpoints"):
        if F[name].present and F[name].value < 1:
            print(f"hpnlp: error: --{name} {F[name].value}: must be at least 1", file=sys.stderr)
            sys.exit(1)
    if F["member_loop"].present and not F.members:
        print(f"hpnlp: error: --member_loop {F.member_loop}: only for --members M (how a seed "
              "ensemble's training runs its members); drop it", file=sys.stderr)
        sys.exit(1)
    if (F.members > 0) == (F.from_checkpoints > 0):
        print("hpnlp: error: give exactly one of --members M (train a seed ensemble) and "
              "--from_checkpoints K (combine the last K checkpoints of a run)"
              + (", not both" if F.members > 0 else ""), file=sys.stderr)
        sys.exit(1)
    if F["profile"].present and F.from_checkpoints:  # taken and ignored (review r4)
        print(f"hpnlp: error: --profile {F.profile}: traces a few training steps of --members "
              "M, and --from_checkpoints K trains none; drop it", file=sys.stderr)
        sys.exit(1)
    logging.set_verbosity(logging.WARNING)
    cfg = F.config
    if cfg is None:  # --from_checkpoints reads the run's own config (its config.json)
        if F.members or cli._option_overrides:
            print("hpnlp: error: --config is required " + (
                "to train a seed ensemble" if F.members else "for --config.*.options "
                "overrides") + ": the experiment file, e.g. --config experiments/rnn_lm.py",
                file=sys.stderr)
            sys.exit(1)
        try:
            cfg = load_run_config(F.workdir)
        except (NoCheckpoint, ConfigError) as e:
            print(f"hpnlp: error: {e}", file=sys.stderr)
            sys.exit(1)
    cli.apply_option_overrides(cfg)
    from hpnlp.paths import check_workdir, check_writable_dir
    from hpnlp.train import Interrupted, NonFiniteLoss
    try:
        if F.from_checkpoints:  # a run read, not resumed: ensemble.json is all it writes
            # (a review, session 117: a run whose checkpoints were write-protected was
            # refused, "a resume writes them again")
            check_writable_dir(F.workdir, "--workdir")
        else:
            check_workdir(F.workdir)  # before a compile
        if F.profile:
            check_writable_dir(F.profile, "--profile")
        cli.join_processes(cfg, {"--members": F.members,
                                 "--from_checkpoints": F.from_checkpoints,
                                 # its step's collectives (a review, session 115); not
                                 # the backend's default, which would start JAX before
                                 # the join
                                 "--member_loop": F.member_loop or "(default)"})
        if F.members:
            if F.coordinator:  # Ctrl-C while it is built stops every process (review, s. 96)
                from hpnlp.train.stop import ctrl_c_as_preemption
                ctrl_c_as_preemption()
            trainer = seed_ensemble(cfg, F.workdir, F.members, member_loop=F.member_loop)
            report = {"mode": "seeds", "seeds": trainer.seeds,
                      **trainer.run(profile_dir=F.profile)["eval"]}
        else:
            report = {"mode": "checkpoints",
                      **weight_average(cfg, F.workdir, F.from_checkpoints)[0]}
    except (ConfigError, CheckpointMismatch, NonFiniteLoss, ValueError, FileNotFoundError) as e:
        cli.exit_failed(f"hpnlp: error: {e}")
    except CheckpointSaveFailed as e:  # at once, as hpnlp.main: orbax's threads hold the exit
        cli.exit_interrupted(f"hpnlp: error: {e}", 1)
    except Interrupted as e:  # as hpnlp.main says it
        cli.exit_interrupted(f"hpnlp: {e}", e.exit_code, e.saved)
    except KeyboardInterrupt as e:  # before the first step or after the last (SIGTERM's too)
        cli.exit_interrupted(f"hpnlp: {str(e) or 'interrupted'}", getattr(e, "exit_code", 130))
    except Exception:  # a traceback: the other processes of the run stop with this one
        cli.stop_if_another_failed()
        cli.tell_the_others()
        raise
    if jax.process_index() == 0:
        try:
            _write_report(F.workdir, report, read=bool(F.from_checkpoints))
        except CheckpointSaveFailed as e:
            cli.exit_interrupted(f"hpnlp: error: {e}", 1)
        print(format_table(report))


__all__ = ["EnsembleTrainer", "NotEnoughCheckpoints", "checkpoint_ensemble", "format_table",
           "make_ensemble_eval_step", "seed_ensemble", "weight_average"]


if __name__ == "__main__":
    from absl import app, flags

    from hpnlp import main as cli  # its flags: --config, --workdir, --coordinator, --profile, ...
    flags.DEFINE_integer("members", 0, "Train a seed ensemble of this many members "
                         "(member i: seed config.seed + i) in --workdir.")
    flags.DEFINE_integer("from_checkpoints", 0, "Combine the last K checkpoints of the plain "
                         "run in --workdir: each, their mean prediction, their mean weights.")
    flags.DEFINE_enum("member_loop", None, list(MEMBER_LOOPS), "How --members' train step runs "
                      "the members: batched by jax.vmap, or one after another in a loop "
                      "(same results up to rounding, same checkpoints). Default: map on CPU, "
                      "vmap elsewhere.")
    sys.argv = cli._take_option_overrides(sys.argv)
    # hpnlp.main's parser: a missing or failing config file and a --config.FIELD of no field
    # are one line (a README walk: tracebacks of 15-55 lines here)
    app.run(_main, flags_parser=lambda argv: cli._parse_flags(argv, config_required=False))

