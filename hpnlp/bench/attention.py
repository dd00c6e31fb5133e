"""`python -m hpnlp.bench attention`: every registered attention variant beside its peers.

Forward and forward+backward time (median, min, max) and memory (compiled executable and
peak RSS of a fresh process per configuration) at B=1, H=8, D=64 for L = 1K..16K (to 64K
for the variants whose memory is linear in L), beside `jax.nn.dot_product_attention`,
`flax.linen.dot_product_attention` (the core of `MultiHeadDotProductAttention`) and, when
installed, PyTorch's `scaled_dot_product_attention` on the same chip as JAX, all in one run.
Exact variants report achieved GFLOP/s and the fraction of this machine's measured matmul
rate.

On a GPU (`JAX_PLATFORMS=cuda`) the same command times everything there: PyTorch's SDPA runs
on CUDA too, a cuDNN row joins the peers ("jax.nn.dot_product_attention (cudnn, bfloat16)",
JAX's fused flash attention, which takes 16-bit inputs only), memory is the device's
(peak bytes in use of a fresh process per configuration, and PyTorch's
`max_memory_allocated`) instead of RSS, and float32 products run at full float32 precision
(`highest`, as PyTorch's default `allow_tf32=False` does) unless JAX_DEFAULT_MATMUL_PRECISION
says otherwise; the header records which. The recorded GPU runs (docs/benchmarks/
attention_h100*) used `--no-isolate`: XLA's GPU compile and autotuning make each row take
seconds there, and a fresh process per row adds a CUDA start-up to each (that isolated path
has not run on a GPU yet).
`chunked` runs its fused CPU kernel (`hpnlp.attention.flash_cpu`), on a GPU its Pallas
kernels (`hpnlp.attention.flash_gpu`; float32 only where its blocks were measured, so far
the H200 at head dims 33-64, else the XLA program); beside it, the row "chunked (xla)"
times the same algorithm as the XLA program it runs elsewhere, and
(bidirectional runs) the row "chunked products only" times that program's block matrix
products alone, without the softmax arithmetic: the floor of any XLA-built design here,
which the kernel gets under by keeping each tile in its core's cache. Beside `chunked`
also run "chunked (bfloat16)" (the registry's `chunked`, default options, on the same
q, k, v cast to bfloat16; its gradients are bfloat16) and PyTorch's SDPA on bfloat16
tensors, "torch.scaled_dot_product_attention (bfloat16)".

Targets (`targets` in results.json, a "### Targets" table in results.md; bidirectional
runs that include `chunked` and L=4096): `chunked` forward+backward time over PyTorch
SDPA's at L=4096, float32 (`chunked_vs_torch_f32`) and bfloat16 (`chunked_vs_torch_bf16`),
each <= 0.8.

Forward+backward is a train step's work (`_step`): the value of a scalar of the output and
the gradients of q, k, v and the variant's own parameters, under a random output cotangent;
PyTorch's rows do the same. Records before 2026-12-06 timed the gradients of sum(output)
alone, of q, k, v: XLA then dropped the forward's P V product of the rows whose output ends
in it (the reference, flax, dense, synthesizer, linformer, sinkhorn, clustered: 5 of a step's
6 products) and no row computed its own weight gradients; `chunked` and PyTorch did all 6
then too, so the targets read the same work.

FLOP convention: forward = 4·B·H·L²·D (QKᵀ and PV; halved when causal), backward = 2x
forward, so forward+backward = 3x forward. Approximations are reported by time only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from hpnlp import attention as attention_lib
from hpnlp.bench import harness, report

PEERS = ("jax.nn.dot_product_attention", "flax.linen.dot_product_attention",
         "torch.scaled_dot_product_attention")
# Not an attention: the bound for `chunked` (see `_products_only`); bidirectional only.
BOUND = "chunked products only"
XLA_TWIN = "chunked (xla)"  # `chunked` with impl='xla': its kernel's XLA twin
# bfloat16 q, k, v (and gradients): `chunked` and PyTorch's SDPA, beside their float32 rows.
BF16_CHUNKED = "chunked (bfloat16)"
BF16_TORCH = "torch.scaled_dot_product_attention (bfloat16)"
# JAX's cuDNN flash attention (GPU only; 16-bit inputs only).
CUDNN = "jax.nn.dot_product_attention (cudnn, bfloat16)"
BF16 = {BF16_CHUNKED, BF16_TORCH, CUDNN}
# O(L^2) memory (the estimate below skips what cannot fit). PyTorch's CPU SDPA is a flash
# kernel, O(L): it runs at 16K too.
QUADRATIC = {"dense", "xla", "synthesizer", *PEERS} - {"torch.scaled_dot_product_attention"}
# Never run past 16K: the quadratic ones, and the peers, XLA and bfloat16 rows beside them.
SHORT = QUADRATIC | set(PEERS) | {BOUND, XLA_TWIN} | BF16
SHORT_MAX_L = 16384
EXACT = {"dense", "xla", "chunked", "ring", XLA_TWIN, BOUND, *PEERS, *BF16}
REFERENCE = "jax.nn.dot_product_attention"
TARGET_L = 4096
# name -> (our row, PyTorch's row, bound on the fwd_bwd time ratio ours / PyTorch's).
TARGETS = {"chunked_vs_torch_f32": ("chunked", "torch.scaled_dot_product_attention", 0.8),
           "chunked_vs_torch_bf16": (BF16_CHUNKED, BF16_TORCH, 0.8)}


def _inputs(L: int, *, B: int, H: int, D: int, seed: int = 0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    # Unit-variance logits, like trained attention: q, k scaled by D^-1/4 each. Other
    # dtypes get the same values, rounded.
    return tuple((jax.random.normal(k, (B, L, H, D), jnp.float32) * (D ** -0.25)).astype(dtype)
                 for k in ks)


def _cotangent(L: int, *, B: int, H: int, D: int):
    """The output cotangent a forward+backward row is timed under: random, float32 [B, L, H, D]
    (a constant one, d sum(output), would let XLA simplify backward products)."""
    return jax.random.normal(jax.random.key(7), (B, L, H, D), jnp.float32)


def _dtype(impl: str):
    return jnp.bfloat16 if impl in BF16 else jnp.float32


def _products_only(L: int, *, B, H, D):
    """{mode: fn(q, k, v)}: the block products of `chunked` and nothing else. Forward
    S = Q K^T and S V; backward S^T = K Q^T, dP^T = V dO^T, dQ^T += K^T dP^T, dK += dP^T Q,
    dV += S^T dO; over the same blocks, layouts and loops (one head at a time), with each
    product's output standing in for P and dS: no max, exp, sums or masks. Its time is
    about the floor for `chunked`'s design built from XLA's products on this machine."""
    from hpnlp.attention import chunked as ch
    bq, bk = ch.auto_block(L, ch.DEFAULT_BLOCK_Q), ch.auto_block(L, ch.DEFAULT_BLOCK_K)
    nq, nk = L // bq, L // bk
    sl, put = ch._slice, jax.lax.dynamic_update_slice_in_dim

    def fwd_head(q_LD, k_LD, v_LD):
        def q_block(i, o_LD):
            q_QD = sl(q_LD, i * bq, bq)
            acc = jax.lax.fori_loop(0, nk, lambda j, a: a + (q_QD @ sl(k_LD, j * bk, bk).T)
                                    @ sl(v_LD, j * bk, bk), jnp.zeros((bq, D)))
            return put(o_LD, acc, i * bq, 0)
        return jax.lax.fori_loop(0, nq, q_block, jnp.zeros((L, D)))

    def bwd_head(q_LD, k_LD, v_LD, do_LD):
        kt_DL = k_LD.T

        def k_block(j, grads):
            dqt_DL, dk_LD, dv_LD = grads
            k_KD, v_KD, kt_DK = sl(k_LD, j * bk, bk), sl(v_LD, j * bk, bk), sl(kt_DL, j * bk, bk, 1)

            def q_block(i, c):
                dqt_DL, dk_KD, dv_KD = c
                q_QD, do_QD = sl(q_LD, i * bq, bq), sl(do_LD, i * bq, bq)
                st_KQ, dpt_KQ = k_KD @ q_QD.T, v_KD @ do_QD.T
                dqt_DQ = sl(dqt_DL, i * bq, bq, 1) + kt_DK @ dpt_KQ
                return put(dqt_DL, dqt_DQ, i * bq, 1), dk_KD + dpt_KQ @ q_QD, dv_KD + st_KQ @ do_QD

            dqt_DL, dk_KD, dv_KD = jax.lax.fori_loop(
                0, nq, q_block, (dqt_DL, jnp.zeros((bk, D)), jnp.zeros((bk, D))))
            return dqt_DL, put(dk_LD, dk_KD, j * bk, 0), put(dv_LD, dv_KD, j * bk, 0)

        return jax.lax.fori_loop(0, nk, k_block, (jnp.zeros((D, L)), jnp.zeros((L, D)),
                                                  jnp.zeros((L, D))))

    def heads(x):  # [B, L, H, D] -> [B*H, L, D], as chunked lays them out once
        return x.transpose(0, 2, 1, 3).reshape(B * H, L, D)

    def fwd(q, k, v):
        return jax.lax.map(lambda a: fwd_head(*a), (heads(q), heads(k), heads(v)))

    def fwd_bwd(q, k, v):  # v stands in for dO
        return fwd(q, k, v), jax.lax.map(lambda a: bwd_head(*a),
                                         (heads(q), heads(k), heads(v), heads(v)))

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def _jax_fn(impl: str, L: int, causal: bool, *, B, H, D):
    """(f(params, q, k, v) -> output, params) for a registry variant (its parameters: a
    variant's own, such as Linformer's projections or Synthesizer's logits, which a train
    step differentiates too) or a JAX/Flax peer (params {})."""
    if impl == "jax.nn.dot_product_attention":
        return lambda p, q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal), {}
    if impl == CUDNN:
        return lambda p, q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), {}
    if impl == "flax.linen.dot_product_attention":
        import flax.linen as nn
        if causal:
            mask = nn.make_causal_mask(jnp.ones((B, L)))
            return lambda p, q, k, v: nn.dot_product_attention(q, k, v, mask=mask), {}
        return lambda p, q, k, v: nn.dot_product_attention(q, k, v), {}
    if impl == XLA_TWIN:
        module = attention_lib.get("chunked")(impl="xla")
    elif impl == BF16_CHUNKED:
        module = attention_lib.get("chunked")()
    else:
        module = attention_lib.get(impl)(**harness.length_options(impl, L))
    key = jax.random.key(0)
    params = module.init({"params": key, "features": key},
                         *_inputs(L, B=B, H=H, D=D, dtype=_dtype(impl)), None,
                         causal=causal, deterministic=True)
    return (lambda p, q, k, v: module.apply(p, q, k, v, None, causal=causal, deterministic=True,
                                            rngs={"features": key}), params)


def _step(fwd):
    """A train step's work on attention `fwd(params, q, k, v)`: the value of a scalar of its
    output and the gradients of q, k, v and the variant's parameters, under a random output
    cotangent `r` [B, L, H, D]. The gradients alone of sum(output) (timed before 2026-12-06)
    let XLA drop the forward's last product where the output ends in one (P V: the
    reference, flax, dense, synthesizer, linformer, sinkhorn, clustered ran 5 of a step's 6
    products; the custom-gradient rows, `chunked` among them, and PyTorch ran all 6), and
    left out the variants' own weight gradients (Synthesizer's [H, F, L] logits product)."""
    def loss(p, q, k, v, r):
        return jnp.sum(fwd(p, q, k, v).astype(jnp.float32) * r)
    return jax.value_and_grad(loss, (0, 1, 2, 3))  # of (params, q, k, v, r), as a step's


def _flops(L: int, causal: bool, *, B, H, D) -> float:
    f = 4.0 * B * H * L * L * D
    return f / 2 if causal else f


def torch_value_and_grads(torch, sdpa, q, k, v, r, causal: bool):
    """PyTorch's forward+backward row: sum(sdpa(q, k, v) * r) and its gradients for q, k
    and v, returned fresh as `jax.value_and_grad` returns them. A review (session 107):
    `.backward()` added each call's gradients into the leaves' `.grad` (three more passes
    over [B, H, L, D] a call, an estimated ~1% of the peer's time at L = 4096), work a step
    that sets its gradients to None first does not do."""
    loss = (sdpa(q, k, v, is_causal=causal).float() * r).sum()
    return loss, torch.autograd.grad(loss, (q, k, v))


def measure(spec: dict) -> dict:
    """One (implementation, length, mode) configuration; runs in the calling process."""
    impl, L, mode, causal = spec["impl"], spec["L"], spec["mode"], spec["causal"]
    B, H, D, repeats = spec["B"], spec["H"], spec["D"], spec["repeats"]
    out = {"impl": impl, "L": L, "mode": mode, "causal": causal, "status": "ok"}
    if impl.startswith("torch."):
        torch = harness.torch_or_none()
        if torch is None:
            return {**out, "status": "skipped: torch not installed (pip install -e '.[bench]')"}
        device = harness.torch_device(torch)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=g) * D ** -0.25 for _ in range(3))
        dtype = torch.bfloat16 if impl == BF16_TORCH else torch.float32
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    sdpa(q, k, v, is_causal=causal)
        else:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            r = torch.randn(B, H, L, D, generator=g).to(device=device)  # as `_cotangent`

            def call():  # the value and its gradients, as `_step`
                return torch_value_and_grads(torch, sdpa, q, k, v, r, causal)
        t, peak = harness.time_torch(torch, device, call, repeats=repeats, warmup=1, min_time_s=0.3)
        out["time"], out["torch_device"] = t.as_dict(), device
        if peak is not None:
            out["peak_device_bytes"] = peak
    else:
        if impl == BOUND:
            fn = _products_only(L, B=B, H=H, D=D)[mode]
        else:
            f, params = _jax_fn(impl, L, causal, B=B, H=H, D=D)
            fn = (lambda q, k, v: f(params, q, k, v)) if mode == "fwd" else _step(f)
        args = _inputs(L, B=B, H=H, D=D, dtype=_dtype(impl))
        if mode != "fwd" and impl != BOUND:  # the parameters are arguments, as in a step
            args = (params, *args, _cotangent(L, B=B, H=H, D=D))
        t = harness.time_jax(fn, *args, repeats=repeats, warmup=1, min_time_s=0.3,
                             max_time_s=spec.get("max_time_s"))
        out["compiled_memory"], out["time"] = t.memory, t.as_dict()
    if impl in EXACT:
        flops = _flops(L, causal, B=B, H=H, D=D) * (1 if mode == "fwd" else 3)
        out["gflops"] = flops / out["time"]["median_s"] / 1e9
    out["peak_rss_bytes"] = harness.peak_rss_bytes()
    if harness.on_accelerator() and "peak_device_bytes" not in out:
        out["peak_device_bytes"] = harness.peak_device_bytes()  # this process's: isolate
    return out


def _estimated_bytes(impl: str, L: int, mode: str, *, B, H) -> float:
    """Rough peak for the O(L^2) ones (score matrices), to skip what cannot fit."""
    if impl not in QUADRATIC:
        return 0.0
    return B * H * L * L * 4.0 * (2 if mode == "fwd" else 5)


def _head(spec: dict) -> dict:
    return {k: spec[k] for k in ("impl", "L", "mode", "causal")}


def row_names(names: list[str], *, causal: bool, backend: str) -> list[str]:
    """The rows a run times, in order: the peers, the registry's variants (`xla` is the
    jax peer), and beside `chunked` its XLA twin (where `chunked` runs a kernel: on a CPU
    or a GPU; elsewhere `chunked` is that program), its products-only bound (bidirectional)
    and the bfloat16 rows, with cuDNN's flash attention on a GPU."""
    impls = list(PEERS) + [n for n in names if n not in ("xla",)]
    if causal:
        impls = [i for i in impls if i in PEERS or attention_lib.get(i).supports_causal]
    if "chunked" in impls:
        impls += [XLA_TWIN] if backend in ("cpu", "gpu") else []
        impls += [] if causal else [BOUND]
        impls += [BF16_CHUNKED, BF16_TORCH] + ([CUDNN] if backend == "gpu" else [])
    return impls


def run(out_dir: str, *, quick: bool, causal: bool, isolate: bool | None = None,
        variants: list[str] | None = None, lengths: list[int] | None = None) -> dict:
    B, H, D = (1, 4, 32) if quick else (1, 8, 64)
    lengths = lengths or ([256, 1024] if quick else
                          [1024, 2048, 4096, 8192, 16384, 32768, 65536])
    repeats = 3 if quick else 5
    isolate = (not quick) if isolate is None else isolate
    names = variants or attention_lib.names()
    unknown = [v for v in names if v not in attention_lib.names()]
    if unknown:
        raise harness.BenchInputError(
            f"unknown attention variant(s) {unknown}; choose from {attention_lib.names()}")
    harness.full_float32_on_gpu()
    impls = row_names(names, causal=causal, backend=jax.default_backend())
    if all(i in SHORT and L > SHORT_MAX_L for i in impls for L in lengths):
        # a bug hunt (session 95): a traceback from the empty plot, after the ceiling's minute
        raise harness.BenchInputError(
            f"--lengths {','.join(map(str, lengths))}: {', '.join(names)} and the "
            f"peers run only up to L={SHORT_MAX_L} (O(L^2) memory); add a length "
            f"<= {SHORT_MAX_L}, or a variant of O(L) memory (e.g. chunked, local)")
    os.makedirs(out_dir, exist_ok=True)
    info = {**harness.machine_info(), "kernels": harness.kernel_info()}
    rates = harness.ceiling_rates((jnp.float32, jnp.bfloat16), quick=quick)
    configs = []
    for L in lengths:
        for impl in impls:
            if impl in SHORT and L > SHORT_MAX_L and impl not in (variants or ()):
                continue  # the peers and the twins beside chunked: the note under the tables
            for mode in ("fwd", "fwd_bwd"):
                # A call of minutes (chunked at 64K) is timed fewer times: 30 s of repeats.
                configs.append(dict(impl=impl, L=L, mode=mode, causal=causal, B=B, H=H, D=D,
                                    repeats=repeats, max_time_s=None if quick else 30.0))
    def row(spec):
        if spec["impl"] in SHORT and spec["L"] > SHORT_MAX_L:  # named in --variants: said
            return {**_head(spec), "status": f"skipped: O(L^2) memory, run up to L={SHORT_MAX_L}"}
        skip = harness.too_big(_estimated_bytes(spec["impl"], spec["L"], spec["mode"], B=B, H=H), 0.5)
        if skip:
            return {**_head(spec), "status": skip}
        return harness.measure_row("hpnlp.bench.attention", measure, spec, _head(spec),
                                   isolate=isolate, own_peak=spec["impl"].startswith("torch."))

    results, interrupted = harness.run_rows(configs, row, _head, desc="attention bench")
    payload = {"benchmark": "attention", "machine": info, "matmul_gflops": rates,
               "shape": {"B": B, "H": H, "D": D, "causal": causal}, "isolated": isolate,
               "interrupted": interrupted, "results": results}
    payload["quick"] = bool(quick)  # said in its report whatever it ran (a bug hunt, session 98)
    if "chunked" in impls and TARGET_L in lengths and not causal:
        report.targets_unless_quick(payload, quick, lambda: _targets(results))
    out_dir = harness.report_dir(out_dir, interrupted)
    payload["summary"] = _summarize(payload, out_dir)
    report.write(out_dir, "attention", payload, _markdown(payload))
    return payload


def _get(results, impl, L, mode):
    for r in results:
        if r["impl"] == impl and r["L"] == L and r["mode"] == mode and r.get("status") == "ok":
            return r
    return None


def _targets(results: list[dict]) -> dict:
    """The issue's targets, from this run's rows at `TARGET_L`: a row that did not run
    (torch missing, a failure) leaves its target not measured (value None, not met)."""
    def median(impl):
        return ((_get(results, impl, TARGET_L, "fwd_bwd") or {}).get("time") or {}).get("median_s")
    return {name: report.target(report.ratio(median(ours), median(peer)), bound, "<=")
            for name, (ours, peer, bound) in TARGETS.items()}


def _summarize(payload: dict, out_dir: str) -> dict:
    res = payload["results"]
    impls = sorted({r["impl"] for r in res})
    lengths = sorted({r["L"] for r in res})
    summary = {"exponents": {}, "crossover_L": {}, "speedup_vs_reference": {}}
    for mode in ("fwd", "fwd_bwd"):
        series = {}
        for impl in impls:
            pts = [(L, (_get(res, impl, L, mode) or {}).get("time", {}).get("median_s")) for L in lengths]
            series[impl] = ([p[0] for p in pts], [p[1] for p in pts])
        shape = payload["shape"]
        peak = payload["matmul_gflops"]["float32"] * 1e9
        ceil_x = lengths
        ceil_y = [_flops(L, shape["causal"], B=shape["B"], H=shape["H"], D=shape["D"]) *
                  (1 if mode == "fwd" else 3) / peak for L in lengths]
        exps = report.scaling_plot(
            os.path.join(out_dir, f"attention_time_{mode}.png"), series, xlabel="sequence length L",
            ylabel="seconds (median)", title=f"attention {mode.replace('_', '+')} time, B={shape['B']} "
            f"H={shape['H']} D={shape['D']}", ceiling=(ceil_x, ceil_y),
            ceiling_label="exact attention FLOPs at this machine's matmul rate")
        summary["exponents"][mode] = exps
        for impl in impls:
            cross, speed = None, {}
            for L in lengths:
                a, r = _get(res, impl, L, mode), _get(res, REFERENCE, L, mode)
                if a and r:
                    s = r["time"]["median_s"] / a["time"]["median_s"]
                    speed[L] = s
                    if cross is None and s > 1.0 and impl != REFERENCE:
                        cross = L
            summary["crossover_L"].setdefault(mode, {})[impl] = cross
            summary["speedup_vs_reference"].setdefault(mode, {})[impl] = speed
    mem_series = {}
    for impl in impls:
        pts = [(L, (_get(res, impl, L, "fwd_bwd") or {}).get("compiled_memory", {}).get("total_bytes"))
               for L in lengths]
        mem_series[impl] = ([p[0] for p in pts], [p[1] / 2**20 if p[1] else None for p in pts])
    report.scaling_plot(os.path.join(out_dir, "attention_memory.png"), mem_series,
                        xlabel="sequence length L", ylabel="MiB (compiled, fwd+bwd)",
                        title="attention forward+backward memory")
    return summary


def _markdown(payload: dict) -> str:
    res, shape = payload["results"], payload["shape"]
    rates = payload["matmul_gflops"]
    peak_key, peak_col, peak_what = report.peak_memory(payload["machine"], payload["isolated"])
    bf16_rows = sorted({r["impl"] for r in res} & BF16)
    dtypes = "float32" + (f" (bfloat16 q, k, v and gradients: {', '.join(f'`{i}`' for i in bf16_rows)};"
                          " their % of matmul is of the bfloat16 rate)" if bf16_rows else "")
    parts = [report.header_md(payload["machine"], rates), "",
             f"Shape: B={shape['B']}, H={shape['H']}, D={shape['D']}, causal={shape['causal']}, "
             f"{dtypes}. Times are medians (min–max) in ms; speedup is against `{REFERENCE}` "
             f"at the same L in this run; memory is the compiled executable's (arguments + "
             f"outputs + temporaries) and {peak_what}.", ""]
    sp = payload["summary"]["speedup_vs_reference"]
    for L in sorted({r["L"] for r in res}):
        rows = []
        for r in sorted((r for r in res if r["L"] == L and r["mode"] == "fwd"), key=lambda r: r["impl"]):
            b = _get(res, r["impl"], L, "fwd_bwd") or next(
                (x for x in res if x["impl"] == r["impl"] and x["L"] == L and x["mode"] == "fwd_bwd"), {})
            cells = [f"`{r['impl']}`"]
            for x in (r, b):
                t = x.get("time")
                cells.append(f"{report.fmt(t['median_s'], 'ms')} ({report.fmt(t['min_s'], 'ms')}–"
                             f"{report.fmt(t['max_s'], 'ms')})" if t else x.get("status", "–"))
            cells.append(report.fmt(sp["fwd_bwd"].get(r["impl"], {}).get(L), "x"))
            cells.append(report.fmt(b.get("compiled_memory", {}).get("total_bytes"), "MiB"))
            cells.append(report.fmt(b.get(peak_key), "MiB"))
            g = b.get("gflops")
            peak = rates.get(jnp.dtype(_dtype(r["impl"])).name, rates["float32"])
            cells.append(f"{g:.1f} ({100 * g / peak:.0f}%)" if g else "–")
            rows.append(cells)
        parts += [f"### L = {L}", "", report.table(
            ["impl", "fwd ms", "fwd+bwd ms", "fwd+bwd speedup", "compiled MiB", peak_col,
             "fwd+bwd GFLOP/s (% of matmul)"], rows), ""]
    if payload.get("quick"):
        parts += [report.QUICK_NO_TARGETS, ""]
    elif payload.get("targets"):
        parts += [report.targets_md(payload["targets"]), "",
                  f"Each ratio is our forward+backward median over PyTorch's at L = {TARGET_L}.", ""]
    exps = payload["summary"]["exponents"].get("fwd_bwd", {})
    cross = payload["summary"]["crossover_L"].get("fwd_bwd", {})
    parts += ["### Scaling (forward+backward)", "", report.table(
        ["impl", "time ~ L^k", f"first L faster than `{REFERENCE}`"],
        [[f"`{i}`", f"{e:.2f}" if e is not None else "–", str(cross.get(i) or "–")]
         for i, e in sorted(exps.items())]), "",
        "Plots: `attention_time_fwd.png`, `attention_time_fwd_bwd.png`, `attention_memory.png`."]
    if any(r["L"] > SHORT_MAX_L for r in res):
        parts += ["", f"Past L = {SHORT_MAX_L} only the variants of O(L) memory run: the "
                  "quadratic ones, the peers and the rows beside `chunked` (its XLA twin, bound "
                  "and bfloat16 rows) stop there."]
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--causal", action="store_true", help="causal attention (default: bidirectional)")
    p.add_argument("--variants", type=harness.names_from(attention_lib.names), default=None,
                   help="comma-separated registry names (default: all)")
    harness.add_isolate_flag(p)
    p.add_argument("--lengths", type=harness.positive_ints("1024,4096"), default=[], help="comma-separated sequence "
                   "lengths (default: 1K..64K, or 256 and 1K with --quick)")


