"""The training loop: validate, build, resume, step, evaluate, checkpoint, summarize.

The loop dispatches step N before it reads step N-1's metrics, so the host never stalls
the device; at a checkpoint it first reads the step's own metrics, so a non-finite loss
is never saved. Everything it needs to continue exactly (params, optimizer state, RNG,
data position, early-stopping counters) is in each checkpoint, and a rerun with the
same workdir resumes from the newest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from hpnlp import data as data_lib
from hpnlp import models
from hpnlp.attention import draws_features
from hpnlp.config import (MESH_AXES, Config, MeshConfig, config_error, from_configdict, validate,
                          with_absolute_paths)
from hpnlp.models import transformer_xl as xl
from hpnlp.parallel import batch_sharding, make_mesh, state_shardings
from hpnlp.parallel.mesh import unboxed
from hpnlp.paths import WorkdirBusy, hold_workdir, write_json
from hpnlp.progress import progress_bar
from hpnlp.train import carry as carry_lib
from hpnlp.train.checkpoint import (Checkpointer, CheckpointMismatch, NoCheckpoint,
                                    check_params_match, has_checkpoint, load_run_config,
                                    restore_params, write_failed)
from hpnlp.train.metrics import MetricWriter
from hpnlp.train.state import (init_params, init_state, learning_rate_schedule,
                               make_optimizer)
from hpnlp.train.stop import StopSignals
from hpnlp.train.step import finalize, make_eval_step, make_train_step, step_compiler_options


SCHEDULE_FIELDS = ("lr", "steps", "warmup_steps", "schedule", "end_lr_frac")


def schedule_change(saved_train: dict, t, step: int) -> str:
    """'; the learning-rate schedule changed (...)' where a resume's train fields give
    another learning rate at `step` than the saved run's, else ''. A longer run is a
    legitimate resume, but its cosine or linear decay is stretched over the new
    train.steps, so the rate jumps where it resumes (a bug hunt: it did so unsaid)."""
    changed = {f: saved_train[f] for f in SCHEDULE_FIELDS
               if f in saved_train and saved_train[f] != getattr(t, f)}
    if not changed:
        return ""
    try:
        before = float(learning_rate_schedule(dataclasses.replace(t, **changed))(step))
    except (TypeError, ValueError):  # a saved field of another type: nothing to compare
        return ""
    now = float(learning_rate_schedule(t)(step))
    if math.isclose(before, now, rel_tol=1e-6, abs_tol=1e-12):
        return ""
    fields = ", ".join(f"train.{f}: saved {v!r}, now {getattr(t, f)!r}"
                       for f, v in changed.items())
    # the rate of step `step + 1`, the first this resume trains and logs (a bug hunt, session
    # 99: "at step N" named the saved run's last step, whose logged rate was another)
    return (f"; the learning-rate schedule changed ({fields}): its rate from step {step + 1} is "
            f"{now:.3g}, where the saved run's schedule gives {before:.3g}")


def _logged(path: str, step: int, *, eval: bool = True) -> bool:
    """Whether metrics.jsonl at `path` holds an eval line (`eval`, else a train line) of
    `step`: a made-up eval (the one that failed at a checkpoint's step) that an earlier
    resume ran and logged, whose rerun from that checkpoint logs it once; the train line
    its early stop flushed there (`_run`)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and (rec.get("eval") is True) == eval and \
                        rec.get("step") == step:
                    return True
    except OSError:
        pass
    return False


def held_out_set(cfg: Config) -> dict:
    """{field: value} of what sets the batches a run's evals read: the eval file (or, where
    there is none, the train file whose end is held out; a prepared folder), the split, how
    many batches and of how many rows. A resume on another set starts early stopping's best
    over (`_run`). The rows per batch only where they set what is read: a number of batches,
    or a stream cut into that many rows (a review, d1: the whole split, its last batch
    completed with filler rows, is the same set at any batch size)."""
    d, t = cfg.data, cfg.train
    paths = {"data.prepared": d.prepared} if d.prepared else {}
    paths.update({"data.eval_path": d.eval_path} if d.eval_path
                 else {"data.train_path": d.train_path})
    # generated ListOps evaluates on the data.listops_num_eval examples after its training
    # ones (a review, session 116: a resume on another count kept the old set's best)
    generated = d.task == "listops" and not d.train_path and not d.prepared
    return {**{k: os.path.abspath(v) if v else v for k, v in paths.items()},
            "data.eval_split": d.eval_split, "train.eval_batches": t.eval_batches,
            **({"data.eval_batch_size": d.eval_batch_size or t.batch_size}
               if t.eval_batches or d.batching == "stream" else {}),
            **({"data.listops_num_eval": d.listops_num_eval} if generated else {})}


def profile_folder(profile_dir: str) -> str:
    """Where this process writes its `--profile` trace: DIR, or DIR/process_I in a run of
    several processes (a bug hunt, session 99: those of one host wrote one HOST.xplane.pb,
    one trace over the other)."""
    if jax.process_count() > 1:
        return os.path.join(profile_dir, f"process_{jax.process_index()}")
    return profile_dir


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite (or the eval loss of a step's parameters)."""


class Interrupted(KeyboardInterrupt):
    """The user stopped training (Ctrl-C, SIGINT; SIGTERM: see hpnlp.train.stop): says which
    checkpoint a rerun resumes from. Still a KeyboardInterrupt, so what stops on one (a
    benchmark's rows) stops on it. `exit_code`: the process's (130 Ctrl-C, 143 SIGTERM);
    `saved`: the loop saved its step and every process stopped there (they can shut down
    together)."""

    def __init__(self, message: str, exit_code: int = 130, saved: bool = False):
        super().__init__(message)
        self.exit_code, self.saved = exit_code, saved


_MAXIMIZE = ("accuracy",)


def dummy_batch(kind: str, batch: int, length: int) -> dict:
    """Zero batch of the right keys and shapes, for `init` and shape inference."""
    z = np.zeros((batch, length), np.int32)
    one = np.ones((batch, length), np.int32)
    if kind == "lm":
        return {"inputs": z, "targets": z, "segment_ids": one, "positions": z}
    rows = {"label": np.zeros((batch,), np.int32), "weight": np.ones((batch,), np.float32)}
    if kind == "classify":
        return {"inputs": z, "segment_ids": one, **rows}
    return {"inputs1": z, "segment_ids1": one, "inputs2": z, "segment_ids2": one,
            "index": np.zeros((batch,), np.int32), **rows}


def _global(batch: dict, sharding) -> dict:
    """This process's rows -> one global array per key, sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def check_process_rows(sharding, batch_size: int) -> None:
    """The data iterator gives process p of n rows [p*B/n, (p+1)*B/n) of each global
    batch, and `_global` puts them where this process's devices sit in the mesh; refuse a
    mesh where the two differ, which would silently drop or duplicate rows (e.g. a tensor
    axis spanning processes replicates the batch over them)."""
    pi, pc = jax.process_index(), jax.process_count()
    per = batch_size // pc
    held = set()
    for idx in sharding.addressable_devices_indices_map((batch_size,)).values():
        held.update(range(*idx[0].indices(batch_size)))
    if held != set(range(pi * per, (pi + 1) * per)):
        from hpnlp.config import ConfigError
        # the axes the batch is not split over, as this sharding's rule names them (review r2:
        # a fixed list named `expert`, which the default rule and expert parallelism split the
        # batch over, so the advice gave up a valid layout)
        spec = sharding.spec[0] if len(sharding.spec) else None
        batch = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
        others = [a for a in sharding.mesh.axis_names if a not in batch]
        raise ConfigError(
            f"config field `mesh` does not split the batch over processes: process {pi} of {pc} "
            f"reads rows {pi * per}..{(pi + 1) * per - 1} of each global batch of {batch_size}, "
            f"but its devices hold rows {min(held)}..{max(held)} ({len(held)} rows). Keep the "
            "mesh axes that `mesh.rules.batch` does not name"
            + (f" ({', '.join(others)})" if others else "") + " within one process, so the "
            "batch axes split the processes evenly and in process order")


_SHARED_PROGRAMS: dict = {}  # (program text, devices) -> compiled; the newest few


def shared_program(fn, *args, mesh=None):
    """`fn` (jitted) compiled for `args`, reused by every later call in this process whose
    program is the same text on the same devices (`mesh`'s, else those `args` are on): runs
    of one model initialize their parameters by one program, and the compress bench times
    many trained models of one shape, but each jits its own closure, which jax would compile
    anew (about 2 s on a 2-core CPU for a small Transformer's random initialization; a
    program under `jax_persistent_cache_min_compile_time_secs` is not even cached)."""
    import hashlib
    lowered = fn.lower(*args)
    if mesh is not None:
        devices = (mesh.axis_names, tuple(d.id for d in mesh.devices.flat))
    else:
        devices = (tuple(sorted({d.id for a in jax.tree.leaves(args) if isinstance(a, jax.Array)
                                 for d in a.devices()})), str(jax.config.jax_default_device))
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), devices, jax.process_index())
    if key not in _SHARED_PROGRAMS:
        if len(_SHARED_PROGRAMS) >= 16:
            _SHARED_PROGRAMS.pop(next(iter(_SHARED_PROGRAMS)))
        _SHARED_PROGRAMS[key] = lowered.compile()
    return _SHARED_PROGRAMS[key]


def _rebox(boxed, values):
    """`values` (unboxed) in the logical-axis boxes of `boxed` (abstract, as init made it)."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda b, v: b.replace_boxed(v) if is_box(b) else v, boxed, values,
                        is_leaf=is_box)


def _peak_memory() -> dict:
    # this process image's own peak, not ru_maxrss, which a bench's child inherits from its
    # parent on Linux (a review, session 109; the data and lra benches report this one)
    from hpnlp.bench.harness import peak_rss_bytes
    out = {"host_peak_rss_bytes": peak_rss_bytes()}
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    return out


def _reader_split(cfg: Config, k: int) -> bool:
    """Whether `k` data-parallel shards split the batches a run read here builds: its
    training batch (per accumulation step), its eval batch, and explicit MoE groups."""
    t, moe = cfg.train, cfg.model.moe
    eval_bs = cfg.data.eval_batch_size or t.batch_size
    groups = moe.groups if moe.enabled() and moe.dispatch == "capacity" else 0
    return t.batch_size % (t.grad_accum * k) == 0 and eval_bs % k == 0 and groups % k == 0


def _refused_on(cfg: Config, n: int) -> str:
    """Why `cfg`'s own mesh, its -1 axes filled on `n` devices, cannot lay the run out there
    (its pipeline stages or expert shards against the model), or "" where it can."""
    from hpnlp.config import ConfigError
    from hpnlp.config.checks import portable_here
    if not any(getattr(cfg.mesh, a) == -1 for a in MESH_AXES if a != "data"):
        return ""
    try:  # with what a reader replaces anyway (a review, session 118: cuDNN attention off a
        # GPU read as the mesh not fitting)
        validate(portable_here(cfg, n)[0], num_devices=n)
    except ConfigError as e:
        return str(e).splitlines()[0]
    return ""


def reader_mesh(cfg: Config, n: int, *, fewer_devices: bool = True
                ) -> tuple[MeshConfig, int, str | None]:
    """(mesh, k devices it lays out, what changed: None where the saved mesh is kept) for a
    run read on `n` devices (`for_these_devices`)."""
    mesh = cfg.mesh
    sizes = mesh.axis_sizes(n)
    fits = mesh.fits(n)
    # With several processes, the axes the batch rule does not name must stay within one
    # process (`check_process_rows`; a bug hunt, session 101: a tensor-parallel run of one
    # process was refused on two, where every device on the data axis reads it). The devices
    # lie in MESH_AXES order, each process's a block of them (parallel/mesh.py make_mesh): from
    # the outermost such axis inward, every axis must fit in the block (review: a batch axis
    # inside one, expert in {tensor: 2, expert: 2}, gives each process every row)
    batch = mesh.mesh_axes_of("batch")
    used = [a for a in MESH_AXES if sizes[a] > 1]
    inner = math.prod(sizes[a] for a in used[next(
        (i for i, a in enumerate(used) if a not in batch), len(used)):])
    across = fits and jax.process_count() > 1 and jax.local_device_count() % inner != 0
    fits = fits and not across
    refused = fits and _refused_on(cfg, n)  # a review (session 117): mesh.pipeline=-1 (or
    # expert) filled 8 devices; on 2 its one stage refused its pipeline_microbatches, on 6
    # its depth: read on the data axis instead, as a mesh that does not fit is
    fits = fits and not refused
    shards = math.prod(sizes[a] for a in batch) if fits else 0
    if fits and _reader_split(cfg, shards):
        return mesh, n, None
    k = n
    if fewer_devices and jax.process_count() == 1:  # (several processes' rows: all)
        k = max(k for k in range(1, n + 1) if _reader_split(cfg, k))
    if fits and k == n:  # (review: said "read with mesh.data=n", then validate refused it)
        return mesh, n, None
    given = {a: getattr(mesh, a) for a in MESH_AXES if getattr(mesh, a) != 1}
    saved = given or {"data": 1}  # a bug hunt (session 100): "on mesh {}" of all ones
    why = (f"was trained on mesh {saved}, whose {inner} devices of axes outside the batch "
           f"would span the {jax.process_count()} processes here" if across else
           f"was trained on mesh {saved}, which does not fit the {n} device(s) here"
           + (f" ({refused})" if refused else "") if not fits else
           f"splits its batch over {shards} of the {n} device(s) here, which does not "
           "divide it")
    moe = cfg.model.moe  # (dropless routing groups split no batch: `_reader_split`)
    groups = moe.groups if moe.enabled() and moe.dispatch == "capacity" else 0
    where = (f" on {k} of the {n} devices (train.batch_size={cfg.train.batch_size}, "
             f"train.grad_accum={cfg.train.grad_accum}, data.eval_batch_size="
             f"{cfg.data.eval_batch_size or cfg.train.batch_size}"
             + (f" and model.moe.groups={groups}" if groups else "") + " split over no more)"
             if k < n else "")
    a = cfg.attention
    # (mesh.pipeline=-1 filled the devices it trained on, which this config does not say:
    # "may", a re-read of this note found it silent or wrong there)
    unpiped = mesh.pipeline != 1 and draws_features(a.name, a.options)
    may = " may" if mesh.pipeline == -1 else ""
    why += (f"; read with mesh.data={k}{where}"
            # (dropless groups split no batch nor route: a re-read, session 111)
            + (" (its MoE routing groups follow the devices)" if moe.enabled()
               and moe.dispatch == "capacity" and not moe.groups else "")
            # (a review of session 108: `generate` refuses decoding a pipelined run of random
            # features from its config, and this layout made that config say pipeline 1)
            + (f"; its attention ({a.name!r}) draws random features per layer otherwise in "
               f"one stage than in pipeline stages (hpnlp/parallel/pipeline.py), so its "
               f"evaluations and decodes here{may} compute another function than its "
               f"training did (mesh.pipeline={mesh.pipeline})" if unpiped else ""))
    return dataclasses.replace(mesh, data=-1 if k == n else k, fsdp=1, tensor=1, sequence=1,
                               pipeline=1, expert=1, pipeline_microbatches=0), k, why


def for_these_devices(cfg: Config, workdir: str, *, fewer_devices: bool = True) -> Config:
    """A saved run read (not trained) here: its checkpoints depend neither on the layout nor
    on which implementation computed them, so each is chosen for these devices, said in one
    line (a bug hunt, session 92: generate, quantize and the kNN-LM refused a tensor-parallel
    run on a laptop, and had no flag to lay it out otherwise; session 100: so too a GPU run's
    cuDNN attention, a fused kernel on several devices (`portable_here`), and a device count
    that does not split the run's batch).

    The mesh: where the saved one does not fit the devices, or its batch does not split over
    them, every device on the data axis; where the batch does not split over all of them
    (3 devices, a batch of 8), `fewer_devices` reads on the first k devices, k the most that
    split it (`reader_devices`), else on all (callers that check the config against every
    device themselves)."""
    from hpnlp.config.checks import portable_here
    # a mesh laid out here already (a reader's config passed on to another: quantize's to
    # its Trainer) is kept, unsaid
    n = jax.device_count()
    mesh, k, why = (cfg.mesh, 0, None) if isinstance(cfg.mesh, ReaderMesh) else reader_mesh(
        cfg, n, fewer_devices=fewer_devices)
    a = cfg.attention
    if why is None and mesh.pipeline == -1 and draws_features(a.name, a.options):
        # the saved mesh kept, its -1 stages filled here: another count than it trained in
        # (a review, session 118: 2 stages trained, 1 read, unsaid)
        from hpnlp.compress.distill import checkpoint_pipeline_stages
        trained, here = checkpoint_pipeline_stages(workdir), mesh.axis_sizes(n)["pipeline"]
        if trained is not None and trained != here and jax.process_index() == 0:
            print(f"hpnlp: {workdir} trained in {trained} pipeline stage(s) (mesh.pipeline=-1) "
                  f"and is laid out in {here} on the {n} device(s) here; its attention "
                  f"({a.name!r}) draws random features per layer otherwise in other stages "
                  "(hpnlp/parallel/pipeline.py), so its evaluations and decodes here compute "
                  "another function than its training did", file=sys.stderr, flush=True)
    if why:
        if jax.process_index() == 0:
            print(f"hpnlp: {workdir} {why}", file=sys.stderr, flush=True)
        if k < n:
            mesh = ReaderMesh(**{f.name: getattr(mesh, f.name) for f in dataclasses.fields(mesh)})
        cfg = dataclasses.replace(cfg, mesh=mesh)
    cfg, notes = portable_here(cfg, reader_device_count(cfg))
    if jax.process_index() == 0:
        for note in notes:
            print(f"hpnlp: {workdir}: {note}", file=sys.stderr, flush=True)
    return cfg


def mesh_for_these_devices(cfg: Config, workdir: str) -> Config:
    """`for_these_devices` on every device (`compress shrink`, whose output is a run to
    train on all of them)."""
    return for_these_devices(cfg, workdir, fewer_devices=False)


class ReaderMesh(MeshConfig):
    """A mesh `for_these_devices` laid out on the first `data` devices here (fewer than there
    are): a reader's, its config passed on (quantize's to its Trainer) kept as it is. Marked by
    its class, held in the config object only: a config.json read back is a MeshConfig, so a
    saved run is always laid out anew (a bug hunt, session 101: inferred from the sizes, a run
    of mesh.data=2 read on 4 devices was kept on 2 of them, unsaid, while hpnlp.moe.route,
    which asks `reader_mesh`, routed in 4 groups)."""


def reader_devices(cfg: Config) -> list | None:
    """The first k devices where `for_these_devices` laid the run read here out on k of them,
    k below the device count, else None (all)."""
    k = cfg.mesh.data
    if (not isinstance(cfg.mesh, ReaderMesh) or jax.process_count() > 1 or not
            0 < k < jax.device_count()):  # (a ReaderMesh replaced stays one: review)
        return None
    return jax.devices()[:k]


def reader_device_count(cfg: Config) -> int:
    """How many devices a run read here is laid out on (`reader_devices`)."""
    return len(reader_devices(cfg) or jax.devices())


def _check_saved_tokenizer(cfg: Config, workdir: str) -> None:
    """A run resumed or read with a subword data.tokenizer (bpe, unigram) where its
    config.json's ids were another tokenizer's: a ConfigError naming the field, before the
    task is built (a re-read, session 111: a bytes run resumed with a bpe tokenizer was told
    its tokenizer folder was lost, which it never had; before that, one was trained and
    saved into the run). Other changes are the Checkpointer's to name."""
    from hpnlp.data import LM_TASKS
    from hpnlp.data.text_tasks import lm_tokenizer
    d = cfg.data
    if (d.prepared or d.task not in LM_TASKS or d.tokenizer not in ("bpe", "unigram")
            or not os.path.isfile(os.path.join(workdir, "config.json"))):
        return
    saved = load_run_config(workdir).data
    was = lm_tokenizer(saved, saved.task) if saved.task in LM_TASKS else None
    if was is not None and was != d.tokenizer:
        raise config_error("data.tokenizer", d.tokenizer,
                           f"the run in {workdir} trained on data.tokenizer={was!r} ids (its "
                           "config.json), which its weights read; set it back to resume or "
                           "read the run, or use a new --workdir")


def wide_sum(x):
    """A step's or an eval batch's sum on the host, in float64 where it is a float: the
    sums of a whole eval or log window pass 2^24 tokens (a review, session 117: summed in
    float32, the token count stopped counting exactly there, and the loss with it)."""
    x = np.asarray(x)
    return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x


def saves_after_a_failed_eval() -> bool:
    """Whether an eval that raised saves the steps trained since the last checkpoint before
    the error: in a single process only. An eval may fail in one process alone (its host's
    memory, its shard of a file), and the save's barrier there would meet the others' next
    step's collectives (a review, session 117: a hang, or gloo's abort, where the error's
    own line stops the others at once: `hpnlp.main`'s watch)."""
    return jax.process_count() == 1


class Trainer:
    """Holds what one run builds; `run()` is the whole loop. Split out so tests and
    notebooks can build a trainer, take a few steps, and look inside."""

    def __init__(self, cfg: Config, workdir: str, *, read_only: bool = False):
        """`read_only`: build the run to read it (restore, evaluate) without writing to
        `workdir` (hpnlp.compress uses this). Otherwise the workdir is held from here to the
        end of `run` (`hpnlp.paths.hold_for_training`): another process's run there is refused,
        and this one is where another holds it."""
        self._release_workdir, self._read_only, self._ran = (lambda: None), read_only, False
        unheld = self._release_workdir
        # A bug hunt (session 101): a run refused after its task saved WORKDIR/tokenizer (a
        # distillation teacher of another tokenizer) left it, and the corrected rerun was
        # refused as another run's folder. Where the folder held nothing of a run, what the
        # build made is removed, once this Trainer holds it (else it may be another's).
        from hpnlp.data.tokenizers import DIRNAME
        from hpnlp.paths import held_by
        made = os.path.join(workdir, DIRNAME)
        fresh = not read_only and jax.process_index() == 0 and not held_by(workdir) and not any(
            os.path.exists(os.path.join(workdir, f))
            for f in ("config.json", "checkpoints", DIRNAME))
        try:
            self._build(cfg, workdir, read_only=read_only)
        except BaseException:
            # the tokenizer removed unless the Checkpointer has written config.json, a run's
            # with it (a fixer's note, session 101: one after config.json left a run with no
            # tokenizer); an ensemble's members fail after it, so keep both
            if (fresh and self._release_workdir is not unheld and os.path.isdir(made)
                    and not os.path.exists(os.path.join(workdir, "config.json"))):
                import shutil
                shutil.rmtree(made, ignore_errors=True)
            self._release_workdir()
            raise

    # At exit the process's end releases the workdir (review: the modules were torn down);
    # sys.is_finalizing is bound here, as `sys` may be None by then (a bug hunt, session 98)
    def __del__(self, _finalizing=sys.is_finalizing):
        if not _finalizing():
            getattr(self, "_release_workdir", lambda: None)()

    def _build(self, cfg: Config, workdir: str, *, read_only: bool) -> None:
        devices = None  # all
        if read_only:
            cfg = for_these_devices(cfg, workdir)
            devices = reader_devices(cfg)
            data_lib.check_files_of_run(cfg.data, workdir)
        else:  # its config.json is read from other directories (generate, a resume)
            cfg = with_absolute_paths(cfg)
        data_lib.check_prepared_of_run(cfg.data, workdir)
        self.cfg = cfg = validate(cfg, num_processes=jax.process_count(),
                                  num_devices=None if devices is None else len(devices))
        from hpnlp.config.checks import check_new_run, check_training
        if not read_only:
            check_training(cfg)
        resumed = has_checkpoint(workdir)  # (nothing below saves one before the Checkpointer)
        # what a new run is refused that a saved one is not: here, before the workdir is held
        # and the data built (a review, session 107: a subword tokenizer was trained first)
        if not resumed:
            check_new_run(cfg)
        self.workdir = workdir
        if not read_only:  # before anything is written there
            from hpnlp.paths import WorkdirBusy, held_by, hold_for_training
            from hpnlp.train.checkpoint import other_model
            model = (cfg, getattr(self, "members", 1))
            # held by this process, with no checkpoint yet (which the Checkpointer compares):
            # a Trainer of another model is refused (a bug hunt, session 96: it rewrote the
            # first one's config.json)
            held = held_by(workdir)
            differ = held and not resumed and other_model(
                held[0], cfg, held[1], model[1])
            if differ:
                raise WorkdirBusy(f"--workdir {workdir}: this process holds it for a run of "
                                  f"another model ({differ}; a Trainer built before, still "
                                  "referenced); delete that Trainer (or let its run end), or "
                                  "use another --workdir")
            self._release_workdir = hold_for_training(workdir, jax.process_count(), model)
        self.lm = cfg.model.kind == "lm"
        # A subword tokenizer lives with the run (WORKDIR/tokenizer) and is reused on resume;
        # a resumed run's lost one is refused as a reader's is, not trained again (on text
        # that may have changed, which check_text_of_run then could not see: a re-read,
        # session 111); a prepared folder's is its own, copied, never trained
        if resumed:
            _check_saved_tokenizer(cfg, workdir)
        self.task = data_lib.make_task(
            cfg.data, workdir=workdir,
            save_tokenizer=not read_only and (not resumed or bool(cfg.data.prepared)))
        if resumed:  # its vocabulary or output layout of the text it trained on
            data_lib.check_text_of_run(cfg, self.task, workdir)
        pi, pc = jax.process_index(), jax.process_count()
        self.iter_args = dict(process_index=pi, process_count=pc)
        self.train_iter = data_lib.make_iterator(self.task, cfg.data, split="train",
                                                 batch_size=cfg.train.batch_size, **self.iter_args)
        if cfg.data.batching == "stream":  # its eval stream's rows are checked here, not after
            # the training (found in review: too few eval tokens failed at the first eval)
            data_lib.make_iterator(self.task, cfg.data, split="eval",
                                   batch_size=cfg.data.eval_batch_size or cfg.train.batch_size,
                                   **self.iter_args)
        self.mesh = make_mesh(cfg.mesh, devices)
        self.rules = cfg.mesh.rule_tuples()
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        for bs in {cfg.train.batch_size, cfg.data.eval_batch_size or cfg.train.batch_size}:
            check_process_rows(self.batch_sharding, bs)
        # tx, the optimizer: below, from the parameters the run trains (weight decay's mask)
        counts = self.task.token_counts
        model = models.build(cfg, deterministic=False, token_counts=counts)
        self.eval_model = models.build(cfg, deterministic=True, token_counts=counts)
        scale = cfg.train.loss_scale_init if cfg.model.dtype == "float16" else None
        # What methods carry between steps (XL memory, a teacher, pruning masks): train/carry.py.
        self.carries = carry_lib.for_config(
            cfg, token_counts=counts, workdir=workdir,
            tokenizer_sha256=data_lib.task_tokenizer_sha256(self.task),
            text_digest=data_lib.task_text_digest(self.task))
        batch1 = dummy_batch(self.task.kind, 1, cfg.data.seq_len)
        # The parameters as the model initializes them (before any factorization): what a
        # run named by train.init_from holds (traced only for such a run), refused here,
        # before any compile, if the shapes differ.
        self.model_params = None
        self._restored = None  # train.init_from's parameters when already read (lowrank.energy)
        # train.init_from's key/value heads (pooled into fewer or into a latent) or experts
        # (fewer, or a dense MLP upcycled), converted here: compress.gqa.conversion, or None
        self._convert = None
        # A run that has saved a checkpoint holds its parameters: it resumes, and is read,
        # with train.init_from's folder moved or deleted (a bug hunt: each failed, saying to
        # train a run there), and so does one whose ranks lowrank.energy chose (below).
        # Nor is that run read once this one has (review, session 94: config.json keeps
        # init_from, and a source trained anew as another model was refused for good).
        saved = resumed
        started = cfg.train.init_from and saved
        if cfg.train.init_from and not started:
            from hpnlp.compress import gqa
            from hpnlp.train import transfer
            source = load_run_config(cfg.train.init_from, field="train.init_from")
            mine = data_lib.task_tokenizer_sha256(self.task)
            self._convert = (transfer.conversion(cfg, source, cfg.train.init_from, mine,
                                                 data_lib.task_text_digest(self.task))
                             or gqa.conversion(cfg, source.model, cfg.train.init_from))
            if self._convert is not None and self._convert.calibrate is not None:
                gqa.check_calibration_source(self._convert.source, source, cfg.train.init_from)
            if cfg.train.init_params != "trunk":  # its output layer read whole
                from hpnlp.compress.distill import refuse_other_counts
                refuse_other_counts(cfg, source, "train.init_from", cfg.train.init_from,
                                    "set train.init_params='trunk' to start from its embedding "
                                    "and trunk under this run's own output layer, or train on "
                                    "that run's text", my_text=data_lib.task_text_digest(self.task))
            if source.model.lowrank.enabled():  # (a conversion refuses it in its own words)
                # a bug hunt (session 95): told to copy its model.lowrank settings, then
                # refused with them (a run reads a dense run, to factorize it itself)
                raise config_error("train.init_from", cfg.train.init_from, "that run's "
                                   "products are factorized (model.lowrank), and a run starts "
                                   "from a dense run's weights (factorizing them itself under "
                                   "model.lowrank); start from the dense run it was factorized "
                                   "from, or train that run on (raise its train.steps)")
            src, src_batch = model, batch1
            if self._convert:  # built as that run was, on its task's batches
                sd = self._convert.source.data
                info = data_lib.task_info(sd)
                # another task's counts are not its own; its shapes need only some counts
                own = sd.task == cfg.data.task
                src = models.build(self._convert.source, deterministic=False,
                                   token_counts=counts if own else np.ones(info["vocab_size"]))
                src_batch = dummy_batch(info["kind"], 1, sd.seq_len)
            self.model_params = jax.eval_shape(
                lambda key: nn.unbox(src.init({"params": key, "dropout": key},
                                              src_batch)["params"]), jax.random.key(0))
            if data_lib.saw_validation(cfg.data, source.data):
                raise config_error("train.init_from", cfg.train.init_from, "that run may have "
                                   "trained on the examples this run holds out for "
                                   "data.eval_split='validation'; start from a run trained with "
                                   "it too (and, for ListOps, the same generator settings)")
            if data_lib.saw_eval(cfg.data, source.data):  # generated ListOps (review r2)
                n, theirs = cfg.data.listops_num_train, source.data.listops_num_train
                raise config_error("train.init_from", cfg.train.init_from, "that run trained on "
                                   "the generated ListOps examples this run evaluates on (the "
                                   f"same data.seed and generator fields, data.listops_num_train="
                                   f"{theirs}, this run's {n}); start from a run of data."
                                   f"listops_num_train <= {n} or of another data.seed, or set "
                                   f"this run's data.listops_num_train={theirs}")
            check_params_match(cfg.train.init_from, self.model_params, field="train.init_from",
                               cfg=self._convert.source if self._convert else cfg)
        transform = None
        if cfg.model.lowrank.enabled():  # factorized products (hpnlp.compress.lowrank)
            from hpnlp.compress import lowrank
            lr = cfg.model.lowrank
            saved = (load_run_config(workdir).model.lowrank.ranks
                     if lr.energy and not lr.ranks and resumed else None)
            if saved:  # a resume: the ranks its start chose, which its config.json holds
                # (a bug hunt: it read train.init_from's run again, and failed where that
                # had moved; a different energy is refused by the checkpoint's config check)
                self.cfg = cfg = dataclasses.replace(cfg, model=dataclasses.replace(
                    cfg.model, lowrank=dataclasses.replace(lr, ranks=saved)))
            elif lr.energy and not lr.ranks:  # from the run train.init_from names
                self._restored = restore_params(cfg.train.init_from, self.model_params,
                                                field="train.init_from")
                self.cfg = cfg = lowrank.resolve_energy(cfg, model, batch1, self._restored)
            transform = lowrank.init_transform(cfg, model, batch1)
        carries, mesh = self.carries, self.mesh  # (not self: a Trainer deleted is collected
        # at once, and the workdir it holds released; a bug hunt, session 96)
        init = lambda key, params=None: init_state(  # noqa: E731
            model, tx, key, batch1, loss_scale=scale, carries=carries,
            batch_size=cfg.train.batch_size, transform=transform, params=params)
        with self._context():
            # Two programs: the model's random initialization, which every run of the same
            # model shares (one compile per process: `shared_program`), then the rest of the
            # state from it (optimizer, carries, a factorization), this run's own and small.
            key0 = jax.random.key(cfg.seed)
            boxed = jax.eval_shape(lambda key: init_params(model, key, batch1), key0)
            if self._convert and self._convert.check:  # e.g. a trunk transfer's shapes
                self._convert.check(self.model_params, carry_lib.model_params(unboxed(boxed)))
            # Weight decay's mask is drawn once from the parameters the run trains, boxed with
            # their logical axes (a bug hunt, session 101: state.decay_mask), before `init`
            # runs the optimizer; the ensemble's members take the same.
            from hpnlp.train.state import train_params
            trained = jax.eval_shape(lambda key, p: train_params(
                model, key, batch1, carries=carries, transform=transform,
                params=_rebox(boxed, p)), key0, unboxed(boxed))
            tx = make_optimizer(cfg.train, params=trained)
            abstract = jax.eval_shape(lambda key, p: init(key, _rebox(boxed, p)), key0,
                                      unboxed(boxed))
            self.state_sharding = state_shardings(abstract, self.mesh, self.rules)
            draw = jax.jit(lambda key: nn.unbox(init_params(model, key, batch1)),
                           out_shardings=state_shardings(boxed, self.mesh, self.rules))
            rest = jax.jit(lambda key, p: nn.unbox(init(key, _rebox(boxed, p))),
                           out_shardings=self.state_sharding)
            self._init = lambda key: rest(key, shared_program(draw, key, mesh=mesh)(key))
            self.abstract_state = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                unboxed(abstract), self.state_sharding)
            self.train_step = jax.jit(
                make_train_step(model, tx, cfg.train, self.carries),
                in_shardings=(self.state_sharding, self.batch_sharding),
                out_shardings=(self.state_sharding, None), donate_argnums=0,
                compiler_options=step_compiler_options())
            self.eval_step = jax.jit(make_eval_step(self.eval_model, cfg.train,
                                                    carries=self.carries),
                                     in_shardings=(self.state_sharding, self.batch_sharding),
                                     compiler_options=step_compiler_options())
            self.eval_memory = None
            if xl.carries_memory(cfg):  # eval_sums threads the eval stream's own memory
                eval_bs = cfg.data.eval_batch_size or cfg.train.batch_size
                mem_sharding = xl.memory_sharding(cfg, eval_bs, self.mesh, self.rules)
                self.eval_memory = jax.jit(lambda: nn.unbox(xl.boxed_memory(cfg, eval_bs)),
                                           out_shardings=mem_sharding)
                self.eval_memory_step = jax.jit(
                    make_eval_step(self.eval_model, cfg.train, memory=True),
                    in_shardings=(self.state_sharding, self.batch_sharding, mem_sharding),
                    out_shardings=(None, mem_sharding), compiler_options=step_compiler_options())
        self.model, self.tx = model, tx
        self.checkpointer = Checkpointer(workdir, cfg, keep=cfg.train.keep_checkpoints,
                                         members=getattr(self, "members", 1), read_only=read_only)
        if cfg.train.distill.teacher and not read_only:  # what a resume needs of the teacher
            from hpnlp.compress.distill import keep_teacher_config
            keep_teacher_config(cfg, workdir)

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        from hpnlp.parallel.pipeline import use_microbatches
        stack.enter_context(use_microbatches(self.cfg.mesh.pipeline_microbatches))
        return stack

    def routing_groups(self) -> int | None:
        """The MoE routing groups a train step uses where model.moe.groups=0 (one per
        data-parallel shard: they follow the devices) and they change what it computes (not
        dropless top-k routing, whose tokens all reach their experts), else None."""
        moe = self.cfg.model.moe
        if not moe.enabled() or moe.groups or (moe.dispatch == "dropless"
                                                and moe.router != "expert_choice"):
            return None
        from hpnlp.moe.layer import batch_shards
        with self._context():
            return batch_shards()

    def _groups_said(self, loop: dict) -> str:
        """'; ...' where a resume routes in other MoE groups than the steps before it (a bug
        hunt, session 95: resumed on 4 devices, capacity dropped other tokens, unsaid)."""
        before, now = loop.get("routing_groups"), self.routing_groups()
        if before is None or now is None or before == now:
            return ""
        # (review: a groups setting the mesh refuses is not offered)
        keep = (f"set model.moe.groups={before} to route as before" if before % now == 0 else
                f"model.moe.groups must be a multiple of the {now} data-parallel shards here, "
                f"so a layout of {before} shard{'s' * (before > 1)} routes as before")
        return (f"; its MoE routing groups follow the devices (model.moe.groups=0): {before} "
                f"before, {now} now, so capacity keeps other tokens ({keep})")

    def _pipeline_said(self, loop: dict, start: int) -> str:
        """'; ...' where a resume of a model whose attention draws random features from the
        `features` stream (Performer's projections, LSH's rotations) moves between pipeline
        stages and none: the stages key that stream per layer otherwise than the stacked
        scan (parallel/pipeline.py), so the same weights compute another function (a review,
        r3: said as the same computation laid out otherwise, i.e. not at all)."""
        a = self.cfg.attention
        if start >= self.cfg.train.steps or not (self.cfg.model.stack_layers
                                                 and draws_features(a.name, a.options)):
            return ""
        now, before = int(self.mesh.shape["pipeline"]), loop.get("pipeline_stages")
        if type(before) is not int:  # a checkpoint saved before the loop item held its stages:
            # the saved config's, where it gives a size (-1 fills with the devices there)
            was = self.checkpointer.changed.get("mesh.pipeline", (None,))[0]
            before = was if type(was) is int and was > 0 else None
        if before is None or (before > 1) == (now > 1):
            return ""
        return (f"; attention.name={a.name!r} draws random features per layer, which pipeline "
                f"stages key otherwise than one stage does: its steps ran in {before} "
                f"stage{'s' * (before > 1)}, these run in {now}, so the same weights compute "
                f"with other features (set mesh.pipeline{'=1' if before == 1 else ' > 1'} "
                "to compute as before)")

    def initial_state(self):
        """(state, loop_state): restored from the newest checkpoint, or fresh."""
        step = self.checkpointer.latest_step()
        if step is None and self._read_only:  # a bug hunt (session 96): a mistyped path read
            # a model's random initialization as the run's, without a word
            raise NoCheckpoint(f"workdir {self.workdir} has no checkpoint to read: a read-only "
                               "Trainer reads a trained run (train one there first, or build "
                               "the Trainer without read_only=True to start one)")
        if step is None:
            return self.fresh_state(jax.random.key(self.cfg.seed)), {}
        state, data_state, loop_state = self.checkpointer.restore(step, self.abstract_state)
        # the routing groups its steps ran in (`split_model`; a reader's loop item may be damaged)
        saved = loop_state.get("routing_groups") if isinstance(loop_state, dict) else None
        self._restored_groups = (step, saved if type(saved) is int and saved > 0 else None)
        try:
            self.train_iter.set_state(data_state)
        except ValueError as e:  # a bug hunt (session 99): the data state's fault, unnamed
            where = os.path.join(self.checkpointer.directory, str(step))
            if not self._read_only:
                raise CheckpointMismatch(f"checkpoint {where}/data: {e}") from None
            # a reader reads the parameters whatever the training stream's state, and says so
            # (a review, session 115: generate refused a byte-level run whose text had grown
            # since, as the checkpoint's restore already lets a reader through)
            print(f"hpnlp: note: checkpoint {where}/data does not match the data this config "
                  f"reads now ({str(e).split('; resume with')[0]}); its parameters are read as "
                  "saved, and any evaluation here reads the data as it is now",
                  file=sys.stderr, flush=True)
        return state, loop_state

    def fresh_state(self, key, sharding=None):
        """A new state from `key`: initialized, `train.init_from`'s weights read in, and every
        carry started (a teacher's initialization before pruning's start), placed on
        `sharding` (default: this trainer's)."""
        sharding = sharding or self.state_sharding
        with self._context():
            state = self._init(key)
            if self.cfg.train.init_from:
                state = state.replace(params=self._params_from(self.cfg.train.init_from,
                                                               state.params, key))
            carry, params = {}, state.params
            for c in self.carries:
                carry[c.name] = c.start(state.carry[c.name], params)
                params = c.start_params(carry[c.name], params, self._first_train_batches)
            if params is not state.params:
                state = state.replace(params=jax.device_put(params, sharding.params))
            return state.replace(carry=jax.device_put(carry, sharding.carry))

    def source_eval_model(self):
        """The `train.init_from` run's model as it evaluates (dropout off), in the shapes it
        is restored in before a conversion: what its calibration reads (the attention inputs
        that weight calibrated key/value fits, the routes that rank experts)."""
        return models.build(self._convert.source, deterministic=True,
                            token_counts=self.task.token_counts)

    def _first_train_batches(self, n: int) -> list[dict]:
        """The run's first `n` training batches as global arrays sharded like the train
        step's, from an iterator of their own (the run's own iterator and so its data order
        are untouched)."""
        import itertools
        it = data_lib.make_iterator(self.task, self.cfg.data, split="train",
                                    batch_size=self.cfg.train.batch_size, **self.iter_args)
        return [_global(b, self.batch_sharding) for b in itertools.islice(iter(it), n)]

    def _params_from(self, workdir: str, like, key):
        """The newest parameters of the run in `workdir` as this run starts from them: read
        into `like`'s shardings; converted (other key/value heads or experts: `like` is this
        run's start from `key`, which a conversion may read); or (model.lowrank) read as the
        model's weights and then factorized by truncated SVD."""
        own = carry_lib.trainable_params(like)
        if own:  # a method's own parameters start fresh
            return {**self._params_from(workdir, carry_lib.model_params(like), key), **own}
        if self._convert:  # other key/value heads or experts (compress.gqa.conversion)
            source = restore_params(workdir, self.model_params, field="train.init_from")
            stats, c = None, self._convert
            if c.calibrate:  # e.g. the fits weighted by the inputs, the experts' routes
                stats = c.calibrate(self.source_eval_model(), source,
                                    self._first_train_batches(c.batches))
            converted = jax.jit(c.convert)(source, stats, like, key)
            return jax.device_put(converted, jax.tree.map(lambda a: a.sharding, like))
        if not self.cfg.model.lowrank.enabled():
            return restore_params(workdir, like, field="train.init_from")
        from hpnlp.compress import lowrank
        dense, self._restored = self._restored, None  # read once: lowrank.energy read it
        if dense is None:
            dense = restore_params(workdir, self.model_params, field="train.init_from")
        batch1 = dummy_batch(self.task.kind, 1, self.cfg.data.seq_len)
        found = lowrank.targets(self.cfg, self.model, dense, batch1)
        factored = jax.jit(lambda p: lowrank.factorize(p, found, self.cfg.model.lowrank.rank_of))(dense)
        # `like`'s own placement: a seed ensemble's member is one slice of its stacked state
        return jax.device_put(factored, jax.tree.map(lambda a: a.sharding, like))

    def eval_sums(self, state, eval_step=None, memory_step=None, *,
                  batches: int | None = None) -> dict:
        """Host sums of `eval_step` (default: this trainer's, with memory for Transformer-XL
        on a stream) over the eval batches (the first `batches`; None: train.eval_batches).
        For Transformer-XL on a stream, the eval stream's memory is threaded through
        `memory_step(state, batch, memory) -> (sums, memory)` (default: this trainer's)
        unless only an `eval_step` is given (memoryless)."""
        cfg = self.cfg
        memory = None
        if getattr(self, "eval_memory", None) and (eval_step is None or memory_step is not None):
            memory = self.eval_memory()
        memory_step = memory_step or getattr(self, "eval_memory_step", None)
        eval_step = eval_step or self.eval_step
        it = data_lib.make_iterator(self.task, cfg.data, split="eval",
                                    batch_size=cfg.data.eval_batch_size or cfg.train.batch_size,
                                    **self.iter_args)
        total, limit = None, cfg.train.eval_batches if batches is None else batches
        with self._context():
            for i, batch in enumerate(it):
                if limit and i >= limit:
                    break
                if memory is not None:
                    sums, memory = memory_step(state, _global(batch, self.batch_sharding), memory)
                else:
                    sums = eval_step(state, _global(batch, self.batch_sharding))
                sums = jax.tree.map(wide_sum, sums)
                total = sums if total is None else jax.tree.map(np.add, total, sums)
        return jax.device_get(total)

    def evaluate(self, state, *, batches: int | None = None) -> dict:
        """The held-out metrics of `state` over the first `batches` eval batches (None:
        train.eval_batches), with the model's whole-split metrics where it has them."""
        out = finalize(self.eval_sums(state) if batches is None else
                       self.eval_sums(state, batches=batches), lm=self.lm)
        # A model may measure the whole eval split at once (the bi-encoder: each held-out
        # query searched against the whole held-out pool), beside the batch sums.
        split_metrics = getattr(type(self.eval_model), "split_metrics", None)
        if split_metrics is None:
            return out
        params = carry_lib.model_params(state.params)
        # the random-feature draw the parameters trained with (Performer, LSH encoders; a
        # review, session 106: the pool was embedded with the seed's), from the replicated
        # rng and step each process holds, so it runs outside the run's mesh too
        rng, step = jax.device_get((state.rng, state.step))
        key = state.replace(rng=rng, step=step).features_key(self.cfg.train.feature_redraw_every)
        model = self.split_model(step)
        if jax.process_count() == 1:
            # in the run's mesh and pipeline, as its steps: a pipelined Performer or LSH trunk
            # draws its features per stage (parallel/pipeline.py), and the pool evaluated
            # unpipelined, at the end of a run resumed at train.steps or from a user's call,
            # measured another function than its training and in-batch eval (review r13)
            with self._context():
                out.update(split_metrics(self.cfg, model, jax.device_get(params), self.task,
                                         features_key=key))
            return out
        # Several processes (a review, r7: they measured none, unsaid): each gathers the whole
        # of every parameter and measures the whole split alike on its own devices, outside
        # the run's mesh (whose constraints would lay the pass out across the processes).
        from jax.experimental import multihost_utils
        from hpnlp.attention import draws_features
        params = multihost_utils.process_allgather(params, tiled=True)
        if self.mesh.shape["pipeline"] > 1 and not getattr(self, "_pool_said", False) and \
                draws_features(self.cfg.attention.name, self.cfg.attention.options):
            self._pool_said = True  # said once a run (review r13)
            print(f"{self.cfg.name}: note: the held-out pool's metrics (recall, MRR) run "
                  "unpipelined on each process, so this pipelined run's random features are "
                  "drawn per layer otherwise there than in its steps and in-batch eval: they "
                  "measure another function; evaluate it on one process to read its own",
                  file=sys.stderr, flush=True)
        with jax.set_mesh(None):
            out.update(split_metrics(self.cfg, model, params, self.task, features_key=key))
        return out

    def split_groups(self, step) -> int | None:
        """The MoE routing groups `split_model(step)` is pinned to (None: not pinned), for a
        tool that builds its own model of the run's (quantize's: a review, session 118)."""
        groups = self.routing_groups()
        if groups is None:
            return None
        restored_step, saved = getattr(self, "_restored_groups", (None, None))
        return saved if saved and restored_step == int(step) else groups

    def split_model(self, step) -> nn.Module:
        """The eval model a split's metrics of the state at `step` are measured with (the
        bi-encoder's pool: `evaluate`, and a tool's through `knnlm.load_trained`). With MoE
        routing groups that follow the devices (model.moe.groups=0, capacity dispatch) it is
        pinned to the groups the steps that made that state routed in: for the state
        `initial_state` restored, those its checkpoint saved ("routing_groups"; a reader on
        other devices routes as the run did), else, and for a checkpoint saved before they
        were, this run's own (`routing_groups`).

        A review (session 107): the layer read them from the mesh where the pass was traced,
        so the pool routed in one group per shard inside the run loop and in one at its end,
        in a tool or with several processes (outside the mesh); then `python -m
        hpnlp.retrieval encoder` and TextSearch used the unpinned model, and a reader pinned
        its own shard count. Capacity drops differ between groups, and so did recall and MRR."""
        groups = self.split_groups(step)
        if groups is None:
            return self.eval_model
        if getattr(self, "_pinned", (None,))[0] != groups:
            cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(
                self.cfg.model, moe=dataclasses.replace(self.cfg.model.moe, groups=groups)))
            self._pinned = (groups, models.build(cfg, deterministic=True,
                                                 token_counts=self.task.token_counts))
        return self._pinned[1]

    def _changes_said(self, start: int) -> str:
        """'; ...' naming what a resume's config changes in what trains the model (the
        checkpointer's `changed`; the schedule's own line names a changed rate), or ''."""
        t = self.cfg.train
        said = schedule_change(self.checkpointer.saved_train, t, start) if start < t.steps else ""
        changed = {k: v for k, v in self.checkpointer.changed.items()
                   if not (said and k in {f"train.{f}" for f in SCHEDULE_FIELDS})
                   # the same computation laid out otherwise (but for random features across
                   # pipeline stages, and MoE groups that follow the devices: said on their own,
                   # `_pipeline_said` and `_groups_said`)
                   and not k.startswith("mesh.")
                   and not (self.checkpointer.attention_changed and k.startswith("attention."))}
        if not changed:
            return ""
        fields = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in changed.items())
        if start >= t.steps:  # a bug hunt (session 94): the old summary, as if the new run's
            return (f"; this config differs from the one it trained with ({fields}), and it "
                    "trains nothing more here: to train under it, use a new --workdir")
        return f"; the steps from here train under a changed config ({fields})"

    def run(self, *, profile_dir: str | None = None) -> dict:
        """The whole loop, in the workdir this Trainer holds (one lock, taken by process 0
        when it was built: the others of a multi-host run share its folder), released at
        its end."""
        if self._ran:  # a bug hunt (session 96): a second run() trained on a closed checkpoint
            # manager (its save failed at the end), from the data position the first left
            # (a start over read other batches), and without the workdir's lock
            raise ValueError(f"this Trainer of {self.workdir} has run (its checkpoints are "
                             "closed); build a new Trainer(cfg, workdir), which resumes from "
                             "the newest checkpoint there")
        if self._read_only:  # a review (r12): it trained and wrote into a workdir it does
            # not hold (no lock: a run there was not refused), truncating its metrics.jsonl
            raise ValueError(f"this Trainer of {self.workdir} was built read_only=True, to read "
                             "the run; build Trainer(cfg, workdir) to train it")
        self._ran = True
        try:
            return self._run(profile_dir=profile_dir)
        finally:
            self._release_workdir()

    def _run(self, *, profile_dir: str | None = None) -> dict:
        cfg, t = self.cfg, self.cfg.train
        state, loop = self.initial_state()
        start = int(state.step)
        resumed = start > 0
        best, best_step = loop.get("best"), loop.get("best_step")
        bad_evals = loop.get("bad_evals", 0)
        if loop.get("best_metric", t.early_stopping_metric) != t.early_stopping_metric:
            # another metric on resume: its best starts over (review, session 96: the saved
            # loss was compared with accuracies, and reported as one)
            best, best_step, bad_evals = None, None, 0
        # So does another held-out set (a review, r4: a resume on another eval file, or
        # another number of eval batches, compared its scores with the old set's best, and
        # stopped early on that, unsaid: these fields are bookkeeping to the config check)
        eval_set = held_out_set(cfg)
        saved_set = loop.get("eval_set")
        if isinstance(saved_set, dict) and "data.eval_batch_size" not in eval_set:
            # one that does not set the batches read now (saved before `held_out_set` left
            # it out there): no change of set
            saved_set = {k: v for k, v in saved_set.items() if k != "data.eval_batch_size"}
        now_set = ({k: v for k, v in eval_set.items() if k != "data.listops_num_eval"}
                   if isinstance(saved_set, dict) and "data.listops_num_eval" not in saved_set
                   else eval_set)  # (saved before `held_out_set` held it: not a change)
        eval_moved = {k: (saved_set.get(k), now_set.get(k)) for k in {**saved_set, **now_set}
                      if saved_set.get(k) != now_set.get(k)} if isinstance(saved_set, dict) else {}
        eval_said = ""
        # The eval due at the restored step failed (its checkpoint was saved without it): run
        # first, logged and counted as the uninterrupted run did (review r3: never made up,
        # early stopping and the best went otherwise). Checkpoints from before say nothing.
        eval_due = bool(loop.get("eval_due", False))
        last_eval: dict = loop.get("last_eval") or {}
        last_eval_step = loop.get("last_eval_step")
        # Nothing left to train from a step saved without its own eval (by checkpoint_every or
        # a SIGTERM, rerun with train.steps lowered to it): that step's eval runs first, as the
        # run of these train.steps ran it (review r3: the summary gave an older step's eval
        # beside final_step). A checkpoint saved before `last_eval_step` evaluated there where
        # the config that saved it did: its eval step, its last step, or an early stop.
        stale_eval = False
        if resumed and start >= t.steps and not eval_due:
            if "last_eval_step" in loop:  # None where no eval ran yet (a review, session 116:
                # then the step's eval ran after the logs closed, unlogged, no best_eval)
                stale_eval = last_eval_step != start
            elif last_eval:
                every = self.checkpointer.saved_train.get("eval_every")
                stale_eval = not (loop.get("stopped_early") or
                                  start == self.checkpointer.saved_train.get("steps") or
                                  (type(every) is int and every > 0 and start % every == 0))
        # (a finished run trains nothing here: its best, of the set it trained with, stays
        # the summary's, beside its last eval, of that set too, unless that eval runs again;
        # a review, d1)
        if eval_moved and best is not None and (start < t.steps or stale_eval or eval_due):
            eval_said = ("; it evaluates on another held-out set (" + "; ".join(
                f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in eval_moved.items())
                + f"), so its best {t.early_stopping_metric} (step {best_step}) and the evals "
                "since it start over")
            best, best_step, bad_evals = None, None, 0
        # A run that stopped early stays stopped while its rule still stops it: with early
        # stopping off, or a patience its bad evals have not reached, a rerun trains on (a
        # bug hunt: with either, and more steps, it trained nothing and said nothing)
        stopped_early = (bool(loop.get("stopped_early", False)) and t.early_stopping_patience > 0
                         and bad_evals >= t.early_stopping_patience)
        writer = MetricWriter(self.workdir, resume_step=start if resumed else None)
        show = t.progress and jax.process_index() == 0
        if resumed and jax.process_index() == 0:  # said, not only in summary.json at the end
            print(f"{cfg.name}: resuming from step {start} in {self.checkpointer.directory}"
                  + (f" under another implementation of exact attention "
                     f"({self.checkpointer.attention_changed})"
                     if self.checkpointer.attention_changed else "")
                  + (f"; what started it is read only when a run starts, and config.json "
                     f"keeps its start ({self.checkpointer.start_changed})"
                     if self.checkpointer.start_changed else "")
                  + (f"; train.steps={t.steps} are done, nothing to train (raise "
                     "--config.train.steps to train on)" if start >= t.steps else "")
                  + (f"; it stopped early there ({bad_evals} evals without a better "
                     f"{t.early_stopping_metric}, train.early_stopping_patience="
                     f"{t.early_stopping_patience}), nothing to train (raise the patience, or "
                     "0 to turn early stopping off, to train on)"
                     if stopped_early and start < t.steps else "")
                  + (schedule_change(self.checkpointer.saved_train, t, start)
                     if start < t.steps else "")
                  + self._changes_said(start) + self._groups_said(loop)
                  + self._pipeline_said(loop, start) + eval_said
                  + (f"; its eval at step {start} failed, and runs first" if eval_due else "")
                  + (f"; it was saved without an eval of step {start}, which runs first"
                     if stale_eval else ""),
                  file=sys.stderr, flush=True)  # a README walk: a rerun that trained nothing
        # The partial log window is part of the checkpoint, so a resumed run logs the same
        # averages as an uninterrupted one.
        saved = loop.get("window") or {}
        dtypes = saved.get("dtypes", {})  # float32 sums read back as float32 (found in review:
        # read as float64, a resumed window summed otherwise and logged other last digits)
        sums = saved.get("sums") and {k: np.asarray(v, dtypes.get(k))
                                      for k, v in saved["sums"].items()}
        window: dict[str, Any] = {"sums": sums, "n": saved.get("n", 0),  # sums: MoE loads are vectors
                                  "applied": saved.get("applied", saved.get("n", 0)),
                                  "gmin": saved.get("gmin", math.inf), "gmax": saved.get("gmax", 0.0),
                                  "clipped": saved.get("clipped", 0), "t0": time.perf_counter(),
                                  # what its train line reads of its last step (a stop at a
                                  # made-up eval writes that line: `take_eval`)
                                  "last": saved.get("last"), "timed": 0, "timed_tokens": 0.0}
        # A made-up eval that stopped the run early flushed the restored window at `start`,
        # as a finished rerun from a step saved mid-window does, and neither saves anything,
        # so the checkpoint still holds the window: one whose line is in metrics.jsonl is not
        # averaged into the next line again (review r3: a rerun with a larger patience logged
        # step `start` twice, in its own line and in the next; a review, session 115, of the
        # finished rerun's line). A checkpoint at a step that logs holds an empty window.
        if window["n"] and writer.enabled and _logged(writer.path, start, eval=False):
            window.update(sums=None, n=0, applied=0, gmin=math.inf, gmax=0.0, clipped=0)
        # The rates time steps that run a compiled program: the first step, and each step whose
        # batch has shapes no earlier step had (bucketing: a new bucket compiles), are left out.
        timing = {"tokens": 0.0, "steps": 0, "t0": None, "shapes": set(), "untimed": {start + 1}}
        maximize = t.early_stopping_metric in _MAXIMIZE

        def newest_checkpoint() -> str | None:
            """Where a rerun resumes from, once the saves under way are done."""
            self.checkpointer.wait()
            good = self.checkpointer.latest_step()
            return (f"step {good} in {self.checkpointer.directory}" if good is not None
                    else None)

        def diverged(step: int, what: str) -> NonFiniteLoss:
            good = newest_checkpoint()
            writer.close()
            where = (f"the last good checkpoint is {good} (left intact)" if good
                     else "no checkpoint was saved yet")
            return NonFiniteLoss(
                f"training became non-finite at step {step} ({what}); {where}. "
                "Lower train.lr, raise train.warmup_steps, keep train.clip_norm > 0, "
                "or check the data.")

        def consume(step: int, metrics) -> None:
            """Read one step's metrics on the host: check, accumulate, log."""
            m = jax.device_get(metrics)
            if not (math.isfinite(float(m["loss"])) and float(m["finite"]) == 1.0):
                raise diverged(step, f"loss = {float(m['loss'])}, gradients and updated params "
                               f"{'all finite' if float(m['finite']) == 1.0 else 'not all finite'}")
            # A float16 step skipped for overflow applied nothing: its gradient norm (inf or
            # NaN) stays out of the window's (found in review: it made them inf and NaN).
            applied = not float(m.get("skipped", 0))
            if not applied:
                m = {**m, "grad_norm": np.zeros_like(m["grad_norm"])}
            # Merged by key, keeping this step's: a statistic whose shape the saved window does
            # not share (a bi-encoder's MoE load, per layer since session 95, per call before),
            # or that it lacks, starts again from this step, and one this step no longer has is
            # dropped (a review, r4: a float16 window's loss_scale and skipped resumed in
            # bfloat16, or another MoE router's balance loss, failed every rerun in a tree map).
            # A loss part started again is still averaged over the whole window in its first
            # line (`finalize` divides it by the window's weight), so it reads low there.
            old, wide = window["sums"], {k: wide_sum(v) for k, v in m.items()}
            window["sums"] = wide if old is None else {
                k: np.add(old[k], v) if k in old and np.shape(old[k]) == np.shape(v) else v
                for k, v in wide.items()}
            window["n"] += 1
            window["last"] = m
            if applied:
                # The gradient norm of every step (not only the window mean), so its usual
                # range and its spikes are visible: TensorBoard gets each step, the log line
                # the range.
                g = float(m["grad_norm"])
                window["applied"] += 1
                window["gmin"], window["gmax"] = min(window["gmin"], g), max(window["gmax"], g)
                window["clipped"] += int(bool(t.clip_norm) and g > t.clip_norm)
                writer.scalar(step, "grad_norm_step", g)
            if timing["t0"] is not None and step not in timing["untimed"]:
                timing["tokens"] += float(m["tokens"])
                # the window's rate too: the steps this process's clock timed (a bug hunt,
                # session 99: the first step's compile, and a resumed window's restored steps)
                window["timed"] += 1
                window["timed_tokens"] += float(m["tokens"])
            if step % t.log_every == 0 or step == t.steps:
                flush(step)

        def flush(step: int) -> None:
            """Write the window's train line (its steps' sums, the last step's norms)."""
            self.checkpointer.check()  # a background save that failed stops the run now
            now = time.perf_counter()
            dt = max(now - window["t0"], 1e-9)
            s, m, n = window["sums"], window["last"], window["applied"]
            line = finalize({**s, "grad_norm": s["grad_norm"] / max(n, 1),
                             "param_norm": m["param_norm"], "lr": m["lr"]}, lm=self.lm,
                            output=self.cfg.output.name)
            if "loss_scale" in m:  # float16: the current scale and the steps it skipped
                line.update(loss_scale=float(m["loss_scale"]), skipped_steps=int(s["skipped"]))
            if n:  # the gradient norms of the steps that applied an update
                line.update(grad_norm_min=window["gmin"], grad_norm_max=window["gmax"],
                            clipped_frac=window["clipped"] / n)
            else:  # every step skipped: no gradient to describe
                del line["grad_norm"]
            if window["timed"]:  # none timed (a compile's step alone): no rate to say
                line.update(steps_per_sec=window["timed"] / dt,
                            tokens_per_sec=window["timed_tokens"] / dt)
            writer.write(step, line)
            # shown at the bar's next redraw, not forced now: in a log file a forced one was a
            # line per log line (a bug hunt, session 96), not one per 15 s
            rates = ({"steps_s": f"{line['steps_per_sec']:.2f}",
                      "tok_s": f"{line['tokens_per_sec']:.0f}"} if window["timed"] else {})
            bar.set_postfix(loss=f"{line['loss']:.4f}", **rates, refresh=False)
            window.update(sums=None, t0=now, n=0, applied=0, gmin=math.inf, gmax=0.0, clipped=0,
                          timed=0, timed_tokens=0.0)

        def paused(seconds: float) -> None:
            """Eval and checkpoint time is not training time: keep it out of the rates."""
            window["t0"] += seconds
            if timing["t0"] is not None:
                timing["t0"] += seconds

        def stop_profiling() -> None:
            """Write --profile's trace, once: at step start+8, or in the loop's `finally`
            (fewer steps left, or a run that stopped or failed while tracing: a review, r12,
            found only Ctrl-C stopped it, so a divergence's trace was never written, and the
            process's next start_trace failed, "already started"). Not training time."""
            nonlocal profiling
            if not profiling:
                return
            profiling = False  # once, even where writing it fails
            t_pause = time.perf_counter()
            try:
                jax.profiler.stop_trace()
            finally:
                paused(time.perf_counter() - t_pause)

        groups = self.routing_groups()
        stages = int(self.mesh.shape["pipeline"])

        text_kept = []  # the step whose save kept WORKDIR/text.json (`save`)

        def save(step: int, state, last_eval: dict, *, eval_due: bool = False) -> None:
            last = window["last"]
            win = None if window["sums"] is None else {
                "sums": {k: np.asarray(v).tolist() for k, v in window["sums"].items()},
                "dtypes": {k: str(np.asarray(v).dtype) for k, v in window["sums"].items()},
                "n": window["n"], "applied": window["applied"],
                "gmin": window["gmin"], "gmax": window["gmax"], "clipped": window["clipped"],
                "last": None if last is None else {
                    k: float(np.asarray(last[k])) for k in ("param_norm", "lr", "loss_scale")
                    if k in last}}
            # what is logged up to this step, TensorBoard's events too, is on disk before the
            # checkpoint a resume purges only the later steps after (a review, r4: queued in
            # tensorboardX's thread, a kill lost them, and no resume redid them)
            writer.sync()
            if not (resumed or text_kept) and jax.process_index() == 0:
                # What its text was (WORKDIR/text.json), for the runs that distill from or
                # start from this one (data.different_text; a review, r3: a word run's file
                # edited between them passed as the same text): kept with its first
                # checkpoint, the one such runs need, so a run refused or stopped before
                # leaves none; a resume keeps its start's (other text is refused by the data
                # state it restores)
                try:
                    data_lib.save_text_record(self.task, cfg.data, self.workdir)
                except OSError as e:  # a review (session 114): a traceback, as no other
                    # write of the run (a full disk)
                    raise write_failed(os.path.join(self.workdir, data_lib.TEXT_FILE), e,
                                       self.checkpointer.directory) from None
                text_kept.append(step)
            self.checkpointer.save(step, state, self.train_iter.get_state(), {
                "best": best, "best_step": best_step, "bad_evals": bad_evals,
                "best_metric": t.early_stopping_metric,
                "stopped_early": stopped_early, "eval_due": eval_due,
                "last_eval": last_eval, "last_eval_step": last_eval_step if last_eval else None,
                "window": win, "routing_groups": groups,
                "eval_set": eval_set, "pipeline_stages": stages})

        def check_unevaluated(step: int, state) -> None:
            """Parameters saved at a step with no eval: their loss on one held-out batch is
            finite, or the run stops before they are saved and named good (a review, r4: at a
            checkpoint step that was no eval step, lr=1e9 saved parameters its update had made
            huge but finite, named "the last good checkpoint", whose resume diverged at once).
            Where that eval fails (an unreadable shard, out of memory), they are unchecked: not
            saved either, and a rerun resumes from the checkpoint before (a review, d1: saved
            as good, nothing checked them again). The loss alone, as `take_eval` checks it."""
            try:  # (an ensemble evaluates its stacked members with a step of its own)
                sums = self.eval_sums(state, getattr(self, "ensemble_eval_step", None),
                                      batches=1)
            except Exception:  # said, as a diverged run's is (a re-read, d3), once the
                good = newest_checkpoint()  # previous checkpoint's save, if under way, is done
                print(f"hpnlp: the one-batch check of step {step}'s parameters failed, so they "
                      "are not saved; a rerun resumes from "
                      + (good or "the start"),
                      file=sys.stderr, flush=True)
                raise
            loss = finalize(sums["ensemble"] if "members" in sums else sums, lm=self.lm)["loss"]
            if "members" in sums:  # each member's too (a review, session 117: one member's
                # blown up, the ensemble's mean probabilities stayed finite, and it was saved)
                m = sums["members"]
                losses = [finalize({k: v[i] for k, v in m.items()}, lm=self.lm)["loss"]
                          for i in range(len(m["weight"]))]
                loss = next((x for x in losses if not math.isfinite(x)), loss)
            if not math.isfinite(loss):
                raise diverged(step, f"its parameters' loss on a held-out batch is {loss}; "
                               "they are not saved")

        def take_eval(step: int, state, *, made_up: bool = False) -> None:
            """The eval due at `step`: run, logged, and counted for the best and early
            stopping. `made_up`: the one the restored step's checkpoint was saved without
            (it failed there, or none was due: `stale_eval`), which a rerun before the next
            checkpoint runs again (logged once: `_logged`)."""
            nonlocal last_eval, last_eval_step, best, best_step, bad_evals, stopped_early
            try:
                last_eval, last_eval_step = self.evaluate(state), step
            except Exception:
                if not made_up and saves_after_a_failed_eval():  # keep the steps trained
                    # since the last checkpoint: saved with the eval due (a resume runs it
                    # first), then the error
                    save(step, state, {}, eval_due=True)
                    self.checkpointer.wait()
                raise
            # Parameters can blow up while staying finite (the step's own loss, read before
            # its update, still finite): their eval loss is the last check before they would
            # be saved and named good (found by a README walk: lr=1e9 saved such a step, and
            # its resume diverged at once). Before the eval is logged (a review, session 116:
            # its NaN line, not JSON, was kept, and a finite rerun's eval then not logged)
            blown = next((float(m["loss"]) for m in last_eval.get("members", ())
                          if not math.isfinite(float(m.get("loss", 0.0)))), None)
            if blown is not None or not math.isfinite(float(last_eval.get("loss", 0.0))):
                # (a seed ensemble's members each: a review, session 117)
                loss = float(last_eval["loss"]) if blown is None else blown
                if not made_up:
                    raise diverged(step, f"eval loss = {loss} on the parameters after it, "
                                   "which are not saved")
                writer.close()  # saved with its eval due: that checkpoint is not good
                where = os.path.join(self.checkpointer.directory, str(step))
                raise NonFiniteLoss(
                    f"training became non-finite at step {step} (eval loss = {loss} on the "
                    f"parameters checkpoint {where} holds, saved "
                    f"{'when that eval failed' if eval_due else 'without an eval'}); move "
                    "it aside to resume from the checkpoint before it, then lower train.lr, "
                    "raise train.warmup_steps, keep train.clip_norm > 0, or check the data.")
            logged = made_up and writer.enabled and _logged(writer.path, step)
            if not logged:
                writer.write(step, last_eval, eval=True)
                if made_up:  # into TensorBoard now: no checkpoint save comes to sync it
                    writer.sync()  # before the next (a review, session 116)
            score = last_eval.get(t.early_stopping_metric)
            if score is not None:
                if best is None or (score > best if maximize else score < best):
                    best, best_step, bad_evals = score, step, 0
                else:
                    bad_evals += 1
            # what ends the run before train.steps (a review, r12: set at the last step, where
            # the steps ran out, it said the run stopped early, and a rerun with more steps
            # trained nothing; its bad evals are saved, so that one stops at its next)
            if (t.early_stopping_patience and bad_evals >= t.early_stopping_patience
                    and step < t.steps):
                stopped_early = True
                # the last steps' train line (found in review: lost), unless written already
                # (a made-up eval's rerun: its eval line logged, not always its train line;
                # a review, session 116)
                if window["n"] and not (writer.enabled and _logged(writer.path, step,
                                                                   eval=False)):
                    flush(step)

        pending = None
        step = trained_to = start
        # --profile traces steps 3-8 from here, or the last where fewer are left (review r4:
        # a run of 2 steps wrote nothing, and said nothing)
        first_traced = min(start + 3, t.steps)
        profiling = traced = False
        stop = StopSignals(multi=jax.process_count() > 1)
        stopping = False
        bar = None
        try:
            # In a terminal redraw often; in a log file (CI, nohup) every 15 s, not every step.
            # Made in the `try` that closes it on every way out: an error or a Ctrl-C then
            # starts its line on a fresh one, not after the bar's text
            bar = progress_bar(total=t.steps, initial=start, disable=not show, desc=cfg.name,
                               dynamic_ncols=True)
            with self._context(), stop:
                if ((stale_eval or start >= t.steps) and window["n"]
                        and window["last"] is not None
                        and not (writer.enabled and _logged(writer.path, start, eval=False))):
                    # the last step's train line, as the run of these steps wrote it before
                    # its eval (a review, session 115: the restored window's steps went
                    # unlogged), or as a run ending at this step writes it (a review, session
                    # 117: train.steps lowered to a step saved mid-window); once: no
                    # checkpoint follows to say so
                    flush(start)
                if eval_due or stale_eval:  # (its checkpoint exists: a stop here saves
                    # nothing more)
                    t_pause = time.perf_counter()
                    take_eval(start, state, made_up=True)
                    paused(time.perf_counter() - t_pause)
                for step in range(start + 1, t.steps + 1):
                    if stopped_early:  # a rerun of a run that already stopped early
                        break
                    batch = next(self.train_iter)
                    if profile_dir and step == first_traced:
                        jax.profiler.start_trace(profile_folder(profile_dir))
                        profiling = traced = True
                    shapes = tuple(np.shape(x) for x in jax.tree.leaves(batch))
                    compiles = timing["t0"] is not None and shapes not in timing["shapes"]
                    timing["shapes"].add(shapes)
                    if compiles:  # the steps before it count (and log); this one's compile does not
                        if pending is not None:
                            consume(*pending)
                            pending = None
                        jax.block_until_ready(state)
                    if compiles or timing["t0"] is None:
                        t_compile = time.perf_counter()
                    state, metrics = self.train_step(state, _global(batch, self.batch_sharding))
                    trained_to = step
                    if pending is not None:
                        consume(*pending)
                    pending = (step, metrics)
                    if timing["t0"] is None:  # the first (compiling) step: not timed, nor in
                        # its log line's rate (a bug hunt, session 99: 0.4 steps/s, then 20)
                        jax.block_until_ready(metrics)
                        paused(time.perf_counter() - t_compile)
                        timing["t0"] = time.perf_counter()
                    elif compiles:
                        jax.block_until_ready(metrics)
                        timing["untimed"].add(step)
                        paused(time.perf_counter() - t_compile)
                    else:
                        timing["steps"] += 1
                    bar.update(1)
                    if profiling and step == start + 8:
                        jax.block_until_ready(metrics)
                        stop_profiling()
                    # SIGTERM (or Ctrl-C in a run of several processes): save and stop here,
                    # after the eval due at this step, if one is (a resume starts after it)
                    stopping = stop.reached(last=step == t.steps) and step < t.steps
                    do_eval = (t.eval_every and step % t.eval_every == 0) or step == t.steps
                    do_ckpt = ((t.checkpoint_every and step % t.checkpoint_every == 0)
                               or step == t.steps or stopping)
                    if not (do_eval or do_ckpt):
                        continue
                    consume(*pending)
                    pending = None
                    t_pause = time.perf_counter()
                    if do_eval:
                        take_eval(step, state)
                        do_ckpt = do_ckpt or stopped_early
                        # an early stop here finishes the run, a signal at this step or not
                        # (a review, session 116: saved stopped early, it ended as stopped by
                        # SIGTERM, no summary, and its rerun trained nothing)
                        stopping = stopping and not stopped_early
                    if do_ckpt:
                        if not (do_eval or stopping):  # (a signal's save is not held up by an
                            # eval, whose compile, where none ran yet, may outlast its grace)
                            check_unevaluated(step, state)
                        save(step, state, last_eval)
                    paused(time.perf_counter() - t_pause)
                    if stopped_early or stopping:
                        break
                if pending is not None:
                    consume(*pending)
                # the last save's wait here, where Ctrl-C is the loop's (a review, session
                # 114: after the loop it escaped to the CLI, whose exit killed the save); not
                # training time (a review, session 115: the rates counted the last write)
                t_pause = time.perf_counter()
                self.checkpointer.wait()
                paused(time.perf_counter() - t_pause)
        except KeyboardInterrupt as e:
            # Ctrl-C: a save under way completes, and the user reads one line saying what a
            # rerun resumes from (found by a README walk: a 30-line traceback, no step named);
            # a SIGTERM the CLI's handler raised (where the loop set none) keeps its status
            good = newest_checkpoint()
            writer.close()
            raise Interrupted(
                f"{'stopped (SIGTERM)' if getattr(e, 'exit_code', 130) == 143 else 'interrupted'}"
                f" at step {step}; " + (
                    f"the newest checkpoint is {good}: rerun the same command to resume from it"
                    if good else "no checkpoint was saved yet: a rerun starts over"),
                getattr(e, "exit_code", 130)) from None
        except Exception:
            # a save under way completes before the error leaves the loop (a review, session
            # 117: the CLI's exit killed it, and the lock went while it wrote); its own
            # failure is the next run's to say. In a single process: in several, the save's
            # commit waits on every process, where a peer may be gone (the error's own line
            # stops the others at once, `hpnlp.main`'s watch)
            if jax.process_count() == 1:
                with contextlib.suppress(Exception):
                    self.checkpointer.wait()
            raise
        finally:
            try:  # the trace of the steps that failed too (`stop_profiling`)
                stop_profiling()
            finally:
                if bar is not None:
                    bar.close()
        if profile_dir and not traced and jax.process_index() == 0:
            why = (f"it stopped at step {trained_to}, before step {first_traced}, the first "
                   "it traces" if trained_to > start else f"train.steps={t.steps} are done"
                   if start >= t.steps else "it stopped early, and trained no step")
            print(f"hpnlp: warning: --profile {profile_dir}: no trace was written ({why})",
                  file=sys.stderr, flush=True)
        if stopping:
            good = newest_checkpoint()
            self.checkpointer.close()
            writer.close()
            raise Interrupted(stop.message(step, good), stop.exit_code, saved=True)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - timing["t0"] if timing["t0"] else 0.0
        self.checkpointer.close()
        writer.close()
        if not last_eval:  # resumed at the end without its eval (a checkpoint saved before
            # `eval_due` where that eval failed, or train.steps lowered): evaluate what it holds
            last_eval = self.evaluate(state)
        summary = {
            "name": cfg.name,
            "task": self.task.name,
            "final_step": int(state.step),
            "resumed_from_step": start if resumed else None,
            "stopped_early": stopped_early,
            "eval": last_eval,
            # the best eval of train.early_stopping_metric and its step (the parameters are
            # the last step's: its checkpoint is kept only among train.keep_checkpoints)
            **({"best_eval": {"step": best_step, t.early_stopping_metric: best}}
               if best is not None and best_step is not None else {}),
            "baseline": self.task.baseline,
            "param_count": models.param_count(carry_lib.model_params(state.params)),
            "throughput": {
                "steps_per_sec": timing["steps"] / elapsed if timing["steps"] else None,
                "tokens_per_sec": timing["tokens"] / elapsed if timing["steps"] else None,
                # steps timed: the others compiled (the first, and a new batch shape's first)
                "timed_steps": timing["steps"],
            },
            "peak_memory": _peak_memory(),
            # Padding this run's batches carried, beside what plain padding would have cost:
            # the batches since this process started or resumed (a bug hunt, session 90: a
            # resumed run's counts read as the whole run's).
            "data": {**self.train_iter.stats(), "counted_from_step": start},
            "devices": jax.device_count(),
            "processes": jax.process_count(),
        }
        reports = {c.name: c.report(state.carry[c.name], state.params) for c in self.carries}
        if any(r is not None for r in reports.values()):  # e.g. pruning's sparsity reached
            summary["carries"] = {k: r for k, r in reports.items() if r is not None}
        path = os.path.join(self.workdir, "summary.json")
        # nothing trained now: keep what the training measured (a bug hunt, session 99: a
        # resume that trained one step, untimed, kept the old run's data and resume step)
        if summary["final_step"] == start and os.path.exists(path):
            try:
                with open(path) as f:
                    old = json.load(f)
            except (OSError, ValueError):  # a bug hunt (session 96): a cut or foreign file
                old = None                 # stopped the rerun; it is rewritten whole
            # only a summary of this very step's (a review, session 115: one left by an
            # earlier, shorter run, the later run stopped before it wrote its own, gave its
            # steps' rates and "resumed from none" to the steps since)
            if isinstance(old, dict) and old.get("final_step") == start:
                for key in ("throughput", "peak_memory", "data", "resumed_from_step"):
                    if key in old:
                        summary[key] = old[key]
        if jax.process_index() == 0:  # whole or not at all (a kill mid-write cut it)
            write_summary(self.workdir, summary)
        return summary


