"""`python -m hpnlp.bench moe_convert`: trained runs converted into mixtures of experts of
another size (`train.init_from`, hpnlp.compress.experts), each against the same model
trained from scratch for the same total steps, in one run on this CPU.

1. Fewer experts (`prune`): the Switch byte LM (experiments/lm.py:bytes,moe: both blocks
   MoE, 8 experts of the dense MLP's width, top-1) trained `source_steps` (the default
   run's 800); then each layer keeps `kept` (4) of its experts: the most routed on
   `calib_batches` (8) training batches (`train.init_experts='routed'`), those with the
   others merged into them (`'merged'`, MC-SMoE: each joins the kept expert routed most
   like it, neurons aligned, averaged by routed weight) or a uniform draw (`'random'`, the
   control), and trains `tune_steps` (200) more. Against: the 8-expert run
   itself trained those steps (what the steps alone give), and the 4-expert LM trained from
   scratch for source + tune steps (what the same model gets from the same total steps).
   Beside them, the same expert parameters by narrower experts: the source trained
   `tune_steps` with each expert's weakest half of its neurons pruned at once
   (`train.prune` structured, magnitude: each expert ranks its own), then shrunk
   (`python -m hpnlp.compress shrink`) to 8 experts of half the width; and each expert's
   two weights at the rank that halves them (`model.lowrank` on `mlp`: one truncated SVD
   per expert), trained `tune_steps`; each against the same MoE from scratch for source +
   tune steps.
2. Upcycling (`upcycle`, Komatsuzaki et al. 2023): the dense byte LM trained
   `source_steps`; each block's MLP copied into 8 experts, top-2 (`router='top_k'`: gates
   that sum to one, so the upcycled model starts as the dense one, up to capacity drops),
   router fresh, trained `tune_steps`. Against: the dense run itself trained those steps,
   and the same MoE trained from scratch for source + tune steps.

Every run after the first `source_steps` trains at the default learning rate with a tenth
of its steps of warmup and cosine decay (a fresh optimizer, as `train.init_from` starts).
Reported: eval loss, its change against the from-scratch model of the same shape, the
loss of each converted model before its steps, parameters, steps. The runs train in
--workdir (a finished run of the same config is reused), side by side, one process a core
(`train_independent_runs`): first the two sources and every model from scratch, then every
run that starts from a source; the rows then read them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from tqdm.auto import tqdm

from hpnlp.bench import compress, gqa, harness, report

# side_by_side and cheap_compile as compress.SIZES' (`train_independent_runs`).
SIZES = {
    "full": dict(lm_steps=None, tune_steps=200, experts=8, kept=4, calib_batches=8,
                 eval_batches=None, side_by_side=True, cheap_compile=False),
    "quick": dict(lm_steps=12, tune_steps=4, experts=4, kept=2, calib_batches=2,
                  eval_batches=2, side_by_side=True, cheap_compile=True),
}
PARTS = ("prune", "upcycle")


def _config(s: dict, experts: int, top_k: int, steps: int | None, *, init_from: str = ""):
    """The byte LM (dense for experts=0) with MoE in both blocks, each expert the dense MLP's
    width, trained `steps` (None: the default run's), from `init_from` when given."""
    cd = compress.experiment("byte LM", dict(lm_steps=steps, eval_batches=s["eval_batches"]))
    if steps and not init_from:  # the experiment's warmup, where `lm_steps` set --quick's 2
        # (a review, session 118: the 1000-step scratch baselines warmed up 2 steps, their
        # sources 100)
        default = compress.experiment("byte LM", dict(lm_steps=None, eval_batches=None))
        cd.train.warmup_steps = min(default.train.warmup_steps, max(2, steps // 10))
    if experts:
        cd.model.moe.update(num_experts=experts, every=1, top_k=top_k,
                            router="switch" if top_k == 1 else "top_k")
    if init_from:
        cd.train.init_from = init_from
        cd.train.warmup_steps = max(1, steps // 10)
    return cd


def _steps(s: dict) -> tuple[int, int]:
    """(source steps, source + tune steps)."""
    source = s["lm_steps"] or compress.experiment("byte LM", dict(
        lm_steps=None, eval_batches=None)).train.steps
    return source, source + s["tune_steps"]


def _row(method: str, experts: int, top_k: int, summary: dict, before: dict | None = None):
    return {"method": method, "experts": experts, "top_k": top_k,
            "steps": summary["final_step"], "params": summary["param_count"],
            "loss": summary["eval"]["loss"], **({"loss_before": before["loss"]} if before else {})}


def _source(s: dict, workdir: str, experts: int, top_k: int, name: str) -> tuple:
    """(config, workdir) of a source: the model trained `lm_steps`."""
    return _config(s, experts, top_k, s["lm_steps"]), os.path.join(workdir, name)


def _continued(s: dict, workdir: str, experts: int, top_k: int, name: str) -> tuple:
    """(config, workdir) of the source `name` itself trained `tune_steps` more."""
    return (_config(s, experts, top_k, s["tune_steps"], init_from=os.path.join(workdir, name)),
            os.path.join(workdir, f"{name}_continued"))


def _scratch(s: dict, workdir: str, target: tuple) -> tuple:
    """(config, workdir) of the `target` model ((experts, top_k)) from scratch for source +
    tune steps."""
    return (_config(s, *target, _steps(s)[1]),
            os.path.join(workdir, f"moe{target[0]}_top{target[1]}_scratch"))


NARROW_SPARSITY = 0.5  # of each expert's neurons, pruned structurally (`narrow_rows`)


def _narrow_run(s: dict, workdir: str, src: str) -> tuple:
    """(config, workdir) of the source `src` trained `tune_steps` with half of every
    expert's neurons pruned structurally at its first update."""
    cd = _config(s, s["experts"], 1, s["tune_steps"], init_from=os.path.join(workdir, src))
    cd.train.prune.update(method="magnitude", sparsity=NARROW_SPARSITY, structure="structured",
                          schedule="oneshot", start_step=0, layers="mlp")
    return cd, os.path.join(workdir, f"{src}_half_neurons")


def _narrow_scratch(s: dict, workdir: str, narrow: int) -> tuple:
    """(config, workdir) of the Switch MoE with experts `narrow` wide from scratch."""
    cd, _ = _scratch(s, workdir, (s["experts"], 1))
    cd.model.moe.mlp_dim = narrow
    return cd, os.path.join(workdir, f"moe{s['experts']}_top1_width{narrow}_scratch")


def narrow_rows(s: dict, workdir: str, src: str) -> list[dict]:
    """The source (`src`, the Switch LM) trained `tune_steps` with half of every expert's
    neurons pruned structurally at its first update (each expert its own weakest by their
    weights' L2 norm), shrunk to experts of half the width; and that narrow MoE from
    scratch for source + tune steps. Rows as `_compare`'s, with the experts' width."""
    from hpnlp.compress import prune
    X = s["experts"]
    cd, pdir = _narrow_run(s, workdir, src)
    width = cd.model.moe.mlp_dim or cd.model.mlp_dim
    sdir = f"{pdir}_shrunk"
    compress._train(cd, pdir)
    # shrunk afresh from the pruned run of this config: `shrink_run` replaces its own
    # earlier output of that run, and refuses a folder holding anything else (a review,
    # session 118: removed here whatever it held)
    summ = prune.shrink_run(pdir, sdir)
    narrow = summ["model"]["moe.mlp_dim"][1]
    row = _row(f"half of each expert's neurons, shrunk (of {width})", X, 1,
               {"final_step": s["tune_steps"], "param_count": summ["params"]["shrunk"],
                "eval": summ["eval"]})
    return _beside_scratch(s, row, _narrow_scratch(s, workdir, narrow), width=narrow)


def _beside_scratch(s: dict, row: dict, scratch: tuple, **shape) -> list[dict]:
    """`row` and the Switch MoE of its shape trained from scratch for source + tune steps
    (`scratch`: its (config, workdir)), both with `shape`'s fields and their loss against
    the latter's."""
    rows = [row, _row("from scratch", s["experts"], 1, compress._train(*scratch))]
    for r in rows:
        r.update(shape, loss_vs_scratch=r["loss"] - rows[-1]["loss"])
    return rows


def half_rank(cd) -> int:
    """The rank r at which an expert's U [K, r] and V [r, N] hold half of its weight's K N
    entries: r (K + N) = K N / 2, rounded."""
    K, N = cd.model.width, cd.model.moe.mlp_dim or cd.model.mlp_dim
    return max(1, round(K * N / (2 * (K + N))))


def _lowrank_run(s: dict, workdir: str, src: str) -> tuple:
    """(config, workdir) of the source `src` with each expert's wi and wo factorized at
    `half_rank`, trained `tune_steps`."""
    cd = _config(s, s["experts"], 1, s["tune_steps"], init_from=os.path.join(workdir, src))
    r = half_rank(cd)
    cd.model.lowrank.update(rank=r, layers="mlp")
    return cd, os.path.join(workdir, f"{src}_rank{r}")


def _lowrank_scratch(s: dict, workdir: str, r: int) -> tuple:
    """(config, workdir) of the Switch MoE with every expert at rank `r`, from scratch."""
    cd, _ = _scratch(s, workdir, (s["experts"], 1))
    cd.model.lowrank.update(rank=r, layers="mlp")
    return cd, os.path.join(workdir, f"moe{s['experts']}_top1_rank{r}_scratch")


def lowrank_rows(s: dict, workdir: str, src: str) -> list[dict]:
    """The source (`src`) with each expert's wi and wo factorized at `half_rank` (one
    truncated SVD per expert), trained `tune_steps`, with its loss before them; and that
    factorized MoE from scratch for source + tune steps. Rows as `_compare`'s, with the rank."""
    cd, out = _lowrank_run(s, workdir, src)
    r = cd.model.lowrank.rank
    with tempfile.TemporaryDirectory() as tmp:
        before = gqa._pooled_eval(cd, tmp)
    row = _row(f"each expert at rank {r} (SVD)", s["experts"], 1, compress._train(cd, out), before)
    return _beside_scratch(s, row, _lowrank_scratch(s, workdir, r), rank=r)


def _compare(s: dict, workdir: str, desc: str, source: tuple, conversions, target: tuple):
    """Rows: the `source` model ((experts, top_k, its run's name)) trained `lm_steps`, then
    itself trained `tune_steps` more ("continued"), each of `conversions` ((label, the
    config of its run from the source, its run's name)) with its loss before its steps, and
    the `target` model ((experts, top_k)) from scratch for source + tune steps; each row's
    loss against that last one where its model is the target's."""
    X, k, name = source
    bar = tqdm(total=3 + len(conversions), desc=desc, leave=False)
    rows = [_row("source", X, k, compress._train(*_source(s, workdir, X, k, name)))]
    bar.update()
    rows.append(_row("source, continued", X, k, compress._train(
        *_continued(s, workdir, X, k, name))))
    bar.update()
    for label, cd, run_name in conversions:
        with tempfile.TemporaryDirectory() as tmp:
            before = gqa._pooled_eval(cd, tmp)
        summary = compress._train(cd, os.path.join(workdir, run_name))
        m = cd.model.moe
        rows.append(_row(label, m.num_experts, m.top_k, summary, before))
        bar.update()
    rows.append(_row("from scratch", *target, compress._train(*_scratch(s, workdir, target))))
    bar.close()
    scratch = rows[-1]["loss"]
    for r in rows:
        same = (r["experts"], r["top_k"]) == target
        r["loss_vs_scratch"] = r["loss"] - scratch if same else None
    return rows


def _prune_conversions(s: dict, workdir: str, src: str) -> list[tuple]:
    """[(label, config, run name)] of the fewer-experts conversions of the source `src`."""
    X, kept = s["experts"], s["kept"]
    conversions = []
    for how in ("routed", "merged", "random"):
        cd = _config(s, kept, 1, s["tune_steps"], init_from=os.path.join(workdir, src))
        cd.train.update(init_experts=how)
        if how != "random":  # a uniform draw reads no batches (the config refuses the field)
            cd.train.update(init_expert_batches=s["calib_batches"])
        conversions.append((f"kept {kept} of {X}: {how}", cd, f"{src}_to_{kept}_{how}"))
    return conversions


def _upcycle_conversion(s: dict, workdir: str) -> tuple:
    """(label, config, run name) of the dense source upcycled into `experts`, top-2."""
    X = s["experts"]
    cd = _config(s, X, 2, s["tune_steps"], init_from=os.path.join(workdir, "dense"))
    return f"upcycled into {X} experts", cd, f"upcycled{X}_top2"


def train_independent_runs(s: dict, workdir: str, parts) -> None:
    """The runs of `parts` trained side by side (`compress._side_by_side`, one process a
    core, where `s` says so) in two batches: first every run that starts from nothing (the
    two sources and every model from scratch, longest first), then every run that starts
    from a source (continued, converted, pruned, factorized), queued ahead at the start
    (`compress._ahead`: each to start once its source is trained, in a process the first
    batch has no run left for). The row builders then find them finished. The narrow
    experts' scratch run is planned at the width the structured pruning leaves
    (`prune.units_pruned`); were the shrunk width another, its row would train that one
    afterwards."""
    from hpnlp.compress import prune
    X, src = s["experts"], f"moe{s['experts']}_top1"
    first, second = [], []
    if "prune" in parts:
        low, narrow = _lowrank_run(s, workdir, src), _narrow_run(s, workdir, src)
        width = narrow[0].model.moe.mlp_dim or narrow[0].model.mlp_dim
        first += [_scratch(s, workdir, (s["kept"], 1)),
                  _lowrank_scratch(s, workdir, low[0].model.lowrank.rank),
                  _narrow_scratch(s, workdir, width - int(prune.units_pruned(NARROW_SPARSITY,
                                                                             width))),
                  _source(s, workdir, X, 1, src)]
        second += [_continued(s, workdir, X, 1, src), narrow, low] + [
            (cd, os.path.join(workdir, name)) for _, cd, name in _prune_conversions(s, workdir,
                                                                                  src)]
    if "upcycle" in parts:
        _, cd, name = _upcycle_conversion(s, workdir)
        first.insert(0, _scratch(s, workdir, (X, 2)))
        first.append(_source(s, workdir, 0, 1, "dense"))
        second += [_continued(s, workdir, 0, 1, "dense"), (cd, os.path.join(workdir, name))]
    compress._ahead(s, second)  # each once its source is trained: no idle core in between
    compress._side_by_side(s, first, "sources and runs from scratch")
    compress._side_by_side(s, second, "runs from the sources")


def prune_rows(s: dict, workdir: str) -> list[dict]:
    X, kept, src = s["experts"], s["kept"], f"moe{s['experts']}_top1"
    return (_compare(s, workdir, "fewer experts", (X, 1, src),
                     _prune_conversions(s, workdir, src), (kept, 1))
            + narrow_rows(s, workdir, src) + lowrank_rows(s, workdir, src))


def upcycle_rows(s: dict, workdir: str) -> list[dict]:
    X = s["experts"]
    conversion = _upcycle_conversion(s, workdir)
    rows = _compare(s, workdir, "upcycling", (0, 1, "dense"), [conversion], (X, 2))
    cd = conversion[1]
    # the upcycled model untrained with nothing dropped: the dense source's function
    cd.model.moe.dispatch = "dropless"
    with tempfile.TemporaryDirectory() as tmp:
        rows[2]["loss_before_dropless"] = gqa._pooled_eval(cd, tmp)["loss"]
    return rows


def _model(r: dict) -> str:
    width = (f" of width {r['width']}" if "width" in r
             else f" of rank {r['rank']}" if "rank" in r else "")
    return "dense" if not r["experts"] else f"{r['experts']} experts{width}, top-{r['top_k']}"


def _table(rows: list[dict]) -> str:
    return report.table(
        ["method", "model", "steps", "params", "eval loss", "vs from scratch", "before its steps"],
        [[r["method"], _model(r), str(r["steps"]), f"{r['params']:,}", f"{r['loss']:.4f}",
          report.fmt(r["loss_vs_scratch"]) if r["loss_vs_scratch"] is None
          else f"{r['loss_vs_scratch']:+.4f}",
          f"{r['loss_before']:.4f}" if "loss_before" in r else "–"] for r in rows])


def _dropless(rows: list[dict]) -> str:
    """The upcycled model's loss before its steps under dropless dispatch, beside the dense
    source's, as a clause (or nothing, for payloads without it)."""
    up = next((r for r in rows if "loss_before_dropless" in r), None)
    if up is None:
        return ""
    return (f" (with capacity dispatch, as it trains; with dropless dispatch, nothing "
            f"dropped: {up['loss_before_dropless']:.4f}, the dense source "
            f"{rows[0]['loss']:.4f})")


def _narrow(rows: list[dict], s: dict) -> str:
    """The narrower experts' rows described (or nothing, for payloads without them)."""
    out = ""
    if any("width" in r for r in rows):
        out += (f" The same expert parameters by narrower experts: the source trained "
                f"{s['tune_steps']} steps with half of each expert's neurons pruned at its "
                f"first update (structured, magnitude: each expert ranks its own), then "
                f"shrunk; from scratch below it: that narrow MoE for {_steps(s)[1]} steps.")
    if any("rank" in r for r in rows):
        out += (f" Or by low-rank experts: each expert's two weights the truncated SVD at "
                f"the rank that halves them, trained {s['tune_steps']} steps; from scratch "
                f"below it: that factorized MoE for {_steps(s)[1]} steps.")
    return out


def _markdown(p: dict) -> str:
    s = p["sizes"]
    source, total = p["steps"]
    out = [report.header_md(p["machine"], {}), ""]
    if p.get("prune"):
        out += [f"### Fewer experts: {s['kept']} of {s['experts']}", "",
                f"The Switch byte LM (both blocks MoE, top-1) trained {source} steps (source), "
                f"then {s['tune_steps']} more: itself (continued), or keeping {s['kept']} of "
                f"each layer's experts, the most routed on {s['calib_batches']} training "
                f"batches (routed), those with the others merged into them (merged: each "
                f"joins the kept expert routed most like it, neurons aligned, averaged by "
                f"routed weight) or a random draw; from scratch: the {s['kept']}-expert LM for "
                f"{total} steps. Before its steps: the kept experts' eval loss, untrained."
                + _narrow(p["prune"], s), "",
                _table(p["prune"]), ""]
    if p.get("upcycle"):
        out += [f"### Upcycling the dense LM into {s['experts']} experts", "",
                f"The dense byte LM trained {source} steps (source), then {s['tune_steps']} "
                f"more: itself (continued), or its MLPs copied into {s['experts']} experts "
                f"(top-2, gates summing to one; router fresh); from scratch: that MoE LM for "
                f"{total} steps. Before its steps: the upcycled model's eval loss, "
                "untrained" + _dropless(p["upcycle"]) + ".", "", _table(p["upcycle"]), ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def run(out_dir: str, *, quick: bool, workdir: str | None = None, parts=PARTS) -> dict:
    s = dict(SIZES["quick" if quick else "full"])
    payload = {"sizes": s, "steps": list(_steps(s)), "machine": harness.machine_info(),
               "seconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        wd = workdir or tmp
        before = compress.runs_in(wd)
        harness.check_parts(parts, PARTS)  # before any training
        with compress.side_by_side_processes(s):
            t0 = time.perf_counter()
            if s["side_by_side"]:
                train_independent_runs(s, wd, parts)
                payload["seconds"]["runs side by side"] = time.perf_counter() - t0
        harness.run_parts(payload, {"prune": lambda: prune_rows(s, wd),
                                    "upcycle": lambda: upcycle_rows(s, wd)}, parts)
    payload["reused_runs"] = compress.reused_since(before)
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "moe_convert", payload, _markdown(payload))
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS,
                                workdir_help="keep the trained runs here (and reuse them)")


main = harness.parts_main(run)
