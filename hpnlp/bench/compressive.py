"""The Compressive Transformer against Transformer-XL at the same memory size (issue 23).

Rae et al. 2020 (models/transformer_xl.py): both models are the default byte LM
(experiments/lm.py:bytes,compressive) on stream batches, same width, depth, steps, data
order and seed, and every query attends over the same number of keys. Transformer-XL keeps
n_m + n_cm positions of plain memory; the Compressive Transformer keeps n_m of memory and
n_cm compressed slots at rate c (a learned convolution trained by the attention-
reconstruction loss), so it reaches n_m + c n_cm tokens back for the same keys.

Reported per model: held-out loss in bits per byte and perplexity (the eval stream read in
order with its own memory, as the Trainer evaluates), accuracy, training seconds per step
(the Trainer's throughput after the compiling step; the runs are sequential on a shared
CPU, so read it as +-20%), and for the compressive model its last logged
reconstruction loss. `quick` trains a few steps of each (compiles dominate, ~1-2 minutes);
full trains 400 steps of the default byte LM's batches.

    >>> from hpnlp.bench import compressive                      # doctest: +SKIP
    >>> print(compressive.markdown(compressive.rows(True, "/tmp/comp")))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os

from hpnlp.bench import harness, report
from hpnlp.config import ModelConfig

# full: half the default byte LM's 800 steps (both models the same), so that the retrieval
# benchmark's parts fit one sitting; the held-out pass is the default 25 batches
SIZES = {"full": dict(steps=400, eval_batches=25, batch_size=32),
         "quick": dict(steps=20, eval_batches=2, batch_size=8)}


def configs(quick: bool) -> dict:
    """{"xl": ConfigDict, "compressive": ConfigDict}: the same run but for the memory."""
    s = SIZES["quick" if quick else "full"]
    out = {}
    for kind in ("xl", "compressive"):
        cd = harness.experiment_module("lm.py").get_config("bytes,compressive")
        if kind == "xl":  # the compressed slots as plain memory instead
            cd.name = cd.name.replace("_compressive", "_xl")
            cd.model.mem_len += cd.model.comp_mem_len
            cd.model.comp_mem_len = 0
            for name in ("comp_rate", "comp_fn", "comp_loss_weight"):  # a bug hunt: refused
                setattr(cd.model, name, getattr(ModelConfig, name))  # without comp_mem_len
        if s["steps"]:
            cd.train.update(steps=s["steps"], warmup_steps=min(cd.train.warmup_steps, s["steps"] // 4),
                            log_every=10, eval_every=s["steps"],
                            checkpoint_every=s["steps"], eval_batches=s["eval_batches"],
                            batch_size=s["batch_size"])
        cd.train.progress = False
        out[kind] = cd
    return out


def _last_train_metric(run_dir: str, key: str):
    value = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            if not d.get("eval") and key in d:
                value = d[key]
    return value


def rows(quick: bool, workdir: str) -> list[dict]:
    """Train (or reuse, hpnlp.bench.compress._train) both runs under `workdir`; one row each."""
    from hpnlp.bench.compress import _train
    out = []
    for kind, cd in configs(quick).items():
        run_dir = os.path.join(workdir, cd.name)
        summary = _train(cd, run_dir)
        m, ev = cd.model, summary["eval"]
        sps = summary["throughput"]["steps_per_sec"]
        out.append({
            "model": "Compressive Transformer" if kind == "compressive" else "Transformer-XL",
            "mem_len": m.mem_len, "comp_mem_len": m.comp_mem_len,
            "comp_rate": m.comp_rate if m.comp_mem_len else None,
            "comp_fn": m.comp_fn if m.comp_mem_len else None,
            "keys": m.comp_mem_len + m.mem_len + cd.data.seq_len,  # per query, last position
            "reach": m.mem_len + m.comp_rate * m.comp_mem_len if m.comp_mem_len else m.mem_len,
            "steps": summary["final_step"], "batch_size": cd.train.batch_size,
            "seq_len": cd.data.seq_len, "params": summary["param_count"],
            "eval_loss": ev["loss"], "bits_per_byte": ev["loss"] / math.log(2), "ppl": ev["ppl"],
            "accuracy": ev.get("accuracy"), "s_per_step": 1.0 / sps if sps else None,
            "loss_recon": _last_train_metric(run_dir, "loss_recon") if m.comp_mem_len else None,
            "workdir": os.path.abspath(run_dir)})
    return out


def markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    head = (f"### Compressive Transformer vs Transformer-XL: byte LM, same keys per query, "
            f"{r0['steps']} steps of {r0['batch_size']} x {r0['seq_len']} bytes")
    memory = lambda r: (f"{r['mem_len']} + {r['comp_mem_len']} compressed x{r['comp_rate']} "  # noqa: E731
                        f"({r['comp_fn']})" if r["comp_mem_len"] else f"{r['mem_len']}")
    table = report.table(
        ["model", "memory", "keys / query", "tokens reached", "params", "held-out bits/byte",
         "ppl", "accuracy", "s/step", "recon loss"],
        [[r["model"], memory(r), str(r["keys"]), str(r["reach"]), f"{r['params']:,}",
          f"{r['bits_per_byte']:.4f}", f"{r['ppl']:.3f}", report.fmt(r["accuracy"]),
          report.fmt(r["s_per_step"]), report.fmt(r["loss_recon"])] for r in rows])
    note = ("Held-out: the eval stream read in order, each model with its own memory. "
            "Tokens reached: how far back one layer's keys go (memory + rate x compressed slots). "
            "s/step: training throughput after the compiling step; runs are sequential, so "
            "compare within one report. Recon loss: the last logged attention-reconstruction "
            "loss (mean squared error per element, mean over layers). Params include the "
            "compressors' (one convolution per layer), which the LM loss does not train.")
    return "\n".join([head, "", table, "", note])
