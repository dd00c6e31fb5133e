"""Crash-hunt worker: runs hpnlp configurations one after another in this process.

    python tests/hunt_worker.py < configs.jsonl

Reads one JSON object per line from stdin (a nested config dict, as `from_configdict`
takes it) and, for each, writes one line `HUNT {"status": ..., ...}` to stdout:

- `refused`: `validate` rejected the config with a `ConfigError` (`message`, one line).
- `ok`: init, `train.steps` steps, eval and checkpoints ran through `hpnlp.train.run`,
  every logged loss and the eval loss finite, and a pruned run (unstructured or N:M) at
  its schedule's sparsity after its last mask update (summary.json); then, where the
  config names `ptq` (a format
  as QuantConfig fields, or "bfloat16"), `hpnlp.compress.ptq.quantize` of the run with a
  finite quantized eval loss and a packed file that reloads to the same outputs, or a
  one-line refusal (`ptq_refused`); then, where the config names a `student` (fields
  merged over the run's own), that student distilled from the run (`train.distill.teacher`)
  with finite losses, or refused in one line before it trains (`student_refused`); then,
  where it names `then` (fields merged likewise, `train.init_from` the run where they say
  FIRST), that run with finite losses or refused in one line (`then_refused`); then,
  where it names `ensemble` (`members`, `member_loop`), the same config as a seed
  ensemble, trained and evaluated finite or refused in one line (`ensemble_refused`); then,
  for a Transformer LM, decoding (`hpnlp.models.generate`, greedy for even seeds, sampled
  for odd) from initial parameters.
- `error`: anything else raised (`message` and the traceback's tail).

A crash of the process (a signal, an abort inside XLA or a kernel) leaves no reply: the
parent (`tests/test_crash_hunt.py`) sees the pipe close and reports the configuration it
was running. The parent sets the simulated device count (XLA_FLAGS) when it starts this.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import traceback

REPLY = "HUNT "
# A user's data files, as the hunt's draws name them (data.train_path, data.eval_path,
# data.prepared = "@NAME"): written once per process by `data_dir`, on first use.
DATA = {"@text": "train.txt", "@eval_text": "eval.txt", "@listops": "listops.tsv",
        "@listops_eval": "listops_eval.tsv", "@prepared": "prepared"}
DATA_ENV = "HPNLP_HUNT_DATA"  # the folder, inherited by the workers a test starts after it
_DATA_DIR: list[str] = []


def data_dir() -> str:
    """The folder of the files in `DATA`, written on first use (DATA_ENV names one already
    written): 60 training and 8 eval chapters of the embedded text as plain-text files
    (a paragraph each), the same prepared (`python -m hpnlp.data.prepare`, bytes), and
    ListOps TSVs of 48 and 16 generated expressions."""
    if _DATA_DIR:
        return _DATA_DIR[0]
    where = os.environ.get(DATA_ENV)
    if not where or not os.path.isdir(os.path.join(where, DATA["@prepared"])):
        import atexit
        import shutil

        import numpy as np

        from hpnlp.config import DataConfig
        from hpnlp.data import corpus, listops, prepare
        where = tempfile.mkdtemp(prefix="hpnlp-hunt-data-")
        atexit.register(shutil.rmtree, where, True)
        path = {name: os.path.join(where, f) for name, f in DATA.items()}
        train, eval_ = corpus.kjv_splits()
        for name, chapters in (("@text", train[:60]), ("@eval_text", eval_[:8])):
            with open(path[name], "w") as f:
                f.write("\n".join(c.text for c in chapters))
        cfg = DataConfig(task="listops", listops_min_length=8, listops_max_length=32,
                         listops_max_depth=3)
        seqs, labels = listops.generate(cfg, 64, seed=0)
        rows = [f"{listops.decode(s)}\t{y}" for s, y in zip(seqs, labels)]
        for name, part in (("@listops", rows[:48]), ("@listops_eval", rows[48:])):
            with open(path[name], "w") as f:
                f.write("Source\tTarget\n" + "\n".join(part) + "\n")
        with contextlib.redirect_stdout(sys.stderr):  # (a worker's stdout is its replies)
            assert prepare.main(["--input", path["@text"], "--eval_input", path["@eval_text"],
                                 "--out", path["@prepared"], "--shard_mb", "0", "--quiet"]) == 0
        assert np.all(labels < listops.NUM_CLASSES)
        os.environ[DATA_ENV] = where
    _DATA_DIR.append(where)
    return where


def with_data(fields: dict) -> dict:
    """`fields` with each data path drawn as "@NAME" (`DATA`) naming its file."""
    data = fields.get("data") or {}
    named = {k: v for k, v in data.items() if k in ("train_path", "eval_path", "prepared")
             and isinstance(v, str) and v in DATA}
    if not named:
        return fields
    return {**fields, "data": {**data, **{k: os.path.join(data_dir(), DATA[v])
                                          for k, v in named.items()}}}


def checked(fields: dict, num_devices: int | None = None, num_processes: int = 1):
    """The validated config of the run in `fields`, refused (ConfigError) as a new run
    that trains is before it starts: `validate`, then what a run in a fresh workdir is
    refused beside it (`check_new_run`) and what a run that trains is (`check_training`;
    a reader takes it). The crash hunt's repair asks the same in its own process. Data
    paths drawn as "@NAME" name the hunt's files (`with_data`)."""
    from hpnlp.config import from_configdict, validate
    from hpnlp.config.checks import check_new_run, check_training
    fields = with_data(fields)
    full = validate(from_configdict(fields), num_devices=num_devices,
                    num_processes=num_processes)
    check_new_run(full)
    check_training(full)
    return full


