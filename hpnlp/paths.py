"""Output folders, checked before any long work: a command that cannot write its results, or
that would write over a run's own files, says so in one line before it trains or compiles
(and creates nothing while checking)."""

from __future__ import annotations

import contextlib
import os
import shutil

# What a training run keeps in its workdir (hpnlp.train): an output written there would
# replace the run's summary or mix with its checkpoints.
RUN_FILES = ("config.json", "checkpoints", "summary.json", "metrics.jsonl", "teacher_config.json",
             "text.json")
RUN_FOLDERS = ("checkpoints", "tensorboard", "tokenizer")  # a run's own, written as it trains


def check_writable_dir(path: str, flag: str) -> None:
    """Raises ValueError, naming `flag`, where `path` cannot be (or become) a folder this
    process writes into: it is a file, a folder on its way is a file, or the nearest folder
    that exists is not writable."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ValueError(f"{flag} {path} is a file, not a folder; give a folder")
    parent = full
    while not os.path.exists(parent):
        if os.path.islink(parent):  # a dangling link: makedirs cannot make it a folder (a
            # review, session 115: a traceback from the run's FileExistsError)
            raise ValueError(f"{flag} {path}: {parent} is a link to {os.readlink(parent)}, "
                             "which does not exist; create that folder, or give another path")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, so the folder cannot be made; "
                         "give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable; give a folder you can write")


# A run's own entries in its workdir: True for a folder, False for a file
_RUN_ENTRIES = {"checkpoints": True, "tensorboard": True, "config.json": False,
                "summary.json": False, "metrics.jsonl": False}


# What a run's first writes, cut short (killed, a full disk), leave in a folder that holds no
# run yet: the next run writes them anew (a bug hunt, session 101)
_RUN_LEFTOVERS = ("config.json.tmp",)


def check_workdir(workdir: str, flag: str = "--workdir") -> None:
    """Raises ValueError, naming `flag`, where a training run cannot write into `workdir`: it
    cannot be a folder (`check_writable_dir`), or it holds files and no run (no config.json,
    no checkpoints): another tool's output (a kNN-LM's summary, a datastore, a quantized or
    prepared folder), which the run's files would replace or mix with (found by a README
    walk: a kNN-LM's summary.json was overwritten, a datastore left unreadable). A new or
    empty folder starts a run, a run's own folder resumes it."""
    check_writable_dir(workdir, flag)
    full = os.path.realpath(workdir)
    if not os.path.isdir(full):
        return
    held = set(os.listdir(full))
    if held & {"config.json", "checkpoints"}:
        # each of the run's own entries of its kind (a bug hunt, session 96: `checkpoints` a
        # file trained from step 0 over the run's metrics, then failed to save at the end)
        wrong = sorted(f for f, folder in _RUN_ENTRIES.items() if f in held
                       and os.path.isdir(os.path.join(full, f)) != folder)
        if wrong:
            f = wrong[0]
            raise ValueError(f"{flag} {workdir}: the run's {f} is not a "
                             f"{'folder' if _RUN_ENTRIES[f] else 'file'} (replaced by hand?); "
                             "restore it, or train in a new --workdir")
        # a resume writes its files again: one it cannot would fail after the restore, or at
        # the end of training (a bug hunt: a read-only metrics.jsonl was a 30-line traceback)
        locked = sorted(f for f in held & {"checkpoints", "summary.json", "metrics.jsonl",
                                           "tensorboard"}
                        if not os.access(os.path.join(full, f), os.W_OK))
        if locked:
            raise ValueError(f"{flag} {workdir}: the run's {', '.join(locked)} "
                             f"{'is' if len(locked) == 1 else 'are'} not writable, and a resume "
                             "writes them again; make them writable (chmod -R u+w), or copy "
                             "the run to a new folder")
        return
    # (a tokenizer's save cut short leaves its temporary folder, a config.json's write its
    # .tmp: not another tool's output)
    other = sorted(f for f in held - set(RUN_FOLDERS) - set(_RUN_LEFTOVERS)
                   if not f.startswith(".tokenizer-"))
    if other:
        raise ValueError(f"{flag} {workdir} holds files but no training run ("
                         f"{', '.join(other[:3])}{', ...' if len(other) > 3 else ''}: another "
                         "tool's output?); give a new or empty folder")