def write_summary(workdir: str, summary: dict) -> None:
    """WORKDIR/summary.json, whole or not at all; a failed write (a full disk) is the one line
    of every other write of the run (a bug hunt, session 101: a traceback)."""
    path = os.path.join(workdir, "summary.json")
    try:
        write_json(path, summary)
    except OSError as e:
        raise write_failed(path, e, os.path.join(workdir, "checkpoints")) from None


def run(cfg, workdir: str, *, profile_dir: str | None = None) -> dict:
    """Train (or resume) the experiment `cfg` (a ConfigDict or `Config`) in `workdir`."""
    if not isinstance(cfg, Config):
        cfg = from_configdict(cfg)
    made = not os.path.exists(workdir)
    os.makedirs(workdir, exist_ok=True)
    try:
        trainer = Trainer(cfg, workdir)
    except Exception:  # a refused config leaves no empty folder behind (found by a README walk)
        if made:
            remove_if_empty(workdir)
        raise
    return trainer.run(profile_dir=profile_dir)


def remove_if_empty(workdir: str) -> None:
    """Remove `workdir`, made by a run its config or a lock then refused, if it is still empty
    and no other process holds it. Another process of the run may have removed it first (a
    README walk: its FileNotFoundError hid the config's error); and not while another process
    holds it (a review, session 114: a run refused as busy removed the folder the winner had
    locked, whose later writes made an unlocked one at the same path)."""
    with contextlib.suppress(OSError, WorkdirBusy):
        release = hold_workdir(workdir)
        try:
            if not os.listdir(workdir):
                os.rmdir(workdir)
        finally:
            release()


__all__ = ["Interrupted", "NonFiniteLoss", "Trainer", "run", "dummy_batch"]
