"""Post-training quantization of a trained run: calibrate, pack, evaluate, reload, report.

    python -m hpnlp.compress quantize --workdir /tmp/hpnlp/lm_bytes --out /tmp/hpnlp/lm_w8a8 \\
        --weights int8 --activations int8 --act_scale static --calibration percentile

1. The run's config (`WORKDIR/config.json`) and newest checkpoint are restored, and the
   float model is evaluated on the held-out split with the task's own metric.
2. The `quant.*` settings are checked (one line naming the field) before anything compiles.
3. Calibration (`act_scale=static`): `--calib_batches` training batches, in order from the
   start of the split (deterministic), run through the model with activations in float;
   each product records its input's range per batch (`calibrate.choose_range`) and the
   batches combine by `calibrate.combine`. Those ranges are the `quant` collection.
4. Export: one pass with the `qexport` collection mutable makes every product weight's
   packed `QWeight` (int4 two per byte, binary eight per byte) at its parameter's path (a
   factorized weight, `model.lowrank`: a `Factored` of two, U's and V's).
5. The packed model is prepared for the integer kernels where they compute the format
   (`serve`: w8a8 with per-token activations, binary x binary, int4 weight-only; the rest
   decode in XLA), evaluated, saved to `OUT/quantized.npz` + `OUT/quant.json`, reloaded,
   and checked to give identical outputs; `OUT/summary.json` reports size on disk, the eval
   metric and forward speed beside the float model.

bfloat16 / float16 inference is the same command with `--weights bfloat16|float16`:
parameters cast and the model computing in that dtype (no integer codes).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import zipfile
import zlib

import flax.traverse_util as traverse
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.compress import qlinear
from hpnlp.compress.qlinear import Factored, QWeight, Served
from hpnlp.config import (Config, ConfigError, QuantConfig, config_error, to_json,
                          validate, with_absolute_paths)
from hpnlp.train.checkpoint import NoCheckpoint, load_run_config  # noqa: F401 (re-exported)
from hpnlp.train.checkpoint import _non_finite

FLOAT_FORMATS = ("bfloat16", "float16")
OUT_FILES = ("quantized.npz", "quant.json", "summary.json")  # what `quantize` writes in OUT


def _is_qweight(x) -> bool:
    return isinstance(x, QWeight)


def with_quant(cfg: Config, q: QuantConfig, *, num_devices: int | None = None) -> Config:
    """`cfg` with its model's `quant` replaced, validated (ConfigError names the field) on
    `num_devices` devices (None: all)."""
    if cfg.model.reversible:
        raise config_error("model.reversible", True, "reversible blocks apply their weights "
                           "functionally, so they cannot be packed yet; quantize a run with "
                           "model.reversible=False (QAT works on reversible blocks)")
    if q.act_scale == "static" and q.activations not in ("int8", "fp8"):
        raise config_error("quant.act_scale", "static", "static (calibrated) ranges are for "
                           "int8/fp8 activations; use quant.act_scale='dynamic'")
    return validate(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quant=q)),
                    num_devices=num_devices)


def _put_back(model, params, batch, quant_vars, collection: str):
    """`params` with the leaves one pass with `collection` mutable put at their paths."""
    variables = {"quant": quant_vars} if quant_vars else {}
    _, got = jax.jit(lambda p, b: model.apply({"params": p, **variables}, b, method="evaluate",
                                              mutable=[collection]))(params, batch)
    is_leaf = lambda _, x: isinstance(x, (QWeight, Served))  # noqa: E731
    new = traverse.flatten_dict(got.get(collection, {}), is_leaf=is_leaf)
    flat = traverse.flatten_dict(params, is_leaf=is_leaf)
    for path, leaf in new.items():
        if path not in flat:
            raise RuntimeError(f"{collection} weight {'/'.join(path)} is not a parameter")
        flat[path] = leaf
    return traverse.unflatten_dict(flat)


def packed_params(model, params, batch, quant_vars=None):
    """`params` with every quantized product weight replaced by its packed QWeight."""
    return _put_back(model, params, batch, quant_vars, "qexport")


def serve(model, params, batch, quant_vars=None):
    """Packed `params` with every QWeight an integer kernel computes (`qlinear.kernel_for`)
    prepared for it (`Served`, at load time: its layout belongs to this build)."""
    return _put_back(model, params, batch, quant_vars, "qserve")


def calibrate_ranges(model, params, batches, method: str, rngs=None):
    """The `quant` collection: each product's activation range over `batches` (step 3),
    the passes under `rngs` (a random-feature model's trained draw: {"features": key})."""
    from hpnlp.compress import calibrate

    # .get: a pass in which no product calibrates makes no `calib` collection (validate
    # refuses such quant.layers: config.compress_checks.CALIBRATED)
    run = jax.jit(lambda p, b: model.apply({"params": p}, b, method="evaluate", rngs=rngs,
                                           mutable=["calib"])[1].get("calib", {}))
    per_batch = [run(params, b) for b in batches]
    return jax.tree.map(lambda *r: calibrate.combine(jnp.stack(r), method), *per_batch)


# ---------------------------------------------------------------- the packed file format

def _entries(params, quant_vars):
    """What `save` stores: ({npz key: array, or a QWeight it stores as KEY/codes and
    KEY/scale}, the keys of model.lowrank's weights (their factors at KEY/u and KEY/v), {such
    a key: its experts' batch axes})."""
    entries, factored, lead = {}, [], {}
    flat = traverse.flatten_dict(params, is_leaf=lambda _, x: _is_qweight(x))
    for path, leaf in flat.items():
        key = "params/" + "/".join(path)
        if isinstance(leaf, Factored):
            factored.append(key)
            if leaf.lead:  # an MoE layer's experts' factors: their batch axes
                lead[key] = leaf.lead
            entries.update({key + "/u": leaf.u, key + "/v": leaf.v})
        else:
            entries[key] = leaf
    for path, leaf in traverse.flatten_dict(quant_vars or {}).items():
        entries["quant/" + "/".join(path)] = leaf
    return entries, factored, lead


def save(out: str, cfg: Config, params, quant_vars, meta: dict) -> int:
    """OUT/quantized.npz (every array, packed codes as stored, zip-deflated: the zeros of a
    pruned model take less room, a 50%-zero int8 matrix about two thirds of its bytes) +
    OUT/quant.json; returns the npz's size in bytes."""
    os.makedirs(out, exist_ok=True)
    arrays, layout, views = {}, {}, {}

    def put(key, a):  # npz knows no bfloat16 / float8: store their bytes, note the dtype
        a = np.asarray(a)
        if a.dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            views[key] = a.dtype.name
            a = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)
        arrays[key] = a

    entries, factored, lead = _entries(params, quant_vars)
    for k, a in entries.items():
        if _is_qweight(a):
            put(k + "/codes", a.codes)
            put(k + "/scale", a.scale)
            layout[k] = {"fmt": a.fmt, "shape": list(a.shape), "k_dims": a.k_dims}
        else:
            put(k, a)
    path = os.path.join(out, "quantized.npz")
    np.savez_compressed(path, **arrays)
    manifest = {"config": to_json(with_absolute_paths(cfg)), "weights": layout, "dtypes": views,
                **({"factored": factored} if factored else {}),
                **({"factored_lead": lead} if lead else {}), **meta}
    with open(os.path.join(out, "quant.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return os.path.getsize(path)


def _damaged(path: str, what: str, command: str = "quantize") -> NoCheckpoint:
    return NoCheckpoint(f"{path} {what}; it is not a file `{command}` wrote: {command} the run "
                        f"again (python -m hpnlp.compress {command} --out ...)")


# A bug hunt (session 99): an array of another shape or taken out of quantized.npz, or the
# model edited in quant.json (width, num_heads), failed in flax (ScopeParamShapeError, "query
# and key disagree") naming neither file, and a NaN or an infinity in one was served (NUL
# bytes from generate, exit 0). The readers below are shared with `sparsify.load`, whose
# folder had none of these guards.

def read_manifest(mpath: str, entries: tuple, command: str = "quantize") -> dict:
    """A folder's JSON (quant.json, sparse.json) with its "config" and `entries` dicts (the
    first required, the rest optional), or one line naming the file."""
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise _damaged(mpath, f"cannot be read ({e})", command) from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("config"), dict)
            and isinstance(manifest.get(entries[0]), dict)
            and all(isinstance(manifest.get(k, {}), dict) for k in entries[1:])):
        names = [f'"{k}"' for k in ("config", *entries)]
        raise _damaged(mpath, f"lacks its {', '.join(names[:-1])} or {names[-1]} entry", command)
    return manifest


