"""`python -m hpnlp.compress COMMAND`: model compression of trained hpnlp runs.

    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights int8 --activations int8
    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights int4 --group_size 32
    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights bfloat16
    python -m hpnlp.compress quantize --workdir QAT_RUN --out DIR   # export a QAT run as trained
    python -m hpnlp.compress shrink --workdir PRUNED --out DIR      # remove pruned units

`quantize` is post-training quantization (hpnlp.compress.ptq): it calibrates, packs,
evaluates with the task's metric, reloads, and writes DIR/summary.json. Errors (an unknown
format, a group size that does not divide a width, a workdir with no checkpoint) are one
line naming the field or file, before anything compiles.

`shrink` takes a run pruned with `train.prune.structure=structured` (whole attention heads
and MLP neurons of a Transformer; hidden units, i.e. channels of model.width, of an LSTM or
GRU) and writes the smaller dense model it amounts to as a new run in DIR
(hpnlp.compress.prune.shrink_run): fewer heads and a narrower MLP, or a narrower recurrent
model, with the same outputs.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    from hpnlp.compress import calibrate, formats, ptq

    p = argparse.ArgumentParser(prog="python -m hpnlp.compress", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="post-training quantization of a trained run")
    q.add_argument("--workdir", required=True, help="a trained run (python -m hpnlp.main)")
    q.add_argument("--out", required=True, help="folder for quantized.npz, quant.json, summary.json")
    q.add_argument("--weights", default=None,
                   help=f"one of {sorted(formats.FORMATS) + list(ptq.FLOAT_FORMATS)}; left out, "
                        "the run's own quant.* settings (exports a QAT run)")
    q.add_argument("--activations", default="none",
                   help=f"none or one of {list(formats.ACTIVATION_FORMATS)}")
    q.add_argument("--act_scale", default="dynamic", help="dynamic (per token) | static (calibrated)")
    q.add_argument("--group_size", type=int, default=0, help="int4 scale groups; 0 = per channel")
    q.add_argument("--calibration", default="absmax", help=f"one of {list(calibrate.METHODS)}")
    q.add_argument("--percentile", type=float, default=99.99)
    q.add_argument("--layers", default="all", help="all, or a comma list of products")
    q.add_argument("--calib_batches", type=int, default=8, help="training batches to calibrate on")
    q.add_argument("--eval_batches", type=int, default=None,
                   help="held-out batches to evaluate (default: the run's train.eval_batches)")
    s = sub.add_parser("shrink", help="remove a structurally pruned run's heads and neurons (or LSTM/GRU units)")
    s.add_argument("--workdir", required=True, help="a run trained with train.prune.structure=structured")
    s.add_argument("--out", required=True, help="new folder for the smaller run")
    s.add_argument("--eval_batches", type=int, default=None,
                   help="held-out batches to evaluate (default: the run's train.eval_batches)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from hpnlp.compress import ptq
    from hpnlp.config import ConfigError, QuantConfig

    try:
        if args.command == "quantize" and args.weights in (None, *ptq.FLOAT_FORMATS):
            given = [f"--{a}" for a, default in (("activations", "none"), ("act_scale", "dynamic"),
                                                 ("group_size", 0), ("calibration", "absmax"),
                                                 ("layers", "all"))
                     if getattr(args, a) != default]
            if given:
                what = ("the QAT run's export keeps its own" if args.weights is None
                        else f"--weights {args.weights} takes none")
                raise ValueError(f"{', '.join(given)} set integer formats, and {what}; drop "
                                 "them, or give an integer --weights")
        if args.command == "shrink":
            from hpnlp.compress import prune
            summary = prune.shrink_run(args.workdir, args.out, eval_batches=args.eval_batches)
        elif args.weights is None:  # a QAT run's own settings
            summary = ptq.quantize(args.workdir, args.out, calib_batches=args.calib_batches,
                                   eval_batches=args.eval_batches)
        elif args.weights in ptq.FLOAT_FORMATS:
            summary = ptq.quantize(args.workdir, args.out, float_dtype=args.weights,
                                   calib_batches=args.calib_batches, eval_batches=args.eval_batches)
        else:
            q = QuantConfig(weights=args.weights, activations=args.activations,
                            act_scale=args.act_scale, group_size=args.group_size,
                            calibration=args.calibration, percentile=args.percentile,
                            layers=args.layers)
            summary = ptq.quantize(args.workdir, args.out, q, calib_batches=args.calib_batches,
                                   eval_batches=args.eval_batches)
    except (ConfigError, ptq.NoCheckpoint, ValueError) as e:
        print(f"hpnlp.compress: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
