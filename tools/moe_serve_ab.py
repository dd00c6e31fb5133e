"""A quantized mixture-of-experts LM with its experts served by the integer kernels, against
the same packed experts decoded in XLA (every other product served alike) and the float run
it came from: the eval forward of one batch, and greedy decoding of `model.max_len` tokens at
batch 1 and 8, timed interleaved in one process.

    python tools/moe_serve_ab.py --workdir W --quantized Q [--rounds 5]

W: a trained MoE LM run (`python -m hpnlp.main --config experiments/lm.py:bytes,moe ...`);
Q: its `python -m hpnlp.compress quantize --workdir W --out Q` folder (w8a8: the int8
kernel). Each row gives the median time of the three, and how the served experts' outputs
compare with the XLA-decoded ones' (log-probs: the share of tokens within 1e-3 and the median
difference; decoding: the share of equal tokens).
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ablib import at_least, interleaved_times, print_cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="the trained MoE LM run")
    p.add_argument("--quantized", required=True, help="its `hpnlp.compress quantize` folder")
    p.add_argument("--rounds", type=at_least(1), default=5)
    args = p.parse_args()
    for flag, path, name in (("--workdir", args.workdir, "config.json"),
                             ("--quantized", args.quantized, "quant.json")):
        if not os.path.exists(os.path.join(path, name)):
            p.error(f"{flag} {path}: no {name} there; give a trained MoE LM run and its "
                    "`python -m hpnlp.compress quantize` folder")
    with open(os.path.join(args.quantized, "quant.json")) as f:
        source = json.load(f).get("source", {}).get("workdir")
    if source and os.path.realpath(source) != os.path.realpath(args.workdir):
        # a bug hunt: another run's quantized folder was timed against this run
        p.error(f"--quantized {args.quantized} was quantized from {source}, not --workdir "
                f"{args.workdir}; give the run it was quantized from")

    from flax import traverse_util

    from hpnlp import data as data_lib
    from hpnlp import models
    from hpnlp.compress import ptq
    from hpnlp.compress.qlinear import Factored, Served
    from hpnlp.models import generate
    from hpnlp.moe.layer import _is_served
    from hpnlp.train import Trainer
    from hpnlp.train.carry import model_params
    from hpnlp.train.checkpoint import load_run_config

    cfg = load_run_config(args.workdir)
    trainer = Trainer(cfg, args.workdir, read_only=True)
    state, _ = trainer.initial_state()
    float_params = model_params(state.params)
    cfg_q, packed, quant_vars = ptq.load(args.quantized)
    if not cfg_q.model.moe.enabled():
        raise SystemExit(f"{args.quantized}: not a mixture-of-experts model (model.moe)")
    batch = next(iter(data_lib.make_iterator(trainer.task, cfg.data, split="eval",
                                             batch_size=cfg.train.batch_size)))
    model_q = models.build(cfg_q, deterministic=True)
    served = ptq.serve(model_q, packed, batch, quant_vars)
    # an expert weight is Served, or (model.lowrank) a Factored of two Served factors
    flat = traverse_util.flatten_dict(served,
                                      is_leaf=lambda _, x: isinstance(x, (Served, Factored)))
    experts = [k for k, v in flat.items() if _is_served(v) and "moe" in k]
    if not experts:
        raise SystemExit(f"{args.quantized}: no expert weight is served by an integer kernel "
                         "(w8a8, int4 weight-only or binary formats are)")
    packed_of = lambda v: (v.replace(u=v.u.packed, v=v.v.packed)  # noqa: E731
                           if isinstance(v, Factored) else v.packed)
    decoded = traverse_util.unflatten_dict({k: packed_of(v) if k in experts else v
                                            for k, v in flat.items()})
    variants = {"float32": (cfg, float_params, None), "experts decoded in XLA":
                (cfg_q, decoded, quant_vars), "experts on the kernels": (cfg_q, served, quant_vars)}

    def forward(c, qv):
        model = models.build(c, deterministic=True)
        extra = {"quant": qv} if qv else {}
        return jax.jit(lambda p: model.apply({"params": p, **extra}, batch, method="log_probs"))

    def decoder(c, qv, B):
        prompt = jnp.asarray(np.arange(4 * B).reshape(B, 4) % 64 + 32, jnp.int32)
        return jax.jit(lambda p: generate(c, p, prompt, jnp.full((B,), 4), length=c.model.max_len,
                                          greedy=True, quant_vars=qv or None))

    print_cpu(f"; {args.quantized}, {len(experts)} expert weights served")
    print(f"{'':22s} {'float32':>10s} {'XLA-decoded':>12s} {'kernels':>10s}  "
          "kernels vs XLA-decoded, vs float32")
    for name, make in (("forward (eval batch)", forward),
                       ("decode, batch 1", lambda c, qv: decoder(c, qv, 1)),
                       ("decode, batch 8", lambda c, qv: decoder(c, qv, 8))):
        fns = {k: (make(c, qv), p) for k, (c, p, qv) in variants.items()}
        outs = {k: jax.block_until_ready(fn(p)) for k, (fn, p) in fns.items()}  # compile
        a, b = outs["experts decoded in XLA"], outs["experts on the kernels"]
        if name.startswith("decode"):
            same = np.mean(np.asarray(a) == np.asarray(b))
            note = f"tokens equal to the XLA-decoded experts': {same:.0%}"
        else:  # a later block's router reads the earlier blocks' outputs: a token whose
            # choice or slot moves with the last bits differs whole
            d = np.abs(np.asarray(a) - np.asarray(b)).max(-1)
            note = (f"tokens within 1e-3 of the XLA-decoded experts': {np.mean(d <= 1e-3):.1%}, "
                    f"median difference {np.median(d):.0e}")
        times = interleaved_times({k: (fn, lambda p=p: (p,)) for k, (fn, p) in fns.items()},
                                  rounds=args.rounds, calls=1)
        t = {k: float(np.median(v)) for k, v in times.items()}
        f, x, s = t["float32"], t["experts decoded in XLA"], t["experts on the kernels"]
        print(f"{name:22s} {f * 1e3:7.1f} ms {x * 1e3:9.1f} ms {s * 1e3:7.1f} ms  "
              f"{x / s:5.2f}x, {f / s:5.2f}x   ({note})", flush=True)


if __name__ == "__main__":
    main()
