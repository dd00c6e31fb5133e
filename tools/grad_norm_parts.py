"""Which parameters make a run's global gradient norm: the first steps' norm split by each
parameter's own name, and the factor global-norm clipping scales every gradient by.

    python tools/grad_norm_parts.py --config experiments/lra.py:listops \
        [--set attention.name=clustered --set attention.options.num_clusters=8 ...] \
        [--steps 1] [--top 8]

Each step is the run's own (`Trainer.train_step` from its initial state, on its training
batches); its gradient is taken as the step takes it (the objective's, over the batch's
tokens or examples, before clipping) and its norm split by the last name in each parameter's
path (`centroids`, `kernel`, `embedding`, ...), largest first. Beside it the step's logged
`grad_norm`, the norm its clipping reads (`hpnlp.train.state.clips`: all of it but what is
no gradient of the objective, and a pruning mask's entries), and the clip factor it gives,
`train.clip_norm / grad_norm` (1: no clip). The split is of one gradient of the whole batch
(under train.grad_accum the step sums its microbatches' instead, and under float16 it unscales
a scaled one: the two norms then differ by rounding). Session 109 measured with it that `clustered`
attention's injected k-means step was 95-100% of the whole norm (the LRA ListOps
classifier's first step: 1376 against the rest's 1.73), which clipping then read (a factor of
7.3e-4); it reads the rest's 1.73 now (0.577).
"""

import argparse
import ast
import collections
import importlib.util
import os
import shutil
import sys
import tempfile

import hpnlp  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import ConfigError, from_configdict
from hpnlp.train import Trainer
from hpnlp.train import carry as carry_lib
from hpnlp.train.loop import _global


def load_configdict(spec: str):
    """An experiment's ConfigDict from 'path.py[:variant]', as `hpnlp.main --config` reads it."""
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise SystemExit(f"--config {spec}: no file {path}; give experiments/NAME.py[:variant]")
    module_spec = importlib.util.spec_from_file_location("experiment", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def apply_sets(cd, sets):
    """`field.path=value` overrides, each value parsed as the field's own type (a field that is
    None, a tuple or a dict: a Python literal, else the text); `attention.options.KEY=VALUE`
    and `output.options.KEY=VALUE`, keys the chosen variant takes that the file need not list,
    as `hpnlp.main` reads `--config.attention.options.KEY=VALUE`. A mistake is one line naming
    the --set (review r6: a missing field, an option key, or 64.0 for an int was a
    traceback, and a boolean took any word but true/1/yes as false)."""
    from hpnlp import main as cli
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: give field.path=value")
        if cli._OPTION.match(f"--config.{item}"):
            saved = cli._option_overrides[:]  # the command line's own, in a process that has one
            cli._option_overrides[:] = []
            try:
                cli._take_option_overrides([f"--config.{item}"])
                cli.apply_option_overrides(cd)
            finally:
                cli._option_overrides[:] = saved
            continue
        *parents, leaf = key.split(".")
        try:
            node = cd
            for name in parents:
                node = node[name]
            old = node[leaf]
        except KeyError as e:  # ml_collections' message: the name, then "Did you mean ..."
            why = " ".join(str(e.args[0]).split()) if e.args else key
            raise SystemExit(f"--set {item}: no such config field: {why}") from None
        except (TypeError, AttributeError):  # a name under a field that is not a group
            raise SystemExit(f"--set {item}: no such config field: {key}") from None
        if isinstance(old, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"--set {item}: {key} is a boolean; give true or false")
            value = text.lower() in ("true", "1")
        elif isinstance(old, (int, float, str)):
            try:
                value = type(old)(text)
            except ValueError:
                kind = "an integer" if isinstance(old, int) else "a number"
                raise SystemExit(f"--set {item}: {key} takes {kind}; {text!r} is not one") from None
        elif text.lower() in cli._WORDS:
            value = cli._WORDS[text.lower()]
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
        try:
            node[leaf] = value
        except (TypeError, ValueError) as e:  # ml_collections' type safety
            raise SystemExit(f"--set {item}: {' '.join(str(e).split())}") from None
    return cd


def parts(grads) -> dict:
    """{a parameter's own name: the squared norm of its gradients}, summed over its leaves."""
    out = collections.defaultdict(float)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        out[str(keys[-1]) if keys else "?"] += float(jnp.sum(jnp.square(g.astype(jnp.float32))))
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="experiments/NAME.py[:variant]")
    p.add_argument("--set", action="append", default=[],
                   help="field.path=value, or attention.options.KEY=value (repeatable)")
    p.add_argument("--steps", type=int, default=1, help="steps to measure, from the start")
    p.add_argument("--top", type=int, default=8, help="names to list per step")
    args = p.parse_args()
    if args.steps < 1 or args.top < 1:
        p.error("--steps and --top must be >= 1")
    cd = apply_sets(load_configdict(args.config), args.set)
    workdir = tempfile.mkdtemp(prefix="grad_norm_parts_")
    try:
        measure(from_configdict(cd), workdir, args)
    except ConfigError as e:  # the config's checks (an option the variant does not take)
        raise SystemExit(f"grad_norm_parts: {e}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure(cfg, workdir: str, args) -> None:
    """Print the split of `args.steps` first steps' gradient norms of a run of `cfg`."""
    t = cfg.train
    trainer = Trainer(cfg, workdir)
    state, _ = trainer.initial_state()
    objective = carry_lib.objective(trainer.model, list(trainer.carries))

    @jax.jit
    def grads_of(state, batch):
        def f(params):
            sums, _ = objective(params, state.carry, batch, {
                "dropout": state.step_key(),
                "features": state.train_features_key(t.feature_redraw_every)})
            return sums["loss"] + sums.get(carry_lib.AUX_LOSS, 0.0), sums
        g, sums = jax.grad(f, has_aux=True)(state.params)
        return jax.tree.map(lambda x: x / jnp.maximum(sums["weight"], 1.0), g)

    print(f"{args.config} {' '.join(args.set)}: attention {cfg.attention.name}, batch "
          f"{t.batch_size} x {cfg.data.seq_len}, clip_norm {t.clip_norm}", file=sys.stderr)
    batches = iter(trainer.train_iter)
    for step in range(args.steps):
        batch = _global(next(batches), trainer.batch_sharding)
        squares = parts(grads_of(state, batch))
        norm = float(np.sqrt(sum(squares.values())))
        state, metrics = trainer.train_step(state, batch)
        logged = float(metrics["grad_norm"])  # the norm the step's clipping read
        clip = min(1.0, t.clip_norm / logged) if t.clip_norm > 0 and logged > 0 else 1.0
        print(f"step {step + 1}: norm {norm:.4g}, of which clipping reads {logged:.4g} (the "
              f"logged grad_norm), clip factor {clip:.3g}")
        for name, sq in sorted(squares.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {name:<24} {np.sqrt(sq):10.4g}  {sq / max(norm ** 2, 1e-30):7.1%} of the "
                  f"squared norm")


if __name__ == "__main__":
    main()
