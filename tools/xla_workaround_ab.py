"""Training speed with and without hpnlp's ISA cap (`--xla_cpu_max_isa=AVX2`), interleaved.

    python tools/xla_workaround_ab.py --rounds 3

Trains the byte LM's local preset (`experiments/lm.py:bytes,local`, 60 steps) alternately
with the cap on (the default) and off (`HPNLP_ISA_WORKAROUND=0`), each in a fresh process,
and prints each run's training tokens/s and final eval loss, then the medians. Only the cap
differs: both arms keep hpnlp's other workarounds (`HPNLP_XLA_WORKAROUNDS=1`: the steps'
YNN-fusions-off compile option, which `=0` would drop too; malloc as hpnlp sets it,
tools/malloc_ab.py measures that one), and the header prints what each arm ran with.
docs/xla_defects.md quotes this script's output.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def given_xla_flags() -> str:
    """XLA_FLAGS as the user gave it, without what an import of hpnlp in this process added
    (a test imports hpnlp first): each arm's own import decides the cap."""
    flags = os.environ.get("XLA_FLAGS", "")
    workarounds = sys.modules.get("hpnlp.xla_workarounds")
    if workarounds is not None:
        flags = " ".join(t for t in flags.split() if t not in workarounds.APPLIED)
    return flags


XLA_FLAGS = given_xla_flags()  # read before this process imports hpnlp (main's header does)
# What each arm's process reports having: its XLA_FLAGS after `import hpnlp` and the options
# its train and eval steps compile with.
_SETTINGS = """
import json, os
import hpnlp
from hpnlp.train.step import step_compiler_options
print(json.dumps({"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                  "compiler_options": step_compiler_options()}))
"""


def arm_env(isa_cap: bool) -> dict:
    """The environment of an arm's process: the ISA cap on or off, the rest alike."""
    return dict(os.environ, XLA_FLAGS=XLA_FLAGS, HPNLP_XLA_WORKAROUNDS="1",
                HPNLP_ISA_WORKAROUND="1" if isa_cap else "0", HPNLP_MALLOC_WORKAROUND="1")


def arm_settings(env: dict) -> dict:
    """{"XLA_FLAGS": ..., "compiler_options": ...} of a process started with `env`."""
    proc = subprocess.run([sys.executable, "-c", _SETTINGS], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one_run(isa_cap: bool) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        subprocess.run([sys.executable, "-m", "hpnlp.main", "--config",
                        "experiments/lm.py:bytes,local", "--workdir", workdir,
                        "--config.train.progress=False"],
                       cwd=ROOT, env=arm_env(isa_cap), check=True, capture_output=True)
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    return {"tokens_per_sec": summary["throughput"]["tokens_per_sec"],
            "eval_loss": summary["eval"]["loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    from ablib import cpu_name
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__}")
    settings = {on: arm_settings(arm_env(on)) for on in (True, False)}
    for on in (True, False):
        print(f"ISA cap {'on ' if on else 'off'}: XLA_FLAGS={settings[on]['XLA_FLAGS']!r}; "
              f"step compile options {settings[on]['compiler_options']}")
    if settings[True] == settings[False]:  # no AVX-512, or a jaxlib the defect was not seen on
        print("note: the cap does not apply here (hpnlp.xla_workarounds.pad_overread_flag), "
              "so both arms run the same programs")
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False):
            res = one_run(on)
            runs[on].append(res)
            print(f"round {r + 1} ISA cap {'on ' if on else 'off'}: "
                  f"{res['tokens_per_sec']:,.0f} tokens/s, eval loss {res['eval_loss']:.6f}",
                  flush=True)
    for on in (True, False):
        med = statistics.median(x["tokens_per_sec"] for x in runs[on])
        print(f"median ISA cap {'on ' if on else 'off'}: {med:,.0f} tokens/s")


if __name__ == "__main__":
    main()
