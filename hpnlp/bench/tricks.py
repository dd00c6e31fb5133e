"""`python -m hpnlp.bench tricks`: the classic speed tricks of neural NLP, slow beside fast.

Each trick is a pair of functions computing the same thing (the test suite checks they
agree): the way a first implementation is usually written, and the way that is fast.
Both run op by op ("eager", as in PyTorch or DyNet, where these tricks were learned) and,
where the pair can be traced, under `jax.jit`, which shows how much of each trick the
compiler recovers by itself from an unrolled loop (some, not all: the measured jit
column is the answer on this machine). Host transfers and a loop over ragged examples
cannot be traced into one program at all, so they are eager only.

Shape letters: B examples, L words, E width, H hidden, V vocabulary, N vectors.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpnlp.bench import harness, report


@dataclasses.dataclass(frozen=True)
class Trick:
    name: str
    what: str  # one line: what is computed, and what the fast version does differently
    inputs: Callable[[bool], tuple]  # quick -> args
    slow: Callable
    fast: Callable
    jittable: bool = True
    sizes: Callable[[bool], dict] | None = None  # quick -> the fields `what` names, if any

    def said(self, quick: bool) -> str:
        """`what` at the sizes this run uses (a bug hunt, session 95: --quick rows were
        labelled with the full run's)."""
        return self.what.format(**self.sizes(quick)) if self.sizes else self.what


# 1. Hoisting: a sentence-level vector combined with every word. The slow loop recomputes
# the sentence projection for each word; the fast one computes it once per sentence.
def _hoist_inputs(quick: bool):
    L, E = (16, 32) if quick else (128, 512)
    k = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(k[0], (L, E)), jax.random.normal(k[1], (E, E)) / E ** 0.5,
            jax.random.normal(k[2], (E, E)) / E ** 0.5)


def hoist_slow(words_LE, w_word_EE, w_sent_EE):
    out = []
    for i in range(words_LE.shape[0]):
        sent_E = jnp.mean(words_LE, axis=0) @ w_sent_EE  # the same for every word
        out.append(jnp.tanh(words_LE[i] @ w_word_EE + sent_E))
    return jnp.stack(out)


def hoist_fast(words_LE, w_word_EE, w_sent_EE):
    sent_E = jnp.mean(words_LE, axis=0) @ w_sent_EE  # once per sentence
    return jnp.tanh(words_LE @ w_word_EE + sent_E[None, :])


# 2. One matrix-matrix product instead of one matrix-vector product per word.
def _matmul_inputs(quick: bool):
    L, E, H = (16, 32, 32) if quick else (256, 512, 512)
    k = jax.random.split(jax.random.key(1), 2)
    return jax.random.normal(k[0], (L, E)), jax.random.normal(k[1], (E, H)) / E ** 0.5


def matvec_slow(x_LE, w_EH):
    return jnp.stack([x_LE[i] @ w_EH for i in range(x_LE.shape[0])])


def matvec_fast(x_LE, w_EH):
    return x_LE @ w_EH


# 3. One host-to-device transfer of the whole batch instead of one per word.
def _transfer_inputs(quick: bool):
    B, L = (4, 16) if quick else (64, 128)
    return (np.random.default_rng(0).integers(0, 1000, size=(B, L)).astype(np.int32),)


def transfer_slow(ids_BL):
    rows = [jnp.stack([jax.device_put(ids_BL[b, i]) for i in range(ids_BL.shape[1])])
            for b in range(ids_BL.shape[0])]
    return jax.block_until_ready(jnp.stack(rows))


def transfer_fast(ids_BL):
    return jax.block_until_ready(jax.device_put(ids_BL))


# 4. Bags of embeddings of different lengths: pad and mask instead of one example at a time.
def _bags_inputs(quick: bool):
    B, V, E, Lmax = (6, 50, 16, 9) if quick else (256, 10000, 256, 64)
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, Lmax + 1, size=B)
    bags = [rng.integers(0, V, size=n).astype(np.int32) for n in lengths]
    table_VE = jax.random.normal(jax.random.key(3), (V, E))
    ids_BL = np.zeros((B, Lmax), np.int32)
    for b, ids in enumerate(bags):
        ids_BL[b, :len(ids)] = ids
    return table_VE, tuple(bags), ids_BL, lengths.astype(np.int32)