def run_one(overrides: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hpnlp.config import ConfigError, from_configdict
    from hpnlp.models import generate
    from hpnlp.train import run

    overrides = with_data(dict(overrides))
    fmt = overrides.pop("ptq", None)
    student = overrides.pop("student", None)
    then = overrides.pop("then", None)
    ensemble = overrides.pop("ensemble", None)
    try:
        cfg = from_configdict(overrides)
        full = checked(overrides)
    except ConfigError as e:
        return {"status": "refused", "message": str(e)}
    with tempfile.TemporaryDirectory() as workdir:
        summary = run(cfg, workdir)
        losses = _losses(workdir, summary)
        if isinstance(losses, str):
            return {"status": "error", "message": losses}
        out = {"status": "ok", "loss": losses[-1], "eval_loss": summary["eval"]["loss"]}
        pruned = summary.get("carries", {}).get("prune")
        if (pruned is not None and full.train.prune.structure != "structured"
                and abs(pruned["sparsity"] - pruned["target"]) > 0.02):  # exact counts
            return {"status": "error", "message": f"pruning reached sparsity "
                    f"{pruned['sparsity']:.3f}, its schedule {pruned['target']:.3f} "
                    f"(last mask update after step {pruned['last_update_step']})"}
        if fmt is not None:
            out.update(quantized(workdir, fmt))
            if out["status"] != "ok":
                return out
        for name, changes in (("student", student), ("then", then)):
            if changes is not None:
                out.update(second_run(overrides, changes, workdir, name))
                if out["status"] != "ok":
                    return out
        if ensemble is not None:
            out.update(seed_ensemble(overrides, full, ensemble, workdir, out["eval_loss"]))
            if out["status"] != "ok":
                return out
    decodes = full.model.kind == "lm" and full.model.arch == "transformer"
    if decodes:  # what cannot decode a token at a time is refused up front, in one line
        from hpnlp.models.generate import check_decodes  # (expert-choice routing ranks a
        try:  # whole group's tokens; a pipelined run's random features are drawn per stage)
            check_decodes(full)
        except ValueError as e:
            decodes, out["decoded"] = False, f"refused: {e}"
    if decodes:
        from hpnlp.models import build
        from hpnlp.train.loop import dummy_batch
        import flax.linen as nn

        model = build(full, deterministic=True, forward_only=True)
        params = jax.jit(lambda k: nn.unbox(model.init(
            k, dummy_batch("lm", 1, full.data.seq_len))["params"]))(jax.random.key(1))
        length = min(full.data.seq_len, full.model.max_len)
        prompt = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4) % full.model.vocab_size)
        greedy = full.seed % 2 == 0  # one compile per config; the seed picks the decoder
        # the counts the model above was built with (none: Zipf's), which generate refuses
        # to guess for an output layer that builds its tables from them
        from hpnlp.softmax import Frequencies
        zipf = Frequencies.zipf(full.model.vocab_size).counts
        toks = jax.jit(lambda p, pr: generate(full, p, pr, jnp.array([4, 2]), length=length,
                                              greedy=greedy, rng=jax.random.key(2),
                                              features_key=jax.random.key(3),
                                              token_counts=zipf))(params, prompt)
        toks = np.asarray(toks)
        if toks.shape != (2, length) or toks.min() < 0 or toks.max() >= full.model.vocab_size:
            return {"status": "error", "message": f"decode produced {toks.shape} tokens in "
                                                  f"[{toks.min()}, {toks.max()}]"}
        out["decoded"] = "greedy" if greedy else "sampled"
    return out


