"""Training speed with and without hpnlp's XLA workarounds, interleaved in one run.

    python tools/xla_workaround_ab.py --rounds 3

Trains the byte LM's local preset (`experiments/lm.py:bytes,local`, 60 steps) alternately
with the workarounds on (the default) and off (`HPNLP_XLA_WORKAROUNDS=0`), each in a fresh
process, and prints each run's training tokens/s and final eval loss, then the medians.
docs/xla_defects.md quotes this script's output.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

XLA_FLAGS = os.environ.get("XLA_FLAGS", "")  # as given, before hpnlp's import adds to it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(workarounds: bool) -> dict:
    # malloc stays as hpnlp sets it in both arms (tools/malloc_ab.py measures that one)
    env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, HPNLP_XLA_WORKAROUNDS="1" if workarounds else "0",
               HPNLP_MALLOC_WORKAROUND="1")
    with tempfile.TemporaryDirectory() as workdir:
        subprocess.run([sys.executable, "-m", "hpnlp.main", "--config", "experiments/lm.py:bytes,local",
                        "--workdir", workdir, "--config.train.progress=False"],
                       cwd=ROOT, env=env, check=True, capture_output=True)
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    return {"tokens_per_sec": summary["throughput"]["tokens_per_sec"], "eval_loss": summary["eval"]["loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    from hpnlp.xla_workarounds import APPLIED
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; flags added by the workarounds here: "
          f"{' '.join(a for a in APPLIED if a.startswith('--')) or 'none'}")
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False):
            res = one_run(on)
            runs[on].append(res)
            print(f"round {r + 1} workarounds {'on ' if on else 'off'}: "
                  f"{res['tokens_per_sec']:,.0f} tokens/s, eval loss {res['eval_loss']:.6f}", flush=True)
    for on in (True, False):
        med = statistics.median(x["tokens_per_sec"] for x in runs[on])
        print(f"median workarounds {'on ' if on else 'off'}: {med:,.0f} tokens/s")


if __name__ == "__main__":
    main()
