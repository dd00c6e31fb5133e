"""hpnlp command line: flags -> config -> training.

    python -m hpnlp.main --config experiments/lm.py --workdir /tmp/hpnlp/lm
    python -m hpnlp.main --config experiments/lra.py:listops --workdir /tmp/hpnlp/listops \\
        --config.train.steps=500 --config.train.batch_size=16

Per-variant options that the config file does not list can still be set from the command
line: `--config.attention.options.block_q=64` (values parsed as Python literals; unknown
keys are rejected by name when the config is validated).

Reusing a workdir resumes from its newest checkpoint. Multi-host: add
`--coordinator HOST:PORT --num_processes N --process_id I` (or set HPNLP_COORDINATOR,
HPNLP_NUM_PROCESSES, HPNLP_PROCESS_ID) to the same command on every process, with one
--workdir that all of them see (shared storage): every process saves its shards of each
checkpoint, process 0 alone writes config.json, metrics and the summary. A checkpoint
resumes under any process count (tests/test_multihost.py).
"""

from __future__ import annotations

import ast
import atexit
import json
import os
import re
import signal
import sys
import threading
import time

from absl import app, flags, logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, optionally with an argument: FILE[:ARG].",
    lock_config=True)
flags.DEFINE_string("workdir", None, "Output folder (metrics.jsonl, summary.json, TensorBoard "
                    "events, checkpoints). Reusing it resumes the run.")
flags.DEFINE_string("coordinator", os.environ.get("HPNLP_COORDINATOR") or None,
                    "HOST:PORT of process 0, for multi-host runs (jax.distributed).")


