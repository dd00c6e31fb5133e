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

from tqdm.auto import tqdm

from hpnlp.bench import harness, report

ENSEMBLE_MEMBERS = 3


def experiment_config(arg: str):
    mod = harness.experiment_module("rnn_lm.py")
    return mod, mod.get_config(arg)


def _quick(cfg, steps: int | None):
    cfg.train.progress = False
    if steps:
        cfg.train.steps = steps
        cfg.train.warmup_steps = min(cfg.train.warmup_steps, max(steps // 5, 1))
        cfg.train.eval_every = 0
        cfg.train.checkpoint_every = 0
        cfg.train.log_every = max(steps // 2, 1)
    return cfg


def run(out_dir: str, *, quick: bool, steps: int | None = None) -> dict:
    from hpnlp import train
    steps = steps or (20 if quick else None)
    mod, _ = experiment_config("")
    variants = ["plain", *mod.TRICKS]
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    results = []
    for v in tqdm(variants + ["ensemble"], desc="rnn quality", dynamic_ncols=True):
        cfg = _quick(experiment_config("" if v in ("plain", "ensemble") else v)[1], steps)
        if quick:
            cfg.train.eval_batches = 2
        with tempfile.TemporaryDirectory() as wd:
            if v == "ensemble":
                from hpnlp.train.ensemble import EnsembleTrainer
                from hpnlp.config import from_configdict
                tr = EnsembleTrainer(from_configdict(cfg), wd, members=ENSEMBLE_MEMBERS)
                summary = tr.run()
                ev = summary["eval"]  # the ensemble's metrics; members listed beside them
                members = [m["loss"] for m in ev["members"]]
                row = {"variant": f"ensemble of {ENSEMBLE_MEMBERS} (plain, seeds)",
                       "eval_loss": ev["loss"], "perplexity": math.exp(ev["loss"]),
                       "member_perplexities": [math.exp(x) for x in members],
                       "steps_per_sec": summary.get("throughput", {}).get("steps_per_sec")}
            else:
                summary = train.run(cfg, wd)
                row = {"variant": v, "eval_loss": summary["eval"]["loss"],
                       "perplexity": math.exp(summary["eval"]["loss"]),
                       "steps_per_sec": summary.get("throughput", {}).get("steps_per_sec")}
        row["steps"] = cfg.train.steps
        results.append(row)
    plain = results[0]
    for r in results:
        r["vs_plain"] = r["perplexity"] / plain["perplexity"] - 1.0
    payload = {"benchmark": "rnn_quality", "machine": info, "results": results,
               "quick": bool(quick)}
    report.write(out_dir, "rnn quality", payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    """results.md's body from a payload (a recorded results.json renders again with it)."""
    cfg = experiment_config("")[1]
    rows = [[f"`{r['variant']}`", f"{r['perplexity']:.1f}", f"{100 * r['vs_plain']:+.1f}%",
             report.fmt(r.get("steps_per_sec")), str(r["steps"])] for r in payload["results"]]
    # the header every bench writes, the CPU named (a bug hunt, session 102: two lines of
    # its own, "AMD EPYC, 2 cores", told no EPYC generation from another)
    return "\n".join([
        report.header_md(payload["machine"], {}), "",
        f"Word-level LSTM LM (`experiments/rnn_lm.py`: V={cfg.data.word_vocab_size}, "
        f"{cfg.model.depth} layers x {cfg.model.width}, batch {cfg.train.batch_size}x"
        f"{cfg.data.seq_len}), the same steps for every variant; held-out perplexity on "
        f"{2 if payload.get('quick') else cfg.train.eval_batches} batches.", "",
        report.table(["variant", "perplexity", "vs plain", "steps/s", "steps"], rows)])