def manifest_config(mpath: str, manifest: dict, command: str = "quantize") -> Config:
    """The config a folder's JSON holds, checked as a run's config.json is (a review, session
    115: an edited format or group size failed in the model's trace, naming no file)."""
    from hpnlp.train.checkpoint import saved_config
    try:
        return saved_config(manifest["config"])
    except (ConfigError, TypeError, AttributeError) as e:
        raise _damaged(mpath, f"holds a config this hpnlp refuses ({e})", command) from None


def read_arrays(npath: str, mpath: str, views: dict, command: str = "quantize") -> dict:
    """A folder's npz as {key: NumPy array}, typed as its JSON's `views` say, or one line
    naming the file; a NaN or an infinity, which neither command writes, is refused as
    `Checkpointer.restore` refuses a run's."""
    try:
        with np.load(npath) as npz:
            stored = {key: npz[key] for key in npz.files}
    except (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError) as e:
        raise _damaged(npath, f"cannot be read ({type(e).__name__}: {e})", command) from None
    for key, name in views.items():
        if key in stored:
            try:
                stored[key] = stored[key].view(jnp.dtype(name))
            except (TypeError, ValueError) as e:
                raise _damaged(mpath, f"gives {key} the dtype {name!r} ({e})", command) from None
    bad = [key for key, a in stored.items() if _non_finite(a)]
    if bad:
        raise _damaged(npath, f"holds non-finite values (a NaN or an infinity) in "
                       f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}", command)
    return stored


