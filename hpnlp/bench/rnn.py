"""`python -m hpnlp.bench rnn`: hpnlp's LSTM/GRU layers against `flax.linen.RNN` cells.

Rows, all at one shape in one run, `hpnlp.rnn.RNNLayer` LSTM as: `hpnlp LSTM`, the default
layer (`impl="auto"`: the fused C++ kernel where it runs, `hpnlp.rnn.fused`);
`hpnlp LSTM (scan)`, the XLA scan with the input projection in blocks of `chunk=8` steps
(the default); `hpnlp LSTM (scan, one product)`, the scan with `chunk=None`;
`hpnlp LSTM (autodiff)`, the scan's autodiff twin (`fast_backward=False`); against
`flax.linen.RNN(OptimizedLSTMCell)`. `RNNLayer` GRU (the scan) against
`flax.linen.RNN(GRUCell)`. And the bound, "LSTM matrix products only": the products an
LSTM layer of this shape built from XLA's products does, with no gate arithmetic, so its
speedup over flax is the most such a layer (the LSTM scan rows) can reach here; the
fused kernel does its products itself and is not bound by it.
Forward and forward+backward (gradient of the output sum with respect to parameters and
inputs) wall time (median, min, max), CPU time (process time, which other processes on a
shared machine inflate far less than wall time), achieved GFLOP/s and its fraction of
this machine's matmul rate, and the speedup over the flax peer in the same run.

Full: B=32, L=256, E=H=512 (a few minutes). `--quick`: B=8, L=32, E=H=64 (seconds).

Targets (`targets` in results.json, a "### Targets" table in results.md; runs at the full
shape that include both rows): the flax `OptimizedLSTMCell` layer's median time over `hpnlp LSTM`'s,
forward+backward >= 2.0 (`lstm_fwd_bwd_vs_flax`) and forward >= 1.5 (`lstm_fwd_vs_flax`).
Under them the report says what each asks of our kernel in that run (`_needed`): the
GFLOP/s its products would run at, as a share of the measured float32 product rate.

FLOP convention: forward = 2·B·L·(E+H)·K·H (the input and recurrent products; K = 4 gates
for the LSTM, 3 for the GRU), forward+backward = 3x forward; gate arithmetic is not
counted.
"""

from __future__ import annotations

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from hpnlp import rnn
from hpnlp.rnn import cells
from hpnlp.bench import harness, report

# name -> (cell kind, the flax peer it is compared with, module constructor of H)
IMPLS = {
    "hpnlp LSTM": ("lstm", "flax OptimizedLSTMCell", lambda H: rnn.RNNLayer(kind="lstm", hidden=H)),
    "hpnlp LSTM (scan)": ("lstm", "flax OptimizedLSTMCell",
                          lambda H: rnn.RNNLayer(kind="lstm", hidden=H, impl="scan")),
    "hpnlp LSTM (scan, one product)": ("lstm", "flax OptimizedLSTMCell", lambda H: rnn.RNNLayer(
        kind="lstm", hidden=H, impl="scan", chunk=None)),
    "hpnlp LSTM (autodiff)": ("lstm", "flax OptimizedLSTMCell",
                             lambda H: rnn.RNNLayer(kind="lstm", hidden=H, fast_backward=False)),
    "flax OptimizedLSTMCell": ("lstm", None, lambda H: nn.RNN(nn.OptimizedLSTMCell(H))),
    "hpnlp GRU": ("gru", "flax GRUCell", lambda H: rnn.RNNLayer(kind="gru", hidden=H)),
    "flax GRUCell": ("gru", None, lambda H: nn.RNN(nn.GRUCell(H))),
    # Not a layer: the bound. See `_products_only`.
    "LSTM matrix products only": ("lstm", "flax OptimizedLSTMCell", None),
}
SIZES = {"full": dict(B=32, L=256, E=512, H=512), "quick": dict(B=8, L=32, E=64, H=64)}
# name -> (mode, bound on the speedup flax time / ours; "hpnlp LSTM" against flax's cell).
TARGET_ROWS = ("hpnlp LSTM", "flax OptimizedLSTMCell")
TARGETS = {"lstm_fwd_bwd_vs_flax": ("fwd_bwd", 2.0), "lstm_fwd_vs_flax": ("fwd", 1.5)}


def _flops(kind: str, *, B, L, E, H) -> float:
    return 2.0 * B * L * (E + H) * cells.NUM_GATES[kind] * H


