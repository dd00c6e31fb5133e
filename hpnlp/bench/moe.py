"""`python -m hpnlp.bench moe`: mixture of experts against the dense model of the same
active compute, in one run on this CPU.

1. LMs (`lm`): the default byte LM (experiments/lm.py, two blocks, MLP width 512) dense,
   and with both blocks' MLPs made MoE at the same compute per token: E = 4, 8, 16 experts,
   top-1 (Switch router, experts of width 512) and top-2 (top_k router, experts of width
   256), capacity factor 1.25, balance loss 0.01, z-loss 0.001; each trained 3500 steps
   (the default run's schedule stretched: warmup 100, cosine to 0). Reported: eval loss at equal steps and at equal wall-clock (each MoE run's
   last evaluation within the dense run's training time), tokens/s, parameters, and the
   per-expert load over training (`moe_load` of each log window).
2. The layer alone (`layer`): forward + backward of the MoE layer (E = 8, top-1, width 256
   -> 1024) by capacity dispatch (factor 1.0 and 1.25) and dropless dispatch, against the
   dense MLP of the same active size, at 2K-32K tokens. The time splits into routing,
   dispatch, expert products and combine by timing each prefix of the layer (routing;
   + dispatch; + experts; the whole layer), forward + backward of a scalar of its outputs,
   and taking differences. Each time is a train step's work: the scalar's value and its
   gradients (`jax.value_and_grad`). The gradients alone would let XLA drop the dense MLP's
   second forward product, whose output feeds only the (linear) scalar, a product no train
   step skips (the output feeds the next layer); the MoE layer cannot drop its own (the
   gates' gradients read the expert outputs). Timed by `jax.grad`, the dense MLP ran 5 of
   its 6 products (recorded before 2026-12-06: 96 ms at 8K tokens, against 114 by
   `value_and_grad` on the same Xeon).
3. Expert parallelism (`parallel`): the train step of an MoE LM compiled on 8 simulated
   devices (mesh.expert = 8, and data 2 x expert 4): the all-to-all buffers in its HLO
   against the formula (2 all-to-alls per MoE layer forward, 2 backward, each of the
   device's [groups, experts, capacity, width] slot buffer).

Targets (issue 22; `targets` in results.json): the MoE layer (capacity factor 1.0) at 8K
tokens at most 1.3x the dense MLP's forward + backward time (`moe_layer_overhead_vs_dense_8k`);
the E = 8 top-1 LM's eval loss minus the dense LM's at equal steps below 0
(`moe_e8_top1_eval_loss_vs_dense`); no expert above 2x the mean load in any log window after
warmup in any MoE LM (`max_expert_load_vs_mean` <= 2). `--quick` shrinks every part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import harness, report

SIZES = {
    # 3500 steps: at the default run's 800 every top-1 MoE is still behind the dense LM
    # (routed experts start slower: scaling the Switch gate up to undo its 1/E start made
    # it worse in a GPU sweep); the E = 8 top-1 LM passes the dense one near step 1250
    # (near 3000 before its experts started at the dense MLP's fan-in), E = 16 near 2000.
    "full": dict(lm_steps=3500, lm_quick=False, experts=(4, 8, 16), top_ks=(1, 2),
                 eval_every=250, tokens=(2048, 4096, 8192, 16384, 32768), repeats=5),
    "quick": dict(lm_steps=60, lm_quick=True, experts=(8,), top_ks=(1, 2), eval_every=30,
                  tokens=(2048, 8192), repeats=3),
}
LAYER = dict(width=256, expert_dim=1024, experts=8)  # the layer part's shapes


# ------------------------------------------------------------------------- the layer alone

def _layer_params(key, M: int, F: int, X: int):
    ks = jax.random.split(key, 3)
    return {"router": jax.random.normal(ks[0], (M, X)) * 0.02,
            "wi": jax.random.normal(ks[1], (X, M, F)) * M ** -0.5, "bi": jnp.zeros((X, F)),
            "wo": jax.random.normal(ks[2], (X, F, M)) * F ** -0.5, "bo": jnp.zeros((X, M))}


def moe_prefix(stage: int, *, dispatch_kind: str, factor: float):
    """f(params, x [T, M], r [T, M]) -> scalar through the first `stage` stages of a Switch
    layer (1 routing, 2 + dispatch, 3 + expert products, 4 + combine): the same code the
    model's MoE layer runs (hpnlp.moe), one routing group."""
    from hpnlp.moe import dispatch, routing

    def f(p, x_TM, r_TM):
        T, M = x_TM.shape
        X = p["router"].shape[1]
        x_GSM, valid_GS = x_TM[None], jnp.ones((1, T), bool)
        logits = jnp.einsum("gsm,mx->gsx", x_GSM, p["router"],
                            precision=jax.lax.Precision.HIGHEST)  # as the layer's router
        probs = jax.nn.softmax(logits, -1)
        choices = routing.switch(probs, top_k=1)
        aux = routing.balance_loss(probs, choices.expert_GSK, valid_GS) + routing.z_loss(logits, valid_GS)
        experts = (p["wi"], p["bi"], p["wo"], p["bo"])
        if dispatch_kind == "dropless":
            rows = dispatch.sort_rows(jax.tree.map(lambda a: a[0], choices), valid_GS[0], experts=X)
            if stage == 1:
                return aux + jnp.sum(rows.gate_R)
            x_pad = jnp.concatenate([x_TM, jnp.zeros_like(x_TM[:1])])
            x_R = x_pad[rows.token_R]
            if stage == 2:
                return aux + jnp.sum(x_R)
            return aux + jnp.sum(dispatch.dropless(x_TM, rows, *experts) * r_TM)  # stages 3-4 fused
        C = routing.capacity(T, experts=X, top_k=1, factor=factor)
        slots, _ = routing.slots_from_choices(choices, valid_GS, experts=X, slots=C)
        if stage == 1:
            return aux + jnp.sum(slots.gate_GSJ)
        buf = dispatch.gather(x_GSM, slots.token_GXC)
        if stage == 2:
            return aux + jnp.sum(buf)
        out = dispatch.expert_mlp(buf, *experts)
        if stage == 3:
            return aux + jnp.sum(out)
        return aux + jnp.sum(dispatch.combine(out, slots.slot_GSJ, slots.gate_GSJ)[0] * r_TM)
    return f


