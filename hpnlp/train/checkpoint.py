"""Orbax checkpoints holding everything a run needs to continue exactly.

One checkpoint = train state (params, optimizer state, step, RNG key data), the data
iterator's position, and the loop's own state (early-stopping counters), saved
atomically by `ocp.CheckpointManager` (a step directory appears only once complete, so a
run killed mid-save leaves the previous checkpoint intact) keeping the last K.
`config.json` beside them records the model; a rerun whose model differs is refused
before anything is overwritten.

Multi-process: every process calls `save`/`restore` (orbax coordinates them: each writes
its own shards, the JSON items are the same everywhere and written once), and process 0
alone writes `config.json`. Nothing saved depends on the process count, so a checkpoint
restores under any number of processes and devices.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from hpnlp import softmax
from hpnlp.config import Config, ConfigError, from_configdict, to_json, validate
from hpnlp.config.fields import DATA_PATH_FIELDS, as_json, same_data_path
from hpnlp.paths import write_json


class NoCheckpoint(FileNotFoundError):
    """The workdir has no trained run to read (to quantize, distill from or fine-tune)."""


class StackedMembers(int):
    """A seed ensemble's member count (`EnsembleTrainer.members`, `run_members` of its
    workdir): its state stacks every array on a leading member axis, even for one member,
    where a plain run's count is the int 1. The type carries that through the Trainer's
    `members=` into the shape signature (review r3: a 1-member ensemble was recorded as a
    plain run, so it could not resume without members.json, and hpnlp.main on it advised the
    config it was trained with)."""


def is_stacked(members: int) -> bool:
    """Whether a member count is a seed ensemble's (its arrays stacked member by member); an
    edited file's count that is no integer is not (its config's comparison names it: a
    review, session 118, `None > 1` was a TypeError)."""
    return isinstance(members, StackedMembers) or type(members) is int and members > 1


def _signature_members(sig: dict) -> int:
    """The member count a shape signature records: a StackedMembers where its arrays are
    stacked (its "ensemble.stacked" mark, or more than one member), else the int."""
    members = sig.get("ensemble.members", 1)
    if type(members) is not int:  # an edited file's: the comparisons with its config name it
        return members
    return StackedMembers(members) if members > 1 or sig.get("ensemble.stacked") else members


def _members_file(folder: str) -> int | None:
    """The member count a seed ensemble's members.json in `folder` records, else None."""
    try:  # (hpnlp.train.ensemble writes it)
        with open(os.path.join(folder, "members.json")) as f:
            members = json.load(f)["members"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return members if type(members) is int and members >= 1 else None


def _unmarked_one(sig: dict, folder: str) -> bool:
    """Whether a shape signature is a 1-member seed ensemble's saved before its
    "ensemble.stacked" mark: one member, no mark, and its members.json in `folder` says 1 (a
    plain run's workdir has none)."""
    members = sig.get("ensemble.members", 1)
    return type(members) is int and members == 1 and "ensemble.stacked" not in sig and \
        _members_file(folder) == 1


def _read_config_json(path: str) -> dict:
    """A run's config.json, or NoCheckpoint naming it where it is not one hpnlp wrote. One
    that lost its shape signature has it rebuilt from its config (a bug hunt, session 96: its
    own model was called "a different model", and deleting the run advised)."""
    if os.path.exists(path) and not os.path.isfile(path):  # a bug hunt (session 96): a folder
        # was a traceback, and a named pipe hung the reader
        raise NoCheckpoint(f"{path} is not a file; it is not a config.json hpnlp wrote: "
                           "restore it, or train the run anew in a new workdir")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        what = "cannot be read" if isinstance(e, OSError) else "is not valid JSON"
        raise NoCheckpoint(f"{path} {what} ({e}); it is not a config.json hpnlp "
                           "wrote: restore it, or train the run anew in a new workdir") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise NoCheckpoint(f"{path} has no \"config\" entry; it is not a config.json hpnlp "
                           "wrote: restore it, or train the run anew in a new workdir")
    if not isinstance(saved.get("shape_signature"), dict):
        # a seed ensemble's members: its members.json (hpnlp.train.ensemble) says
        members = _members_file(os.path.dirname(path))
        members = 1 if members is None else StackedMembers(members)
        try:  # (one it cannot read is said: a bug hunt, session 99, compared with no
            # signature, listed equal values as "a different model" and advised deleting it)
            saved["shape_signature"] = _shape_signature(from_configdict(saved["config"]),
                                                        members)
        except (ConfigError, TypeError, ValueError, AttributeError) as e:
            if not _options_as_text(saved["config"]):  # (those: load_run_config's own error)
                raise _edited(path, e) from None
    return saved


def _options_as_text(config: dict) -> bool:
    """Whether a config.json's config predates configs saved readably (options as text)."""
    return any(isinstance(group.get("options"), str) for group in (
        config.get("attention"), config.get("output")) if isinstance(group, dict))


def _edited(path: str, e: Exception) -> ConfigError:
    """The error for a config.json whose config this version refuses (`e`): named as that
    file's, not as a setting of the command (a bug hunt, session 99: "config field
    `model.dropout` = 1.5 is not allowed", said to users who had set nothing)."""
    what = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
    return ConfigError(f"{path}: {what}; this version of hpnlp refuses the config that file "
                       "holds: if it was edited, restore it (or correct that field there); if "
                       "an older hpnlp wrote it, set that field to its default there")


def run_members(workdir: str) -> int:
    """How many models a run's checkpoints stack: M for a seed ensemble (EnsembleTrainer),
    as a StackedMembers (`is_stacked`; of 1 too), the int 1 for a plain run (its config.json's
    shape signature; 1 where it has none)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return 1
    sig = _read_config_json(path).get("shape_signature", {})
    if _unmarked_one(sig, workdir):  # a 1-member ensemble saved before the mark, as the
        # Trainer's resume reads it (a review: generate and distill read its stacked [1, ...]
        # arrays as a plain run's)
        return StackedMembers(1)
    return _signature_members(sig)


def has_checkpoint(workdir: str) -> bool:
    """Whether `workdir` holds a saved checkpoint (a numbered folder in its checkpoints/)."""
    ckpt = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))


def config_file(path: str) -> Config:
    """The run config a config.json file at `path` holds (a run's, or a copy of one)."""
    return from_configdict(_read_config_json(path)["config"])


# What `python -m hpnlp.compress` writes in a folder that is not a run: (its record, its
# arrays, the command), each file naming the folder as that command's output
COMPRESSED = (("quant.json", "quantized.npz", "quantize"),
              ("sparse.json", "sparse.npz", "sparsify"))


def compressed(folder: str) -> str | None:
    """The `hpnlp.compress` command whose output `folder` holds (either of its files), else
    None."""
    return next((command for meta, data, command in COMPRESSED
                 if any(os.path.exists(os.path.join(folder, f)) for f in (meta, data))), None)


def load_run_config(workdir: str, *, require_checkpoint: bool = True,
                    field: str | None = None) -> Config:
    """The config a run in `workdir` was trained with (its config.json); NoCheckpoint where
    it has none, or (`require_checkpoint`) no checkpoint yet. `field`: the config field that
    named `workdir` (a teacher, a run to start from), which the errors then name."""
    path = os.path.join(workdir, "config.json")
    named = f"{field}={workdir}: " if field else ""
    if not os.path.exists(path):
        # found in review: a compressed copy was told to train a run there; its arrays alone
        # too (a bug hunt, session 98)
        command = compressed(workdir)
        if command is not None:
            meta, data = next((m, d) for m, d, c in COMPRESSED if c == command)
            source = "the run it was made from"
            try:  # its record names the run
                with open(os.path.join(workdir, meta)) as f:
                    source += f", {json.load(f)['source']['workdir']}"
            except OSError:
                meta = data  # its arrays alone
            except (ValueError, KeyError, TypeError):
                pass
            raise NoCheckpoint(f"{named}{workdir} holds a compressed copy ({meta}, written by "
                               f"python -m hpnlp.compress {command} --out), not a run; name "
                               f"{source}")
        full = os.path.abspath(workdir)
        parts = full.split(os.sep)
        inner = 2 if parts[-1].isdigit() and parts[-2:-1] == ["checkpoints"] else \
            1 if parts[-1] == "checkpoints" else 0
        up = os.sep.join(parts[:-inner]) if inner else ""
        if up and os.path.isfile(os.path.join(up, "config.json")):  # a bug hunt (session 94)
            raise NoCheckpoint(f"{named}{workdir} is inside the run {up} (its checkpoints); "
                               f"name the run's own folder, {up}")
        if has_checkpoint(workdir):  # a bug hunt (session 99): "no run ...: train one there"
            raise NoCheckpoint(
                f"{named}{path} is missing, and {os.path.join(workdir, 'checkpoints')} holds "
                "the run's checkpoints: rerun the command that trained it (python -m "
                f"hpnlp.main --config ... --workdir {workdir}), which writes config.json and "
                "trains nothing more where the run is finished, or restore the file")
        raise NoCheckpoint(f"{named}no run in workdir {workdir} (no config.json): train one "
                           "there first with python -m hpnlp.main --config ... --workdir ...")
    saved = _read_config_json(path)["config"]
    if _options_as_text(saved):
        raise NoCheckpoint(f"{path} was written before configs were saved readably (options as "
                           "text); retrain the run, or resume it for a few more train.steps "
                           "(config.json is rewritten with its next checkpoint)")
    ckpt = os.path.join(workdir, "checkpoints")
    if require_checkpoint and not has_checkpoint(workdir):
        raise NoCheckpoint(f"{named}workdir {workdir} has no checkpoint in {ckpt}: train (or "
                           "resume) the run until it saves one, then use it")
    try:
        return saved_config(saved)
    except (ConfigError, TypeError, AttributeError) as e:  # as _read_config_json's (review r4:
        # a value of another kind, `"options": 5`, was a traceback in every reader)
        raise _edited(f"{named}{path}", e) from None


def saved_config(saved: dict) -> Config:
    """A config as a file saved it (a run's config.json, a compressed folder's quant.json or
    sparse.json), checked where the file is known: its task's facts from the config, which a
    run records with its vocabulary (no data is read); readers check it again with their data
    and devices. Raises ConfigError, TypeError or AttributeError."""
    cfg = from_configdict(saved)
    kind = {"classifier": "classify", "dual_encoder": "match", "bi_encoder": "match"}
    if cfg.model.vocab_size or cfg.model.kind != "lm":
        validate(cfg, devices=False, task_info={
            "kind": kind.get(cfg.model.kind, "lm"), "vocab_size": cfg.model.vocab_size,
            "num_classes": cfg.model.num_classes})
    return cfg


# The attention variants that compute softmax attention exactly (implementations of
# `dense`): a resume may switch between them.
EXACT_ATTENTION = frozenset({"dense", "chunked", "xla", "ring"})


class CheckpointMismatch(ValueError):
    """The workdir holds checkpoints of a different model."""


class CheckpointSaveFailed(RuntimeError):
    """A run's write failed (a full disk, a read-only or foreign folder): a checkpoint, its
    config.json, summary.json or log (`write_failed`): one line naming what and the newest
    complete step. A checkpoint's is raised where orbax reports it, at the next save or at
    the run's end (its writes run in the background)."""


# Fields that change parameter or optimizer-state shapes: a resume must agree on them.
_SHAPE_FIELDS = {
    "model": ("kind", "width", "depth", "num_heads", "mlp_dim", "max_len", "pos_emb",
              "param_dtype", "vocab_size", "num_classes"),
    "attention": ("name", "options"),
    "output": ("name", "tie_embeddings", "options"),
}


# Fields that change the parameter tree too, compared with the saved config itself rather
# than its shape signature, so that runs saved before they were checked still resume (found
# in review: another expert count failed in the restore as a "damaged" checkpoint).
_CONFIG_SHAPE_FIELDS = (("model", "arch"), ("model", "stack_layers"), ("model", "reversible"),
                        ("model", "moe", "num_experts"), ("model", "memory", "size"))
# (A bug hunt: another model.moe.noisy, which adds a router `noise` parameter, and another
# train.prune.layers, which sets the masks' tree, failed as a layout "of another version".)
_CONFIG_SHAPE_WHEN = {("model", "moe", "num_experts"): (("model", "moe", "mlp_dim"),
                                                        ("model", "moe", "every"),
                                                        ("model", "moe", "shared_experts"),
                                                        ("model", "moe", "noisy")),
                      ("model", "memory", "size"): (("model", "memory", "key_dim"),)}
# A recurrent trunk's (model.arch lstm or gru, saved or now): its layer norm and learned
# initial state are parameters; its combine and direction, another function of the same
# arrays, so another model (as other attention variants are). Found by a bug hunt: the
# first two failed in the restore as a layout "of another version"; another combine resumed.
_RNN_FIELDS = (("rnn", "layer_norm"), ("rnn", "learned_init"), ("rnn", "combine"),
               ("rnn", "bidirectional"))


@functools.lru_cache(maxsize=1)
def _default_config_json() -> dict:
    """The default config as config.json holds it, built once (callers only read it)."""
    from hpnlp.config import default_configdict
    return to_json(from_configdict(default_configdict()))


# What a run reads only when it starts (where its parameters come from): a resume restores
# its checkpoint instead, so config.json keeps the saved values (a bug hunt, session 94: a
# resume without the conversion's flags recorded `init_from: ''`, and the original command
# was then refused as adding an init_from the run never had).
START_FIELDS = (("train", "init_from"), ("train", "init_params"), ("train", "init_kv_heads"),
                ("train", "init_kv_calibration"), ("train", "init_experts"),
                ("train", "init_expert_batches"), ("train", "distill", "init"),
                ("train", "distill", "importance_batches"), ("train", "distill", "init_blocks"),
                # float16's first loss scale: a resume restores the scale the run reached (a
                # review, r4: a resume said it trained "under" another value it never read)
                ("train", "loss_scale_init"))


def _keep_saved_start(saved: dict, payload: dict) -> str:
    """Sets `payload`'s START_FIELDS to the saved config's (where it has them); returns
    'field: saved a, now b; ...' for those the resume gave otherwise, else ''."""
    changed = []
    for path in START_FIELDS:
        a, b = saved, payload
        for k in path[:-1]:
            a, b = a.get(k), b.get(k)
            if not isinstance(a, dict) or not isinstance(b, dict):
                break
        else:
            k = path[-1]
            if path == ("train", "loss_scale_init") and (
                    payload.get("model", {}).get("dtype") != "float16"):
                # float16's alone: a resume in another dtype, which `validate` refuses a
                # scale, would write config.json with the saved one, which every reader then
                # refused as edited (a review, session 116)
                continue
            if k in a and k in b and a[k] != b[k]:
                changed.append(f"{'.'.join(path)}: saved {a[k]!r}, now {b[k]!r}")
                b[k] = a[k]
    return "; ".join(changed)


# What a resume may change without changing what is trained: how often it logs, evaluates
# and saves, its progress bar, its length (said on its own), where its parameters started,
# the held-out data, and how the same computation is laid out (remat, kernels, blocks).
_BOOKKEEPING = {"train." + f for f in ("steps", "log_every", "eval_every", "eval_batches",
                                       "checkpoint_every", "keep_checkpoints", "progress",
                                       "early_stopping_patience", "early_stopping_metric")}
_BOOKKEEPING |= {"name", "data.eval_batch_size", "data.eval_path", "model.remat", "rnn.impl",
                 "rnn.unroll", "train.distill.chunk_tokens", "model.moe.block_size"}
_BOOKKEEPING |= {".".join(p) for p in START_FIELDS}


_PATHS = {"data." + f for f in DATA_PATH_FIELDS}


def _without_layout(config: dict) -> dict:
    """A config.json config whose output.options and attention.options leave out their
    layer's layout options (`softmax.layout_options`, the attention variant's
    `layout_options`: chunk sizes, recomputation, which a resume may change unsaid, as
    _BOOKKEEPING's model.remat)."""
    for group, layout_of in (("output", softmax.layout_options),
                             ("attention", _attention_layout)):
        part = config.get(group)
        if not isinstance(part, dict) or not isinstance(part.get("options"), dict):
            continue
        layout = layout_of(part.get("name"))
        config = {**config, group: {**part, "options": {
            k: v for k, v in part["options"].items() if k not in layout}}}
    return config


def _without_unread(config: dict) -> dict:
    """A config.json config with the fields nothing reads in it set back to their defaults
    (`checks.without_unread`), or as it is where it cannot be read so. Review d2: a run of
    experiments/lm.py:bytes saved with data.word_vocab_size=8000 (read by words alone),
    resumed after the experiment stopped setting it, was said to train under a changed config."""
    from hpnlp.config.checks import without_unread
    try:
        return json.loads(json.dumps(to_json(without_unread(from_configdict(config)))))
    except Exception:  # noqa: BLE001 (an edited or older file: compared as it is)
        return config


def _changed_fields(saved: dict, now: dict) -> dict:
    """{dotted field: (saved, now)} where two config.json configs differ, but for
    _BOOKKEEPING (a bug hunt, session 94: a finished run rerun with another learning rate
    or distillation weight trained nothing and printed its old summary, unsaid) and the
    output layer's layout options."""
    out = {}
    saved, now = _without_layout(_without_unread(saved)), _without_layout(_without_unread(now))

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict) and not path.endswith("options"):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b and a is not None and path not in _BOOKKEEPING and not (
                # a run saved before its data paths were absolute, resumed from its directory
                path in _PATHS and same_data_path(a, b)):
            out[path] = (a, b)
    walk(saved, now, "")
    return out


def _config_shape_diff(saved: dict, cfg) -> dict:
    """{field: (saved, now)} for `_CONFIG_SHAPE_FIELDS` (and, where either run sets one, the
    fields it brings) that differ between a saved config.json's config and `cfg`."""
    default, now = _default_config_json(), to_json(cfg)

    def get(d, path):
        for k in path:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    def value(path):  # the saved run's, or the default where it predates the field
        a = get(saved, path)
        return get(default, path) if a is None else a

    fields, diff = [], {}
    recurrent = {get(saved, ("model", "arch")), get(now, ("model", "arch"))} & {"lstm", "gru"}
    method = ("train", "prune", "method")
    pruned = {get(saved, method), get(now, method)} - {None, "none"}
    for path in (_CONFIG_SHAPE_FIELDS + (_RNN_FIELDS if recurrent else ())
                 + ((("train", "prune", "layers"),) if pruned else ())):
        fields.append(path)
        if get(saved, path) or get(now, path):
            fields += _CONFIG_SHAPE_WHEN.get(path, ())
    # Found by a bug hunt (session 90), each resumed or failed unnamed: the init and dropout
    # key is the checkpoint's (another seed was ignored, and config.json recorded it); a
    # float16 resume of another dtype's run restored no loss scale and trained unscaled;
    # Transformer-XL's compressive memory (on or off, its compressor) holds parameters, and
    # its memory is a carry only on a stream ("another version" in the restore).
    fields.append(("seed",))
    # A review (session 117): iterative magnitude pruning's rewind point is captured once, at
    # its step; resumed under another, a run saved before it rewound every weight to zeros
    # never captured (resumed at 0), and one saved after it to the old point, unsaid
    if "imp" in {value(("train", "prune", "schedule")), get(now, ("train", "prune", "schedule"))}:
        fields.append(("train", "prune", "rewind_step"))
    # A bug hunt (session 92): a classifier resumed causal, or pooling the first token, as
    # another function of the same arrays (another model, as another attention variant is)
    if "lm" not in {value(("model", "kind")), get(now, ("model", "kind"))}:
        fields += [("model", "causal"), ("model", "pool")]
    if get(now, ("model", "dtype")) == "float16":
        fields.append(("model", "dtype"))
    # A bug hunt (session 102): mining on or off adds or drops the bi-encoder's `negatives`
    # carry (hpnlp.retrieval.mining), refused by the restore as a layout naming no field;
    # compared here, not in the shape signature, so that mining runs saved before still
    # resume (another mine_every > 0 keeps the carry: it resumes)
    mine = ("model", "encoder", "mine_every")
    if bool(value(mine)) != bool(get(now, mine)):
        diff[".".join(mine)] = (value(mine), get(now, mine))
    if "transformer_xl" in {value(("model", "arch")), get(now, ("model", "arch"))}:
        fields.append(("model", "comp_mem_len"))
        if value(("model", "comp_mem_len")) or get(now, ("model", "comp_mem_len")):
            # comp_rate too (a review, r10: under "conv" its kernel's shape failed the restore
            # naming no field; under "pool" the memory pooled at one rate resumed at another)
            fields += [("model", "comp_fn"), ("model", "comp_rate")]
        stream = ("data", "batching")
        if (value(stream) == "stream") != (get(now, stream) == "stream"):
            fields.append(stream)
        elif get(now, stream) == "stream":
            # A bug hunt (session 101): the memory carried on a stream is [depth, batch,
            # mem_len, width], so another train.batch_size or memory length was refused by
            # the restore as unnamed arrays of other shapes. mem_len 0 is data.seq_len: named
            # as the field that changed
            fields.append(("train", "batch_size"))
            ml, sl = ("model", "mem_len"), ("data", "seq_len")
            was, mem = value(ml) or value(sl), get(now, ml) or get(now, sl)
            if was != mem and value(ml) == get(now, ml):  # both 0: the segment length changed
                diff["data.seq_len"] = (value(sl), get(now, sl))
            elif was != mem:
                diff["model.mem_len"] = (was, mem)
    experts_dim = ("model", "moe", "mlp_dim")

    def resolved(side, f):  # an expert's width as the layer takes it: 0 is model.mlp_dim's (a
        # review, session 116: a shrunk run's explicit width, resumed from a config of 0 and
        # the same model.mlp_dim, was refused as another model)
        v = side(f)
        return (v or side(("model", "mlp_dim"))) if f == experts_dim else v
    now_value = lambda f: get(now, f)  # noqa: E731
    diff.update({".".join(f): (value(f), get(now, f)) for f in fields
                 if resolved(value, f) != resolved(now_value, f)})
    return diff


def _attention_layout(name) -> frozenset:
    """Attention variant `name`'s `layout_options`; none for a name not registered."""
    from hpnlp import attention
    try:
        return frozenset(getattr(attention.get(name), "layout_options", ()))
    except (ValueError, TypeError):
        return frozenset()


def _resolved(sig: dict, other: dict) -> dict:
    """A shape signature with `model.head_dim` as the run computes it (width / heads) where
    `other` sets it and `sig` does not (a README walk: a run shrunk with head_dim set to that
    refused its own resume from a config leaving it unset), and its `output.options` without
    the layer's layout options (`softmax.layout_options`; review r3: another `chunk_tokens`
    was "a different model", and deleting the run advised), and its `attention.options`
    without the variant's. config.json's signature keeps
    them, as it did: both sides of a comparison drop them here."""
    for group, layout in (("output", softmax.layout_options(sig.get("output.name"))),
                          ("attention", _attention_layout(sig.get("attention.name")))):
        options = sig.get(group + ".options")  # (attention's: a review, session 117)
        if isinstance(options, dict) and layout & set(options):
            sig = {**sig, group + ".options": {k: v for k, v in options.items()
                                               if k not in layout}}
    if other.get("model.head_dim") and not sig.get("model.head_dim") and \
            sig.get("model.width") and sig.get("model.num_heads"):
        sig = {**sig, "model.head_dim": sig["model.width"] // sig["model.num_heads"]}
    return sig


def _shape_signature(cfg, members: int = 1) -> dict:
    sig = {"ensemble.members": int(members)}  # a seed ensemble stacks M copies of every array
    if members == 1 and isinstance(members, StackedMembers):  # one of them, told apart from a
        # plain run (review r3); M > 1 says it already, so runs saved before still resume
        sig["ensemble.stacked"] = True
    for group, fields in _SHAPE_FIELDS.items():
        sub = getattr(cfg, group)
        for f in fields:
            v = getattr(sub, f)
            sig[f"{group}.{f}"] = dict(v) if f == "options" else v
    sig["train.clip_norm > 0"] = cfg.train.clip_norm > 0  # changes the optimizer-state tree
    # Factorized products and the train state's carries change the state's arrays too; the
    # keys appear only when set, so runs saved before they existed still resume.
    if cfg.model.head_dim:
        sig["model.head_dim"] = cfg.model.head_dim
    if cfg.model.kv_heads() < cfg.model.num_heads:  # q and kv [E, 2, G, D] in place of qkv
        sig["model.num_kv_heads"] = cfg.model.kv_heads()
    if cfg.model.kv_latent_dim:  # q, kv_down, kv_norm, k_up, v_up in place of qkv
        sig["model.kv_latent_dim"] = cfg.model.kv_latent_dim
        sig["model.kv_latent_rope_dim"] = cfg.model.latent_rope_dims()
        if not cfg.model.kv_latent_norm:  # no kv_norm parameters
            sig["model.kv_latent_norm"] = False
    if cfg.model.lowrank.enabled():
        lr = cfg.model.lowrank  # energy and ranks only when used: older runs still resume
        tables = [k for k in ("embed", "output") if lr.applies(k)]  # since "all" took them
        sig["model.lowrank"] = {"rank": lr.rank, "layers": lr.layers, **(
            {"energy": lr.energy, "ranks": dict(lr.ranks)} if lr.energy or lr.ranks else {}),
            **({"tables": tables} if tables else {})}
    if cfg.data.eval_split != "eval":  # what the weights never saw: a resume keeps it
        sig["data.eval_split"] = cfg.data.eval_split
    if cfg.train.prune.method != "none":
        sig["train.prune.method"] = cfg.train.prune.method
        for f, value in (("structure", "structured"), ("schedule", "imp")):  # other carry trees
            if getattr(cfg.train.prune, f) == value:
                sig[f"train.prune.{f}"] = value
    if cfg.train.distill.teacher:  # a hidden-state projection is a trained parameter
        sig["train.distill"] = "hidden" if cfg.train.distill.hidden else "on"
    # a mapping at any depth as a dict (a review, session 103: options' nested mappings are
    # FrozenDicts since config.json's lists became tuples, and were written as their repr)
    return as_json(sig)


class Checkpointer:
    def __init__(self, workdir: str, cfg, *, keep: int, members: int = 1, read_only: bool = False):
        """`read_only`: a tool reading the run (PTQ, ensembles of checkpoints) checks the
        model against config.json but leaves the run's files as they are. A resume under a
        changed config (another learning rate, more steps) writes config.json with the first
        checkpoint it saves, so the file never describes steps no checkpoint holds."""
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.config_path = os.path.join(os.path.abspath(workdir), "config.json")
        self._pending_config = None
        self._pending_step = None  # the step of the first save that writes it (`_write_pending`)
        # config.json is missing beside checkpoints: written once one is read (`restore`)
        self._config_missing = False
        # "attention.name: saved 'dense', now 'chunked'" where a resume changes only the
        # implementation of exact attention (EXACT_ATTENTION), which it may
        self.attention_changed = ""
        # "train.init_kv_heads: saved 'svd', now 'mean'" where a resume gives START_FIELDS
        # otherwise than the run started with (they are not read; config.json keeps the saved)
        self.start_changed = ""
        # {field: (saved, now)} where a resume's config differs from the saved one in what
        # trains the model (not where it is logged, evaluated or saved, nor START_FIELDS)
        self.changed: dict = {}
        # the saved config's train fields, where a resume reads them (its lr schedule's)
        self.saved_train: dict = {}
        self.read_only = read_only
        self._check_or_write_config(cfg, members, write=not read_only)
        # A save cut short (a second SIGTERM, a kill) leaves its whole state in a temporary
        # folder no restore reads (a bug hunt, session 92): a run removes them before it saves;
        # a tool reading the run leaves them (the run may be saving now)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=not read_only,  # (a reader writes nothing: a bug
                cleanup_tmp_directories=not read_only))   # hunt, session 96)
        # Orbax removes them in a thread it starts here and awaits at the first save: a script
        # that built a Trainer and ended (to read its initial state) printed a 40-line
        # "cannot schedule new futures after interpreter shutdown" (a bug hunt, session 98)
        wait = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if wait is not None:
            wait()
        # The training loop keeps the preemption sync point's step counter (hpnlp.train.stop);
        # Orbax's save would set that counter to the step number it saves.
        self.manager.reached_preemption = lambda step: False

    def _check_or_write_config(self, cfg, members: int, write: bool = True) -> None:
        sig = _shape_signature(cfg, members)
        payload = {"shape_signature": sig, "config": to_json(cfg)}
        # a numbered folder, as `has_checkpoint`: a save cut short leaves only a temporary
        # one, and its rerun starts over (review r3: it was refused as another model's run)
        resuming = os.path.isdir(self.directory) and any(
            n.isdigit() for n in os.listdir(self.directory))
        if os.path.exists(self.config_path):
            saved = _read_config_json(self.config_path)
            self.saved_train = dict(saved.get("config", {}).get("train", {}))
            old_sig = saved.get("shape_signature", {})
            unmarked = _unmarked_one(old_sig, os.path.dirname(self.config_path))
            if unmarked:  # a 1-member ensemble saved before the mark, as its members.json
                # says: resumed as before, and config.json gains the mark (written below); a
                # plain run's resume of it (hpnlp.main's) is refused naming --members 1 (a
                # review: it got past this check and failed in the restore)
                old_sig = saved["shape_signature"] = {**old_sig, "ensemble.stacked": True}
            diff = _saved_differs(saved, cfg, sig)
            lines = "; ".join(f"{k}: saved {_shown(a, saved.get('config'), k)}, now "
                              f"{_shown(b, payload['config'], k)}" for k, (a, b) in diff.items())
            if diff and resuming and _exact_attention_switch(
                    diff, saved["config"].get("attention", {}).get("name"), cfg.attention.name):
                # Exact attention by another implementation (or its block sizes): the same
                # arrays and the same function, so a resume or a tool may switch (a README
                # walk: a dense run refused `chunked`). Other variants hold the same arrays
                # too, but compute another model: a switch to one is refused (review).
                self.attention_changed = lines
            elif diff and resuming:
                edited = _signature_edited(saved, diff)
                if edited:
                    raise CheckpointMismatch(
                        f"{self.config_path}: its shape_signature and its config disagree "
                        f"({edited}), so the file was edited since the run wrote it: restore "
                        "it, or edit it back so that they agree")
                saved_members = _signature_members(old_sig)
                if (saved_members, is_stacked(saved_members)) != (members, is_stacked(members)):
                    # a seed ensemble read as one run, or the reverse (of one member too)
                    fix = (f"It holds a seed ensemble of {saved_members}: train or evaluate it "
                           f"with python -m hpnlp.train.ensemble --members {saved_members}"
                           if is_stacked(saved_members) else "It holds a single run, not a seed "
                           "ensemble: train or evaluate it with python -m hpnlp.main")
                elif set(diff) == {"model.encoder.mine_every"}:
                    # review (session 102): named as "a different model", and deleting it
                    # advised; mining keeps its negatives in the train state, not the model,
                    # so train.init_from reads the run (_model_fields_differ leaves it out)
                    was = diff["model.encoder.mine_every"][0]
                    workdir = os.path.dirname(self.config_path)
                    raise CheckpointMismatch(
                        f"workdir {workdir} holds checkpoints of a run trained with "
                        f"bi-encoder mining {'on' if was else 'off'} ({lines}), whose train "
                        f"state {'holds' if was else 'lacks'} the mined negatives (the model "
                        f"is the same): {'resume' if write else 'read'} it with "
                        f"model.encoder.mine_every {'> 0' if was else '= 0'} as saved"
                        + (", or start a new --workdir from its parameters with "
                           f"--config.train.init_from={workdir}" if write else ""))
                elif set(diff) == {"train.prune.rewind_step"}:  # a review (session 117)
                    was = diff["train.prune.rewind_step"][0]
                    workdir = os.path.dirname(self.config_path)
                    raise CheckpointMismatch(
                        f"workdir {workdir} holds checkpoints of an iterative magnitude pruning "
                        f"run that rewinds to its weights after {was} updates ({lines}), which "
                        "it captures once, at that step: resume it with "
                        f"train.prune.rewind_step={was} as saved")
                elif write:
                    fix = "Use a new --workdir, or delete that one to start over"
                else:  # a tool reading the run (found by a README walk: it advised deleting it)
                    fix = ("Read it with the config it was trained with (its config.json, "
                           "or the experiment and overrides that wrote it)")
                raise CheckpointMismatch(
                    f"workdir {os.path.dirname(self.config_path)} holds checkpoints of a different "
                    f"model ({lines}). {fix}.")
            was = saved.get("config", {}).get("train", {}).get("init_from", "")
            if write and resuming and not was and cfg.train.init_from:
                # a bug hunt (session 92): a rerun adding it resumed its own checkpoint, read
                # nothing from that run, and config.json recorded the start it never made (a
                # changed path stays allowed: the source run may have moved)
                raise CheckpointMismatch(
                    f"workdir {os.path.dirname(self.config_path)} holds checkpoints of a run "
                    f"trained from its own initialization (train.init_from: saved '', now "
                    f"{cfg.train.init_from!r}); train.init_from is read only when a run starts, "
                    "and a rerun resumes its checkpoints. Drop it to resume, or use a new "
                    "--workdir to start from that run")
            if resuming:
                payload = json.loads(json.dumps(payload))
                self.start_changed = _keep_saved_start(saved["config"], payload["config"])
                self.changed = _changed_fields(saved["config"], payload["config"])
                if saved == payload and not unmarked:
                    return  # the same config: nothing to write
        elif resuming:
            self._config_missing = True
            if jax.process_index() == 0:  # a bug hunt (session 92): unsaid
                print(f"hpnlp: warning: {self.directory} holds checkpoints but "
                      f"{self.config_path} is missing: the config they were trained with is "
                      "unknown, so only their arrays' shapes are checked against this one"
                      + ("; config.json records this one once the newest is read" if write
                         else ""), file=sys.stderr, flush=True)
        if write and resuming:
            self._pending_config = payload  # written with the first new checkpoint (`wait`)
        elif write:
            self._write_config(payload)
            if not is_stacked(members):  # a new plain run: an earlier ensemble's members.json
                # left here (one stopped before it saved, or its checkpoints deleted) would
                # read this run as a 1-member ensemble saved before the mark (review r1)
                self._drop_members_file()

    def _write_config(self, payload: dict) -> None:
        if jax.process_index() == 0:  # atomically: other processes may be reading it
            try:
                os.makedirs(os.path.dirname(self.config_path), exist_ok=True)
                write_json(self.config_path, payload)
            except OSError as e:  # a bug hunt (session 101): a full disk was a 34-line traceback
                raise write_failed(self.config_path, e, self.directory) from None

    def _drop_members_file(self) -> None:
        path = os.path.join(os.path.dirname(self.config_path), "members.json")
        if jax.process_index() == 0 and os.path.lexists(path):
            try:
                os.remove(path)
            except OSError as e:
                raise CheckpointSaveFailed(
                    f"{path} is left from a seed ensemble trained in this workdir before, and "
                    f"removing it failed ({type(e).__name__}: {e}); delete it (this run is "
                    "not an ensemble) and run again") from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, loop_state: dict) -> None:
        if self._pending_config is not None and self._pending_step is None:
            self._pending_step = step  # (set first: a Ctrl-C inside orbax's save may leave
            # that step to commit)
        with self._saving():
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                loop=ocp.args.JsonSave(loop_state)))
        if self._pending_config is not None:  # a resume's changed config, now that it trains
            self.wait()

    def _write_pending(self) -> None:
        """A resume's changed config, written once its first checkpoint is committed, by
        whichever wait finds it so (a process stopped while that save ran resumes the step
        before, which the old config.json describes). A review (r3): written by `save` alone,
        a Ctrl-C during its wait left that step committed (the loop's own wait finished it)
        and config.json describing the old config, taken by the rerun as the same one."""
        if self._pending_config is None or self._pending_step is None:
            return
        newest = self.latest_step()
        if newest is not None and newest >= self._pending_step:
            self._write_config(self._pending_config)
            self._pending_config = self._pending_step = None

    def restore(self, step: int, abstract_state):
        """abstract_state: ShapeDtypeStructs carrying the target shardings."""
        where = os.path.join(self.directory, str(step))
        # from the start: a restore failing part-way (a truncated manifest) can abandon reads
        # that report in while it is still under way (a bug hunt, on a loaded machine: 27
        # 'Event loop is closed' tracebacks before hpnlp's one line)
        _quiet_aborted_reads()
        other = _other_shapes(os.path.join(where, "state"), abstract_state)
        if other:  # refused from the stored metadata: a restore that fails part-way leaves
            # orbax's reads of the other arrays pending on a closed event loop
            raise CheckpointMismatch(
                f"checkpoint {where} holds arrays of other shapes or types than this run's model "
                f"({other}): the workdir holds a different model's checkpoints (or one edited "
                "since); resume it with the config it was trained with (its config.json), or "
                "use a new --workdir")
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                loop=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 (whatever orbax raises: the step cannot be read)
            if "not compatible with the stored shape" in str(e):  # another model's arrays
                raise CheckpointMismatch(
                    f"checkpoint {where} holds arrays of other shapes than this run's model "
                    f"({str(e).splitlines()[0][:200]}): the workdir holds a different model's "
                    "checkpoints; resume it with the config it was trained with (its "
                    "config.json), or use a new --workdir") from e
            if "tree structures do not match" in str(e):  # read whole, but another layout
                raise CheckpointMismatch(
                    f"checkpoint {where} cannot be read as this run's train state: its layout "
                    "differs from the one this version of hpnlp builds for the run's config "
                    "(written by another version, or under settings whose state carried other "
                    "entries); resume it as it was written, move it aside to resume from the "
                    "step before, or start a new --workdir from its parameters with "
                    f"--config.train.init_from={os.path.dirname(self.directory)}") from e
            raise _unreadable(where, e, "move it aside to read the step before" if self.read_only
                              else "move it aside to resume from the step before, or use a new "
                              "--workdir") from e
        for item, wrong in (("loop", _loop_state_wrong(out["loop"])),
                            ("data", "" if isinstance(out["data"], dict) else
                             f"{out['data']!r:.80} is not a JSON object")):
            if wrong and not self.read_only:  # (a reader uses the parameters alone) a bug
                # hunt (session 99): an edited loop item trained ten steps, then failed at the
                # eval (its `best` a string), and they were lost
                raise CheckpointMismatch(
                    f"checkpoint {where}: its {item} state ({os.path.join(where, item)}) is "
                    f"damaged ({wrong}); move the step aside to resume from the step before, "
                    "or use a new --workdir")
        bad = _non_finite(getattr(out["state"], "params", {}))
        if bad:  # a bug hunt (session 92): read as it was, then blamed on the learning rate
            raise _non_finite_error(where, bad, "move it aside to read the step before"
                                    if self.read_only else "move it aside to resume from the "
                                    "step before, or use a new --workdir")
        if self._config_missing and self._pending_config is not None:
            # A bug hunt (session 99): a finished run that lost its config.json saves no next
            # checkpoint, so the file never came back; its arrays have now been read as this
            # config's (a rerun that trains on writes it no earlier than before it did)
            self._write_config(self._pending_config)
            self._pending_config, self._config_missing = None, False
        return out["state"], out["data"], out["loop"]

    def wait(self) -> None:
        with self._saving():
            self.manager.wait_until_finished()
        self._write_pending()

    def close(self) -> None:
        self.wait()
        self.manager.close()

    def check(self) -> None:
        """Raise CheckpointSaveFailed if a background save has failed (called each log
        window, so a full disk stops the run within a window, not a checkpoint later)."""
        with self._saving():
            self.manager.check_for_errors()
            if not self.manager.is_saving_in_progress():
                # a review (session 117): orbax's finalize thread takes the writer's error
                # from where check_for_errors looks and keeps it until that thread is joined,
                # which a finished save's wait does at once (and raises it)
                self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _saving(self):
        """Whatever a save raised (the filesystem's error, as orbax passes it on) as
        CheckpointSaveFailed. A bug hunt: a read-only checkpoints folder gave 300 lines of
        traceback and a process that never exited; a full disk, orbax's tracebacks and the
        error late."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            raise self._save_failed(e) from None

    def _save_failed(self, e: Exception) -> CheckpointSaveFailed:
        return write_failed(f"a checkpoint in {self.directory}", e, self.directory)


def write_failed(what: str, e: Exception, directory: str) -> CheckpointSaveFailed:
    """A run's failed write of `what` (a checkpoint, its config.json, its metrics) as one
    line naming the newest complete checkpoint in `directory`, the run's checkpoints folder,
    which a rerun resumes from."""
    steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit()) \
        if os.path.isdir(directory) else []
    detail = (str(e).splitlines() or ["no detail"])[0][:200]
    newest = (f"the newest complete checkpoint is step {steps[-1]}: a rerun of the same "
              "command resumes from it" if steps else "no checkpoint is complete")
    return CheckpointSaveFailed(
        f"writing {what} failed ({type(e).__name__}: {detail}); {newest}. Free space there, "
        "or make it writable, before rerunning")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_count(v) -> bool:
    return type(v) is int and v >= 0


def _is_last_step(v) -> bool:
    """A log window's last step as saved: what its train line reads of that step."""
    return (isinstance(v, dict) and {"param_norm", "lr"} <= set(v)
            and set(v) <= {"param_norm", "lr", "loss_scale"} and all(map(_is_number, v.values())))


