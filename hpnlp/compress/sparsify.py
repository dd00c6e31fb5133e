"""A pruned run served by the sparse product: `python -m hpnlp.compress sparsify`.

    python -m hpnlp.compress sparsify --workdir PRUNED --out DIR [--min_sparsity 0.75]

Unstructured pruning (`train.prune.*`) leaves every weight at its shape with zeros in it,
and XLA's dense product takes as long whatever the sparsity. This writes the run with each
Transformer product weight (qkv, out, MLP, a classifier head; not embeddings, the output
layer or an MoE layer's experts) that is at least `min_sparsity` zeros stored by its
nonzeros (`qlinear.Sparse`: hpnlp.compress.spmm's CSC arrays), which the model multiplies
by the sparse kernel. The default 0.75 is where that kernel starts beating the dense
product at the byte LM's shapes on the CPUs measured (`python -m hpnlp.bench sparse`).

1. The run's config and newest checkpoint are restored, read only; the masked (dense)
   model is evaluated on the held-out split with the task's metric.
2. Each product weight sparse enough becomes a `Sparse` leaf; the rest stay dense. A run
   with none (not pruned, or pruned less) is refused, naming the sparsest weight and the
   flag that would take it.
3. The sparse model is evaluated the same way, saved to OUT/sparse.npz + OUT/sparse.json,
   reloaded, and checked to give identical outputs. OUT/summary.json reports both metrics,
   the weights converted with their sparsity, sizes (the converted weights dense and
   sparse, the file) and forward speed beside the masked model.

`load(OUT)` gives (config, params) for `model.apply`: the model the run builds computes
with them as it is (qeinsum dispatches on the weight's type); a Performer's or LSH run's
passes take the draw its weights trained with, `load_features_key(OUT)` (as `rngs=
{"features": key}`).
"""

from __future__ import annotations

import json
import os
import sys

import flax.traverse_util as traverse
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.compress import spmm
from hpnlp.compress.qlinear import Factored, QWeight, Sparse, Served, float_bytes, products
from hpnlp.config import Config, config_error, to_json, with_absolute_paths
from hpnlp.train.checkpoint import NoCheckpoint, load_run_config

KINDS = ("qkv", "out", "mlp", "head")  # the products qeinsum computes from their weight alone
OUT_FILES = ("sparse.npz", "sparse.json", "summary.json")
MIN_SPARSITY = 0.75


def candidates(model, params, batch) -> dict:
    """{parameter path: (weight [K, N], k_dims)} of the product weights `sparsify` may
    convert (KINDS, one weight each, float arrays)."""
    flat = traverse.flatten_dict(params, is_leaf=lambda _, x: isinstance(
        x, (Factored, QWeight, Served, Sparse)))
    out = {}
    for path, prod in sorted(products(model, params, batch).items()):
        w = flat.get(path)
        if prod.kind not in KINDS or prod.lead or not isinstance(w, (jax.Array, np.ndarray)):
            continue
        k_dims = len(prod.contraction)
        if tuple(prod.contraction) != tuple(range(k_dims)):  # stored contraction first
            continue
        out[path] = (w, k_dims)
    return out