def check_new_output(out: str, source: str | None, flag: str = "--out", *,
                     may_replace: tuple[str, ...] = ()) -> str | None:
    """Raises ValueError, naming `flag`, where writing a tool's results into `out` would lose
    something: `out` is the run `source` it reads (if any) or inside one of its own folders
    (its checkpoints: a folder there reads as a damaged step), or holds a training run's
    files or any file other than `may_replace` (the tool's own, from an earlier call, which
    it writes anew), or the tool's output of another run that still exists. A new folder
    inside the run is fine. Returns a line to say once the call's other checks pass where it
    replaces its earlier output of this run, else None."""
    check_writable_dir(out, flag)
    full = os.path.realpath(out)
    if source is not None:
        src = os.path.realpath(source)
        if full == src:
            raise ValueError(f"{flag} {out} is the run it reads; give a new folder")
        if full.startswith(src + os.sep) and \
                os.path.relpath(full, src).split(os.sep)[0] in RUN_FOLDERS:
            raise ValueError(f"{flag} {out} is inside the run's own folders ({source}); give a "
                             "new folder")
    if not os.path.isdir(full):
        return
    held = sorted(set(os.listdir(full)) - set(may_replace) - {UNFINISHED})  # a killed call's
    tools = [f for f in ("quant.json", "sparse.json") if f in held]
    if tools:  # a bug hunt (session 94): a quantize output was called "a training run"
        raise ValueError(f"{flag} {out} holds another command's output ({', '.join(tools)}); "
                         "give a new folder")
    run = [f for f in held if f in RUN_FILES]
    if run:
        raise ValueError(f"{flag} {out} holds a training run ({', '.join(run)}); give a new folder")
    if held:
        raise ValueError(f"{flag} {out} holds files this command would not write "
                         f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); give a "
                         "new or empty folder")
    manifests = [f for f in ("quant.json", "sparse.json") if f in may_replace]
    present = os.listdir(full)
    if manifests and "summary.json" in present and not set(manifests) & set(present):
        # a review (session 117): another command's summary.json alone (a retrieval
        # report's) was removed unsaid; this tool's own output holds its manifest beside
        # its summary (moved in last)
        raise ValueError(f"{flag} {out} holds a summary.json that is not this command's (no "
                         f"{' or '.join(manifests)} beside it); give a new folder")
    earlier = _output_source(full, may_replace)
    if earlier is None:
        return None
    if earlier != os.path.realpath(source or "") and os.path.isdir(earlier):  # a bug hunt
        # (session 95): the export of another run was replaced unsaid, and what served it
        # then served this one (a source since moved or deleted: the same run, moved with it)
        raise ValueError(f"{flag} {out} holds this command's output of another run "
                         f"({earlier}); give a new folder, or delete that one to replace it")
    return (f"{flag} {out} holds this command's earlier output of {source}; the new one "
            "replaces it once written")


def _output_source(folder: str, files: tuple[str, ...]) -> str | None:
    """The run a tool's output in `folder` was made from (the `source.workdir` its
    quant.json or sparse.json records), or None where it holds none."""
    import json
    for name in ("quant.json", "sparse.json"):
        if name in files:
            try:
                with open(os.path.join(folder, name)) as f:
                    return os.path.realpath(json.load(f)["source"]["workdir"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return None


def write_json(path: str, obj, indent: int | None = 1) -> None:
    """`obj` as JSON at `path`, whole or not at all: written beside it, then moved over it (a
    reader, or a rerun after a kill, never finds half a file)."""
    import json
    tmp = path + ".tmp"  # (written by one process: process 0, or a tool's only one)
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
        os.replace(tmp, path)
    except BaseException:
        # a bug hunt (session 101): a full disk left config.json.tmp, and every rerun in the
        # folder was refused as another tool's output
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class WorkdirBusy(ValueError):
    """Another process is training in the workdir."""


# The workdirs this process holds: realpath -> [the locked folder's descriptor, holders,
# whether the hold made the folder, its owner]
_HELD: dict[str, list] = {}


def hold_workdir(workdir: str, owner=None, busy: str | None = None):
    """Take `workdir`'s training lock for this process and return its release() (called
    more than once, it releases once). Another process holding it: WorkdirBusy. Within one
    process the lock is shared (a second hold only counts), so a process's own runs one
    after the other never refuse each other; `held_by` gives the `owner` the first hold
    named (a Trainer refuses a second one of another model: a bug hunt, session 96). An
    flock on the folder, so a process that dies releases it; where the file system takes
    no locks (some network mounts), runs go on unguarded. `busy`: WorkdirBusy's message
    ({workdir} filled in), BUSY's by default."""
    key, busy = os.path.realpath(workdir), busy or BUSY
    if key in _HELD:
        _HELD[key][1] += 1
        if _HELD[key][3] is None:  # a first hold of no owner (a bench's look at a run folder,
            # a review, session 117) does not hide the model a Trainer holds it for
            _HELD[key][3] = owner
    else:
        made = not os.path.isdir(workdir)  # removed again if released empty (a run refused
        os.makedirs(workdir, exist_ok=True)  # before it wrote anything leaves no folder)
        fd = _lock(workdir, busy)
        # (review, session 96: a folder that its holder removed as it released it, locked
        # meanwhile, is no longer the folder at that path: locked again there)
        for _ in range(3):
            if fd is None or _same_folder(fd, workdir):
                break
            os.close(fd)
            os.makedirs(workdir, exist_ok=True)
            fd = _lock(workdir, busy)
        _HELD[key] = [fd, 1, made, owner]
    done = []

    def release() -> None:
        if done:
            return
        done.append(True)
        entry = _HELD.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[key]
                with contextlib.suppress(OSError):
                    if entry[2] and not os.listdir(key):
                        os.rmdir(key)
                if entry[0] is not None:
                    os.close(entry[0])  # the lock with it
    return release


def _lock(workdir: str, busy: str) -> int | None:
    """A descriptor of `workdir` holding its flock; WorkdirBusy where another holds it; None
    where the file system takes no locks (the run goes on unguarded)."""
    import errno
    import fcntl
    try:
        fd = os.open(workdir, os.O_RDONLY)
    except FileNotFoundError:  # removed by a holder that released it empty, since this
        # process saw it (a review, session 117): made again, as the holder would
        os.makedirs(workdir, exist_ok=True)
        fd = os.open(workdir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise WorkdirBusy(busy.format(workdir=workdir)) from None
        return None
    return fd


def _same_folder(fd: int, workdir: str) -> bool:
    try:
        here = os.stat(workdir)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


BUSY = ("--workdir {workdir}: another process is training or writing in it; wait for it to end "
        "(or stop it), or use another --workdir")
WRITING = ("--out {workdir}: another process is writing into it (a call like this one, or a "
           "run training there); wait for it to end (or stop it), or use another --out")


def held_by(workdir: str):
    """The owner this process holds `workdir` for (`hold_workdir`), or None."""
    entry = _HELD.get(os.path.realpath(workdir))
    return None if entry is None else entry[3]


def hold_for_training(workdir: str, processes: int = 1, owner=None):
    """`hold_workdir` for a run about to write into `workdir`, before it writes anything
    (review, session 95: refused only in `Trainer.run`, a second run had already rewritten
    config.json and removed the first one's checkpoint being saved), and kept until its
    release() (a bug hunt, session 96: a probe released at once let two runs started together
    both pass it, the loser then rewrote config.json, and a multi-host loser's other process
    waited in a collective for good). Process 0 holds it; every process of a multi-host run
    raises alike. Returns release()."""
    import jax
    release, busy = (lambda: None), False
    if processes == 1 or jax.process_index() == 0:
        try:
            release = hold_workdir(workdir, owner)
        except WorkdirBusy as e:
            busy = str(e)
    if processes > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        try:
            said = bool(multihost_utils.broadcast_one_to_all(np.int32(bool(busy))))
        except BaseException:
            release()
            raise
        busy = busy or (BUSY.format(workdir=workdir) if said else False)
    if busy:
        release()
        raise WorkdirBusy(busy)
    return release


UNFINISHED = ".unfinished"  # OUT/.unfinished: a tool's files while it writes and checks them


@contextlib.contextmanager
def staged(out: str, files: tuple[str, ...] | None = None):
    """Yields a folder (OUT/.unfinished) to write `files` into (None: whatever is written
    there, summary.json last); when the block ends they replace OUT's own at once, and where
    it raises (a failed check, Ctrl-C) they are removed and OUT keeps what an earlier call
    wrote. A bug hunt (session 94): a rerun into the same --out, interrupted, left the new
    model's files beside the old call's summary.json; a `shrink` cut short left a run with no
    checkpoint that its rerun refused. OUT is held (`hold_workdir`) from the start to the
    end: a second call into it is refused (a bug hunt, session 97: two `shrink` calls at once
    shared the stage, one removing the other's; one failed in a traceback, and OUT was left
    with no summary.json)."""
    release = hold_workdir(out, busy=WRITING)
    try:
        with _staged(out, files) as stage:
            yield stage
    finally:
        release()


@contextlib.contextmanager
def _staged(out: str, files: tuple[str, ...] | None):
    stage = os.path.join(out, UNFINISHED)
    shutil.rmtree(stage, ignore_errors=True)  # what a killed call left
    os.makedirs(stage)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if files is None:
        files = tuple(sorted(os.listdir(stage), key=lambda f: f == "summary.json"))
    import signal
    held = {signal.SIGINT, signal.SIGTERM}  # the moves are not cut short (review)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        if os.path.exists(os.path.join(out, "summary.json")):  # absent while OUT is mixed
            os.remove(os.path.join(out, "summary.json"))
        for f in files:  # the summary last: present, the rest is this call's
            if os.path.isdir(os.path.join(out, f)):  # an earlier call's folder (checkpoints),
                # which a file or folder cannot be moved over: moved into the stage, removed
                # with it (a bug hunt, session 99: a `shrink` rerun)
                os.replace(os.path.join(out, f), os.path.join(stage, f + ".earlier"))
            if os.path.exists(os.path.join(stage, f)):
                os.replace(os.path.join(stage, f), os.path.join(out, f))
            elif os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    shutil.rmtree(stage, ignore_errors=True)
