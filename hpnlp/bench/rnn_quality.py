"""`python -m hpnlp.bench rnn --quality`: word-LM perplexity of the LSTM with each trick.

Runs `experiments/rnn_lm.py` once plain and once per trick (layer norm, variational
dropout, recurrent dropout, zoneout, weight drop), all for the same steps on the same
data, plus a seed ensemble of the plain model (members trained in one program,
`EnsembleTrainer`'s default member loop: one by one on CPU, `vmap` elsewhere; predictions
averaged), and reports held-out perplexity and steps/s.
"""

from __future__ import annotations

import math
import os
import tempfile

from hpnlp.bench import harness, report

ENSEMBLE_MEMBERS = 3


def experiment_config(arg: str):
    mod = harness.experiment_module("rnn_lm.py")
    return mod, mod.get_config(arg)


def _quick(cfg, steps: int | None):
    cfg.train.progress = False
    if steps:
        cfg.train.steps = steps
        # below the steps too: the 'cosine' decay needs steps after its warmup (a review, r10:
        # --steps 1 gave every run warmup_steps = 1, refused by name; lra._config's fix)
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, max(steps // 5, 1), steps - 1)
        cfg.train.eval_every = 0
        cfg.train.checkpoint_every = 0
        cfg.train.log_every = max(steps // 2, 1)
    return cfg


def _label(v: str) -> str:
    return f"ensemble of {ENSEMBLE_MEMBERS} (plain, seeds)" if v == "ensemble" else v


def _train(v: str, *, quick: bool, steps: int | None) -> dict:
    """Variant `v`'s row: its config trained in a temporary folder, then evaluated."""
    from hpnlp import train
    from hpnlp.config import from_configdict
    cfg = _quick(experiment_config("" if v in ("plain", "ensemble") else v)[1], steps)
    if quick:
        cfg.train.eval_batches = 2
    with tempfile.TemporaryDirectory() as wd:
        if v == "ensemble":
            from hpnlp.train.ensemble import EnsembleTrainer
            summary = EnsembleTrainer(from_configdict(cfg), wd, members=ENSEMBLE_MEMBERS).run()
            ev = summary["eval"]  # the ensemble's metrics; members listed beside them
            row = {"member_perplexities": [math.exp(m["loss"]) for m in ev["members"]]}
        else:
            summary = train.run(cfg, wd)
            ev, row = summary["eval"], {}
    return {"eval_loss": ev["loss"], "perplexity": math.exp(ev["loss"]), **row,
            "steps_per_sec": summary.get("throughput", {}).get("steps_per_sec"),
            "steps": cfg.train.steps}


def run(out_dir: str, *, quick: bool, steps: int | None = None) -> dict:
    steps = steps or (20 if quick else None)
    mod, _ = experiment_config("")
    variants = ["plain", *mod.TRICKS, "ensemble"]
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()

    def head(v):
        return {"variant": _label(v)}

    def row(v):
        try:
            return {**head(v), **_train(v, quick=quick, steps=steps)}
        except Exception as e:  # report, never crash the whole run (the rows before: minutes)
            return {**head(v), "status": f"failed: {type(e).__name__}: {str(e)[:150]}"}

    # a Ctrl-C or SIGTERM keeps the rows that ran (review r10: the six before the ensemble,
    # 8-10 minutes of training, were lost, as quality.py's and lra.py's were before session 95)
    results, interrupted = harness.run_rows(variants, row, head, desc="rnn quality")
    out_dir = harness.report_dir(out_dir, interrupted)
    plain = results[0]
    for r in results:
        if "perplexity" in r and "perplexity" in plain:
            r["vs_plain"] = r["perplexity"] / plain["perplexity"] - 1.0
    payload = {"benchmark": "rnn_quality", "machine": info, "results": results,
               "quick": bool(quick), "interrupted": interrupted}
    report.write(out_dir, "rnn quality", payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    """results.md's body from a payload (a recorded results.json renders again with it)."""
    cfg = experiment_config("")[1]
    rows = [[f"`{r['variant']}`", f"{r['perplexity']:.1f}",
             f"{100 * r['vs_plain']:+.1f}%" if "vs_plain" in r else "–",
             report.fmt(r.get("steps_per_sec")), str(r["steps"])] if "perplexity" in r
            else [f"`{r['variant']}`", r.get("status", "–"), "", "", ""]  # failed or not run
            for r in payload["results"]]
    # the header every bench writes, the CPU named (a bug hunt, session 102: two lines of
    # its own, "AMD EPYC, 2 cores", told no EPYC generation from another)
    return "\n".join([
        report.header_md(payload["machine"], {}), "",
        f"Word-level LSTM LM (`experiments/rnn_lm.py`: V={cfg.data.word_vocab_size}, "
        f"{cfg.model.depth} layers x {cfg.model.width}, batch {cfg.train.batch_size}x"
        f"{cfg.data.seq_len}), the same steps for every variant; held-out perplexity on "
        f"{2 if payload.get('quick') else cfg.train.eval_batches} batches.", "",
        report.table(["variant", "perplexity", "vs plain", "steps/s", "steps"], rows)])