def check_min_sparsity(value: float, name: str = "min_sparsity") -> None:
    """ValueError naming `value` as `name` (the CLI's flag, or the argument) unless it is a
    share of zeros in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} {value}: give the share of zeros in [0, 1) from which a "
                         f"weight is stored by its nonzeros, or leave it out (the default, "
                         f"{MIN_SPARSITY})")


def convert(model, params, batch, min_sparsity: float) -> tuple[dict, dict]:
    """(params with each candidate weight of at least `min_sparsity` zeros as a `Sparse`,
    {path: its sparsity} of those converted)."""
    check_min_sparsity(min_sparsity)
    flat = traverse.flatten_dict(params, is_leaf=lambda _, x: isinstance(x, (Factored, QWeight)))
    found = candidates(model, params, batch)
    done, sparsest = {}, (None, -1.0)
    for path, (w, k_dims) in found.items():
        w_np = np.asarray(jax.device_get(w), np.float32)
        q = float(np.mean(w_np == 0))
        if q > sparsest[1]:
            sparsest = ("/".join(path), q)
        if q >= min_sparsity:
            K = int(np.prod(w_np.shape[:k_dims]))
            flat[path] = Sparse(spmm.prepare_sparse_weight(w_np.reshape(K, -1)),
                                shape=tuple(w_np.shape), k_dims=k_dims)
            done["/".join(path)] = q
    if not done and not sparsest[0]:  # found by a bug hunt: told to lower --min_sparsity 0
        factored = any(prod.kind in KINDS and isinstance(flat.get(path), Factored)
                       for path, prod in products(model, params, batch).items())
        why = ("a factorized product, model.lowrank, is two products the sparse kernel does "
               "not take); sparsify a pruned run without model.lowrank" if factored else
               "an MoE layer's experts, and weights not stored contraction first, are not "
               "taken)")
        raise ValueError("the run has no plain qkv, out, MLP or head product weight to store "
                         f"sparse ({why}")
    if not done:
        raise ValueError(f"no product weight is at least {min_sparsity:.0%} zeros (the "
                         f"sparsest, {sparsest[0]}, is {sparsest[1]:.1%} zeros); prune the run "
                         "(train.prune.*) or lower --min_sparsity")
    return traverse.unflatten_dict(flat), done


# ---------------------------------------------------------------- the file

def save(out: str, cfg: Config, params, meta: dict) -> int:
    """OUT/sparse.npz (dense arrays as they are; a Sparse weight as KEY/col_ptr, KEY/row,
    KEY/val) + OUT/sparse.json; returns the npz's size in bytes."""
    os.makedirs(out, exist_ok=True)
    arrays, layout, views = {}, {}, {}

    def put(key, a):  # npz knows no bfloat16: store its bytes, note the dtype (as ptq.save)
        a = np.asarray(a)
        if a.dtype == jnp.bfloat16:
            views[key], a = "bfloat16", a.view(np.uint16)
        arrays[key] = a

    is_sparse = lambda _, x: isinstance(x, Sparse)  # noqa: E731
    for path, leaf in traverse.flatten_dict(params, is_leaf=is_sparse).items():
        key = "params/" + "/".join(path)
        if isinstance(leaf, Sparse):
            for name in ("col_ptr", "row", "val"):
                put(f"{key}/{name}", getattr(leaf.w, name))
            layout[key] = {"shape": list(leaf.shape), "k_dims": leaf.k_dims}
        else:
            put(key, leaf)
    path = os.path.join(out, "sparse.npz")
    np.savez(path, **arrays)
    with open(os.path.join(out, "sparse.json"), "w") as f:
        # its data paths absolute, an older run's relative ones too (a bug hunt, session 98)
        json.dump({"config": to_json(with_absolute_paths(cfg)), "sparse": layout,
                   "views": views, **meta}, f, indent=1)
    return os.path.getsize(path)


CSC = ("col_ptr", "row", "val")  # a Sparse weight's arrays in the npz, at KEY/name


def _damaged(path: str, what: str):
    from hpnlp.compress.ptq import _damaged
    return _damaged(path, what, "sparsify")


