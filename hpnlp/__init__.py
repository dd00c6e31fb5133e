"""hpnlp: fast neural NLP in JAX/Flax (see README.md).

    import hpnlp
    hpnlp.attention.names()      # attention variants, by registry name
    hpnlp.softmax.names()        # output layers over large vocabularies
    hpnlp.data.task_names()      # embedded tasks
    hpnlp.train.run(config, workdir)
"""

__version__ = "0.1.0"


def _interrupts_in_one_line(argv=None) -> str | None:
    """Run as `python -m hpnlp.X`: a Ctrl-C no command catches itself (`hpnlp.main` does)
    says one line and exits 130 at once, not a traceback of 9-60 lines (a bug hunt: every
    other CLI, in its imports or its work), nor a segfault in the shutdown (XLA's threads); one
    that lands in a garbage-collection callback, where Python prints it and carries on (the
    Ctrl-C lost), is raised again in the main thread. Returns the command's name (None: a
    library import, left alone)."""
    import os
    import sys
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    i = argv.index("-m") if "-m" in argv else -1
    if i < 0 or i + 1 >= len(argv) or argv[i + 1].split(".")[0] != "hpnlp":
        return None  # a library import (a script, a notebook, pytest): theirs to handle
    prog, hook, unraisable = f"python -m {argv[i + 1]}", sys.excepthook, sys.unraisablehook

    def one_line(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return hook(kind, value, tb)
        # hpnlp.train's Interrupted (a bench's training run) names the step a rerun resumes
        # from and its exit status (143 for SIGTERM). Nothing is imported here (a bug hunt,
        # session 100: a Ctrl-C while JAX imported ran `from hpnlp.progress import` again, which
        # re-ran the half-imported package: a 60-line double traceback, exit 1); the bars are
        # those of a tqdm already loaded.
        try:
            progress, tqdm = sys.modules.get("hpnlp.progress"), sys.modules.get("tqdm")
            if hasattr(progress, "close_bars") and hasattr(tqdm, "tqdm"):
                progress.close_bars()
            print(f"{prog}: {str(value) or 'interrupted'}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(getattr(value, "exit_code", 130))

    import _thread
    import signal
    import threading
    import time
    main = threading.main_thread().ident

    def send_again(sig):
        """The signal again to the main thread (it wakes a sleep) once that has left the hook:
        raised in the hook, it would be printed and lost again (a bug hunt, session 100: a
        Timer's 10 ms could end before the hook returned, on a loaded machine)."""
        for _ in range(2000):
            frame = sys._current_frames().get(main)
            while frame is not None and frame.f_code is not raised_again.__code__:
                frame = frame.f_back
            if frame is None:
                break
            time.sleep(0.001)
        signal.pthread_kill(main, sig)

    def raised_again(u):
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            # SIGTERM for a Stopped of status 143 (a bug hunt, session 99: a SIGINT always, so
            # a SIGTERM that landed here ended as "interrupted", status 130). Nothing here
            # waits (a bug hunt, session 100: threading's start waited for the thread, a wait
            # a signal could interrupt, and that interrupt was lost: the command ran on)
            sig = (signal.SIGTERM if getattr(u.exc_value, "exit_code", 130) == 143
                   else signal.SIGINT)
            _thread.start_new_thread(send_again, (sig,))
            return None
        return unraisable(u)

    sys.excepthook, sys.unraisablehook = one_line, raised_again
    # SIGTERM as Ctrl-C: cleanups run and the line is said, exit status 143 (a bug hunt,
    # session 94: the compress commands, and training before its first step, ended silent).
    # What keeps its own handler installs it over this one (training saves its next step).
    from hpnlp.stopping import Stopped

    def on_term(signum, frame):
        raise Stopped("stopped (SIGTERM)", 143)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_term)
    return prog


def _at_once_while_importing(prog: str | None):
    """While the package imports (JAX, XLA: seconds), a command's Ctrl-C or SIGTERM says its
    line and exits at once, 130 or 143: nothing has started to clean up, and an exception
    raised inside a C extension's initialization came out as an ImportError's traceback
    (exit 1), or a segfault (a bug hunt, session 100). Returns what restores the handlers."""
    import os
    import signal
    if prog is None:
        return lambda: None
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def at_once(signum, frame):
        term = signum == signal.SIGTERM
        os.write(2, f"{prog}: {'stopped (SIGTERM)' if term else 'interrupted'}\n".encode())
        os._exit(143 if term else 130)
    for s, h in saved.items():
        if h not in (signal.SIG_IGN, signal.SIG_DFL, None):  # ignored (a background job): kept
            signal.signal(s, at_once)

    def restore():
        for s, h in saved.items():
            if signal.getsignal(s) is at_once:
                signal.signal(s, h)
    return restore


_imported = _at_once_while_importing(_interrupts_in_one_line())

try:  # (review: an import that failed left the handlers exiting on any later Ctrl-C)
    from hpnlp import xla_workarounds as _xla_workarounds  # noqa: E402

    _xla_workarounds.apply()  # before JAX reads XLA_FLAGS (docs/xla_defects.md)

    from hpnlp import attention, config, data, models, softmax, train  # noqa: F401,E402
finally:
    _imported()
