"""Training loop edges (hpnlp/train/loop.py) reviews (r12, d1) found: early stopping at the
last step, --profile's trace when a run fails or pauses, a read-only Trainer's run(), a
checkpoint's one-batch check, and what makes another held-out set."""

import glob
import json
import os
import time

import jax
import numpy as np
import pytest
from test_train import read_jsonl, tiny

from hpnlp.config import from_configdict
from hpnlp.train import Trainer, run
from hpnlp.train import loop as loop_lib


# 3.9 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, session 109, --durations:
# the suite read 6 min 12 s for 1775 tests in CI): CI's slow part runs it
@pytest.mark.slow
def test_patience_reached_at_the_last_step_is_no_early_stop_and_a_longer_rerun_trains_on(
        tmp_path, monkeypatch, capsys):
    """A review (r12): the patience-th eval without a better loss at step train.steps set
    `stopped_early`, where the steps had run out, so the summary said early stopping ended
    the run, and a rerun with more steps trained nothing. Its bad evals stay counted: the
    longer run stops at its next. A read-only Trainer's run() is refused, and writes
    nothing. The evals are scripted: nothing else compiles but the train step."""
    scores = iter([1.0, 0.5, 0.6, 0.7])  # steps 2, 4, 6 and the last, 7
    monkeypatch.setattr(Trainer, "evaluate", lambda self, state: {"loss": next(scores)})
    cd = tiny(steps=7, eval_every=2, early_stopping_patience=2, eval_batches=1,
              checkpoint_every=0)
    first = run(cd, str(tmp_path))
    assert first["final_step"] == 7 and not first["stopped_early"]
    assert first["best_eval"] == {"step": 4, "loss": 0.5}
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    cd.train.steps = 12
    reader = Trainer(from_configdict(cd), str(tmp_path), read_only=True)
    with pytest.raises(ValueError, match=r"^this Trainer of .* was built read_only=True, to "
                       r"read the run; build Trainer\(cfg, workdir\) to train it$"):
        reader.run()
    assert (tmp_path / "metrics.jsonl").read_bytes() == metrics
    capsys.readouterr()
    scores = iter([0.8])  # step 8: the third eval without a better loss
    longer = run(cd, str(tmp_path))
    assert "stopped early there" not in capsys.readouterr().err
    assert longer["final_step"] == 8 and longer["stopped_early"]
    assert longer["best_eval"] == {"step": 4, "loss": 0.5}


# a short run of a tiny model: 6 s on the Xeon model 207; CI's slow part runs it
@pytest.mark.slow
def test_a_signal_at_the_eval_that_stops_early_finishes_the_run(tmp_path, monkeypatch):
    """A review (session 116): a SIGTERM at a step whose eval reached the patience saved the
    step stopped early, then ended the run as stopped by the signal (exit 143, no summary),
    and its rerun trained nothing. It finishes as an early stop. The evals are scripted."""
    from hpnlp.train import stop as stop_lib
    scores = iter([1.0, 1.5, 1.6])  # steps 2, 4, 6: two evals without a better loss at 6
    monkeypatch.setattr(Trainer, "evaluate", lambda self, state, **kw: {"loss": next(scores)})
    calls = []
    monkeypatch.setattr(stop_lib.StopSignals, "reached",  # a SIGTERM during step 6
                        lambda self, last=False: calls.append(1) or len(calls) == 6)
    cd = tiny(steps=10, eval_every=2, early_stopping_patience=2, eval_batches=1,
              checkpoint_every=0)
    summary = run(cd, str(tmp_path))
    assert summary["stopped_early"] and summary["final_step"] == 6
    assert json.load(open(tmp_path / "summary.json"))["final_step"] == 6


def _traces(folder):
    return glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))


# 2.8 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_profile_writes_the_trace_of_a_run_that_fails_while_tracing(tmp_path, monkeypatch):
    """A review (r12): only Ctrl-C stopped the trace of a run that ended in the traced steps
    (3-8), so a divergence's trace (the one worth reading) was never written, and the
    process's next start_trace failed ("Profile has already been started")."""
    real, calls = loop_lib._global, []

    def fail_at_step_5(batch, sharding):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("a device lost at step 5")
        return real(batch, sharding)
    monkeypatch.setattr(loop_lib, "_global", fail_at_step_5)
    cd = tiny(steps=6, checkpoint_every=0, eval_batches=1)
    with pytest.raises(RuntimeError, match="a device lost at step 5"):
        run(cd, str(tmp_path / "run"), profile_dir=str(tmp_path / "p"))
    assert _traces(str(tmp_path / "p"))
    jax.profiler.start_trace(str(tmp_path / "q"))  # the profiler is free
    jax.profiler.stop_trace()


# 2.4 s on the 2-core AMD EPYC Zen 4 (2026-12-07): CI's slow part runs it
@pytest.mark.slow
def test_an_error_in_the_loop_waits_for_the_save_under_way(tmp_path, monkeypatch):
    """A review (session 117): an error other than Ctrl-C or a divergence left the loop with
    a checkpoint's save under way, which the CLI's exit (and a multi-process run's peers)
    then killed, the workdir's lock released while it wrote: the save completes first."""
    from hpnlp.train.checkpoint import Checkpointer
    real, calls, waited = loop_lib._global, [], []

    def fail_at_step_3(batch, sharding):  # steps 1, 2, step 2's checkpoint check, step 3
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("a shard unreadable at step 3")
        return real(batch, sharding)
    monkeypatch.setattr(loop_lib, "_global", fail_at_step_3)
    wait = Checkpointer.wait
    monkeypatch.setattr(Checkpointer, "wait", lambda self: (
        waited.append(self.manager.is_saving_in_progress()), wait(self)))
    cd = tiny(steps=6, checkpoint_every=2, eval_every=0)
    with pytest.raises(RuntimeError, match="a shard unreadable at step 3"):
        run(cd, str(tmp_path / "run"))
    assert waited and sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2"]


