"""`python -m hpnlp.bench speculative`: speculative decoding (hpnlp.models.speculative) of a
byte LM with a smaller draft, against the target decoding alone, in one run on this CPU.

Models (trained in --workdir, a finished run of the same config reused), per target size:
the target, a byte LM of experiments/lm.py (the default one, and one four times as wide and
twice as deep, 12.8M parameters); two drafts at half its depth and width (an eighth of the
wide target's parameters, a sixth of the default one's, whose embedding weighs more):
distilled from it (`train.distill`, `DRAFTS`: the compress bench's text-classifier recipe
until 2026-11-29, the teacher's important weights from its last blocks with soft targets at
T = 1) and trained from scratch, both for the target's steps.

Decoding: `prompts` prompts of `prompt_len` bytes from the eval text, `new_tokens` bytes each,
at batch 1 (one prompt a call, in turn: where drafting pays most, since one token's step
reads every weight) and at `batch` (the prompts in calls of that many rows, each row
keeping its own drafts); greedy and sampled (temperature 0.8). Per (target, batch, draft,
k drafted tokens a round, mode): tokens/s, the speed-up over the target alone at the same
batch and mode, acceptance (drafts kept / drafted, over the rounds each row took part in),
tokens per target call (all rows'), and for greedy whether the tokens equal the target's
own greedy tokens at batch 1 (they must: the check runs in the bench). Every call is timed
interleaved with its target's alone (`harness.time_interleaved`), so drift falls on both.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

from hpnlp.bench import compress, harness, report

# target name: (model fields, train fields) over experiments/lm.py's byte LM. The wide one
# trains at a third of the default learning rate: at 3e-3 it stayed on the plateau near loss
# 2.27 that the default LM leaves near step 350, and ended at eval loss 2.16 after 800 steps
# (2026-11-27), worse than the default LM's 1.52
TARGETS = {"default byte LM": (dict(width=128, depth=2, num_heads=4, mlp_dim=512), {}),
           "4x wide, 2x deep": (dict(width=512, depth=4, num_heads=8, mlp_dim=2048),
                                dict(lr=1e-3))}
SIZES = {
    # both targets train the default experiment's 800 steps (the wide one 0.9 steps/s on a
    # 2-core Zen 5: 15 minutes); at 400 the wide one was still on the plateau (eval loss 2.18)
    # that both leave near step 350
    "full": dict(targets={"default byte LM": None, "4x wide, 2x deep": None}, ks=(2, 4, 6, 8, 10),
                 prompts=4, batch=4, prompt_len=16, new_tokens=96, temperature=0.8, repeats=7,
                 eval_batches=None),
    "quick": dict(targets={"default byte LM": 12}, ks=(2,), prompts=2, batch=2, prompt_len=8,
                  new_tokens=16, temperature=0.8, repeats=2, eval_batches=2),
}
# --targets names them by these (a GPU session's 15 minutes fit a part of the run)
TARGET_NAMES = {"default": "default byte LM", "wide": "4x wide, 2x deep"}
QUICK_TARGETS = "--quick runs the default target only; drop --targets or --quick"
# the distilled draft's recipe, the one its record trained: the text classifier's targets'
# recipe in the compress bench until 2026-11-29 (Minitron's important weights of the last
# blocks, soft targets at T = 1). Validation picks others since (compress.TARGETS_RECIPE:
# the byte LM's own, the classifier's at its students' rate); this bench was not rerun.
DRAFTS = {"distilled": dict(alpha=0.5, temperature=1.0, init="importance", init_blocks="last"),
          "scratch": None}
MODES = ("greedy", "sampled")


def target_config(name: str, steps: int | None, eval_batches: int | None = None):
    """experiments/lm.py's byte LM at `name`'s size, trained `steps` (None: its 800)."""
    cd = compress.experiment("byte LM", dict(lm_steps=None, eval_batches=eval_batches))
    cd.model.update(TARGETS[name][0])
    cd.train.update(TARGETS[name][1])
    if steps:
        cd.train.steps, cd.train.warmup_steps = steps, min(cd.train.warmup_steps, steps // 5)
    return cd


def draft_config(name: str, steps: int | None, eval_batches: int | None, tdir: str, how: str):
    cd = compress.student(target_config(name, steps, eval_batches))
    if DRAFTS[how] is not None:
        cd.train.distill.update(teacher=tdir, **DRAFTS[how])
    return cd


def _load(workdir: str):
    """(config, params, task) of a trained run."""
    from hpnlp.train import Trainer
    from hpnlp.train.carry import model_params
    from hpnlp.train.checkpoint import load_run_config

    tr = Trainer(load_run_config(workdir), workdir, read_only=True)
    state, _ = tr.initial_state()
    tr.checkpointer.close()
    return tr.cfg, model_params(state.params), tr.task


def _prompts(task, cfg, n: int, length: int) -> np.ndarray:
    from hpnlp import data as data_lib
    batch = next(iter(data_lib.make_iterator(task, cfg.data, split="eval", batch_size=n)))
    return np.asarray(batch["inputs"][:, :length], np.int32)


def train_models(s: dict, workdir: str) -> dict:
    """{target name: {"dirs": {"target" or draft name: workdir}, "summaries": {the same:
    its training summary}}}, trained (or reused)."""
    out = {}
    for name, steps in s["targets"].items():
        tag = name.replace(" ", "_").replace(",", "")
        tdir = os.path.join(workdir, f"{tag}_target")
        summaries = {"target": compress._train(target_config(name, steps, s["eval_batches"]), tdir)}
        dirs = {"target": tdir}
        for how in DRAFTS:
            ddir = dirs[how] = os.path.join(workdir, f"{tag}_draft_{how}")
            summaries[how] = compress._train(
                draft_config(name, steps, s["eval_batches"], tdir, how), ddir)
        out[name] = {"dirs": dirs, "summaries": summaries}
    return out


def decode_rows(s: dict, models: dict) -> list[dict]:
    from hpnlp.models.generate import generate
    from hpnlp.models.speculative import speculative_generate

    rows = []
    n_new = s["new_tokens"]
    length = s["prompt_len"] + n_new
    for name, m in models.items():
        cfg, params, task = _load(m["dirs"]["target"])
        prompts = _prompts(task, cfg, s["prompts"], s["prompt_len"])
        drafts = {how: _load(m["dirs"][how]) for how in DRAFTS}
        calls, stats = {}, {}

        def over_prompts(key, f, *args):
            """calls[key]: f(*args, prompts, their key) on the prompts in calls of `batch`
            rows (key[1]); stats[key]: the outputs of its latest call."""
            outs, batch = stats.setdefault(key, []), key[1]

            def call():
                outs[:] = [f(*args, prompts[i:i + batch], jax.random.key(i))
                           for i in range(0, len(prompts), batch)]
                jax.block_until_ready(outs)
            calls[key] = call
        for mode in MODES:
            kw = (dict(greedy=True) if mode == "greedy" else  # greedy refuses a temperature
                  dict(greedy=False, temperature=s["temperature"]))
            for batch in dict.fromkeys((1, s["batch"])):
                # the prompt prefilled in one call, as speculative decoding does
                over_prompts((mode, batch, "target alone", 0), jax.jit(
                    lambda p, pr, key, kw=kw: generate(cfg, p, pr, None, length=length, rng=key,
                                                       **kw)), params)
                for how, (dcfg, dparams, _) in drafts.items():
                    for k in s["ks"]:
                        over_prompts((mode, batch, how, k), jax.jit(
                            lambda p, dp, pr, key, dcfg=dcfg, k=k, kw=kw: speculative_generate(
                                cfg, p, dcfg, dp, pr, length=length, draft_tokens=k, rng=key,
                                **kw)), params, dparams)
        timed = harness.time_interleaved(calls, repeats=s["repeats"])
        target = m["summaries"]["target"]
        for mode, batch, how, k in calls:
            sec = timed[(mode, batch, how, k)][0].median_s
            draft = m["summaries"][how] if k else None
            row = {"target": name, "target_params": target["param_count"],
                   "target_loss": target["eval"]["loss"], "mode": mode, "batch": batch,
                   "draft": how, "k": k, "draft_params": draft and draft["param_count"],
                   "draft_loss": draft and draft["eval"]["loss"], "seconds": sec,
                   "tokens_per_s": len(prompts) * n_new / sec}
            if k:
                res = stats[(mode, batch, how, k)]
                rounds = sum(int(st["rounds"]) for _, st in res)
                kept = sum(int(np.sum(st["accepted"])) for _, st in res)
                row_rounds = sum(int(np.sum(st["row_rounds"])) for _, st in res)
                row.update(rounds=rounds, accepted=kept, acceptance=kept / (row_rounds * k),
                           tokens_per_call=len(prompts) * n_new / rounds)
                if mode == "greedy":
                    own = np.concatenate(stats[(mode, 1, "target alone", 0)])
                    row["equals_target"] = bool(np.array_equal(
                        np.concatenate([t for t, _ in res]), own))
            rows.append(row)
        base = {(r["mode"], r["batch"]): r["seconds"] for r in rows
                if r["target"] == name and not r["k"]}
        for r in rows:
            if r["target"] == name:
                r["speedup"] = base[(r["mode"], r["batch"])] / r["seconds"]
    return rows


def _markdown(p: dict) -> str:
    s = p["sizes"]
    out = [report.header_md(p["machine"], {}), "",
           f"{s['prompts']} prompts of {s['prompt_len']} bytes from the eval text, "
           f"{s['new_tokens']} new bytes each, at batch 1 (one prompt a call) and batch "
           f"{s['batch']} (each row keeps its own drafts); sampled at temperature "
           f"{s['temperature']}. Tokens/s: medians of the rounds, every configuration of a "
           "target timed in turn each round. Speed-up: over the target decoding alone, same "
           "batch and mode. Acceptance: drafts kept over drafts proposed. Tokens per call: new "
           "tokens (all rows') per target call. Greedy rows check their tokens against the "
           "target's own greedy decoding at batch 1.", ""]
    for target in dict.fromkeys(r["target"] for r in p["rows"]):
        rows = sorted((r for r in p["rows"] if r["target"] == target), key=lambda r: r["batch"])
        t = rows[0]
        out += [f"### {target}: {t['target_params']:,} parameters, eval loss "
                f"{t['target_loss']:.4f}", ""]
        drafts = {r["draft"]: r for r in rows if r["k"]}
        if drafts:
            out += ["Drafts: " + "; ".join(f"{d} ({r['draft_params']:,} parameters, eval loss "
                                            f"{r['draft_loss']:.4f})" for d, r in drafts.items())
                    + ".", ""]
        out += [report.table(
            ["batch", "mode", "draft", "k", "tokens/s", "speed-up", "acceptance",
             "tokens per call", "= target's greedy"],
            [[str(r["batch"]), r["mode"], r["draft"], str(r["k"] or "–"),
              f"{r['tokens_per_s']:.1f}",
              report.fmt(r["speedup"], "x"), report.fmt(r.get("acceptance")),
              report.fmt(r.get("tokens_per_call")),
              {True: "yes", False: "**no**"}.get(r.get("equals_target"), "–")] for r in rows]), ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    """Speed-up against k per (target, draft, mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in p["rows"]))
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4), squeeze=False)
    for ax, target in zip(axes[0], targets):
        series = {}
        for r in p["rows"]:
            if r["target"] == target and r["k"]:
                series.setdefault(f"{r['draft']}, {r['mode']}, batch {r['batch']}", []).append(
                    (r["k"], r["speedup"]))
        for label, pts in series.items():
            ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xlabel("drafted tokens per round (k)")
        ax.set_ylabel("speed-up over the target alone")
        ax.set_title(target)
        ax.legend(fontsize=8)
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "speculative_speedup.png"))


def run(out_dir: str, *, quick: bool, workdir: str | None = None,
        targets: list[str] | None = None, ks: list[int] | None = None) -> dict:
    """`targets` (TARGET_NAMES' short names) and `ks` narrow the run (default: the size's)."""
    s = dict(SIZES["quick" if quick else "full"])
    if targets and set(targets) - {"default"} and quick:
        raise ValueError(QUICK_TARGETS)
    if targets:
        s["targets"] = {TARGET_NAMES[t]: s["targets"][TARGET_NAMES[t]] for t in targets}
    if ks:
        s["ks"] = tuple(ks)
    payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
               "machine": harness.machine_info(), "seconds": {}}
    every = SIZES["quick" if quick else "full"]
    left_out = [key for key in ("targets", "ks") if set(every[key]) - set(s[key])]
    if left_out:  # a part of the tables, not the README's (a bug hunt, session 103: `--ks 2`
        # wrote its rows, marked full)
        payload["subset"] = {key: list(s[key]) for key in left_out}
    with tempfile.TemporaryDirectory() as tmp:
        t0, reused = time.perf_counter(), len(compress.REUSED)
        models = train_models(s, workdir or tmp)
        payload["seconds"]["train"] = time.perf_counter() - t0
        payload["reused_runs"] = len(compress.REUSED) - reused
        t0 = time.perf_counter()
        payload["rows"] = decode_rows(s, models)
        payload["seconds"]["decode"] = time.perf_counter() - t0
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "speculative", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def _targets(text: str) -> list[str]:
    out = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not out or any(t not in TARGET_NAMES for t in out):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(TARGET_NAMES)}, "
                                         "comma-separated")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the trained runs here (and reuse them)")
    p.add_argument("--targets", type=_targets, default=None,
                   help=f"comma-separated, from {', '.join(TARGET_NAMES)} (default: both; "
                   "default only with --quick)")
    p.add_argument("--ks", type=harness.positive_ints("2,4,8"), default=None,
                   help="drafted tokens a round, comma-separated (default: 2,4,6,8,10; 2 with --quick)")


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --targets or --ks leaving out a
    target or a k it has rows of (a bug hunt, session 103: `--ks 2` replaced the recorded
    report)."""
    rows = [r for r in held.get("rows") or () if isinstance(r, dict)]
    flags = []
    if args.targets and {r.get("target") for r in rows} - {
            None, *(TARGET_NAMES[t] for t in args.targets)}:
        flags.append(f"--targets {','.join(args.targets)}")
    if args.ks and {r.get("k") for r in rows} - {None, 0, *args.ks}:  # (0: the target alone)
        flags.append(f"--ks {','.join(map(str, args.ks))}")
    return flags


def main(args) -> None:
    if args.quick and args.targets and set(args.targets) - {"default"}:
        print(f"python -m hpnlp.bench speculative: error: {QUICK_TARGETS}", file=sys.stderr)
        raise SystemExit(2)
    run(args.out, quick=args.quick, workdir=args.workdir, targets=args.targets, ks=args.ks)