def _products_only(H: int, x):
    """The matrix products an LSTM layer cannot avoid, done as `RNNLayer`'s scan does them
    (the default `chunk=8`), and nothing else. Forward: per block of 8 steps one input
    product ([8*B, E] x [E, 4H]), then 8 dependent recurrent products ([B, H] x [H, 4H];
    each step's h is a slice of the last product: no gate arithmetic). Backward: L
    dependent [B, 4H] x [4H, H] products and the three whole-sequence ones (dW_h, dW_x,
    dx). Its time is about the floor for an LSTM at this shape built from XLA's products
    on this machine, so its speedup over flax bounds the LSTM scan rows. Not the fused
    kernel (`hpnlp LSTM` on CPU), which computes its products itself and beats it (the
    README's record: 376 against 505 ms forward+backward)."""
    B, L, E = x.shape
    G, T = 4 * H, 8
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w_x": jax.random.normal(k1, (E, G)) * E ** -0.5,
              "w_h": jax.random.normal(k2, (H, G)) * H ** -0.5}

    def fwd(p, x):
        def block(h, x_TBE):
            xw = x_TBE.reshape(T * B, E) @ p["w_x"]
            h, hs = jax.lax.scan(lambda h, _: ((h @ p["w_h"])[:, :H],) * 2, h + xw[:B, :H],
                                 None, length=T)
            return h, (hs, xw)
        x_NTBE = jnp.swapaxes(x, 0, 1).reshape(L // T, T, B, E)
        _, (hs, xw) = jax.lax.scan(block, jnp.zeros((B, H)), x_NTBE)
        return hs, xw.reshape(L * B, G)

    def fwd_bwd(p, x):
        hs, dz = fwd(p, x)  # dz: any [L*B, G] array serves as the gate gradients
        w_ht = p["w_h"].T
        dhs = jax.lax.scan(lambda d, _: ((jnp.tile(d @ w_ht, (1, 4)),) * 2), dz[:B], None,
                           length=L)[1]
        hs = hs.reshape(L * B, H)
        return dhs, hs.T @ dz, x.reshape(B * L, E).T @ dz, dz @ p["w_x"].T

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}, params


def _fn(name: str, H: int, x):
    """({"fwd": f, "fwd_bwd": f}, params) with f(params, x)."""
    if IMPLS[name][2] is None:
        return _products_only(H, x)
    module = IMPLS[name][2](H)
    params = module.init(jax.random.key(0), x)
    if isinstance(module, rnn.RNNLayer):
        fwd = lambda p, x: module.apply(p, x)[0]  # noqa: E731
    else:
        fwd = lambda p, x: module.apply(p, x)  # noqa: E731
    return {"fwd": fwd, "fwd_bwd": jax.grad(lambda p, x: jnp.sum(fwd(p, x)), (0, 1))}, params


def compile_impl(name: str, *, B, L, E, H) -> dict:
    """{mode: zero-argument blocking call} for one implementation (one init, one compile
    per mode), with the compile time and FLOPs of each."""
    kind = IMPLS[name][0]
    x = jax.random.normal(jax.random.key(1), (B, L, E), jnp.float32)
    fns, params = _fn(name, H, x)
    out = {}
    for mode in ("fwd", "fwd_bwd"):
        compiled, compile_s = harness.compile_timed(fns[mode], params, x)
        out[mode] = dict(call=lambda c=compiled: jax.block_until_ready(c(params, x)),
                         compile_s=compile_s,
                         flops=_flops(kind, B=B, L=L, E=E, H=H) * (1 if mode == "fwd" else 3))
    return out


def measure(names: list[str], *, B, L, E, H, repeats: int) -> list[dict]:
    """Forward and forward+backward rows of every implementation. All are compiled first,
    then timed in interleaved rounds (`harness.time_interleaved`): on a machine whose speed
    drifts, one after the other would hand the slow minutes to whichever ran then. Also
    the process CPU time of one call (the fastest), which drift inflates less."""
    built, rows = {}, []
    for name in tqdm(names, desc="rnn bench: compile", dynamic_ncols=True):
        try:
            for mode, b in compile_impl(name, B=B, L=L, E=E, H=H).items():
                built[(name, mode)] = b
        except Exception as e:  # report, never crash the whole run
            rows += [{"impl": name, "cell": IMPLS[name][0], "mode": mode,
                      "status": f"failed: {type(e).__name__}: {str(e)[:150]}"}
                     for mode in ("fwd", "fwd_bwd")]
    timed = harness.time_interleaved({k: b["call"] for k, b in built.items()}, repeats=repeats,
                                     warmup=1, min_time_s=0.3)
    for (name, mode), (t, cpu_s) in timed.items():
        t.compile_s = built[(name, mode)]["compile_s"]
        rows.append({"impl": name, "cell": IMPLS[name][0], "mode": mode, "status": "ok",
                     "time": t.as_dict(), "cpu_s": cpu_s,
                     "gflops": built[(name, mode)]["flops"] / t.median_s / 1e9})
    order = {n: i for i, n in enumerate(names)}
    return sorted(rows, key=lambda r: (order[r["impl"]], r["mode"]))