def bags_slow(table_VE, bags, ids_BL, lengths_B):
    sums = [table_VE[jnp.asarray(ids)].sum(axis=0) for ids in bags]
    means = [s / len(ids) for s, ids in zip(sums, bags)]
    return jnp.stack(sums), jnp.stack(means)


def bags_fast(table_VE, bags, ids_BL, lengths_B):
    mask_BL = jnp.arange(ids_BL.shape[1])[None, :] < lengths_B[:, None]
    emb_BLE = jnp.take(table_VE, ids_BL, axis=0) * mask_BL[..., None]
    sum_BE = emb_BLE.sum(axis=1)
    return sum_BE, sum_BE / lengths_B[:, None].astype(sum_BE.dtype)  # real length, not padded


# 5. Scores of one vector against many: a batched dot product instead of multiply-and-sum.
def _dots_inputs(quick: bool):
    N, E = (64, 32) if quick else (50000, 512)
    k = jax.random.split(jax.random.key(4), 2)
    return jax.random.normal(k[0], (E,)), jax.random.normal(k[1], (N, E))


def dots_slow(a_E, b_NE):
    return jnp.sum(a_E[None, :] * b_NE, axis=-1)  # materializes the [N, E] product


def dots_fast(a_E, b_NE):
    return b_NE @ a_E


# 6. Per-example gradient norms of a Transformer LM over examples of different lengths:
# one vmapped program over the padded batch instead of a Python loop over examples
# (hpnlp.train.per_example). The loop's calls are jitted too (one compile per length,
# done in warmup), so the difference is B dispatches of small programs against one.
def _per_example_sizes(quick: bool, long: bool = False) -> tuple[int, int, int]:
    """(B, L, E): examples, their longest length (the shortest is L/4), model width."""
    if quick:
        return (2, 16, 16) if long else (4, 16, 16)
    return (32, 128, 128) if long else (128, 32, 64)


