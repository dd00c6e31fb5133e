"""The checks of the compression fields, which `validate` runs: `quant.*` (QAT and PTQ's
formats and layers), `model.lowrank` (the factorized products) and `train.distill` /
`train.prune` (a teacher, masks and their schedules); and `_refuse_unread`, which `validate`
uses too, for the fields a config sets and nothing reads."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from hpnlp.config.fields import (LOWRANK_LAYERS, QUANT_LAYERS, Config, ModelConfig, QuantConfig,
                                 _check_choice, _check_positive, _fail, config_flag,
                                 layers_name)


def _refuse_unread(group: str, values: Any, why: str, fix: str, *,
                   names: Iterable[str] | None = None, but: Iterable[str] = ()) -> None:
    """The project's rule for a field nothing reads under this config: each of `names` (all
    fields of the dataclass `values` but those in `but`: the switch) set other than its
    default is refused in one line naming it, `why` nothing reads it and `fix` what would
    (a bug hunt, session 99: train.prune.l1 and train.distill.alpha, model.encoder.*,
    model.memory.*, model.pool on an LM and more were taken and ignored)."""
    default = type(values)()
    if names is None:
        names = [f.name for f in dataclasses.fields(values) if f.name not in but]
    for name in names:
        value, was = getattr(values, name), getattr(default, name)
        if value != was:
            _fail(f"{group}.{name}", value, f"{why}, so nothing reads it; {fix}, or leave it "
                  f"at its default ({config_flag(f'{group}.{name}', str(was))})")


# The train.prune fields of the schedules -> the schedules that read them (hpnlp.compress.prune:
# sparsity_at, last_update, imp_boundaries); under any other schedule they are refused
SCHEDULE_FIELDS = {"start_step": ("oneshot", "cubic"), "end_step": ("cubic",),
                   "every": ("cubic",), "rounds": ("imp",), "rewind_step": ("imp",)}


# The QUANT_LAYERS kinds whose input `quant.act_scale='static'` reads by a calibrated range
# (qlinear.quant_act): the output layer reads its hidden states quantized per token, and the
# recurrent product quantizes its weights only (the state h stays float32).
CALIBRATED = ("qkv", "out", "mlp", "head", "input")


def quant_products(m: ModelConfig) -> tuple[str, ...]:
    """The QUANT_LAYERS kinds of product this model has: its trunk's (a Transformer's qkv,
    out and mlp, an LSTM/GRU's input and recurrent; a bag of embeddings has none), an LM's
    output layer, a classifier's or dual encoder's head (a bi-encoder has none)."""
    trunk = {"lstm": ("input", "recurrent"), "gru": ("input", "recurrent"),
             "bag": ()}.get(m.arch, ("qkv", "out", "mlp"))
    return trunk + {"lm": ("output",), "classifier": ("head",),
                    "dual_encoder": ("head",)}.get(m.kind, ())


def _check_quant(q: QuantConfig, m: ModelConfig) -> None:
    """The `quant` group: formats, the int4 group size against every contraction width."""
    from hpnlp.compress import calibrate, formats  # light modules: numerics only

    _check_choice("quant.weights", q.weights, ("none", *formats.FORMATS))
    _check_choice("quant.activations", q.activations, ("none", *formats.ACTIVATION_FORMATS))
    _check_choice("quant.act_scale", q.act_scale, ("dynamic", "static"))
    _check_choice("quant.calibration", q.calibration, calibrate.METHODS)
    if not (isinstance(q.percentile, (int, float)) and 50.0 < q.percentile <= 100.0):
        _fail("quant.percentile", q.percentile, "must be in (50, 100]")
    if q.activations == "binary" and q.weights != "binary":
        _fail("quant.activations", q.activations, "binary activations are XNOR-Net's binary "
              "products and need quant.weights='binary'")
    _check_layers("quant.layers", q.layers, QUANT_LAYERS)
    if q.enabled and m.arch == "transformer_xl":
        _fail("quant.weights", q.weights, "Transformer-XL's relative-position attention has its "
              "own products, not yet quantizable; quantize model.arch='transformer' or an LSTM/GRU")
    if not q.enabled:  # a bug hunt (session 101): each taken, and read by nothing
        _refuse_unread("quant", q, "quant.weights='none' and quant.activations='none' "
                       "quantize nothing", "set quant.weights (or quant.activations)",
                       but=("weights", "activations", "kv_cache"))  # kv_cache works alone
        return
    # a bug hunt (session 101): each of these was taken by QAT and read by nothing, though
    # the PTQ command refuses the same (hpnlp.compress.__main__._check_applies)
    static = q.act_scale == "static"
    if static and (q.activations == "none" or not formats.get(q.activations).uses_range):
        _fail("quant.act_scale", "static", f"calibrates a range per product for int8/fp8 "
              f"activations, and quant.activations={q.activations!r} takes none; set "
              "quant.activations ('int8' or 'fp8'), or use quant.act_scale='dynamic'")
    if q.percentile != QuantConfig.percentile and q.calibration != "percentile":
        _fail("quant.percentile", q.percentile, f"is read only with "
              f"quant.calibration='percentile' (given {q.calibration!r}); set that, or leave "
              f"it at its default (--config.quant.percentile={QuantConfig.percentile})")
    ranged = q.weights != "none" and formats.get(q.weights).uses_range
    if q.calibration != "absmax" and not ranged and not static:
        weights = ("quantizes no weights" if q.weights == "none" else "takes its scale from "
                   "the weights' statistics, not a clipping range")
        _fail("quant.calibration", q.calibration, f"chooses clipping ranges, and quant.weights="
              f"{q.weights!r} {weights}, and no activation range is calibrated (quant.act_scale="
              "'dynamic'), so nothing reads it; leave it 'absmax', or quantize weights to int8, "
              "int4, fp8 or pow2")
    named = [n.strip() for n in q.layers.split(",")] if q.layers != "all" else None
    has = quant_products(m)
    if not has:
        _fail("quant.weights" if q.weights != "none" else "quant.activations",
              q.weights if q.weights != "none" else q.activations, f"a model.arch={m.arch!r} "
              f"{m.kind} has no matrix products to quantize (its bag of embeddings is a "
              "lookup), so it would train in float; set quant.weights='none' and "
              "quant.activations='none'")
    if named is not None and not set(named) & set(has):  # a bug hunt (session 101): the
        # run trained in float without a word, and only its export refused it
        _fail("quant.layers", q.layers, f"names no product of this {m.kind} ({m.arch}), so "
              f"nothing would be quantized (it has {', '.join(has)}); name products it has "
              "(or 'all'); a run saved with it trained in float: set quant.weights and "
              "quant.activations to 'none' in its config.json")
    quantized = [k for k in has if named is None or k in named]
    if q.activations != "none" and quantized == ["recurrent"]:  # a review (r5): QAT trained
        # float activations and PTQ's summary said int8, without a word
        also = " and quant.act_scale='dynamic'" if static else ""
        _fail("quant.activations", q.activations, f"the recurrent product quantizes its weights "
              f"only (the state h stays float32), and quant.layers={q.layers!r} names no other "
              f"product of this {m.kind} ({m.arch}), so nothing reads it; add 'input' to "
              f"quant.layers, or set quant.activations='none'{also} (a run saved with it "
              "trained with float activations: set that in its config.json)")
    if static and not set(quantized) & set(CALIBRATED):  # a review (r5): PTQ restored the run
        # and failed with a KeyError: 'calib' in its first calibration batch
        per = " and ".join(w for k, w in (("output", "the output layer reads its input "
                                           "quantized per token"),
                                          ("recurrent", "the recurrent product quantizes its "
                                           "weights only")) if k in quantized)
        _fail("quant.act_scale", "static", f"calibrates the input ranges of the "
              f"{', '.join(k for k in has if k in CALIBRATED)} products, and quant.layers="
              f"{q.layers!r} names none of them ({per}), so nothing would be calibrated; use "
              "quant.act_scale='dynamic', or name such a product in quant.layers")
    if q.act_scale == "static" and m.reversible:
        _fail("quant.act_scale", "static", "reversible blocks recompute themselves functionally and "
              "hold no calibrated ranges; use quant.act_scale='dynamic'")
    if not isinstance(q.group_size, int) or q.group_size < 0:
        _fail("quant.group_size", q.group_size, "must be an integer >= 0 (0: per channel)")
    if q.group_size and q.weights != "int4":
        _fail("quant.group_size", q.group_size, f"group scales are for quant.weights='int4' "
              f"(got {q.weights!r}); set quant.group_size=0")
    if q.group_size:  # every contraction the quantized products sum over must split evenly
        for name, width in _quantized_contractions(m, quantized).items():
            if width % q.group_size:
                _fail("quant.group_size", q.group_size, f"must divide {name}={width} (int4 "
                      "groups split each product's contraction); choose a divisor of it")


def _quantized_contractions(m: ModelConfig, quantized: list[str]) -> dict[str, int]:
    """{name: width} of the contractions the `quantized` kinds of product sum over in this
    model, which int4 groups split (and N:M pruning's, of the pruned kinds) (a review: every
    arch was checked against the Transformer's width, mlp_dim and heads, whatever
    quant.layers named, so an LSTM of width 96 in groups of 48 was refused on a
    model.mlp_dim it does not have). Where a product contracts a multiple of a width (a
    bidirectional RNN's 2 x width into its next layer and its head, MoE's shared experts), a
    divisor of the width divides it too. MoE experts' width (checks._check_moe; N:M's in
    _check_compress) and the low-rank ranks (_check_lowrank) are checked there."""
    on = set(quantized)
    dual = "head" in on and m.kind == "dual_encoder"
    widths = {}
    # qkv, the MLP's first product (each expert's too), the output layer, a classifier's
    # head and an RNN's input (its first layer reads the embeddings) and recurrent products
    if on & {"qkv", "mlp", "output", "input", "recurrent"} or ("head" in on and not dual):
        widths["model.width"] = m.width
    elif dual:  # its first head product reads [u, v, u*v, u-v] of the pooled encodings
        widths["the dual encoder head's input 4 * model.width"] = 4 * m.width
    dense = not all(m.moe.applies(i) for i in range(m.depth))  # any block's MLP not MoE
    if ("mlp" in on and dense) or dual:  # the dense MLP's second product; the dual
        widths["model.mlp_dim"] = m.mlp_dim  # encoder's second head product (its classes')
    if "out" in on:  # the attention output: every head's values
        widths["model.num_heads * head size"] = m.num_heads * m.dims_per_head()
    return widths


def _kept_units(n: int, sparsity: float) -> int:
    """Of `n` units, how many structured pruning at `sparsity` keeps (never none), counted
    in float32 as the masks count them (compress.prune.units_pruned)."""
    import numpy as np
    return n - min(int(np.round(np.float32(sparsity) * np.float32(n))), n - 1)


def _shrunk_units(cfg: Config) -> dict[str, tuple[int, int, str | None]]:
    """{name: (units, each unit's size, the logical axis that shards it)} of what structured
    pruning narrows in the shrunk model (None: an expert's width, which no config check
    splits over the mesh: its weights' shardings replicate where it does not divide)."""
    p, m = cfg.train.prune, cfg.model
    if m.arch in ("lstm", "gru"):  # the embedding's width: its "embed" axis
        return {"model.width": (m.width, 1, "embed")}
    units = {}
    if layers_name(p.layers, "mlp"):  # the dense blocks' neurons, each expert's
        if not all(m.moe.applies(i) for i in range(m.depth)):
            units["model.mlp_dim"] = (m.mlp_dim, 1, "mlp")
        if m.moe.enabled():
            units["model.moe.mlp_dim (each expert's)"] = (m.moe.expert_dim(m), 1, None)
    if layers_name(p.layers, "qkv") or layers_name(p.layers, "out"):
        units["model.num_heads * head size"] = (m.num_heads, m.dims_per_head(), "heads")
    return units


def _check_shrunk_groups(cfg: Config) -> None:
    """Structured pruning under int4 groups: the shrunk model's contractions (the units kept,
    as compress.prune.units_pruned counts them) must split into quant.group_size groups too,
    or `shrink` refuses the trained run (a bug hunt, session 94: found after training)."""
    p, g = cfg.train.prune, cfg.model.quant.group_size
    if not g or not isinstance(p.sparsity, (int, float)):
        return
    kept, q = _kept_units, cfg.model.quant
    # the product whose contraction each sums over: the kept heads' values reach the
    # attention output's, the kept neurons the MLP's second (each expert's); an RNN's width
    # every product's. Only a quantized one is grouped (a review, session 115: heads kept
    # that 32 did not divide were refused under quant.layers='qkv,mlp', whose `out` is float)
    reads = {"model.num_heads * head size": "out", "model.mlp_dim": "mlp",
             "model.moe.mlp_dim (each expert's)": "mlp"}
    for name, (n, size, _) in _shrunk_units(cfg).items():
        if name in reads and not q.applies(reads[name]):
            continue
        if kept(n, p.sparsity) * size % g:
            fits = [s / 100 for s in range(1, 100) if kept(n, s / 100) * size % g == 0]
            _fail("train.prune.sparsity", p.sparsity, f"keeps {kept(n, p.sparsity) * size} of "
                  f"{name}={n * size} in the shrunk model, which quant.group_size={g} does not "
                  "divide (int4 groups split each product's contraction); choose a sparsity "
                  f"that keeps a multiple of {g}" + (f" (e.g. {fits[len(fits) // 2]})" if fits
                                                     else "") + " or another group size")


def _check_shrunk_mesh(cfg: Config) -> None:
    """Structured pruning on a mesh: the shrunk model's heads, model.mlp_dim neurons or
    LSTM/GRU width must split over the mesh axes that shard them, as `validate` asks of every
    run, or `shrink` refuses the trained run (a review, session 107: kept heads that
    mesh.tensor did not split were refused after training, and shrink has no flag to change
    the mesh). A new run's rule (a saved run is still read and evaluated); only mesh axes of
    a fixed size count here (a -1 axis follows the devices, and `shrink` checks it)."""
    p, mesh = cfg.train.prune, cfg.mesh
    if p.method == "none" or p.structure != "structured":
        return
    units = {name: (n, size, math.prod(getattr(mesh, a) for a in mesh.mesh_axes_of(logical)),
                    logical) for name, (n, size, logical) in _shrunk_units(cfg).items()
             if logical and -1 not in [getattr(mesh, a) for a in mesh.mesh_axes_of(logical)]}
    kept = _kept_units
    for name, (n, size, split, logical) in units.items():
        if kept(n, p.sparsity) % split:
            fits = [s / 100 for s in range(1, 100)
                    if all(kept(n2, s / 100) % d == 0 for n2, _, d, _ in units.values())]
            axes = " x ".join(f"mesh.{a}={getattr(mesh, a)}" for a in mesh.mesh_axes_of(logical))
            _fail("train.prune.sparsity", p.sparsity, f"keeps {kept(n, p.sparsity)} of "
                  f"{name.split(' * ')[0]}={n} in the shrunk model, and mesh.rules.{logical} "
                  f"splits them over {axes}, which does not divide that, so `shrink` would "
                  "refuse the trained run; choose a sparsity that keeps a multiple of "
                  f"{split}" + (f" (e.g. {fits[len(fits) // 2]})" if fits else "")
                  + f", or another mesh (mesh.rules.{logical}=None replicates them)")


def _output_vectors(cfg: Config) -> bool:
    """Whether the LM's output layer is one [V, E] matrix of output vectors (a VocabLayer:
    full, sampled, nce, ...), the weight model.lowrank factorizes and pruning masks as
    'output'; adaptive, hierarchical, binary_code and vmf keep their own tables."""
    from hpnlp import softmax  # late: the registry (output.name is checked after this)
    from hpnlp.softmax.base import VocabLayer
    return issubclass(softmax.get(cfg.output.name), VocabLayer)


def _check_layers(field: str, layers: str, allowed) -> None:
    """A `layers` field: "all" or a comma list of `allowed` product kinds."""
    if layers == "all":
        return
    names = [n.strip() for n in layers.split(",")]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        _fail(field, layers, f"'all' or a comma list of {list(allowed)} (unknown: {bad})")


def _check_lowrank(cfg: Config) -> None:
    """`model.lowrank`: the rank against every chosen product's shape, what it combines with."""
    lr, m = cfg.model.lowrank, cfg.model
    if not isinstance(lr.rank, int) or lr.rank < 0:
        _fail("model.lowrank.rank", lr.rank, "must be an integer >= 0 (0: no factorization)")
    if not isinstance(lr.energy, (int, float)) or not 0.0 <= lr.energy <= 1.0:
        _fail("model.lowrank.energy", lr.energy, "the kept fraction of sum(S^2) must be in (0, 1] "
              "(0: off)")
    if lr.rank and lr.energy:
        _fail("model.lowrank.energy", lr.energy, "give a fixed model.lowrank.rank or a kept "
              "energy, not both")
    if lr.ranks and not lr.energy:
        _fail("model.lowrank.ranks", dict(lr.ranks), "is filled from model.lowrank.energy when "
              "the run is built; set model.lowrank.energy (or one model.lowrank.rank) instead")
    bad = {k: v for k, v in lr.ranks.items() if not isinstance(v, int) or v < 1}
    if bad:
        _fail("model.lowrank.ranks", bad, "ranks must be integers >= 1")
    if lr.energy and not lr.ranks and not cfg.train.init_from:
        _fail("model.lowrank.energy", lr.energy, "measures the energy of trained weights: set "
              "train.init_from to the run to factorize")
    if not lr.enabled():
        _refuse_unread("model.lowrank", lr, "model.lowrank.rank=0 (and no energy) factorizes "
                       "nothing", "set model.lowrank.rank (or model.lowrank.energy)",
                       names=("layers",))
        return
    _check_layers("model.lowrank.layers", lr.layers, LOWRANK_LAYERS)
    if m.arch != "transformer" and any(lr.applies(k) for k in ("qkv", "out", "mlp")):
        _fail("model.lowrank.layers", lr.layers, f"model.arch={m.arch!r} has no qkv/out/mlp "
              "products; factorize a Transformer, or set model.lowrank.layers to what it has "
              "('embed,output' for an LM, 'embed,head' for a classifier)")
    hd = m.num_heads * m.dims_per_head()
    # grouped key/value heads: q [E, H*D] and kv [E, 2*G*D] are two qkv products
    qkv = 3 * hd if m.kv_heads() == m.num_heads else min(hd, 2 * m.kv_heads() * m.dims_per_head())
    shapes = [("qkv", (m.width, qkv)), ("out", (hd, m.width))]
    if m.kv_latent_dim:  # latent attention (a bug hunt: a rank past C + R failed at init,
        # naming no field): q [E, H*D] and kv_down [E, C + R] are its qkv products
        shapes[0] = ("qkv", (m.width, min(hd, m.kv_latent_dim + m.latent_rope_dims())))
    if not all(m.moe.applies(i) for i in range(m.depth)):  # a dense block's MLP
        shapes.append(("mlp", (m.width, m.mlp_dim)))
    if m.moe.enabled():  # each expert's own products (the shared experts' are wider)
        shapes.append(("mlp", (m.width, m.moe.expert_dim(m))))
    for kind, (k, n) in shapes:  # the heads' once the task's classes are known
        if lr.rank and lr.applies(kind) and lr.rank > min(k, n):
            _fail("model.lowrank.rank", lr.rank, f"the {kind} product is [{k}, {n}], of rank at "
                  f"most {min(k, n)} (and its factors hold fewer parameters than it only below "
                  f"rank {-(-k * n // (k + n))}); lower the "
                  f"rank or drop {kind!r} from model.lowrank.layers")
    named = {n.strip() for n in lr.layers.split(",")}  # "all": whichever the model has
    if "output" in named and m.kind != "lm":
        _fail("model.lowrank.layers", lr.layers, f"'output' is an LM's output layer and "
              f"model.kind={m.kind!r} has none; drop 'output' (a classifier's is 'head')")

    if "output" in named and m.kind == "lm" and not _output_vectors(cfg):
        _fail("model.lowrank.layers", lr.layers, f"output layer {cfg.output.name!r} keeps "
              "its own tables, not one [V, E] matrix of output vectors; drop 'output' or "
              "use output.name='full' (or another VocabLayer: sampled, nce, ...)")
    tied = m.kind == "lm" and cfg.output.tie_embeddings
    if tied and lr.applies("embed") and not _output_vectors(cfg):
        _fail("model.lowrank.layers", lr.layers, f"output layer {cfg.output.name!r} reads "
              "the tied embedding table itself, so the table cannot be factorized; drop "
              "'embed' from model.lowrank.layers")
    if lr.applies("embed") and tied and not lr.applies("output"):
        _fail("model.lowrank.layers", lr.layers, "the input embedding is the output layer's "
              "table (output.tie_embeddings=True): one weight, factorized as the output "
              "layer's; name 'output' too (or instead)")
    if (lr.applies("embed") or (tied and lr.applies("output"))) and m.embed_grad_scale != "none":
        _fail("model.embed_grad_scale", m.embed_grad_scale, "scales each looked-up row's "
              "gradient, and a factorized embedding has no rows of its own; set it to 'none' "
              "or drop 'embed' from model.lowrank.layers")
    q = m.quant
    # the fixed ranks; none while model.lowrank.energy waits to choose them at build time
    ranks = sorted({lr.rank} if lr.rank else set(lr.ranks.values()))
    if q.applies("output") and lr.applies("output"):
        _fail("quant.layers", q.layers, "names the output layer, whose table model.lowrank "
              "factorizes, and a factorized output table is not quantized yet; leave 'output' "
              "out of quant.layers (the table stays float) or out of model.lowrank.layers")
    if q.group_size and any(q.applies(k) and lr.applies(k) for k in ("qkv", "out", "mlp", "head")):
        if not ranks:  # model.lowrank.energy, resolved when the run is built
            _fail("quant.group_size", q.group_size, "int4 groups split the rank of each "
                  "factorized product, and model.lowrank.energy chooses the ranks later; use "
                  "model.lowrank.rank, or quant.group_size=0")
        if any(r % q.group_size for r in ranks):
            _fail("quant.group_size", q.group_size, f"must divide the rank of every factorized "
                  f"product (ranks {ranks}: x U [*, r] is the second product's input); choose "
                  "a divisor of them, or quant.group_size=0")
    pr = cfg.train.prune
    try:
        nm = pr.nm()
    except ValueError:  # a malformed structure: refused with the prune fields
        nm = None
    if pr.method != "none" and nm and any(pr.applies(k) and lr.applies(k)
                                               for k in LOWRANK_LAYERS):
        M = nm[1]
        if not ranks or any(r % M for r in ranks):
            _fail("train.prune.structure", pr.structure, f"groups M={M} consecutive weights "
                  "along each factor's contraction, and V's is the rank: M must divide every "
                  f"rank ({ranks or 'chosen later by model.lowrank.energy'}); choose ranks that "
                  "M divides (model.lowrank.rank), or unstructured pruning")
    if pr.method != "none" and pr.structure == "structured":
        _fail("train.prune.structure", pr.structure, "removes whole heads and neurons, which a "
              "factorized weight's U and V do not own apart; prune and shrink before "
              "factorizing, or prune unstructured or N:M (each factor pruned)")
    for field, value, on, also in (("model.stack_layers", True, m.stack_layers,
                                    " (and mesh.pipeline=1)"),
                                   ("model.reversible", True, m.reversible, "")):
        if on:  # a bug hunt (session 95): "factorize first" led to the same refusal
            kind = "stacked" if field.endswith("stack_layers") else "reversible"
            _fail(field, value, f"model.lowrank does not factorize {kind} blocks yet; set "
                  f"{field}=False{also}, or model.lowrank.rank=0")


def check_new_compress_run(cfg: Config) -> None:
    """What a run that has saved no checkpoint yet is refused, though `validate` takes it in
    a saved config.json (a run trained before the rule is still read and resumed): a
    dual encoder's MLP neurons pruned structurally (a review, session 104: its matching head
    is model.mlp_dim wide too, no group of the blocks, so the shrunk run's head kept the old
    width and failed to build after the masked model was evaluated and the shrunk one
    written). Its heads can go; so can an all-MoE trunk's experts' neurons. And kept units
    that the mesh does not split (`_check_shrunk_mesh`), and the rules of a review of session
    107 (`_check_new_distill`, `_check_new_prune` and model.lowrank.layers below): each was
    first put in `validate`, which a later review found refused every reader and resume of a
    run saved before it, some of them holding only defaults."""
    p, m, lr = cfg.train.prune, cfg.model, cfg.model.lowrank
    # the kinds this model has: quant's but an RNN's own (which model.lowrank does not
    # factorize), and every model's embedding table
    has = [k for k in quant_products(m) if k in LOWRANK_LAYERS] + ["embed"]
    named = {n.strip() for n in lr.layers.split(",")}
    if lr.enabled() and lr.layers != "all" and not named & set(has):  # 'head' on an LM or
        # a bi-encoder trained dense, its config.json saying model.lowrank.rank (a saved
        # one is read as it trained: model.lowrank finds no product to factorize)
        _fail("model.lowrank.layers", lr.layers, f"names no product of this {m.kind} "
              f"({m.arch}), so nothing would be factorized (it has {', '.join(has)}); name "
              "products it has (or 'all')")
    if lr.ranks:  # a review (session 118): a new run given them (another run's config.json)
        # skipped the energy's measure and factorized by ranks nothing checked against this
        # model, a missing path at rank 0 and a rank past a weight's in lowrank's ValueError
        _fail("model.lowrank.ranks", dict(lr.ranks), "is written by a run that chose them from "
              "model.lowrank.energy when it was built, and a new run measures its own; leave "
              "it unset (a fixed rank for every product: model.lowrank.rank)")
    if cfg.train.distill.teacher:
        _check_new_distill(cfg)
    if p.method != "none":
        _check_new_prune(cfg)
    if (p.method != "none" and p.structure == "structured" and m.kind == "dual_encoder"
            and m.arch == "transformer" and layers_name(p.layers, "mlp")
            and not all(m.moe.applies(i) for i in range(m.depth))):
        _fail("train.prune.layers", p.layers, f"a dual_encoder's matching head is "
              f"model.mlp_dim={m.mlp_dim} wide too, and shrink narrows model.mlp_dim to the "
              "neurons its blocks keep; prune its heads alone (train.prune.layers='qkv,out')")
    _check_shrunk_mesh(cfg)


def _check_new_distill(cfg: Config) -> None:
    """`train.distill` fields a new run is refused (a review, session 107): each taken where
    compress/distill.py reads none."""
    dist, m = cfg.train.distill, cfg.model
    if dist.init != "none" and cfg.train.init_from:  # read, converted or factorized, then
        # every weight replaced by the teacher's
        _fail("train.init_from", cfg.train.init_from, f"train.distill.init={dist.init!r} "
              "starts the student as the teacher's blocks, which replace every weight "
              "read from it; drop train.init_from, or set train.distill.init='none'")
    if dist.init not in ("importance", "pca"):  # (a START_FIELD: a resume keeps the saved
        # value in config.json, which is why a saved run must still validate with it)
        _refuse_unread("train.distill", dist, f"it sizes the teacher's unit ranking of "
                       f"train.distill.init='importance' or 'pca', and "
                       f"train.distill.init={dist.init!r} ranks none", "set "
                       "train.distill.init='importance' (or 'pca')",
                       names=("importance_batches",))
    if not (dist.alpha or dist.hidden or dist.attention) and dist.init == "none":
        # a review (session 115): the teacher loaded, carried and saved in every checkpoint,
        # and read by nothing (Distiller.loss computes no teacher term, no init copies it)
        _fail("train.distill.alpha", dist.alpha, "with train.distill.hidden=0, "
              "train.distill.attention=0 and train.distill.init='none' the teacher "
              f"{dist.teacher!r} is read by nothing; give it a weight (train.distill.alpha, "
              "hidden or attention > 0) or an init (train.distill.init), or drop "
              "train.distill.teacher")
    if not (dist.alpha or dist.hidden or dist.attention):  # compress/distill.py's
        # `Distiller.loss` computes no soft targets then (no teacher forward). Under
        # alpha=0 with hidden or attention matching it still computes and logs loss_soft
        # (temperature and chunk_tokens shape it), so they are taken there
        _refuse_unread("train.distill", dist, "it shapes the soft targets' loss, and "
                       "train.distill.alpha=0 gives it no weight", "set train.distill.alpha "
                       "> 0", names=("temperature", "chunk_tokens"))
    elif m.kind != "lm":
        _refuse_unread("train.distill", dist, f"it chunks an LM's soft targets over its "
                       f"vocabulary, and a model.kind={m.kind!r} model's are its classes' "
                       "(never chunked)", "distill an LM (model.kind='lm')",
                       names=("chunk_tokens",))


def _check_new_prune(cfg: Config) -> None:
    """`train.prune` settings a new run is refused (a review, session 107; 'output' of an
    output layer with its own tables: review r11; layers that name no product the model has:
    review r1, once refused by PruneCarry.init). A run saved with one trained (some are
    defaults: train.prune.layers on Transformer-XL; a one-shot schedule at start_step 0), so
    it must still validate: its config.json is read, and resumed as it trained."""
    p, m = cfg.train.prune, cfg.model
    tables = m.kind == "lm" and not _output_vectors(cfg)  # no 'output' product to prune
    if m.arch == "transformer_xl" and any(layers_name(p.layers, k) for k in ("qkv", "out")):
        # its qkv, rel and out are plain einsums no pruning masks, so they stayed dense while
        # summary.json reported the target (and 'qkv,out' alone failed at init: "names no
        # product this model has"); 'output' offered only where the rule below takes it (a
        # review, d1: two refusals in a row)
        _fail("train.prune.layers", p.layers, "Transformer-XL's relative-position attention "
              "has its own qkv, rel and out products, not prunable yet, so they would stay "
              "dense; set train.prune.layers='mlp'"
              + ("" if tables else " (or 'mlp,output' for its output layer too)"))
    named = {n.strip() for n in p.layers.split(",")}  # "all": whichever the model has
    if "output" in named and tables:
        # review r11: only a VocabLayer records the 'output' product, so the others' tables
        # stayed dense while summary.json reported the target ('output' alone failed at
        # init: "names no product this model has")
        _fail("train.prune.layers", p.layers, f"output layer {cfg.output.name!r} keeps its "
              "own tables, not one [V, E] matrix of output vectors, so pruning would leave "
              "them dense; drop 'output' or use output.name='full' (or another VocabLayer: "
              "sampled, nce, ...)")
    # the kinds a pruner finds in this model (`prune.targets`): quant's, but Transformer-XL's
    # attention (refused above) and an output layer of its own tables
    has = [k for k in quant_products(m) if not (k == "output" and tables) and not (
        m.arch == "transformer_xl" and k in ("qkv", "out"))]
    if not set(has) & (set(has) if p.layers == "all" else named):
        # review r1: refused by PruneCarry.init, after the data (a bpe tokenizer trained) were
        # built, as quant.layers and model.lowrank.layers are before anything is
        _fail("train.prune.layers", p.layers, f"names no product of this {m.kind} ({m.arch}), "
              f"so nothing would be pruned (it has {', '.join(has) or 'none'}); "
              + ("name products it has (or 'all')" if has else
                 "set train.prune.method='none'"))
    if p.method == "movement" and p.schedule == "oneshot" and p.start_step == 0:
        # after one step each Adam score is -sign(dL/dS) (m / sqrt(v) = d / |d|), so the one
        # mask made was one batch's gradient signs, ties pruned by position (a kernel's
        # leading rows), and a one-shot mask is never made again
        why = ("makes its one mask after step 0, from one batch's movement scores: each is "
               "that batch's gradient sign (+-1), so ties are pruned by position")
        if p.structure != "unstructured":  # N:M: made once, at start_step (one-shot only)
            _fail("train.prune.start_step", p.start_step, f"N:M movement pruning {why}; set "
                  "train.prune.start_step > 0 so the scores accumulate first (or "
                  "train.prune.method='magnitude')")
        _fail("train.prune.schedule", p.schedule, f"with train.prune.method='movement' and "
              f"train.prune.start_step=0 it {why}; use train.prune.schedule='cubic' (masks "
              "recomputed as the scores accumulate, a pruned weight able to come back), or "
              "a start_step > 0 for a one-shot mask of accumulated scores")


def _check_compress(cfg: Config) -> None:
    """`train.distill` and `train.prune` (hpnlp.compress): fields, and what they combine with."""
    dist, p, m = cfg.train.distill, cfg.train.prune, cfg.model
    if not dist.teacher:
        _refuse_unread("train.distill", dist, "train.distill.teacher='' distills from no "
                       "teacher", "set train.distill.teacher to a trained run's workdir",
                       but=("teacher",))
    else:
        if not 0.0 <= dist.alpha <= 1.0:
            _fail("train.distill.alpha", dist.alpha, "the soft-target weight must be in [0, 1]")
        _check_positive("train.distill.temperature", dist.temperature)
        if not isinstance(dist.chunk_tokens, int) or dist.chunk_tokens < -1:
            _fail("train.distill.chunk_tokens", dist.chunk_tokens, "-1 (automatic), 0 (never) or "
                  "a positive number of tokens")
        _check_positive("train.distill.hidden", dist.hidden, allow_zero=True)
        _check_positive("train.distill.attention", dist.attention, allow_zero=True)
        if dist.attention:
            from hpnlp import attention as attention_lib
            if not attention_lib.get(cfg.attention.name).returns_probabilities:
                _fail("train.distill.attention", dist.attention, f"attention variant "
                      f"{cfg.attention.name!r} does not return its probabilities; use "
                      "attention.name='dense' for attention-map distillation")
        _check_choice("train.distill.init", dist.init, ("none", "every_other", "select",
                                                         "importance", "pca"))
        _check_choice("train.distill.init_blocks", dist.init_blocks, ("first", "last"))
        if dist.init_blocks != "first" and dist.init == "none":
            _fail("train.distill.init_blocks", dist.init_blocks, "picks the teacher blocks the "
                  "student starts as, and train.distill.init='none' starts it from none; set "
                  "train.distill.init to every_other, select, importance or pca")
        if (isinstance(dist.importance_batches, bool) or not isinstance(dist.importance_batches, int)
                or dist.importance_batches < 1):
            _fail("train.distill.importance_batches", dist.importance_batches,
                  "must be a whole number of training batches >= 1")
        blocks = dist.matches_blocks()
        if blocks and (m.kind == "dual_encoder" or m.arch != "transformer"):
            _fail(*blocks, "matches Transformer blocks of an LM or classifier; this run has "
                  f"model.kind={m.kind!r}, model.arch={m.arch!r}")
        if m.kind == "bi_encoder":  # a bug hunt (session 94): a traceback in the first step
            _fail("train.distill.teacher", dist.teacher, "distillation matches the teacher's "
                  "predicted distributions, and a bi-encoder predicts none (it scores pairs of "
                  "embeddings against the batch); distill an lm, classifier or dual_encoder run")
        if m.arch == "transformer_xl" and cfg.data.batching == "stream":
            from hpnlp.config.checks import xl_on_pack
            _fail("train.distill.teacher", dist.teacher, "Transformer-XL on a stream carries "
                  "memory through its loss and cannot distill yet; " + xl_on_pack(m))
    _check_choice("train.prune.method", p.method, ("none", "magnitude", "random", "movement"))
    if p.method == "none":  # no pruner is built (hpnlp.train.carry): no masks, no L1 loss
        _refuse_unread("train.prune", p, "train.prune.method='none' prunes nothing", "set "
                       "train.prune.method ('magnitude', 'random' or 'movement')", but=("method",))
        return
    if not (isinstance(p.sparsity, (int, float)) and 0.0 <= p.sparsity < 1.0):
        _fail("train.prune.sparsity", p.sparsity, "the fraction pruned must be in [0, 1)")
    _check_choice("train.prune.scope", p.scope, ("layer", "global"))
    _check_choice("train.prune.schedule", p.schedule, ("oneshot", "cubic", "imp"))
    # a review: imp's start_step, oneshot's end_step and every, cubic's rounds were taken and
    # ignored (imp prunes at its rounds' boundaries, hpnlp.compress.prune.imp_boundaries)
    for name, by in SCHEDULE_FIELDS.items():
        if p.schedule not in by:
            _refuse_unread("train.prune", p, f"train.prune.schedule={p.schedule!r} does not use "
                           "it", f"use train.prune.schedule={' or '.join(map(repr, by))} for it",
                           names=(name,))
    if p.schedule == "imp":
        for name in ("rounds", "rewind_step"):
            v = getattr(p, name)
            if not isinstance(v, int) or v < (1 if name == "rounds" else 0):
                _fail(f"train.prune.{name}", v, "must be an integer >= "
                      + ("1 (pruning rounds)" if name == "rounds" else "0"))
        if (cfg.train.steps - p.rewind_step) < p.rounds + 1:
            _fail("train.prune.rounds", p.rounds, f"train.steps={cfg.train.steps} after "
                  f"rewind_step={p.rewind_step} cannot make rounds + 1 training segments")
        if p.method not in ("magnitude", "random") or p.structure != "unstructured":
            _fail("train.prune.schedule", p.schedule, "iterative pruning with rewinding takes "
                  "method 'magnitude' (or 'random', the control) and structure 'unstructured'")
    for name in ("start_step", "end_step"):
        v = getattr(p, name)
        if not isinstance(v, int) or v < 0:
            _fail(f"train.prune.{name}", v, "must be an integer >= 0")
    _check_positive("train.prune.l1", p.l1, allow_zero=True)
    if not isinstance(p.every, int) or p.every < 1:
        _fail("train.prune.every", p.every, "must be an integer >= 1 (steps between mask updates)")
    if m.stack_layers or m.reversible:
        # pipeline stages need stacked layers: said, or the fix led to the pipeline's refusal
        # (review r10, session 108; the low-rank twin's was mended so in session 95)
        also = " (and mesh.pipeline=1)" if cfg.mesh.pipeline != 1 else ""
        _fail("model.stack_layers" if m.stack_layers else "model.reversible", True, "pruning "
              "masks are per layer; prune a model with model.stack_layers=False and "
              f"model.reversible=False{also}")
    end = p.end_step or cfg.train.steps
    if p.schedule == "cubic" and end <= p.start_step:
        _fail("train.prune.end_step", p.end_step, f"the cubic schedule needs end_step (0: "
              f"train.steps={cfg.train.steps}) after start_step={p.start_step}")
    # found in review: schedules past the run were accepted, and pruned nothing (or never
    # reached their sparsity) without a word
    if p.schedule != "imp" and p.start_step >= cfg.train.steps:
        _fail("train.prune.start_step", p.start_step, f"pruning would start after the run's "
              f"last step (train.steps={cfg.train.steps}, steps 0..{cfg.train.steps - 1}); "
              "choose a start_step below train.steps")
    if p.schedule == "cubic" and p.end_step > cfg.train.steps:
        _fail("train.prune.end_step", p.end_step, f"the cubic schedule would not reach its "
              f"sparsity within train.steps={cfg.train.steps}; choose end_step <= train.steps "
              "(0: the run's end)")
    _check_layers("train.prune.layers", p.layers, QUANT_LAYERS)
    q = m.quant
    both = [k for k in quant_products(m) if q.applies(k) and layers_name(p.layers, k)]
    if q.weights == "binary" and both:  # a bug hunt: taken, and every pruned weight computed
        # as -scale (binary codes have no zero), the run reporting its sparsity
        _fail("train.prune.method", p.method, f"pruned weights must compute as zero, and "
              f"quant.weights='binary' codes are +-1 (no zero) in {both}; use "
              "quant.weights='ternary' (which has zero), or leave those products out of "
              "train.prune.layers or quant.layers")
    if p.structure == "structured":
        if m.arch in ("lstm", "gru"):  # hidden units: model.width channels (compress.prune)
            if cfg.rnn.layer_norm:
                _fail("rnn.layer_norm", True, "structured pruning removes hidden units, but layer "
                      "norm mixes every unit's gates (removing one renormalizes the rest); set "
                      "rnn.layer_norm=False or use train.prune.structure='unstructured'")
            if cfg.rnn.bidirectional:
                _fail("rnn.bidirectional", True, "structured pruning cannot remove hidden units of "
                      "a bidirectional layer yet; set rnn.bidirectional=False")
            if m.kind not in ("lm", "classifier"):
                _fail("model.kind", m.kind, "structured pruning of an LSTM/GRU knows the "
                      "consumers of the 'lm' and 'classifier' trunks only")
            if m.kind == "lm" and cfg.output.name != "full":
                _fail("output.name", cfg.output.name, "structured pruning of an LSTM/GRU removes "
                      "hidden units from the 'full' output layer only")
            if not (layers_name(p.layers, "input") and layers_name(p.layers, "recurrent")):
                _fail("train.prune.layers", p.layers, "an LSTM/GRU hidden unit owns input and "
                      "recurrent weights; name both (e.g. 'input,recurrent')")
        elif m.arch != "transformer":
            _fail("train.prune.structure", p.structure, "structured pruning removes Transformer "
                  f"heads and MLP neurons and LSTM/GRU hidden units; model.arch={m.arch!r} has "
                  "none: use 'unstructured' or 'N:M'")
        if p.method not in ("magnitude", "random"):
            _fail("train.prune.method", p.method, "structured pruning ranks whole heads and "
                  "neurons by 'magnitude' (their weights' L2 norm) or 'random'")
        if p.scope != "layer":
            _fail("train.prune.scope", p.scope, "structured pruning removes the same number of "
                  "heads and neurons from every block (so the shrunk model is one config); set "
                  "train.prune.scope='layer'")
        from hpnlp import attention as attention_lib
        heads = m.arch == "transformer" and (layers_name(p.layers, "qkv")
                                             or layers_name(p.layers, "out"))
        if heads and m.kv_heads() < m.num_heads:
            _fail("train.prune.structure", p.structure, f"model.num_kv_heads={m.num_kv_heads} "
                  "shares each key/value head among query heads, so removing a head is not one "
                  "slice of each product; set train.prune.layers='mlp' (or prune a multi-head "
                  "model)")
        if heads and m.kv_latent_dim:
            _fail("train.prune.structure", p.structure, f"model.kv_latent_dim={m.kv_latent_dim} "
                  "derives every head's keys and values from one shared latent, so removing a "
                  "head is not one slice of each product; set train.prune.layers='mlp'")
        if heads and not attention_lib.get(cfg.attention.name).heads_independent:
            free = [n for n in attention_lib.names() if attention_lib.get(n).heads_independent]
            _fail("train.prune.structure", p.structure, f"attention variant "
                  f"{cfg.attention.name!r} has per-head parameters or random draws, so its heads "
                  f"cannot be removed; use a variant whose heads are independent ({', '.join(free)}) "
                  "or set train.prune.layers='mlp'")
        extra = sorted(k for k in QUANT_LAYERS if layers_name(p.layers, k)
                       and k not in ("qkv", "out", "mlp", "input", "recurrent"))
        if extra:
            _fail("train.prune.layers", p.layers, f"structured pruning removes heads (qkv, out), "
                  f"MLP neurons (mlp) and LSTM/GRU hidden units (input, recurrent); {extra} have "
                  "no such units")
        _check_shrunk_groups(cfg)
    elif p.structure != "unstructured":
        try:
            n, mm = (int(v) for v in p.structure.split(":"))
        except ValueError:
            n = mm = None
        if n is None or not 0 < n < mm:
            _fail("train.prune.structure", p.structure, "'unstructured', 'structured' (heads and "
                  "MLP neurons) or 'N:M' with 0 < N < M (e.g. '2:4': 2 kept in every 4 weights "
                  "along the contraction)")
        default = type(p)().sparsity
        if abs(p.sparsity - default) > 1e-12 and abs(p.sparsity - (1 - n / mm)) > 1e-9:
            # found by a bug hunt: taken and ignored (the masks keep N of every M)
            _fail("train.prune.sparsity", p.sparsity, f"N:M structure {p.structure!r} fixes "
                  f"the sparsity at 1 - N/M = {1 - n / mm:g}; drop train.prune.sparsity or set "
                  f"it to {1 - n / mm:g}, or choose another N:M")
        if p.scope != "layer":
            _fail("train.prune.scope", p.scope, "N:M groups are pruned each on its own; set "
                  "train.prune.scope='layer'")
        if p.schedule != "oneshot":
            _fail("train.prune.schedule", p.schedule, "N:M masks are made once, at start_step; "
                  "set train.prune.schedule='oneshot'")
        # the contractions of the products pruned, as int4 groups check theirs (review r11:
        # every Transformer width was checked whatever the arch and train.prune.layers, so
        # an LSTM of width 96 under '1:3' was refused on a model.mlp_dim it does not have)
        pruned = [k for k in quant_products(m) if layers_name(p.layers, k)]
        widths = _quantized_contractions(m, pruned)
        if m.moe.enabled() and "mlp" in pruned:  # found in review: the experts' own width
            widths["model.moe.mlp_dim (each expert's width)"] = m.moe.expert_dim(m)
        for field, width in widths.items():
            if width % mm:
                _fail("train.prune.structure", p.structure, f"M={mm} must divide {field}={width} "
                      "(groups split each product's contraction)")
