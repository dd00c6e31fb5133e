"""Ensembles: a member equals its plain run, under either member loop; the ensemble scores
the mean of its members' probabilities (an LM's by token chunks), and its NLL obeys Jensen;
checkpoint ensembles and weight averages combine a plain run's last checkpoints; the CLI.

Compiles dominate on CPU, so the runs are module fixtures shared by the tests: one plain
run (seed 1) and one 2-member seed ensemble (seed 0, so its member 1 is that run).
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import chex
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import data as data_lib
from hpnlp.config import ConfigError, default_configdict, from_configdict
from hpnlp.train import Trainer, run
from hpnlp.train.checkpoint import CheckpointMismatch
from hpnlp.train.loop import _global
from hpnlp.train.ensemble import (EnsembleTrainer, NotEnoughCheckpoints, checkpoint_ensemble,
                                  weight_average)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Written into a config file for the CLI test; `tiny()` evaluates the same text.
# Dropout is on, so equal members also need equal dropout streams.
TINY = """
from hpnlp.config import default_configdict

def get_config(arg=""):
    cd = default_configdict()
    cd.name = "tiny"
    cd.data.update(task="byte_lm", seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=32, depth=1, num_heads=2, mlp_dim=64, max_len=32, dropout=0.1)
    cd.train.update(steps=4, batch_size=8, lr=3e-3, warmup_steps=1, log_every=2, eval_every=2,
                    eval_batches=2, checkpoint_every=2, keep_checkpoints=3, progress=False)
    return cd
"""


def tiny(seed=0, **train):
    scope = {}
    exec(TINY, scope)
    cd = scope["get_config"]()
    cd.seed = seed
    cd.train.update(**train)
    return from_configdict(cd)


def lines(workdir, *, eval):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {l["step"]: l for l in map(json.loads, f) if bool(l.get("eval")) == eval}


def check_report(report, members):
    """Fields present; the mean-probability ensemble's NLL is at most the members' mean."""
    assert len(report["members"]) == members
    for m in report["members"] + [report["member_mean"], report]:
        assert {"loss", "accuracy"} <= set(m) and 0.0 <= m["accuracy"] <= 1.0
    mean = np.mean([m["loss"] for m in report["members"]])
    assert report["member_mean"]["loss"] == pytest.approx(mean, rel=1e-6)
    if "ppl" in report:  # the mean loss's (a bug hunt, session 96: the perplexities' mean)
        assert report["member_mean"]["ppl"] == pytest.approx(np.exp(mean), rel=1e-6)
    assert report["loss"] <= mean * (1 + 1e-6)  # Jensen, up to float32 rounding


def check_members(members, plain_evals):
    """Each member's metrics are its plain run's own evaluation."""
    for member, expect in zip(members, plain_evals, strict=True):
        assert member["loss"] == pytest.approx(expect["loss"], rel=1e-5)
        assert member["accuracy"] == pytest.approx(expect["accuracy"], abs=1e-6)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain run of seed 1 (member 1 of the ensemble below); checkpoints and evals at
    steps 2 and 4."""
    workdir = str(tmp_path_factory.mktemp("seed1"))
    run(tiny(1), workdir)
    return workdir


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """A 2-member ensemble of seed 0: (workdir, trainer, summary)."""
    workdir = str(tmp_path_factory.mktemp("ensemble"))
    trainer = EnsembleTrainer(tiny(0), workdir, members=2)
    return workdir, trainer, trainer.run()


