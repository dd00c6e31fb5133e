"""How often a long command's progress bar redraws: often in a terminal or a notebook,
every 15 s where stderr is a file or a pipe (CI, nohup), so a log gets a few lines a minute,
not one per update (a bug hunt, session 96: a 100k-step run, or a 20 GB `prepare`, wrote
thousands)."""

from __future__ import annotations

import signal
import sys
import threading

IN_A_FILE_S = 15.0


def bar_interval(terminal_s: float = 0.2) -> float:
    """tqdm's `mininterval` for a bar on stderr: `terminal_s` in a terminal or a Jupyter
    kernel (Colab's too), else 15 s. A kernel's stderr is ipykernel's stream, which is no tty,
    and tqdm.auto's bar there is a widget that honours mininterval (review r6: a notebook's
    bar moved every 15 s)."""
    in_a_kernel = type(sys.stderr).__module__.split(".")[0] == "ipykernel"
    return terminal_s if in_a_kernel or sys.stderr.isatty() else IN_A_FILE_S


def close_bars() -> None:
    """Close the progress bars still drawn, each ending its line, so that a last message (a
    Ctrl-C's) starts on a line of its own, not after a bar's text (`lm_bytes:   0%| | 0/200
    [...]hpnlp: interrupted`): a bar a Ctrl-C left (a loop over `tqdm(...)`) is closed only
    when it is collected, and in a pipe or a file its text ends at its next redraw."""
    from tqdm import tqdm
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def progress_bar(**kwargs):
    """A tqdm bar on stderr redrawn at `bar_interval()`, made whole before a Ctrl-C is taken:
    one that came as it was first drawn (before tqdm set what its `close` needs to end the
    line) is raised once it is made, and closed."""
    from tqdm.auto import tqdm
    kwargs.setdefault("mininterval", bar_interval())
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return tqdm(**kwargs)  # only Python's KeyboardInterrupt cuts the drawing short
    taken = []
    signal.signal(signal.SIGINT, lambda signum, frame: taken.append(signum))
    try:
        bar = tqdm(**kwargs)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if taken:
        bar.close()
        raise KeyboardInterrupt
    return bar
