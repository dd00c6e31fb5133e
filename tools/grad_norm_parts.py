"""Which parameters make a run's global gradient norm: the first steps' norm split by each
parameter's own name, and the factor global-norm clipping scales every gradient by.

    python tools/grad_norm_parts.py --config experiments/lra.py:listops \
        [--set attention.name=clustered ...] [--steps 1] [--top 8]

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

from hpnlp.config import from_configdict
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
    """`field.path=value` overrides, each value parsed as the field's own type."""
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: give field.path=value")
        *parents, leaf = key.split(".")
        node = cd
        for name in parents:
            node = node[name]
        old = node[leaf]
        value = (text.lower() in ("1", "true", "yes") if isinstance(old, bool) else
                 type(old)(text) if isinstance(old, (int, float, str)) else text)
        node[leaf] = value
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
    p.add_argument("--set", action="append", default=[], help="field.path=value (repeatable)")
    p.add_argument("--steps", type=int, default=1, help="steps to measure, from the start")
    p.add_argument("--top", type=int, default=8, help="names to list per step")
    args = p.parse_args()
    if args.steps < 1 or args.top < 1:
        p.error("--steps and --top must be >= 1")
    cfg = from_configdict(apply_sets(load_configdict(args.config), args.set))
    workdir = tempfile.mkdtemp(prefix="grad_norm_parts_")
    try:
        measure(cfg, workdir, args)
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