@pytest.mark.slow
def test_members_equal_plain_runs(plain, ensemble):
    """Member 1 of the ensemble (its default member loop) is the plain run with seed
    cfg.seed + 1: params, optimizer state, RNG and every evaluation (dropout is on)."""
    workdir, ens, summary = ensemble
    assert ens.seeds == [0, 1] and summary["final_step"] == 4
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]
    # A rerun resumes the stacked state.
    state, _ = EnsembleTrainer(tiny(0), workdir, members=2).initial_state()
    assert int(state.step) == 4 and state.rng.shape == (2, 2)
    tr = Trainer(tiny(1), plain)
    expect = jax.device_get(tr.checkpointer.restore(4, tr.abstract_state)[0])
    tr.checkpointer.close()
    member = jax.device_get(ens.member_state(state, 1))
    chex.assert_trees_all_close(member.params, expect.params, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(member.opt_state, expect.opt_state, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(member.rng, expect.rng)
    other = jax.tree.leaves(jax.device_get(ens.member_state(state, 0)).params)
    assert not all(np.allclose(a, b) for a, b in zip(other, jax.tree.leaves(member.params)))
    train = lines(workdir, eval=False)
    assert sorted(train) == [2, 4] and all(np.isfinite(l["loss"]) for l in train.values())
    evals, p_evals = lines(workdir, eval=True), lines(plain, eval=True)
    assert sorted(evals) == [2, 4]
    for step, report in evals.items():
        check_report(report, 2)
        check_members(report["members"][1:], [p_evals[step]])
    assert evals[4]["loss"] == summary["eval"]["loss"]
    assert ens.evaluate(state)["loss"] == pytest.approx(summary["eval"]["loss"], rel=1e-6)
    # M copies of one member are that member: the logsumexp - log M normalization.
    m1 = ens.member_state(state, 1)
    with ens._context():
        same = ens.evaluate(ens._stack_members(m1, m1))
    assert same["loss"] == pytest.approx(evals[4]["members"][1]["loss"], rel=1e-6)
    assert same["accuracy"] == pytest.approx(evals[4]["members"][1]["accuracy"], abs=1e-6)


@pytest.fixture(scope="module")
def scored_batch(ensemble):
    """(trainer, stacked members, eval batch, each member's log-probabilities [M, B, L, V]
    float64, computed by its own `model.apply`): the fixture ensemble's trainer and trained
    members, and one eval batch with padded tokens (row 0 from position 20, row 5 whole)."""
    workdir, ens, _ = ensemble
    cfg = ens.cfg
    reader = EnsembleTrainer(tiny(0), workdir, members=2)
    members, _ = reader.initial_state()  # the fixture's last checkpoint
    reader.checkpointer.close()
    it = data_lib.make_iterator(ens.task, cfg.data, split="eval", **ens.iter_args,
                                batch_size=cfg.data.eval_batch_size or cfg.train.batch_size)
    batch = dict(next(iter(it)))
    segment_ids = np.array(batch["segment_ids"])
    segment_ids[0, 20:] = 0
    segment_ids[5] = 0
    batch["segment_ids"] = segment_ids
    redraw = cfg.train.feature_redraw_every
    log_probs = jax.jit(lambda s, b: ens.eval_model.apply(
        {"params": s.params}, b, method="log_probs", rngs={"features": s.features_key(redraw)}))
    logp_MBLV = np.stack([np.asarray(log_probs(ens.member_state(members, i), batch), np.float64)
                          for i in range(2)])
    return ens, members, batch, logp_MBLV


def expected_sums(logp_BLV, batch) -> dict:
    """Summed NLL, correct argmax and real tokens of log-probabilities [B, L, V], in numpy."""
    target_BL, real_BL = batch["targets"], batch["segment_ids"] > 0
    nll_BL = -np.take_along_axis(logp_BLV, target_BL[..., None], axis=-1)[..., 0]
    return {"loss": nll_BL[real_BL].sum(), "weight": real_BL.sum(),
            "correct": (logp_BLV.argmax(-1) == target_BL)[real_BL].sum()}


def check_sums(got, logp_MBLV, batch):
    """`got` (an ensemble eval step's sums) are the mean-probability ensemble's, and each
    member's, of the members' log-probabilities [M, B, L, V]."""
    M = len(logp_MBLV)
    expect = expected_sums(np.logaddexp.reduce(logp_MBLV, axis=0) - np.log(M), batch)
    assert got["ensemble"]["weight"] == expect["weight"] == 8 * 32 - 12 - 32
    assert got["ensemble"]["loss"] == pytest.approx(expect["loss"], rel=1e-5)
    assert got["ensemble"]["correct"] == expect["correct"]
    for i in range(M):
        expect = expected_sums(logp_MBLV[i], batch)
        assert got["members"]["weight"][i] == expect["weight"]
        assert got["members"]["loss"][i] == pytest.approx(expect["loss"], rel=1e-5)
        assert got["members"]["correct"][i] == expect["correct"]


def test_the_ensemble_is_the_mean_of_the_members_probabilities(scored_batch):
    """Review (session 107): no test checked the ensemble's own formula, and a geometric
    mean or a per-token max of the members passed them all. On one batch its sums are those
    of logsumexp_m(log p_m) - log M over the real tokens, from each member's log-probs by
    its own model.apply; where the members disagree its NLL is strictly below their mean
    (a geometric mean's equals it)."""
    ens, members, batch, logp_MBLV = scored_batch
    with ens._context():  # compiled by the fixture's run
        got = jax.device_get(ens.ensemble_eval_step(members, _global(batch, ens.batch_sharding)))
    check_sums(got, logp_MBLV, batch)
    weight = got["ensemble"]["weight"]
    assert got["ensemble"]["loss"] / weight < np.mean(got["members"]["loss"]) / weight - 0.1


def test_an_lm_ensemble_evaluates_by_token_chunks(scored_batch, monkeypatch, tmp_path):
    """Review (session 107): the ensemble's evaluation held each member's whole [B, L, V]
    log-probabilities, a running copy and their logaddexp, where the plain evaluation walks
    token chunks (at 16K tokens x 250K ids, over 40 GiB against 256 MiB). With chunks forced
    to 5 tokens a row (8 rows: 7 chunks of the 32 positions, the last padded by 3, and the
    batch's padded tokens), its sums are the unchunked step's and the formula's; at V = 4096
    and 2 tokens a row, the compiled step's temporaries are under half of one [B, L, V]
    float32 (unchunked: 3 of them)."""
    from hpnlp.softmax import full
    from hpnlp.train.ensemble import make_ensemble_eval_step
    ens, members, host_batch, logp_MBLV = scored_batch
    with ens._context():
        batch = _global(host_batch, ens.batch_sharding)
        unchunked = jax.device_get(ens.ensemble_eval_step(members, batch))  # the fixture's
        monkeypatch.setattr(full, "auto_chunk", lambda num_tokens, vocab_size: 40)
        step = jax.jit(make_ensemble_eval_step(ens.eval_model, ens.cfg.train, "lm"))
        got = jax.device_get(step(members.replace(step=jnp.broadcast_to(members.step, (2,))),
                                  batch))
    chex.assert_trees_all_close(got, unchunked, rtol=1e-6)
    check_sums(got, logp_MBLV, host_batch)

    cfg = tiny(0)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=4096))
    big = EnsembleTrainer(cfg, str(tmp_path), members=2)
    monkeypatch.setattr(full, "auto_chunk", lambda num_tokens, vocab_size: 16)
    B, L = host_batch["targets"].shape
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in host_batch.items()}
    with big._context():
        compiled = big.ensemble_eval_step.lower(big.abstract_state, abstract_batch).compile()
    big.checkpointer.close()
    assert compiled.memory_analysis().temp_size_in_bytes < B * L * 4096 * 4 / 2