def _csc(npath: str, mpath: str, key: str, shape: tuple, k_dims: int, col_ptr, row,
         val) -> spmm.SparseWeight:
    """KEY's stored arrays as the SparseWeight [K, N] its `shape` (in sparse.json) says, or
    one line naming the file: what the kernel would read out of bounds, or the XLA twin
    place elsewhere, is refused before anything compiles."""
    K, N = int(np.prod(shape[:k_dims])), int(np.prod(shape[k_dims:]))
    for name, a, want, ok in (
            ("col_ptr", col_ptr, "int32 [N + 1]", col_ptr.dtype == np.int32),
            ("row", row, "int32 [nonzeros]", row.dtype == np.int32),
            ("val", val, "float [nonzeros]", jnp.issubdtype(val.dtype, jnp.floating))):
        if a.ndim != 1 or not ok:
            raise _damaged(npath, f"holds {key}/{name} as {a.dtype} {list(a.shape)}, where a "
                           f"sparse weight stores {want}")
    nnz = len(row)
    if len(col_ptr) != N + 1:  # (it named the config's K twice: "a [512, 512] weight")
        raise _damaged(npath, f"holds {key} as {len(col_ptr) - 1} columns (its col_ptr has "
                       f"{len(col_ptr)} entries), where its shape in {mpath}, {list(shape)} "
                       f"with k_dims {k_dims}, has {N}")
    if len(val) != nnz:
        raise _damaged(npath, f"holds {len(val)} values in {key}/val for {nnz} row indices")
    if col_ptr[0] != 0 or col_ptr[-1] != nnz or np.any(np.diff(col_ptr) < 0):
        raise _damaged(npath, f"holds a {key}/col_ptr that does not rise from 0 to its {nnz} "
                       "nonzeros")
    if nnz and (row.min() < 0 or row.max() >= K):
        raise _damaged(npath, f"holds a row index outside [0, {K}) in {key}/row")
    if np.any(~np.isin(np.flatnonzero(np.diff(row) <= 0) + 1, col_ptr)):
        raise _damaged(npath, f"holds {key}/row with a column's rows not ascending")
    return spmm.SparseWeight(jnp.asarray(col_ptr), jnp.asarray(row), jnp.asarray(val), k=K)


def load_features_key(out: str):
    """The random-feature draw the sparse model in `out` was trained with (Performer, LSH),
    kept in sparse.json; None for a model that reads none (`ptq.load_features_key`)."""
    from hpnlp.compress import ptq
    return ptq.load_features_key(out, command="sparsify")


def load(out: str):
    """(config, params with Sparse weights) saved by `save`; a damaged or edited folder is
    one line naming the file, before anything compiles."""
    from hpnlp.compress import ptq
    mpath, npath = os.path.join(out, "sparse.json"), os.path.join(out, "sparse.npz")
    for p in (mpath, npath):
        if not os.path.exists(p):
            raise NoCheckpoint(f"no sparse checkpoint in {out} ({os.path.basename(p)} missing): "
                               "make one with python -m hpnlp.compress sparsify --out ...")
    # a bug hunt (session 99): none of ptq.load's guards were here: a cut sparse.npz
    # (BadZipFile), a broken sparse.json, an array taken out (KeyError), row indices past K
    # (an error from the compiled kernel), a model edited in sparse.json (flax's
    # ScopeParamShapeError); each is one line naming the file, by ptq's readers
    manifest = ptq.read_manifest(mpath, ("sparse", "views"), "sparsify")
    cfg = ptq.manifest_config(mpath, manifest, "sparsify")
    stored = ptq.read_arrays(npath, mpath, manifest.get("views", {}), "sparsify")
    want = {key: leaf.shape for key, leaf in ptq.model_entries(cfg, packed=False)[0].items()}
    free = ptq.counts_shaped(cfg)
    flat = {}
    for key, info in manifest["sparse"].items():
        layout = ptq._layout(mpath, key, info, "sparsify", fmt=False)
        shape, k_dims = layout["shape"], layout["k_dims"]
        if tuple(want.get(key, ())) != shape and not (free and key.startswith(free)):
            has = list(want[key]) if key in want else "no such weight"
            raise _damaged(mpath, f"gives {key} the shape {list(shape)}, where the model of its "
                           f"config has {has}")
        for name in CSC:
            if f"{key}/{name}" not in stored:
                raise _damaged(npath, f"has no array {key}/{name} (which {mpath} lists)")
        w = _csc(npath, mpath, key, shape, k_dims, *(stored.pop(f"{key}/{name}") for name in CSC))
        flat[tuple(key.split("/")[1:])] = Sparse(w, shape=shape, k_dims=k_dims)
    ptq.check_shapes(npath, mpath, {key: a.shape for key, a in stored.items()},
                     {key: s for key, s in want.items() if key not in manifest["sparse"]},
                     "sparsify", free=free)
    for key, a in stored.items():
        flat[tuple(key.split("/")[1:])] = jnp.asarray(a)
    return cfg, traverse.unflatten_dict(flat)


# ---------------------------------------------------------------- the whole command