def check_args(args) -> None:
    """Variants named with --causal that cannot run causal (a bug hunt: they were dropped
    from the report without a word); the default, every variant, drops them quietly."""
    if args.causal and args.variants:
        bidirectional = [n for n in args.variants if not attention_lib.get(n).supports_causal]
        if bidirectional:
            raise ValueError(f"--variants {', '.join(bidirectional)}: bidirectional only, so "
                             "--causal cannot time them; drop them, or --causal")


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --variants or --lengths leaving out a
    variant or a length it has rows of (a bug hunt, session 103: `--variants chunked` replaced
    the recorded L = 4096 report of eight variants). The records are made with these flags
    (docs/benchmarks.md), so what counts is the rows held, not the flags given; and
    --no-isolate where the report was measured isolated (its memory column is each row's
    fresh process's: a review, r12, found train's and softmax's taken so)."""
    rows = [r for r in held.get("results") or () if isinstance(r, dict)]
    flags = []
    variants = {r.get("impl") for r in rows} & set(attention_lib.names())  # (not the peers)
    if args.variants and variants - set(args.variants):
        flags.append(f"--variants {','.join(args.variants)}")
    if args.lengths and {r.get("L") for r in rows} - {None, *args.lengths}:
        flags.append(f"--lengths {','.join(map(str, args.lengths))}")
    shape = held.get("shape") if isinstance(held.get("shape"), dict) else {}
    if bool(args.causal) != bool(shape.get("causal", False)):  # (review: a causal run drops
        # the bidirectional-only rows, the bound row and the targets of a bidirectional one)
        flags.append("--causal" if args.causal else "no --causal")
    if args.no_isolate and held.get("isolated") is True:
        flags.append("--no-isolate")
    return flags


def main(args) -> dict:
    payload = run(args.out, quick=args.quick, causal=args.causal,
                  isolate=False if args.no_isolate else None,
                  variants=args.variants,
                  lengths=args.lengths or None)
    harness.exit_if_interrupted(payload["interrupted"], args.out)
    return payload


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