def test_member_loops_agree_and_resume_each_other(ensemble, tmp_path):
    """A step with the members one by one is the step under `vmap` (the same params,
    optimizer state, RNG and metrics), and a checkpoint written by one loop resumes under
    the other: the fixture trained with the default loop, this resumes it with the other."""
    workdir, ens, _ = ensemble
    assert ens.member_loop == ("map" if jax.default_backend() == "cpu" else "vmap")
    with pytest.raises(ValueError, match=r"member_loop = 'scan' is not allowed: .*'map'"):
        EnsembleTrainer(tiny(0), workdir, members=2, member_loop="scan")
    other = {"map": "vmap", "vmap": "map"}[ens.member_loop]
    shutil.copytree(workdir, tmp_path / "ens")
    tr = EnsembleTrainer(tiny(0), str(tmp_path / "ens"), members=2, member_loop=other)
    state, _ = tr.initial_state()
    assert int(state.step) == 4 and tr.member_loop == other
    batch = _global(next(tr.train_iter), tr.batch_sharding)
    with tr._context():
        got, got_metrics = tr.train_step(jax.tree.map(jax.numpy.copy, state), batch)
        expect, metrics = ens.train_step(state, batch)  # compiled by the fixture's run
    assert int(got.step) == int(expect.step) == 5
    chex.assert_trees_all_close(jax.device_get(got), jax.device_get(expect), atol=1e-6,
                                rtol=1e-6)
    chex.assert_trees_all_close(jax.device_get(got_metrics), jax.device_get(metrics),
                                atol=1e-6, rtol=1e-6)


# 9.4-11.2 s with its fixtures' runs in three suites on the 2-core Zen 3 (2026-12-01; the
# ensemble's serves no other test the README's command runs): CI's slow part runs it
@pytest.mark.slow
def test_workdir_must_hold_the_same_members(plain, ensemble):
    workdir, _, _ = ensemble
    with pytest.raises(CheckpointMismatch, match=r"2-member ensemble, not of a 3.*--members 2"):
        EnsembleTrainer(tiny(), workdir, members=3)
    with pytest.raises(CheckpointMismatch, match=r"a plain run, not of a 2-member ensemble"):
        EnsembleTrainer(tiny(1), plain, members=2)
    with pytest.raises(CheckpointMismatch, match="holds a seed ensemble"):
        checkpoint_ensemble(tiny(), workdir, 2)
    with pytest.raises(ValueError, match="members = 0"):
        EnsembleTrainer(tiny(), workdir, members=0)
    with pytest.raises(CheckpointMismatch, match=r"ensemble.members: saved 2, now 1"):
        Trainer(tiny(), workdir)  # a plain run pointed at an ensemble


def test_a_lost_or_cut_members_file(ensemble, tmp_path):
    """A bug hunt (session 96): an ensemble that lost members.json was called "a plain run"
    (its config.json counts the members), and a cut one was a JSON error naming no file."""
    from hpnlp.train.ensemble import MEMBERS_FILE, _check_members_file
    workdir = str(tmp_path / "ens")
    os.makedirs(os.path.join(workdir, "checkpoints", "3"))
    shutil.copy(os.path.join(ensemble[0], "config.json"), workdir)
    _check_members_file(workdir, 2)  # no members.json: the checkpoints' own count
    with pytest.raises(CheckpointMismatch, match=r"2-member ensemble, not of a 3.*--members 2"):
        _check_members_file(workdir, 3)
    with open(os.path.join(workdir, MEMBERS_FILE), "w") as f:
        f.write('{"members": 2, "seeds": [0,\n')
    with pytest.raises(CheckpointMismatch, match=r"ens/members.json cannot be read .*delete it"):
        _check_members_file(workdir, 2)