def sparsify(workdir: str, out: str, *, min_sparsity: float = MIN_SPARSITY,
             eval_batches: int | None = None, repeats: int = 5) -> dict:
    """The run in `workdir` with its sparse product weights stored and multiplied by their
    nonzeros, into `out`; returns the summary also written to OUT/summary.json."""
    from hpnlp import data as data_lib
    from hpnlp.compress.ptq import _forward_seconds
    from hpnlp.paths import check_new_output, staged
    from hpnlp.train import Trainer
    from hpnlp.train.carry import fold_eval, model_params
    from hpnlp.train.step import finalize

    check_min_sparsity(min_sparsity)  # before anything is restored or compiled
    cfg = load_run_config(workdir)
    from hpnlp.config.compress_checks import quant_products
    m = cfg.model
    has = quant_products(m)
    if not set(has) & set(KINDS):  # a review (session 107): an LSTM LM was restored, then
        # refused naming model.lowrank, which it did not have
        raise config_error("model.arch", m.arch, f"the {m.arch} {m.kind} run in {workdir} has "
                           + (f"{', '.join(has)} products" if has else "no products (a "
                              "lookup)") + ", and "
                           "sparsify stores only qkv, out, MLP and head weights (those the "
                           "sparse kernel computes from their weight alone), so nothing would "
                           "be converted; serve it dense")
    for field in ("stack_layers", "reversible"):  # a review (session 118): their blocks'
        # products are not recorded (nn.scan's collections; reversible halves applied apart),
        # so an LM was refused after its restore naming neither, and a classifier's head
        # alone converted, unsaid
        if getattr(m, field):
            raise config_error(f"model.{field}", True, f"the run in {workdir} holds its blocks "
                               + ("stacked as one (nn.scan)" if field == "stack_layers" else
                                  "as reversible halves") + ", whose products sparsify does "
                               f"not take apart; sparsify a run trained with model.{field}"
                               "=False")
    q = cfg.model.quant
    if q.enabled:  # a bug hunt: a QAT run's sparse model computed in float, its loss reported
        field = "quant.weights" if q.weights != "none" else "quant.activations"
        raise config_error(field, getattr(q, field.split(".")[1]), f"the run in {workdir} "
                           "trained quantized (QAT), and the sparse products multiply float "
                           "weights and activations, so the sparse model would not be the one "
                           "trained; sparsify a run trained without quant.*, or serve this one "
                           "with python -m hpnlp.compress quantize")
    lr = cfg.model.lowrank
    if lr.enabled():  # a review (session 115): its factors were written as pickled objects,
        # and the reload, after the whole evaluation, read "damaged"
        field = ("rank" if lr.rank else "energy" if lr.energy else "ranks")
        raise config_error(f"model.lowrank.{field}", getattr(lr, field), f"the run in "
                           f"{workdir} is factorized (model.lowrank), and sparsify stores plain "
                           "product weights sparse (a factor pair is two products the sparse "
                           "kernel does not take); sparsify a pruned run without model.lowrank")
    if cfg.model.memory.size:
        raise config_error("model.memory.size", cfg.model.memory.size,
                           f"the run in {workdir} reads a key-value memory that lives in its train "
                           "state, which a sparse checkpoint does not hold")
    replacing = check_new_output(out, workdir, may_replace=OUT_FILES)
    # --eval_batches counts the two evals alone, not written into sparse.json's config (a
    # review, session 116, as shrink's in session 115)
    counted = {} if eval_batches is None else {"batches": eval_batches}
    trainer = Trainer(cfg, workdir, read_only=True)
    step = trainer.checkpointer.latest_step()
    state, _ = trainer.initial_state()
    trainer.checkpointer.close()
    params = jax.device_get(model_params(state.params))
    eval_batch = next(iter(data_lib.make_iterator(
        trainer.task, cfg.data, split="eval",
        batch_size=cfg.data.eval_batch_size or cfg.train.batch_size)))
    model = trainer.eval_model
    sparse, converted = convert(model, params, eval_batch, min_sparsity)
    masked_eval = trainer.evaluate(state, **counted)
    # the random-feature draw the weights trained with (Performer, LSH), as quantize takes
    # it, for every pass below, kept in sparse.json (a review, session 115: the sparse model
    # was evaluated under the seed's draw, and its loss against the masked one's was off)
    from hpnlp.compress.ptq import FEATURES, key_json
    from hpnlp.retrieval.knnlm import reads_features
    key = state.host_features_key(cfg.train.feature_redraw_every)
    rngs = {"features": key} if reads_features(cfg) else None

    # the sums with what the layers sow folded in, as the masked eval's (a review: an MoE
    # run's sparse eval lacked its loss_moe_* and moe_* statistics, as quantize's had in
    # session 102): carry.fold_eval, which the timed forwards below run too
    run = jax.jit(lambda p, b: fold_eval(model, {"params": p}, b, rngs))
    run_memory = jax.jit(lambda p, b, mem: model.apply({"params": p}, b, mem,
                                                       method="evaluate_and_memory"))
    sparse_eval = finalize(trainer.eval_sums(
        state, eval_step=lambda _, b: run(sparse, b),
        memory_step=lambda _, b, mem: run_memory(sparse, b, mem), **counted), lm=trainer.lm)
    # the whole held-out pool's metrics, as the masked eval's (a bi-encoder's recall@k, MRR)
    split_metrics = getattr(type(model), "split_metrics", None)
    if split_metrics is not None:  # in the MoE routing groups of the masked model's pool (a
        # review, session 118: the sparse pool routed in this mesh's, the masked in the run's)
        with trainer._context():
            sparse_eval.update(split_metrics(cfg, trainer.split_model(step), sparse,
                                             trainer.task, features_key=key))

    flat = traverse.flatten_dict(params)
    dense_bytes = sum(np.asarray(flat[tuple(k.split("/"))]).nbytes for k in converted)
    sparse_bytes = sum(leaf.w.nbytes for leaf in jax.tree.leaves(
        sparse, is_leaf=lambda x: isinstance(x, Sparse)) if isinstance(leaf, Sparse))
    blocker = spmm.KERNEL.blocker()
    t_dense = _forward_seconds(run, params, eval_batch, repeats=repeats)
    t_sparse = _forward_seconds(run, sparse, eval_batch, repeats=repeats)
    tokens = int(np.sum([np.sum(v != 0) for k, v in eval_batch.items()
                         if k.startswith("segment_ids")]))
    if replacing:  # said once every check has passed
        print(f"hpnlp.compress: note: {replacing}", file=sys.stderr, flush=True)
    with staged(out, OUT_FILES) as stage:  # OUT's files replaced once all are written
        size = save(stage, cfg, sparse, {"source": {"workdir": os.path.abspath(workdir),
                                                    "step": step}, "min_sparsity": min_sparsity,
                                         **({FEATURES: key_json(key)} if rngs else {})})
        _, reloaded = load(stage)
        if rngs and not jnp.array_equal(jax.random.key_data(load_features_key(stage)),
                                        jax.random.key_data(key)):  # (a review, session 118)
            raise RuntimeError(f"the sparse checkpoint written for {out} did not reload its "
                               "random-feature draw")
        identical = all(bool(jnp.array_equal(a, b)) for a, b in zip(
            jax.tree.leaves(run(sparse, eval_batch)), jax.tree.leaves(run(reloaded, eval_batch))))
        if not identical:  # nothing of this call's is kept (staged)
            raise RuntimeError(f"the sparse checkpoint written for {out} did not reload to "
                               "identical outputs")
        summary = {
            "workdir": os.path.abspath(workdir), "step": step, "task": trainer.task.name,
            "min_sparsity": min_sparsity, "converted": converted,
            "eval": {"masked": masked_eval, "sparse": sparse_eval,
                     "loss_rel_diff": sparse_eval["loss"] / masked_eval["loss"] - 1.0},
            "size_bytes": {"float32_params": float_bytes(params), "sparse_file": size,
                           "converted_dense": int(dense_bytes),
                           "converted_sparse": int(sparse_bytes)},
            "forward": {"batch_tokens": tokens, "masked_s": t_dense, "sparse_s": t_sparse,
                        "speedup": t_dense / t_sparse,
                        "how": ("the sparse kernel (hpnlp.compress.spmm)" if blocker is None
                                else f"the XLA twin: {blocker}")},
            "reload_identical": identical,
        }
        with open(os.path.join(stage, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary

