"""`python -m hpnlp.bench softmax --quality`: perplexity at equal training time, per output layer.

Trains the word-level LM of `experiments/lm.py:words` on the shipped corpus (the whole
train vocabulary, 12,070 words, so the output layer dominates the step) once per output
layer for the same wall-clock seconds of training (compilation excluded), with a constant
learning rate after warmup (a decay schedule would need the step count in advance, which
is what differs between methods). Each is then evaluated with its exact normalized
log-probabilities on the same held-out batches. Reported: perplexity, steps taken,
steps/s relative to `full`, and whether the perplexity is within 5% of `full`'s.
"""

from __future__ import annotations

import math
import os
import time

import jax
from tqdm.auto import tqdm

from hpnlp import softmax as softmax_lib
from hpnlp.bench import harness, report

WITHIN = 0.05  # "as good as full": perplexity within 5%


def _config(method: str, quick: bool):
    from hpnlp.config import from_configdict
    cfg = harness.experiment_module("lm.py").get_config("words")
    cfg.name = f"quality_{method}"
    cfg.data.word_vocab_size = 12_070  # every train word: the output layer is the cost
    cfg.output.name = method
    cfg.output.tie_embeddings = "embed" in softmax_lib.get(method).__dataclass_fields__
    from hpnlp.bench.softmax import bench_options
    cfg.output.options = bench_options(method, cfg.data.word_vocab_size)
    cfg.train.schedule = "constant"
    cfg.train.steps = 10**6  # bounded by time, not steps
    cfg.train.warmup_steps = 50
    cfg.train.eval_batches = 4 if quick else 25
    cfg.train.progress = False
    if quick:
        cfg.model.width, cfg.model.mlp_dim, cfg.model.depth = 64, 128, 1
        cfg.data.seq_len = cfg.model.max_len = 64
        cfg.train.batch_size = 16
    return from_configdict(cfg)


def train_for(method: str, seconds: float, workdir: str, *, quick: bool) -> dict:
    """Train `method` for `seconds` of step time; evaluate exactly."""
    from hpnlp.train.loop import Trainer, _global
    trainer = Trainer(_config(method, quick), workdir)
    state, _ = trainer.initial_state()
    steps = 0
    with trainer._context():
        state, m = trainer.train_step(state, _global(next(trainer.train_iter), trainer.batch_sharding))
        jax.block_until_ready(m)  # compiled; the clock starts now
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            state, m = trainer.train_step(state, _global(next(trainer.train_iter), trainer.batch_sharding))
            steps += 1
            if steps % 10 == 0:
                jax.block_until_ready(m)  # keep the clock honest about queued work
        jax.block_until_ready(m)
        train_s = time.perf_counter() - t0
    ev = trainer.evaluate(state)
    return {"method": method, "steps": steps, "train_seconds": train_s,
            "steps_per_sec": steps / train_s, "eval_loss": ev["loss"],
            "perplexity": math.exp(ev["loss"]), "train_loss_last": float(jax.device_get(m["loss"])
                                                                          / jax.device_get(m["weight"]))}


def run(out_dir: str, *, quick: bool, methods: list[str] | None = None,
        seconds: float | None = None) -> dict:
    import tempfile
    seconds = seconds or (20.0 if quick else 240.0)
    names = methods or softmax_lib.names()
    names = ["full"] + [n for n in names if n != "full"]
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    results = []
    for m in tqdm(names, desc="softmax quality", dynamic_ncols=True):
        with tempfile.TemporaryDirectory() as wd:
            try:
                results.append(train_for(m, seconds, wd, quick=quick))
            except Exception as e:  # report, never crash the whole run
                results.append({"method": m, "status": f"failed: {type(e).__name__}: {str(e)[:150]}"})
    full = next((r for r in results if r["method"] == "full" and "perplexity" in r), None)
    for r in results:
        if full and "perplexity" in r:
            r["speedup"] = r["steps_per_sec"] / full["steps_per_sec"]
            r["ppl_vs_full"] = r["perplexity"] / full["perplexity"] - 1.0
            r["within_5pct"] = r["ppl_vs_full"] <= WITHIN
    payload = {"benchmark": "softmax_quality", "machine": info, "seconds": seconds, "quick": quick,
               "results": results}
    cfg = _config("full", quick)
    rows = [[f"`{r['method']}`", f"{r['perplexity']:.1f}", f"{100 * r['ppl_vs_full']:+.1f}%",
             "yes" if r["within_5pct"] else "no", str(r["steps"]), report.fmt(r["speedup"], "x")]
            if "perplexity" in r and full else [f"`{r['method']}`", r.get("status", "–"), "", "", "", ""]
            for r in results]
    md = "\n".join([
        f"- date: {info['date']}", f"- machine: {info['cpu']}, {info['cores']} cores", "",
        f"Word-level LM on the shipped corpus (V={cfg.model.vocab_size or cfg.data.word_vocab_size}, "
        f"width {cfg.model.width}, depth {cfg.model.depth}, batch {cfg.train.batch_size}x"
        f"{cfg.data.seq_len}), {seconds:.0f} s of training per method (compilation excluded), "
        f"constant lr {cfg.train.lr} after {cfg.train.warmup_steps} warmup steps; exact normalized "
        f"perplexity on {cfg.train.eval_batches} held-out batches.", "",
        report.table(["method", "perplexity", "vs full", f"within {WITHIN:.0%}", "steps",
                      "steps/s vs full"], rows)])
    if full:
        plot_tradeoff(os.path.join(out_dir, "softmax_quality.png"), results)
        md += "\n\nPlot: `softmax_quality.png` (perplexity against speed)."
    report.write(out_dir, "softmax quality", payload, md)
    return payload


def plot_tradeoff(path: str, results: list[dict]) -> None:
    """Perplexity against steps/s relative to `full`, the 5% band shaded."""
    import matplotlib.pyplot as plt
    ok = [r for r in results if "speedup" in r]
    full = next(r for r in ok if r["method"] == "full")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.axhspan(0, full["perplexity"] * (1 + WITHIN), color="tab:green", alpha=0.08,
               label=f"within {WITHIN:.0%} of full")
    for r in ok:
        ax.scatter(r["speedup"], r["perplexity"], s=25)
        ax.annotate(r["method"], (r["speedup"], r["perplexity"]), fontsize=8,
                    xytext=(4, 3), textcoords="offset points")
    ppl = [r["perplexity"] for r in ok]
    ax.set_ylim(min(ppl) * 0.9, max(ppl) * 1.1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("training steps/s relative to full")
    ax.set_ylabel("held-out perplexity (exact)")
    ax.set_title("output layers at equal training time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
