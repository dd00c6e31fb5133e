"""`validate`: every check of a `Config` against the task and the devices, run before
anything is compiled, so a bad field fails in a second with a message that names the field,
the bad value and what is allowed (`hpnlp.config.config_error`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import math
import os
from typing import Any, Mapping

from hpnlp.config.compress_checks import (_check_compress, _check_lowrank, _check_quant,
                                          _refuse_unread)
from hpnlp.config.fields import (DEFAULT_RULES, DTYPES, ENCODER_LOSSES, MEMORY_PREDICTIONS,
                                 MESH_AXES, MOE_ROUTERS, REMAT_NAMES, Config, ConfigError,
                                 DataConfig, ModelConfig, MoEConfig, OutputConfig, TrainConfig,
                                 _check_choice, _check_positive, _fail, config_flag,
                                 same_data_path)


# What the model gives an output layer itself: not options (found in review: accepted, then
# overwritten when the layer was built), with the field that sets each
_MODEL_SET_OUTPUT = {k: f"is set by the model from {v}; set that instead" for k, v in {
    "vocab_size": "model.vocab_size", "embed": "output.tie_embeddings",
    "counts": "the task's token counts", "dtype": "model.dtype",
    "param_dtype": "model.param_dtype", "quant": "the quant group"}.items()}


def check_options(field: str, options: Mapping[str, Any], cls: type,
                  model_set: Mapping[str, str] | None = None) -> None:
    """Options must be constructor fields of the registered module class, of their default's
    kind where it is a bool, an int, a float, a list or a string (found in review: 'false' from
    the command line was a string, so true, and 'abc' failed deep inside the loss). The
    softmax bench's `--set` uses the same check. `model_set`: {option: why it is refused} of
    the options the caller sets itself (default: the model's, for output.options)."""
    params = inspect.signature(cls).parameters
    if model_set is None:
        model_set = _MODEL_SET_OUTPUT if field == "output.options" else {}
    allowed = sorted(p for p in params if p not in ("parent", "name") and p not in model_set)
    for key, value in options.items():
        if key in model_set:
            _fail(f"{field}.{key}", value, model_set[key])
        if key not in params or key in ("parent", "name"):
            _fail(f"{field}.{key}", value,
                  f"unknown option for {cls.__name__}; it takes {allowed}")
        default = params[key].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                _fail(f"{field}.{key}", value, "must be True or False")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(f"{field}.{key}", value, "must be an integer")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(f"{field}.{key}", value, "must be a number")
        elif isinstance(default, (tuple, list)):
            if not isinstance(value, (tuple, list)):
                _fail(f"{field}.{key}", value, "must be a list")
        elif isinstance(default, str):
            if not isinstance(value, str):
                _fail(f"{field}.{key}", value, "must be a string")


def _check_remat(remat: Any) -> None:
    if isinstance(remat, str) and remat.startswith("names:"):
        names = [n.strip() for n in remat[len("names:"):].split(",")]
        bad = [n for n in names if n not in REMAT_NAMES]
        if bad:
            _fail("model.remat", remat, f"unknown activation name(s) {bad}; after 'names:' list "
                  f"comma-separated names from {list(REMAT_NAMES)}")
        return
    _check_choice("model.remat", remat, ("none", "full", "dots_saveable", "elementwise",
                                         "names:<a>,<b>"))


# The compressed memory's fields besides its size (model.comp_mem_len), read only where it is on
COMPRESSIVE_FIELDS = ("comp_rate", "comp_fn", "comp_loss_weight")


def xl_on_pack(m) -> str:
    """The fix that moves a Transformer-XL model `m` (a ModelConfig) off stream batches:
    data.batching='pack' with its memory's fields back to their defaults, which 'pack' refuses
    otherwise (mem_len 0: the segment's length; a re-read, session 111; each message that
    said 'pack' alone led to the mem_len refusal, and back: a review, session 115)."""
    drop = ", ".join(
        (["model.mem_len=0"] if m.mem_len else [])
        + (["model.comp_mem_len=0"] if m.comp_mem_len else [])
        + [f"model.{k}={getattr(ModelConfig, k)!r}" for k in COMPRESSIVE_FIELDS
           if m.comp_mem_len and getattr(m, k) != getattr(ModelConfig, k)])
    return ("use data.batching='pack'" + (f" with {drop}" if drop else "")
            + ", where it carries no memory")


def _check_compressive(cfg: Config) -> None:
    """`model.comp_*`: the Compressive Transformer's memory (models/transformer_xl.py)."""
    m, d = cfg.model, cfg.data
    if not isinstance(m.comp_mem_len, int) or m.comp_mem_len < 0:
        _fail("model.comp_mem_len", m.comp_mem_len, "must be an integer >= 0 (0: no compressed memory)")
    if not isinstance(m.comp_rate, int) or m.comp_rate < 1:
        _fail("model.comp_rate", m.comp_rate, "must be an integer >= 1 (positions per compressed slot)")
    _check_choice("model.comp_fn", m.comp_fn, ("pool", "conv"))
    _check_positive("model.comp_loss_weight", m.comp_loss_weight, allow_zero=True)
    if not m.comp_mem_len:
        for name in COMPRESSIVE_FIELDS:  # a bug hunt: ignored
            if getattr(m, name) != getattr(ModelConfig, name):  # a bug hunt: "drop it" from
                # an experiment that sets it cannot be done on the command line
                _fail(f"model.{name}", getattr(m, name), "sets the compressed memory, and "
                      f"model.comp_mem_len=0 has none; set it back to its default "
                      f"(--config.model.{name}={getattr(ModelConfig, name)}), or set "
                      "model.comp_mem_len")
        return
    if m.arch != "transformer_xl":
        _fail("model.comp_mem_len", m.comp_mem_len, f"the compressed memory extends Transformer-XL's; "
              f"set model.arch='transformer_xl' (got {m.arch!r}) or model.comp_mem_len=0")
    if d.batching != "stream":
        _fail("data.batching", d.batching, "the compressed memory is carried from batch to batch; "
              "set data.batching='stream' (or model.comp_mem_len=0)")
    mem = m.mem_len or d.seq_len
    for name, n in (("data.seq_len", d.seq_len), ("model.mem_len", mem)):
        if n % m.comp_rate:
            _fail("model.comp_rate", m.comp_rate, f"must divide {name}={n} (each segment compresses "
                  "the positions it pushes out of the memory in whole groups); pick a divisor")


def _check_encoder(cfg: Config) -> None:
    """`model.encoder` (the bi-encoder, hpnlp.models.bi_encoder)."""
    e, m = cfg.model.encoder, cfg.model
    if m.kind != "bi_encoder":
        _refuse_unread("model.encoder", e, f"model.kind={m.kind!r} has no bi-encoder (whose "
                       "loss, bag and mined negatives these set)", "set model.kind='bi_encoder'")
        return
    _check_choice("model.encoder.loss", e.loss, ENCODER_LOSSES)
    if cfg.train.grad_accum != 1:  # a bug hunt (session 101): batch 16 in 4 microbatches
        # scored each pair against 3 others, not 15 (loss 45.0 against 22.7), unsaid
        _fail("train.grad_accum", cfg.train.grad_accum, "the bi-encoder scores each pair "
              "against the batch's other pairs (in-batch negatives; the triplet loss too, "
              "where none is mined), and a microbatch holds 1/train.grad_accum of them, so "
              "the step would not be one big batch's; set train.grad_accum=1")
    _check_choice("model.encoder.bag", e.bag, ("mean", "sum"))
    _check_positive("model.encoder.temperature", e.temperature)
    _check_positive("model.encoder.margin", e.margin, allow_zero=True)
    for name in ("mine_every", "mine_depth"):
        if not isinstance(getattr(e, name), int) or getattr(e, name) < (name == "mine_depth"):
            _fail(f"model.encoder.{name}", getattr(e, name),
                  "must be an integer >= " + ("1" if name == "mine_depth" else "0 (0: no mining)"))
    if e.mine_depth > 1024:
        _fail("model.encoder.mine_depth", e.mine_depth, "must be <= 1024 (the negative is drawn "
              "from this many nearest non-positives; deeper draws are nearly random)")
    if m.arch != "bag":  # models/bi_encoder.py reads each only where said
        _refuse_unread("model.encoder", e, f"it pools a model.arch='bag' encoder, and "
                       f"model.arch={m.arch!r} pools by model.pool", "set model.arch='bag'",
                       names=("bag",))
    other = "triplet" if e.loss == "in_batch" else "in_batch"
    _refuse_unread("model.encoder", e, f"it is the {other} loss's, and model.encoder.loss="
                   f"{e.loss!r} trains with the other", f"set model.encoder.loss={other!r}",
                   names=("margin",) if e.loss == "in_batch" else ("temperature", "symmetric"))
    if not e.mine_every:
        _refuse_unread("model.encoder", e, "it sets the mining of hard negatives, and "
                       "model.encoder.mine_every=0 mines none", "set model.encoder.mine_every",
                       names=("mine_depth",))


def _check_memory(cfg: Config) -> None:
    """`model.memory` (hpnlp.retrieval.memory): fields, and what the memory combines with."""
    mm, m, t = cfg.model.memory, cfg.model, cfg.train
    if not isinstance(mm.size, int) or mm.size < 0:
        _fail("model.memory.size", mm.size, "must be an integer >= 0 (0: no memory)")
    if not mm.size:
        _refuse_unread("model.memory", mm, "model.memory.size=0 has no key-value memory",
                       "set model.memory.size (slots)", but=("size",))
        return
    if m.kind != "classifier":
        _fail("model.memory.size", mm.size, f"the key-value memory answers with a class label, for "
              f"model.kind='classifier' (this run has {m.kind!r}); set model.memory.size=0")
    if not isinstance(mm.key_dim, int) or mm.key_dim < 1:
        _fail("model.memory.key_dim", mm.key_dim, "must be an integer >= 1")
    if not isinstance(mm.k, int) or not 1 <= mm.k <= mm.size:
        _fail("model.memory.k", mm.k, f"must be an integer in [1, model.memory.size={mm.size}]")
    _check_positive("model.memory.margin", mm.margin, allow_zero=True)
    _check_positive("model.memory.loss_weight", mm.loss_weight, allow_zero=True)
    _check_choice("model.memory.predict", mm.predict, MEMORY_PREDICTIONS)
    if t.grad_accum != 1:
        _fail("train.grad_accum", t.grad_accum, "the key-value memory is updated from each step's "
              "whole batch, which microbatches would drop; set train.grad_accum=1 (or "
              "model.memory.size=0)")
    if t.distill.teacher:
        _fail("train.distill.teacher", t.distill.teacher, "distillation and the key-value memory "
              "both replace the model's loss; set model.memory.size=0 or train.distill.teacher=''")


def check_moe_fields(c: MoEConfig) -> None:
    """`model.moe`'s own fields (num_experts >= 1), checked by `validate` and by an MoE layer
    built directly (`hpnlp.moe.MoE`), so both refuse a bad field in the same one line."""
    if not isinstance(c.num_experts, int) or c.num_experts < 1:
        _fail("model.moe.num_experts", c.num_experts, "an MoE layer needs an integer >= 1 "
              "(0 turns MoE off in a model's config)")
    X = c.num_experts
    _check_choice("model.moe.router", c.router, MOE_ROUTERS)
    _check_choice("model.moe.dispatch", c.dispatch, ("capacity", "dropless"))
    for name in ("every", "top_k"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
            _fail(f"model.moe.{name}", getattr(c, name), "must be an integer >= 1")
    for name in ("mlp_dim", "shared_experts", "groups", "block_size"):
        if not isinstance(getattr(c, name), int) or getattr(c, name) < 0:
            _fail(f"model.moe.{name}", getattr(c, name), "must be an integer >= 0")
    if c.top_k > X:
        _fail("model.moe.top_k", c.top_k, f"a token cannot choose more than the "
              f"model.moe.num_experts={X} experts; lower top_k or add experts")
    if c.router == "switch" and c.top_k != 1:
        _fail("model.moe.router", c.router, f"Switch routing is top-1 (model.moe.top_k="
              f"{c.top_k}); use router='top_k' for k >= 2")
    if c.router == "top_k" and c.top_k == 1:
        _fail("model.moe.router", c.router, "top_k gates are a softmax over the chosen logits, "
              "which is 1 for a single choice (the router would learn nothing); use "
              "router='switch' for top-1")
    if c.router == "expert_choice" and c.dispatch != "capacity":
        _fail("model.moe.dispatch", c.dispatch, "expert-choice routing fills each expert's "
              "capacity by construction; use dispatch='capacity'")
    if c.noisy and c.router == "expert_choice":
        _fail("model.moe.noisy", True, "noisy gating is for token-choice routers (top_k, switch)")
    for name in ("capacity_factor", "eval_capacity_factor"):
        v = getattr(c, name)
        # a bug hunt: inf and nan passed, then failed converting the slots to an integer
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            _fail(f"model.moe.{name}", v, "must be a finite number > 0 (slots per expert = "
                  "factor x tokens x top_k / experts); use model.moe.dispatch='dropless' for "
                  "no capacity limit")
    _check_positive("model.moe.balance_loss", c.balance_loss, allow_zero=True)
    _check_positive("model.moe.z_loss", c.z_loss, allow_zero=True)


def _check_moe(cfg: Config) -> None:
    """`model.moe`: fields, and what MoE combines with (hpnlp.moe), as far as none of it
    depends on the devices (the mesh's expert axis and the batch's groups: `_check_moe_mesh`).
    A bug hunt (session 100): all of it came after the devices' checks, so a process of a
    multi-process run waited for the others to join before it refused a bad field."""
    c, m = cfg.model.moe, cfg.model
    if not isinstance(c.num_experts, int) or c.num_experts < 0:
        _fail("model.moe.num_experts", c.num_experts, "must be an integer >= 0 (0: no MoE)")
    if not c.enabled():
        default = MoEConfig()
        for f in dataclasses.fields(c):  # a field set without experts would be ignored
            if f.name != "num_experts" and getattr(c, f.name) != getattr(default, f.name):
                _fail(f"model.moe.{f.name}", getattr(c, f.name), "is ignored while "
                      "model.moe.num_experts=0 (no MoE: every block keeps its dense MLP); set "
                      "num_experts > 0 to use it, or leave it at its default "
                      f"{getattr(default, f.name)!r}")
        return
    check_moe_fields(c)
    default = MoEConfig()
    ignored = []
    if c.router == "expert_choice" or m.kind != "lm":
        # a review (session 114): a token-choice LM of capacity dispatch decodes through
        # dropless blocks (MoE.decode), which block_size sizes: it was refused as ignored
        ignored = [("block_size", "it sizes dropless dispatch's blocks (and a token-choice "
                    "LM's decoding), and dispatch='capacity'")]
    if c.dispatch == "dropless":
        ignored = [(f, "dropless dispatch gives every token its experts, with no capacity")
                   for f in ("capacity_factor", "eval_capacity_factor")]
    if c.router == "expert_choice":
        ignored.append(("balance_loss", "expert-choice routing balances the experts' loads by "
                        "construction (each takes its capacity)"))
        # its eval_capacity_factor, which it no longer reads, is refused for a new run only
        # (`check_new_run`): a run saved while the field was read still validates
    for f, why in ignored:
        if getattr(c, f) != getattr(default, f):
            _fail(f"model.moe.{f}", getattr(c, f), f"is ignored: {why}; leave it at its default "
                  f"{getattr(default, f)!r}")
    X = c.num_experts
    if m.arch != "transformer":
        has = ("has no MLPs" if m.arch in RECURRENT_ARCHS else "does not route its blocks' "
               "MLPs to experts yet")  # a bug hunt (session 95): Transformer-XL's has MLPs
        _fail("model.moe.num_experts", X, f"MoE replaces the MLPs of model.arch='transformer' "
              f"blocks; model.arch={m.arch!r} {has} (use model.arch='transformer' or "
              "num_experts=0)")
    if c.every > m.depth:
        _fail("model.moe.every", c.every, f"no block of model.depth={m.depth} would be MoE; "
              f"choose every <= {m.depth}")
    for field, value, on, why in (
            ("model.reversible", True, m.reversible, "reversible blocks recompute themselves "
             "in a custom backward pass that cannot report the router's losses"),
            ("quant.act_scale", "static", m.quant.act_scale == "static" and
             m.quant.activations != "none" and m.quant.applies("mlp"), "the experts read their "
             "inputs quantized per token (dynamic), not by calibrated ranges; use "
             "quant.act_scale='dynamic' or leave 'mlp' out of quant.layers")):
        if on:
            _fail(field, value, f"cannot be combined with model.moe: {why}")
    q = m.quant
    if q.group_size and q.applies("mlp") and c.expert_dim(m) % q.group_size:
        _fail("quant.group_size", q.group_size, f"must divide the experts' width "
              f"{c.expert_dim(m)} (int4 groups split their second product's contraction)")
    if m.stack_layers and c.every != 1:
        _fail("model.moe.every", c.every, "stacked layers (model.stack_layers=True) are one "
              "block repeated; use every=1 or model.stack_layers=False")


def _check_moe_mesh(cfg: Config, sizes: Mapping[str, int]) -> None:
    """`model.moe` on the mesh: its expert axis, pipeline stages, the routing groups."""
    c, t, d = cfg.model.moe, cfg.train, cfg.data
    if not c.enabled():
        if sizes["expert"] > 1 and cfg.mesh.mesh_axes_of("batch").count("expert") == 0:
            _fail("mesh.expert", sizes["expert"], "without model.moe the expert axis only splits "
                  "the batch, and mesh.rules.batch does not name it; add 'expert' to "
                  "mesh.rules.batch or set mesh.expert=1")
        return
    if sizes["pipeline"] > 1:
        _fail("mesh.pipeline", sizes["pipeline"], "cannot be combined with model.moe: pipeline "
              "stages apply their layers functionally and cannot report the router's losses")
    X = c.num_experts
    ep = sizes["expert"]
    if X % ep:
        _fail("model.moe.num_experts", X, f"must be divisible by mesh.expert={ep} (each "
              f"device holds num_experts / mesh.expert experts)")
    batch_axes = cfg.mesh.mesh_axes_of("batch")
    shards = math.prod(sizes[a] for a in batch_axes)
    if ep > 1:
        import jax
        if cfg.model.dtype == "bfloat16" and jax.default_backend() == "cpu":
            # found by the crash hunt (session 110): the train step's compile aborted the
            # process (jaxlib 0.10.2's AllReducePromotion, "Invalid binary instruction opcode
            # copy", the defect hpnlp.parallel.pipeline works around); float16 compiles
            _fail("model.dtype", "bfloat16", f"with expert parallelism (mesh.expert={ep}) "
                  "aborts XLA:CPU's compiler (jaxlib 0.10.2: AllReducePromotion, \"Invalid "
                  "binary instruction opcode copy\"); on CPU set model.dtype='float32' or "
                  "'float16', or mesh.expert=1")
        if "expert" not in batch_axes:
            _fail("mesh.rules.batch", cfg.mesh.rules.get("batch"), "expert parallelism sends "
                  "each device's own tokens to the experts' devices, so the batch must be split "
                  "over the expert axis too: add 'expert' to mesh.rules.batch")
        if c.dispatch != "capacity":
            _fail("model.moe.dispatch", c.dispatch, f"expert parallelism (mesh.expert={ep}) moves "
                  "fixed-size capacity buffers with all-to-all; use dispatch='capacity'")
        if sizes["sequence"] > 1:
            _fail("mesh.sequence", sizes["sequence"], "expert parallelism routes whole rows; "
                  "set mesh.sequence=1 with mesh.expert > 1")
    if c.dispatch != "capacity":  # review r1: dropless routes are the same in any groups, and
        # the layer pads rows they do not split (a new run is refused a non-zero groups:
        # `_check_unread_of_new_run`; train/loop.py's _reader_split reads none either)
        return
    groups = c.groups or shards
    rows = {"train.batch_size / train.grad_accum": t.batch_size // t.grad_accum,
            "data.eval_batch_size (or train.batch_size)": d.eval_batch_size or t.batch_size}
    for field, n in rows.items():
        if n % groups:
            _fail("model.moe.groups", c.groups, f"{groups} routing groups must divide the rows the "
                  f"model sees per step, {field} = {n}")
    if shards > 1 and c.dispatch == "capacity" and groups % shards:
        _fail("model.moe.groups", c.groups, f"must be a multiple of the {shards} data-parallel "
              "shards (each device routes whole groups)")


def _check_kv_cache(cfg: Config) -> None:
    from hpnlp import attention  # the registry; imported late to avoid cycles

    m, q = cfg.model, cfg.model.quant
    _check_choice("quant.kv_cache", q.kv_cache, ("none", "int8"))
    if q.kv_cache == "none":
        return
    if m.kind != "lm" or m.arch != "transformer":
        _fail("quant.kv_cache", q.kv_cache, f"is the key/value cache a Transformer LM decodes "
              f"through (model.kind='lm', model.arch='transformer'); this is kind={m.kind!r}, "
              f"arch={m.arch!r}; set quant.kv_cache='none'")
    if not attention.get(cfg.attention.name).exact_cache():
        _fail("quant.kv_cache", q.kv_cache, f"attention.name={cfg.attention.name!r} decodes "
              "through a cache of its own, not the exact key/value cache that int8 codes "
              "replace; use a variant that keeps it (e.g. dense or chunked) or "
              "quant.kv_cache='none'")


def _check_kv_heads(m: ModelConfig) -> None:
    G = m.num_kv_heads
    if not isinstance(G, int) or isinstance(G, bool) or G < 0:
        _fail("model.num_kv_heads", G, "must be an integer >= 0 (0: model.num_heads, multi-head)")
    if G and (G > m.num_heads or m.num_heads % G):
        _fail("model.num_kv_heads", G, f"must divide model.num_heads={m.num_heads} (each key/value "
              "head serves the same number of query heads); 1 is multi-query attention")
    if m.kv_heads() < m.num_heads and m.arch != "transformer":
        _fail("model.num_kv_heads", G, f"grouped key/value heads are the Transformer's "
              f"(model.arch='transformer'); model.arch={m.arch!r} has its own attention or none; "
              "set model.num_kv_heads=0")


def _check_kv_latent(cfg: Config) -> None:
    m = cfg.model
    C, R = m.kv_latent_dim, m.kv_latent_rope_dim
    for name, v in (("model.kv_latent_dim", C), ("model.kv_latent_rope_dim", R)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            _fail(name, v, "must be an integer >= 0 (0: off)")
    if R and not C:
        _fail("model.kv_latent_rope_dim", R, "sizes the rotary part of multi-head latent "
              "attention's keys; set model.kv_latent_dim too, or leave it 0")
    if not isinstance(m.kv_latent_norm, bool):
        _fail("model.kv_latent_norm", m.kv_latent_norm, "must be true or false")
    if not m.kv_latent_norm and not C:
        _fail("model.kv_latent_norm", False, "switches off the latent's layer norm in multi-head "
              "latent attention; set model.kv_latent_dim too, or leave it true")
    if not C:
        return
    if m.arch != "transformer":
        _fail("model.kv_latent_dim", C, f"multi-head latent attention is the Transformer's "
              f"(model.arch='transformer'); model.arch={m.arch!r} has its own attention or none; "
              "set model.kv_latent_dim=0")
    if m.kv_heads() < m.num_heads:
        _fail("model.kv_latent_dim", C, f"the latent replaces grouped key/value heads "
              f"(model.num_kv_heads={m.num_kv_heads}): every head's keys and values come from "
              "it; set model.num_kv_heads=0 (or model.kv_latent_dim=0)")
    D = m.dims_per_head()
    if R and m.pos_emb != "rope":
        _fail("model.kv_latent_rope_dim", R, f"is the rotary part of each head, and "
              f"model.pos_emb={m.pos_emb!r} rotates nothing; set model.pos_emb='rope' or leave "
              "it 0")
    if m.pos_emb == "rope":
        R = m.latent_rope_dims()
        if R % 2 or not 0 < R < D:
            _fail("model.kv_latent_rope_dim" if m.kv_latent_rope_dim else "model.head_dim",
                  m.kv_latent_rope_dim or D, f"the rotary dims R={R} of each head must be even "
                  f"and below its {D} dims (the rest are the latent's); set "
                  "model.kv_latent_rope_dim to an even number below model.head_dim")


RECURRENT_ARCHS = ("lstm", "gru", "bag")  # model.arch values without attention

FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127  # float32's largest finite value, about 3.4028e38


def _check_not_transformer(cfg: Config) -> None:
    """An LSTM, a GRU or a bag of embeddings has no attention, heads, position embeddings or
    Transformer blocks: a setting of those other than its default would do nothing, so it is
    refused by name (a README walk: attention.name='lsh' trained an LSTM as if unset). The
    Transformer's sizes (num_heads, mlp_dim, max_len) are left alone: an experiment sets
    them for every arch it offers (experiments/encoder.py)."""
    m = cfg.model
    if m.arch not in RECURRENT_ARCHS:
        return
    for field, value, default in (("attention.name", cfg.attention.name, "dense"),
                                  ("attention.options", dict(cfg.attention.options), {}),
                                  ("model.pos_emb", m.pos_emb, "learned"),
                                  ("model.remat", m.remat, "none"),
                                  ("model.head_dim", m.head_dim, 0)):
        if value != default:
            _fail(field, value, f"model.arch={m.arch!r} has no attention, heads, position "
                  f"embeddings or Transformer blocks, so it would do nothing; leave it at its "
                  f"default ({default!r}), or use model.arch='transformer'")


def _check_buckets(d: DataConfig) -> None:
    """`data.seq_len`, `data.batching` and `data.bucket_boundaries`, before anything converts
    the boundaries (a bug hunt, session 99: hpnlp.data.batching's int() of each trained 32.5
    as 32 and True as 1, and failed on None or 'a,b' naming no field)."""
    _check_positive("data.seq_len", d.seq_len)
    _check_choice("data.batching", d.batching, ("pad", "bucket", "pack", "stream"))
    if d.batching != "bucket":
        _refuse_unread("data", d, f"they are the widths bucketing pads rows to, and "
                       f"data.batching={d.batching!r} does not bucket", "set "
                       "data.batching='bucket'", names=("bucket_boundaries",))
    bad = [b for b in d.bucket_boundaries
           if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= d.seq_len]
    if bad:
        _fail("data.bucket_boundaries", d.bucket_boundaries, f"every boundary must be an "
              f"integer in [1, data.seq_len={d.seq_len}] (not {bad}); give them as "
              f"--config.data.bucket_boundaries={max(d.seq_len // 2, 1)},{d.seq_len}, or "
              f"{config_flag('data.bucket_boundaries', '()')} for the default")


def _attention_blocked(cfg: Config, num_devices: int) -> tuple[str, Any, str, str] | None:
    """(option, portable value, why, fix) where attention.options name an implementation that
    cannot run on `num_devices` devices of this machine (the variant's `cannot_run_here`, given
    the compute dtype q, k and v are cast to)."""
    from hpnlp import attention
    if cfg.model.arch != "transformer" or cfg.attention.name not in attention.names():
        return None  # (Transformer-XL attends by its own relative attention)
    hook = getattr(attention.get(cfg.attention.name), "cannot_run_here", None)
    if hook is None:
        return None
    return hook(dict(cfg.attention.options), head_dim=cfg.model.dims_per_head(),
                num_devices=num_devices, dtype=cfg.model.dtype)


def portable_here(cfg: Config, num_devices: int) -> tuple[Config, list[str]]:
    """A saved run's `cfg` with each implementation that cannot run on `num_devices` devices
    of this machine replaced by its portable twin, which computes the same function (cuDNN's
    attention by XLA's, a fused kernel by `auto`), and a line saying so for each. A bug hunt
    (session 100): a GPU run's `implementation='cudnn'`, or a fused kernel's run read on a
    mesh of several devices, was refused by every reader, which has no flag to change it;
    `validate` still refuses them for a run it trains, where the user sets them."""
    notes = []
    blocked = _attention_blocked(cfg, num_devices)
    if blocked:
        option, portable, why, _ = blocked
        notes.append(f"attention.options.{option}={cfg.attention.options[option]!r} cannot "
                     f"run here ({why}); read with {portable!r}, the same function")
        # of the options' own type (a FrozenDict): a plain dict made the Config unhashable,
        # and the kNN-LM's and the bi-encoder's cached passes failed on it (a review, 116)
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(
            cfg.attention, options=type(cfg.attention.options)(
                {**cfg.attention.options, option: portable})))
    why = _rnn_blocked(cfg, num_devices)
    if why:
        notes.append(f"rnn.impl='fused': the kernel cannot run {why}; read with "
                     "rnn.impl='auto', the same function")
        cfg = dataclasses.replace(cfg, rnn=dataclasses.replace(cfg.rnn, impl="auto"))
    return cfg, notes


def _rnn_blocked(cfg: Config, num_devices: int) -> str | None:
    """Why the fused LSTM kernel that `cfg` asks for cannot run on `num_devices` devices of
    this machine, else None (what the config itself rules out is validate's, by field)."""
    if cfg.rnn.impl != "fused" or cfg.model.arch not in ("lstm", "gru"):
        return None
    if num_devices > 1:  # a bug hunt: the layer's error at init named its own field
        return f"on a mesh of {num_devices} devices (XLA cannot partition the kernel's call)"
    from hpnlp.rnn import fused  # a bug hunt (session 99): the layer's error, naming `impl`
    reason = fused.unavailable_reason()
    return reason and f"here: {reason}"


def _check_process_rows(mesh, sizes: dict, n: int, num_processes: int, real: bool) -> None:
    """Refuse a mesh whose batch shards do not split the processes evenly and in process
    order: process p reads rows [p B / P, (p + 1) B / P) of each global batch (the data
    iterator), and its devices must hold those rows. The devices lie in the mesh in
    row-major order as `parallel.mesh.make_mesh` lays jax.devices() out: each one's process
    read from JAX where `real` (this process's devices), else assumed in blocks of n / P (a
    count given to validate). A crash hunt (session 113): a reader's validate of
    mesh.pipeline=2 on 2 processes of 1 device accepted it, and the run was refused only
    by the Trainer's check of its shardings (`train.loop.check_process_rows`, which stays)."""
    if num_processes <= 1 or n % num_processes:
        return
    local = n // num_processes
    if real:  # (n is jax.device_count() there)
        import jax
        owner = [d.process_index for d in jax.devices()]
    else:
        owner = [i // local for i in range(n)]
    import itertools
    coords = list(itertools.product(*(range(sizes[a]) for a in MESH_AXES)))  # row-major
    batch_axes = mesh.mesh_axes_of("batch")
    shards = math.prod(sizes[a] for a in batch_axes)

    def fault(axes) -> tuple | None:
        """(process, shards held, shards read) of the first process whose differ, the
        batch split over `axes` (most significant first, as the sharding's spec)."""
        shard_of = []
        for c in coords:
            at, shard = dict(zip(MESH_AXES, c)), 0
            for a in axes:
                shard = shard * sizes[a] + at[a]
            shard_of.append(shard)
        for p in range(num_processes):
            held = {shard for shard, q in zip(shard_of, owner) if q == p}
            want = set(range(p * shards // num_processes, (p + 1) * shards // num_processes))
            if shards % num_processes or held != want:
                return p, held, want
        return None

    found = fault(batch_axes)
    if found is None:
        return
    p, held, want = found
    others = [a for a in MESH_AXES if a not in batch_axes and sizes[a] > 1]
    in_order = tuple(a for a in MESH_AXES if a in batch_axes)
    if in_order != tuple(batch_axes) and fault(in_order) is None:  # (a review: the order
        # of the rule's axes, not another axis, is what splits the batch out of order)
        _fail("mesh.rules.batch", mesh.rules.get("batch"), f"the batch would not split over "
              f"the {num_processes} processes in process order: name its axes in the mesh's "
              f"order, {','.join(in_order)}")
    field = f"mesh.{others[0]}" if others else "mesh.rules.batch"
    value = sizes[others[0]] if others else mesh.rules.get("batch")
    where = (f"the batch axes ({', '.join(batch_axes)}) cut each batch into {shards} "
             f"shard{'s' if shards > 1 else ''}, not a multiple of the processes"
             if shards % num_processes else
             f"process {p}'s devices would hold batch shards {sorted(held)} of "
             f"{shards}, and it reads shards {sorted(want)}")
    _fail(field, value, f"the batch would not split over the {num_processes} processes "
          f"({local} device{'s' if local > 1 else ''} each): {where}. Keep the mesh axes "
          "that mesh.rules.batch does not name" + (f" ({', '.join(others)})" if others else "")
          + " within one process, and the batch axes a multiple of the processes")


def _check_mesh_fields(cfg: Config) -> None:
    """The mesh's fields as far as they do not depend on the device count: axis sizes, one
    -1 at most, `mesh.rules`' names. A review (session 107): they came after the devices'
    checks, so a process of a multi-process run waited for the others to join (or for
    --init_timeout) before it named a misspelled rule."""
    mesh = cfg.mesh
    for name in MESH_AXES:
        v = getattr(mesh, name)
        if not isinstance(v, int) or v == 0 or v < -1:
            _fail(f"mesh.{name}", v, "must be a positive axis size or -1 (fill the rest)")
    filled = [a for a in MESH_AXES if getattr(mesh, a) == -1]
    if len(filled) > 1:
        _fail("mesh", {a: -1 for a in filled}, "at most one axis may be -1")
    for logical, axes in mesh.rules.items():
        if logical not in DEFAULT_RULES:
            _fail(f"mesh.rules.{logical}", axes,
                  f"unknown logical axis name; the models use {sorted(DEFAULT_RULES)}")
        named = mesh.axes_in(axes or None)
        for a in named:
            if a not in MESH_AXES:
                _fail(f"mesh.rules.{logical}", axes, f"{a!r} is not a mesh axis; use None "
                      f"(replicated) or names from {list(MESH_AXES)}")
        if len(set(named)) != len(named):
            _fail(f"mesh.rules.{logical}", axes, "names a mesh axis twice")


def check_master_weights(cfg: Config) -> None:
    """A new run's parameters are its master weights: float16 ones are refused by `validate`,
    bfloat16 ones here (review, session 107). bfloat16 keeps 8 significant bits, and optax
    rounds each updated parameter, and Adam's moments (kept in the parameters' dtype), back
    to it: a norm gain of 1.0 stayed exactly 1.0 through a run at lr 1e-3, and AdamW's decay
    (lr x weight_decay x w) is far below half a bfloat16 ulp. A run saved so before this rule
    still validates, resumes and is read (`compress shrink` of one writes a new run, and is
    refused here like it); a quantized copy's bfloat16 parameters are exported, not trained."""
    if cfg.model.param_dtype == "bfloat16":
        _fail("model.param_dtype", "bfloat16", "bfloat16 master weights round away every update "
              "below ~2^-8 of a weight (a LayerNorm gain of 1.0 never moves at train.lr=1e-3, "
              "and AdamW's weight decay never changes a weight); keep "
              "model.param_dtype='float32' and set model.dtype='bfloat16'")


def check_training(cfg: Config) -> None:
    """What a run that trains is refused (new or resumed), though a reader of its config
    takes it: quantized activations with `quant.act_scale='static'`, whose ranges only PTQ
    calibrates (else the first step's trace failed, after the data and the model were built),
    and clustered attention under pipeline stages.
    The Trainer calls it, and so does a process of a multi-process run before it joins."""
    if cfg.attention.name == "clustered" and cfg.mesh.pipeline != 1:  # (-1: every device)
        # a review (session 116): every stage runs its layers at each of the M + P - 1 ticks,
        # and the centroids' k-means gradient (clustered's backward tap) is added whatever
        # cotangent reaches it, so the bubble ticks' stale rows added theirs (a reader of a
        # run saved so evaluates as it did: training alone is refused)
        _fail("mesh.pipeline", cfg.mesh.pipeline, "pipeline stages cannot yet train clustered "
              "attention: its centroids' k-means update would count the pipeline's idle ticks "
              "too; set mesh.pipeline=1 (with mesh.fsdp or mesh.data for the devices)")
    q = cfg.model.quant
    if q.act_scale == "static" and q.activations in ("int8", "fp8"):
        _fail("quant.act_scale", "static", "a training run has no calibrated activation ranges "
              "(PTQ calibrates them: python -m hpnlp.compress quantize --act_scale static); "
              "train with quant.act_scale='dynamic'")


def eval_is_train(d: DataConfig) -> bool:
    """Whether data.eval_path names data.train_path's file (by another name too, where both
    exist; else the names are compared, and reading the missing one names it)."""
    if not (isinstance(d.train_path, str) and isinstance(d.eval_path, str)
            and d.train_path and d.eval_path):
        return False
    try:
        return os.path.samefile(d.train_path, d.eval_path)
    except OSError:
        return same_data_path(d.train_path, d.eval_path)


# What draws generated ListOps (hpnlp/data/listops.py); a train_path TSV reads none of them
LISTOPS_FIELDS = ("listops_num_train", "listops_num_eval", "listops_min_length",
                  "listops_max_length", "listops_max_depth", "listops_max_args")


def _unread_of_new_run(cfg: Config) -> dict[str, bool]:
    """Which of the fields a review (session 107, and review r1) found taken, recorded in
    config.json and read by nothing this config holds away from the default (or, the ring's
    axis, read wrongly): {field: set and unread}, for
    `_check_unread_of_new_run`'s refusals and `without_unread`'s clearing alike."""
    from hpnlp import data as data_lib
    m, d, r = cfg.model, cfg.data, cfg.rnn
    tokenizer = None
    if d.task in data_lib.LM_TASKS:
        from hpnlp.data.text_tasks import lm_tokenizer
        tokenizer = lm_tokenizer(d, d.task)
    from hpnlp.data.tokenizers import SUBWORD
    default, moe, a = DataConfig(), m.moe, cfg.attention
    ring = a.name == "ring"
    axis = a.options.get("axis", "sequence") if ring else "sequence"

    def alone(axis):  # the ring's axis of one device (mesh.<axis>=1; a -1 axis depends on the
        # devices): the layer runs as `chunked`, which reads neither option
        return ring and axis in MESH_AXES and getattr(cfg.mesh, axis) == 1

    wrong = ring and axis != "sequence" and axis in MESH_AXES and (
        alone(axis) or axis not in cfg.mesh.mesh_axes_of("length"))
    return {"data.vocab_size": tokenizer not in SUBWORD and d.vocab_size != default.vocab_size,
            # review r1: read by the words tokenizer and verse_book's word vocabulary only
            "data.word_vocab_size": (tokenizer != "words" and d.task != "verse_book"
                                     and d.word_vocab_size != default.word_vocab_size),
            # review r1: read by generated ListOps only (a train_path TSV reads none)
            "data.listops_*": ((d.task != "listops" or bool(d.train_path)) and any(
                getattr(d, f) != getattr(default, f) for f in LISTOPS_FIELDS)),
            # ('auto' picks per machine, so its unroll is read wherever the scan runs)
            "rnn.unroll": (r.impl == "fused" and m.arch in ("lstm", "gru")
                           and r.unroll != type(r)().unroll),
            # the task's count, which validate fills in and config.json keeps, is taken
            "model.num_classes": (m.kind == "bi_encoder" and m.num_classes not in (
                0, data_lib.task_info(d).get("num_classes", 0))),
            # review r1: dropless routes (and the router's losses, summed over the groups)
            # are the same in any groups; the layer pads rows they do not split
            "model.moe.groups": (moe.enabled() and moe.dispatch == "dropless"
                                 and moe.groups != MoEConfig().groups),
            # review r1: the ring over an axis the sequence is not split over gathered each
            # device's rows for its share of every sequence (or, of one device, ran chunked)
            "attention.options.axis": wrong,
            # (of the axis it is refused for: 'sequence', so one fix clears both)
            "attention.options.block": (alone("sequence" if wrong else axis)
                                        and a.options.get("block") is not None),
            # review r11: the reconstruction loss it weights trains the conv compressor
            # alone (every other input stop-gradient); pooling has no parameters, so the
            # weight scaled the logged loss_aux and trained nothing
            "model.comp_loss_weight": (bool(m.comp_mem_len) and m.comp_fn == "pool" and
                                       m.comp_loss_weight != ModelConfig().comp_loss_weight)}


def _check_unread_of_new_run(cfg: Config) -> None:
    """Refused to a new run only: a run saved with one trained as if it were unset, and a
    later review of that session found every reader of it refused (`validate` runs on each
    saved config.json) with no edit of the file that helped."""
    m, d = cfg.model, cfg.data
    unread = _unread_of_new_run(cfg)
    if unread["data.vocab_size"]:  # experiments/lm.py documents data.vocab_size as the size
        # to change, and a byte LM without data.tokenizer=bpe trained on 256 byte ids
        from hpnlp import data as data_lib
        if d.task not in data_lib.LM_TASKS:
            _refuse_unread("data", d, f"it sizes an LM task's bpe/unigram tokenizer, and "
                           f"data.task={d.task!r} has its own ids", "use data.task='byte_lm' "
                           "(or 'word_lm') with data.tokenizer='bpe'", names=("vocab_size",))
        from hpnlp.data.text_tasks import lm_tokenizer
        _refuse_unread("data", d, f"it sizes a bpe/unigram tokenizer, and this run's ids are "
                       f"{lm_tokenizer(d, d.task)} (data.tokenizer={d.tokenizer!r}, data.task="
                       f"{d.task!r})", "set data.tokenizer='bpe' (or 'unigram')",
                       names=("vocab_size",))
    if unread["rnn.unroll"]:
        _refuse_unread("rnn", cfg.rnn, "it unrolls the XLA scan, and the fused kernel (rnn.impl="
                       "'fused') runs none", "use rnn.impl='scan' (or 'auto')", names=("unroll",))
    if unread["model.num_classes"]:  # models/bi_encoder.py reads none
        _fail("model.num_classes", m.num_classes, "model.kind='bi_encoder' scores pairs of "
              "embeddings and has no classes, so nothing reads it; leave it at its default "
              "(--config.model.num_classes=0)")
    if unread["data.word_vocab_size"]:  # experiments/lm.py:bpe took it, and trained 8000 pieces
        from hpnlp import data as data_lib
        if d.task not in data_lib.LM_TASKS:
            _refuse_unread("data", d, f"it sizes the word vocabulary of data.tokenizer='words' "
                           f"and of data.task='verse_book', and data.task={d.task!r} has its "
                           "own ids", "use data.task='word_lm' (or 'verse_book')",
                           names=("word_vocab_size",))
        from hpnlp.data.text_tasks import lm_tokenizer
        _refuse_unread("data", d, f"it sizes the word vocabulary of data.tokenizer='words', and "
                       f"this run's ids are {lm_tokenizer(d, d.task)} (data.tokenizer="
                       f"{d.tokenizer!r}, data.task={d.task!r})", "set data.tokenizer='words' "
                       "(a bpe/unigram tokenizer's size is data.vocab_size)",
                       names=("word_vocab_size",))
    if unread["data.listops_*"]:
        # every one set at once, defaults first where a file is read (review d2: the
        # experiments/lra.py:listops,local preset sets three, so a user's TSV was refused three
        # times in turn, first told to drop the file it meant to train on)
        default = DataConfig()
        given = [f for f in LISTOPS_FIELDS if getattr(d, f) != getattr(default, f)]
        reset = " ".join(f"--config.data.{f}={getattr(default, f)}" for f in given)
        why, fix = ((f"it shapes the ListOps generated without data.train_path, and "
                     f"data.train_path={d.train_path!r} reads the expressions from a file",
                     "drop data.train_path (and data.eval_path) to generate them")
                    if d.task == "listops" else
                    (f"it shapes the generated ListOps of data.task='listops', and this run's "
                     f"data.task is {d.task!r}", "use data.task='listops'"))
        also = f" (nor {', '.join('data.' + f for f in given[1:])})" if given[1:] else ""
        them = "them at their defaults" if given[1:] else "it at its default"
        _fail(f"data.{given[0]}", getattr(d, given[0]), f"{why}, so nothing reads it{also}; "
              f"leave {them} ({reset}), or {fix}")
    if unread["model.moe.groups"]:
        _refuse_unread("model.moe", m.moe, "model.moe.dispatch='dropless' computes every "
                       "choice of every token: its routes, and the router's losses (summed over "
                       "the groups), are the same in any routing groups", "use "
                       "model.moe.dispatch='capacity', whose capacity binds per group",
                       names=("groups",))
    a, mesh = cfg.attention, cfg.mesh
    axis = a.options.get("axis", "sequence")
    if unread["attention.options.axis"]:
        length = mesh.mesh_axes_of("length")
        _fail("attention.options.axis", axis, f"the ring passes key/value blocks around the "
              f"mesh axis the sequence is split over ({list(length)}, mesh.rules.length), and "
              + (f"mesh.{axis}=1 has one device, so the layer runs as `chunked` and nothing "
                 "reads it" if axis in length else
                 f"over mesh.{axis} > 1, which splits no sequence, each device would gather "
                 "the others' rows (or heads) for its share of every sequence in every "
                 f"attention layer (at mesh.{axis}=1 the layer runs as `chunked`, reading "
                 "nothing)")
              + "; set it to 'sequence' (with mesh.sequence > 1 for sequence parallelism)")
    if unread["model.comp_loss_weight"]:
        _fail("model.comp_loss_weight", m.comp_loss_weight, "it weights the attention-"
              "reconstruction loss, which trains only a learned compressor, and model.comp_fn="
              "'pool' (mean pooling) has no parameters, so it would scale the logged loss_aux "
              "and train nothing; set model.comp_fn='conv', or leave it at its default "
              f"(--config.model.comp_loss_weight={ModelConfig().comp_loss_weight})")
    if unread["attention.options.block"]:
        axis = "sequence" if unread["attention.options.axis"] else axis
        _fail("attention.options.block", a.options["block"], f"it sizes the ring's tiles, and "
              f"mesh.{axis}=1 gives the ring one device, so the layer runs as `chunked` (which "
              f"chooses its own blocks) and nothing reads it; set mesh.{axis} > 1 for sequence "
              "parallelism, or leave it at its default (None)")


def without_unread(cfg: Config) -> Config:
    """`cfg` with the fields `_check_unread_of_new_run` refuses set back to their defaults:
    nothing reads them, so a run saved with one computes what this config does (`compress
    shrink` writes a new run of an older run's config: a re-read, session 107)."""
    unread = _unread_of_new_run(cfg)
    m, d, r, a = cfg.model, cfg.data, cfg.rnn, cfg.attention
    default = DataConfig()
    if unread["data.vocab_size"]:
        d = dataclasses.replace(d, vocab_size=default.vocab_size)
    if unread["data.word_vocab_size"]:
        d = dataclasses.replace(d, word_vocab_size=default.word_vocab_size)
    if unread["data.listops_*"]:
        d = dataclasses.replace(d, **{f: getattr(default, f) for f in LISTOPS_FIELDS})
    if unread["rnn.unroll"]:
        r = dataclasses.replace(r, unroll=type(r)().unroll)
    if unread["model.num_classes"]:
        m = dataclasses.replace(m, num_classes=ModelConfig().num_classes)
    if unread["model.moe.groups"]:
        m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, groups=MoEConfig().groups))
    if unread["model.comp_loss_weight"]:  # (the pooled memory's loss_aux, logged, moves)
        m = dataclasses.replace(m, comp_loss_weight=ModelConfig().comp_loss_weight)
    if m.moe.enabled() and m.moe.router == "expert_choice":  # `check_new_run` refuses its
        # eval_capacity_factor, read by nothing since review r4 (session 105; fixer fA's
        # note: a saved run that took it, as the workaround then, was refused by shrink)
        m = dataclasses.replace(m, moe=dataclasses.replace(
            m.moe, eval_capacity_factor=MoEConfig().eval_capacity_factor))
    cleared = {k for k in ("axis", "block") if unread[f"attention.options.{k}"]}
    if cleared:  # (a ring over another axis computes what it does over none: the same values)
        a = dataclasses.replace(a, options=type(a.options)(
            {k: v for k, v in a.options.items() if k not in cleared}))
    return dataclasses.replace(cfg, model=m, data=d, rnn=r, attention=a)


_SAVED_DATA = contextvars.ContextVar("saved_data", default=False)  # set by `of_saved_data`


@contextlib.contextmanager
def of_saved_data():
    """Within it, `check_new_run` leaves out its rules of how generated ListOps is drawn: for
    a new run of a saved run's data fields, `shrink`'s output, whose config that command
    writes (it takes none) and whose other data fields would draw other examples than the
    pruned run trained on (a review, d1: a run saved before the rules could not be shrunk)."""
    token = _SAVED_DATA.set(True)
    try:
        yield
    finally:
        _SAVED_DATA.reset(token)


def packs_block_aligned(cfg: Config) -> bool:
    """Whether `cfg` packs documents into rows (data.batching='pack') under Transformer
    attention whose blocks start at each row's first column (`Attention.block_aligned`)."""
    from hpnlp import attention
    return (cfg.data.batching == "pack" and cfg.model.arch == "transformer"
            and attention.get(cfg.attention.name).block_aligned(cfg.attention.options))


def check_new_run(cfg: Config) -> None:
    """What a run that has saved no checkpoint is refused, though `validate` takes it in a
    saved config.json (a run trained before the rule is still read and resumed): early
    stopping that can never stop before the last step (review, session 104: eval_every >=
    train.steps was taken, its one eval setting the best), a run of one step with a warmup
    (its one step applies the warmup's rate 0), generated ListOps longer than data.seq_len
    (cut, with the whole expression's label) or of a negative data.seed (`of_saved_data`
    leaves these two out), `clustered` attention in float16, an expert-choice
    eval_capacity_factor, `model.embed_grad_scale='batch'` under train.grad_accum (below),
    an eval file that is the train file (`eval_is_train`), a bi-encoder's mining that no step
    runs (model.encoder.mine_every >= train.steps), packed rows under attention whose blocks
    start at each row's first column (`Attention.block_aligned`), bfloat16 master weights
    (`check_master_weights`), fields nothing reads (`_check_unread_of_new_run`), and
    `compress_checks.check_new_compress_run`'s."""
    t, moe = cfg.train, cfg.model.moe
    check_master_weights(cfg)
    if cfg.model.kind == "dual_encoder":  # (a saved one is still read)
        from hpnlp import data as data_lib
        if data_lib.task_info(cfg.data).get("positives_only"):
            _fail("model.kind", cfg.model.kind, f"data.task={cfg.data.task!r} holds positive "
                  "pairs only (every label 'same'), so a dual encoder's classifier of them "
                  "learns a constant; use model.kind='bi_encoder' (the batch's other pairs its "
                  "negatives)")
    _check_unread_of_new_run(cfg)
    if t.steps == 1 and t.warmup_steps >= 1:
        # a review (r12, session 108): the step at optimizer count c applies schedule(c), and
        # a warmup's rate at count 0 is 0, so a run of one step with a warmup ('constant'
        # takes warmup_steps == train.steps) left its parameters as they were and wrote a
        # summary as if it had trained; a saved run's config.json still validates
        _fail("train.warmup_steps", t.warmup_steps, "with train.steps=1 the warmup's first "
              "rate, 0, is the only one a step applies, so the run would train nothing; set "
              "train.warmup_steps=0, or raise train.steps")
    d = cfg.data
    generated = d.task == "listops" and not d.train_path and not _SAVED_DATA.get()
    if generated and d.listops_max_length > d.seq_len:
        # review r2: taken with a warning (kept for a user's TSV, which LRA cuts too), and
        # `--config.data.seq_len=256` on experiments/lra.py:listops (which pairs the two at
        # 512) cut half the expressions mid-tree, each keeping its whole expression's label
        _fail("data.listops_max_length", d.listops_max_length, f"generates ListOps longer than "
              f"data.seq_len={d.seq_len}, which would be cut, each keeping the label of the "
              f"whole expression, which the cut input no longer determines; set data."
              f"listops_max_length={d.seq_len}, or raise data.seq_len to {d.listops_max_length}")
    if generated and d.seed < 0:
        # a review (d1): random.Random(int) seeds with the int's absolute value, so a seed
        # sweep over +-N counted one data set twice; saved runs still draw so (listops.py)
        _fail("data.seed", d.seed, f"draws the generated ListOps expressions of data.seed="
              f"{-d.seed} (Python's Random seeds with an int's absolute value); give "
              f"data.seed={-d.seed}, or another seed >= 0")
    if packs_block_aligned(cfg):
        # a review (session 115): taken; a run saved so is still read and resumed
        _fail("data.batching", "pack",
              f"attention {cfg.attention.name!r} places its blocks from each row's first column "
              "(lsh: its chunks from the row's sorted order), so a document packed mid-row "
              "would attend to other tokens than it does alone or "
              "when decoded (which counts from its own first token); use data.batching='pad' "
              "(a document a row), or a variant whose pattern follows distances alone "
              "('sliding_window', or 'strided' with mode='strided')")
    if eval_is_train(cfg.data):
        # a review (session 107): taken, every eval document one trained on, and a kNN-LM
        # of the run found each held-out target's own entry at distance 0 (perplexity ~1);
        # `python -m hpnlp.data.prepare` refuses --eval_input equal to an --input likewise
        _fail("data.eval_path", cfg.data.eval_path, "names data.train_path's file, so every "
              "eval document would be one trained on; the eval text must be held out: give "
              "another file, or drop data.eval_path (the end of the train file is then held out)")
    e = cfg.model.encoder
    if cfg.model.kind == "bi_encoder" and 0 < t.steps <= e.mine_every:
        # a review (session 115): mining runs after step mine_every - 1 and never after the
        # last, so none ran, the run trained on in-batch negatives alone, its summary "mined"
        _fail("model.encoder.mine_every", e.mine_every, f"with train.steps={t.steps} no "
              "step mines (the first mining follows step model.encoder.mine_every, and none "
              "follows the last), so no pair would get a hard negative; set it to "
              + (f"at most {t.steps - 1} or " if t.steps > 1 else "") + "0 (no mining), or "
              "raise train.steps")
    if cfg.attention.name == "clustered" and cfg.model.dtype == "float16":
        # review r1 (session 105): the layer injects its k-means gradient in the backward
        # pass, where the train step's loss scale (train/step.py's `applied`) cannot reach
        # it, and the step divides every gradient by that scale
        _fail("attention.name", cfg.attention.name, "with model.dtype='float16': its centroids' "
              "k-means gradient is injected in the backward pass, which float16's loss scale "
              "does not reach, so it would come out divided by that scale (which moves as it "
              "adapts); set model.dtype='bfloat16' or 'float32'")
    default = MoEConfig().eval_capacity_factor
    if moe.enabled() and moe.router == "expert_choice" and moe.eval_capacity_factor != default:
        # review r4 (session 105): its capacity is its routing (a wider one gives every token
        # more experts), so it evaluates at capacity_factor; a run saved while the field was
        # read (set to capacity_factor, the workaround) still validates and resumes
        _fail("model.moe.eval_capacity_factor", moe.eval_capacity_factor, "is ignored with "
              "router='expert_choice', which evaluates at the capacity it trained with "
              "(capacity_factor), since its capacity decides how many experts each token gets; "
              f"leave it at its default {default!r} (model.moe.capacity_factor sets both)")
    if cfg.model.embed_grad_scale == "batch" and t.grad_accum != 1:
        # review r10 (session 108): the Embed of each microbatch counts its own ids, so an id
        # seen once in each of 4 microbatches had its row's gradient 4x one big batch's, and
        # accumulation changed the update of the same batch (train/step.py's promise); the
        # step's whole-batch counts would have to reach every model's Embed call
        _fail("model.embed_grad_scale", "batch", f"with train.grad_accum={t.grad_accum} it "
              "would divide each row's gradient by its id's count in a microbatch, not in the "
              "step's batch, so accumulation would change the update; set "
              "model.embed_grad_scale='corpus' (where the task has train token counts: a fixed "
              "table of the step's whole batch) or train.grad_accum=1")
    if t.early_stopping_patience and t.eval_every:
        before = (t.steps - 1) // t.eval_every  # evals before the last step
        if before < t.early_stopping_patience + 1:
            every = (t.steps - 1) // (t.early_stopping_patience + 1)
            # a review (session 107): where even eval_every=1 is too few evals, "at most 1"
            # was offered with eval_every=1 itself
            fix = (f"set train.eval_every to at most {every}, or lower the patience" if every
                   else (f"lower it to at most {before - 1}, " if before > 1 else "") +
                   f"set it to 0 (no early stopping), or raise train.steps to at least "
                   f"{(t.early_stopping_patience + 1) * t.eval_every + 1}")
            _fail("train.early_stopping_patience", t.early_stopping_patience,
                  f"stops after that many evals without improvement over a best, and "
                  f"train.eval_every={t.eval_every} evaluates {before} times before the last "
                  f"step (train.steps={t.steps}), so it can never stop early; {fix}")
    from hpnlp.config.compress_checks import check_new_compress_run
    check_new_compress_run(cfg)


def validate(cfg: Config, *, task_info: Mapping[str, Any] | None = None,
             num_devices: int | None = None, num_processes: int = 1,
             devices: bool = True) -> Config:
    """Check every field; returns the config with task-derived fields filled in.

    `task_info` has `kind` ("lm" | "classify" | "match"), `vocab_size`, `num_classes`;
    it comes from `hpnlp.data.task_info(cfg.data)` without building the data set.
    `devices=False` leaves out what depends on the devices (the mesh, the batch's split):
    a process of a multi-process run checks the rest before it waits for the others, when
    JAX may not touch a device yet.
    """
    from hpnlp import attention, softmax  # registries; imported late to avoid cycles

    m, t, d = cfg.model, cfg.train, cfg.data
    _check_choice("model.kind", m.kind, ("lm", "classifier", "dual_encoder", "bi_encoder"))
    for name in ("width", "depth", "num_heads", "mlp_dim", "max_len"):
        _check_positive(f"model.{name}", getattr(m, name))
    if not isinstance(m.head_dim, int) or m.head_dim < 0:
        _fail("model.head_dim", m.head_dim, "must be an integer >= 0 (0: width / num_heads)")
    # model.arch 'lstm', 'gru' and 'bag' have no heads, positions or attention: the
    # Transformer's rules for them do not apply (a README walk: an LSTM was refused for
    # model.num_heads=3 not dividing its width; `_check_not_transformer` below)
    recurrent = m.arch in RECURRENT_ARCHS
    if not recurrent and not m.head_dim and m.width % m.num_heads:
        _fail("model.width", m.width,
              f"must be divisible by model.num_heads={m.num_heads} (head_dim = width / heads), "
              "or set model.head_dim")
    _check_kv_heads(m)
    if not 0.0 <= m.dropout < 1.0:
        _fail("model.dropout", m.dropout, "must be in [0, 1)")
    _check_choice("model.pos_emb", m.pos_emb, ("learned", "sinusoidal", "rope"))
    if m.pos_emb == "rope" and m.dims_per_head() % 2 and not recurrent:
        _fail("model.pos_emb", m.pos_emb, f"RoPE rotates pairs of dims, and each head has "
              f"{m.dims_per_head()} (odd); set model.head_dim (or model.width / model.num_heads) "
              "even, or use model.pos_emb='learned'")
    _check_choice("model.pool", m.pool, ("mean", "first"))
    if m.kind == "lm":  # the user's model.num_classes: validate fills a classifier's below
        _refuse_unread("model", m, "model.kind='lm' predicts the next token: it pools nothing "
                       "and has no classes", "use model.kind='classifier' (or 'dual_encoder')",
                       names=("pool", "num_classes"))
    if m.arch == "bag":
        _refuse_unread("model", m, "a bag of embeddings pools by model.encoder.bag", "pool it "
                       "with model.encoder.bag ('mean' or 'sum')", names=("pool",))
        # a review (r13): its sum of embeddings has no dropout; a rate was taken, unread
        # (0.0 says what a bag does, and the default is taken as unset)
        if m.dropout not in (0.0, type(m)().dropout):
            _fail("model.dropout", m.dropout, "a bag of embeddings has no layer it drops out, "
                  "so nothing reads it; use model.arch='transformer' (or 'lstm') for dropout, "
                  "or set it to 0.0")
    if m.causal not in (True, False):
        _fail("model.causal", m.causal, "must be true or false")
    if m.causal and m.kind != "classifier":
        _fail("model.causal", m.causal, f"makes a classifier's attention causal; a "
              f"model.kind={m.kind!r} model is " + ("always causal" if m.kind == "lm" else
                                                    "not") + "; leave it false")
    if m.causal and m.arch != "transformer":
        _fail("model.causal", m.causal, f"applies to Transformer classifiers; a model.arch="
              f"{m.arch!r} trunk reads in its own order; leave it false")
    if m.causal and m.pool == "first":
        _fail("model.causal", m.causal, "with model.pool='first' the pooled token would see only "
              "itself; set model.pool='mean'")
    # found in review: a classifier read one token; a bug hunt (session 102): so did a
    # dual_encoder's and a bi_encoder's (every text opening "A" got one vector)
    if m.arch in ("lstm", "gru") and m.kind != "lm" and m.pool == "first" \
            and not cfg.rnn.bidirectional:
        # review (session 102): a dual or bi-encoder saved so before is refused when read or
        # resumed, and either fix changes the model a resume compares (model.pool, the RNN)
        _fail("model.pool", m.pool, f"a left-to-right {m.arch.upper()}'s first output has read "
              "only the first token; set model.pool='mean' or rnn.bidirectional=True (a run "
              "saved so: train it again in a new --workdir)")
    _check_choice("model.param_dtype", m.param_dtype, DTYPES)
    _check_choice("model.dtype", m.dtype, DTYPES)
    if m.param_dtype == "float16":
        _fail("model.param_dtype", m.param_dtype, "float16 master weights lose small updates; keep "
              "model.param_dtype='float32' and set model.dtype='float16' (loss scaling is automatic)")
    _check_remat(m.remat)
    if not isinstance(m.reversible, bool):
        _fail("model.reversible", m.reversible, "must be True or False")
    if m.reversible and m.arch != "transformer":
        _fail("model.reversible", True, f"reversible blocks are Transformer blocks; "
              f"model.arch={m.arch!r} has none (set model.reversible=False)")
    if m.reversible and m.remat != "none":
        _fail("model.remat", m.remat, "model.reversible=True already recomputes each block in the "
              "backward pass; set model.remat='none'")
    _check_choice("model.arch", m.arch, ("transformer", "transformer_xl", "lstm", "gru", "bag"))
    _check_not_transformer(cfg)
    if m.arch == "bag" and m.kind != "bi_encoder":
        _fail("model.arch", m.arch, "a bag of embeddings has no sequence model, only the "
              "bi-encoder pools one; set model.kind='bi_encoder' or another model.arch")
    _check_choice("model.embed_grad_scale", m.embed_grad_scale, ("none", "batch", "corpus"))
    _check_encoder(cfg)
    if not isinstance(m.mem_len, int) or m.mem_len < 0:
        _fail("model.mem_len", m.mem_len, "must be an integer >= 0 (0: = data.seq_len)")
    if m.mem_len and not (m.arch == "transformer_xl" and d.batching == "stream"):
        # a bug hunt: taken and ignored (and on pack/pad, M empty memory slots computed)
        _fail("model.mem_len", m.mem_len, "is the memory Transformer-XL carries from batch to "
              "batch, which only model.arch='transformer_xl' on data.batching='stream' has; "
              "drop it, or set both")
    if m.arch == "transformer_xl":
        if m.pos_emb != "learned":  # a bug hunt: 'sinusoidal' was taken and ignored
            _fail("model.pos_emb", m.pos_emb, "model.arch='transformer_xl' has its own relative "
                  "positions (which ignore model.pos_emb); set model.pos_emb='learned'")
        if m.kind != "lm":
            _fail("model.arch", m.arch, "Transformer-XL memory is for causal LMs; set model.kind='lm'")
        if cfg.attention.name != "dense":
            _fail("attention.name", cfg.attention.name, "model.arch='transformer_xl' has its own "
                  "exact relative-position attention; set attention.name='dense'")
        if d.batching == "stream" and t.grad_accum != 1:
            _fail("train.grad_accum", t.grad_accum, "Transformer-XL on stream batches carries each "
                  "row's memory to the next step, which microbatches would break; set "
                  "train.grad_accum=1")
    _check_compressive(cfg)
    if not isinstance(m.stack_layers, bool):
        _fail("model.stack_layers", m.stack_layers, "must be True or False")
    if m.stack_layers and m.arch != "transformer":
        _fail("model.stack_layers", True, f"it stacks Transformer blocks; model.arch={m.arch!r} has "
              "none (set model.stack_layers=False)")
    if m.stack_layers and m.reversible:
        _fail("model.stack_layers", True, "reversible blocks keep their own stack "
              "(models/reversible.py); set model.stack_layers=False or model.reversible=False")
    _check_quant(m.quant, m)
    q = m.quant
    if q.enabled and m.kind == "lm" and "output" in {n.strip() for n in q.layers.split(",")}:
        # found in review: ignored, the layer evaluated float
        if cfg.output.name in softmax.names() and "quant" not in {
                f.name for f in dataclasses.fields(softmax.get(cfg.output.name))}:
            _fail("quant.layers", q.layers, f"names the output layer, but output layer "
                  f"{cfg.output.name!r} keeps its own tables, which are not quantized yet; drop "
                  "'output' (the layer stays float) or use output.name='full' (or another "
                  "VocabLayer: sampled, nce, ...)")
    _check_kv_cache(cfg)
    _check_kv_latent(cfg)
    _check_choice("train.init_kv_heads", t.init_kv_heads, ("mean", "svd"))
    _check_choice("train.init_params", t.init_params, ("all", "trunk"))
    if t.init_params != "all" and not t.init_from:
        _fail("train.init_params", t.init_params, "chooses what this run takes of the run "
              "train.init_from names; set train.init_from, or leave it 'all'")
    if t.init_params == "trunk":
        defaults = type(t)()
        for field in ("init_kv_heads", "init_kv_calibration", "init_experts",
                      "init_expert_batches"):
            value, default = getattr(t, field), getattr(defaults, field)
            if value != default:
                _fail(f"train.{field}", value, "converts a run of the same task, and "
                      "train.init_params='trunk' copies another task's trunk as it is; convert "
                      f"that run first (its own fine-tune), or leave train.{field}={default!r}")
    _check_choice("train.init_experts", t.init_experts, ("routed", "random", "merged"))
    if (not isinstance(t.init_expert_batches, int) or isinstance(t.init_expert_batches, bool)
            or t.init_expert_batches < 1):
        _fail("train.init_expert_batches", t.init_expert_batches, "must be an integer >= 1 "
              "(training batches routed to rank the experts a run of fewer keeps)")
    if t.init_experts != "routed" and not t.init_from:
        _fail("train.init_experts", t.init_experts, "chooses the experts a run keeps of the run "
              "train.init_from names; set train.init_from, or leave it 'routed'")
    default_batches = TrainConfig.init_expert_batches
    if t.init_expert_batches != default_batches and (  # a bug hunt: taken, and read by nothing
            not t.init_from or t.init_experts == "random"):
        _fail("train.init_expert_batches", t.init_expert_batches, "are the batches routed to "
              "choose the experts kept of the run train.init_from names (train.init_experts="
              "'routed' or 'merged'); 'random' reads none. Set those, or leave it "
              f"{default_batches}")
    if (not isinstance(t.init_kv_calibration, int) or isinstance(t.init_kv_calibration, bool)
            or t.init_kv_calibration < 0):
        _fail("train.init_kv_calibration", t.init_kv_calibration, "must be an integer >= 0 "
              "(batches; 0: fit the weights alone)")
    if t.init_kv_calibration and not t.init_from:
        _fail("train.init_kv_calibration", t.init_kv_calibration, "weights the SVD fits that "
              "convert the run train.init_from names; set train.init_from, or leave it 0")
    if t.init_kv_heads == "svd" and not t.init_from:
        _fail("train.init_kv_heads", "svd", "converts the key/value heads of the run "
              "train.init_from names; set train.init_from, or leave it 'mean'")
    _check_compress(cfg)
    _check_lowrank(cfg)
    _check_memory(cfg)
    r = cfg.rnn
    if m.arch not in ("lstm", "gru"):  # a bug hunt: each taken and ignored
        for f in dataclasses.fields(r):
            if getattr(r, f.name) != f.default:
                _fail(f"rnn.{f.name}", getattr(r, f.name), f"sets the recurrent trunk, and "
                      f"model.arch={m.arch!r} has none; drop it, or set model.arch='lstm' "
                      "(or 'gru')")
    _check_choice("rnn.combine", r.combine, ("last", "sum", "residual"))
    for name in ("variational_dropout", "state_dropout", "recurrent_dropout", "zoneout", "weight_drop"):
        rate = getattr(r, name)
        if not (isinstance(rate, (int, float)) and 0.0 <= rate < 1.0):
            _fail(f"rnn.{name}", rate, "must be a probability in [0, 1)")
    _check_positive("rnn.unroll", r.unroll)
    _check_choice("rnn.impl", r.impl, ("auto", "scan", "fused"))
    if r.impl == "fused" and m.arch in ("lstm", "gru"):
        # each of hpnlp.rnn.layers._fused_blocker's, named by its config field (a bug hunt:
        # the last four reached the layer, whose error named `impl` and `hidden`)
        blocker = next((why for cond, why in (
            (m.arch == "gru", "model.arch='gru' (the kernel is a plain LSTM)"),
            (r.layer_norm, "rnn.layer_norm=True (the kernel is a plain LSTM)"),
            (r.zoneout > 0, "rnn.zoneout > 0 (the kernel is a plain LSTM)"),
            (r.recurrent_dropout > 0 or r.state_dropout > 0,
             "rnn.recurrent_dropout or rnn.state_dropout > 0 (per-step masks in training)"),
            (m.width % 16, f"model.width={m.width} (the kernel needs a multiple of 16)"),
            (m.dtype != "float32", f"model.dtype={m.dtype!r} (the kernel computes in float32)"))
            if cond), None)  # (this machine's, with the devices: `_rnn_blocked`)
        if blocker:
            _fail("rnn.impl", "fused", f"the fused kernel cannot run {blocker}; use "
                  "rnn.impl='auto' (the kernel where it applies) or 'scan'")
    if m.arch != "transformer" and m.kind == "lm" and r.bidirectional:
        _fail("rnn.bidirectional", True, "a language model reads left to right; bidirectional "
              "layers are for model.kind='classifier' or 'dual_encoder'")

    _check_buckets(d)  # before the attention's rules, which see each bucket width

    # Attention: registry name, options, and the variant's own shape rules.
    if cfg.attention.name not in attention.names():
        _fail("attention.name", cfg.attention.name, f"choose one of {attention.names()}")
    att_cls = attention.get(cfg.attention.name)
    check_options("attention.options", cfg.attention.options, att_cls)
    fixed = att_cls.random_features and not cfg.attention.options.get("redraw", True)
    if fixed or not att_cls.random_features:  # the `features` stream's only readers
        drawers = [n for n in attention.names() if attention.get(n).random_features]
        _refuse_unread("train", t, f"it redraws random features, and attention "
                       f"{cfg.attention.name!r} " + ("keeps one fixed draw" if fixed else
                                                     "draws none"),
                       "set attention.options.redraw=True" if fixed else
                       f"use an attention that draws them ({', '.join(drawers)})",
                       names=("feature_redraw_every",))
    causal = m.kind == "lm" or m.causal
    check = getattr(att_cls, "check_config", None)
    if check is not None:
        check(dict(cfg.attention.options), seq_len=d.seq_len, causal=causal,
              field="attention.options")
        if d.batching == "bucket":  # every bucket width is a sequence length the model sees
            from hpnlp.data.batching import bucket_boundaries
            for width in bucket_boundaries(d):
                try:
                    check(dict(cfg.attention.options), seq_len=width, causal=causal,
                          field="attention.options")
                except ConfigError as e:
                    which = "data.bucket_boundaries" if d.bucket_boundaries else \
                        "the default data.bucket_boundaries"
                    raise ConfigError(
                        f"{e} -- here the length is bucket width {width} from {which}; set "
                        "data.bucket_boundaries to multiples of the block sizes") from None
    synth_len = cfg.attention.options.get("max_len", getattr(att_cls, "max_len", 0))
    if (cfg.attention.name == "synthesizer" and m.kind == "lm" and m.arch == "transformer"
            and isinstance(synth_len, int) and synth_len < m.max_len):
        # a bug hunt: trained, then no decode ran (its cache is model.max_len tokens long)
        _fail("attention.options.max_len", synth_len, f"an LM decodes into a cache of "
              f"model.max_len={m.max_len} positions, past the synthesized weights' {synth_len}; "
              "raise it to model.max_len, or lower model.max_len")

    if cfg.output.name not in softmax.names():
        _fail("output.name", cfg.output.name, f"choose one of {softmax.names()}")
    check_options("output.options", cfg.output.options, softmax.get(cfg.output.name))

    # Training.
    for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints",
                 "loss_scale_init", "loss_scale_period"):
        _check_positive(f"train.{name}", getattr(t, name))
    for name in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every",
                 "clip_norm", "weight_decay", "early_stopping_patience", "feature_redraw_every"):
        _check_positive(f"train.{name}", getattr(t, name), allow_zero=True)
    _check_positive("train.lr", t.lr)
    if t.loss_scale_init < 1:  # a bug hunt: 1e-30 underflowed every float16 gradient to 0
        _fail("train.loss_scale_init", t.loss_scale_init, "must be >= 1, the dynamic loss "
              "scale's floor (float16 gradients scaled below 1 underflow)")
    # a review (r10): 1e39, finite here, was inf in the float32 state: every step skipped
    if t.loss_scale_init > FLOAT32_MAX:
        _fail("train.loss_scale_init", t.loss_scale_init, f"must be at most {FLOAT32_MAX:.4g}, "
              "float32's largest, where the loss scale is kept (past it, inf skips every step); "
              "float16 gradients need no more than 2**64, and the default is 2**15")
    # Found by a bug hunt (session 90): each taken and ignored.
    if m.dtype != "float16":
        for name in ("loss_scale_init", "loss_scale_period"):
            if getattr(t, name) != getattr(TrainConfig, name):
                _fail(f"train.{name}", getattr(t, name), "sets float16's dynamic loss scaling, "
                      f"which model.dtype={m.dtype!r} does not use; drop it, or set "
                      "model.dtype='float16'")
    if t.schedule == "constant" and t.end_lr_frac != TrainConfig.end_lr_frac:
        _fail("train.end_lr_frac", t.end_lr_frac, "is where a decay ends, and "
              "train.schedule='constant' does not decay; drop it, or choose 'cosine' or 'linear'")
    _check_choice("train.schedule", t.schedule, ("cosine", "linear", "constant"))
    # found in review: these took any number (end_lr_frac -1 ascended the loss after its middle)
    if not 0 <= t.end_lr_frac <= 1:
        _fail("train.end_lr_frac", t.end_lr_frac, "the final learning rate as a fraction of "
              "train.lr must be in [0, 1]")
    for name in ("b1", "b2"):
        if not 0 <= getattr(t, name) < 1:
            _fail(f"train.{name}", getattr(t, name), "Adam's moment decay must be in [0, 1)")
    if t.schedule == "constant" and t.warmup_steps > t.steps:
        # a bug hunt (session 103): this said "must be < train.steps (the 'constant' decay
        # needs steps after warmup)", a bound not applied, of a decay 'constant' does not have
        _fail("train.warmup_steps", t.warmup_steps, f"must be <= train.steps={t.steps} (the "
              "warmup ends within the run); lower it, or raise train.steps")
    if t.schedule != "constant" and t.warmup_steps >= t.steps:
        _fail("train.warmup_steps", t.warmup_steps,
              f"must be < train.steps={t.steps} (the {t.schedule!r} decay needs steps after warmup)")
    metrics = ("loss", "accuracy", "ppl") if m.kind == "lm" else ("loss", "accuracy")
    _check_choice("train.early_stopping_metric", t.early_stopping_metric, metrics)
    # Each taken and ignored (found in review: experiments/lra.py set the metric alone)
    if (t.early_stopping_patience == 0
            and t.early_stopping_metric != TrainConfig.early_stopping_metric):
        _fail("train.early_stopping_metric", t.early_stopping_metric, "is the metric early "
              "stopping watches, and train.early_stopping_patience=0 turns it off; drop it, or "
              "set train.early_stopping_patience (evals without improvement before stopping)")
    if t.early_stopping_patience and not t.eval_every:
        _fail("train.early_stopping_patience", t.early_stopping_patience, "counts evals without "
              "improvement, and train.eval_every=0 evaluates only after the last step; set "
              "train.eval_every, or drop the patience")

    # Data.
    from hpnlp import data as data_lib
    if d.task not in data_lib.task_names():
        _fail("data.task", d.task, f"choose one of {data_lib.task_names()}")
    # a bug hunt: -8 passed (it divides by the shards) and failed at the first eval, unnamed
    _check_positive("data.eval_batch_size", d.eval_batch_size, allow_zero=True)
    _check_choice("data.eval_split", d.eval_split, ("eval", "validation"))
    if d.prepared:  # found by a bug hunt: the text files were read by nothing, silently
        for field in ("train_path", "eval_path"):
            if getattr(d, field):
                _fail(f"data.{field}", getattr(d, field),
                      f"data.prepared={d.prepared!r} is set, and a prepared folder holds both "
                      "splits, so this file would not be read; drop one of the two (prepare "
                      "the text with `python -m hpnlp.data.prepare --input ... --eval_input ...`)")
    if d.eval_split == "validation":
        for field in ("train_path", "eval_path", "prepared"):
            if getattr(d, field):
                fix = ("prepare the corpus again with your validation text as --eval_input "
                       "(python -m hpnlp.data.prepare --input ... --eval_input ...), name that "
                       "folder in data.prepared, and keep data.eval_split='eval'"
                       if field == "prepared" else  # a bug hunt: the
                       "pass a validation file as data.eval_path and keep "  # other fix is
                       "data.eval_split='eval'")  # refused with a prepared folder
                _fail("data.eval_split", d.eval_split,
                      f"'validation' holds out part of the shipped corpus or of generated "
                      f"ListOps, and data.{field} is set; with your own data {fix}")
        if d.task == "listops" and d.listops_num_train <= d.listops_num_eval:
            _fail("data.eval_split", d.eval_split,
                  f"'validation' holds out data.listops_num_eval={d.listops_num_eval} of the "
                  f"data.listops_num_train={d.listops_num_train} generated training examples; "
                  "raise data.listops_num_train above it")
    from hpnlp.data.tokenizers import KINDS as tokenizer_kinds
    _check_choice("data.tokenizer", d.tokenizer, ("",) + tokenizer_kinds)
    # sinusoidal and rope positions have no table: rows longer than model.max_len train, and
    # only decoding (generate: length <= model.max_len, the cache's size) is bounded by it
    if d.seq_len > m.max_len and m.pos_emb == "learned" and m.arch == "transformer":
        _fail("data.seq_len", d.seq_len,
              f"must be <= model.max_len={m.max_len} (the learned position table); "
              "raise model.max_len or use model.pos_emb='sinusoidal' or 'rope'")

    info = dict(task_info) if task_info is not None else data_lib.task_info(d)
    want_kind = {"lm": "lm", "classifier": "classify", "dual_encoder": "match",
                 "bi_encoder": "match"}[m.kind]
    # a task of positive pairs only (every label 'same') trains a bi-encoder, whose negatives
    # are the batch's other pairs; a dual encoder's classifier of it learns a constant (a
    # review, session 116: 100% accuracy, loss 0)
    match = "bi_encoder" if info.get("positives_only") else "dual_encoder"
    if info["kind"] != want_kind:
        kinds = {"lm": "lm", "classify": "classifier", "match": match}
        _fail("model.kind", m.kind,
              f"data.task={d.task!r} is a {info['kind']!r} task and needs "
              f"model.kind={kinds[info['kind']]!r}")
    if d.batching == "pack" and not getattr(att_cls, "supports_segments", True):
        _fail("data.batching", d.batching,
              f"attention {cfg.attention.name!r} takes padding as lengths only (one segment per "
              "row), so packed rows cannot be separated; use data.batching='pad' or another attention")
    if d.batching == "stream" and d.prepared:  # a bug hunt (session 101): refused only when
        # the batches were read (and, on a plain Transformer, told to use Transformer-XL)
        from hpnlp.data.batching import MODES
        rows = f"a prepared folder (data.prepared={d.prepared!r}) is read in rows of {list(MODES)}"
        if m.arch == "transformer_xl":  # a bug hunt (session 110): "use pack" led to the
            # mem_len refusal's "set both" (stream), and back
            _fail("data.batching", d.batching, f"{rows}, never streams, and the memory "
                  "Transformer-XL carries from batch to batch (the compressed one too) needs "
                  "stream batches, so it cannot train on a prepared folder: train on a "
                  "data.train_path file instead of data.prepared, or " + xl_on_pack(m))
        _fail("data.batching", d.batching, f"{rows}, not streams; use data.batching='pack'")
    if d.batching == "stream" and m.arch == "transformer":
        _fail("data.batching", d.batching, "stream batches continue each row across batches for "
              "Transformer-XL memory, so positions grow past model.max_len, and a plain "
              "Transformer has absolute positions and no memory; use data.batching='pack' or "
              "'pad', or model.arch='transformer_xl'")
    if d.batching == "stream" and m.arch in ("lstm", "gru"):  # a bug hunt: taken, to no end
        _fail("data.batching", d.batching, "stream batches continue each row across batches for "
              f"a memory carried between them, which only Transformer-XL carries; a "
              f"model.arch={m.arch!r} LM starts each batch from a zero state, so use "
              "data.batching='pack' (each packed row read as one stream)")
    if d.batching in ("pack", "stream") and info["kind"] != "lm":
        _fail("data.batching", d.batching, f"{d.batching!r} is for LM tasks; use 'pad' or 'bucket'")
    if m.vocab_size and m.vocab_size < info["vocab_size"]:
        _fail("model.vocab_size", m.vocab_size,
              f"data.task={d.task!r} has {info['vocab_size']} token ids; use 0 to take it from the task")
    if m.num_classes and m.num_classes < info.get("num_classes", 0):
        _fail("model.num_classes", m.num_classes,
              f"data.task={d.task!r} has {info['num_classes']} classes; use 0 to take it from the task")
    model = dataclasses.replace(
        m, vocab_size=m.vocab_size or info["vocab_size"],
        num_classes=m.num_classes or info.get("num_classes", 0))
    lr, V, C = m.lowrank, model.vocab_size, model.num_classes
    for kind in ("embed", "output"):  # the [V, E] tables, now that V is known
        if lr.rank and lr.applies(kind) and V and lr.rank > min(V, m.width):
            _fail("model.lowrank.rank", lr.rank, f"the {kind} table is [{V}, {m.width}], of "
                  f"rank at most {min(V, m.width)}; lower the rank or drop {kind!r} from "
                  "model.lowrank.layers")
    # the heads' products (`head`), now that the classes are known: a classifier's [E, C]; a
    # dual encoder's MLP over [u, v, u v, u - v], [4 E, mlp_dim], then [mlp_dim, C]; E twice
    # the width for a bidirectional RNN (a review, session 118: its [2 E, C] head was bounded
    # by E)
    enc = m.width * (2 if m.arch in ("lstm", "gru") and cfg.rnn.bidirectional else 1)
    heads = {"classifier": [(enc, C)],
             "dual_encoder": [(4 * enc, m.mlp_dim), (m.mlp_dim, C)]}.get(m.kind, [])
    for k, n in heads:
        if lr.rank and lr.applies("head") and C and lr.rank > min(k, n):
            _fail("model.lowrank.rank", lr.rank, f"the head product is [{k}, {n}] (data.task="
                  f"{d.task!r} has {C} classes), of rank at most {min(k, n)}; lower the rank or "
                  "drop 'head' from model.lowrank.layers")
    if m.kind != "lm":  # a README walk: a classifier trained the same with any of them
        for f in ("name", "tie_embeddings", "options"):
            if getattr(cfg.output, f) != getattr(OutputConfig(), f):
                _fail(f"output.{f}", getattr(cfg.output, f), f"output.* configures an LM's "
                      f"layer over the vocabulary; a model.kind={m.kind!r} model has its own "
                      "head and ignores it: leave output.* unset")
    if m.kind == "lm":  # the output layer's own rules, now that the vocabulary is known; first,
        # as what they refuse no other setting fixes (a bug hunt, session 95: adaptive on bytes
        # was told to untie, then refused for the bytes)
        softmax.check_config(cfg.output.name, cfg.output.options, vocab_size=model.vocab_size,
                             frequency_sorted=info.get("frequency_sorted"))
    if m.kind == "lm" and getattr(softmax.get(cfg.output.name), "requires_tied", False) \
            and not cfg.output.tie_embeddings:
        _fail("output.tie_embeddings", False, f"output layer {cfg.output.name!r} predicts the "
              "target's input embedding, so it needs the tied table; set "
              "output.tie_embeddings=True")
    if m.kind == "lm" and cfg.output.tie_embeddings:
        tieable = [n for n in softmax.names() if softmax.can_tie(n)]
        if cfg.output.name not in tieable:
            _fail("output.tie_embeddings", True, f"output layer {cfg.output.name!r} cannot share the "
                  f"input embedding; set output.tie_embeddings=False, or use one of {tieable}")

    _check_moe(cfg)  # (before the devices': a process checks it before it joins the others)
    _check_mesh_fields(cfg)  # (so are these)

    # Devices and batch.
    if not devices:
        return dataclasses.replace(cfg, model=model)
    import jax
    n = jax.device_count() if num_devices is None else num_devices
    mesh = cfg.mesh
    filled = [a for a in MESH_AXES if getattr(mesh, a) == -1]
    sizes = mesh.axis_sizes(n)
    if not mesh.fits(n):
        # all ones (`mesh.data=1` on 8 devices) reads as data 1, not {} (review r3)
        given = {a: getattr(mesh, a) for a in MESH_AXES if getattr(mesh, a) != 1} or {"data": 1}
        fixed = {a: v for a, v in given.items() if v != -1}
        simulate = (" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates "
                    "N devices)" if jax.default_backend() == "cpu" else "")
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        if filled:  # a README walk: "got {'data': 0, ...}" for an axis that does not divide
            _fail("mesh", given, f"the other axes' sizes multiply to {math.prod(fixed.values())}, "
                  f"which does not divide the {n} device(s), so mesh.{filled[0]}=-1 cannot fill "
                  f"the rest; give axis sizes whose product divides {n} ({divisors})" + simulate)
        _fail("mesh", given, f"the axis sizes multiply to {math.prod(fixed.values())}, not the "
              f"device count {n}; give sizes whose product is {n}, or set one axis to -1 to "
              "fill the rest" + simulate)
    # Every dimension the rules shard must split evenly over its mesh axes.
    dims = {"heads": {"model.num_heads": m.num_heads},
            "kv_heads": {"model.num_kv_heads": m.kv_heads()} if m.kv_heads() < m.num_heads else {},
            "mlp": {"model.mlp_dim": m.mlp_dim},
            "vocab": {"model.vocab_size": model.vocab_size}, "embed": {"model.width": m.width},
            "kv": {"model.head_dim": m.dims_per_head()},
            # with pipeline stages: model.depth's own check below, which names the stages
            "layers": {"model.depth": m.depth} if sizes["pipeline"] == 1 else {}}
    if recurrent:  # a bug hunt (session 101): an LSTM LM on
        # mesh.tensor=8 was refused over model.num_heads, which it does not have. Its
        # hidden units (model.width, the `mlp` axis of rnn/layers.py's weights) hold no
        # sharding constraint: the state's shardings replicate them where the axis does not
        # divide (parallel/mesh.py _dividing; width 30 on tensor=4 trained the 1-device losses)
        dims.update(heads={}, kv_heads={}, mlp={}, kv={})
    for logical, named in dims.items():
        split = math.prod(sizes[a] for a in mesh.mesh_axes_of(logical))
        for name, dim in named.items():
            if dim % split:
                axes = " x ".join(f"mesh.{a}={sizes[a]}" for a in mesh.mesh_axes_of(logical))
                _fail(f"mesh.rules.{logical}", mesh.rules.get(logical),
                      f"it splits {name}={dim} over {axes} = {split}, which does not divide it; "
                      "change the axis size or map the rule to None")
    if sizes["sequence"] > 1 and m.arch != "transformer":  # a review (session 107): the ring
        # advice below was refused for these archs' attention.name, and that refusal's fix
        # brought this one back
        _fail("mesh.sequence", sizes["sequence"], f"sequence parallelism splits each sequence "
              f"over devices for ring attention (attention.name='ring'), which model.arch="
              f"{m.arch!r} cannot use; set mesh.sequence=1")
    if sizes["sequence"] > 1 and cfg.attention.name != "ring":
        _fail("mesh.sequence", sizes["sequence"],
              "sequence parallelism splits every sequence over devices and needs "
              "attention.name='ring' (exact attention passing key/value blocks around the ring)")
    why = _rnn_blocked(cfg, n)
    if why:
        _fail("rnn.impl", "fused", f"the fused kernel cannot run {why}; use rnn.impl='auto' "
              "(the kernel where it can run, else the XLA scan) or 'scan'")
    blocked = _attention_blocked(cfg, n)  # found in review (the CPU kernel's head dims) and a
    if blocked:  # bug hunt (session 100: a mesh of several devices): the layer's error at the
        option, _, why, fix = blocked  # model's init named no config field
        _fail(f"attention.options.{option}", cfg.attention.options[option], f"{why}; {fix}")
    ring_axis = cfg.attention.options.get("axis", "sequence")
    if (sizes["sequence"] > 1 and cfg.attention.name == "ring"
            and ring_axis not in mesh.mesh_axes_of("length")):
        _fail("attention.options.axis", ring_axis, "the ring passes key/value blocks around "
              "this mesh axis, and the sequence is split over "
              f"{list(mesh.mesh_axes_of('length'))} (mesh.rules.length); set it to 'sequence'")
    if sizes["sequence"] > 1 and d.seq_len % sizes["sequence"]:
        _fail("data.seq_len", d.seq_len, f"must be a multiple of mesh.sequence={sizes['sequence']}")
    if sizes["sequence"] > 1 and d.batching == "bucket":  # found in review: failed mid-run
        from hpnlp.data.batching import bucket_boundaries
        odd = [w for w in bucket_boundaries(d) if w % sizes["sequence"]]
        if odd:
            _fail("data.bucket_boundaries", list(d.bucket_boundaries) or "(default)",
                  f"bucket widths {odd} do not split over mesh.sequence={sizes['sequence']}; "
                  f"give widths that are multiples of {sizes['sequence']}")
    # The ring runs over its axis wherever that has several devices (attention/ring.py), the
    # sequence split or not: a new run is refused another axis (`check_new_run`), and a run
    # saved with one still reads it, but not where its trace would fail (review r1: with
    # mesh.sequence=1 and axis='data', a seq_len mesh.data does not divide failed there, and
    # the block check below was skipped)
    n_ring = sizes.get(ring_axis, 1) if cfg.attention.name == "ring" else 1
    block = cfg.attention.options.get("block")
    if n_ring > 1 and (ring_axis != "sequence" or isinstance(block, int)):
        from hpnlp.data.batching import bucket_boundaries
        widths = bucket_boundaries(d) if d.batching == "bucket" else [d.seq_len]
        odd = [w for w in widths if w % n_ring]
        if odd and ring_axis != "sequence":  # (mesh.sequence's own checks are above)
            _fail("attention.options.axis", ring_axis, f"the ring would split each sequence "
                  f"over mesh.{ring_axis}={n_ring} devices, which do not divide its lengths "
                  f"{odd}; set it to 'sequence', the axis sequence parallelism splits "
                  "(mesh.sequence > 1)")
        odd = [w for w in widths if isinstance(block, int) and (w // n_ring) % block]
        if odd:  # the ring's tiles split each device's share of a sequence
            _fail("attention.options.block", block, f"each device holds L / mesh.{ring_axis} = "
                  f"{[w // n_ring for w in odd]} positions, which the ring's tile "
                  "must divide; choose a divisor of them, or None")
    for axis in MESH_AXES:  # a bug hunt (session 90): data=4 with rules.batch=None ran as 1
        # (pipeline stages need rules.layers, checked below)
        named = any(axis in mesh.mesh_axes_of(r) for r in mesh.rules)
        if axis != "pipeline" and sizes[axis] > 1 and not named:
            usual = [r for r, a in DEFAULT_RULES.items() if axis in mesh.axes_in(a)]
            _fail(f"mesh.{axis}", sizes[axis], f"no mesh.rules entry names {axis!r}, so every "
                  "device along it would compute the same; name it in a rule (by default "
                  + ", ".join(f"mesh.rules.{r}" for r in usual) + f" does) or set mesh.{axis}=1")
    shards = math.prod(sizes[a] for a in mesh.mesh_axes_of("batch"))
    per_step = t.grad_accum * math.lcm(shards, num_processes)
    if t.batch_size % per_step:
        _fail("train.batch_size", t.batch_size,
              f"must be a multiple of train.grad_accum x data-parallel shards = "
              f"{t.grad_accum} x lcm({shards} devices, {num_processes} processes) = {per_step}")
    eval_bs = d.eval_batch_size or t.batch_size
    if eval_bs % math.lcm(shards, num_processes):
        _fail("data.eval_batch_size", eval_bs,
              f"must be a multiple of {math.lcm(shards, num_processes)} (data-parallel shards)")
    _check_process_rows(mesh, sizes, n, num_processes, real=num_devices is None)
    # after the batch sizes' checks, which its routing groups divide (review r4: before them,
    # batch_size=32 with grad_accum=3 was refused as model.moe.groups not dividing "32 / 3 = 10")
    _check_moe_mesh(cfg, sizes)
    # Pipeline (GPipe, parallel/pipeline.py): stages split the stacked layer axis, and each
    # batch the trunk sees splits into microbatches.
    stages, micro = sizes["pipeline"], mesh.pipeline_microbatches
    if not isinstance(micro, int) or micro < 0:
        _fail("mesh.pipeline_microbatches", micro, "must be an integer >= 0 (0: = mesh.pipeline)")
    if micro and stages == 1:  # a bug hunt (session 90): taken and ignored
        _fail("mesh.pipeline_microbatches", micro, "only pipeline stages split a batch into "
              "microbatches, and mesh.pipeline is 1; set mesh.pipeline > 1, or leave this at 0 "
              "(train.grad_accum splits a step's batch without stages)")
    if stages > 1:
        if m.arch != "transformer":
            _fail("mesh.pipeline", stages, f"pipeline stages are Transformer blocks; model.arch="
                  f"{m.arch!r} has none; set mesh.pipeline=1")
        if not m.stack_layers:
            _fail("mesh.pipeline", stages, "pipeline stages split the stacked layer axis; set "
                  "model.stack_layers=True (or mesh.pipeline=1)")
        if sizes["sequence"] > 1:  # ring attention's shard_map does not nest in the stages' yet
            _fail("mesh.pipeline", stages, f"pipeline stages cannot yet run ring attention over "
                  f"mesh.sequence={sizes['sequence']}; set mesh.sequence=1 or mesh.pipeline=1")
        if mesh.mesh_axes_of("layers") != ("pipeline",):
            _fail("mesh.rules.layers", mesh.rules.get("layers"),
                  "must be 'pipeline' when mesh.pipeline > 1 (each stage holds its own layers)")
        if m.depth % stages:  # a bug hunt (session 101): the `layers` rule's check offered
            # "map the rule to None", which the check above refuses
            _fail("model.depth", m.depth, f"its {m.depth} layers do not split into "
                  f"mesh.pipeline={stages} stages; choose a depth that {stages} divides or a "
                  f"mesh.pipeline that divides {m.depth}")
        for logical in sorted(mesh.rules):  # a bug hunt (session 90): JAX's error at the
            # first step's trace, the workdir written ("can only refer to Auto axes")
            if logical != "layers" and "pipeline" in mesh.mesh_axes_of(logical):
                _fail(f"mesh.rules.{logical}", mesh.rules[logical],
                      "only mesh.rules.layers may name 'pipeline' when mesh.pipeline > 1 (inside "
                      "a stage that axis is the stage's own); drop 'pipeline' from this rule")
        n_micro = micro or stages
        for field, rows in (("train.batch_size / train.grad_accum", t.batch_size // t.grad_accum),
                            ("data.eval_batch_size (or train.batch_size)", eval_bs)):
            if rows % n_micro:
                _fail("mesh.pipeline_microbatches", micro,
                      f"{n_micro} microbatches must divide the batch the model sees per step, "
                      f"{field} = {rows}; choose a divisor of {rows}")
    return dataclasses.replace(cfg, model=model)