def _env_int(name: str, default: int) -> int:
    """An integer environment variable; empty is unset (found in review: '' or 'two' was a
    traceback at import)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"hpnlp: error: {name}={text!r} is not an integer; set it to one, "
                         "or unset it") from None


flags.DEFINE_integer("num_processes", _env_int("HPNLP_NUM_PROCESSES", 1),
                     "Number of processes in a multi-host run.")
flags.DEFINE_integer("process_id", _env_int("HPNLP_PROCESS_ID", 0),
                     "This process's index in a multi-host run.")
flags.DEFINE_integer("init_timeout", _env_int("HPNLP_INIT_TIMEOUT", 300),
                     "Seconds each process of a multi-host run waits for every process to "
                     "join at --coordinator before it gives up.")
flags.DEFINE_string("profile", None, "Write a jax.profiler trace of a few steps to this folder "
                    "(open it in TensorBoard's profile tab or Perfetto); a run of several "
                    "processes writes each one's in its subfolder process_I.")
flags.mark_flags_as_required(["workdir"])  # --config: in _parse_flags, which says what it takes


def _valid_coordinator(value: str | None) -> bool:
    if not value:
        return True
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


# An empty folder name (a review, session 118: `--workdir=$OUT` with OUT unset ran in the
# current directory, or failed creating ''; `--profile=` was ignored)
for _name in ("workdir", "profile"):
    flags.register_validator(_name, lambda v: v is None or bool(v.strip()),
                             "is empty; give a folder (an unset shell variable?)")

# Checked when flags are parsed, so a typo fails at once instead of inside
# jax.distributed.initialize (which would wait for a coordinator that never answers).
flags.register_validator(
    "coordinator", _valid_coordinator,
    "must be HOST:PORT (port 1..65535), the address process 0 listens on, e.g. "
    "--coordinator=10.0.0.1:8476 (HPNLP_COORDINATOR sets the default)")


def _valid_init_timeout(f: dict) -> bool:
    """--init_timeout >= 1 where it is read: a multi-process run's join. Not in a run of one
    process (review r6: absl checks defaults too, so HPNLP_INIT_TIMEOUT=0 exported by a
    cluster profile refused every run of one process, naming a flag it was never given)."""
    if not f["coordinator"] or f["init_timeout"] >= 1:
        return True
    env = os.environ.get("HPNLP_INIT_TIMEOUT", "").strip()
    given = ("--init_timeout" if FLAGS["init_timeout"].present or not env else
             f"HPNLP_INIT_TIMEOUT={env} (--init_timeout's default)")
    raise flags.ValidationError(f"{given}: must be at least 1 (the seconds each process waits "
                                "for the others at --coordinator)")


flags.register_multi_flags_validator(["coordinator", "init_timeout"], _valid_init_timeout)
flags.register_multi_flags_validator(
    ["coordinator", "num_processes", "process_id"],
    lambda f: f["num_processes"] >= 1 and 0 <= f["process_id"] < f["num_processes"]
    and (f["num_processes"] == 1 or bool(f["coordinator"])),
    "--num_processes must be >= 1, --process_id in [0, num_processes), and a run of more "
    "than one process needs --coordinator HOST:PORT (or HPNLP_NUM_PROCESSES, "
    "HPNLP_PROCESS_ID, HPNLP_COORDINATOR)")


_OPTION = re.compile(r"^--config\.(attention|output)\.options\.([A-Za-z_]\w*)(?:=(.*))?$")
_WORDS = {"true": True, "false": False, "none": None, "null": None}  # as absl reads bools
_option_overrides: list[tuple[str, str, object]] = []


def _take_option_overrides(argv: list[str]) -> list[str]:
    """Pull `--config.{attention,output}.options.KEY=VALUE` out of argv.

    ml_collections cannot add a key to a ConfigDict from the command line, and the option
    keys depend on the chosen variant, so they are applied after the config file loads.
    """
    rest, args = [], iter(argv)
    for arg in args:
        m = _OPTION.match(arg)
        if not m:
            rest.append(arg)
            continue
        text = m.group(3)
        if text is None:  # `--config.attention.options.KEY VALUE`, as absl takes its flags
            text = next(args, None)  # (found in review: refused as no such field)
            if text is None:
                raise SystemExit(f"hpnlp: error: {arg} needs a value")
            if text.startswith("--"):  # a bug hunt (session 101): the next flag was the value
                raise SystemExit(f"hpnlp: error: {arg} needs a value ({arg}=VALUE, or the "
                                 f"value after it), and the next argument is the flag "
                                 f"{text.split('=')[0]}")
        if text.lower() in _WORDS:  # found in review: 'false' stayed a string, so true
            value = _WORDS[text.lower()]
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
        _option_overrides.append((m.group(1), m.group(2), value))
    return rest


def apply_option_overrides(cfg) -> None:
    """Set the taken `--config.{attention,output}.options.KEY=VALUE` overrides on the loaded
    config. Each replaces its group's options with a plain copy (no type safety), so a value
    of another kind than the file's (64 -> 'auto') is the registry's check to judge, in one
    line naming the option (review r4: ml_collections refused it with a traceback)."""
    import ml_collections
    for group, key, value in _option_overrides:
        options = dict(getattr(cfg, group).options or {})
        options[key] = value
        with cfg.unlocked():
            getattr(cfg, group).options = ml_collections.ConfigDict(options, type_safe=False)


# Other frameworks' names for fields hpnlp names otherwise, which difflib's "Did you mean"
# does not reach (a README walk: --config.train.grad_clip was refused with no hint)
_ALIASES = {"grad_clip": "train.clip_norm", "max_grad_norm": "train.clip_norm",
            "learning_rate": "train.lr", "warmup": "train.warmup_steps",
            "num_steps": "train.steps", "max_steps": "train.steps",
            "d_model": "model.width", "hidden_size": "model.width", "n_embd": "model.width",
            "num_layers": "model.depth", "n_layers": "model.depth", "n_layer": "model.depth",
            "n_heads": "model.num_heads", "n_head": "model.num_heads",
            "d_ff": "model.mlp_dim", "ffn_dim": "model.mlp_dim",
            "intermediate_size": "model.mlp_dim", "seq_length": "data.seq_len",
            "max_seq_len": "data.seq_len"}


def _alias_hint(key: str) -> str:
    """' Did you mean --config.FIELD?' where `key` is another framework's name for one."""
    return f" Did you mean --config.{_ALIASES[key]}?" if key in _ALIASES else ""


