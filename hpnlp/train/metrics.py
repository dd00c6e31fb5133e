"""Metrics to `metrics.jsonl` (one JSON object per logged step) and TensorBoard events.

Train lines: `{"step": s, "loss": ..., "grad_norm": ..., "grad_norm_min": ..., "grad_norm_max": ...,
"clipped_frac": ..., "lr": ..., "steps_per_sec": ...}` (the gradient-norm range and the
fraction of steps clipped over the log window; TensorBoard also gets `train/grad_norm_step`
at every step; a float16 step skipped for overflow is left out of them, and a window of
only skipped steps has none; the norm is the one clipping reads, `train.state.clips`);
eval lines carry `"eval": true`. Only process 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import jax


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without dragging in torch (3+ s per process):
    tensorboardX imports torch only to recognise torch tensors, and we log floats."""
    import sys
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` raise ImportError inside tensorboardX
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _cells(table, prefix=""):
    """(index path "i/j", value) of every number in a nested list (other entries, such as an
    ensemble's per-member dicts, are not TensorBoard scalars)."""
    for i, v in enumerate(table):
        idx = f"{prefix}{i}"
        if isinstance(v, list):
            yield from _cells(v, idx + "/")
        elif isinstance(v, (int, float)):
            yield idx, float(v)


class MetricWriter:
    def __init__(self, workdir: str, *, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._closed = False  # (by `close`, or at a failed write)
        if not self.enabled:
            return
        try:
            os.makedirs(workdir, exist_ok=True)
            self._truncate_after(resume_step)
            self.file = open(self.path, "a")
            tb_dir = os.path.join(workdir, "tensorboard")
            if os.path.exists(tb_dir) and not os.path.isdir(tb_dir):
                # tensorboardX would fail only at its first write, in its writer thread
                raise NotADirectoryError(20, "not a folder", tb_dir)
            SummaryWriter = _summary_writer_class()
            # On resume, purge events logged after the checkpoint (the steps are redone); on a
            # start, every earlier one (a bug hunt, session 96: a run stopped before its first
            # checkpoint left its curves, mixed with the rerun's, as metrics.jsonl did not)
            self.tb = SummaryWriter(
                tb_dir, purge_step=0 if resume_step is None else resume_step + 1)
            self._threads = [_ThreadWrites.install(w) for w in self.tb.all_writers.values()]
        except OSError as e:  # a bug hunt: a read-only metrics.jsonl was a 30-line traceback
            raise ValueError(f"workdir {workdir}: cannot write {e.filename or workdir} "
                             f"({e.strerror or e}); make it writable, move it aside, or use a "
                             "new --workdir") from None

    def _truncate_after(self, step: int | None) -> None:
        """On resume drop lines logged after the restored checkpoint (they are redone)."""
        if not os.path.exists(self.path):
            return
        keep = []
        # a line cut by a kill, stray bytes or a line that is no step's record is dropped (a
        # bug hunt, session 96: undecodable bytes, or `null`, stopped the resume)
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not (isinstance(rec, dict) and isinstance(rec.get("step", 0), int)):
                    continue
                if step is not None and rec.get("step", 0) <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path + ".tmp"  # whole or not at all
        try:
            with open(tmp, "w") as f:
                f.writelines(keep)
            os.replace(tmp, self.path)
        except OSError as e:  # a bug hunt (session 101): a full disk left the .tmp and said to
            # use a new --workdir, abandoning the run's checkpoints, which a rerun resumes
            with contextlib.suppress(OSError):
                os.remove(tmp)
            from hpnlp.train.checkpoint import write_failed
            raise write_failed(self.path, e, os.path.join(os.path.dirname(self.path),
                                                          "checkpoints")) from None

    def write(self, step: int, metrics: dict, *, eval: bool = False) -> None:
        if not self.enabled:
            return
        rec = {"step": int(step), **({"eval": True} if eval else {}), **metrics}
        with self._writing(self.path):
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        prefix = "eval/" if eval else "train/"
        with self._writing(os.path.join(os.path.dirname(self.path), "tensorboard")):
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(prefix + k, v, step)
                elif isinstance(v, list):  # a table (MoE load [layer][expert]): a series a cell
                    for idx, x in _cells(v):
                        self.tb.add_scalar(f"{prefix}{k}/{idx}", x, step)
            self.tb.flush()
            self._thread_failed()

    def scalar(self, step: int, name: str, value: float) -> None:
        """A TensorBoard-only scalar (per-step series too dense for the JSON log)."""
        if self.enabled:
            self.tb.add_scalar("train/" + name, value, step)

    def sync(self) -> None:
        """Everything written so far reaches the files (the OS: what a killed process leaves),
        TensorBoard's events too: the loop calls it before it saves a checkpoint, whose resume
        purges only the steps after it. A review (r4): tensorboardX's thread writes the queued
        events into a buffer it flushes every 120 s, and its `flush` reaches only what the
        thread has written, so a kill soon after a checkpoint lost the events up to it."""
        if not self.enabled or self._closed:
            return
        with self._writing(os.path.join(os.path.dirname(self.path), "tensorboard")):
            for t in self._threads:
                t.reach()  # the thread has written what was queued before
            self.tb.flush()
            self._thread_failed()

    def close(self) -> None:
        if self.enabled and not self._closed:
            with self._writing(self.path):
                self.file.close()
            with self._writing(os.path.join(os.path.dirname(self.path), "tensorboard")):
                self._thread_failed()
                self.tb.close()  # (its thread writes what is queued as it stops: review)
                self._thread_failed()
            self._closed = True

    def _thread_failed(self) -> None:
        """Raises the OSError tensorboardX's writer thread met (`_ThreadWrites`), if any."""
        for t in self._threads:
            if t.error is not None:
                raise t.error

    @contextlib.contextmanager
    def _writing(self, where: str):
        """A write's OSError as the run's one line (a bug hunt, session 101: a full disk was a
        66-line traceback from tensorboardX, its atexit flush and its thread, where a failed
        checkpoint save is one line naming the step a rerun resumes from)."""
        try:
            yield
        except OSError as e:
            self._close_quietly()
            from hpnlp.train.checkpoint import write_failed
            raise write_failed(where, e, os.path.join(os.path.dirname(self.path),
                                                      "checkpoints")) from None

    def _close_quietly(self) -> None:
        """Both files closed, errors dropped: tensorboardX's thread stopped and its atexit
        close (whose flush would fail again) left nothing to do."""
        self._closed = True
        with contextlib.suppress(OSError):
            self.file.close()  # (closed even where its flush fails)
        for w in list((getattr(self.tb, "all_writers", None) or {}).values()):
            events = getattr(w, "event_writer", None)
            if events is None or getattr(events, "_closed", True):
                continue
            events._closed = True  # what its close checks: the atexit one does nothing
            worker = getattr(events, "_worker", None)
            # As it stops, its thread writes what it has queued (and flushes, past flush_secs)
            # to the disk that failed (an OSError in the thread, printed as a traceback), and
            # tensorboardX's `stop` joins it with no timeout (a hung filesystem would hang the
            # exit): its writes dropped, it is stopped as `stop` does, waiting a while (a
            # fixer's note, session 101)
            if worker is not None and hasattr(worker, "_record_writer"):
                worker._record_writer = _ThreadWrites(None)
            stopped = worker is None or not worker.is_alive()  # (a dead one reads no stop)
            with contextlib.suppress(Exception):
                if not stopped:  # else it reads its queue as the interpreter closes it
                    worker._queue.put(worker._shutdown_signal, timeout=_STOP_SECONDS)
                    worker.join(_STOP_SECONDS)
                    stopped = not worker.is_alive()
            if stopped:  # (a stuck one may be inside the file)
                with contextlib.suppress(Exception):
                    events._ev_writer._py_recordio_writer.close()
            with contextlib.suppress(Exception):
                if not stopped:  # what the queue still sends, dropped: the exit does not wait
                    events._event_queue.cancel_join_thread()
                events._event_queue.close()


_STOP_SECONDS = 5.0  # how long a writer thread is given to stop, once its writes failed


class _Mark:
    """Queued to tensorboardX's writer thread behind events (`_ThreadWrites.reach`): the
    thread reaches it once it has written them (it passes through the queue's pipe pickled,
    so it is a class of its own, told apart by its type)."""

    def __init__(self, number: int):
        self.number = number


class _ThreadWrites:
    """What tensorboardX's writer thread writes through (its worker's `_record_writer`, 2.6.5),
    an OSError kept for the run's next write or close to raise as its one line: raised in the
    thread, it ended it, printed as an "Exception in thread" traceback (a fixer's note, session
    101: the thread writes its queue and flushes every flush_secs). `events` None: nothing is
    written (a writer whose writes failed, stopping)."""

    def __init__(self, events):
        self.events, self.error = events, None
        self.queue_event = self.worker = None  # (`install`)
        self._marks = self._reached = 0  # the `_Mark`s queued, and the last the thread wrote
        self._reaching = threading.Condition()

    @classmethod
    def install(cls, file_writer) -> "_ThreadWrites":
        event_writer = getattr(file_writer, "event_writer", None)
        worker = getattr(event_writer, "_worker", None)
        writes = cls(getattr(worker, "_record_writer", None))
        if writes.events is not None:  # (another tensorboardX: its thread left as it is)
            worker._record_writer = writes
            writes.queue_event, writes.worker = event_writer.add_event, worker
        return writes

    def reach(self) -> None:
        """Returns once the thread has written every event queued before this call (or has
        stopped): a mark queued behind them, which it hands to `write_event`."""
        if self.queue_event is None or self.events is None:
            return
        with self._reaching:
            self._marks += 1
            mark = self._marks
        self.queue_event(_Mark(mark))
        with self._reaching:
            while self._reached < mark and self.worker.is_alive():
                self._reaching.wait(0.1)

    def write_event(self, event) -> None:
        if isinstance(event, _Mark):  # (written by nothing: what `reach` waits for)
            with self._reaching:
                self._reached = event.number
                self._reaching.notify_all()
            return
        self._call("write_event", event)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args) -> None:
        if self.events is None or self.error is not None:  # (the run stops at the first)
            return
        try:
            getattr(self.events, name)(*args)
        except OSError as e:
            self.error = e