@functools.lru_cache(maxsize=4)
def model_entries(cfg: Config, packed: bool = True) -> tuple[dict, list, dict]:
    """`_entries` of what `save` stores for the model of `cfg`: its parameters (factorized
    where model.lowrank says), `packed` where `cfg.model.quant` packs them (not in a
    bfloat16 / float16 folder, whose config keeps a QAT run's settings), and its calibrated
    ranges (act_scale='static', which no run trains with), as shapes (jax.eval_shape: traced,
    nothing compiled)."""
    import flax.linen as nn

    from hpnlp import models
    from hpnlp.train.loop import dummy_batch
    q = cfg.model.quant
    # the float model's parameters, as `quantize` reads them (a static one's products would
    # ask for ranges not calibrated yet when model.lowrank finds its products)
    cfg_f = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, quant=QuantConfig(kv_cache=q.kv_cache)))
    model_f, model = (models.build(c, deterministic=True, forward_only=True)
                      for c in (cfg_f, cfg))
    kind = {"lm": "lm", "classifier": "classify"}.get(cfg.model.kind, "match")
    batch = dummy_batch(kind, 1, cfg.data.seq_len)

    def init(key):
        p = model_f.init(key, batch)["params"]
        if cfg.model.lowrank.enabled():
            from hpnlp.compress import lowrank
            p = lowrank.init_transform(cfg_f, model_f, batch)(p)
        return nn.unbox(p)
    params, quant = jax.eval_shape(init, jax.random.key(0)), {}
    if q.enabled and q.act_scale == "static":
        quant = jax.eval_shape(lambda p: model.apply(
            {"params": p}, batch, method="evaluate", mutable=["calib"])[1].get("calib", {}),
            params)
    if q.enabled and packed:
        params = jax.eval_shape(lambda p, qv: packed_params(model, p, batch, qv), params, quant)
    return _entries(params, quant)


def beyond_range(params, dtype) -> list[str]:
    """The paths of the float arrays in `params` holding a value beyond `dtype`'s range (cast
    to it, inf: float16's 65504)."""
    top = float(jnp.finfo(dtype).max)
    return [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(v.dtype, jnp.floating)
            and float(jnp.max(jnp.abs(v), initial=0.0)) > top]


def counts_shaped(cfg: Config) -> str:
    """The prefix of the arrays whose shapes the task's token counts decide, which a folder's
    config alone does not (the adaptive softmax's default cutoffs: review; class_based's
    classes, binned by frequency), or "". The other output layers' shapes follow the config
    alone (hierarchical: V - 1 nodes, binary_code: the bits of V ids)."""
    if cfg.output.name == "adaptive" and cfg.output.options.get("cutoffs") is None:
        return "params/output/"
    # a bug hunt (session 100): class_bins makes the classes the counts give (29 on the byte
    # task where Zipf over the ids gives 16), so every class_based folder was refused as
    # damaged; `load` has no task to count, so these arrays are left out of the check
    if cfg.output.name == "class_based":
        return "params/output/classes/"
    return ""


def check_shapes(npath: str, mpath: str, got: dict, want: dict, command: str = "quantize",
                 free: str = ""):
    """One line naming the npz where its arrays ({key: shape}) are not the `want`ed ones of
    the model that the config in `mpath` describes: one missing, one more, or another shape.
    Keys under the prefix `free` (`counts_shaped`) are not compared."""
    if free:
        got, want = ({k: v for k, v in d.items() if not k.startswith(free)} for d in (got, want))
    where = f"the model of the config in {mpath}"
    for key in want:
        if key not in got:
            raise _damaged(npath, f"has no array {key}, which {where} has", command)
    for key, shape in got.items():
        if key not in want:
            raise _damaged(npath, f"holds an array {key}, which {where} has no place for",
                           command)
        if tuple(shape) != tuple(want[key]):
            raise _damaged(npath, f"holds {key} of shape {list(shape)}, where {where} has "
                           f"{list(want[key])}", command)