def _losses(workdir: str, summary: dict):
    """The run's logged losses, or what is wrong with them (non-finite or none)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f]
    if not losses or not all(math.isfinite(x) for x in losses + [summary["eval"]["loss"]]):
        return f"non-finite or missing losses: {losses}, eval {summary['eval']['loss']}"
    return losses


def _merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for k, v in changes.items():
        out[k] = _merged(base.get(k) or {}, v) if isinstance(v, dict) and v else v
    return out


FIRST = "FIRST"  # in a second run's fields: the first run's workdir


def second_run(first: dict, changes: dict, workdir: str, name: str) -> dict:
    """A run of `changes`' fields over the first run's config that starts from the run in
    `workdir` (a student distilled from it, `train.distill.teacher`, or `train.init_from`
    it where the changes say FIRST): finite losses, or a one-line refusal before any step
    trains. Replies are keyed by `name` ("student", "then")."""
    from hpnlp.config import ConfigError, from_configdict, validate
    from hpnlp.train import run
    fields = _merged(first, changes)
    if "distill" in changes.get("train", {}):
        fields["train"]["distill"] = dict(fields["train"]["distill"], teacher=workdir)
    if fields["train"].get("init_from") == FIRST:
        fields["train"]["init_from"] = workdir
    out = os.path.join(workdir, name)
    try:
        cfg = from_configdict(fields)
        validate(cfg, num_processes=1)
        summary = run(cfg, out)
    except ConfigError as e:
        return _late_refusal(e, out, f"the {name} run") or {f"{name}_refused": str(e)}
    losses = _losses(out, summary)
    if isinstance(losses, str):
        return {"status": "error", "message": f"{name}: {losses}"}
    return {f"{name}_loss": losses[-1]}


def seed_ensemble(fields: dict, full, spec: dict, workdir: str, plain_eval_loss: float) -> dict:
    """The run's config (`fields`, validated as `full`) as a seed ensemble
    (`hpnlp.train.ensemble`: spec["members"] seeds trained in one step, their members
    stepped by spec["member_loop"]): finite training losses, a finite eval of every member
    and of the ensemble, and member 0's eval the plain run's (`plain_eval_loss`), or a
    one-line refusal before it trains (`ensemble_refused`)."""
    from hpnlp.config import ConfigError, from_configdict
    from hpnlp.train.ensemble import check_ensemble_evaluates
    from hpnlp.train.ensemble import seed_ensemble as ensemble_of
    out = os.path.join(workdir, "ensemble")
    try:
        trainer = ensemble_of(from_configdict(fields), out, spec["members"],
                              member_loop=spec["member_loop"])
        summary = trainer.run()
    except ConfigError as e:
        late = _late_refusal(e, out, "the ensemble")
        if late:
            return late
        # the plain run trained, so only what an ensemble cannot evaluate may refuse it (a
        # review, session 113: any one-line refusal passed)
        try:
            check_ensemble_evaluates(full)
        except ConfigError as expected:
            if str(expected) == str(e):
                return {"ensemble_refused": str(e)}
        return {"status": "error", "message": f"the ensemble of a run that trained alone was "
                                              f"refused: {e}"}
    numbers = _numbers(summary["eval"])
    losses = _losses(out, summary)
    if isinstance(losses, str) or not numbers or not all(math.isfinite(x) for x in numbers):
        return {"status": "error", "message": f"ensemble: losses {losses}, eval "
                                              f"{summary['eval']}"}
    # member 0 is the plain run (its seed, dropout and data): the same eval, to float
    # rounding where vmap batches the members (hpnlp.train.ensemble's module doc) and in
    # 16-bit compute; not where early stopping watches the ensemble's loss (a review,
    # session 113: it may stop at another step than the plain run)
    first, plain = summary["eval"]["members"][0]["loss"], plain_eval_loss
    tolerance = (1e-2 if full.model.dtype != "float32" else
                 1e-3 if spec["member_loop"] == "vmap" else 1e-4)
    stops = full.train.early_stopping_patience > 0 and spec["members"] > 1
    if not stops and abs(first - plain) > tolerance * max(1.0, abs(plain)):
        return {"status": "error", "message": f"the ensemble's member 0 evaluated {first}, the "
                                              f"plain run of its seed {plain}"}
    return {"ensemble_loss": losses[-1]}


def _late_refusal(e, out: str, what: str) -> dict | None:
    """The error reply where refusal `e` of a second run in `out` is not one line before it
    trained (None where it is)."""
    if "\n" in str(e) or os.path.exists(os.path.join(out, "metrics.jsonl")):
        return {"status": "error", "message": f"{what}'s refusal is not one line before "
                                              f"training: {e}"}
    return None


def _numbers(tree) -> list[float]:
    """Every float in a summary's nested dicts and lists."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _numbers(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _numbers(v)]
    return [float(tree)] if isinstance(tree, float) else []


