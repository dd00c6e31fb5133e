"""hpnlp: fast neural NLP in JAX/Flax (see README.md).

    import hpnlp
    hpnlp.attention.names()      # attention variants, by registry name
    hpnlp.softmax.names()        # output layers over large vocabularies
    hpnlp.data.task_names()      # embedded tasks
    hpnlp.train.run(config, workdir)
"""

__version__ = "0.1.0"


def _interrupts_in_one_line(argv=None) -> None:
    """Run as `python -m hpnlp.X`: a Ctrl-C no command catches itself (`hpnlp.main` does)
    says one line and exits 130 at once, not a traceback of 9-60 lines (a bug hunt: every
    other CLI, in its imports or its work), nor a segfault in the shutdown (XLA's threads); one
    that lands in a garbage-collection callback, where Python prints it and carries on (the
    Ctrl-C lost), is raised again in the main thread."""
    import os
    import sys
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    i = argv.index("-m") if "-m" in argv else -1
    if i < 0 or i + 1 >= len(argv) or argv[i + 1].split(".")[0] != "hpnlp":
        return  # a library import (a script, a notebook, pytest): theirs to handle
    prog, hook, unraisable = f"python -m {argv[i + 1]}", sys.excepthook, sys.unraisablehook

    def one_line(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            return hook(kind, value, tb)
        # hpnlp.train's Interrupted (a bench's training run) names the step a rerun resumes
        # from and its exit status (143 for SIGTERM)
        from hpnlp.progress import close_bars
        close_bars()
        print(f"{prog}: {str(value) or 'interrupted'}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(value, "exit_code", 130))

    def raised_again(u):
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            import signal
            import threading  # the signal again, once this hook has returned (raised in the
            # hook, it would be printed and lost again), to the main thread: it wakes a sleep.
            # SIGTERM for a Stopped of status 143 (a bug hunt, session 99: a SIGINT always, so
            # a SIGTERM that landed here ended as "interrupted", status 130)
            sig = (signal.SIGTERM if getattr(u.exc_value, "exit_code", 130) == 143
                   else signal.SIGINT)
            main = threading.main_thread().ident
            return threading.Timer(0.01, signal.pthread_kill, (main, sig)).start()
        return unraisable(u)

    sys.excepthook, sys.unraisablehook = one_line, raised_again
    # SIGTERM as Ctrl-C: cleanups run and the line is said, exit status 143 (a bug hunt,
    # session 94: the compress commands, and training before its first step, ended silent).
    # What keeps its own handler installs it over this one (training saves its next step).
    import signal

    from hpnlp.stopping import Stopped

    def on_term(signum, frame):
        raise Stopped("stopped (SIGTERM)", 143)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_term)


_interrupts_in_one_line()

from hpnlp import xla_workarounds as _xla_workarounds  # noqa: E402

_xla_workarounds.apply()  # before JAX reads XLA_FLAGS (docs/xla_defects.md)

from hpnlp import attention, config, data, models, softmax, train  # noqa: F401,E402
