"""How good a distilled student's start is: its eval loss before any training, per init.

    python tools/distill_init_loss.py --teacher WORKDIR [--inits select importance pca]

The byte LM's student of the compress bench (`hpnlp.bench.compress.student`: half the
teacher's depth, width, heads and MLP width) is started from the teacher in WORKDIR by each
`train.distill.init` and evaluated at once (the teacher's eval batches and split: train a
teacher with `data.eval_split='validation'`, as `python -m hpnlp.bench distill_recipes
--model 'byte LM' --workdir W` does in W/byte_LM/teacher, to read validation chapters only).
For `pca` it also prints the share of the normalized residual states' energy the kept
components hold (`hpnlp.compress.slicing`). Beside them the teacher's own loss, and the
unigram loss (a model that learned only byte frequencies).
"""

import argparse
import json
import os
import sys

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import ml_collections
import numpy as np

from ablib import scratch_dir
from hpnlp.bench import compress
from hpnlp.config import from_configdict, to_json, validate
from hpnlp.train import Trainer
from hpnlp.train.checkpoint import load_run_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="a byte-LM run's workdir")
    p.add_argument("--inits", nargs="+", default=["select", "importance", "pca"],
                   choices=["none", "every_other", "select", "importance", "pca"],
                   help="train.distill.init values to compare")
    p.add_argument("--eval-batches", type=int, default=0, help="0: the teacher's")
    args = p.parse_args()
    if args.eval_batches < 0:  # a bug hunt: a traceback after the first init's evaluation
        p.error(f"--eval-batches {args.eval_batches}: give a positive number (0: the teacher's)")
    if not os.path.exists(os.path.join(args.teacher, "config.json")):
        sys.exit(f"--teacher {args.teacher}: no config.json there; pass a finished run's workdir")
    summary = teacher_summary(p, args.teacher)
    tcfg = validate(load_run_config(args.teacher))
    print(f"teacher {args.teacher}: eval split {tcfg.data.eval_split!r}")
    for init in args.inits:
        cd = compress.student(ml_collections.ConfigDict(to_json(tcfg)))
        cd.train.distill.update(teacher=args.teacher, init=init, alpha=0.0)
        cd.train.progress = False
        if args.eval_batches:
            cd.train.eval_batches = args.eval_batches
        tr = Trainer(from_configdict(cd), scratch_dir())
        state, _ = tr.initial_state()
        line = f"init={init}: loss {tr.evaluate(state)['loss']:.4f}"
        if init == "pca":
            line += f" (kept components' energy {energy(tr, state):.3f})"
        print(line, flush=True)
    print(f"teacher: loss {summary['eval']['loss']:.4f}; unigram loss "
          f"{summary['baseline']['unigram_loss']:.4f} (its run's summary.json)")


def teacher_summary(p: argparse.ArgumentParser, teacher: str) -> dict:
    """The teacher run's summary.json, with the losses the last line prints; a parser error
    naming what is missing before any student is built (review r6: a run stopped by Ctrl-C,
    or still training, has none, a FileNotFoundError after every init's evaluation)."""
    path = os.path.join(teacher, "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
    except OSError as e:
        p.error(f"--teacher {teacher}: no readable summary.json there ({e.strerror}): a run "
                "writes it when it ends; pass a finished run's workdir")
    except ValueError as e:
        p.error(f"--teacher {teacher}: its summary.json is not JSON ({e}); pass a finished "
                "run's workdir")
    for section, key in (("eval", "loss"), ("baseline", "unigram_loss")):
        part = summary.get(section) if isinstance(summary, dict) else None
        value = part.get(key) if isinstance(part, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            p.error(f"--teacher {teacher}: its summary.json has no number {section}.{key}; pass "
                    "a finished byte-LM run's workdir")
    return summary


def energy(tr, state) -> float:
    """The share of the covariance's trace the student's basis keeps (its mean direction
    holds none: the states are centered), on the batches the init read."""
    from hpnlp.compress import slicing
    from hpnlp.compress.distill import TeacherCarry
    (c,) = [c for c in tr.carries if isinstance(c, TeacherCarry)]
    batches = tr._first_train_batches(c.d.importance_batches)
    value = state.carry[c.name]  # the teacher's parameters, restored by the init
    cov = slicing.stream_covariance(c.teacher, {"params": value}, batches, "hidden",
                                    microbatches=tr.cfg.train.grad_accum)
    basis = slicing.stream_basis(cov, tr.cfg.model.width)
    return float(np.trace(basis.T @ cov @ basis) / np.trace(cov))


if __name__ == "__main__":
    main()
