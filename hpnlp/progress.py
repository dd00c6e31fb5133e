"""How often a long command's progress bar redraws: often in a terminal, every 15 s where
stderr is a file or a pipe (CI, nohup), so a log gets a few lines a minute, not one per
update (a bug hunt, session 96: a 100k-step run, or a 20 GB `prepare`, wrote thousands)."""

from __future__ import annotations

import sys

IN_A_FILE_S = 15.0


def bar_interval(terminal_s: float = 0.2) -> float:
    """tqdm's `mininterval` for a bar on stderr: `terminal_s` in a terminal, else 15 s."""
    return terminal_s if sys.stderr.isatty() else IN_A_FILE_S
