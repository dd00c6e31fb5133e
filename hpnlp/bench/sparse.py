"""`python -m hpnlp.bench sparse`: where a sparse weight product beats the dense one on this CPU.

Pruning (`train.prune`) zeroes weights but keeps them dense, so a pruned hpnlp model runs at
its dense speed: XLA:CPU has no sparse product. This bench measures what that leaves on the
table, at the default byte LM's products (experiments/lm.py: one eval batch of
`batch_size` x `seq_len` tokens through each block's qkv, out, mlp_in and mlp_out weights,
shapes read from its config), with weights pruned by magnitude (layer-wise, unstructured)
at 50-98% sparsity and 2:4 (N:M along the contraction), in one run:

- `xla dense`: the baseline, what a pruned hpnlp model runs (the masked weight, dense, jitted);
- `hpnlp csc`: hpnlp's sparse product (`hpnlp.compress.spmm`: the weight's nonzeros by
  column, the rows of x as vector lanes, every core), what `python -m hpnlp.compress
  sparsify` serves a pruned run with;
- `torch dense`: PyTorch's dense product (its CPU BLAS);
- `torch csr`: `torch.sparse.mm` of the weight as a CSR matrix (W^T [N, K] @ x^T);
- `scipy csr`: SciPy's CSR product (one thread);
- `jax bcoo`: `jax.experimental.sparse` (BCOO weight, jitted): JAX's own sparse product,
  which XLA lowers to gathers and a scatter-add.

Every product is checked against float64 NumPy of the masked weight before it is timed (a
row whose relative error exceeds 1e-4 reads `wrong`, one that raises `failed: ...`, and
neither gets a time). Times are medians of interleaved rounds (every implementation once a
round, `harness.time_interleaved`), each (product, sparsity) on its own; the block's row
sums its four products. Reported: ms and speed-up over `xla dense` at each sparsity, and
per implementation the lowest sparsity at which it beats `xla dense` on the whole block
(`breakeven`). No targets: the issue asks to state where, if anywhere, a sparse product wins.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import harness, report

SPARSITIES = (0.5, 0.75, 0.9, 0.95, 0.98)
SIZES = {
    "full": dict(tokens=None, sparsities=SPARSITIES, repeats=15),
    "quick": dict(tokens=256, sparsities=(0.5, 0.95), repeats=3),
}
IMPLS = ("xla dense", "hpnlp csc", "torch dense", "torch csr", "scipy csr", "jax bcoo")
TOLERANCE = 1e-4  # max |y - y64| / max |y64|


def products(tokens: int | None = None) -> tuple[int, dict[str, tuple[int, int]]]:
    """(tokens, {name: (K, N)}): the default byte LM's block products and one eval batch."""
    cd = harness.experiment_module("lm.py").get_config("bytes")
    m = cd.model
    D = m.head_dim or m.width // m.num_heads
    kv = m.num_kv_heads or m.num_heads
    shapes = {"qkv": (m.width, (m.num_heads + 2 * kv) * D), "out": (m.num_heads * D, m.width),
              "mlp_in": (m.width, m.mlp_dim), "mlp_out": (m.mlp_dim, m.width)}
    return tokens or cd.train.batch_size * cd.data.seq_len, shapes


def magnitude_mask(w: np.ndarray, sparsity: float) -> np.ndarray:
    """Keep the largest |w|: exactly round(sparsity * size) entries pruned, as `train.prune`'s
    layer-wise magnitude mask prunes them (ties: the earlier position first)."""
    from hpnlp.compress import prune
    keep = prune._keep_top(jnp.abs(jnp.asarray(w)).ravel(), int(round(sparsity * w.size)))
    return np.asarray(keep).reshape(w.shape)


def nm_mask(w: np.ndarray, n: int = 2, m: int = 4) -> np.ndarray:
    """N:M along the contraction (axis 0), as `train.prune` makes it."""
    from hpnlp.compress import prune
    return np.asarray(prune.nm_mask(jnp.abs(jnp.asarray(w)), (0,), n, m))