def _check_model(npath: str, mpath: str, cfg: Config, stored: dict, layouts: dict,
                 manifest: dict) -> None:
    """A quantized folder's arrays, packed weights' `layouts` and factorized weights against
    what `save` stores for the model of its config (`model_entries`)."""
    want, factored, lead = model_entries(cfg, packed=bool(layouts))
    shapes, packed = {}, {}
    for key, leaf in want.items():
        if _is_qweight(leaf):
            packed[key] = {"fmt": leaf.fmt, "shape": tuple(leaf.shape), "k_dims": leaf.k_dims}
            shapes[key + "/codes"], shapes[key + "/scale"] = leaf.codes.shape, leaf.scale.shape
        else:
            shapes[key] = leaf.shape
    free = counts_shaped(cfg)
    check_shapes(npath, mpath, {key: a.shape for key, a in stored.items()}, shapes, free=free)
    where = "the model of its config"
    for key, got in layouts.items():
        if free and key.startswith(free):
            continue
        if key not in packed:
            raise _damaged(mpath, f"lists {key} as a packed weight, which {where} does not pack")
        if got != packed[key]:
            show = lambda x: f"{x['fmt']} {list(x['shape'])} (k_dims {x['k_dims']})"  # noqa: E731
            raise _damaged(mpath, f"gives {key} the layout {show(got)}, where {where} packs it "
                           f"as {show(packed[key])}")
    for key in packed:
        if key not in layouts and not (free and key.startswith(free)):
            raise _damaged(mpath, f"lists no layout for {key}, which {where} packs")
    listed, leads = manifest.get("factored", []), manifest.get("factored_lead", {})
    if not (isinstance(listed, list) and isinstance(leads, dict)):
        raise _damaged(mpath, "holds a \"factored\" entry that is not a list, or a "
                       "\"factored_lead\" one that is not a dict")
    for key in listed:
        if key not in factored:
            raise _damaged(mpath, f"lists {key} as factorized, which {where} does not factorize")
    for key in factored:
        if key not in listed:
            raise _damaged(mpath, f"does not list {key} as factorized, which {where} "
                           "factorizes (model.lowrank)")
        if leads.get(key, 0) != lead.get(key, 0):
            raise _damaged(mpath, f"gives {key} {leads.get(key, 0)} experts' axes, where "
                           f"{where} has {lead.get(key, 0)}")


def _layout(mpath: str, key: str, info, command: str = "quantize", fmt: bool = True) -> dict:
    """A stored weight's entry in its JSON: its float shape, contraction axes and (a packed
    weight's, `fmt`) format."""
    from hpnlp.compress import formats
    try:
        shape, k_dims = tuple(info["shape"]), info["k_dims"]
        ok = ((not fmt or info["fmt"] in formats.FORMATS)
              and all(type(d) is int and d > 0 for d in shape)
              and type(k_dims) is int and 0 < k_dims <= len(shape))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise _damaged(mpath, f"holds no valid layout for {key} ({info!r})", command)
    return {**({"fmt": info["fmt"]} if fmt else {}), "shape": shape, "k_dims": k_dims}