def test_a_one_member_ensemble_resumes_without_members_json(tmp_path):
    """Review r3: a 1-member ensemble's shape signature was a plain run's (members 1), so with
    members.json lost `--members 1` was refused as "a plain run", and a plain run on its
    workdir was told to resume with its own config. Its signature marks it stacked; one saved
    before the mark resumes as before where its members.json says 1, and gains the mark."""
    from hpnlp.train.checkpoint import Checkpointer, StackedMembers
    from hpnlp.train.ensemble import MEMBERS_FILE, _check_members_file
    cfg, workdir = tiny(0), str(tmp_path / "ens1")
    ens = EnsembleTrainer(cfg, workdir, members=1)
    state, _ = ens.initial_state()  # saved as the run would save it, without a step's compile
    ens.checkpointer.save(1, state.replace(step=state.step + 1), ens.train_iter.get_state(), {})
    ens.checkpointer.close()
    config_json = os.path.join(workdir, "config.json")
    with open(config_json) as f:
        saved = json.load(f)
    assert saved["shape_signature"]["ensemble.stacked"] is True
    os.remove(os.path.join(workdir, MEMBERS_FILE))
    with pytest.raises(CheckpointMismatch, match=r"It holds a seed ensemble of 1: train or "
                       r"evaluate it with python -m hpnlp.train.ensemble --members 1\."):
        Trainer(cfg, workdir)  # hpnlp.main's
    resumed = EnsembleTrainer(cfg, workdir, members=1)
    state, _ = resumed.initial_state()
    assert int(state.step) == 1 and state.rng.shape[0] == 1
    os.remove(os.path.join(workdir, MEMBERS_FILE))
    with pytest.raises(CheckpointMismatch, match=r"1-member ensemble, not of a 2.*--members 1"):
        _check_members_file(workdir, 2)
    # saved before the mark: its members.json tells it from a plain run
    del saved["shape_signature"]["ensemble.stacked"]
    with open(config_json, "w") as f:
        json.dump(saved, f)
    with open(os.path.join(workdir, MEMBERS_FILE), "w") as f:
        json.dump({"members": 1, "seeds": [0]}, f)
    checkpointer = Checkpointer(workdir, resumed.cfg, keep=3, members=StackedMembers(1))
    assert checkpointer._pending_config["shape_signature"]["ensemble.stacked"] is True
    checkpointer.close()


def test_a_one_member_ensemble_saved_before_the_mark_is_read_as_one(tmp_path, capsys):
    """Review: `run_members` read a 1-member ensemble saved before the "ensemble.stacked" mark
    (its members.json says 1) as a plain run's int 1, so generate and distill took its stacked
    [1, ...] arrays for one model's, and hpnlp.main's Trainer passed its check into the
    restore. It is a stacked 1, as its own resume reads it; a plain run is still the int 1.
    (Nothing builds: the checks come first.)"""
    import importlib
    from hpnlp.compress.distill import TeacherCarry
    from hpnlp.config import validate
    from hpnlp.train.checkpoint import Checkpointer, StackedMembers, is_stacked, run_members
    from hpnlp.train.ensemble import MEMBERS_FILE
    cfg, workdir = validate(tiny(0), num_devices=1), str(tmp_path / "ens")  # as a run's
    Checkpointer(workdir, cfg, keep=1, members=StackedMembers(1)).close()
    os.makedirs(os.path.join(workdir, "checkpoints", "1"))  # as if a step were saved
    config_json = os.path.join(workdir, "config.json")
    with open(config_json) as f:
        saved = json.load(f)
    del saved["shape_signature"]["ensemble.stacked"]  # as written before the mark
    with open(config_json, "w") as f:
        json.dump(saved, f)
    with open(os.path.join(workdir, MEMBERS_FILE), "w") as f:
        json.dump({"members": 1, "seeds": [0]}, f)
    members = run_members(workdir)
    assert members == 1 and isinstance(members, StackedMembers) and is_stacked(members)
    with pytest.raises(CheckpointMismatch, match=r"It holds a seed ensemble of 1: train or "
                       r"evaluate it with python -m hpnlp.train.ensemble --members 1\."):
        Trainer(cfg, workdir)  # hpnlp.main's
    generate = importlib.import_module("hpnlp.models.generate")  # the module, not the function
    assert generate.main(["--workdir", workdir, "--prompt", "x", "--greedy"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --workdir {workdir}: a seed ensemble of 1 member; generate decodes one LM run "
        "(train a plain one with python -m hpnlp.main)")
    scope = {}
    exec(TINY, scope)
    student = scope["get_config"]()
    student.train.distill.teacher = workdir
    with pytest.raises(ConfigError, match=r"holds a seed ensemble of 1 member \(EnsembleTrainer"):
        TeacherCarry(validate(from_configdict(student), num_devices=1))  # as a run builds it
    with open(config_json) as f:  # read, not rewritten
        assert "ensemble.stacked" not in json.load(f)["shape_signature"]
    plain = str(tmp_path / "plain")  # the same signature, without members.json
    Checkpointer(plain, cfg, keep=1).close()
    assert type(run_members(plain)) is int and run_members(plain) == 1


def test_a_plain_run_after_an_unsaved_one_member_ensemble_stays_plain(tmp_path):
    """Review r1: a `--members 1` ensemble stopped before its first checkpoint (or whose
    checkpoints were deleted) left members.json saying 1, and a plain run trained there after
    it had an unmarked signature beside it, so it was read as a 1-member ensemble saved before
    the mark: its resume refused ("It holds a seed ensemble of 1"), generate and distill too.
    A new plain run's config removes the leftover. (Nothing builds: the checks come first.)"""
    from hpnlp.config import validate
    from hpnlp.train.checkpoint import Checkpointer, StackedMembers, run_members
    from hpnlp.train.ensemble import MEMBERS_FILE
    cfg, workdir = validate(tiny(0), num_devices=1), str(tmp_path / "w")  # as a run's
    Checkpointer(workdir, cfg, keep=1, members=StackedMembers(1)).close()  # the ensemble's
    with open(os.path.join(workdir, MEMBERS_FILE), "w") as f:  # as EnsembleTrainer writes it
        json.dump({"members": 1, "seeds": [0]}, f)
    Checkpointer(workdir, cfg, keep=1).close()  # the plain run over it (hpnlp.main's)
    assert not os.path.exists(os.path.join(workdir, MEMBERS_FILE))
    os.makedirs(os.path.join(workdir, "checkpoints", "2"))  # as if it saved a step
    assert type(run_members(workdir)) is int and run_members(workdir) == 1
    Checkpointer(workdir, cfg, keep=1).close()  # its resume: no CheckpointMismatch


# 3.4 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_members_carry_their_own_pruning_masks(tmp_path):
    """A carry (here pruning's masks) works per member: each member's pruned weights are
    exactly zero after steps, at the sparsity asked for, with masks of its own weights."""
    from flax import traverse_util

    from hpnlp.compress import prune
    cfg = tiny(0, steps=2, eval_every=0, checkpoint_every=0)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0),
                              train=dataclasses.replace(cfg.train, prune=dataclasses.replace(
                                  cfg.train.prune, method="magnitude", sparsity=0.5)))
    ens = EnsembleTrainer(cfg, str(tmp_path), members=2)
    state, _ = ens.initial_state()
    with ens._context():
        for _ in range(2):
            state, _ = ens.train_step(state, _global(next(ens.train_iter), ens.batch_sharding))
    masks_of = []
    for i in range(2):
        member = jax.device_get(ens.member_state(state, i))
        masks, flat = member.carry["prune"]["masks"], traverse_util.flatten_dict(member.params)
        assert masks
        for k, mask in masks.items():
            assert not np.any(np.asarray(flat[tuple(k.split("/"))])[~np.asarray(mask)])
        assert prune.sparsity_report(member.params, masks)["total"] == pytest.approx(0.5, abs=0.02)
        masks_of.append(masks)
    assert any(not np.array_equal(masks_of[0][k], masks_of[1][k]) for k in masks_of[0])
    (c,) = [c for c in ens.carries if c.name == "prune"]  # the summary's report: per member
    got = c.report(state.carry["prune"], state.params)
    assert got["last_update_step"] == [0, 0] and got["target"] == [0.5, 0.5]
    assert got["sparsity"] == pytest.approx(0.5, abs=0.02)