def _calls(x: np.ndarray, w: np.ndarray, torch) -> dict:
    """{impl: zero-argument blocking call returning y [T, N] as NumPy-able}."""
    import scipy.sparse as sp
    from jax.experimental import sparse as jsparse

    from hpnlp.compress import spmm

    xj, wj = jnp.asarray(x), jnp.asarray(w)
    bcoo = jsparse.BCOO.fromdense(wj)
    matmul = jax.jit(lambda a, b: a @ b)  # compiled once per weight type: dense, BCOO
    xT = np.ascontiguousarray(x.T)
    w_csr = sp.csr_matrix(np.ascontiguousarray(w.T))
    calls = {"xla dense": lambda: jax.block_until_ready(matmul(xj, wj)),
             "scipy csr": lambda: (w_csr @ xT).T,
             "jax bcoo": lambda: jax.block_until_ready(matmul(xj, bcoo))}
    if spmm.available():
        csc = spmm.prepare_sparse_weight(w)
        sparse = jax.jit(lambda a, b: spmm.sparse_matmul(a, b, impl="kernel"))
        calls["hpnlp csc"] = lambda: jax.block_until_ready(sparse(xj, csc))
    if torch is not None:
        xt, wt, xtT = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(xT)
        with warnings.catch_warnings():  # "sparse CSR tensor support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            wt_csr = torch.from_numpy(np.ascontiguousarray(w.T)).to_sparse_csr()
        calls["torch dense"] = lambda: xt @ wt
        calls["torch csr"] = lambda: torch.sparse.mm(wt_csr, xtT).T
    return calls


def _check(y, want: np.ndarray) -> float:
    y = np.asarray(y.numpy() if hasattr(y, "numpy") else y, np.float64)
    return float(np.abs(y - want).max() / max(np.abs(want).max(), 1e-30))


def product_rows(name: str, K: int, N: int, T: int, pattern: str, sparsity: float, s: dict,
                 torch, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32)
    w = w * (nm_mask(w) if pattern == "2:4" else magnitude_mask(w, sparsity))
    want = x.astype(np.float64) @ w.astype(np.float64)
    calls = _calls(x, w, torch)
    base = {"product": name, "K": K, "N": N, "tokens": T, "pattern": pattern,
            "sparsity_asked": sparsity, "sparsity": float(np.mean(w == 0)),
            "nonzeros": int(np.count_nonzero(w))}
    rows, ok = {}, {}
    for impl in IMPLS:
        if impl not in calls:
            why = "no PyTorch" if impl.startswith("torch") else "no kernel here"
            rows[impl] = {**base, "impl": impl, "status": f"skipped ({why})"}
            continue
        try:  # one implementation that raises (a PyTorch without CSR `sparse.mm`, BCOO out
            # of memory) is its failed row, not the lost run (a review, session 109)
            err = _check(calls[impl](), want)
        except Exception as e:
            rows[impl] = {**base, "impl": impl,
                          "status": f"failed: {type(e).__name__}: {e}"[:150]}
            continue
        rows[impl] = {**base, "impl": impl, "max_rel_err": err,
                      "status": "ok" if err <= TOLERANCE else "wrong"}
        if err <= TOLERANCE:
            ok[impl] = calls[impl]
    timed = harness.time_interleaved(ok, repeats=s["repeats"])
    for impl, (t, cpu) in timed.items():
        rows[impl].update(time=t.as_dict(), cpu_s=cpu)
    return list(rows.values())


def settings(s: dict) -> list[tuple[str, float]]:
    return [("unstructured", q) for q in s["sparsities"]] + [("2:4", 0.5)]


def block_rows(rows: list[dict]) -> list[dict]:
    """Per (pattern, sparsity, impl): the sum of the block's products' median times and its
    speed-up over `xla dense` (None where any product has no time)."""
    out = []
    keys = sorted({(r["pattern"], r["sparsity_asked"], r["impl"]) for r in rows},
                  key=lambda k: (k[0] != "unstructured", k[1], IMPLS.index(k[2])))
    def at(pattern, q, impl):
        return [r for r in rows
                if (r["pattern"], r["sparsity_asked"], r["impl"]) == (pattern, q, impl)]

    for pattern, q, impl in keys:
        mine, dense = at(pattern, q, impl), at(pattern, q, "xla dense")
        t = sum(r["time"]["median_s"] for r in mine) if all("time" in r for r in mine) else None
        d = sum(r["time"]["median_s"] for r in dense) if all("time" in r for r in dense) else None
        out.append({"pattern": pattern, "sparsity": q, "impl": impl, "median_s": t,
                    "speedup_vs_xla_dense": report.ratio(d, t),
                    "status": "ok" if t is not None else
                    next(r["status"] for r in mine if "time" not in r)})
    return out


NOT_MEASURED = "not measured"  # `breakeven`'s, where the run has no time to judge by


def breakeven(blocks: list[dict]) -> dict:
    """Per implementation, the lowest unstructured sparsity from which on it beats `xla
    dense` on the whole block (None where it never does in the run; NOT_MEASURED where a
    block of it, or of `xla dense`, has no time: a review, session 118, found a skipped
    implementation reported as "never")."""
    out = {}
    for impl in IMPLS[1:]:
        mine = sorted((b for b in blocks if b["impl"] == impl and b["pattern"] == "unstructured"),
                      key=lambda b: b["sparsity"])
        if not mine or any(b["speedup_vs_xla_dense"] is None for b in mine):
            out[impl] = NOT_MEASURED
            continue
        wins = [b["speedup_vs_xla_dense"] > 1 for b in mine]
        first = next((i for i in range(len(wins)) if all(wins[i:])), None)
        out[impl] = mine[first]["sparsity"] if first is not None and mine else None
    return out


def _markdown(p: dict) -> str:
    T = p["tokens"]
    shapes = ", ".join(f"{k} [{K} -> {N}]" for k, (K, N) in p["products"].items())
    out = [report.header_md(p["machine"], {}), "",
           f"The default byte LM's block products ({shapes}) on one eval batch of {T} tokens, "
           "weights pruned by magnitude (unstructured) or 2:4; median ms of the block's four "
           "products (interleaved rounds) and speed-up over `xla dense`, what a pruned hpnlp "
           "model runs. `scipy csr` runs on one thread.", ""]
    impls = [i for i in IMPLS if any(b["impl"] == i for b in p["block"])]
    cells = {(b["pattern"], b["sparsity"], b["impl"]): b for b in p["block"]}
    settings_seen = sorted({(b["pattern"], b["sparsity"]) for b in p["block"]},
                           key=lambda k: (k[0] != "unstructured", k[1]))
    body = []
    for pattern, q in settings_seen:
        row = [pattern if pattern != "unstructured" else f"{q:.0%}"]
        for impl in impls:
            b = cells.get((pattern, q, impl))
            if b is None or b["median_s"] is None:
                row.append(b["status"] if b else "–")
            elif impl == "xla dense" or b["speedup_vs_xla_dense"] is None:  # the ms alone
                # where `xla dense` has no time (a review, session 109: a TypeError after all
                # the timing, no report written)
                row.append(f"{b['median_s'] * 1e3:.2f}")
            else:
                row.append(f"{b['median_s'] * 1e3:.2f} ({b['speedup_vs_xla_dense']:.2f}x)")
        body.append(row)
    out += [report.table(["sparsity"] + [f"`{i}` ms" for i in impls], body), ""]
    be = p["breakeven"]
    out += ["Lowest sparsity from which on each beats `xla dense` on the whole block: "
            + "; ".join(f"`{i}` " + ("never" if v is None else v if isinstance(v, str) else
                                     f"{v:.0%}") for i, v in be.items())
            + ".", ""]
    worst = max((r.get("max_rel_err", 0.0) for r in p["rows"]), default=0.0)
    out += [f"Largest relative error against float64 NumPy: {worst:.1e} (bound {TOLERANCE:g}).",
            ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in IMPLS[1:]:
        pts = sorted((b["sparsity"], b["speedup_vs_xla_dense"]) for b in p["block"]
                     if b["impl"] == impl and b["pattern"] == "unstructured"
                     and b["speedup_vs_xla_dense"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.axhline(1.0, color="black", ls="--", lw=1, label="xla dense (a pruned hpnlp model)")
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (unstructured, magnitude)")
    ax.set_ylabel("speed-up over XLA's dense product")
    ax.set_title(f"Byte LM block products, {p['tokens']} tokens")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "sparse_speedup.png"))


def run(out_dir: str, *, quick: bool, only: tuple[str, ...] | None = None) -> dict:
    """The bench; `only` limits the products measured (the test's)."""
    # else XLA's TF32 product on a GPU reads `wrong` against TOLERANCE (a review, session 109)
    harness.full_float32_on_gpu()
    s = dict(SIZES["quick" if quick else "full"])
    T, shapes = products(s["tokens"])
    shapes = {k: v for k, v in shapes.items() if only is None or k in only}
    torch = harness.torch_or_none()
    payload = {"sizes": s, "machine": harness.machine_info(), "tokens": T, "products": shapes,
               "seconds": {}, "rows": []}
    t0 = time.perf_counter()
    todo = [(pat, q, name) for pat, q in settings(s) for name in shapes]
    for i, (pattern, q, name) in enumerate(tqdm(todo, desc="sparse products", leave=False)):
        K, N = shapes[name]
        payload["rows"] += product_rows(name, K, N, T, pattern, q, s, torch, seed=i)
    payload["seconds"]["products"] = time.perf_counter() - t0
    payload["block"] = block_rows(payload["rows"])
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    payload["breakeven"] = breakeven(payload["block"])
    report.write(out_dir, "sparse", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    del p  # --out and --quick only


def main(args) -> None:
    run(args.out, quick=args.quick)