def dense_mlp(p, x_TM, r_TM):
    h = jax.nn.gelu(x_TM @ p["wi"] + p["bi"])
    return jnp.sum((h @ p["wo"] + p["bo"]) * r_TM)


def step(fn):
    """A train step's work on `fn(params, x, r) -> scalar`, jitted: its value and the
    gradients of params and x (module doc: the gradients alone let XLA drop a product)."""
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))


def layer_rows(s: dict) -> list[dict]:
    """Forward + backward times of the layer, per dispatch and token count, split by stage."""
    M, F, X = LAYER["width"], LAYER["expert_dim"], LAYER["experts"]
    p_moe = _layer_params(jax.random.key(0), M, F, X)
    p_dense = {"wi": p_moe["wi"][0], "bi": p_moe["bi"][0], "wo": p_moe["wo"][0], "bo": p_moe["bo"][0]}
    variants = {"capacity 1.0": ("capacity", 1.0), "capacity 1.25": ("capacity", 1.25),
                "dropless": ("dropless", 1.0)}
    rows = []
    for T in tqdm(s["tokens"], desc="MoE layer", leave=False):
        x = jax.random.normal(jax.random.key(1), (T, M))
        r = jax.random.normal(jax.random.key(2), (T, M))
        calls = {}

        def add(key, fn, p):
            g = step(fn)
            calls[key] = lambda g=g, p=p: jax.block_until_ready(g(p, x, r))
        add(("dense", 4), dense_mlp, p_dense)
        for name, (kind, factor) in variants.items():
            stages = (1, 2, 4) if kind == "dropless" else (1, 2, 3, 4)
            for stage in stages:
                add((name, stage), moe_prefix(stage, dispatch_kind=kind, factor=factor), p_moe)
        timed = harness.time_interleaved(calls, repeats=s["repeats"])
        t = {k: v[0].median_s for k, v in timed.items()}
        dense = t[("dense", 4)]
        rows.append({"tokens": T, "dispatch": "dense MLP", "total_s": dense, "vs_dense": 1.0})
        for name, (kind, _) in variants.items():
            total = t[(name, 4)]
            split = {"routing": t[(name, 1)], "dispatch": t[(name, 2)] - t[(name, 1)]}
            if kind == "dropless":  # products and combine are one fused step
                split["experts + combine"] = total - t[(name, 2)]
            else:
                split["experts"] = t[(name, 3)] - t[(name, 2)]
                split["combine"] = total - t[(name, 3)]
            rows.append({"tokens": T, "dispatch": name, "total_s": total, "vs_dense": total / dense,
                         "split_s": split})
    return rows


# ------------------------------------------------------------------------- the LMs

def lm_config(s: dict, experts: int = 0, top_k: int = 1):
    """The default byte LM, dense (experts = 0) or MoE in both blocks at its active size."""
    cd = harness.experiment_module("lm.py").get_config("bytes")
    cd.train.steps = s["lm_steps"]
    if s["lm_quick"]:
        cd.train.warmup_steps = 10
        cd.train.eval_batches = 4
        cd.train.log_every = 10
    cd.train.eval_every = s["eval_every"]
    cd.train.checkpoint_every = 0
    cd.train.progress = False
    if experts:
        cd.name = f"lm_moe_e{experts}_top{top_k}"
        cd.model.moe.update(num_experts=experts, every=1, top_k=top_k,
                            router="switch" if top_k == 1 else "top_k",
                            mlp_dim=cd.model.mlp_dim // top_k, capacity_factor=1.25)
    return cd


def _read_run(workdir: str) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    return [l for l in lines if not l.get("eval")], [l for l in lines if l.get("eval")]


def lm_rows(s: dict, workdir: str) -> list[dict]:
    from hpnlp.bench.compress import _train
    runs = [(0, 1)] + [(e, k) for e in s["experts"] for k in s["top_ks"]]
    rows = []
    for experts, k in tqdm(runs, desc="LMs", leave=False):
        cd = lm_config(s, experts, k)
        out = os.path.join(workdir, cd.name)
        summary = _train(cd, out)
        train, evals = _read_run(out)
        # Training time at each log step: the windows' durations (the loop keeps evaluation,
        # checkpoints and compiles out of them; a window of a compiling step alone has none).
        clock, prev, elapsed = {}, 0, 0.0
        for l in train:
            elapsed += (l["step"] - prev) / l["steps_per_sec"] if "steps_per_sec" in l else 0.0
            clock[l["step"]], prev = elapsed, l["step"]
        rows.append({"name": "dense" if not experts else f"E={experts} top-{k}",
                     "experts": experts, "top_k": k, "params": summary["param_count"],
                     "eval_loss": summary["eval"]["loss"],
                     "tokens_per_sec": summary["throughput"]["tokens_per_sec"],
                     "evals": [{"step": e["step"], "loss": e["loss"], "train_s": clock.get(e["step"])}
                               for e in evals],
                     "load": [{"step": l["step"], "load": l["moe_load"],
                               "max_vs_mean": l["moe_load_max_vs_mean"],
                               "dropped": l["moe_dropped_frac"]} for l in train if "moe_load" in l],
                     "warmup_steps": cd.train.warmup_steps, "workdir": out})
    dense_s = rows[0]["evals"][-1]["train_s"]
    for r in rows:  # equal wall-clock: the last evaluation within the dense run's training time
        within = [e for e in r["evals"] if e["train_s"] is not None and e["train_s"] <= dense_s * 1.001]
        r["eval_loss_equal_time"] = within[-1]["loss"] if within else None
        r["step_equal_time"] = within[-1]["step"] if within else None
    return rows


# ------------------------------------------------------------------------- expert parallel

EP_CODE = r"""
import json, sys
from hpnlp.bench.moe import ep_measure
print(json.dumps(ep_measure(json.loads(sys.argv[1]))))
"""


def ep_measure(mesh: dict) -> dict:
    """(In a process with 8 devices) the compiled train step's all-to-all buffers."""
    from hpnlp.config import from_configdict
    from hpnlp.train import Trainer
    from hpnlp.train.loop import _global
    cd = lm_config(SIZES["quick"], experts=8, top_k=1)
    cd.train.batch_size = 16
    cd.model.moe.groups = 0  # one routing group per device
    cd.mesh.update(**mesh)
    with tempfile.TemporaryDirectory() as workdir:  # (a review, session 116: one left a call)
        tr = Trainer(from_configdict(cd), workdir)
        state, _ = tr.initial_state()
        tr.checkpointer.close()
        with tr._context():
            batch = _global(next(tr.train_iter), tr.batch_sharding)
            hlo = tr.train_step.lower(state, batch).compile().as_text()
    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
    ops = []
    for line in hlo.splitlines():
        if " all-to-all(" not in line:
            continue
        # The result: one array, or a tuple of one piece per peer device.
        result = line.split(" = ", 1)[1].split(" all-to-all(", 1)[0]
        ops.append(sum(int(np.prod([int(d) for d in dims.split(",") if d])) * sizes.get(dt, 4)
                       for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)))
    m, c = tr.cfg.model, tr.cfg.model.moe
    shards = np.prod([v for a, v in tr.cfg.mesh.axis_sizes(jax.device_count()).items()
                      if a in tr.cfg.mesh.mesh_axes_of("batch")])
    from hpnlp.moe import routing
    S = cd.train.batch_size // shards * cd.data.seq_len
    C = routing.capacity(S, experts=c.num_experts, top_k=c.top_k, factor=c.capacity_factor)
    layers = sum(c.applies(i) for i in range(m.depth))
    buffer = c.num_experts * C * m.width * 4  # one device's [1 group, X, C, M] float32 slots
    ep = tr.cfg.mesh.axis_sizes(jax.device_count())["expert"]
    return {"mesh": mesh, "all_to_all_ops": len(ops), "hlo_bytes_per_device": int(sum(ops)),
            "formula_bytes_per_device": int(4 * layers * buffer), "moe_layers": int(layers),
            "tokens_per_device": int(S), "capacity": int(C),
            "sent_off_device_bytes": int(4 * layers * buffer * (ep - 1) / ep)}


def parallel_rows() -> list[dict]:
    from hpnlp.compile_flags import with_flags  # (where XLA reads it: before a bare token)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_flags(
        os.environ.get("XLA_FLAGS", ""), ["--xla_force_host_platform_device_count=8"]))
    rows = []
    for mesh in ({"data": 1, "expert": 8}, {"data": 2, "expert": 4}):
        proc = subprocess.run([sys.executable, "-c", EP_CODE, json.dumps(mesh)], env=env,
                              capture_output=True, text=True, timeout=900)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        rows.append(json.loads(lines[-1]) if proc.returncode == 0 and lines else
                    {"mesh": mesh, "status": f"failed: {proc.stderr.strip().splitlines()[-1:]}"})
    return rows


# ------------------------------------------------------------------------- report

PARTS = ("lm", "layer", "parallel")
WORKDIR_PARTS = ("lm",)  # the parts that keep runs in --workdir


def _targets(p: dict) -> dict:
    layer = {(r["tokens"], r["dispatch"]): r for r in p.get("layer") or []}
    at8k = layer.get((8192, "capacity 1.0"))
    lms = {r["name"]: r for r in p.get("lm") or []}
    diff = None
    if "dense" in lms and "E=8 top-1" in lms:
        diff = lms["E=8 top-1"]["eval_loss"] - lms["dense"]["eval_loss"]
    loads = [w["max_vs_mean"] for r in lms.values() for w in r["load"] if w["step"] > r["warmup_steps"]]
    return report.targets_of_parts(p.get("seconds"), {
        "layer": {"moe_layer_overhead_vs_dense_8k": report.target(at8k and at8k["vs_dense"],
                                                                  1.3, "<=")},
        "lm": {"moe_e8_top1_eval_loss_vs_dense": report.target(diff, 0.0, "<="),
               "max_expert_load_vs_mean": report.target(max(loads) if loads else None, 2.0,
                                                        "<=")}})


def _split_cells(split: dict | None) -> list[str]:
    """routing, dispatch, experts, combine (ms) of a layer row; dropless fuses the last two."""
    if not split:
        return ["–"] * 4
    if "experts + combine" in split:
        return [report.fmt(split["routing"], "ms"), report.fmt(split["dispatch"], "ms"),
                report.fmt(split["experts + combine"], "ms"), "(in experts)"]
    return [report.fmt(split[k], "ms") for k in ("routing", "dispatch", "experts", "combine")]


def _markdown(p: dict) -> str:
    out = [report.header_md(p["machine"], {}), ""]
    if p.get("lm"):
        dense = p["lm"][0]
        out += ["### LMs at the dense model's active compute", "",
                report.table(["model", "params", "eval loss (equal steps)", "vs dense",
                              "eval loss (equal time)", "steps in dense's time", "tokens/s",
                              "max load / mean after warmup"], [
                    [r["name"], f"{r['params']:,}", f"{r['eval_loss']:.4f}",
                     f"{r['eval_loss'] - dense['eval_loss']:+.4f}",
                     report.fmt(r["eval_loss_equal_time"]) if r["eval_loss_equal_time"] is None
                     else f"{r['eval_loss_equal_time']:.4f}", report.fmt(r["step_equal_time"]),
                     f"{r['tokens_per_sec']:,.0f}",
                     report.fmt(max((w["max_vs_mean"] for w in r["load"]
                                     if w["step"] > r["warmup_steps"]), default=None))]
                    for r in p["lm"]]), ""]
    if p.get("layer"):
        M, F, X = LAYER["width"], LAYER["expert_dim"], LAYER["experts"]
        out += [f"### The layer: forward + backward, E = {X} top-1, {M} -> {F}, against the "
                f"dense MLP {M} -> {F}", "",
                report.table(["tokens", "dispatch", "ms", "vs dense", "routing", "dispatch ms",
                              "experts", "combine"], [
                    [f"{r['tokens']:,}", r["dispatch"], report.fmt(r["total_s"], "ms"),
                     report.fmt(r["vs_dense"], "x"), *_split_cells(r.get("split_s"))]
                    for r in p["layer"]]), "",
                "Stages by prefix timing: each is the difference between forward + backward of "
                "the layer up to it and up to the stage before (dropless: its products and "
                "combine are one step); a negative difference is a stage below the timing "
                "noise (dispatch's gather).", ""]
    if p.get("parallel"):
        out += ["### Expert parallelism, 8 simulated devices: all-to-all per train step", "",
                report.table(["mesh", "all-to-all ops", "HLO bytes / device", "formula bytes / device",
                              "sent off device"], [
                    [json.dumps(r["mesh"]), str(r.get("all_to_all_ops", "–")),
                     f"{r['hlo_bytes_per_device']:,}" if "hlo_bytes_per_device" in r else r.get("status", "–"),
                     f"{r['formula_bytes_per_device']:,}" if "formula_bytes_per_device" in r else "–",
                     f"{r['sent_off_device_bytes']:,}" if "sent_off_device_bytes" in r else "–"]
                    for r in p["parallel"]]), "",
                "Formula: 4 all-to-alls per MoE layer (dispatch and return, forward and "
                "backward), each of the device's [1 group, 8 experts, C, width] float32 slot "
                "buffer; of it, (N - 1) / N leaves the device.", ""]
    # the runs reused from --workdir said (a review, session 118: "lm 0" read as a part that
    # took no time)
    out += report.seconds_md(p)
    out += [report.targets_md(p.get("targets"), p.get("quick"))]
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    for r in p.get("lm") or []:
        xs = [e["train_s"] for e in r["evals"] if e["train_s"] is not None]
        ys = [e["loss"] for e in r["evals"] if e["train_s"] is not None]
        axes[0].plot(xs, ys, marker="o", ms=3, label=r["name"], color="black" if not r["experts"] else None)
        if r["load"]:
            axes[1].plot([w["step"] for w in r["load"]], [w["max_vs_mean"] for w in r["load"]],
                         label=r["name"])
    axes[0].set(xlabel="training seconds", ylabel="eval loss", title="LMs: eval loss over time")
    axes[1].axhline(2.0, color="red", ls="--", lw=1)
    axes[1].set(xlabel="step", ylabel="max expert load / mean", title="load balance per log window")
    for ax in axes[:2]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for name in ("dense MLP", "capacity 1.0", "capacity 1.25", "dropless"):
        pts = [(r["tokens"], r["total_s"] * 1e3) for r in p.get("layer") or [] if r["dispatch"] == name]
        if pts:
            axes[2].plot(*zip(*pts), marker="o", label=name)
    axes[2].set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms (fwd + bwd)",
                title="MoE layer vs dense MLP")
    if axes[2].lines:
        axes[2].legend(fontsize=7)
    e8 = next((r for r in p.get("lm") or [] if r["name"] == "E=8 top-1" and r["load"]), None)
    if e8:  # each expert's share of block 0's routed tokens, per log window
        share = np.asarray([w["load"][0] for w in e8["load"]])
        axes[3].stackplot([w["step"] for w in e8["load"]], share.T,
                          labels=[f"expert {i}" for i in range(share.shape[1])])
        axes[3].set(xlabel="step", ylabel="share of routed tokens", ylim=(0, 1),
                    title="E=8 top-1, block 0: load per expert")
        axes[3].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "moe.png"))


def run(out_dir: str, *, quick: bool, parts=PARTS, workdir: str | None = None) -> dict:
    s = SIZES["quick" if quick else "full"]
    payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
               "layer_shape": LAYER, "machine": harness.machine_info(), "seconds": {}}
    from hpnlp.bench import compress
    reused = len(compress.REUSED)
    with tempfile.TemporaryDirectory() as tmp:
        harness.run_parts(payload, {"lm": lambda: lm_rows(s, workdir or tmp),
                                    "layer": lambda: layer_rows(s), "parallel": parallel_rows}, parts)
    payload["reused_runs"] = len(compress.REUSED) - reused
    report.targets_unless_quick(payload, quick, lambda: _targets(payload))
    report.write(out_dir, "moe", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS, workdir_help="keep the LM runs' workdirs here (reused)")


main = harness.parts_main(run)
