"""`python -m hpnlp.bench train`: whole training steps, as users run them.

1. The causal LM at three widths: tokens/s and model FLOP utilization (MFU) against the
   matrix-product rate timed in alternation with the step (and, for reference, against
   the best-call ceiling measured at the start of the run).
2. The encoder classifier with every attention variant at L = 1K, 2K, 3K, 4K, reported
   as the Long Range Arena paper reports it: steps/s and peak memory relative to the
   vanilla (`dense`) Transformer at the same length, beside a bound row (`BOUND`) whose
   attention costs nothing.

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, app. B): 6·N for the
parameters N outside the embeddings plus 12·depth·L·width for attention (halved for a
causal LM). Steps run on synthetic token batches (no data loading in the timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import attention as attention_lib
from hpnlp import models
from hpnlp.bench import harness, report
from hpnlp.config import (AttentionConfig, Config, ModelConfig, TrainConfig, default_configdict,
                          from_configdict)
from hpnlp.train.state import init_state, make_optimizer, train_params
from hpnlp.train.step import make_train_step, step_compiler_options

# (name, width, depth, heads, mlp) at seq 256, batch 8: 2048 tokens a step. Batch 8 is
# chosen for this 2-core machine: at width 512 its step ran 104-118 model GFLOP/s against
# 101-105 at batch 16 (`measure` of both, alternating, in one process).
LM_SIZES = [("lm-256", 256, 4, 4, 1024), ("lm-512", 512, 4, 8, 2048), ("lm-768", 768, 4, 12, 3072)]
LM_BATCH = 8
# Encoder rows: at most this many seconds of steps, warm-up included; a step slower than
# this is timed by its first call after the compile (`harness.time_jax`). (20 s, without
# the warm-up, made the full run take 30-31 minutes.)
MAX_TIME_S = 12.0
PROBE_S = 0.3  # matrix-product rate probed for this long before and after each timing
# Ratios of two rows whose probed machine speeds differ by more than this are flagged.
DRIFT_FLAG = 1.2
# `--quick`: one variant of each family (the full run and the tests cover all of them).
QUICK_VARIANTS = ["dense", "chunked", "local", "bigbird", "lsh", "performer", "linear", "linformer"]
LM_SIZES_QUICK = [("lm-128", 128, 2, 4, 512), ("lm-256", 256, 2, 4, 1024), ("lm-512", 512, 2, 8, 2048)]
# Every encoder row (dense and the bound too) recomputes its layer norms' and gelu's
# outputs in the backward pass (`model.remat`): the memory every variant shares shrinks,
# and what is left of a row's memory is more nearly its attention's own.
ENCODER_REMAT = "elementwise"
# The bound row: the same encoder step with an attention that costs nothing (it returns
# the values). Everything else in the step is shared by every variant, so no variant's
# speed or memory relative to `dense` can beat this row's.
BOUND = "(values only)"


class _ValuesOnly(attention_lib.Attention):
    """out = v: no attention at all. Registered only while the bound row is measured."""

    def __call__(self, q, k, v, mask=None, *, causal: bool = False, deterministic: bool = True):
        return v


def _config(kind: str, width: int, depth: int, heads: int, mlp: int, L: int, vocab: int,
            attention: str, remat: str = "none") -> Config:
    cfg = from_configdict(default_configdict())
    return dataclasses.replace(
        cfg,
        model=ModelConfig(kind=kind, width=width, depth=depth, num_heads=heads, mlp_dim=mlp,
                          dropout=0.0, max_len=L, vocab_size=vocab, num_classes=10, remat=remat),
        attention=AttentionConfig(attention, harness.length_options(attention, L)),
        train=TrainConfig(steps=1000, warmup_steps=10, batch_size=1))


def _batch(kind: str, B: int, L: int, vocab: int):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab, (B, L)).astype(np.int32)
    seg = np.ones((B, L), np.int32)
    if kind == "lm":
        return {"inputs": toks, "targets": np.roll(toks, -1, 1), "segment_ids": seg,
                "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()}
    return {"inputs": toks, "segment_ids": seg, "label": rng.integers(0, 10, B).astype(np.int32),
            "weight": np.ones(B, np.float32)}


def _non_embedding_params(params) -> int:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return int(sum(np.prod(x.shape) for p, x in flat
                   if not any(getattr(k, "key", "") in ("embed", "pos_embedding") for k in p)))


def measure(spec: dict) -> dict:
    """One configuration: build, compile and time the jitted train step."""
    if spec.get("attention") == BOUND:
        with attention_lib.registered(BOUND, _ValuesOnly):
            return _measure(spec)
    return _measure(spec)


def _measure(spec: dict) -> dict:
    kind, L, B = spec["kind"], spec["L"], spec["B"]
    cfg = _config(kind, spec["width"], spec["depth"], spec["heads"], spec["mlp"], L,
                  spec["vocab"], spec["attention"], spec.get("remat", "none"))
    model = models.build(cfg, deterministic=False)
    batch = _batch(kind, B, L, spec["vocab"])
    tx = make_optimizer(cfg.train, params=jax.eval_shape(  # (weight decay's mask)
        lambda k: train_params(model, k, batch), jax.random.key(0)))
    # The initial state is compiled without XLA's backend optimizations: they took about
    # 4 of a worker's 9 s of start-up, for a function that runs once (its values differ
    # from an optimized init's in the last bits, which no timing depends on).
    init = jax.jit(lambda k: nn.unbox(init_state(model, tx, k, batch))).lower(jax.random.key(0))
    state = init.compile(compiler_options={"xla_backend_optimization_level": 0})(jax.random.key(0))
    step, options = make_train_step(model, tx, cfg.train), step_compiler_options()
    out = {**spec, "status": "ok"}
    if kind == "lm":
        # MFU is a ratio of two rates, so both are timed in the same rounds: the step and
        # the n x n matrix product alternate (`harness.time_interleaved`), and a machine
        # whose speed drifts over minutes slows both alike.
        compiled, compile_s = harness.compile_timed(step, state, batch, compiler_options=options)
        mm, mm_flops = harness.matmul_call(jnp.float32)
        timed = harness.time_interleaved(
            {"step": lambda: jax.block_until_ready(compiled(state, batch)), "matmul": mm},
            repeats=spec["repeats"], warmup=2, min_time_s=spec.get("min_time_s", 1.0))
        t = timed["step"][0]
        t.compile_s, t.memory = compile_s, harness.executable_memory(compiled)
        out["matmul_gflops_beside"] = mm_flops / timed["matmul"][0].median_s / 1e9
    else:
        # Each encoder configuration runs in its own process (for its peak RSS), so the
        # matrix-product rate is probed beside its timing instead: the report flags ratios
        # whose two rows ran at different machine speeds. (Timing the variants of one
        # length interleaved in one process is no cure: there the dense step at L=4096
        # ran 35 s a step against 20 s in a process of its own, as memory held by the
        # other executables slowed its 14 GB of per-step allocations.)
        rate = lambda: harness.matmul_rate(jnp.float32, n=spec.get("probe_n", 2048),  # noqa: E731
                                           min_time_s=PROBE_S, warmup=1)
        probe = [rate()]
        # Donation-free timing: the same state each call, so repeats do identical work.
        t = harness.time_jax(step, state, batch, repeats=spec["repeats"], warmup=1,
                             min_time_s=spec.get("min_time_s", 1.0), max_time_s=spec.get("max_time_s"),
                             compiler_options=options)
        probe.append(rate())
        out["probe_gflops"] = probe
    out["compiled_memory"], out["time"] = t.memory, t.as_dict()
    n = _non_embedding_params(state.params)
    attn = 12 * cfg.model.depth * L * cfg.model.width * (0.5 if kind == "lm" else 1.0)
    flops = (6 * n + attn) * B * L
    out.update(params_non_embedding=n, step_flops=flops, tokens_per_sec=B * L / t.median_s,
               steps_per_sec=1.0 / t.median_s, model_gflops=flops / t.median_s / 1e9,
               peak_rss_bytes=harness.peak_rss_bytes(),
               # on an accelerator, where attention's buffers live (a review, session 118,
               # as lra's in session 116: the ratio read the host's RSS there)
               peak_device_bytes=harness.peak_device_bytes())
    return out


def _one(spec: dict, isolate: bool) -> dict:
    if isolate:
        return {**spec, **harness.isolated("hpnlp.bench.train", spec, timeout_s=900)}
    try:
        res = measure(spec)
        res.pop("peak_rss_bytes", None)
        return res
    except Exception as e:
        return {**spec, "status": f"failed: {type(e).__name__}: {str(e)[:150]}"}


def run(out_dir: str, *, quick: bool, isolate: bool | None = None,
        variants: list[str] | None = None, lengths: list[int] | None = None) -> dict:
    isolate = (not quick) if isolate is None else isolate
    unknown = [v for v in variants or () if v not in attention_lib.names()]
    if unknown:  # before the LM rows: an unknown name would fail only in its own rows
        raise ValueError(f"unknown attention variant(s) {unknown}; choose from {attention_lib.names()}")
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    rates = harness.ceiling_rates(quick=quick)
    repeats, min_time_s = (3, 0.3) if quick else (5, 1.0)
    lm_specs = [dict(group="lm", kind="lm", name=n, width=w, depth=d, heads=h, mlp=f, L=256,
                     B=LM_BATCH, vocab=256, attention="dense", repeats=repeats,
                     min_time_s=min_time_s)
                for n, w, d, h, f in (LM_SIZES_QUICK if quick else LM_SIZES)]
    lengths = lengths or ([512] if quick else [1024, 2048, 3072, 4096])
    names = variants or (QUICK_VARIANTS if quick else attention_lib.names())
    names = ["dense"] + [n for n in names if n != "dense"] + [BOUND]  # LRA divides by dense
    enc_specs = []
    for L in lengths:
        for name in names:
            # LRA's encoder: width 256, 4 layers, 4 heads, MLP 1024 (their byte-level setup), B=4.
            enc_specs.append(dict(group="encoder", kind="classifier", name=name, width=128 if quick else 256,
                                  depth=2 if quick else 4, heads=4, mlp=512 if quick else 1024, L=L,
                                  B=2 if quick else 4, vocab=256, attention=name, remat=ENCODER_REMAT,
                                  probe_n=1024 if quick else 2048,
                                  repeats=min(repeats, 3), min_time_s=min_time_s,
                                  max_time_s=MAX_TIME_S))
    # a Ctrl-C or SIGTERM keeps the rows that ran (a bug hunt, session 95: none were written)
    results, interrupted = harness.run_rows(lm_specs + enc_specs, lambda s: _one(s, isolate),
                                            dict, desc="train bench")
    payload = {"benchmark": "train", "machine": info, "matmul_gflops": rates,
               "isolated": isolate, "interrupted": interrupted, "results": results}
    if variants and set(attention_lib.names()) - {"dense", *variants}:  # a part of the table,
        # not the README's (a bug hunt, session 103: `--variants dense` wrote it, marked full)
        payload["subset"] = {"variants": variants}
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    payload["summary"] = _summarize(payload)
    out_dir = harness.report_dir(out_dir, interrupted)
    _plot(payload, out_dir)
    report.write(out_dir, "train", payload, _markdown(payload))
    return payload


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def _probe(row: dict) -> float | None:
    """Mean matrix-product rate probed around a row's timing (None in older results)."""
    p = row.get("probe_gflops")
    return sum(p) / len(p) if p else None