# The loop item's entries (hpnlp.train.loop's `save`): what each must be, and the test
_LOOP_ENTRIES = {"best": ("a number or null", lambda v: v is None or _is_number(v)),
                 "best_step": ("a step or null", lambda v: v is None or _is_count(v)),
                 "bad_evals": ("a count", _is_count),
                 "best_metric": ("a metric's name", lambda v: isinstance(v, str)),
                 "stopped_early": ("true or false", lambda v: isinstance(v, bool)),
                 "last_eval": ("an object or null", lambda v: v is None or isinstance(v, dict)),
                 "last_eval_step": ("a step or null", lambda v: v is None or _is_count(v)),
                 "window": ("an object or null", lambda v: v is None or isinstance(v, dict)),
                 "routing_groups": ("a count or null", lambda v: v is None or _is_count(v)),
                 "eval_due": ("true or false", lambda v: isinstance(v, bool)),
                 "eval_set": ("an object", lambda v: isinstance(v, dict)),
                 "pipeline_stages": ("a count", _is_count)}
_WINDOW_ENTRIES = {"sums": ("an object or null", lambda v: v is None or isinstance(v, dict)),
                   "dtypes": ("an object", lambda v: isinstance(v, dict)),
                   "n": ("a count", _is_count), "applied": ("a count", _is_count),
                   "clipped": ("a count", _is_count), "gmin": ("a number", _is_number),
                   "gmax": ("a number", _is_number),
                   "last": ("null or an object of numbers: param_norm, lr (and loss_scale)",
                            lambda v: v is None or _is_last_step(v))}