def quantized(workdir: str, fmt) -> dict:
    """`ptq.quantize` of the run in `workdir` to `fmt` (QuantConfig fields or a float cast)."""
    from hpnlp.compress import ptq
    from hpnlp.config import ConfigError, QuantConfig
    out = os.path.join(workdir, "quantized")
    try:
        if isinstance(fmt, str):
            s = ptq.quantize(workdir, out, float_dtype=fmt, eval_batches=1, repeats=1)
        else:
            s = ptq.quantize(workdir, out, QuantConfig(**fmt), eval_batches=1, repeats=1)
    except ConfigError as e:
        if "\n" in str(e):
            return {"status": "error", "message": f"quantize's refusal is not one line: {e}"}
        return {"ptq_refused": str(e)}
    loss = s["eval"]["quantized"]["loss"]
    if not math.isfinite(loss) or not s["reload_identical"]:
        return {"status": "error", "message": f"quantized to {fmt}: eval loss {loss}, reloaded "
                                              f"identical: {s['reload_identical']}"}
    return {"ptq_loss": loss}


def main() -> None:
    import hpnlp  # noqa: F401  (its XLA workarounds before JAX starts)
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    print(REPLY + json.dumps({"status": "ready", "devices": jax.device_count()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = run_one(json.loads(line))
        except Exception as e:  # noqa: BLE001 - every failure is a finding, reported whole
            reply = {"status": "error", "message": f"{type(e).__name__}: {e}"[:2000],
                     "traceback": traceback.format_exc()[-3000:]}
        print(REPLY + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