def _per_example_said(quick: bool, long: bool = False) -> dict:
    B, L, _ = _per_example_sizes(quick, long)
    return {"B": B, "shortest": L // 4, "L": L}


def _per_example_inputs(quick: bool, *, long: bool = False):
    """Many short examples (the DP-SGD regime: per-call overhead dominates the loop), or
    with `long`, fewer long ones, where the padded batch's wasted work (lengths are drawn
    from L/4..L) can outweigh the loop's overhead."""
    from hpnlp import models
    from hpnlp.config import default_configdict, from_configdict, validate

    B, L, E = _per_example_sizes(quick, long)
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=L)
    cd.model.update(kind="lm", width=E, depth=2, num_heads=4, mlp_dim=4 * E, max_len=L, dropout=0.0)
    model = models.build(validate(from_configdict(cd), num_devices=1), deterministic=True)
    rng = np.random.default_rng(5)
    lengths = rng.integers(L // 4, L + 1, size=B)
    tokens = rng.integers(0, 256, size=(B, L + 1)).astype(np.int32)
    seg = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
    batch = {"inputs": tokens[:, :-1] * seg, "targets": tokens[:, 1:] * seg, "segment_ids": seg,
             "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()}
    # jitted: an eager init compiles every primitive on its own
    params = jax.jit(model.init)(jax.random.key(0), jax.tree.map(lambda x: x[:1], batch))["params"]
    return model, params, batch, lengths


@functools.lru_cache(maxsize=None)
def _grad_norm_fns(model):
    from hpnlp.train import per_example

    def one(params, ex):  # ex: a batch of one, unpadded
        sums = model.apply({"params": params}, ex)
        return sums["loss"] / sums["weight"]
    loop_fn = jax.jit(lambda p, ex: optax.tree.norm(jax.grad(one)(p, ex)))
    vmap_fn = jax.jit(lambda p, b: per_example.per_example_grad_norms(model, p, b))
    return loop_fn, vmap_fn


def per_example_slow(model, params, batch, lengths_B):
    loop_fn, _ = _grad_norm_fns(model)
    return jnp.stack([loop_fn(params, {k: v[b:b + 1, :n] for k, v in batch.items()})
                      for b, n in enumerate(lengths_B)])


def per_example_fast(model, params, batch, lengths_B):
    _, vmap_fn = _grad_norm_fns(model)
    return vmap_fn(params, batch)


TRICKS = (
    Trick("hoist", "per-sentence projection computed once, not once per word",
          _hoist_inputs, hoist_slow, hoist_fast),
    Trick("matmul", "one [L,E]x[E,H] product instead of L [E]x[E,H] products",
          _matmul_inputs, matvec_slow, matvec_fast),
    Trick("transfer", "one host-to-device copy of the batch instead of one per word",
          _transfer_inputs, transfer_slow, transfer_fast, jittable=False),
    Trick("bags", "padded bags + mask (sum and length-correct mean) instead of a loop over examples",
          _bags_inputs, bags_slow, bags_fast, jittable=False),
    Trick("dots", "a @ B^T instead of elementwise multiply then sum",
          _dots_inputs, dots_slow, dots_fast),
    Trick("per_example", "per-example gradient norms, {B} examples of {shortest}..{L} tokens: one "
          "vmapped program instead of a loop", _per_example_inputs, per_example_slow,
          per_example_fast, jittable=False, sizes=_per_example_said),
    Trick("per_example_long", "the same, {B} examples of {shortest}..{L} tokens: padding waste "
          "against loop overhead", functools.partial(_per_example_inputs, long=True),
          per_example_slow, per_example_fast, jittable=False,
          sizes=functools.partial(_per_example_said, long=True)),
)


def run(out_dir: str, *, quick: bool, names: tuple[str, ...] | None = None) -> dict:
    """Time every trick (or those in `names`) slow against fast; write the report."""
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    timing = dict(repeats=3, min_time_s=0.01) if quick else dict(repeats=5, min_time_s=0.2)
    chosen = [t for t in TRICKS if names is None or t.name in names]

    def head(trick):
        return {"trick": trick.name, "what": trick.said(quick)}

    def measure(trick):
        args = trick.inputs(quick)
        row = head(trick)
        for kind in ("slow", "fast"):
            fn = getattr(trick, kind)
            row[f"eager_{kind}"] = harness.time_python(lambda: jax.block_until_ready(fn(*args)),
                                                       **timing).as_dict()
            if trick.jittable:
                row[f"jit_{kind}"] = harness.time_jax(fn, *args, **timing).as_dict()
        row["eager_speedup"] = row["eager_slow"]["median_s"] / row["eager_fast"]["median_s"]
        if trick.jittable:
            row["jit_speedup"] = row["jit_slow"]["median_s"] / row["jit_fast"]["median_s"]
        return row

    # a Ctrl-C or SIGTERM keeps the rows that ran (a bug hunt, session 95: none were written)
    results, interrupted = harness.run_rows(chosen, measure, head, desc="tricks bench")
    payload = {"benchmark": "tricks", "machine": info, "quick": quick,
               "interrupted": interrupted, "results": results}
    rows = []
    for r in results:
        t = lambda k: report.fmt(r[k]["median_s"], "ms") if k in r else "–"  # noqa: E731
        rows.append([f"`{r['trick']}`", r["what"], t("eager_slow"), t("eager_fast"),
                     report.fmt(r.get("eager_speedup", r.get("status")), "x"), t("jit_slow"),
                     t("jit_fast"), report.fmt(r.get("jit_speedup"), "x")])
    sizes = ("`--quick`: small sizes (the per-example rows' labels name theirs); the full run's "
             "are larger." if quick else "")
    md = "\n".join([report.header_md(info, {}), "",
                    "Median ms; eager = op by op, jit = `jax.jit` of the same function. " + sizes,
                    "", report.table(["trick", "what", "eager slow", "eager fast", "eager speedup",
                                      "jit slow", "jit fast", "jit speedup"], rows)])
    report.write(harness.report_dir(out_dir, interrupted), "tricks", payload, md)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # no options beyond --out and --quick


def main(args) -> dict:
    payload = run(args.out, quick=args.quick)
    harness.exit_if_interrupted(payload["interrupted"], args.out)
    return payload

