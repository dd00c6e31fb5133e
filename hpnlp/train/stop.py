"""A clean stop on request: SIGTERM (a scheduler's preemption notice, `kill`, `timeout`)
and, in a run of several processes, Ctrl-C in any one of them. Every process saves the same
step's checkpoint and exits, so a rerun of the same command loses no step.

One process: SIGTERM during the training loop is taken at the next step. Ctrl-C still
stops at once (naming the newest checkpoint), as it did.

Several processes: `jax.distributed.initialize` starts JAX's preemption service, whose
handler takes SIGTERM in every process (without this loop a SIGTERM was ignored) and tells
the others through the coordination service; the processes agree on the next step that all
of them can reach (`reached_preemption_sync_point`). Ctrl-C in one process is turned into
that SIGTERM, so the others stop with it instead of waiting minutes in a collective for a
process that is gone (found in a README walk). A second Ctrl-C stops the process at once.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading

from jax.experimental import multihost_utils

# The steps this process's training loops have taken: the preemption sync's step counter.
# Not the step number: a notice that comes before the first step (while the step compiles)
# is synced at counter 1, which a resumed run's first step must reach too.
_calls = itertools.count(1)


def _preemption_service() -> bool:
    """Whether JAX's preemption service runs in this process (jax.distributed started it)."""
    from jax._src import distributed
    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


# A Ctrl-C this process took before its training loop (several processes: passed on as the
# SIGTERM that JAX's preemption service takes; `ctrl_c_as_preemption`)
_before: list[str] = []


def ctrl_c_as_preemption() -> None:
    """From a multi-process run's start (its processes joined) to its training loop: Ctrl-C
    in this process becomes the SIGTERM JAX's preemption service takes, so every process
    stops with it at the loop's first step, saving that step (a bug hunt, session 96: a
    Ctrl-C while the run was being built ended this process alone, and the others waited
    about 100 s in a collective, then aborted). A second Ctrl-C stops at once."""
    if threading.current_thread() is not threading.main_thread() or not _preemption_service():
        return

    def on_int(signum, frame):
        if _before:
            raise KeyboardInterrupt
        _before.append("Ctrl-C")
        print("hpnlp: Ctrl-C: every process stops at the first step, saving it (Ctrl-C again "
              "stops this one at once)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    on_int.hpnlp_before_loop = True
    signal.signal(signal.SIGINT, on_int)


class StopSignals:
    """`with StopSignals(multi) as stop:` around the training loop; `stop.reached()` once per
    step says whether to save this step's checkpoint and stop, the same answer in every
    process. `stop.taken` is the signal this process took (None if another process's)."""

    def __init__(self, multi: bool):
        self.multi = multi
        self.taken: str | None = _before[0] if multi and _before else None
        self._saved: dict[int, object] = {}
        # Several processes agree on a stop only through JAX's preemption service
        # (jax_enable_preemption_service); without it neither signal is taken here
        self._sync = multi and _preemption_service()
        self._last = False  # the loop's last step has reached its sync point
        self._early = self.taken is not None  # taken before the loop (review: not "during")

    def _on_term(self, signum, frame) -> None:  # one process
        if self.taken:  # a second SIGTERM: die as the first would have
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.taken = "SIGTERM"

    def _on_int(self, signum, frame) -> None:  # several processes
        if self.taken:
            raise KeyboardInterrupt
        self.taken = "Ctrl-C"
        if self._last:  # no step left to stop at (a bug hunt, session 97: said nothing)
            self._finishes("after")
            return
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption handler tells every process

    def _finishes(self, when: str) -> None:
        print(f"hpnlp: {self.taken} {when} the last step: the run finishes (Ctrl-C again stops "
              "this process at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        # Several processes: Ctrl-C becomes the SIGTERM that JAX's preemption service takes;
        # where that service is off (jax_enable_preemption_service), nothing would take it,
        # and Ctrl-C keeps stopping this process at once (found in review: it killed the
        # process silently)
        if threading.current_thread() is threading.main_thread() and (
                not self.multi or self._sync):  # else Python refuses
            which, handler = ((signal.SIGINT, self._on_int) if self.multi
                              else (signal.SIGTERM, self._on_term))
            saved = signal.signal(which, handler)
            # after the loop Ctrl-C stops the process again (a SIGTERM would be taken by the
            # preemption service, which no loop asks any more)
            self._saved[which] = (signal.default_int_handler
                                  if getattr(saved, "hpnlp_before_loop", False) else saved)
        return self

    def __exit__(self, *exc) -> None:
        for which, handler in self._saved.items():
            signal.signal(which, handler)
        self._saved.clear()
        _before.clear()  # taken over by this loop's stop

    def reached(self, last: bool = False) -> bool:
        """`last`: the loop's last step, after which a stop is not taken but said."""
        if not self.multi:
            return self.taken is not None
        got = self._sync and multihost_utils.reached_preemption_sync_point(next(_calls))
        if last:
            self._last = True
            if self.taken:  # taken during the last step, or before it where it is the first
                self._finishes("before" if self._early else "during")
        return got

    def message(self, step: int, checkpoint: str) -> str:
        why = (f"on {self.taken}" if not self.multi else
               f"on {self.taken} in this process, every process with it" if self.taken else
               "with every process, one of which took SIGTERM or Ctrl-C")
        return (f"stopped at step {step} {why}; saved {checkpoint}: rerun the same command "
                "to resume from it")

    @property
    def exit_code(self) -> int:
        return 130 if self.taken == "Ctrl-C" else 143  # 128 + SIGINT, 128 + SIGTERM
