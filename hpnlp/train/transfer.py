"""A run of one task started from the trunk of a run of another (`train.init_params='trunk'`):
pretrain, then fine-tune (GPT and BERT's recipe), e.g. the byte LM's trunk under the text
classifier.

The `train.init_from` run's token embedding and trunk (its blocks, final norm and position
table) start this run; every other parameter (the task's head: a classifier's, an LM's output
bias) keeps this run's own draw, as a run without `init_from` would start it. A learned
position table of another length is copied where both have rows; the positions past that
run's keep this run's draw. The two runs must read the same token ids (both byte-level, or
the same task and tokenizer) and have the same trunk: what differs is named, with the fields
to change, before anything is read or compiled. It is one of `train.init_from`'s conversions
(compress.gqa.Conversion), so prune, distill and the other carries start from it as they
start from any `init_from`.
"""

from __future__ import annotations

import dataclasses

import flax.traverse_util as traverse
import jax.numpy as jnp

from hpnlp.config import Config, config_error
from hpnlp.train.checkpoint import EXACT_ATTENTION

KEPT = ("embed", "trunk")  # the top-level parameter groups a trunk transfer reads
POSITIONS = ("trunk", "pos_embedding")  # a learned position table: [max_len, width]
# The model fields that make the trunk's function, beside its weights: a run that reads
# another's trunk must have that run's (some change no shape: positions, attention)
TRUNK_FIELDS = ("arch", "width", "depth", "num_heads", "head_dim", "num_kv_heads",
                "kv_latent_dim", "kv_latent_rope_dim", "kv_latent_norm", "mlp_dim", "pos_emb",
                "reversible", "stack_layers")
# model.moe's fields but these, each named: how dropless blocks are laid out, and the
# training losses' weights (a fine-tune sets its own, as model.dropout). A review (r4): the
# whole MoEConfig was compared, so another block_size, which a resume may change, was refused.
MOE_NOT_TRUNK = ("block_size", "balance_loss", "z_loss")
# An LSTM/GRU trunk's (model.arch, width and depth are the cell and the stack): what its
# arrays or its eval function read. Not its dropout variants and weight_drop (the identity at
# evaluation, and a fine-tune sets its own, as model.dropout) nor impl and unroll (how the
# recurrence runs): a review (r4) found each of those refused, the whole RNNConfig named.
# zoneout stays: its eval output is the expectation p prev + (1 - p) new.
RNN_TRUNK_FIELDS = ("combine", "layer_norm", "learned_init", "bidirectional", "zoneout")
# What an LSTM/GRU trunk reads of TRUNK_FIELDS. The Transformer's sizes (num_heads, mlp_dim,
# ...) are ignored there, and an experiment sets them for every arch it offers: a review (r1)
# found an LSTM trunk refused over model.mlp_dim. Its attention and MoE fields are held at
# their defaults (config/checks.py), so there is nothing of them to compare.
RNN_MODEL_FIELDS = ("arch", "width", "depth")


def _trunk_settings(cfg: Config) -> dict:
    """{field: value} of what defines `cfg`'s trunk beside its weights."""
    if cfg.model.arch in ("lstm", "gru"):
        return {**{f"model.{f}": getattr(cfg.model, f) for f in RNN_MODEL_FIELDS},
                **{f"rnn.{f}": getattr(cfg.rnn, f) for f in RNN_TRUNK_FIELDS}}
    out = {f"model.{f}": getattr(cfg.model, f) for f in TRUNK_FIELDS}
    # as the model resolves them (0: width / num_heads, num_heads, D / 2), so a run giving a
    # head layout explicitly reads the trunk of one that left it at 0 (a review, r3: refused)
    out.update({"model.head_dim": cfg.model.dims_per_head(),
                "model.num_kv_heads": cfg.model.kv_heads(),
                "model.kv_latent_rope_dim": cfg.model.latent_rope_dims()})
    moe = cfg.model.moe  # (off: its expert count alone, the other fields read by nothing)
    out.update({f"model.moe.{f.name}": getattr(moe, f.name) for f in dataclasses.fields(moe)
                if f.name not in MOE_NOT_TRUNK and (moe.enabled() or f.name == "num_experts")})
    # without the variant's layout options (chunk sizes, recomputation), which a resume may
    # change (a review, session 118: performer's recompute refused a trunk transfer)
    from hpnlp.train.checkpoint import _attention_layout
    layout = _attention_layout(cfg.attention.name)
    out.update({"attention.name": cfg.attention.name,
                "attention.options": {k: v for k, v in cfg.attention.options.items()
                                      if k not in layout}})
    return out