# 4.0 and 2.5 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
@pytest.mark.parametrize("member_loop", ["map", "vmap"])
def test_members_draw_random_pruning_from_their_own_seeds(tmp_path, member_loop):
    """A bug hunt (session 103): random pruning drew every member's scores from cfg.seed, so
    the members pruned the same entries and member 1 was not the plain run of seed 1. Member
    i's masks after a step are those the plain run of seed i draws (its PruneCarry's)."""
    from hpnlp.compress.prune import PruneCarry

    def random_pruning(seed):
        cfg = tiny(seed, steps=2, eval_every=0, checkpoint_every=0)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0),
                                   train=dataclasses.replace(cfg.train, prune=dataclasses.replace(
                                       cfg.train.prune, method="random", sparsity=0.5)))
    ens = EnsembleTrainer(random_pruning(0), str(tmp_path), members=2, member_loop=member_loop)
    state, _ = ens.initial_state()
    start = [jax.device_get(ens.member_state(state, i)) for i in range(2)]
    with ens._context():
        state, _ = ens.train_step(state, _global(next(ens.train_iter), ens.batch_sharding))
    (member_carry,) = [c for c in ens.carries if c.name == "prune"]
    got = [jax.device_get(ens.member_state(state, i)).carry["prune"]["masks"] for i in range(2)]
    for i in range(2):
        plain = PruneCarry(random_pruning(i))  # the plain run's carry, as its Trainer's
        plain.products = member_carry.products
        expect = jax.jit(lambda value, params: plain.after_update(
            value, params, None, jax.numpy.int32(0))[1]["masks"])(
            start[i].carry["prune"], start[i].params)
        assert sorted(got[i]) == sorted(expect)
        for k in expect:
            np.testing.assert_array_equal(got[i][k], expect[k], err_msg=f"member {i}: {k}")
    assert any(not np.array_equal(got[0][k], got[1][k]) for k in got[0])


def test_ensembles_refuse_models_whose_evaluation_reads_more_than_params(tmp_path):
    cfg = tiny()
    memory = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, memory=dataclasses.replace(cfg.model.memory, size=16)))
    with pytest.raises(ConfigError, match="`model.memory.size`"):
        EnsembleTrainer(memory, str(tmp_path / "a"), members=2)
    stream_xl = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, arch="transformer_xl", mem_len=8),
        data=dataclasses.replace(cfg.data, batching="stream"))
    with pytest.raises(ConfigError, match=r"`data.batching`.*the checkpoints of a run trained "
                       r"on a stream cannot be combined \(evaluate each alone\), and a seed "
                       r"ensemble \(--members\) of this model can train on "
                       r"data.batching='pack' with model.mem_len=0, where it carries no memory$"):  # (a fix that
        checkpoint_ensemble(stream_xl, str(tmp_path / "b"), 2)  # works: review, session 115)