def run(out_dir: str, *, quick: bool, sizes: dict | None = None,
        impls: list[str] | None = None) -> dict:
    shape = dict(sizes or SIZES["quick" if quick else "full"])
    repeats = 3 if quick else 9  # the fused kernel's threads meet every step: more spread
    names = impls or list(IMPLS)
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise harness.BenchInputError(
            f"unknown rnn implementation(s) {unknown}; choose from {list(IMPLS)}")
    os.makedirs(out_dir, exist_ok=True)
    info = {**harness.machine_info(), "kernels": harness.kernel_info()}
    rates = harness.ceiling_rates(quick=quick)
    info["fma_peak_gflops"] = harness.fma_peak()
    results = measure(names, repeats=repeats, **shape)
    payload = {"benchmark": "rnn", "machine": info, "matmul_gflops": rates, "shape": shape,
               "results": results}
    # at the shape they are set for (a README walk: --quick wrote them at B=8, L=32, H=64,
    # unmet, as if they held there)
    payload["quick"] = shape != SIZES["full"]  # said whatever it ran (session 98)
    if set(names) != set(IMPLS):  # a part of the table: not the one the README shows (a bug
        # hunt, session 102: `--impls "hpnlp GRU"` wrote a 2-row report, marked full)
        payload["subset"] = {"impls": names}
    if set(TARGET_ROWS) <= set(names):
        report.targets_unless_quick(payload, payload["quick"], lambda: _targets(results))
    payload["summary"] = _summarize(payload, out_dir)
    report.write(out_dir, "rnn", payload, _markdown(payload))
    return payload


def _get(results, impl, mode):
    return next((r for r in results if r["impl"] == impl and r["mode"] == mode
                 and r.get("status") == "ok"), None)


def _targets(results: list[dict]) -> dict:
    """The issue's targets from this run's rows; a row that failed leaves its target not
    measured (value None, not met)."""
    ours, flax_row = TARGET_ROWS

    def median(impl, mode):
        return ((_get(results, impl, mode) or {}).get("time") or {}).get("median_s")
    return {name: report.target(report.ratio(median(flax_row, mode), median(ours, mode)),
                                bound, ">=")
            for name, (mode, bound) in TARGETS.items()}


def _summarize(payload: dict, out_dir: str) -> dict:
    res = payload["results"]
    speed = {}
    for name, (_, peer, _) in IMPLS.items():
        for mode in ("fwd", "fwd_bwd"):
            a, p = _get(res, name, mode), _get(res, peer, mode) if peer else None
            if a and p:
                speed.setdefault(name, {})[mode] = {
                    "vs": peer, "wall": p["time"]["median_s"] / a["time"]["median_s"],
                    "cpu": p["cpu_s"] / a["cpu_s"]}
    _plot(os.path.join(out_dir, "rnn_time.png"), payload)
    return {"speedup_vs_flax": speed}


def _plot(path: str, payload: dict) -> None:
    import matplotlib.pyplot as plt
    res = [r for r in payload["results"] if r.get("status") == "ok"]
    names = list(dict.fromkeys(r["impl"] for r in res))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for j, mode in enumerate(("fwd", "fwd_bwd")):
        ys = [(_get(res, n, mode) or {}).get("time", {}).get("median_s", 0) * 1e3 for n in names]
        ax.bar([i + (j - 0.5) * width for i in range(len(names))], ys, width,
               label=mode.replace("_", "+"))
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("ms (median wall time)")
    s = payload["shape"]
    ax.set_title(f"RNN layers, B={s['B']} L={s['L']} E={s['E']} H={s['H']}, float32")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    report.savefig(fig, path)


def _needed(payload: dict) -> list[str]:
    """What each target asks of our kernel in this run: the rate its product arithmetic
    would run at to meet the bound against flax's measured time, as a share of the
    measured float32 matrix-product rate and of the cores' FMA peak (gate arithmetic
    uncounted, so the true need is higher). Above 100% of the product rate a kernel would
    have to outrun the machine's own products; above 100% of the FMA peak no float32
    kernel can meet the target on this CPU in this run."""
    res, peak = payload["results"], payload["matmul_gflops"]["float32"]
    fma = payload["machine"].get("fma_peak_gflops")
    lines = []
    for name, (mode, bound) in TARGETS.items():
        ours, flax_row = _get(res, TARGET_ROWS[0], mode), _get(res, TARGET_ROWS[1], mode)
        if not (ours and flax_row and ours.get("gflops")):
            continue
        need_s = flax_row["time"]["median_s"] / bound
        gflops = ours["gflops"] * ours["time"]["median_s"] / need_s
        lines.append(f"- `{name}` >= {bound}: `{TARGET_ROWS[0]}` {mode.replace('_', '+')} in "
                     f"{need_s * 1e3:.{0 if need_s >= 0.01 else 2}f} ms, its products at "
                     f"{gflops:.1f} GFLOP/s, "
                     f"{100 * gflops / peak:.0f}% of the measured float32 product rate "
                     f"(now {100 * ours['gflops'] / peak:.0f}%)"
                     + (f" and {100 * gflops / fma:.0f}% of the cores' FMA peak "
                        f"(now {100 * ours['gflops'] / fma:.0f}%)." if fma else "."))
    return (["What meeting each target needs in this run:", "", *lines, ""]) if lines else []


def _markdown(payload: dict) -> str:
    res, s = payload["results"], payload["shape"]
    peak = payload["matmul_gflops"]["float32"]
    speed = payload["summary"]["speedup_vs_flax"]
    rows = []
    for r in res:
        t = r.get("time")
        sp = speed.get(r["impl"], {}).get(r["mode"])
        rows.append([
            f"`{r['impl']}`", r["mode"].replace("_", "+"),
            f"{report.fmt(t['median_s'], 'ms')} ({report.fmt(t['min_s'], 'ms')}–"
            f"{report.fmt(t['max_s'], 'ms')})" if t else r.get("status", "–"),
            report.fmt(r.get("cpu_s"), "ms"),
            f"{r['gflops']:.1f} ({100 * r['gflops'] / peak:.0f}%)" if r.get("gflops") else "–",
            f"{sp['wall']:.2f}x / {sp['cpu']:.2f}x vs `{sp['vs']}`" if sp else "–"])
    targets = [report.targets_md(payload["targets"]), "",
               f"Each is `{TARGET_ROWS[1]}`'s median wall time over `{TARGET_ROWS[0]}`'s.", "",
               *_needed(payload)] if payload.get("targets") else (
                   [report.QUICK_NO_TARGETS, ""] if payload.get("quick") else [])
    return "\n".join([
        report.header_md(payload["machine"], payload["matmul_gflops"]), "",
        f"Shape: B={s['B']}, L={s['L']}, E={s['E']}, H={s['H']}, float32, no padding. Wall times "
        "are medians (min–max) in ms; CPU is the process time of one call; speedup "
        "is the flax peer's time over ours in this run (wall / CPU).", "",
        report.table(["impl", "mode", "wall ms", "CPU ms", "GFLOP/s (% of matmul)", "speedup"],
                     rows), "", *targets, "Plot: `rnn_time.png`."])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impls", type=harness.names_from(IMPLS), default=None,
                   help=f"comma-separated subset of {list(IMPLS)}")
    p.add_argument("--quality", action="store_true",
                   help="instead: word-LM perplexity of the LSTM with each trick, same steps")
    p.add_argument("--steps", type=harness.positive_number(int), default=None, help="--quality: steps per run (default: the "
                   "experiment's, 20 with --quick)")


def check_args(args) -> None:
    """A flag of one mode given to the other would be ignored: refused before any work."""
    if args.quality and args.impls:
        raise ValueError("--impls picks the timing run's layers; --quality trains the LSTM's "
                         "tricks (drop --impls)")
    if not args.quality and args.steps:
        raise ValueError("--steps sets the --quality run; add --quality or drop --steps")


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --impls leaving out a layer it has
    rows of, or --quality's --steps fewer than its runs took (a bug hunt, session 102: both
    replaced the recorded reports; the recorded --quality run's own command gives --steps)."""
    rows = [r for r in held.get("results") or () if isinstance(r, dict)]
    if args.quality:
        from hpnlp.bench import rnn_quality
        steps = args.steps or rnn_quality.experiment_config("")[1].train.steps  # (not quick)
        ran = [r["steps"] for r in rows if isinstance(r.get("steps"), int)]
        return [f"--steps {steps}"] if ran and steps < max(ran) else []
    if args.impls and {r.get("impl") for r in rows} - {None, *args.impls}:
        return [f'--impls "{",".join(args.impls)}"']
    return []


def main(args) -> dict:
    if getattr(args, "quality", False):
        from hpnlp.bench import rnn_quality
        payload = rnn_quality.run(args.out, quick=args.quick, steps=args.steps)
        harness.exit_if_interrupted(payload["interrupted"], args.out)
        return payload
    return run(args.out, quick=args.quick, impls=getattr(args, "impls", None))
