"""`python -m hpnlp.compress COMMAND`: model compression of trained hpnlp runs.

    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights int8 --activations int8
    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights int4 --group_size 32
    python -m hpnlp.compress quantize --workdir TRAINED --out DIR --weights bfloat16
    python -m hpnlp.compress quantize --workdir QAT_RUN --out DIR   # export a QAT run as trained
    python -m hpnlp.compress shrink --workdir PRUNED --out DIR      # remove pruned units
    python -m hpnlp.compress sparsify --workdir PRUNED --out DIR    # serve sparse weights

`quantize` is post-training quantization (hpnlp.compress.ptq): it calibrates, packs,
evaluates with the task's metric, reloads, and writes DIR/summary.json. Errors (an unknown
format, a group size that does not divide a width, a workdir with no checkpoint, a flag the
format would ignore: `--calib_batches` without `--act_scale static`, `--percentile` without
`--calibration percentile`) are one line naming the field, flag or file, before anything
compiles.

`shrink` takes a run pruned with `train.prune.structure=structured` (whole attention heads
and MLP neurons of a Transformer; hidden units, i.e. channels of model.width, of an LSTM or
GRU) and writes the smaller dense model it amounts to as a new run in DIR
(hpnlp.compress.prune.shrink_run): fewer heads and a narrower MLP, or a narrower recurrent
model, with the same outputs.

`sparsify` takes a run pruned unstructured (or any run) and writes it with every qkv, out,
MLP and head weight of at least `--min_sparsity` zeros stored by its nonzeros, multiplied
by the sparse CPU kernel (hpnlp.compress.sparsify, hpnlp.compress.spmm); OUT/summary.json
has both models' metrics, the sizes and the forward speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys

CALIB_BATCHES = 8  # --calib_batches left out


def _check_applies(args) -> None:
    """`--percentile`, `--calib_batches` and `--calibration` where the format would ignore
    them: refused, since a user who gave them believes they took effect (ValueError naming
    the flag and what would make it apply). A QAT export reads the run's own settings."""
    from hpnlp.compress import formats, ptq
    if args.weights in ptq.FLOAT_FORMATS:  # the integer flags are refused before this
        if args.calib_batches is not None:
            raise ValueError(f"--calib_batches calibrates static activation ranges, and --weights "
                             f"{args.weights} is a float cast; drop it, or give an integer "
                             "--weights with --activations int8|fp8 --act_scale static")
        return
    if args.weights is None:  # a QAT run's own settings
        if args.calib_batches is None:
            return
        q = ptq.load_run_config(args.workdir).quant
        if q.enabled and q.act_scale != "static":  # not enabled: ptq.quantize names the fix
            raise ValueError(f"--calib_batches calibrates static activation ranges, and the run in "
                             f"{args.workdir} has quant.act_scale={q.act_scale!r} (its export "
                             "calibrates nothing); drop --calib_batches")
        return
    static = args.act_scale == "static"
    if args.percentile is not None and args.calibration != "percentile":
        raise ValueError(f"--percentile is used only with --calibration percentile (given "
                         f"{args.calibration}); add --calibration percentile, or drop --percentile")
    if args.calib_batches is not None and not static:
        raise ValueError(f"--calib_batches calibrates static activation ranges, and --act_scale is "
                         f"{args.act_scale}; drop it, or give --activations int8|fp8 "
                         "--act_scale static")
    if (args.calibration != "absmax" and args.weights in formats.FORMATS
            and not formats.get(args.weights).uses_range and not static):
        raise ValueError(f"--calibration {args.calibration}: --weights {args.weights} takes its "
                         "scale from the weights' statistics, not a clipping range, and no "
                         "activation range is calibrated; drop --calibration, or give "
                         "--activations int8|fp8 --act_scale static")


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
    q.add_argument("--percentile", type=float, default=None,
                   help="with --calibration percentile: the percentile of |x| kept (default 99.99)")
    q.add_argument("--layers", default="all", help="all, or a comma list of products")
    q.add_argument("--calib_batches", type=int, default=None,
                   help="with --act_scale static: training batches to calibrate the activation "
                        f"ranges on (default {CALIB_BATCHES})")
    q.add_argument("--eval_batches", type=int, default=None,
                   help="held-out batches to evaluate (default: the run's train.eval_batches)")
    s = sub.add_parser("shrink", help="remove a structurally pruned run's heads and neurons (or LSTM/GRU units)")
    s.add_argument("--workdir", required=True, help="a run trained with train.prune.structure=structured")
    s.add_argument("--out", required=True, help="new folder for the smaller run")
    s.add_argument("--eval_batches", type=int, default=None,
                   help="held-out batches to evaluate (default: the run's train.eval_batches)")
    z = sub.add_parser("sparsify", help="serve a pruned run's sparse weights by the sparse kernel")
    z.add_argument("--workdir", required=True, help="a trained run, pruned (train.prune.*)")
    z.add_argument("--out", required=True, help="folder for sparse.npz, sparse.json, summary.json")
    z.add_argument("--min_sparsity", type=float, default=None,
                   help="a weight with at least this share of zeros is stored sparse "
                        "(default 0.75)")
    z.add_argument("--eval_batches", type=int, default=None,
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
                                                 ("layers", "all"), ("percentile", None))
                     if getattr(args, a) != default]
            if given and args.weights is None and not ptq.load_run_config(
                    args.workdir).quant.enabled:  # a README walk: called a QAT run
                raise ValueError(f"{', '.join(given)} set integer formats, and the run in "
                                 f"{args.workdir} trained without quantization (not QAT), so "
                                 "they apply with an integer --weights; add one (e.g. --weights "
                                 "int8)")
            if given:
                what = ("the QAT run's export keeps its own" if args.weights is None
                        else f"--weights {args.weights} takes none")
                raise ValueError(f"{', '.join(given)} set integer formats, and {what}; drop "
                                 "them, or give an integer --weights")
        # the flag by its own name (a README walk: -1 was refused as the config field
        # `train.eval_batches`, which the user had not set)
        if args.eval_batches is not None and args.eval_batches < 0:
            raise ValueError(f"--eval_batches {args.eval_batches}: give a count of held-out "
                             "batches >= 0 (0: the whole held-out split), or leave it out for "
                             "the run's train.eval_batches")
        if getattr(args, "min_sparsity", None) is not None:  # the flag by its own name, before
            # the run is read (a bug hunt, session 97: named as a config field)
            from hpnlp.compress.sparsify import check_min_sparsity
            check_min_sparsity(args.min_sparsity, "--min_sparsity")
        if args.command == "quantize":
            _check_applies(args)
            if args.calib_batches is not None and args.calib_batches < 1:  # review r1: a QAT
                # export's was refused as the config field `calib_batches`, which no config has
                raise ValueError(f"--calib_batches {args.calib_batches}: give a count of "
                                 "training batches >= 1, or leave it out for "
                                 f"{CALIB_BATCHES}")
            calib_batches = CALIB_BATCHES if args.calib_batches is None else args.calib_batches
            percentile = {} if args.percentile is None else {"percentile": args.percentile}
        if args.command == "shrink":
            from hpnlp.compress import prune
            summary = prune.shrink_run(args.workdir, args.out, eval_batches=args.eval_batches)
        elif args.command == "sparsify":
            from hpnlp.compress import sparsify
            fields = {} if args.min_sparsity is None else {"min_sparsity": args.min_sparsity}
            summary = sparsify.sparsify(args.workdir, args.out, eval_batches=args.eval_batches,
                                        **fields)
        elif args.weights is None:  # a QAT run's own settings
            summary = ptq.quantize(args.workdir, args.out, calib_batches=calib_batches,
                                   eval_batches=args.eval_batches)
        elif args.weights in ptq.FLOAT_FORMATS:
            summary = ptq.quantize(args.workdir, args.out, float_dtype=args.weights,
                                   calib_batches=calib_batches, eval_batches=args.eval_batches)
        else:
            q = QuantConfig(weights=args.weights, activations=args.activations,
                            act_scale=args.act_scale, group_size=args.group_size,
                            calibration=args.calibration, layers=args.layers, **percentile)
            summary = ptq.quantize(args.workdir, args.out, q, calib_batches=calib_batches,
                                   eval_batches=args.eval_batches)
    except (ConfigError, ptq.NoCheckpoint, ValueError) as e:
        said = str(e)
        if args.command == "quantize" and args.weights is not None:
            said = as_flags(said)
        print(f"hpnlp.compress: error: {said}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    return 0


def as_flags(message: str) -> str:
    """A config check's message about the quantization this command's flags set, with the
    flags named (`--act_scale dynamic`) where it names `quant.*` fields (a bug hunt, session
    95: "use quant.act_scale='dynamic' or leave 'mlp' out of quant.layers")."""
    import re
    flags = ("weights|activations|act_scale|group_size|calibration|layers|percentile|"
             "calib_batches")
    # the field the check names (`quant.layers`, or the PTQ's own `layers`), and the fields
    # its text names, not a path that holds one (review: sweep/quant.group_size=32)
    # not a clause about a QAT run's own config.json, which this command's run is not (a
    # review, session 115: "set --weights and --activations to 'none' in its config.json")
    message = re.sub(r"; a run saved with it trained in float: [^;]*in its config\.json", "",
                     message)
    message = re.sub(r" \(a run saved with it trained with [^()]*in its config\.json\)", "",
                     message)
    message = re.sub(rf"config field `(?:quant\.)?({flags})`", r"`--\1`", message)
    message = re.sub(rf"(?<![\w/.-])quant\.({flags})='([^']*)'", r"--\1 \2", message)
    return re.sub(rf"(?<![\w/.-])quant\.({flags})\b", r"--\1", message)


if __name__ == "__main__":
    sys.exit(main())