def _drifted(x: dict) -> bool:
    m = x.get("machine_speed_ratio")
    return m is not None and max(m, 1 / m) > DRIFT_FLAG


def _summarize(payload: dict) -> dict:
    peak = payload["matmul_gflops"]["float32"]
    lm = {r["name"]: {"tokens_per_sec": r["tokens_per_sec"], "mfu": r["model_gflops"] / peak,
                      "mfu_interleaved": (r["model_gflops"] / r["matmul_gflops_beside"]
                                          if r.get("matmul_gflops_beside") else None)}
          for r in _ok(payload["results"]) if r["group"] == "lm"}
    rel = {}
    enc = [r for r in payload["results"] if r["group"] == "encoder"]
    compiled = lambda x: x["compiled_memory"].get("total_bytes")  # noqa: E731
    mem = lambda x: (x.get("peak_device_bytes") or x.get("peak_rss_bytes")  # noqa: E731
                     or compiled(x))
    for r in _ok(enc):
        base = next((b for b in _ok(enc) if b["name"] == "dense" and b["L"] == r["L"]), None)
        if base is None:
            continue
        rel.setdefault(r["name"], {})[r["L"]] = {
            "relative_speed": r["steps_per_sec"] / base["steps_per_sec"],
            "relative_memory": mem(r) / mem(base),
            "relative_compiled_memory": (compiled(r) / compiled(base)
                                         if compiled(r) and compiled(base) else None),
            "machine_speed_ratio": _probe(r) / _probe(base) if _probe(r) and _probe(base) else None}
    return {"lm": lm, "encoder_relative_to_dense": rel}