def _loop_state_wrong(loop) -> str:
    """What is wrong with a checkpoint's loop item (its entries of another type), else "".
    An entry left out is taken as its default (states saved before it existed)."""
    if not isinstance(loop, dict):
        return f"{loop!r:.80} is not a JSON object"
    for entries, holder, name in ((_LOOP_ENTRIES, loop, ""),
                                  (_WINDOW_ENTRIES, loop.get("window") or {}, "window.")):
        for key, (want, ok) in entries.items():
            if key in holder and not ok(holder[key]):
                return f"{name}{key} = {holder[key]!r:.80}, not {want}"
    return ""


def _signature_edited(saved: dict, diff: dict) -> str:
    """'field: shape_signature a, config b; ...' where a config.json's shape signature and
    the one its own config gives disagree in fields of `diff` (a resume's differences), else
    "": the file was edited (a bug hunt, session 99: a reader told "saved 128, now 64" to
    read the run with its config.json, the file it had just read)."""
    old = saved.get("shape_signature", {})
    members = _signature_members(old)
    try:  # (a count that is no integer, edited: its config's own, 1, so the diff names it)
        own = _shape_signature(from_configdict(saved["config"]),
                               members if isinstance(members, int) else 1)
    except Exception:  # noqa: BLE001 (a config this version cannot read: the caller's error)
        return ""
    old, own = _resolved(old, own), _resolved(own, old)
    return "; ".join(f"{k}: shape_signature {_shown(old.get(k), None, k)}, config "
                     f"{_shown(own.get(k), None, k)}" for k in sorted(diff)
                     if k in {**old, **own} and old.get(k) != own.get(k))