def conversion(cfg: Config, source: Config, workdir: str, my_sha256: str | None = None,
               my_text: str | None = None):
    """The trunk transfer from the run in `workdir` (trained with `source`) into `cfg`'s run
    (whose subword model's sha256, `my_sha256`, and training text's digest, `my_text`
    (data.task_text_digest), are compared with that run's), a
    compress.gqa.Conversion; None for `train.init_params='all'` (the run restores whole, or
    through another conversion). A run of another kind of task under 'all' is refused here,
    naming 'trunk'."""
    from hpnlp import data as data_lib
    from hpnlp.compress.gqa import Conversion, refuse_factorized
    mine, theirs = cfg.model.kind, source.model.kind
    trunk = cfg.train.init_params == "trunk"
    if not trunk and mine != theirs:
        raise config_error("train.init_from", workdir, f"that run is a model.kind={theirs!r} "
                           f"run (data.task={source.data.task!r}) and this one a {mine!r} "
                           "run, so its head cannot start this one's; set "
                           "train.init_params='trunk' to start from its embedding and trunk")
    if not (data_lib.byte_ids(cfg.data) and data_lib.byte_ids(source.data)):
        # whole runs too (a bug hunt, session 96: another subword model of the same size was
        # read, every embedding row then standing for another piece; session 102: this run's
        # own, of an edited data.train_path, was not read, and one of other pieces passed;
        # review r3: words of an edited file, compared by its path)
        why = data_lib.different_encoding(cfg.data, source.data, workdir, my_sha256, my_text)
        if why:
            field, value = ("train.init_params", "trunk") if trunk else ("train.init_from",
                                                                          workdir)
            raise config_error(field, value, f"the run train.init_from={workdir} was trained "
                               f"with {why}, so its embedding reads other token ids than this "
                               "run's; start from a run of the same ids (any two byte-level "
                               "tasks share theirs)")
    if not trunk:
        return None
    refuse_factorized(source.model, cfg.model, workdir, made="a trunk transfer copies dense "
                      "weights", first="fine-tune from the trunk")
    theirs, mine = _trunk_settings(source), _trunk_settings(cfg)
    # the fields both trunks have: an LSTM's against a Transformer's differ in model.arch
    differ = [k for k in mine if k in theirs and mine[k] != theirs[k]]
    if {cfg.attention.name, source.attention.name} <= EXACT_ATTENTION:
        # one function of the arrays whichever computes it, as a resume may switch (a review,
        # r4: a dense LM's trunk was refused under `chunked`, or other block sizes)
        differ = [k for k in differ if not k.startswith("attention.")]
    if differ:
        shown = "; ".join(f"{k}={mine[k]!r} (that run: {theirs[k]!r})" for k in differ[:4])
        raise config_error("train.init_params", "trunk", f"this run reads the trunk of the run "
                           f"train.init_from={workdir} as that run computed it, and has "
                           f"{shown}; set {', '.join(differ)} to that run's")
    return Conversion(source, lambda p, stats, fresh, key: keep_trunk(p, fresh),
                      check=lambda src, fresh: check(src, fresh, workdir))


def _trunk(params) -> dict:
    return {k: v for k, v in traverse.flatten_dict(params).items() if k[0] in KEPT}


def check(source, fresh, workdir: str) -> None:
    """Refuse (naming `train.init_from`) where the trunk of `source` (that run's parameters,
    shapes suffice) cannot start `fresh` (this run's): arrays on one side only, or of other
    shapes, the position table's length apart."""
    src, mine = _trunk(source), _trunk(fresh)
    diff = sorted(set(src) ^ set(mine)) + sorted(
        k for k in set(src) & set(mine) if tuple(src[k].shape) != tuple(mine[k].shape)
        and not (k == POSITIONS and src[k].shape[1:] == mine[k].shape[1:]))
    if diff:
        shape = lambda t, k: tuple(t[k].shape) if k in t else None  # noqa: E731
        shown = "; ".join(f"{'/'.join(k)}: that run {shape(src, k)}, this run {shape(mine, k)}"
                          for k in diff[:4])
        raise config_error("train.init_from", workdir, f"train.init_params='trunk' starts this "
                           f"run from that run's embedding and trunk, and {len(diff)} of their "
                           f"arrays differ ({shown}); give this run that run's vocabulary and "
                           "model fields")


def keep_trunk(source, fresh):
    """`fresh` (this run's initial parameters) with the arrays of `source`'s embedding and
    trunk; a position table of another length copied over the rows both have."""
    out, src = traverse.flatten_dict(fresh), traverse.flatten_dict(source)
    for k, v in out.items():
        if k[0] not in KEPT:
            continue
        s = jnp.asarray(src[k], v.dtype)
        if s.shape != v.shape:  # the position table (`check`): the rows both have
            n = min(s.shape[0], v.shape[0])
            s = v.at[:n].set(s[:n])
        out[k] = s
    return traverse.unflatten_dict(out)
