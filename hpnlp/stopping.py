"""SIGTERM taken as Ctrl-C by the commands that keep no training state (`prepare`, the
kNN-LM): what cleans up or checkpoints on a KeyboardInterrupt runs for it too, and the
command ends in one line with exit status 143 (a bug hunt: SIGTERM ended them silently, a
partial datastore or an uncounted checkpoint left behind). Training has its own handler
(`hpnlp.train.stop`), which saves the next step first."""

from __future__ import annotations

import contextlib
import signal


class Stopped(KeyboardInterrupt):
    """A stop by signal: the line to say and the exit status (130 Ctrl-C, 143 SIGTERM); a
    KeyboardInterrupt, so what stops on Ctrl-C stops on it."""

    def __init__(self, message: str = "", exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def _on_sigterm(signum, frame):
    raise Stopped("stopped (SIGTERM)", 143)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within: SIGTERM raises `Stopped(..., 143)`; the previous handler is restored after."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
