"""hpnlp's malloc setting (`hpnlp.xla_workarounds`) on and off, for hpnlp's train and eval steps.

    python tools/malloc_ab.py [--rounds 3] [--steps 12]

Importing hpnlp keeps the memory that XLA:CPU frees for reuse (glibc `mallopt`), so a
step's temporaries and outputs are not page-faulted in again on every call. malloc is
set once per process, so each variant runs in processes of its own: a round starts one
process per variant in turn (`HPNLP_MALLOC_WORKAROUND=1` and `=0`), which compiles the
step as `Trainer` does, warms it, then times `--steps` calls (median) and counts the page
faults they took; the table shows the medians over rounds. Steps: the byte LM
(`experiments/lm.py:bytes`), the text classifier (`experiments/lra.py:text` at 256 bytes,
as the compress bench trains it) and a width-512, depth-4 LM (the quantization bench's
size; 8 rows of 256 bytes). docs/xla_defects.md quotes this script's output.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

MODELS = {
    "byte LM": ("lm.py", "bytes", {}),
    "text classifier": ("lra.py", "text", {}),
    "width-512 LM": ("lm.py", "bytes", {
        "model.width": 512, "model.depth": 4, "model.num_heads": 8, "model.mlp_dim": 2048,
        "train.batch_size": 8, "data.seq_len": 256, "model.max_len": 512}),
}


def measure(label: str, steps: int) -> dict:
    """In this process: seconds per train and eval step (medians) and faults per step."""
    import hpnlp  # noqa: F401  (malloc and XLA flags, before JAX starts)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ablib import trainer
    from hpnlp import xla_workarounds
    from hpnlp.train.step import make_eval_step, make_train_step, step_compiler_options

    exp, arg, fields = MODELS[label]
    tr, state, batch = trainer(exp, arg, **fields)
    options = step_compiler_options()
    train = jax.jit(make_train_step(tr.model, tr.tx, tr.cfg.train, tr.carries), donate_argnums=0)
    train = train.lower(state, batch).compile(compiler_options=options)
    evals = jax.jit(make_eval_step(tr.eval_model, tr.cfg.train, carries=tr.carries))
    evals = evals.lower(state, batch).compile(compiler_options=options)
    out = {"malloc": [a for a in xla_workarounds.APPLIED if a.startswith("M_")]}
    state = jax.tree.map(jnp.copy, state)
    for name, call in (("train", lambda s: train(s, batch)), ("eval", lambda s: (s, evals(s, batch)))):
        times, faults = [], []
        for _ in range(4 + steps):  # the first 4 warm up: the heap grows over the first calls
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            state, metrics = jax.block_until_ready(call(state))
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        out[name] = {"s": float(np.median(times[4:])), "faults": float(np.median(faults[4:])),
                     "faults_each": faults}
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 5:  # the first 4 steps are warm-up, not timed
        parser.error(f"--rounds {args.rounds} --steps {args.steps}: give --rounds >= 1 and --steps >= 5")
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args.steps)), flush=True)
        return
    import numpy as np

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {args.rounds} rounds, median of {args.steps} steps each")
    print(f"{'':28s} {'malloc default':>22s} {'hpnlp (reuse)':>22s} {'speedup':>7s}  peak RSS MB")
    variants = {"default": "0", "reuse": "1"}
    for label in MODELS:
        runs = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, switch in variants.items():
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", label, "--steps", str(args.steps)],
                    env={**os.environ, "HPNLP_MALLOC_WORKAROUND": switch},
                    capture_output=True, text=True, check=True)
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                res = json.loads(line[len("RESULT "):])
                assert ("M_MMAP_MAX=0" in res["malloc"]) == (v == "reuse"), (v, res["malloc"])
                runs[v].append(res)
        for step in ("train", "eval"):
            med = {v: float(np.median([r[step]["s"] for r in rs])) for v, rs in runs.items()}
            flt = {v: float(np.median([r[step]["faults"] for r in rs])) for v, rs in runs.items()}
            rss = {v: float(np.median([r["max_rss_mb"] for r in rs])) for v, rs in runs.items()}
            cells = [f"{med[v] * 1e3:7.1f} ms {flt[v]:7.0f} flt" for v in variants]
            print(f"{label + ': ' + step + ' step':28s} {cells[0]:>22s} {cells[1]:>22s} "
                  f"{med['default'] / med['reuse']:6.2f}x  {rss['default']:.0f} / {rss['reuse']:.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