@jax.jit
def _all_finite(tree):
    return jax.tree.map(lambda x: jax.numpy.isfinite(x).all(), tree)


def _non_finite(params) -> list[str]:
    """The paths of the parameters holding a NaN or an infinity: on the host where this
    process holds them whole (no compile per model), else one reduction each under jit."""
    floats = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
              if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)}
    spread = {k: x for k, x in floats.items() if not getattr(x, "is_fully_addressable", True)}
    ok = {k: bool(np.isfinite(np.asarray(x)).all()) for k, x in floats.items() if k not in spread}
    ok.update(jax.device_get(_all_finite(spread)) if spread else {})
    return [k for k in floats if not ok[k]]


def _non_finite_error(where: str, bad: list[str], fix: str, *,
                      named: str = "") -> CheckpointMismatch:
    """The error for checkpoint `where` holding non-finite parameters (`bad`: their paths,
    from `_non_finite`), read by a resume or a tool, or as another run's parameters (`named`:
    the field and value that named it, e.g. "train.init_from=WORKDIR")."""
    return CheckpointMismatch(
        (f"{named}: " if named else "") + f"checkpoint {where} holds non-finite parameters "
        f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), which training never saves "
        f"(a non-finite step stops before its checkpoint): it is damaged; {fix}")


def _unreadable(where: str, e: Exception, fix: str) -> CheckpointMismatch:
    """The error for a checkpoint step that failed to read: damaged or incomplete, and the
    `fix`. TensorStore's first line ends in a pointer to more detail that prints as a bound
    method's repr (found by a README walk): kept out."""
    _quiet_aborted_reads()
    detail = str(e).splitlines()[0].split(" See full TensorStore details")[0] if str(
        e) else "no detail"
    return CheckpointMismatch(
        f"checkpoint {where} cannot be read ({type(e).__name__}: {detail[:200]}); it is "
        f"damaged or incomplete: {fix}")


