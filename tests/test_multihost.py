"""Multi-host training with 2 real local processes (jax.distributed, gloo CPU collectives):
the same losses as one process, checkpoints that move between process counts either way,
no deadlock at the end, and clear errors for bad multi-host settings.

Every run is `python -m hpnlp.main` in subprocesses, each process with its own timeout;
whatever is still running when a test ends is killed.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from envlib import free_port as _free_port, train_losses as losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY = 12, 6  # checkpoints at 6 and 12; the resumes restart from 6
TIMEOUT = 360  # seconds per run, all its processes together (~30 s each on an idle machine)

TINY = ["--config", "experiments/lm.py:bytes,local", f"--config.train.steps={STEPS}",
        f"--config.train.checkpoint_every={EVERY}", "--config.train.eval_every=0",
        "--config.train.eval_batches=2", "--config.train.warmup_steps=3",
        "--config.train.log_every=1", "--config.train.batch_size=8", "--config.train.progress=False",
        "--config.data.seq_len=32", "--config.model.max_len=32", "--config.model.width=32",
        "--config.model.depth=1", "--config.model.mlp_dim=64", "--config.model.dropout=0.1"]


@contextlib.contextmanager
def sigint_taken():
    """Children started inside take Ctrl-C as from a terminal: a pytest-xdist worker can
    ignore SIGINT, which its children inherit, and Python then takes none (a CI run, session
    97: a Ctrl-C test's process ignored it). A handled signal is reset in the child; an
    ignored one stays ignored (and a preexec_fn would fork a process running JAX's threads)."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def launch():
    """launch(workdir, processes=, devices=, extra=) starts one run and returns a handle
    for `finish`; every process still alive at teardown is killed (by its own pid)."""
    started = []

    def start(workdir, *, processes=1, devices=1, extra=(), each=None, cwds=None, config=None,
              module="hpnlp.main"):
        # `devices` CPU devices per process; `each[i]`: process i's own extra flags;
        # `cwds[i]`: the folder process i starts in (as on its own host), else the repository;
        # `config`: another experiment than TINY's (its overrides still apply)
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")
        if cwds:
            env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
        multi = ["--coordinator", f"127.0.0.1:{_free_port()}",
                 "--num_processes", str(processes)] if processes > 1 else []
        procs = []
        for i in range(processes):
            log = open(f"{workdir}.p{i}.log", "w")
            tiny = [os.path.join(ROOT, a) if cwds and a.startswith("experiments/") else a
                    for a in [TINY[0], config or TINY[1], *TINY[2:]]]
            cmd = [sys.executable, "-m", module, *tiny, *extra, "--workdir", str(workdir),
                   *multi, *(["--process_id", str(i)] if multi else []),
                   *(each[i] if each else ())]  # last: absl takes a flag's last value
            with sigint_taken():
                procs.append((subprocess.Popen(cmd, cwd=cwds[i] if cwds else ROOT, env=env,
                                               stdout=log, stderr=subprocess.STDOUT), log))
        started.extend(procs)
        return procs, time.time() + TIMEOUT

    yield start
    for p, log in started:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def finish(run, *, expect=0) -> list[str]:
    """Wait for every process of a run (until the run's deadline) and return their logs.
    Any other exit code than `expect`, or a timeout, kills the rest and fails with every
    process's log tail."""
    procs, deadline = run
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.time(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
        log.close()
    logs = [open(log.name).read() for _, log in procs]
    if codes != [expect] * len(procs):
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        tails = "\n".join(f"--- process {i} (exit {c}):\n{t[-3000:]}"
                          for i, (c, t) in enumerate(zip(codes, logs)))
        pytest.fail(f"run {procs[0][1].name}: exit codes {codes}, expected {expect}:\n{tails}")
    return logs


def summary(workdir) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def keep_first_checkpoint(src, dst):
    """A copy of workdir `src` whose newest checkpoint is step EVERY (a run stopped there)."""
    shutil.copytree(src, dst)
    shutil.rmtree(os.path.join(dst, "checkpoints", str(STEPS)))


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_move_between_them(tmp_path, launch):
    """The reference is 1 process with 2 simulated devices, so the 2-process runs (1 device
    each) compile the same partitioned program; the only difference is that the cross-device
    sum goes through gloo, and a sum of 2 floats does not depend on order: equal bitwise.
    Dropout masks are drawn for the global batch (threefry is partitionable), so the
    masks are the same too. A 1-process 1-device resume sums each batch on one device in
    another order, which moves losses by ~2e-7 relative: compared at 1e-5."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_one = launch(one, devices=2)
    run_two = launch(two, processes=2)
    finish(run_one)
    logs_two = finish(run_two)  # both processes exit: no one-sided final save or eval

    ref = losses(one)
    assert [s for s, _ in ref] == list(range(1, STEPS + 1))
    # Process 0 alone writes metrics (no line twice), config.json and the summary.
    assert losses(two) == ref
    s_one, s_two = summary(one), summary(two)
    assert (s_two["processes"], s_two["devices"], s_one["processes"]) == (2, 2, 1)
    assert s_two["eval"] == s_one["eval"]
    assert "final_step" in logs_two[0] and "final_step" not in logs_two[1]
    assert os.path.exists(two / "config.json")
    # Saved collectively: one checkpoint of both processes' shards per step.
    assert sorted(map(int, os.listdir(two / "checkpoints"))) == [EVERY, STEPS]

    # 2-process checkpoint -> 1 process (1 device); 1-process checkpoint -> 2 processes.
    # Both continue from step EVERY, data position included, as the uninterrupted run did.
    to_one, to_two = tmp_path / "two_to_one", tmp_path / "one_to_two"
    keep_first_checkpoint(two, to_one)
    keep_first_checkpoint(one, to_two)
    run_to_one = launch(to_one, devices=1)
    run_to_two = launch(to_two, processes=2)
    finish(run_to_one)
    finish(run_to_two)

    for workdir in (to_one, to_two):
        assert summary(workdir)["resumed_from_step"] == EVERY
        assert [s for s, _ in losses(workdir)] == list(range(1, STEPS + 1))
    assert losses(to_two) == ref
    assert summary(to_two)["eval"] == s_one["eval"]
    np.testing.assert_allclose([l for _, l in losses(to_one)], [l for _, l in ref], rtol=1e-5)
    np.testing.assert_allclose(summary(to_one)["eval"]["loss"], s_one["eval"]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_importance_init_ranks_the_same_units_on_two_processes(tmp_path, launch):
    """train.distill.init=importance reads the teacher on the run's first training batches
    as global arrays, sharded like the step's: 2 processes (1 device each) rank the same
    heads, neurons and channels as 1 process with 2 devices, so the distilled students'
    losses are equal bitwise (the reasoning of the test above)."""
    teacher = tmp_path / "teacher"
    finish(launch(teacher, extra=["--config.train.steps=4", "--config.train.checkpoint_every=4",
                                         "--config.train.warmup_steps=1"]))
    student = [f"--config.train.distill.teacher={teacher}", "--config.train.distill.init=importance",
               "--config.train.distill.importance_batches=2", "--config.model.width=16",
               "--config.model.num_heads=2", "--config.model.mlp_dim=32"]
    _same_on_one_and_two_processes(tmp_path, launch, student)
    # init=pca rotates the teacher's weights on the host, which an fsdp axis across the
    # processes splits between them (a review, session 115: each process failed, "spans
    # non-addressable devices")
    os.makedirs(tmp_path / "pca")
    pca = [a.replace("=importance", "=pca") for a in student]
    _same_on_one_and_two_processes(tmp_path / "pca", launch,
                                   [*pca, "--config.mesh.data=1", "--config.mesh.fsdp=2"])


def _same_on_one_and_two_processes(tmp_path, launch, extra):
    """3 steps of the run `extra` describes on 1 process with 2 devices and on 2 processes
    of 1 (in tmp_path/one and tmp_path/two): the same losses, bitwise."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = [*extra, "--config.train.steps=3", "--config.train.checkpoint_every=3",
             "--config.train.warmup_steps=1"]
    run_one = launch(one, devices=2, extra=extra)
    run_two = launch(two, processes=2, extra=extra)
    finish(run_one)
    finish(run_two)
    assert [s for s, _ in losses(one)] == [1, 2, 3]
    assert losses(two) == losses(one)


@pytest.mark.slow  # two runs at once, each ~30 s on the 2-core CPU
def test_a_bi_encoders_pool_metrics_are_measured_on_two_processes(tmp_path, launch):
    """A review (r7): a bi-encoder run of several processes left the held-out pool's
    recall@1/10 and MRR out of every eval, unsaid. Every process now gathers the parameters
    and measures the whole pool: the numbers of 1 process with 2 devices (the same
    parameters, bitwise: the reasoning of the first test)."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["--config.train.steps=3", "--config.train.checkpoint_every=3",
             "--config.train.warmup_steps=1"]
    run_one = launch(one, devices=2, extra=extra, config="experiments/encoder.py:local")
    run_two = launch(two, processes=2, extra=extra, config="experiments/encoder.py:local")
    finish(run_one)
    finish(run_two)
    assert losses(two) == losses(one)
    s_one, s_two = summary(one), summary(two)
    assert (s_two["processes"], s_one["processes"]) == (2, 1)
    assert {"recall@1", "recall@10", "mrr"} <= set(s_two["eval"])
    assert s_two["eval"] == s_one["eval"]


@pytest.mark.slow
def test_merged_experts_are_planned_the_same_on_two_processes(tmp_path, launch):
    """train.init_experts=merged routes the run's first training batches (global arrays)
    through the source and plans the merge on the host: 2 processes (1 device each) merge
    the same experts as 1 process with 2 devices, so the runs' losses are equal bitwise."""
    moe = ["--config.model.moe.top_k=2", "--config.model.moe.router=top_k"]
    source = tmp_path / "source"
    finish(launch(source, extra=[*moe, "--config.model.moe.num_experts=4",
                                 "--config.train.steps=4",
                                 "--config.train.checkpoint_every=4",
                                 "--config.train.warmup_steps=1"]))
    _same_on_one_and_two_processes(tmp_path, launch, [
        *moe, "--config.model.moe.num_experts=2", f"--config.train.init_from={source}",
        "--config.train.init_experts=merged", "--config.train.init_expert_batches=2"])


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_bad_multihost_settings_fail_clearly(tmp_path, launch):
    # A coordinator without a port is refused when flags are parsed, before
    # jax.distributed.initialize could wait for it.
    (bad,) = finish(launch(tmp_path / "bad", extra=["--coordinator", "127.0.0.1",
                                                    "--num_processes", "2"]), expect=1)
    assert "--coordinator=127.0.0.1: must be HOST:PORT" in bad
    assert not os.path.exists(tmp_path / "bad")
    # Found in a README walk: a process started alone waited 5 minutes before it read the
    # config, then aborted with a C++ stack trace. A bad config now fails before the wait...
    alone = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num_processes", "2",
             "--process_id", "1", "--init_timeout", "2"]
    t0 = time.time()
    (bad,) = finish(launch(tmp_path / "alone", extra=[*alone, "--config.model.width=-3"]),
                    expect=1)
    assert "config field `model.width` = -3 is not allowed" in bad and "joining" not in bad
    # ... and the wait ends in one line after --init_timeout seconds
    (bad,) = finish(launch(tmp_path / "alone", extra=alone), expect=1)
    assert time.time() - t0 < 60
    assert bad.splitlines()[-2:] == [
        f"hpnlp: process 1 of 2: joining the run at {alone[1]}, waiting up to 2 s for every "
        "process (--init_timeout)",
        f"hpnlp: error: process 1 of 2: not every process joined at {alone[1]} within 2 s; "
        f"start processes 0 to 1 with the same --coordinator and --num_processes (process 0 "
        f"on the host of {alone[1]}), or raise --init_timeout"], bad
    assert not os.path.exists(tmp_path / "alone")
    # A tensor axis across the 2 processes would replicate the batch over them while each
    # reads half of it: refused by both processes, before compiling, and neither hangs.
    logs = finish(launch(tmp_path / "tensor", processes=2,
                         extra=["--config.mesh.data=1", "--config.mesh.tensor=2"]), expect=1)
    for log in logs:  # (validate's check since session 113, before the Trainer's of its
        # shardings: the same for every process, naming the axis)
        assert ("config field `mesh.tensor` = 2 is not allowed: the batch would not split over "
                "the 2 processes (1 device each): the batch axes (data, fsdp, expert) cut each "
                "batch into 1 shard, not a multiple of the processes") in log, log[-2000:]
        # the axes of the mesh the default rule leaves out, not `expert`, which it splits the
        # batch over
        assert "does not name (tensor) within one process" in log, log[-2000:]
    assert not os.path.exists(tmp_path / "tensor" / "checkpoints")
    # A bug hunt (session 92): processes started with different configs aborted in gloo's
    # C++ "collective mismatch" (another model.width), or would train on (another train.lr).
    # Every process now names the fields after joining, before the workdir is touched.
    logs = finish(launch(tmp_path / "differ", processes=2,
                         each=[[], ["--config.model.width=64", "--config.train.lr=1e-3"]]),
                  expect=1)
    for i, log in enumerate(logs):
        assert log.splitlines()[-1] == (
            f"hpnlp: error: process {i} of 2: the processes were started with different "
            "configs (model.width: process 0 32, process 1 64; train.lr: process 0 0.003, "
            "process 1 0.001); start every process with the same --config, --config.* "
            "overrides and other flags (--process_id aside; --workdir: the same path, on "
            "storage every host sees)"), log[-2000:]
    assert not os.path.exists(tmp_path / "differ")
    # another --num_processes (numpy's error in one, a hang in the other) or --workdir (both
    # hung at the first checkpoint): the same line, naming the flag
    logs = finish(launch(tmp_path / "count", processes=2, each=[[], ["--num_processes", "3"]]),
                  expect=1)
    for log in logs:
        assert "different configs (--num_processes: process 0 2, process 1 3)" in log, log[-2000:]
    logs = finish(launch(tmp_path / "dir", processes=2,
                         each=[[], ["--workdir", str(tmp_path / "other")]]), expect=1)
    for log in logs:
        assert (f"different configs (--workdir: process 0 '{tmp_path / 'dir'}', process 1 "
                f"'{tmp_path / 'other'}')") in log, log[-2000:]
    assert not os.path.exists(tmp_path / "count") and not os.path.exists(tmp_path / "other")
    # a seed ensemble's --member_loop, which sets its step's collectives (a review, session
    # 115: not compared, a collective mismatch in gloo or a hang)
    logs = finish(launch(tmp_path / "loop", processes=2, module="hpnlp.train.ensemble",
                         extra=["--members", "2"], each=[["--member_loop=map"], []]), expect=1)
    for log in logs:
        assert ("different configs (--member_loop: process 0 'map', process 1 '(default)')"
                in log), log[-2000:]
    # A bug hunt (session 99): one relative data.train_path, read from each process's own
    # directory, named another file in each, and the run trained on both silently
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for h, words in zip(hosts, ["the of and to", "in a is it"]):
        os.makedirs(h)
        with open(h / "corpus.txt", "w") as f:
            f.write("\n\n".join(" ".join([words] * 40) for _ in range(50)))
    logs = finish(launch(tmp_path / "rel", processes=2, cwds=hosts,
                         extra=["--config.data.train_path=corpus.txt"]), expect=1)
    for log in logs:
        # and their texts differ (a review, session 117: one absolute path to another copy
        # on each host was not compared)
        assert (f"different configs (data.train_path: process 0 '{hosts[0] / 'corpus.txt'}', "
                f"process 1 '{hosts[1] / 'corpus.txt'}'; the training text's sha256: process 0 "
                "'") in log, log[-2000:]
        assert log.splitlines()[-1].endswith(
            "data paths and the runs it reads: one absolute path, as a relative one is read "
            "from each process's own directory; the same data files on every host "
            "(data.train_path, data.eval_path or data.prepared))"), log[-2000:]
    assert not os.path.exists(tmp_path / "rel")


def test_the_runs_a_run_reads_are_compared_across_processes_as_absolute_paths(tmp_path,
                                                                             monkeypatch):
    """A review (session 117): a relative train.init_from or train.distill.teacher was
    compared as given and read in each process's own directory, each process restoring its
    replicas from another run, unsaid (as data paths, session 99, above)."""
    from hpnlp.config import default_configdict, from_configdict
    from hpnlp.main import with_absolute_run_paths
    cd = default_configdict()
    cd.train.init_from, cd.train.distill.teacher = "runs/base", "runs/teacher"
    cfg = from_configdict(cd)
    for d in ("host0", "host1"):
        os.makedirs(tmp_path / d)
    monkeypatch.chdir(tmp_path / "host0")
    got = with_absolute_run_paths(cfg)
    assert got.train.init_from == str(tmp_path / "host0" / "runs" / "base")
    assert got.train.distill.teacher == str(tmp_path / "host0" / "runs" / "teacher")
    monkeypatch.chdir(tmp_path / "host1")
    assert with_absolute_run_paths(cfg).train.init_from != got.train.init_from
    cd.train.init_from, cd.train.distill.teacher = "", ""  # none: unchanged
    assert with_absolute_run_paths(from_configdict(cd)) == from_configdict(cd)
    # and the data files' contents (a stale copy at one path on one host)
    import hashlib

    from hpnlp.main import EVAL_TEXT_KEY, TEXT_KEY, text_digests
    (tmp_path / "train.txt").write_text("the cat sat\n")
    (tmp_path / "eval.txt").write_text("a dog\n")
    cd.data.update(task="byte_lm", train_path=str(tmp_path / "train.txt"),
                   eval_path=str(tmp_path / "eval.txt"))
    sha = {p: hashlib.sha256((tmp_path / p).read_bytes()).hexdigest()
           for p in ("train.txt", "eval.txt")}
    assert text_digests(from_configdict(cd).data) == {TEXT_KEY: sha["train.txt"],
                                                      EVAL_TEXT_KEY: sha["eval.txt"]}
    assert text_digests(from_configdict(default_configdict()).data) == {}  # the shipped corpus
    # a prepared folder's eval split too, beside its train split (a review, session 118: only
    # the train split's digest was compared)
    from hpnlp.data import sharded
    folder = tmp_path / "prepared"
    folder.mkdir()
    np.save(folder / sharded.COUNTS_FILE, np.ones(4, np.int64))
    np.save(folder / sharded.EVAL_TARGET_COUNTS_FILE, np.ones(4, np.int64))

    def digests(eval_split):
        (folder / sharded.META_FILE).write_text(json.dumps({"splits": {
            "train": {"shards": ["a"]}, "eval": eval_split}, "tokenizer": {"kind": "bytes"}}))
        cd.data.update(task="byte_lm", train_path="", eval_path="", prepared=str(folder))
        return text_digests(from_configdict(cd).data)
    one, two = digests({"shards": ["e1"]}), digests({"shards": ["e2"]})
    assert one[TEXT_KEY] == two[TEXT_KEY] and one[EVAL_TEXT_KEY] != two[EVAL_TEXT_KEY]
    assert None not in (one[TEXT_KEY], one[EVAL_TEXT_KEY])
    cd.data.prepared = ""
    # ListOps' TSV too (a review, session 118: only an LM's text was compared)
    (tmp_path / "lo.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n")
    cd.data.update(task="listops", train_path=str(tmp_path / "lo.tsv"), eval_path="")
    assert text_digests(from_configdict(cd).data) == {
        TEXT_KEY: hashlib.sha256((tmp_path / "lo.tsv").read_bytes()).hexdigest()}


# 5.6 s on the 2-core Xeon model 167 (2026-12-06): over the ~8 s a test may take on the Zen 3;
# the only check that one process's failure stops the others: CI's slow part runs it
@pytest.mark.slow
def test_a_failure_in_one_process_stops_the_others_at_once(tmp_path, launch):
    """A bug hunt (session 97): a data file missing on one host failed that process after the
    join, and the other waited in a collective for it; both aborted in C++ after 5 minutes.
    Now the other stops with it in one line, leaving no workdir behind. (A relative data path
    that names another file in each process is refused at the join since session 99: here
    process 1 fails after it on its own --profile folder, `process_1` a file.)"""
    profile = tmp_path / "profile"
    os.makedirs(profile)
    open(profile / "process_1", "w").close()
    t0 = time.time()
    logs = finish(launch(tmp_path / "run", processes=2, extra=["--profile", str(profile)]),
                  expect=1)
    assert time.time() - t0 < 90, logs
    assert logs[1].splitlines()[-1] == (f"hpnlp: error: --profile {profile / 'process_1'} is a "
                                        "file, not a folder; give a folder"), logs
    assert logs[0].splitlines()[-1] == ("hpnlp: error: process 0 of 2: process 1 failed (its "
                                        "own log says why); this one stops with it"), logs
    assert not os.path.exists(tmp_path / "run")


# 3.9 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_ctrl_c_or_a_busy_port_while_joining_ends_in_one_line(tmp_path, launch):
    """A bug hunt (session 97): Ctrl-C while waiting for the other processes was taken only
    when --init_timeout ran out, and a --coordinator port in use was a 20-line traceback."""
    import signal
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        where = f"127.0.0.1:{busy.getsockname()[1]}"
        (log,) = finish(launch(tmp_path / "busy", extra=[
            "--coordinator", where, "--num_processes", "2", "--init_timeout", "60"]), expect=1)
    assert log.splitlines()[-1] == (f"hpnlp: error: process 0 of 2: cannot listen on "
                                    f"--coordinator {where} (in use?); choose another port"), log
    where = f"127.0.0.1:{_free_port()}"
    run = launch(tmp_path / "wait", extra=["--coordinator", where, "--num_processes", "2",
                                           "--process_id", "1", "--init_timeout", "60"])
    log = _stopped_while_joining(run, f"{tmp_path / 'wait'}.p0.log", signal.SIGINT, 130)
    assert log.splitlines()[-1] == (f"hpnlp: interrupted: process 1 of 2 stopped waiting for "
                                    f"every process to join at {where}"), log
    assert not os.path.exists(tmp_path / "busy") and not os.path.exists(tmp_path / "wait")


def _stopped_while_joining(run, log_name: str, sig, code: int) -> str:
    """The log of the one process of `run` sent `sig` once it waits to join, which it ends
    with exit `code` at once."""
    (proc, _), = run[0]
    while "joining the run" not in open(log_name).read():
        assert proc.poll() is None and time.time() < run[1]
        time.sleep(0.1)
    time.sleep(0.5)
    t0 = time.time()
    proc.send_signal(sig)
    (log,) = finish(run, expect=code)
    assert time.time() - t0 < 30  # not the 60 s of --init_timeout
    return log


# 4.2 s on the 2-core Xeon model 167 (2026-12-06): over the ~8 s a test may take on the Zen 3;
# the only check of a lone process 0 or a SIGTERM while joining: CI's slow part runs it
@pytest.mark.slow
def test_process_0_alone_or_sigterm_while_joining_ends_in_one_line(tmp_path, launch):
    """A bug hunt (session 99): process 0 that stopped waiting (--init_timeout, Ctrl-C)
    aborted in C++ ("wrong service incarnation", 38 lines, exit 134) as it told the others
    through its unconnected client; SIGTERM while waiting was taken only when --init_timeout
    ran out."""
    import signal
    alone, term = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    run_alone = launch(tmp_path / "alone", extra=[
        "--coordinator", alone, "--num_processes", "2", "--init_timeout", "3"])
    run_term = launch(tmp_path / "term", extra=[
        "--coordinator", term, "--num_processes", "2", "--init_timeout", "60"])
    log = _stopped_while_joining(run_term, f"{tmp_path / 'term'}.p0.log", signal.SIGTERM, 143)
    assert log.splitlines()[-1] == (f"hpnlp: process 0 of 2 stopped (SIGTERM) waiting for "
                                    f"every process to join at {term}"), log
    (log,) = finish(run_alone, expect=1)
    assert log.splitlines()[-1] == (
        f"hpnlp: error: process 0 of 2: not every process joined at {alone} within 3 s; start "
        f"processes 0 to 1 with the same --coordinator and --num_processes (process 0 on the "
        f"host of {alone}), or raise --init_timeout"), log
    assert not os.path.exists(tmp_path / "alone") and not os.path.exists(tmp_path / "term")


def _stop_when_training(run, workdir, after_step: int, process: int, sig) -> list[int]:
    """Send `sig` to one process of `run` once it logged `after_step`; return every process's
    exit code."""
    procs, deadline = run
    metrics = os.path.join(workdir, "metrics.jsonl")
    while time.time() < deadline:
        assert all(p.poll() is None for p, _ in procs), "a process ended before the signal"
        if os.path.exists(metrics) and any(l.get("step", 0) >= after_step
                                           for l in map(json.loads, open(metrics))):
            break
        time.sleep(0.1)
    procs[process][0].send_signal(sig)
    codes = [p.wait(timeout=max(deadline - time.time(), 0.1)) for p, _ in procs]
    for _, log in procs:
        log.close()
    return codes


@pytest.mark.slow
def test_sigterm_or_ctrl_c_in_one_process_stops_both_at_one_saved_step(tmp_path, launch):
    """Found in a README walk: in a run of 2 processes SIGTERM was ignored (JAX's preemption
    service takes it), and Ctrl-C in one left the other waiting minutes in a collective for
    it. Now both agree on a step, save it and exit, and the rerun resumes from it."""
    import re
    import signal
    work = tmp_path / "run"
    endless = ["--config.train.steps=100000", "--config.train.checkpoint_every=0"]
    codes = _stop_when_training(launch(work, processes=2, extra=endless), work, 3, 1,
                                signal.SIGINT)
    logs = [open(f"{work}.p{i}.log").read() for i in range(2)]
    assert codes == [143, 130], logs
    first = {int(re.search(r"stopped at step (\d+)", log).group(1)) for log in logs}
    assert len(first) == 1, logs
    (first,) = first
    assert "on Ctrl-C in this process, every process with it" in logs[1]
    assert "with every process, one of which took SIGTERM or Ctrl-C" in logs[0]
    assert os.listdir(work / "checkpoints") == [str(first)]
    # the rerun resumes there; SIGTERM to process 0 (the coordinator's) stops both again
    codes = _stop_when_training(launch(work, processes=2, extra=endless), work, first + 2, 0,
                                signal.SIGTERM)
    log = open(f"{work}.p0.log").read()
    assert codes == [143, 143], log
    assert f"resuming from step {first} in " in log
    second = int(re.search(r"stopped at step (\d+)", log).group(1))
    assert second > first and str(second) in os.listdir(work / "checkpoints")
    assert [s for s, _ in losses(work)] == list(range(1, second + 1))


# 11.1 s on the 2-core Xeon model 167 (2026-12-06): over the ~8 s a test may take on the Zen 3;
# the only check that Ctrl-C after a multi-process run's last step is said: CI's slow part runs it
@pytest.mark.slow
def test_ctrl_c_after_the_last_step_is_said(tmp_path, launch):
    """A bug hunt (session 97): Ctrl-C in one process during the final eval was ignored
    without a word (no step is left to stop at); the run finishes, and says so."""
    import signal
    work = tmp_path / "run"
    run = launch(work, processes=2,
                 extra=["--config.train.steps=6", "--config.train.eval_batches=300"])
    codes = _stop_when_training(run, work, 6, 1, signal.SIGINT)  # in the 300 batches' eval
    logs = [open(f"{work}.p{i}.log").read() for i in range(2)]
    assert codes == [0, 0], logs
    assert ("hpnlp: Ctrl-C after the last step: the run finishes (Ctrl-C again stops this "
            "process at once)") in logs[1], logs[1][-2000:]
    assert summary(work)["final_step"] == 6


@pytest.mark.slow
def test_a_process_killed_mid_training_is_said_and_each_keeps_its_trace(tmp_path, launch):
    """A bug hunt (session 99): a process killed mid-training (SIGKILL, out of memory) left
    the other a traceback of gloo's "Connection reset by peer", then a wait in the shutdown's
    barrier and a C++ abort ~70 s later; it now says so in one line and exits at once. And
    --profile DIR of processes on one host kept one trace (both wrote HOST.xplane.pb in one
    folder): DIR/process_I each."""
    import glob
    import signal
    work, profile = tmp_path / "run", tmp_path / "profile"
    run = launch(work, processes=2, extra=["--config.train.steps=100000",
                                           "--config.train.checkpoint_every=0",
                                           "--profile", str(profile)])
    codes = _stop_when_training(run, work, 10, 1, signal.SIGKILL)  # traced steps 3-8 first
    log = open(f"{work}.p0.log").read()
    assert codes == [1, -signal.SIGKILL], log[-3000:]
    assert log.splitlines()[-1] == (
        "hpnlp: error: process 0 of 2: lost process 1 (killed?) in a collective; no "
        "checkpoint was saved: a rerun starts over"), log[-3000:]  # (checkpoint_every=0)
    assert "Traceback" not in log, log[-3000:]
    assert sorted(os.listdir(profile)) == ["process_0", "process_1"]
    for i in range(2):
        assert glob.glob(str(profile / f"process_{i}" / "plugins" / "profile" / "*" /
                             "*.xplane.pb")), i