# 3.0 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_classifier_members_and_ensemble(tmp_path):
    """Per-example predictions: members at their (different) inits, each equal to the
    classifier's own evaluate."""
    cd = default_configdict()
    cd.data.update(task="listops", seq_len=64, listops_num_train=64, listops_num_eval=32,
                   listops_min_length=16, listops_max_length=64)
    cd.model.update(kind="classifier", width=32, depth=1, num_heads=2, mlp_dim=64, max_len=64)
    cd.train.update(steps=4, batch_size=8, warmup_steps=1, eval_batches=2, progress=False)
    ens = EnsembleTrainer(from_configdict(cd), str(tmp_path), members=3)
    state, _ = ens.initial_state()
    report = ens.evaluate(state)
    check_report(report, 3)
    alone = [Trainer.evaluate(ens, ens.member_state(state, i)) for i in range(3)]
    check_members(report["members"], alone)
    assert len({m["loss"] for m in report["members"]}) == 3  # different seeds
    # Trainer.evaluate's `batches` taken (a review, session 118: a TypeError)
    counted, real = [], Trainer.eval_sums

    def eval_sums(self, *args, **kw):
        counted.append(kw.get("batches"))
        return real(self, *args, **kw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Trainer, "eval_sums", eval_sums)
        check_report(ens.evaluate(state, batches=1), 3)
    assert counted == [1]


def test_checkpoint_ensemble(plain):
    report = checkpoint_ensemble(tiny(1), plain, 2)
    assert report["steps"] == [2, 4] and "weight_average" not in report
    check_report(report, 2)
    evals = lines(plain, eval=True)  # the run's own evaluations of those checkpoints
    check_members(report["members"], [evals[2], evals[4]])


@pytest.fixture(scope="module")
def averaged(plain):
    return weight_average(tiny(1), plain, 2)


def test_weight_average_is_the_mean_of_the_restored_params(plain, averaged):
    report, params = averaged
    assert report["steps"] == [2, 4]
    check_report(report, 2)
    evals = lines(plain, eval=True)
    check_members(report["members"], [evals[2], evals[4]])
    tr = Trainer(tiny(1), plain)
    states = [tr.checkpointer.restore(s, tr.abstract_state)[0] for s in (2, 4)]
    tr.checkpointer.close()
    manual = jax.tree.map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2,
                          states[0].params, states[1].params)
    chex.assert_trees_all_close(jax.device_get(params), manual, atol=1e-7, rtol=1e-6)
    wa = report["weight_average"]
    assert np.isfinite(wa["loss"]) and 0.0 <= wa["accuracy"] <= 1.0
    assert wa["loss"] not in (evals[2]["loss"], evals[4]["loss"])