def _plot(payload: dict, out_dir: str) -> None:
    enc = [r for r in _ok(payload["results"]) if r["group"] == "encoder"]
    series = {}
    for name in sorted({r["name"] for r in enc}):
        pts = sorted((r["L"], r["steps_per_sec"]) for r in enc if r["name"] == name)
        series[name] = ([p[0] for p in pts], [p[1] for p in pts])
    report.scaling_plot(os.path.join(out_dir, "train_encoder_steps.png"), series,
                        xlabel="sequence length L", ylabel="training steps / s",
                        title="encoder training speed by attention variant")


def _markdown(payload: dict) -> str:
    res = payload["results"]
    parts = [report.header_md(payload["machine"], payload["matmul_gflops"]), "",
             f"### Causal LM training step (seq 256, batch {LM_BATCH}, float32, AdamW)", ""]
    mfu = payload["summary"]["lm"]
    rows = []
    for r in (x for x in res if x["group"] == "lm"):
        if r.get("status") != "ok":
            rows.append([r["name"], r["status"]] + ["–"] * 6)
            continue
        rows.append([r["name"], f"{r['params_non_embedding'] / 1e6:.2f}M",
                     f"{report.fmt(r['time']['median_s'], 'ms')} ({report.fmt(r['time']['min_s'], 'ms')}–"
                     f"{report.fmt(r['time']['max_s'], 'ms')})",
                     f"{r['tokens_per_sec']:,.0f}", f"{r['model_gflops']:.1f}",
                     (f"{r['matmul_gflops_beside']:.1f}" if r.get("matmul_gflops_beside") else "–"),
                     (f"**{100 * mfu[r['name']]['mfu_interleaved']:.0f}%**"
                      if mfu[r["name"]]["mfu_interleaved"] else "–"),
                     f"{100 * mfu[r['name']]['mfu']:.0f}%"])
    parts += [report.table(["model", "params (non-emb.)", "step ms", "tokens/s", "model GFLOP/s",
                            "matmul GFLOP/s in the same rounds", "MFU",
                            "MFU of the run's best-call ceiling"], rows), "",
              "MFU: model GFLOP/s over the 2048 x 2048 float32 matrix-product rate timed in "
              "alternation with the step in the same process (medians of both), so drift of "
              "this machine's speed slows both alike. The last column divides by the "
              "ceiling measured at the start of the run instead (the fastest product call).", ""]
    rel = payload["summary"]["encoder_relative_to_dense"]
    lengths = sorted({r["L"] for r in res if r["group"] == "encoder"})
    isolated = payload["isolated"]
    parts += ["### Encoder training, relative to the dense Transformer (as in LRA, Tay et al. 2021, table 3)",
              "", "Steps/s and peak memory divided by `dense` at the same length. Memory: "
              + ("the peak RSS of a fresh process (the Python and XLA runtime included), then the "
                 "compiled executable's (arguments, outputs, temporaries: the part LRA's device "
                 "memory measured)." if isolated else "the compiled executable's.")
              + " Every row recomputes its layer norms' and gelu's outputs in the backward pass "
              f"(`model.remat={ENCODER_REMAT!r}`).", ""]
    rows = []
    enc_names = sorted({r["name"] for r in res if r["group"] == "encoder"}, key=lambda n: (n == BOUND, n))
    for name in enc_names:
        cells = [f"bound: {name}" if name == BOUND else f"`{name}`"]
        for L in lengths:
            x = rel.get(name, {}).get(L)
            r = next((r for r in res if r["group"] == "encoder" and r["name"] == name and r["L"] == L), {})
            compiled = (f" / {x['relative_compiled_memory']:.3f}x"
                        if isolated and x and x.get("relative_compiled_memory") else "")
            if x:
                cells.append(f"{x['relative_speed']:.2f}x / {x['relative_memory']:.2f}x{compiled}"
                             f"{' †' if _drifted(x) else ''}")
            else:  # an ok row without a ratio: its `dense` row at this L failed (review r12:
                # the cell read `ok`, hiding that the denominator was missing)
                cells.append("no dense row" if r.get("status") == "ok"
                             else (r.get("status") or "–")[:60])
        rows.append(cells)
    peak = "device" if payload["machine"].get("backend", "cpu") != "cpu" else "RSS"
    what = f"speed / memory ({peak}) / memory (compiled)" if isolated else "speed / memory"
    parts += [report.table(["attention"] + [f"L={L} {what}" for L in lengths], rows), ""]
    if BOUND in enc_names:
        bound = rel.get(BOUND, {})
        beat = [f"`{n}` at {L}" for n in enc_names if n != BOUND for L in lengths
                if L in bound and L in rel.get(n, {})
                and (rel[n][L]["relative_speed"] > bound[L]["relative_speed"]
                     or rel[n][L]["relative_memory"] < bound[L]["relative_memory"])]
        parts += ["The bound row is the same step with attention replaced by its values (`out = v`, "
                  "nothing computed): the rest of the step is shared by every variant, so no variant's "
                  "ratio can truly beat this row's, in speed or in memory."
                  + (f" In this run {len(beat)} ratio(s) read past it ({', '.join(beat)}): rows timed "
                     "minutes apart on this drifting machine, which is the size of the noise in this "
                     "table." if beat else ""), ""]
    flagged = [x for v in rel.values() for x in v.values() if _drifted(x)]
    probes = [_probe(r) for r in _ok(res) if _probe(r)]
    if probes:
        where = "each in a process of its own" if payload["isolated"] else "one after the other"
        marks = (f"† marks the {len(flagged)} ratio(s) whose row and `dense` row ran at machine "
                 f"speeds more than {DRIFT_FLAG:.1f}x apart: read those as rough." if flagged else
                 f"No row ran at a machine speed more than {DRIFT_FLAG:.1f}x from `dense`'s.")
        parts += [f"Rows run {where}, and the machine's matrix-product rate, "
                  f"probed beside each row, ranged {min(probes):.0f}–{max(probes):.0f} GFLOP/s "
                  f"over this run. {marks}", ""]
    single = [r for r in _ok(res) if r.get("time", {}).get("first_call_only")]
    if single:
        parts += [f"{len(single)} row(s) with steps slower than {MAX_TIME_S:.0f} s were timed by "
                  "their first call after the compile: "
                  + ", ".join(f"`{r['name']}` at {r['L']}" for r in single) + ".", ""]
    parts += ["Plot: `train_encoder_steps.png`."]
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", type=harness.names_from(attention_lib.names), default=None,
                   help="comma-separated attention names (default: all)")
    harness.add_isolate_flag(p)


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --variants leaving out an encoder
    variant it has rows of (a bug hunt, session 103: `--variants dense` replaced the
    recorded report); --no-isolate where it was measured isolated (review r12: the table
    lost its RSS column under README prose citing RSS ratios). `dense` and the bound row
    run always."""
    rows = [r for r in held.get("results") or () if isinstance(r, dict)]
    held_names = {r.get("name") for r in rows if r.get("group") == "encoder"}
    flags = []
    if args.variants and held_names - {None, "dense", BOUND, *args.variants}:
        flags.append(f"--variants {','.join(args.variants)}")
    if args.no_isolate and held.get("isolated") is True:
        flags.append("--no-isolate")
    return flags


def main(args) -> dict:
    payload = run(args.out, quick=args.quick, isolate=False if args.no_isolate else None,
                  variants=args.variants)
    harness.exit_if_interrupted(payload["interrupted"], args.out)
    return payload


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
