"""`python -m hpnlp.bench softmax --quality`: perplexity at equal training time, per output layer.

Trains the LM of `experiments/lm.py` on the shipped corpus once per output layer and
tokenization for the same wall-clock seconds of training (compilation excluded), at one
constant learning rate from the first step (`WARMUP_STEPS`; a decay schedule would need the
step count in advance, which is what differs between methods). Two tokenizations, each its own
table compared with `full` on the same tokenization in the same run (`tokenizers=`):

- `words`: the whole train vocabulary, 12,070 words (`experiments/lm.py:words`);
- `bpe`: SentencePiece BPE of 32,000 pieces (`experiments/lm.py:bpe`), the size the
  approximate softmaxes were made for. Its ids are frequency-sorted like word ids, so
  `bench_options(method, V)` (negatives V/32, adaptive cutoffs V/128, V/16, V/4) and the
  log-uniform samplers apply as they do to words.

Either way the output layer dominates the step. Each model is then evaluated with its
exact normalized log-probabilities on the same held-out batches. Reported: perplexity per
token, steps taken, steps/s relative to `full`, and whether the perplexity is within 5% of
`full`'s. Perplexities per word and per subword piece are not comparable, so each result
also carries the loss rescaled to per word and per byte of the eval split (`per_word_ppl`,
`bits_per_byte`: loss x the split's tokens / its words or bytes).

Cost: at `--seconds 90` on one CPU core the words part takes ~20 minutes and the bpe part
~40 (exact evaluation at V = 32000 is ~1 minute a method, `hierarchical`'s ~8; and
`class_based` takes ~27 s a step there, since on this corpus 18,923 of the 32,000 pieces never
occur in the training text and its frequency binning puts every unseen id in one class).
"""

from __future__ import annotations

import math
import os
import time

import jax

from hpnlp import softmax as softmax_lib
from hpnlp.bench import harness, report

WITHIN = 0.05  # "as good as full": perplexity within 5%

# No warmup: every arm trains at the same rate from its first step, whatever its speed. A
# warmup counted in steps is a different schedule for each arm in a fixed time budget (review
# r10: the records up to 2026-12-06 warmed over 50 steps, so at V = 32K `full`'s 41 steps
# ended at 0.8x the rate and `class_based`'s 11 at 0.2x, while the fast arms spent 16-20% of
# their steps in it); a warmup by a share of the time would need the rate fed by the clock,
# outside the optimizer's step-counted schedule. Adam's step is about the rate whatever the
# gradient's scale, and this small LM at 3e-3 trains without one: on the words part (60 steps,
# one core of the Xeon model 167, 2026-12-06) `full`, `adaptive`, `sampled` and
# `hierarchical` fell with no spike, `full`'s train loss to 4.68 at step 60 (4.94 warmed up).
WARMUP_STEPS = 0
# What the records before WARMUP_STEPS (payloads without `warmup_steps`) warmed over.
RECORDED_WARMUP_STEPS = 50

# tokenizer -> (preset of experiments/lm.py, vocabulary size, the table's title). Both sizes
# are large enough that the output layer is most of the step.
TOKENIZERS = {
    "words": ("words", 12_070, "Words"),  # every train word: 12,068 words, <eos>, <unk>
    "bpe": ("bpe", 32_000, "BPE subwords"),  # the shipped corpus supports up to ~34K pieces
}


def _config(method: str, quick: bool, tokenizer: str = "words"):
    from hpnlp.bench.softmax import bench_options
    from hpnlp.config import from_configdict
    preset, V, _ = TOKENIZERS[tokenizer]
    cfg = harness.experiment_module("lm.py").get_config(preset)
    cfg.name = f"quality_{tokenizer}_{method}"
    # each read by its tokenizer only (check_new_run refuses it else)
    if tokenizer == "words":
        cfg.data.word_vocab_size = V
    else:
        cfg.data.vocab_size = V
    cfg.output.name = method
    cfg.output.tie_embeddings = "embed" in softmax_lib.get(method).__dataclass_fields__
    cfg.output.options = bench_options(method, V)
    cfg.train.schedule = "constant"
    cfg.train.steps = 10**6  # bounded by time, not steps
    cfg.train.warmup_steps = WARMUP_STEPS
    cfg.train.eval_batches = 4 if quick else 25
    cfg.train.progress = False
    if quick:
        cfg.model.width, cfg.model.mlp_dim, cfg.model.depth = 64, 128, 1
        cfg.data.seq_len = cfg.model.max_len = 64
        cfg.train.batch_size = 16
    return from_configdict(cfg)


def eval_units(task) -> dict:
    """Target tokens, words and UTF-8 bytes of the shipped corpus's eval split (each
    document's first unit is never a target), to rescale a per-token loss."""
    from hpnlp.data import corpus, task as task_lib, text_tasks
    docs = [c.text for c in corpus.kjv_splits()[1]]
    return {"tokens": int(len(task_lib.lm_targets(task.eval))),
            "words": sum(len(text_tasks.word_tokens(d)) - 1 for d in docs),
            "bytes": sum(len(d.encode("utf-8")) - 1 for d in docs)}


def train_for(method: str, seconds: float, workdir: str, *, quick: bool,
              tokenizer: str = "words") -> dict:
    """Train `method` for `seconds` of step time; evaluate exactly."""
    from hpnlp.train.loop import Trainer, _global
    trainer = Trainer(_config(method, quick, tokenizer), workdir)
    state, _ = trainer.initial_state()
    steps = 0
    with trainer._context():
        state, m = trainer.train_step(state, _global(next(trainer.train_iter), trainer.batch_sharding))
        jax.block_until_ready(m)  # compiled; the clock starts now
        t0, per_step = time.perf_counter(), None
        while time.perf_counter() - t0 < seconds:
            state, m = trainer.train_step(state, _global(next(trainer.train_iter), trainer.batch_sharding))
            steps += 1
            left = seconds - (time.perf_counter() - t0)
            # keep the clock honest about queued work: every 10 steps, and every step once
            # the time left is within 10 (a bug hunt: 0.5 s ran `full` 4.9 s, 10 queued steps)
            if steps % 10 == 0 or per_step is None or left < 10 * per_step:
                jax.block_until_ready(m)
                per_step = (time.perf_counter() - t0) / steps
        jax.block_until_ready(m)
        train_s = time.perf_counter() - t0
    ev = trainer.evaluate(state)
    units = eval_units(trainer.task)
    return {"method": method, "tokenizer": tokenizer, "vocab_size": trainer.task.vocab_size,
            "steps": steps, "train_seconds": train_s,
            "steps_per_sec": steps / train_s, "eval_loss": ev["loss"],
            "perplexity": math.exp(ev["loss"]),
            "per_word_ppl": math.exp(ev["loss"] * units["tokens"] / units["words"]),
            "bits_per_byte": ev["loss"] * units["tokens"] / units["bytes"] / math.log(2),
            "eval_units": units,
            "train_loss_last": float(jax.device_get(m["loss"]) / jax.device_get(m["weight"]))}


def compare(results: list[dict]) -> None:
    """Each result against `full` on its own tokenization: speedup, ppl_vs_full, within_5pct."""
    full = {r["tokenizer"]: r for r in results if r["method"] == "full" and "perplexity" in r}
    for r in results:
        f = full.get(r["tokenizer"])
        if f and "perplexity" in r:
            r["speedup"] = r["steps_per_sec"] / f["steps_per_sec"]
            r["ppl_vs_full"] = r["perplexity"] / f["perplexity"] - 1.0
            r["within_5pct"] = r["ppl_vs_full"] <= WITHIN


def default_seconds(quick: bool) -> float:
    """Each method's training time where --seconds is not given (quick: 20 short runs, ~8
    minutes)."""
    return 10.0 if quick else 240.0


def run(out_dir: str, *, quick: bool, methods: list[str] | None = None,
        seconds: float | None = None, tokenizers: list[str] | None = None) -> dict:
    """`tokenizers`: the parts to run, of `TOKENIZERS` (default: all)."""
    import tempfile
    tokenizers = tokenizers or list(TOKENIZERS)
    bad = [t for t in tokenizers if t not in TOKENIZERS]
    if bad:
        raise ValueError(f"tokenizers={bad}: choose from {sorted(TOKENIZERS)}")
    unknown = [m for m in methods or () if m not in softmax_lib.names()]
    if unknown:  # each run would fail alone, and the report would list only failures
        raise ValueError(f"methods={unknown}: choose from {softmax_lib.names()}")
    seconds = seconds or default_seconds(quick)
    names = methods or softmax_lib.names()
    names = ["full"] + [n for n in names if n != "full"]
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    jobs = [(t, m) for t in tokenizers for m in names]

    def row(job):
        t, m = job
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as wd:
            try:
                out = train_for(m, seconds, wd, quick=quick, tokenizer=t)
            except Exception as e:  # report, never crash the whole run
                out = {"method": m, "tokenizer": t,
                       "status": f"failed: {type(e).__name__}: {str(e)[:150]}"}
        # Data, compilation and evaluation included: what a rerun of this row costs.
        return {**out, "wall_seconds": time.perf_counter() - t0}

    # a Ctrl-C or SIGTERM keeps the rows that ran (review, session 95: minutes each)
    results, interrupted = harness.run_rows(jobs, row, lambda job: {"method": job[1],
                                                                    "tokenizer": job[0]},
                                            desc="softmax quality")
    out_dir = harness.report_dir(out_dir, interrupted)
    compare(results)
    payload = {"benchmark": "softmax_quality", "machine": info, "seconds": seconds, "quick": quick,
               "tokenizers": tokenizers, "warmup_steps": WARMUP_STEPS,
               "interrupted": interrupted, "results": results}
    if set(names) != set(softmax_lib.names()):  # a part of each table, not the README's (a
        # bug hunt, session 102: `--methods full` wrote a one-row report, marked full)
        payload["subset"] = {"methods": names}
    md = markdown(payload)
    if any("speedup" in r for r in results):
        plot_tradeoff(os.path.join(out_dir, "softmax_quality.png"), results)
        md += "\n\nPlot: `softmax_quality.png` (perplexity against speed, one panel per tokenization)."
    report.write(out_dir, "softmax quality", payload, md)
    return payload


def _rows(results: list[dict], per_word: bool) -> list[list[str]]:
    rows = []
    for r in results:
        if "ppl_vs_full" in r:
            rows.append([f"`{r['method']}`", f"{r['perplexity']:.1f}"]
                        + ([f"{r['per_word_ppl']:.1f}"] if per_word else [])
                        + [f"{100 * r['ppl_vs_full']:+.1f}%", "yes" if r["within_5pct"] else "no",
                           str(r["steps"]), report.fmt(r["speedup"], "x")])
        else:  # failed, or no `full` to compare with
            status = r.get("status") or "no `full` to compare with"
            rows.append([f"`{r['method']}`", status] + [""] * (5 if per_word else 4))
    return rows


def rate_reached(steps: int, warmup: int) -> float:
    """The share of the learning rate a row's last step applied: `steps` timed steps after
    the untimed first one, step s of a warmup applying (s - 1) / warmup of the rate."""
    return min(steps / warmup, 1.0) if warmup else 1.0


def markdown(payload: dict) -> str:
    """results.md's body from a payload: one table per tokenization."""
    info, seconds, quick = payload["machine"], payload["seconds"], payload["quick"]
    tokenizers = payload.get("tokenizers") or ["words"]  # results recorded before `bpe`
    warmup = payload.get("warmup_steps", RECORDED_WARMUP_STEPS)
    cfg = _config("full", quick, tokenizers[0])
    schedule = (f"constant lr {cfg.train.lr} from the first step (no warmup: the same schedule "
                "for every method, whatever its speed)" if not warmup else
                f"constant lr {cfg.train.lr} after {warmup} warmup steps (linear from 0, "
                "counted in steps: a method that took fewer never reached that lr)")
    # the header every bench writes, the CPU named (a bug hunt, session 102: two lines of its
    # own, "AMD EPYC, 2 cores", told no EPYC generation from another)
    lines = [report.header_md(info, {}), "",
             f"LMs on the shipped corpus (width {cfg.model.width}, depth {cfg.model.depth}, "
             f"batch {cfg.train.batch_size}x{cfg.data.seq_len} tokens), {seconds:.0f} s of training "
             f"per method (compilation excluded), {schedule}; exact normalized perplexity per "
             f"token on {cfg.train.eval_batches} held-out batches. Each table compares with "
             "`full` on the same tokenization."]
    for t in tokenizers:
        _, V, title = TOKENIZERS[t]
        results = [r for r in payload["results"] if r.get("tokenizer", "words") == t]
        V = next((r["vocab_size"] for r in results if "vocab_size" in r), V)
        per_word = t != "words"
        lines += ["", f"**{title}, V = {V}**" + (
            ": per word = exp(loss per piece x pieces / words of the eval split), comparable to "
            "the words table's perplexity (which, though, is of lowercased words with `<unk>` "
            "for unseen ones, an easier target)" if per_word else ""), "",
            report.table(["method", "perplexity"] + (["per word"] if per_word else [])
                         + ["vs full", f"within {WITHIN:.0%}", "steps", "steps/s vs full"],
                         _rows(results, per_word))]
        short = [f"`{r['method']}` {rate_reached(r['steps'], warmup):.2g}x" for r in results
                 if "steps" in r and rate_reached(r["steps"], warmup) < 1]
        if short:  # review r10: their rows compare schedules as well as output layers
            lines += ["", "Ended inside the warmup (the share of the lr its last step applied): "
                      + ", ".join(short) + "."]
    return "\n".join(lines)


def plot_tradeoff(path: str, results: list[dict]) -> None:
    """Perplexity against steps/s relative to `full`, the 5% band shaded; a panel per tokenization."""
    import matplotlib.pyplot as plt
    parts = [t for t in TOKENIZERS if any("speedup" in r and r["tokenizer"] == t for r in results)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.2), squeeze=False)
    for ax, t in zip(axes[0], parts):
        ok = [r for r in results if "speedup" in r and r["tokenizer"] == t]
        full = next(r for r in ok if r["method"] == "full")
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
        ax.set_ylabel("held-out perplexity per token (exact)")
        ax.set_title(f"{TOKENIZERS[t][2]}, V = {full['vocab_size']}: equal training time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    report.savefig(fig, path)