def test_checkpoint_errors(plain, tmp_path):
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints` = 3 .*keep_checkpoints=4"):
        checkpoint_ensemble(tiny(1), plain, 4)
    with pytest.raises(NotEnoughCheckpoints, match=r"has 2 checkpoint\(s\) \(steps \[2, 4\]\)"):
        weight_average(tiny(1, keep_checkpoints=5), plain, 3)
    with pytest.raises(NotEnoughCheckpoints, match="no run in workdir"):
        checkpoint_ensemble(tiny(), str(tmp_path / "nothing"), 2)
    with pytest.raises(NotEnoughCheckpoints, match="no run in workdir"):  # not "retrain with
        checkpoint_ensemble(tiny(), str(tmp_path / "nothing"), 4)  # more" (review, s. 115)
    with pytest.raises(ValueError, match="last_k = 0"):
        checkpoint_ensemble(tiny(1), plain, 0)
    # found by the crash hunt: the members were scored on whatever data the command line
    # gave, not the run's own
    other = tiny(1)
    other = dataclasses.replace(other, data=dataclasses.replace(other.data, eval_split="validation"))
    with pytest.raises(ConfigError, match=r"`data.eval_split` = 'validation' is not allowed: the run "
                                          r".* trained with 'eval'"):
        checkpoint_ensemble(other, plain, 2)


def test_checkpoints_are_read_as_a_reader_reads_the_run(plain, capsys):
    """A bug hunt (session 100): another --config's seed was "a different model" and the
    reader was told to delete the run; a run of 4 devices' mesh was refused on 1."""
    from hpnlp.train.ensemble import _restore_last
    cfg = tiny(0)  # the run's own seed is 1
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=2, tensor=2))
    # and the run's own interval of feature redraws, which picks each checkpoint's draw (a
    # review, session 115: the command line's was taken, and a redrawn run scored on draw 0)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, feature_redraw_every=7))
    trainer, steps, _ = _restore_last(cfg, plain, 2)
    assert steps == [2, 4] and trainer.cfg.seed == 1 and trainer.cfg.mesh.tensor == 1
    assert trainer.cfg.train.feature_redraw_every == tiny(1).train.feature_redraw_every != 7
    assert f"read with mesh.data={jax.device_count()}" in capsys.readouterr().err
    other = tiny(1)
    other = dataclasses.replace(other, model=dataclasses.replace(other.model, depth=2))
    with pytest.raises(CheckpointMismatch, match=r"model.depth: saved 1, now 2\)\. Read it with "
                                                 r"the config it was trained with"):
        checkpoint_ensemble(other, plain, 2)


# 8.2, 7.2, 6.9 and 8.2 s in four suites on the 2-core Zen 3 (2026-12-01), the README's command
# over 10 min there from an empty kernel cache: CI's slow part runs it
@pytest.mark.slow
def test_cli_from_checkpoints(plain, averaged, tmp_path):
    config = tmp_path / "tiny_config.py"
    config.write_text(TINY)
    cmd = [sys.executable, "-m", "hpnlp.train.ensemble", "--config", str(config),
           "--workdir", plain, "--config.seed=1", "--from_checkpoints", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for row in ("step 2", "step 4", "member mean", "ensemble", "weight average"):
        assert row in proc.stdout
    saved = json.load(open(os.path.join(plain, "ensemble.json")))
    assert saved == {"mode": "checkpoints", **averaged[0]}
    # without --config, the run's own (its config.json; a README walk: --config was required)
    os.remove(os.path.join(plain, "ensemble.json"))
    own_cmd = [sys.executable, "-m", "hpnlp.train.ensemble", "--workdir", plain]
    own = subprocess.run(own_cmd + ["--from_checkpoints", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert own.returncode == 0 and own.stdout == proc.stdout, own.stderr[-2000:]
    assert json.load(open(os.path.join(plain, "ensemble.json"))) == saved
    bad = subprocess.run(own_cmd + ["--members", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "hpnlp: error: --config is required to train a seed ensemble: the experiment file, "
        "e.g. --config experiments/rnn_lm.py")
    bad = subprocess.run(cmd[:-2], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "exactly one of --members" in bad.stderr
    # one line, not absl's usage dump of 49 (a README walk: --members 0)
    bad = subprocess.run(cmd[:-2] + ["--members", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "hpnlp: error: --members 0: must be at least 1")
    bad = subprocess.run(cmd + ["--member_loop", "map"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "hpnlp: error: --member_loop map: only for --members M (how a seed ensemble's training "
        "runs its members); drop it")
    # a field of no config is one line, as hpnlp.main says it (a README walk: 55 lines)
    bad = subprocess.run(cmd + ["--config.train.stepz=3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().startswith(
        "hpnlp: error: --config.train.stepz: no such config field: 'stepz'"), bad.stderr[-2000:]


# 6.0 s in the suite on the 2-core Zen 3 (2026-12-01 evening, the README command over 10 min):
# CI's slow part runs it (the default run keeps the ensembles' other refusal)
@pytest.mark.slow
def test_ensembles_refuse_a_bi_encoder_and_a_file_workdir_in_one_line(tmp_path):
    """Found by the crash hunt: --from_checkpoints on a bi-encoder run failed deep in flax
    (BiEncoder has no `logits`), and a --workdir that is a file as a bare FileExistsError."""
    from hpnlp.train.ensemble import check_ensemble_evaluates
    cfg = tiny()
    bi = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="bi_encoder"))
    with pytest.raises(ConfigError, match="`model.kind` = 'bi_encoder' is not allowed in an ensemble"):
        check_ensemble_evaluates(bi)
    config = tmp_path / "tiny_config.py"
    config.write_text(TINY)
    (tmp_path / "f").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "hpnlp.train.ensemble", "--config", str(config),
                           "--workdir", str(tmp_path / "f"), "--members", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"hpnlp: error: --workdir {tmp_path / 'f'} is a file, not a folder; give a folder")


def test_a_refused_ensemble_leaves_no_empty_workdir(tmp_path):
    """Review r1: `--members M` made its --workdir before the config was refused (here a
    bi-encoder's), and left it empty; hpnlp.train.run removes a folder it made. The CLI's
    trainer (`seed_ensemble`) does too, and keeps a folder that was there. Refused before
    anything builds."""
    from hpnlp.train.ensemble import seed_ensemble
    cfg = tiny()
    bi = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="bi_encoder"))
    for made in (True, False):
        workdir = tmp_path / f"new{made}"
        if not made:
            workdir.mkdir()
        with pytest.raises(ConfigError, match="'bi_encoder' is not allowed in an ensemble"):
            seed_ensemble(bi, str(workdir), 2)
        assert workdir.exists() is not made
    # but not one another process holds (a review, session 115, of session 114's fix to
    # hpnlp.train.run): a seed ensemble that made the folder and lost the race for its lock
    # removed it, the winner's lock with it
    from hpnlp.train import ensemble as ensemble_lib
    from hpnlp.paths import WorkdirBusy
    holders = []

    def lost_race(cfg, workdir, members, member_loop=None):
        holders.append(subprocess.Popen(
            [sys.executable, "-c", "import fcntl, os, time\n"
             f"fd = os.open({workdir!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
             "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True))
        assert holders[-1].stdout.readline().strip() == "held"
        raise WorkdirBusy("busy")
    race = tmp_path / "race"
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ensemble_lib, "EnsembleTrainer", lost_race)
            with pytest.raises(WorkdirBusy):
                seed_ensemble(cfg, str(race), 2)
        assert race.is_dir()
    finally:
        for p in holders:
            p.kill()
            p.wait()


def test_the_cli_report_is_written_whole_or_not_at_all(tmp_path):
    """Review r1: ensemble.json was opened and dumped in place, so a write cut short (a kill;
    here a value JSON refuses) left half a file over the last report."""
    from hpnlp.train.ensemble import _write_report
    _write_report(str(tmp_path), {"mode": "seeds", "loss": 1.0})
    with pytest.raises(TypeError):
        _write_report(str(tmp_path), {"mode": "seeds", "loss": object()})
    with open(tmp_path / "ensemble.json") as f:
        assert json.load(f) == {"mode": "seeds", "loss": 1.0}
    assert os.listdir(tmp_path) == ["ensemble.json"]
    # a failed write is one line naming the file (a review, session 115: a traceback)
    from hpnlp.train import ensemble as ensemble_lib
    from hpnlp.train.checkpoint import CheckpointSaveFailed

    def full(*_, **__):
        raise OSError(28, "No space left on device")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ensemble_lib, "write_json", full)
        with pytest.raises(CheckpointSaveFailed, match=r"writing .*ensemble\.json failed "
                           r"\(OSError: \[Errno 28\] No space left on device\)"):
            _write_report(str(tmp_path), {"mode": "seeds", "loss": 2.0})
        # a run's checkpoints read: a rerun reads them again, resuming nothing (a review,
        # session 117: "a rerun of the same command resumes from" step N)
        with pytest.raises(CheckpointSaveFailed, match=r"ensemble\.json failed \(OSError: .*"
                           r"and rerun the same command \(it reads the checkpoints again\)$"):
            _write_report(str(tmp_path), {"mode": "checkpoints", "loss": 2.0}, read=True)


# 3.1 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_cli_refuses_profile_with_from_checkpoints(tmp_path):
    """A review (r4): `--from_checkpoints K --profile DIR` was taken, and DIR left empty (only
    --members' training is traced); refused before the run is read, as --member_loop is."""
    proc = subprocess.run([sys.executable, "-m", "hpnlp.train.ensemble", "--workdir",
                           str(tmp_path / "run"), "--from_checkpoints", "1", "--profile",
                           str(tmp_path / "p")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"hpnlp: error: --profile {tmp_path / 'p'}: traces a few training steps of --members M, "
        "and --from_checkpoints K trains none; drop it"), proc.stderr[-2000:]
    assert not (tmp_path / "p").exists()


def test_member_metrics_reduce_over_the_member_axis_only():
    """Found in review: an MoE ensemble's per-layer, per-expert loads ([M, layers, X])
    were summed to a scalar, and its first log line failed."""
    from hpnlp.train.ensemble import _reduce_members
    load = np.arange(12.0).reshape(2, 3, 2)
    got = _reduce_members({"loss": np.asarray([1.0, 2.0]), "moe_load": load,
                           "grad_norm": np.asarray([1.0, 3.0]), "tokens": np.asarray([5, 5])})
    np.testing.assert_array_equal(got["moe_load"], load.sum(0))
    assert float(got["loss"]) == 3.0 and float(got["grad_norm"]) == 2.0 and int(got["tokens"]) == 5


# a 4-step pruned run and its average: CI's slow part runs it
@pytest.mark.slow
def test_a_pruned_runs_weight_average_keeps_its_newest_masks(tmp_path):
    """A review (session 117): the average of a pruned run's checkpoints kept every weight
    any of them kept, a denser model than each, scored as one of the run's. It is masked by
    the newest checkpoint's masks: zero where those prune, the plain mean elsewhere."""
    import dataclasses

    from hpnlp.config import PruneConfig
    cfg = tiny(1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, prune=PruneConfig(
        method="magnitude", sparsity=0.5, schedule="cubic", start_step=1, every=1)))
    run(cfg, str(tmp_path))
    report, params = weight_average(cfg, str(tmp_path), 2)
    assert report["steps"] == [2, 4]
    tr = Trainer(cfg, str(tmp_path), read_only=True)
    states = [tr.checkpointer.restore(s, tr.abstract_state)[0] for s in (2, 4)]
    tr.checkpointer.close()
    masks = {k: np.asarray(m) for k, m in states[1].carry["prune"]["masks"].items()}
    assert masks
    flat = {"/".join(k): np.asarray(v) for k, v in
            flax.traverse_util.flatten_dict(jax.device_get(params)).items()}
    old, new = ({"/".join(k): np.asarray(v) for k, v in flax.traverse_util.flatten_dict(
        s.params).items()} for s in states)
    for k, mask in masks.items():
        assert not flat[k][~mask].any(), k
        np.testing.assert_allclose(flat[k][mask], ((old[k] + new[k]) / 2)[mask], rtol=1e-6,
                                   atol=1e-7)
    assert any((old[k][~m] != 0).any() for k, m in masks.items())  # the earlier kept more