def _check_packed(npath: str, key: str, w: QWeight) -> None:
    """`w`'s codes [..., K packed, N] and scales [..., G, N] (G dividing K; the same leading
    axes: stacked layers, experts) as its format stores them."""
    import math
    K, N = w.k, math.prod(w.shape[w.k_dims:])
    rows = {"int4": -(-K // 2), "binary": -(-K // 8)}.get(w.fmt, K)
    dtype = {"int4": jnp.uint8, "binary": jnp.uint8, "fp8": jnp.float8_e4m3fn}.get(w.fmt, jnp.int8)
    lead = w.codes.shape[:-2]
    G = w.scale.shape[-2] if w.scale.ndim >= 2 else 0
    for what, a, want, ok in (
            ("codes", w.codes, f"{dtype.__name__} [..., {rows}, {N}]",
             w.codes.ndim >= 2 and w.codes.shape[-2:] == (rows, N) and w.codes.dtype == dtype),
            ("scale", w.scale, f"float32 [..., G, {N}] with G dividing {K}",
             w.scale.shape == (*lead, G, N) and G > 0 and K % G == 0
             and w.scale.dtype == jnp.float32)):
        if not ok:
            raise _damaged(npath, f"holds {key}/{what} as {a.dtype} {list(a.shape)}, where its "
                           f"{w.fmt} weight of shape {list(w.shape)} stores {want}")


def load(out: str, cfg: Config | None = None):
    """(config, params with QWeights, quant collection) saved by `save`. `cfg`, when given,
    must be the model the file was made for."""
    mpath, npath = os.path.join(out, "quant.json"), os.path.join(out, "quantized.npz")
    for p in (mpath, npath):
        if not os.path.exists(p):
            raise NoCheckpoint(f"no quantized checkpoint in {out} ({os.path.basename(p)} missing): "
                               "make one with python -m hpnlp.compress quantize --out ...")
    # a bug hunt (session 96): a cut or edited quant.json / quantized.npz was a traceback
    # (BadZipFile, KeyError, a JSON error naming no file, or a JAX TypeError deep in the
    # forward from an array of another shape); each is one line naming the file
    manifest = read_manifest(mpath, ("weights", "dtypes"))
    saved = manifest_config(mpath, manifest)
    if cfg is not None:
        from hpnlp.train.checkpoint import _shape_signature
        a, b = _shape_signature(saved), _shape_signature(cfg)
        diff = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
        if diff or saved.model.quant != cfg.model.quant:
            lines = "; ".join(f"{k}: saved {x!r}, given {y!r}" for k, (x, y) in diff.items()) or \
                f"quant: saved {saved.model.quant}, given {cfg.model.quant}"
            raise ConfigError(f"the quantized checkpoint in {out} is of a different model ({lines}); "
                              "load it with its own config (hpnlp.compress.ptq.load(out))")
    stored = read_arrays(npath, mpath, manifest.get("dtypes", {}))

    def get(key):
        if key not in stored:
            raise _damaged(npath, f"has no array {key} (which {mpath} lists)")
        return jnp.asarray(stored[key])

    layouts = {key: _layout(mpath, key, info) for key, info in manifest["weights"].items()}
    flat, quant = {}, {}
    for key, layout in layouts.items():
        w = QWeight(codes=get(key + "/codes"), scale=get(key + "/scale"), **layout)
        _check_packed(npath, key, w)
        flat[tuple(key.split("/")[1:])] = w
    _check_model(npath, mpath, saved, stored, layouts, manifest)  # each array's shape
    for key in stored:
        if key.startswith("quant/"):
            quant[tuple(key.split("/")[1:])] = get(key)
        elif key.startswith("params/") and key.rsplit("/", 1)[0] not in layouts:
            flat[tuple(key.split("/")[1:])] = get(key)
    for key in manifest.get("factored", []):
        path = tuple(key.split("/")[1:])
        if path + ("u",) not in flat or path + ("v",) not in flat:
            raise _damaged(npath, f"lacks a factor of {key} (which {mpath} lists as factored)")
        flat[path] = Factored(u=flat.pop(path + ("u",)), v=flat.pop(path + ("v",)),
                              lead=manifest.get("factored_lead", {}).get(key, 0))
    return saved, traverse.unflatten_dict(flat), traverse.unflatten_dict(quant) if quant else {}


FEATURES = "features_key"  # quant.json's entry of the draw (`quantize`)


def key_json(key) -> dict:
    """A random key as quant.json holds it: its implementation's name and its data."""
    return {"impl": str(jax.random.key_impl(key)),
            "data": np.asarray(jax.random.key_data(key)).tolist()}


def load_features_key(out: str, *, command: str = "quantize"):
    """The random-feature draw the quantized model in `out` was trained with and evaluated
    under (`quantize`; `command="sparsify"`: the sparse model's, in sparse.json), for passes
    that read the `features` stream (Performer, LSH: `hpnlp.retrieval.knnlm.reads_features`);
    None for a model that reads none. A folder whose model reads one and that holds none (or
    a damaged one) is refused, naming the file: the model would run under another draw than
    its weights trained with."""
    from hpnlp.retrieval.knnlm import reads_features
    file, entry = {"quantize": ("quant.json", "weights"),
                   "sparsify": ("sparse.json", "sparse")}[command]
    mpath = os.path.join(out, file)
    manifest = read_manifest(mpath, (entry,), command)
    cfg = manifest_config(mpath, manifest, command)
    if not reads_features(cfg):
        return None
    entry = manifest.get(FEATURES)
    try:
        key = jax.random.wrap_key_data(np.asarray(entry["data"], np.uint32),
                                       impl=entry["impl"])
        if key.shape != ():
            raise ValueError(f"a key of shape {key.shape}")
        return key
    except (TypeError, KeyError, ValueError, OverflowError) as e:
        what = "has no" if entry is None else f"has a damaged ({type(e).__name__})"
        raise _damaged(mpath, f"{what} {FEATURES!r}, the random-feature draw its "
                       f"attention.name={cfg.attention.name!r} model trained with",
                       command) from None


# ---------------------------------------------------------------- the whole command

def _forward_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class _WithQuant:
    """`model`'s passes with its calibrated activation ranges (the "quant" collection)
    beside the parameters a pass is given: a split's metrics (`split_metrics`) apply
    {"params": p} alone, which an act_scale='static' model refuses."""

    def __init__(self, model, quant_vars):
        self.model, self.cfg, self.quant_vars = model, model.cfg, quant_vars

    def apply(self, variables, *args, **kwargs):
        extra = {"quant": self.quant_vars} if self.quant_vars else {}
        return self.model.apply({**variables, **extra}, *args, **kwargs)



def served_products(x: Served) -> int:
    """The kernel products one `Served` leaf computes: each expert's own, and each stacked
    layer's (model.stack_layers: its packed arrays carry the scan's leading [depth] axis
    over a weight's [G, N] scales; a review, session 117, found a depth-4 stack counted as
    one layer)."""
    layers = 1
    if x.packed is not None:
        layers = int(np.prod(np.shape(x.packed.scale)[:-2], dtype=np.int64))
    return layers * max(x.experts, 1)

def quantize(workdir: str, out: str, q: QuantConfig | None = None, *, float_dtype: str | None = None,
             calib_batches: int = 8, eval_batches: int | None = None, repeats: int = 5) -> dict:
    """Quantize the run in `workdir` with `q` (or cast it to `float_dtype`) into `out`;
    returns the summary also written to OUT/summary.json (module doc). `q` None and no
    `float_dtype`: the run's own `quant.*` settings, which exports a QAT run."""
    if q is None and float_dtype is None:
        q = load_run_config(workdir).quant
        if not q.enabled:
            raise config_error("quant.weights", "none", f"the run in {workdir} trained without "
                               "quantization; give the format to quantize it to (--weights ...)")
    from hpnlp import data as data_lib
    from hpnlp import models
    from hpnlp.train.carry import fold_eval
    from hpnlp.train.loop import (Trainer, for_these_devices, reader_device_count,
                                  reader_devices)
    from hpnlp.train.step import finalize

    if q is not None and float_dtype is not None:
        raise ValueError("give a QuantConfig or a float_dtype (bfloat16 | float16), not both")
    if q is not None and not q.enabled:  # found by a bug hunt: a folder of float weights
        raise config_error("weights", q.weights, "quantizes nothing; give a format "
                           "(int8, int4, ...), or leave --weights out to export a QAT run")
    if float_dtype is not None and float_dtype not in FLOAT_FORMATS:
        raise config_error("weights", float_dtype, f"float formats are {list(FLOAT_FORMATS)}")
    if calib_batches <= 0:
        raise config_error("calib_batches", calib_batches, "must be > 0")
    from hpnlp.paths import check_new_output, staged
    replacing = check_new_output(out, workdir, may_replace=OUT_FILES)
    cfg = for_these_devices(load_run_config(workdir), workdir)  # before with_quant
    # the devices it is read on (a bug hunt, session 100: 3 devices, which do not split a
    # batch of 8, were refused naming train.batch_size; the reader reads on 2 of them)
    num_devices = reader_device_count(cfg)
    if cfg.model.memory.size:
        raise config_error("model.memory.size", cfg.model.memory.size,
                           f"the run in {workdir} reads a key-value memory that lives in its train "
                           "state, which a quantized checkpoint does not hold; quantize a run "
                           "without model.memory")
    from hpnlp.config.compress_checks import quant_products
    if q is not None and not quant_products(cfg.model):  # a review (session 115): refused
        # by the QAT check, whose fix read "--weights none", which this command refuses
        raise config_error("model.arch", cfg.model.arch, f"the {cfg.model.arch} "
                           f"{cfg.model.kind} run in {workdir} has no matrix products to "
                           "quantize (its bag of embeddings is a lookup); serve it in float, "
                           "or export it as --weights bfloat16 or float16")
    # --eval_batches counts the two evals alone, not written into quant.json's config (a
    # review, session 118, as sparsify's in session 116 and shrink's in 115)
    counted = {} if eval_batches is None else {"batches": eval_batches}
    kv_cache = cfg.model.quant.kv_cache  # the run's key/value cache stays the quantized model's
    if q is not None and q.kv_cache == "none":
        q = dataclasses.replace(q, kv_cache=kv_cache)
    if float_dtype is not None:
        # float16: the config keeps float32 parameters (validate refuses float16 master
        # weights, a training rule); the stored arrays are float16 all the same (below), and
        # the model computes in float16.
        cfg_q = validate(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, dtype=float_dtype,
            param_dtype=float_dtype if float_dtype == "bfloat16" else "float32")),
            num_devices=num_devices)
    else:
        cfg_q = with_quant(cfg, q, num_devices=num_devices)  # fails here, before any compile

    # The float model of the run's weights (a QAT run's float shadow weights), read only.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                            quant=QuantConfig(kv_cache=kv_cache)))
    trainer = Trainer(cfg, workdir, read_only=True)
    step = trainer.checkpointer.latest_step()
    state, _ = trainer.initial_state()
    trainer.checkpointer.close()
    lm = trainer.lm
    from hpnlp.train.carry import model_params
    params = model_params(state.params)  # without what a method trained beside the model
    # formats code a NaN weight as 0: the quantized model would hide what the float one shows
    bad = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(params)
           if jnp.issubdtype(v.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(v)))]
    if bad:
        raise ValueError(f"the checkpoint of step {step} in {workdir} holds non-finite weights "
                         f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); quantize a "
                         "run whose weights are finite")
    batches = data_lib.make_iterator(trainer.task, cfg.data, split="train",
                                     batch_size=cfg.train.batch_size)
    calib = [next(batches) for _ in range(calib_batches)]
    eval_batch = next(iter(data_lib.make_iterator(
        trainer.task, cfg.data, split="eval",
        batch_size=cfg.data.eval_batch_size or cfg.train.batch_size)))

    model_q = models.build(cfg_q, deterministic=True, token_counts=trainer.task.token_counts)
    # The random-feature draw the weights trained with (Performer, LSH: the run's last
    # step's), from the replicated rng and step, for every pass below (calibration
    # included) and kept in quant.json (`load_features_key`): before session 113 such runs
    # were refused, their files keeping no draw (found in review: evaluated and decoded
    # with another one)
    key = state.host_features_key(cfg.train.feature_redraw_every)
    from hpnlp.retrieval.knnlm import reads_features
    rngs = {"features": key} if reads_features(cfg) else None
    quant_vars = {}
    if float_dtype is not None:
        dt = jnp.dtype(float_dtype)
        big = beyond_range(params, dt)
        if big:  # cast to inf, which load refuses as damaged (review, session 99)
            raise ValueError(f"the checkpoint of step {step} in {workdir} holds weights beyond "
                             f"{float_dtype}'s range ({', '.join(big[:3])}"
                             f"{', ...' if len(big) > 3 else ''}: {jnp.finfo(dt).max:.0f}); "
                             "export it as --weights bfloat16")
        packed = jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                              params)
    else:
        if q.act_scale == "static":
            quant_vars = calibrate_ranges(model_q, params, calib, q.calibration, rngs)
        packed = packed_params(model_q, params, calib[0], quant_vars)
        if q.weights != "none" and not any(isinstance(x, QWeight) for x in jax.tree.leaves(
                packed, is_leaf=lambda x: isinstance(x, QWeight))):
            # found by a bug hunt: `--layers head` on an LM wrote a "quantized" folder of
            # float weights (before anything is written). (A QAT run's own quant.layers that
            # names none is refused when its config is read: config.compress_checks.)
            raise config_error("layers", q.layers, f"names no product of this "
                               f"{cfg.model.kind} ({cfg.model.arch}), so nothing would be "
                               "quantized; name products it has (or 'all')")

    float_eval = trainer.evaluate(state, **counted)  # after what may refuse the format (a bug hunt)

    def variables(p, qv):
        return {"params": p, **({"quant": qv} if qv else {})}

    # What a user of the file runs: integer kernels where they serve the format (`serve`),
    # packed weights decoded in XLA elsewhere.
    served = packed if float_dtype else serve(model_q, packed, calib[0], quant_vars)
    kernel_products = sum(served_products(x) for x in jax.tree.leaves(
        served, is_leaf=lambda x: isinstance(x, Served)) if isinstance(x, Served))
    # The sums with what the layers sow folded in, as the float eval's (a bug hunt, session
    # 102: an MoE run's quantized eval lacked the float eval's loss_moe_* and moe_*
    # statistics): carry.fold_eval, the float eval's own code, which both timed forwards
    # below run
    eval_q = jax.jit(lambda p, qv, b: fold_eval(model_q, variables(p, qv), b, rngs))
    # Transformer-XL on a stream (float formats): the eval stream's memory threaded through,
    # as in the float evaluation above (its blocks are never MoE: nothing is sown).
    eval_q_memory = jax.jit(lambda p, qv, b, mem: model_q.apply(variables(p, qv), b, mem,
                                                                 method="evaluate_and_memory"))
    quant_eval = finalize(trainer.eval_sums(
        state, eval_step=lambda _, b: eval_q(served, quant_vars, b),
        memory_step=lambda _, b, mem: eval_q_memory(served, quant_vars, b, mem), **counted),
        lm=lm)
    # The whole held-out split's metrics (the bi-encoder's pool: recall@1/10, MRR), as the
    # float eval's `trainer.evaluate` adds them (a bug hunt, session 110: the summary had them
    # for the float model alone, and the quantized encoder's retrieval was measured nowhere)
    split_metrics = getattr(type(model_q), "split_metrics", None)
    if split_metrics is not None:
        # in the MoE routing groups the float pool routed in (`Trainer.split_model`; a review,
        # session 118: the quantized pool routed in this mesh's, the float one in the run's)
        groups, mq = trainer.split_groups(step), cfg_q.model
        pool_model = model_q if groups is None else models.build(
            dataclasses.replace(cfg_q, model=dataclasses.replace(
                mq, moe=dataclasses.replace(mq.moe, groups=groups))),
            deterministic=True, token_counts=trainer.task.token_counts)
        with trainer._context():
            quant_eval.update(split_metrics(cfg_q, _WithQuant(pool_model, quant_vars), served,
                                            trainer.task, features_key=key))

    model_f = trainer.eval_model
    eval_f = jax.jit(lambda p, b: fold_eval(model_f, {"params": p}, b, rngs))
    tokens = int(np.sum([np.sum(v != 0) for k, v in eval_batch.items() if k.startswith("segment_ids")]))
    rows = max(int(np.size(v)) for k, v in eval_batch.items() if k.startswith("segment_ids"))
    from hpnlp.compress.kernels import INT4_KERNEL_MAX_ROWS
    t_float = _forward_seconds(eval_f, params, eval_batch, repeats=repeats)
    t_quant = _forward_seconds(eval_q, served, quant_vars, eval_batch, repeats=repeats)
    float_bytes = qlinear.float_bytes(params)
    metric = "loss"
    summary = {
        "workdir": os.path.abspath(workdir), "step": step, "task": trainer.task.name,
        "format": float_dtype or {"weights": q.weights, "activations": q.activations,
                                  "act_scale": q.act_scale, "group_size": q.group_size,
                                  "calibration": q.calibration, "layers": q.layers,
                                  **({"percentile": q.percentile}
                                     if q.calibration == "percentile" else {})},
        "calib_batches": calib_batches if (q is not None and q.act_scale == "static") else 0,
        "eval": {"float32": float_eval, "quantized": quant_eval,
                 "loss_rel_increase": quant_eval[metric] / float_eval[metric] - 1.0},
        "size_bytes": {"float32_params": float_bytes, "quantized_file": None,
                       "ratio": None},
        "forward": {"batch_tokens": tokens, "float32_s": t_float, "quantized_s": t_quant,
                    "speedup": t_float / t_quant,
                    "kernel_products": kernel_products,
                    "how": ("integer kernels (hpnlp.compress.kernels) for the products they "
                            "serve, the rest decoded in XLA" if kernel_products else
                            "packed weights decoded in the jitted forward (XLA)")
                    # a review (session 117): int4's kernel serves up to its rows, a decode
                    # step's; a batch's products past them ran on its XLA twin
                    + (f"; int4 products of over {INT4_KERNEL_MAX_ROWS} rows (this batch's "
                       f"{rows}) on the kernel's XLA twin" if kernel_products and
                       q.weights == "int4" and rows > INT4_KERNEL_MAX_ROWS else "")},
        "reload_identical": None,
    }
    from hpnlp.data import TEXT_FILE, kept_text
    # the run's TEXT_FILE (its training text's digest) kept here too, for a reader of this
    # folder once the run is moved (a review, session 118: a word model then decoded under
    # a vocabulary rebuilt from the file as it is now, unchecked)
    text = kept_text(workdir)
    meta = {"source": {"workdir": os.path.abspath(workdir), "step": step,
                       **({TEXT_FILE: text} if text else {})},
            **({FEATURES: key_json(key)} if rngs else {})}
    if replacing:  # said once every check has passed
        print(f"hpnlp.compress: note: {replacing}", file=sys.stderr, flush=True)
    with staged(out, OUT_FILES) as stage:  # OUT's files replaced once all are written
        # a layout on some of the devices here is this read's, not the folder's (review,
        # session 100: saved, a folder quantized on 2 of 3 devices was refused on 1)
        size = save(stage, dataclasses.replace(cfg_q, mesh=dataclasses.replace(
            cfg_q.mesh, data=-1)) if reader_devices(cfg_q) else cfg_q, packed, quant_vars, meta)
        _, reloaded, reloaded_quant = load(stage, cfg_q)
        if rngs and not jnp.array_equal(jax.random.key_data(load_features_key(stage)),
                                        jax.random.key_data(key)):
            raise RuntimeError(f"the quantized checkpoint written for {out} did not reload "
                               "its random-feature draw")
        if not float_dtype:
            reloaded = serve(model_q, reloaded, calib[0], reloaded_quant)
        # placed as the run's own arrays are (a mesh may shard them; a sharded low-precision
        # forward sums in another order than a one-device one, and this check is bitwise)
        reloaded, reloaded_quant = (jax.tree.map(lambda r, a: jax.device_put(r, a.sharding), r, a)
                                    for r, a in ((reloaded, served), (reloaded_quant, quant_vars)))
        out_before = eval_q(served, quant_vars, eval_batch)
        out_after = eval_q(reloaded, reloaded_quant, eval_batch)
        identical = all(bool(jnp.array_equal(a, b)) for a, b in
                        zip(jax.tree.leaves(out_before), jax.tree.leaves(out_after)))
        if not identical:  # nothing of this call's is kept (staged)
            raise RuntimeError(f"the quantized checkpoint written for {out} did not reload to "
                               "identical outputs")
        summary["size_bytes"].update(quantized_file=size, ratio=float_bytes / size)
        summary["reload_identical"] = identical
        with open(os.path.join(stage, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary
