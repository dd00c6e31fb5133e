"""Training loop edges (hpnlp/train/loop.py) a review (r12) found: early stopping at the last
step, --profile's trace when a run fails or pauses, and a read-only Trainer's run()."""

import glob
import os
import time

import jax
import pytest
from test_train import read_jsonl, tiny

from hpnlp.config import from_configdict
from hpnlp.train import Trainer, run
from hpnlp.train import loop as loop_lib


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


def _traces(folder):
    return glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))


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


def test_profile_s_trace_write_is_not_training_time(tmp_path, monkeypatch):
    """A review (r12): stop_trace at step start+8 (it writes the trace) was timed as
    training, in the window's rate and the summary's. The profiler is faked here, its
    write half a second's sleep: 8 tiny steps take far less."""
    traced = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda folder: traced.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace",
                        lambda: (traced.append("stop"), time.sleep(0.5)))
    cd = tiny(steps=9, checkpoint_every=0, eval_batches=1, log_every=9)
    summary = run(cd, str(tmp_path / "run"), profile_dir=str(tmp_path / "p"))
    assert traced == ["start", "stop"]  # at step 8 (3-8 traced)
    timed = summary["throughput"]["timed_steps"]
    assert timed == 8 and summary["throughput"]["steps_per_sec"] > timed / 0.5
    line, = [l for l in read_jsonl(tmp_path / "run" / "metrics.jsonl") if not l.get("eval")]
    assert line["steps_per_sec"] > timed / 0.5