# 2.8 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_profile_s_trace_write_is_not_training_time(tmp_path, monkeypatch):
    """A review (r12): stop_trace at step start+8 (it writes the trace) was timed as
    training, in the window's rate and the summary's. The profiler is faked here, its write
    an hour on the loop's clock (which it moves on, sleeping not at all): whatever the 8
    tiny steps take, the rates leave out that hour (a review, d1: a half-second sleep
    asserted 8 steps took under half a second, which a loaded machine may not give)."""
    class Clock:  # the loop's `time`, its perf_counter moved on by the fake writes
        skew = 0.0

        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter(self):
            return time.perf_counter() + self.skew
    clock, traced, hour = Clock(), [], 3600.0

    def stop_trace():
        traced.append("stop")
        clock.skew += hour
    monkeypatch.setattr(loop_lib, "time", clock)
    monkeypatch.setattr(jax.profiler, "start_trace", lambda folder: traced.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", stop_trace)
    # nor the wait for the last step's save, an hour too (a review, session 115)
    from hpnlp.train.checkpoint import Checkpointer
    real_wait = Checkpointer.wait

    def slow_wait(self):
        clock.skew += hour
        return real_wait(self)
    monkeypatch.setattr(Checkpointer, "wait", slow_wait)
    cd = tiny(steps=9, checkpoint_every=0, eval_batches=1, log_every=9)
    summary = run(cd, str(tmp_path / "run"), profile_dir=str(tmp_path / "p"))
    assert traced == ["start", "stop"]  # at step 8 (3-8 traced)
    timed = summary["throughput"]["timed_steps"]
    assert timed == 8 and summary["throughput"]["steps_per_sec"] > timed / hour
    line, = [l for l in read_jsonl(tmp_path / "run" / "metrics.jsonl") if not l.get("eval")]
    assert line["steps_per_sec"] > timed / hour


def test_a_checkpoint_s_one_batch_check_that_fails_saves_nothing_and_checks_the_loss_alone(
        tmp_path, monkeypatch, capsys):
    """A review (d1): at a checkpoint step with no eval, the one-batch eval that checks the
    parameters before they are saved (`check_unevaluated`) saved them when it failed (an
    unreadable shard, out of memory), unchecked, as good: the rerun resumed from them and
    nothing checked them again. Not saved; the rerun resumes from the checkpoint before. It
    checks only the loss, as an eval step does: a statistic that is not finite (a max, a
    ratio) stopped runs at checkpoint steps alone. The evals are scripted: nothing else
    compiles but the train step."""
    checks = []

    def eval_sums(self, state, eval_step=None, memory_step=None, *, batches=None):
        assert batches == 1  # (no eval step here: the checkpoints' checks alone)
        checks.append(int(state.step))
        if len(checks) == 2:
            raise OSError("an unreadable eval shard")
        return {"loss": np.float32(3.0), "weight": np.float32(2.0), "ratio": np.float32(np.inf)}
    monkeypatch.setattr(Trainer, "eval_sums", eval_sums)
    cd = tiny(steps=3, checkpoint_every=1, eval_batches=1, warmup_steps=1)
    with pytest.raises(OSError, match="an unreadable eval shard"):
        run(cd, str(tmp_path))
    assert checks == [1, 2]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    # and it says so (a re-read, d3: the raw error alone said nothing of the steps dropped)
    assert ("the one-batch check of step 2's parameters failed, so they are not saved; a "
            "rerun resumes from step 1 in ") in capsys.readouterr().err
    state, _ = Trainer(from_configdict(cd), str(tmp_path), read_only=True).initial_state()
    assert int(state.step) == 1


def _scripted_evals(monkeypatch) -> None:
    """Evals that read the state's step as their loss, and a checkpoint's one-batch check
    that passes: nothing compiles but the train step."""
    monkeypatch.setattr(Trainer, "evaluate", lambda self, state, **kw: {
        "loss": float(state.step)})
    monkeypatch.setattr(Trainer, "eval_sums", lambda self, state, *args, batches=None: {
        "loss": np.float32(3.0), "weight": np.float32(2.0)})


def _stopped_at_step_7(cd, workdir: str) -> None:
    """Run `cd` in `workdir` and stop it by Ctrl-C in step 7, after its checkpoint at 6."""
    from hpnlp.train import Interrupted
    tr = Trainer(from_configdict(cd), workdir)
    inner = tr.train_step

    def stopping(state, batch):
        if int(state.step) == 6:
            raise KeyboardInterrupt
        return inner(state, batch)
    tr.train_step = stopping
    with pytest.raises(Interrupted, match="at step 7; the newest checkpoint is step 6 in "):
        tr.run()


# 4.1 and 8.9 s (the first compiles) on one core of the Xeon model 167 stepping 1 beside
# other work (2026-12-06, load 2.7 on 2 cores): CI's slow part runs it
@pytest.mark.slow
@pytest.mark.parametrize("saved_before", [False, True])
def test_a_finished_rerun_from_a_step_saved_without_its_eval_evaluates_that_step(
        tmp_path, monkeypatch, capsys, saved_before):
    """A review (r3): a run stopped after its checkpoint at a step with no eval (6, evals
    every 5), rerun with train.steps lowered to 6, wrote step 5's eval as summary.json's
    eval beside final_step 6. Step 6's eval runs first, logged once, as the run of 6 steps
    ran it; for a checkpoint saved before `last_eval_step`, where the config that saved it
    did not evaluate there. The evals are scripted: nothing else compiles but the train
    step."""
    from hpnlp.train.checkpoint import Checkpointer
    _scripted_evals(monkeypatch)
    if saved_before:
        save = Checkpointer.save
        monkeypatch.setattr(Checkpointer, "save", lambda self, step, state, data, loop: save(
            self, step, state, data, {k: v for k, v in loop.items() if k != "last_eval_step"}))
    cd = tiny(steps=8, eval_every=5, checkpoint_every=6, eval_batches=1, warmup_steps=1)
    _stopped_at_step_7(cd, str(tmp_path))
    cd.train.steps = 6
    capsys.readouterr()
    first = run(cd, str(tmp_path))
    assert "; it was saved without an eval of step 6, which runs first" in \
        capsys.readouterr().err
    again = run(cd, str(tmp_path))
    for summary in (first, again):
        assert (summary["final_step"], summary["eval"]) == (6, {"loss": 6.0})
        assert summary["best_eval"] == {"step": 5, "loss": 5.0}
    assert [(l["step"], l["loss"]) for l in read_jsonl(tmp_path / "metrics.jsonl")
            if l.get("eval")] == [(5, 5.0), (6, 6.0)]
    # and step 6's train line before it, once, as the run of 6 steps wrote it (a review,
    # session 115: the restored window of step 6 was never written)
    assert [(l["step"], bool(l.get("eval"))) for l in read_jsonl(
        tmp_path / "metrics.jsonl")] == [(5, False), (5, True), (6, False), (6, True)]
    # a later run of 8 steps from that checkpoint does not average step 6 into its next line
    cd.train.steps = 8
    run(cd, str(tmp_path))
    train = [l for l in read_jsonl(tmp_path / "metrics.jsonl") if not l.get("eval")]
    assert [l["step"] for l in train] == [5, 6, 8]
    ours = read_jsonl(tmp_path / "metrics.jsonl")
    fresh = str(tmp_path / "fresh")  # the line of 7-8 alone, as an uninterrupted run of
    run(tiny(steps=8, eval_every=5, checkpoint_every=6, eval_batches=1, warmup_steps=1,
             log_every=2), fresh)  # 8 steps logging every 2 writes it (same data, seed)
    want = {l["step"]: l for l in read_jsonl(os.path.join(fresh, "metrics.jsonl"))
            if not l.get("eval")}
    assert [l for l in ours if not l.get("eval")][-1]["loss"] == pytest.approx(
        want[8]["loss"], rel=1e-6)


# two short runs of a tiny model: CI's slow part runs it, as the test above
@pytest.mark.slow
def test_a_finished_rerun_from_a_step_saved_before_any_eval_evaluates_and_logs_it(
        tmp_path, monkeypatch):
    """A review (session 116): a run stopped after its checkpoint at step 6 with no eval
    before it (evals every 10), rerun with train.steps lowered to 6, evaluated step 6 only
    after the logs were closed: no eval line in metrics.jsonl, no best_eval in the summary,
    and the restored window's train line never written. Both now go to the logs, as the run
    of 6 steps wrote them."""
    _scripted_evals(monkeypatch)
    cd = tiny(steps=8, eval_every=10, checkpoint_every=6, eval_batches=1, warmup_steps=1,
              log_every=5)
    _stopped_at_step_7(cd, str(tmp_path))
    cd.train.steps = 6
    summary = run(cd, str(tmp_path))
    assert (summary["final_step"], summary["eval"]) == (6, {"loss": 6.0})
    assert summary["best_eval"] == {"step": 6, "loss": 6.0}
    assert [(l["step"], bool(l.get("eval"))) for l in read_jsonl(
        tmp_path / "metrics.jsonl")] == [(5, False), (6, False), (6, True)]


# two short runs of a tiny model: CI's slow part runs it, as the tests above
@pytest.mark.slow
def test_a_rerun_lowered_to_a_step_saved_mid_window_logs_that_window(tmp_path, monkeypatch):
    """A review (session 117): a run stopped after its checkpoint at step 6, evaluated there
    (evals every 6, logs every 5), rerun with train.steps lowered to 6, never wrote the train
    line of steps 6..6 its checkpoint's window held, which a run of 6 steps writes."""
    _scripted_evals(monkeypatch)
    cd = tiny(steps=8, eval_every=6, checkpoint_every=6, eval_batches=1, warmup_steps=1,
              log_every=5)
    _stopped_at_step_7(cd, str(tmp_path))
    cd.train.steps = 6
    for _ in range(2):  # written once
        assert run(cd, str(tmp_path))["final_step"] == 6
        assert sorted((l["step"], bool(l.get("eval"))) for l in read_jsonl(
            tmp_path / "metrics.jsonl")) == [(5, False), (6, False), (6, True)]


def test_the_held_out_set_counts_its_batch_size_only_where_it_sets_what_is_read():
    """A review (d1): the eval batch size was part of the held-out set with
    train.eval_batches=0 too, where every batch of the split is read (its last completed
    with filler rows), so a resume that changed only train.batch_size said the run
    evaluates on another set, and its best started over. It counts where it sets the
    batches read: a number of them, or the rows an eval stream is cut into."""
    def held_out(eval_batches, batch_size, batching="pack"):
        cd = tiny(eval_batches=eval_batches)
        cd.train.batch_size = batch_size
        cd.data.batching = batching
        return loop_lib.held_out_set(from_configdict(cd))
    assert held_out(0, 8) == held_out(0, 16)
    assert "data.eval_batch_size" not in held_out(0, 8)
    assert held_out(2, 8)["data.eval_batch_size"] == 8 and held_out(2, 8) != held_out(2, 16)
    assert held_out(0, 8, "stream") != held_out(0, 16, "stream")
    # generated ListOps evaluates on its data.listops_num_eval examples (a review, session
    # 116: a resume on another count kept the old set's best); a file's examples are the file's
    cd = tiny()
    cd.data.update(task="listops", seq_len=64, listops_max_length=64)
    sets = [loop_lib.held_out_set(from_configdict(cd))]
    cd.data.listops_num_eval = 500
    sets.append(loop_lib.held_out_set(from_configdict(cd)))
    assert sets[0] != sets[1] and sets[1]["data.listops_num_eval"] == 500
    assert "data.listops_num_eval" not in held_out(0, 8)


def test_a_finished_run_rerun_on_another_held_out_set_keeps_its_best_and_an_old_save_s_batch(
        tmp_path, monkeypatch, capsys):
    """A review (d1): a finished run rerun with another train.eval_batches said its best
    starts over, trained nothing, and its summary lost best_eval (its last eval still the
    old set's). It keeps both. And a run saved while the set counted the eval batch size at
    train.eval_batches=0 resumes at another batch size on the same set, its best kept (not
    said to start over). The evals are scripted: nothing else compiles but the train step."""
    scores = iter([1.0, 0.5])  # steps 2 and 4
    monkeypatch.setattr(Trainer, "evaluate", lambda self, state: {"loss": next(scores)})
    real = loop_lib.held_out_set
    with monkeypatch.context() as patch:  # saved as before the review
        patch.setattr(loop_lib, "held_out_set", lambda cfg: {
            **real(cfg), "data.eval_batch_size": cfg.data.eval_batch_size or cfg.train.batch_size})
        cd = tiny(steps=4, eval_every=2, eval_batches=0, checkpoint_every=0, warmup_steps=1)
        first = run(cd, str(tmp_path))
    assert first["best_eval"] == {"step": 4, "loss": 0.5}
    cd.train.eval_batches = 1
    capsys.readouterr()
    again = run(cd, str(tmp_path))
    assert again["final_step"] == 4 and again["best_eval"] == first["best_eval"]
    assert again["eval"] == first["eval"] == {"loss": 0.5}
    assert "another held-out set" not in capsys.readouterr().err
    cd.train.update(eval_batches=0, steps=8)
    cd.data.eval_batch_size = 4

    def stop(batch, sharding):  # the resume is said before the first step, which is not run
        raise RuntimeError("stopped before step 5")
    monkeypatch.setattr(loop_lib, "_global", stop)
    with pytest.raises(RuntimeError, match="stopped before step 5"):
        run(cd, str(tmp_path))
    err = capsys.readouterr().err
    assert "resuming from step 4" in err and "another held-out set" not in err, err
    # a field the saved set predates (generated ListOps' eval count, session 116) is no change
    with monkeypatch.context() as patch:
        patch.setattr(loop_lib, "held_out_set", lambda cfg: {
            **real(cfg), "data.listops_num_eval": 500})
        with pytest.raises(RuntimeError, match="stopped before step 5"):
            run(cd, str(tmp_path))
    err = capsys.readouterr().err
    assert "resuming from step 4" in err and "another held-out set" not in err, err


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # inf in f32
def test_float16_loss_scale_past_float32_s_range_is_reported_and_growth_is_capped():
    """A review (r10): an init scale past float32's largest was inf in the state, which
    halving never moves: every step skipped, `finite` 1, and the run "finished" untrained.
    An inf scale counts as the floor (FLOOR_SKIPS skips in a row report `finite` 0, which
    stops the loop), and doubling stops at MAX_LOSS_SCALE, short of inf."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax

    from hpnlp.config import TrainConfig
    from hpnlp.train.state import init_state
    from hpnlp.train.step import FLOOR_SKIPS, MAX_LOSS_SCALE, make_train_step

    class Toy(nn.Module):  # a gradient of 1 per token: finite at any finite scale
        @nn.compact
        def __call__(self, batch):
            w = self.param("w", nn.initializers.ones, ())
            return {"loss": jnp.sum(batch["tokens"] * w),
                    "weight": jnp.float32(batch["tokens"].size)}

    batch, tx = {"tokens": jnp.ones((2, 4), jnp.float32)}, optax.sgd(0.0)
    state = init_state(Toy(), tx, jax.random.key(0), batch,
                       loss_scale=float(np.finfo(np.float32).max) * 10)
    step = jax.jit(make_train_step(Toy(), tx, TrainConfig(steps=3, warmup_steps=1,
                                                          loss_scale_period=1)))
    seen = []
    for _ in range(FLOOR_SKIPS):
        state, m = step(state, batch)
        seen.append((float(m["loss_scale"]), float(m["skipped"]), float(m["finite"])))
    assert seen == [(np.inf, 1.0, 1.0)] * (FLOOR_SKIPS - 1) + [(np.inf, 1.0, 0.0)]
    # a clean step at the cap, a full period (1) of them: no doubling past it
    state, m = step(state.replace(loss_scale=jnp.float32(MAX_LOSS_SCALE),
                                  good_steps=jnp.zeros((), jnp.int32)), batch)
    assert (float(m["skipped"]), float(m["finite"])) == (0.0, 1.0)
    assert float(state.loss_scale) == MAX_LOSS_SCALE


# a 2-step run: CI's slow part runs it
@pytest.mark.slow
def test_a_seed_ensemble_member_blown_up_at_an_eval_is_not_saved_as_good(tmp_path, monkeypatch):
    """A review (session 117): the checks read the ensemble's loss alone, whose mean of the
    members' probabilities stayed finite where one member's had overflowed, so the step was
    saved and named good. Each member's loss counts (the evals are scripted)."""
    from hpnlp.train.loop import NonFiniteLoss
    monkeypatch.setattr(Trainer, "evaluate", lambda self, state, **kw: {
        "loss": 1.0, "members": [{"loss": 1.0}, {"loss": float("inf")}]})
    with pytest.raises(NonFiniteLoss, match="eval loss = inf"):
        run(tiny(steps=2, eval_every=2, checkpoint_every=2, warmup_steps=1), str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints" / "2")