def _aborted_read(unraisable) -> bool:
    """Whether an unraisable exception is one of orbax's reads abandoned by a failed restore:
    its coroutine collected after the restore's event loop closed, or TensorStore finishing a
    read for that closed loop."""
    code = getattr(unraisable.object, "cr_code", None)
    return getattr(code, "co_name", "") == "_read_array_index_and_device_put" or (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed")


def _quiet_aborted_reads() -> None:
    """From a restore on, this process drops the tracebacks of orbax's abandoned reads
    (`_aborted_read`) and passes every other unraisable exception on. A README walk's damaged
    checkpoint printed hpnlp's one line, then up to 1,300 lines of them ('Exception ignored
    in: <coroutine _read_array_index_and_device_put>', 'Event loop is closed'), at random:
    whenever the reads finished or were collected."""
    previous = sys.unraisablehook
    if getattr(previous, "hpnlp_quiet", False):
        return

    def hook(unraisable):
        if not _aborted_read(unraisable):
            previous(unraisable)
    hook.hpnlp_quiet = True
    sys.unraisablehook = hook


def _plain_path(path) -> tuple:
    """A pytree path as plain names and indices, the same for a train state's attributes and
    named tuples and for the dicts and lists its checkpoint's metadata reads back as."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _shape_dtype(x) -> str:
    """`(2, 8) float32`: an array's shape and element type, as the errors show them."""
    dtype = getattr(x, "dtype", None)
    return f"{tuple(x.shape)}" + (f" {np.dtype(dtype).name}" if dtype is not None else "")


def _other_shapes(state_dir: str, abstract_state) -> str:
    """The arrays of a saved train state whose shapes or element types differ from
    `abstract_state`'s, named with both ("" when none differ, or when the metadata cannot say:
    a layout that differs, or an unreadable step, is left to the restore's own error). A bug
    hunt (session 96): an array saved as int32 was cast back to float32 by the restore, and
    the run resumed from those weights without a word."""
    try:
        from etils import epath
        handler = ocp.StandardCheckpointHandler()
        try:
            meta = handler.metadata(epath.Path(state_dir))
        finally:
            handler.close()
        saved = {_plain_path(p): _shape_dtype(x)
                 for p, x in jax.tree_util.tree_leaves_with_path(meta) if hasattr(x, "shape")}
    except Exception:  # noqa: BLE001 (no metadata to compare: the restore reports)
        return ""
    now = {_plain_path(p): _shape_dtype(x)
           for p, x in jax.tree_util.tree_leaves_with_path(abstract_state)}
    if saved.keys() != now.keys():
        return ""
    differ = [("/".join(map(str, k)), saved[k], now[k]) for k in now if saved[k] != now[k]]
    shown = "; ".join(f"{name}: saved {a}, now {b}" for name, a, b in differ[:3])
    return shown + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")


def _newest(workdir: str):
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    manager = ocp.CheckpointManager(directory)
    step = manager.latest_step()
    if step is None:
        manager.close()
        raise NoCheckpoint(f"workdir {workdir} has no checkpoint in {directory}: train (or resume) "
                           "that run until it saves one")
    return manager, step


def saved_state_tree(workdir: str) -> dict | None:
    """The train state's tree in the newest checkpoint of `workdir`, as its orbax metadata
    reads back (nested dicts of array metadata; no array is read), for a layout that follows
    what a run saved; None where there is no checkpoint or its metadata cannot be read (the
    restore then says so)."""
    if not has_checkpoint(workdir):
        return None
    try:
        manager, step = _newest(workdir)
    except NoCheckpoint:  # numbered folders orbax does not count as steps
        return None
    manager.close()
    import logging
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # the item has no step-level metadata file; its tree is read
    try:
        meta = ocp.PyTreeCheckpointer().metadata(os.path.join(manager.directory, str(step),
                                                              "state"))
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        return tree if isinstance(tree, dict) else None
    except Exception:  # noqa: BLE001 (damaged metadata: the restore's own check reports it)
        return None
    finally:
        absl.setLevel(level)


def check_params_match(workdir: str, like, *, field: str, cfg: Config | None = None) -> None:
    """Refuse (naming `field`) when the newest checkpoint in `workdir` holds parameters of
    other names or shapes than `like` (arrays or ShapeDtypeStructs), before any restore.
    `cfg`: the config `like` is built by, whose fields the error compares with that run's
    (a bug hunt, session 94: it named arrays, 'saved None', and not the model.arch or the
    seed ensemble that made them differ)."""
    import flax.traverse_util as traverse
    from hpnlp.config import config_error

    manager, step = _newest(workdir)
    manager.close()
    import logging
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # the item has no step-level metadata file; its tree is what we read
    where = os.path.join(manager.directory, str(step))
    try:
        meta = ocp.PyTreeCheckpointer().metadata(os.path.join(where, "state"))
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        tree["params"]
    except Exception as e:  # noqa: BLE001 (a bug hunt, session 96: damaged metadata read as
        # None, then an AttributeError traceback; the restore's own check says it in one line)
        raise _unreadable(where, e, "move it aside to read the step before it") from None
    finally:
        absl.setLevel(level)
    from hpnlp.train.carry import model_params  # a method's own parameters are not the model's
    saved = {k: tuple(v.shape) for k, v in traverse.flatten_dict(model_params(tree["params"])).items()}
    mine = {k: tuple(v.shape) for k, v in traverse.flatten_dict(like).items()}
    diff = sorted(set(saved) ^ set(mine)) + sorted(k for k in set(saved) & set(mine)
                                                   if saved[k] != mine[k])
    if diff:
        members = run_members(workdir)
        if is_stacked(members):
            raise config_error(field, workdir, f"it holds a seed ensemble of {members} "
                               f"member{'s' if members > 1 else ''} "
                               "(python -m hpnlp.train.ensemble), whose parameters are stacked "
                               "member by member; name a single run (python -m hpnlp.main)")
        fields = _model_fields_differ(workdir, cfg) if cfg is not None else {}
        theirs = _read_config_json(os.path.join(workdir, "config.json")).get("config")
        ours = to_json(cfg) if cfg is not None else {}
        named = "; ".join(f"{k}: that run {_shown(a, theirs, k)}, this run {_shown(b, ours, k)}"
                          for k, (a, b) in fields.items())
        shown = "; ".join(f"{'/'.join(k)}: " + ("that run has none" if k not in saved else
                                                 "this run has none" if k not in mine else
                                                 f"saved {saved[k]}, this run {mine[k]}")
                          for k in diff[:4])
        settings = [s for k in fields for s in _settings(k, theirs, ours)]
        fix = (f"set this run's {', '.join(settings)} to read it, or name a run of this run's "
               "model shape" if settings else "it must be a run of the same model shape")
        raise config_error(field, workdir, "its parameters differ from this run's ("
                           + (f"{named}: " if named else "") + f"{len(diff)} arrays: {shown}); "
                           + fix)


def _shown(value, config: dict | None, field: str) -> str:
    """`value` of a dotted `field` as a message shows it: where a shape signature leaves a
    field out (unset: train.prune.method 'none'), the config's own value (a bug hunt, session
    95: "saved 'movement', now None")."""
    if value is None:
        for k in field.split("."):
            config = config.get(k) if isinstance(config, dict) else None
        return "unset" if config is None else repr(config)
    return repr(value)


def _settings(field: str, theirs: dict, ours: dict) -> list[str]:
    """'field=value' settings that give `ours` (a config.json config) `theirs`' value of the
    dotted `field`, a group's field by field (a bug hunt, session 95: "set this run's
    model.lowrank={'rank': 4, ...}", which no flag takes, or "=None")."""
    def get(conf, path):
        for k in path.split("."):
            conf = conf.get(k) if isinstance(conf, dict) else None
        return conf
    value = get(theirs, field)
    if not isinstance(value, dict):
        return [] if value is None else [f"{field}={value!r}"]
    return [f"{field}.{k}={v!r}" for k, v in value.items() if get(ours, f"{field}.{k}") != v]


def _saved_differs(saved: dict, cfg, sig: dict) -> dict:
    """{field: (saved, cfg's)} where a config.json's contents (`saved`) and `cfg` (of shape
    signature `sig`) differ in what shapes or defines the model's arrays."""
    old = saved.get("shape_signature", {})
    old, new = _resolved(old, sig), _resolved(sig, old)
    diff = {k: (old.get(k), new.get(k)) for k in {**old, **new} if old.get(k) != new.get(k)}
    diff.update(_config_shape_diff(saved["config"], cfg))
    return diff


def _exact_attention_switch(diff: dict, name_a, name_b) -> bool:
    """Whether two runs' differences (`_saved_differs`) are only one implementation of exact
    attention for another (or its block sizes): one model."""
    return set(diff) <= {"attention.name", "attention.options"} and \
        {name_a, name_b} <= EXACT_ATTENTION


def other_model(a: Config, b: Config, members_a: int = 1, members_b: int = 1) -> str:
    """The fields in which a run of `b` would be another model than a run of `a` in the same
    workdir, as a resume's check finds them ("" where none: exact attention's
    implementations are one model), e.g. "model.width: 32 and 64"."""
    saved = {"shape_signature": _shape_signature(a, members_a), "config": to_json(a)}
    diff = _saved_differs(saved, b, _shape_signature(b, members_b))
    if _exact_attention_switch(diff, a.attention.name, b.attention.name):
        return ""
    return "; ".join(f"{k}: {x!r} and {y!r}" for k, (x, y) in sorted(diff.items()))


def _model_fields_differ(workdir: str, cfg: Config) -> dict:
    """{field: (that run's, cfg's)} for the model and output-layer fields that shape the
    parameters, where the run in `workdir` (its config.json) and `cfg` differ."""
    diff = _saved_differs(_read_config_json(os.path.join(workdir, "config.json")), cfg,
                          _shape_signature(cfg))
    return {k: v for k, v in sorted(diff.items()) if k.startswith(("model.", "output."))
            and k not in ("model.dtype", "model.causal", "model.pool", "model.mem_len",
                          "model.encoder.mine_every")}


def restore_params(workdir: str, like, *, field: str | None = None):
    """The parameters of the newest checkpoint in `workdir`, in the shapes, dtypes and
    shardings of `like` (a parameter tree of arrays), read without the rest of the state
    (Orbax partial restore): a distillation teacher (hpnlp.compress.distill), or the start
    of a fine-tuning run (`train.init_from`); `field`, where given, the one that names
    `workdir`, for an error."""
    manager, step = _newest(workdir)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                           sharding=getattr(a, "sharding", None)),
                            like)
    item = {"params": abstract}
    _quiet_aborted_reads()  # as Checkpointer.restore
    try:
        out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True)))
    except Exception as e:  # noqa: BLE001 (whatever orbax raises: the step cannot be read)
        raise _unreadable(os.path.join(manager.directory, str(step)), e,
                          "move it aside to read the step before it") from e
    finally:
        manager.close()
    params = out["state"]["params"]
    bad = _non_finite(params)
    if bad:  # a bug hunt (session 102): a resume refused it, a teacher or init_from read
        # it, and the run failed after its compile ("training became non-finite at step 1
        # ... Lower train.lr")
        raise _non_finite_error(os.path.join(manager.directory, str(step)), bad,
                                "move it aside to read the step before it",
                                named=f"{field}={workdir}" if field else "")
    return params