def _config_file_error(e: BaseException, argv: list[str]) -> str | None:
    """One line for an error raised by the experiment file itself as it loaded (its
    get_config, or Python it is not), naming the file and line; None for another's. A bug
    hunt (session 99): a typo in the file was blamed on the overrides, and a run's
    config.json given as --config was a 52-line traceback."""
    given = next((argv[i + 1] if a == "--config" and i + 1 < len(argv) else a[len("--config="):]
                  for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")),
                 None)
    if not given:
        return None
    path = os.path.realpath(given.split(":")[0])
    line = e.lineno if isinstance(e, SyntaxError) and e.filename and \
        os.path.realpath(e.filename) == path else None
    tb = None if line else e.__traceback__
    while tb is not None:  # the innermost of the file's frames (a helper it defines)
        if os.path.realpath(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    what = str(e)
    try:  # ml_collections' errors say the repr of their message
        what = ast.literal_eval(what) if what.startswith("'") else what
    except (ValueError, SyntaxError):
        pass
    what = " ".join(str(what).splitlines())
    hint = ("; a run's config.json is read by the tools with --workdir, and a run resumes "
            "with its experiment file and the same overrides" if path.endswith(".json") else
            "; fix the experiment file")
    return f"--config {given}: line {line}: {type(e).__name__}: {what}{hint}"


def _parse_flags(argv: list[str], *, config_required: bool = True) -> list[str]:
    """absl's flag parsing, with a config file that is missing or fails (an unknown
    argument), or a `--config.FIELD` that names no field, said in one line, not a traceback.
    `config_required=False`: a tool that can read the config a run saved (FLAGS.config is
    then None when not given)."""
    try:
        rest = FLAGS(argv)
        if FLAGS["init_timeout"].present and not FLAGS.coordinator:  # read by join_processes
            # only, which one process skips (review r6: taken and ignored without a word)
            raise flags.Error("--init_timeout: only for a multi-process run (--coordinator "
                              "HOST:PORT); drop it")
        if FLAGS.config is None:
            if not config_required:
                return rest
            # absl said "flag --config=None: Flag --config must have a value other than None"
            raise flags.Error("--config is required: the experiment file, with its argument if "
                              "any, e.g. --config experiments/lm.py:bytes (see experiments/)")
        FLAGS.config.get("name")  # a file that did not load fails on first use: here, not later
        return rest
    except OSError as e:  # the config file missing or unreadable
        msg = f"--config: {str(e).strip().splitlines()[-1].strip()}"
    except flags.Error as e:  # a flag's own check; a config file that fails to load
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        msg = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
        unknown = re.match(r"Unknown command line flag '(config\.[\w.]+)'", msg)
        if unknown and not any(a == "--config" or a.startswith("--config=") for a in argv):
            # found in review: an override without the file it overrides
            msg = (f"--{unknown.group(1)} overrides a field of the experiment, but no --config "
                   "was given: add --config EXPERIMENT_FILE (e.g. experiments/lm.py:bytes)")
        if msg.startswith("flag --workdir=None:"):  # absl's words for a flag not given
            msg = ("--workdir is required: the run's output folder (a new one, or a run's to "
                   "resume it), e.g. --workdir runs/lm")
        # a boolean field given another word: absl says it as a tuple's repr (a README walk)
        bad = re.match(r"flag (--config\.[\w.]+)=(.*): \('Non-boolean argument", msg)
        if bad:
            msg = f"{bad.group(1)}: {bad.group(2)!r} is not a boolean; give true or false"
    except Exception as e:  # noqa: BLE001 (the file's own error, else re-raised as it was)
        msg = _config_file_error(e, argv)
        if msg is None and not isinstance(e, (AttributeError, KeyError)):
            raise
        if msg is None:  # a --config.FIELD override of no field
            given = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
            why = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
            # the flag whose path holds the unknown name, not every flag given (found by a
            # README walk: a typo among ten overrides was named as all ten)
            key = re.match(r"'?(\w+)'?", why)
            if re.fullmatch(r"\w+", why):  # a bare name (no suggestion): quoted, a sentence
                why = f"'{why}'."
            bad = [g for g in given if key and key.group(1) in g.split(".")[1:]]
            msg = (f"{bad[0]}: no such config field: {why}" if len(bad) == 1
                   else f"no such config field in {bad or given}: {why}")
            if key and "Did you mean" not in why:
                msg += _alias_hint(key.group(1))
    print(f"hpnlp: error: {msg}", file=sys.stderr)
    sys.exit(1)


def refuse_positional(argv: list[str]) -> None:
    """Words that are not flags: one line, not absl's usage dump (the module's docstring,
    39 lines here) ahead of it (a README walk)."""
    if len(argv) > 1:
        print(f"hpnlp: error: unexpected arguments {argv[1:]}: every setting is a flag "
              "(--name=value); --help lists them", file=sys.stderr)
        sys.exit(1)


def exit_interrupted(message: str, code: int = 130, together: bool = False) -> None:
    """Say `message` and exit with `code` (130 Ctrl-C, 143 SIGTERM) at once. Not through the
    interpreter's shutdown: a Ctrl-C during a compile leaves XLA's threads running, and the
    shutdown then segfaulted (exit 139 in 4 of 5 tries in a README walk). By here every
    `finally` has run, and the loop has waited for the checkpoint under way. `together`:
    every process of a multi-process run stopped at the same step (hpnlp.train.stop), so
    they leave the coordination service together; a process leaving alone would take it
    from the others mid-exit."""
    from hpnlp.progress import close_bars
    close_bars()
    if not together:  # leaving alone (a second Ctrl-C, a failed save): the others of a
        tell_the_others()  # multi-process run stop with it, not waiting in a collective (review)
    print(message, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if together:
        import jax
        if jax.process_count() > 1:  # within 30 s: a process that left at once (a second
            # Ctrl-C) would keep the others in the shutdown's barrier for its 5 minutes
            import threading
            done = threading.Thread(target=_shutdown_quietly, daemon=True)
            done.start()
            done.join(30)
    os._exit(code)


def _shutdown_quietly() -> None:
    import jax
    try:
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 (a peer gone first: exiting anyway)
        pass


def join_processes(cfg, flags: dict | None = None) -> None:
    """In a multi-host run (--coordinator): check the config as far as it does not depend on
    the devices, then join the other processes (jax.distributed), saying so. Found in a README
    walk: a process started alone waited 5 minutes before it read the config, and then
    aborted with a C++ stack trace; now a bad config fails at once, and the wait ends in one
    line after --init_timeout seconds."""
    if not FLAGS.coordinator:
        return
    import threading

    import jax

    from hpnlp.config import Config, ConfigError, from_configdict, validate, with_absolute_paths
    n, i = FLAGS.num_processes, FLAGS.process_id
    where, limit = FLAGS.coordinator, FLAGS.init_timeout
    if not os.path.exists(FLAGS.workdir):  # this run makes it (`_remove_unused_workdir`)
        _made.append(FLAGS.workdir)
    checked = validate(cfg if isinstance(cfg, Config) else from_configdict(cfg),
                       num_processes=n, devices=False)
    if not (flags or {}).get("--from_checkpoints"):  # this run trains (ensemble's combining
        # of a run's checkpoints reads them): the Trainer's own refusals, here before the join
        # (a review, session 107: a process started alone waited out --init_timeout first)
        from hpnlp.config.checks import check_new_run, check_training
        from hpnlp.train.checkpoint import has_checkpoint
        check_training(checked)
        if not has_checkpoint(FLAGS.workdir):
            check_new_run(checked)
    texts = text_digests(with_absolute_paths(checked).data)  # before the join: read at once
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    print(f"hpnlp: process {i} of {n}: joining the run at {where}, waiting up to {limit} s for "
          "every process (--init_timeout)", file=sys.stderr, flush=True)

    if i == 0 and not _can_listen(where):  # a bug hunt (session 97): a 20-line traceback,
        # or a segfault in initialize's failure (4 of 4 tries here)
        exit_interrupted(f"hpnlp: error: process 0 of {n}: cannot listen on --coordinator "
                         f"{where} (in use?); choose another port", 1)
    lock = threading.Lock()

    def give_up() -> None:  # before JAX's own abort at the same deadline
        with lock:  # held to the exit: a join now waits for it
            if _joined:  # joined in the timer's last moment (found in review)
                return
            exit_interrupted(
                f"hpnlp: error: process {i} of {n}: not every process joined at {where} within "
                f"{limit} s; start processes 0 to {n - 1} with the same --coordinator and "
                f"--num_processes (process 0 on the host of {where}), or raise --init_timeout", 1)
    timer = threading.Timer(max(limit - 1.0, 0.5), give_up)
    timer.daemon = True
    timer.start()
    # initialize blocks in C++, where the main thread takes no Ctrl-C (a bug hunt, session
    # 97: taken only when --init_timeout ran out): Python's signal handler writes its number
    # to this pipe at once, and a thread reading it stops the process. (Not initialize on a
    # thread: its "Failed to start RPC server" was a segfault there.)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    threading.Thread(target=_stop_on_signal, daemon=True, args=(
        wake_r, f"process {i} of {n} stopped waiting for every process to join at {where}",
        f"process {i} of {n} stopped (SIGTERM) waiting for every process to join at "
        f"{where}")).start()
    on_main = threading.current_thread() is threading.main_thread()  # (else Python refuses)
    before = signal.set_wakeup_fd(wake_w) if on_main else None
    try:
        jax.distributed.initialize(where, n, i, initialization_timeout=limit)
        with lock:
            _joined.append(True)
    finally:
        timer.cancel()
        if on_main:
            signal.set_wakeup_fd(before)
        os.close(wake_w)  # the thread reads the end of the pipe, and closes it
    # the run's shape and folder too (a bug hunt: another --num_processes failed in numpy in
    # one process and hung the other; another --workdir hung both at the first checkpoint)
    same = {"--num_processes": n, "--workdir": os.path.abspath(FLAGS.workdir), **(flags or {}),
            **texts}
    try:  # data paths absolute, as config.json holds them (a bug hunt, session 99: one
        # relative data.train_path named another file in each process's directory, and the
        # run trained on both silently)
        same_config_everywhere(with_absolute_run_paths(with_absolute_paths(checked)), n, i,
                               same)
    except ConfigError as e:  # every process stops here, and leaves the service together
        exit_interrupted(f"hpnlp: error: {e}", 1, together=True)
    client = _jax_distributed().global_state.client
    watch = threading.Thread(target=_watch_the_others, daemon=True, args=(client, n, i))
    watch.start()
    atexit.register(_stop_watching, client, i, watch)  # before JAX's shutdown (registered first)


def _can_listen(where: str) -> bool:
    """Whether a server could listen on the port of `where` (HOST:PORT) on every address, as
    the coordination service does (gRPC's `[::]:PORT`)."""
    import errno
    import socket
    port = int(where.rsplit(":", 1)[1])
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 here after all
        family, probe = socket.AF_INET, socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a port left
        if family == socket.AF_INET6:  # in TIME_WAIT by an earlier run is free
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError as e:  # (another error, e.g. no IPv6 address: initialize's to meet)
            return e.errno != errno.EADDRINUSE
    return True


def _stop_on_signal(wake_r: int, message: str, on_term: str) -> None:
    """`join_processes`'s thread: exit 130 with `message` where the signal handler wrote
    SIGINT's number to the pipe `wake_r`, 143 with `on_term` for SIGTERM's (a bug hunt,
    session 99: SIGTERM's handler raises in the main thread, blocked in C++, so it was taken
    only when --init_timeout ran out); the pipe's end (closed) ends the thread."""
    try:
        while True:
            got = os.read(wake_r, 1)
            if not got:
                return
            if got[0] == signal.SIGINT:
                exit_interrupted(f"hpnlp: interrupted: {message}")
            if got[0] == signal.SIGTERM:
                exit_interrupted(f"hpnlp: {on_term}", 143)
    finally:
        os.close(wake_r)


def _jax_distributed():
    from jax._src import distributed
    return distributed


# A key of the coordination service per process of a multi-process run, set by a process
# that failed after joining (to its id: `tell_the_others`), or by the process itself as it
# ends ("end")
_STOP = "hpnlp/stop/{}"
# jax.distributed.initialize returned: this process is connected. Before it, process 0's
# client exists unconnected, and a key set through it aborted the process in C++ ("wrong
# service incarnation", a bug hunt, session 99: Ctrl-C or --init_timeout while waiting)
_joined: list[bool] = []
_leaving: list[bool] = []  # this process is ending: its own line says why, if it fails


def _watch_the_others(client, n: int, i: int) -> None:
    """On a thread of each process of a multi-process run from the join on: where another
    process failed, say so and stop this one with it. A bug hunt (session 97): a data file
    missing on one host failed that process alone, and the others waited in a collective for
    it, then both aborted in C++ after 5 minutes."""
    while True:
        try:
            who = client.blocking_key_value_get(_STOP.format(i), 600_000)
            break
        except Exception as e:  # noqa: BLE001
            if "DEADLINE_EXCEEDED" not in str(e):
                return  # the service closed: the run is ending
    # An error every process meets (a config refused after joining) is said best by each
    # process's own line: a moment for it
    deadline = time.monotonic() + 3
    while who != "end" and not _leaving and time.monotonic() < deadline:
        time.sleep(0.05)
    if who != "end" and not _leaving:
        _stop_with(who, n, i)


# Held by the thread that says how this process of a multi-process run ends: the watcher
# stopping it with a peer, or the main thread with its own error (CI, session 98: the
# watcher's line, then the main thread's traceback of the collective the peer broke)
_ending = threading.RLock()


def _stop_with(who: str, n: int, i: int) -> None:
    """Process `i` of `n` exits 1 with process `who`, which failed first (unless this
    process's main thread is saying its own error)."""
    if not _ending.acquire(blocking=False):
        return
    if i == 0:
        _remove_unused_workdir()
    exit_interrupted(f"hpnlp: error: process {i} of {n}: process {who} failed (its own "
                     "log says why); this one stops with it", 1, together=True)


def stop_if_another_failed() -> None:
    """Where another process of the run failed first (it set this one's key), stop with it in
    its line: this process's own error (a collective that lost it) would be a traceback that
    hides why (CI, session 98: 1 run in 3, before `_watch_the_others` had said it)."""
    if not FLAGS.coordinator or not _joined:
        return
    client = _jax_distributed().global_state.client
    try:
        who = client.key_value_try_get(_STOP.format(FLAGS.process_id))
    except Exception:  # noqa: BLE001 (no key: none failed; or no service)
        return
    if who != "end":
        _stop_with(who, FLAGS.num_processes, FLAGS.process_id)


# The --workdir this run made (`join_processes`): where another process failed, this one
# leaves it as a run refused does, not holding the config.json and empty checkpoints/ that
# building it wrote
_made: list[str] = []


def _remove_unused_workdir() -> None:
    import shutil
    for workdir in _made:
        checkpoints = os.path.join(workdir, "checkpoints")
        try:
            if (set(os.listdir(workdir)) <= {"config.json", "checkpoints"}
                    and not (os.path.isdir(checkpoints) and os.listdir(checkpoints))):
                shutil.rmtree(workdir)
        except OSError:
            pass


def _stop_watching(client, i: int, watch) -> None:
    """At the interpreter's exit: the watching thread ends first (a daemon thread still
    waiting in C++ aborted the process at its exit)."""
    _leaving.append(True)
    try:
        client.key_value_set(_STOP.format(i), "end")
    except Exception:  # noqa: BLE001 (a process that failed set it; or the service is gone)
        pass
    watch.join(5)


def tell_the_others() -> bool:
    """This process of a multi-process run is failing after the join: the others stop with
    it (`_watch_the_others`) instead of waiting in a collective for it. False where it has
    joined no other process."""
    if not FLAGS.coordinator or not _joined:
        return False  # (a Ctrl-C in the imports or while joining: nothing joined)
    client = _jax_distributed().global_state.client
    if client is None:
        return False
    if not _ending.acquire(blocking=False):  # the watcher is stopping this process with a
        threading.Event().wait(60)            # peer that failed first: it exits
    if _leaving:
        return True
    _leaving.append(True)
    for p in range(FLAGS.num_processes):
        try:
            if p != FLAGS.process_id:
                client.key_value_set(_STOP.format(p), str(FLAGS.process_id))
        except Exception:  # noqa: BLE001 (another process said it first)
            pass
    return True


# gloo's words for a peer whose process ended (killed, out of memory) mid-collective
_LOST = re.compile(r"\bGloo [\w -]+ failed: .*(Connection (reset|closed) by peer|Broken pipe)")


def lost_a_process(e: BaseException) -> bool:
    """Whether `e` is a collective's failure where another process of a multi-process run
    is gone. A bug hunt (session 99): a peer killed mid-training left a traceback ending in
    gloo's error, then a wait in the shutdown's barrier and a C++ abort ~70 s later."""
    import jax
    return (bool(FLAGS.coordinator) and isinstance(e, jax.errors.JaxRuntimeError)
            and bool(_LOST.search(str(e))))


def exit_lost_process() -> None:
    """Say that this process lost another mid-collective, and exit 1 at once: the shutdown's
    barrier would wait for the lost one, then abort in C++."""
    if not _ending.acquire(blocking=False):  # the watcher is stopping this process with a
        threading.Event().wait(60)            # peer that failed first (its leaving broke the
        # collective; its shutdown took the client, so `tell_the_others` does not wait): it exits
    n, i = FLAGS.num_processes, FLAGS.process_id
    who = f"process {1 - i}" if n == 2 else "another process"
    from hpnlp.train.checkpoint import has_checkpoint
    again = ("rerun the same command to resume from its last checkpoint"
             if has_checkpoint(FLAGS.workdir) else "no checkpoint was saved: a rerun starts over")
    exit_interrupted(f"hpnlp: error: process {i} of {n}: lost {who} (killed?) in a collective; "
                     f"{again}", 1)


def exit_failed(message: str) -> None:
    """Say `message` and exit 1; in a multi-process run the others stop with this one (a bug
    hunt, session 97: they waited for it in a collective, then aborted after 5 minutes)."""
    if tell_the_others():
        exit_interrupted(message, 1, together=True)
    print(message, file=sys.stderr)
    sys.exit(1)


RUN_PATH_FIELDS = ("train.init_from", "train.distill.teacher")  # the runs a run reads
TEXT_KEY = "the training text's sha256"  # compared across processes where it has one
EVAL_TEXT_KEY = "the eval text's sha256"


def text_digests(data) -> dict:
    """{TEXT_KEY: the training text's sha256, EVAL_TEXT_KEY: data.eval_path's} where DataConfig
    `data` reads a user's file or a prepared folder, for the processes' comparison (a review,
    session 117: one path, another file on each host, a stale copy, and each process built
    its own vocabulary, plan or eval set from its own, unsaid)."""
    from hpnlp.data import prepared_eval_digest, sharded, train_text_digest

    def file_sha256(path):
        try:
            return sharded.file_sha256(path)
        except OSError:  # missing on this host: its own error, after the join, names it
            return None
    out = {}
    text = train_text_digest(data)  # an LM's (a prepared folder's too)
    if text is None and data.train_path:  # another task's file, ListOps' TSV (a review,
        text = file_sha256(data.train_path)  # session 118: not compared)
    if text is not None or data.train_path:
        out[TEXT_KEY] = text
    if data.eval_path:
        out[EVAL_TEXT_KEY] = file_sha256(data.eval_path)
    elif data.prepared:  # its eval split, which the train digest leaves out (a review,
        # session 118: a stale copy's held-out shards passed)
        out[EVAL_TEXT_KEY] = prepared_eval_digest(data)
    return out


def with_absolute_run_paths(cfg):
    """`cfg` with the runs it reads (RUN_PATH_FIELDS) absolute from this process's directory,
    for the processes' comparison (config.json keeps them as given): a review (session 117)
    found a relative one read in each process's own directory, each restoring its replicas
    from another run, unsaid, as data paths had been (session 99)."""
    import dataclasses
    t = cfg.train

    def absolute(path):
        return os.path.abspath(path) if path else path
    return dataclasses.replace(cfg, train=dataclasses.replace(
        t, init_from=absolute(t.init_from),
        distill=dataclasses.replace(t.distill, teacher=absolute(t.distill.teacher))))


def same_config_everywhere(cfg, n: int, i: int, flags: dict) -> None:
    """Every process of a run must run one config (and the same `flags`, e.g. an ensemble's
    {"--members": M}): refused, in every process, where any differs from process 0's, naming
    the fields (a bug hunt: a process started with another model.width aborted both in
    gloo's C++ 'collective mismatch'; another train.lr would have trained on, each process
    updating its own replicas differently)."""
    import json

    import jax
    import numpy as np
    from flax import traverse_util
    from jax.experimental import multihost_utils

    from hpnlp.config import ConfigError, to_json
    from hpnlp.config.fields import DATA_PATH_FIELDS
    mine = {**traverse_util.flatten_dict(to_json(cfg), sep="."), **flags}
    mine = json.dumps(mine, sort_keys=True).encode()
    mine = np.frombuffer(mine, np.uint8)
    try:
        sizes = multihost_utils.process_allgather(np.array([mine.size], np.int32)).reshape(-1)
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[:mine.size] = mine
        joined = sizes.size  # the processes that joined, whatever --num_processes said
        every = multihost_utils.process_allgather(padded).reshape(joined, -1)
    except ValueError as e:  # a bug hunt: numpy's reshape error, naming nothing
        raise ConfigError(
            f"process {i} of {n}: the processes do not hold the same number of devices (this "
            f"one has {jax.local_device_count()}; {e}); give every process the same devices "
            "(XLA_FLAGS, CUDA_VISIBLE_DEVICES)") from None
    configs = [json.loads(bytes(every[p, :sizes[p]]).decode()) for p in range(joined)]
    diffs = []
    for p in range(1, joined):
        keys = sorted(k for k in {**configs[0], **configs[p]}
                      if configs[0].get(k) != configs[p].get(k))
        diffs += [f"{k}: process 0 {configs[0].get(k)!r}, process {p} {configs[p].get(k)!r}"
                  for k in keys]
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        paths = any(d.startswith(tuple(f"data.{f}:" for f in DATA_PATH_FIELDS)
                                 + tuple(f"{f}:" for f in RUN_PATH_FIELDS)) for d in diffs)
        raise ConfigError(
            f"process {i} of {n}: the processes were started with different configs ({shown}); "
            "start every process with the same --config, --config.* overrides and other flags "
            "(--process_id aside; --workdir: the same path, on storage every host sees"
            + ("; data paths and the runs it reads: one absolute path, as a relative one is "
               "read from each process's own directory" if paths else "")
            + ("; the same data files on every host (data.train_path, data.eval_path or "
               "data.prepared)" if any(d.startswith((TEXT_KEY + ":", EVAL_TEXT_KEY + ":"))
                                       for d in diffs) else "") + ")")


def _orbax_errors_in_one_line(record) -> bool:
    """A failed background save: orbax logs it with its traceback from each of its threads
    (a bug hunt: ~300 lines before hpnlp's own line, which says what failed and what to do);
    kept to their one-line messages."""
    if record.exc_info and "orbax" in record.pathname:
        record.exc_info, record.exc_text = None, None
    return True


def main(argv) -> None:
    refuse_positional(argv)
    # Orbax logs every checkpoint step at INFO; keep the terminal for the progress bar.
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_orbax_errors_in_one_line)
    try:  # Ctrl-C in the imports' seconds (found by CI on the Zen 3: a traceback, exit -2)
        import jax

        from hpnlp.config import ConfigError
        from hpnlp.train import Interrupted, NonFiniteLoss, run
        from hpnlp.train.checkpoint import CheckpointMismatch, CheckpointSaveFailed
    except KeyboardInterrupt as e:
        exit_interrupted(f"hpnlp: {str(e) or 'interrupted'}", getattr(e, "exit_code", 130))

    cfg = FLAGS.config
    apply_option_overrides(cfg)
    try:
        from hpnlp.paths import check_workdir, check_writable_dir
        check_workdir(FLAGS.workdir)
        if FLAGS.profile:
            check_writable_dir(FLAGS.profile, "--profile")
        join_processes(cfg)
        if FLAGS.profile and jax.process_count() > 1:  # the folder of this process's trace,
            # checked as --profile is before the join
            from hpnlp.train.loop import profile_folder
            check_writable_dir(profile_folder(FLAGS.profile), "--profile")
        if FLAGS.coordinator:  # Ctrl-C while the run is built stops every process with it
            from hpnlp.train.stop import ctrl_c_as_preemption
            ctrl_c_as_preemption()
        summary = run(cfg, FLAGS.workdir, profile_dir=FLAGS.profile)
    except (ConfigError, CheckpointMismatch, NonFiniteLoss, ValueError, FileNotFoundError) as e:
        # Config, data-file and checkpoint problems: one line saying what and how to fix.
        exit_failed(f"hpnlp: error: {e}")
    except CheckpointSaveFailed as e:  # at once: orbax's writer threads would hold the exit
        exit_interrupted(f"hpnlp: error: {e}", 1)
    except Interrupted as e:  # Ctrl-C or SIGTERM while training: what a rerun resumes from
        exit_interrupted(f"hpnlp: {e}", e.exit_code, e.saved)
    except KeyboardInterrupt as e:  # before the first step or after the last (SIGTERM's too)
        exit_interrupted(f"hpnlp: {str(e) or 'interrupted'}", getattr(e, "exit_code", 130))
    except Exception as e:  # a traceback: the other processes of the run stop with this one
        stop_if_another_failed()
        if lost_a_process(e):
            exit_lost_process()
        tell_the_others()
        raise
    if jax.process_index() == 0:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.argv = _take_option_overrides(sys.argv)  # config_flags reads sys.argv itself
    app.run(main, flags_parser=_parse_flags)
