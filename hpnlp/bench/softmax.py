"""`python -m hpnlp.bench softmax`: every registered output layer beside `full` and PyTorch.

One training step of the output layer alone (loss forward + backward with respect to its
parameters and the hidden states) for N tokens of width E over vocabularies V = 32K, 262K
and 1M (N=8192, E=512), every method in `hpnlp.softmax.names()` and, when installed,
PyTorch's `AdaptiveLogSoftmaxWithLoss` with the same cutoffs as `adaptive`, all in one run.
Targets follow Zipf's law over frequency-sorted ids (as word tokens do) and the
frequency-based methods get those counts. Times are medians (min, max); memory is the
compiled executable's and the peak RSS of a fresh process per configuration. `full` also
reports achieved GFLOP/s against this machine's matmul rate (6·N·V·E FLOPs per step).
On a GPU (`JAX_PLATFORMS=cuda`) PyTorch's layer runs on CUDA too, memory is the device's
and float32 products run at full precision there, as in `attention` (its docstring).

`--quality` instead trains the word-level LM and a BPE (V = 32000) LM on the shipped corpus
once per method for the same wall-clock time as `full` and reports exact perplexity (see
`quality.py`; `--tokenizers words|bpe` runs one part).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import softmax as softmax_lib
from hpnlp.bench import harness, report
from hpnlp.config import ConfigError, checks

TORCH_ADAPTIVE = "torch.AdaptiveLogSoftmaxWithLoss"
# The output layers' options this bench sets itself (review, session 96: the model's own list
# refused dtype, which the bench has no model field for)
BENCH_SET = {"vocab_size": "is set by the bench from --vocabs, not a --set option",
             "counts": "is set by the bench (a Zipf law over each V), not a --set option",
             "embed": "is set by the bench (vmf's own table), not a --set option",
             "quant": "is set by a model's quant group, which the bench does not time"}
REFERENCE = "full"


def adaptive_cutoffs(V: int) -> list[int]:
    """Shortlist V/128, then clusters up to V/16 and V/4 (with Zipf targets the shortlist
    takes about 60% of tokens at V=262K); below V=512, at least 1 and without repeats, so
    the cutoffs stay strictly increasing in (0, V) (a bug hunt, session 95: V=100 read
    (0, 6, 25), refused by both adaptive softmaxes)."""
    return sorted({max(1, c) for c in (V // 128, V // 16, V // 4)} - {V} if V > 1 else set())


def bench_options(impl: str, V: int) -> dict:
    """Per-method settings used in the benchmark (and the quality run): a budget of
    negatives around V/32, capped at 8192, the paper defaults otherwise."""
    negatives = min(8192, max(64, V // 32))
    return {
        "sampled": {"num_samples": negatives},
        "nce": {"num_samples": negatives},
        "negative_sampling": {"num_samples": negatives},
        "adaptive": {"cutoffs": tuple(adaptive_cutoffs(V)), "div_value": 4.0},
        # Equal-mass classes make the rare-word classes huge under Zipf (6.6K members at
        # V=262K); square-root frequency binning bounds the largest class near sqrt(V).
        "class_based": {"bin_power": 0.5},
    }.get(impl, {})


PEER_FIELDS = ("cutoffs", "div_value", "head_bias")  # the adaptive options torch's layer takes


def peer_options(V: int, settings: dict) -> dict:
    """The torch peer's layout at V: adaptive's as this run sets it (a review, session 118:
    `--set adaptive.div_value=2.0` changed hpnlp's tails and not the peer's, unsaid)."""
    mine = {**bench_options("adaptive", V), **settings.get("adaptive", {})}
    return {k: mine[k] for k in PEER_FIELDS if k in mine}


def _zipf_targets(V: int, N: int, seed: int = 0) -> np.ndarray:
    p = 1.0 / np.arange(1, V + 1)
    return np.random.default_rng(seed).choice(V, size=N, p=p / p.sum()).astype(np.int32)


class _Tied(nn.Module):
    """An input embedding table for the layers that predict it (`vmf`)."""

    layer_cls: type
    vocab_size: int
    options: dict

    def setup(self):
        self.embed = nn.Embed(self.vocab_size, self.options.get("_width", 1))
        self.out = self.layer_cls(vocab_size=self.vocab_size, embed=self.embed,
                                  **{k: v for k, v in self.options.items() if k != "_width"})

    def loss(self, *args, **kw):
        return self.out.loss(*args, **kw)


def _layer(impl: str, V: int, options: dict, width: int):
    cls = softmax_lib.get(impl)
    kw = dict(options)
    if "counts" in cls.__dataclass_fields__:
        kw["counts"] = softmax_lib.Frequencies.zipf(V)
    if impl == "vmf":  # needs the (tied) input embedding it predicts
        return _Tied(cls, V, {**kw, "_width": width})
    return cls(vocab_size=V, **kw)


def measure(spec: dict) -> dict:
    """One (method, V) configuration; runs in the calling process."""
    impl, V, N, E = spec["impl"], spec["V"], spec["N"], spec["E"]
    out = {"impl": impl, "V": V, "status": "ok"}
    targets = _zipf_targets(V, N)
    hidden = np.random.default_rng(1).standard_normal((N, E)).astype(np.float32)
    if impl == TORCH_ADAPTIVE:
        torch = harness.torch_or_none()
        if torch is None:
            return {**out, "status": "skipped: torch not installed (pip install -e '.[bench]')"}
        device = harness.torch_device(torch)
        o = spec["options"]  # adaptive's own (`peer_options`)
        asm = torch.nn.AdaptiveLogSoftmaxWithLoss(
            E, V, list(o.get("cutoffs") or adaptive_cutoffs(V)),
            div_value=float(o.get("div_value", 4.0)),
            head_bias=bool(o.get("head_bias", False))).to(device)
        h = torch.from_numpy(hidden).to(device).requires_grad_()
        t = torch.from_numpy(targets.astype(np.int64)).to(device)

        def call():  # fresh gradients, as jax's (`.backward()` added h's into h.grad)
            return torch.autograd.grad(asm(h, t).loss, [h, *asm.parameters()],
                                       allow_unused=True)  # a tail no target reached

        t, peak = harness.time_torch(torch, device, call, repeats=spec["repeats"], warmup=1,
                                     min_time_s=0.3)
        out["time"], out["torch_device"] = t.as_dict(), device
        if peak is not None:
            out["peak_device_bytes"] = peak
    else:
        layer = _layer(impl, V, spec["options"], E)
        t_N = jnp.asarray(targets)
        rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
        params = jax.jit(lambda h: layer.init(rngs, h, t_N[:8], None, method="loss",
                                              deterministic=False))(jnp.asarray(hidden[:8]))

        def step(params, h_NE, key):
            def loss(params, h_NE):
                l_N = layer.apply(params, h_NE, t_N, None, method="loss", deterministic=False,
                                  rngs={"dropout": key})
                return jnp.mean(l_N)
            return jax.grad(loss, argnums=(0, 1))(params, h_NE)

        args = (params, jnp.asarray(hidden), jax.random.key(2))
        t = harness.time_jax(step, *args, repeats=spec["repeats"], warmup=1, min_time_s=0.3,
                             max_time_s=spec.get("max_time_s"))
        out["compiled_memory"], out["time"] = t.memory, t.as_dict()
    if impl == REFERENCE:
        out["gflops"] = 6.0 * N * V * E / out["time"]["median_s"] / 1e9
    out["peak_rss_bytes"] = harness.peak_rss_bytes()
    if harness.on_accelerator() and "peak_device_bytes" not in out:
        out["peak_device_bytes"] = harness.peak_device_bytes()  # this process's: isolate
    return out


def _estimated_bytes(impl: str, V: int, N: int, E: int) -> float:
    """Rough peak, to report what cannot fit instead of crashing the machine. (`full` and
    `hard_negative` score every id, but in token chunks: their O(N x V) is time, not memory.)"""
    return 4.0 * V * E * 4  # params, gradient and two working copies


def default_vocabs(quick: bool) -> list[int]:
    """The vocabulary sizes timed where --vocabs is not given."""
    return [8192, 32768] if quick else [32768, 262144, 1048576]


def parse_settings(items: list[str], methods: list[str] | None = None,
                   vocabs: list[int] | None = None) -> dict:
    """`--set METHOD.FIELD=VALUE` items as {method: {field: value}}: VALUE is a Python literal
    (`adaptive.chunk_logits=67108864`, `adaptive.div_value=2.0`), FIELD one of the output
    layer's options; errors name the item and what is allowed. With `vocabs`, each layer given
    settings is also built (not compiled) at each V with them and the bench's own options, so
    a value no V takes (`adaptive.div_value=-1`) is refused here, not in each row after the
    run (a bug hunt, session 97)."""
    out: dict = {}
    given: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        method, dot, field = name.partition(".")
        if not (sep and dot and method and field):
            raise harness.BenchInputError(f"--set {item!r}: write METHOD.FIELD=VALUE, e.g. "
                                          "adaptive.chunk_logits=67108864")
        # the reference is timed whatever `methods` names (a review, session 118: its
        # settings were refused beside --methods without it)
        timed = [REFERENCE, *[m for m in methods if m != REFERENCE]] if methods else None
        if method not in softmax_lib.names() or (timed and method not in timed):
            raise harness.BenchInputError(
                f"--set {item!r}: {method!r} is not a timed output layer here; choose "
                f"from {timed or softmax_lib.names()}")
        try:
            v = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise harness.BenchInputError(
                f"--set {item!r}: {value!r} is not a Python literal (a number, a "
                "quoted string, True/False, a tuple)") from None
        try:  # a bug hunt (session 95): a value of the wrong kind failed each row alone
            checks.check_options("output.options", {field: v}, softmax_lib.get(method),
                                 model_set=BENCH_SET)
        except ConfigError as e:
            raise harness.BenchInputError(f"--set {item!r}: {e}") from None
        if (method, field, v) == ("adaptive", "cutoffs", None):  # the peer's need them
            raise harness.BenchInputError(
                f"--set {item!r}: the {TORCH_ADAPTIVE} peer is built with adaptive's cutoffs, "
                "and None leaves them to the layer's counts; give them (a tuple), or leave "
                "the bench's own")
        out.setdefault(method, {})[field] = v
        given.setdefault(method, []).append(item)
    for method, options in out.items():
        for V in vocabs or ():
            try:
                _build(method, V, {**bench_options(method, V), **options})
            except (ValueError, TypeError) as e:  # ConfigError too; a dtype jnp cannot read
                raise harness.BenchInputError(
                    f"--set {' '.join(given[method])}: {method} at V={V}: {e}") from None
    return out


def _build(impl: str, V: int, options: dict) -> None:
    """Output layer `impl` at V with `options`, checked as a model config checks it and then
    set up (`init`) in shapes only: every setting it refuses raises its ValueError, and
    nothing is compiled or allocated."""
    softmax_lib.check_config(impl, options, vocab_size=V, frequency_sorted=True)
    layer = _layer(impl, V, options, 8)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    jax.eval_shape(lambda h, t: layer.init(rngs, h, t, None, method="loss", deterministic=False),
                   jax.ShapeDtypeStruct((2, 8), jnp.float32),
                   jax.ShapeDtypeStruct((2,), jnp.int32))


def run(out_dir: str, *, quick: bool, isolate: bool | None = None, methods: list[str] | None = None,
        vocabs: list[int] | None = None, settings: dict | None = None) -> dict:
    """Time every method (and PyTorch's adaptive softmax) at each V; `settings` ({method:
    {field: value}}, see `parse_settings`) override the methods' bench options."""
    N, E = (1024, 128) if quick else (8192, 512)
    vocabs = vocabs or default_vocabs(quick)
    repeats = 3 if quick else 5
    isolate = (not quick) if isolate is None else isolate
    # the reference timed too, whatever `methods` names: every speedup is against it (a bug
    # hunt, session 101: methods=["sampled"] drew the notebook's speedup plot empty, unsaid)
    names = ([REFERENCE] + [m for m in methods if m != REFERENCE] if methods
             else softmax_lib.names())
    unknown = [m for m in names if m not in softmax_lib.names() and m != TORCH_ADAPTIVE]
    if unknown:
        raise harness.BenchInputError(
            f"unknown output layer(s) {unknown}; choose from {softmax_lib.names()}")
    impls = [m for m in names if m != TORCH_ADAPTIVE] + [TORCH_ADAPTIVE]
    harness.full_float32_on_gpu()
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    rates = harness.ceiling_rates(quick=quick)
    settings = settings or {}
    configs = [dict(impl=i, V=V, N=N, E=E, repeats=repeats, max_time_s=120.0,
                    options=(peer_options(V, settings) if i == TORCH_ADAPTIVE else
                             {**bench_options(i, V), **settings.get(i, {})}))
               for V in vocabs for i in impls]
    def head(spec):
        return {"impl": spec["impl"], "V": spec["V"], "options": spec["options"]}

    def row(spec):
        skip = harness.too_big(_estimated_bytes(spec["impl"], spec["V"], N, E), 0.7)
        if skip:
            return {**head(spec), "status": skip}
        return harness.measure_row("hpnlp.bench.softmax", measure, spec, head(spec),
                                   isolate=isolate, own_peak=spec["impl"] == TORCH_ADAPTIVE)

    results, interrupted = harness.run_rows(configs, row, head, desc="softmax bench")
    payload = {"benchmark": "softmax", "machine": info, "matmul_gflops": rates,
               "shape": {"N": N, "E": E}, "isolated": isolate, "interrupted": interrupted,
               "results": results}
    out_dir = harness.report_dir(out_dir, interrupted)
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    payload["summary"] = _summarize(payload, out_dir)
    report.write(out_dir, "softmax", payload, _markdown(payload))
    return payload


def _get(results, impl, V):
    for r in results:
        if r["impl"] == impl and r["V"] == V and r.get("status") == "ok":
            return r
    return None


def _summarize(payload: dict, out_dir: str) -> dict:
    res = payload["results"]
    impls = list(dict.fromkeys(r["impl"] for r in res))
    vocabs = sorted({r["V"] for r in res})
    speedup, vs_torch, series, mem = {}, {}, {}, {}
    for impl in impls:
        times = [(_get(res, impl, V) or {}).get("time", {}).get("median_s") for V in vocabs]
        series[impl] = (vocabs, times)
        mem[impl] = (vocabs, [((_get(res, impl, V) or {}).get("compiled_memory", {}).get("total_bytes")
                               or 0) / 2**20 or None for V in vocabs])
        for V, t in zip(vocabs, times):
            ref, peer = _get(res, REFERENCE, V), _get(res, TORCH_ADAPTIVE, V)
            if t and ref:
                speedup.setdefault(impl, {})[V] = ref["time"]["median_s"] / t
            if t and peer:
                vs_torch.setdefault(impl, {})[V] = peer["time"]["median_s"] / t
    shape = payload["shape"]
    peak = payload["matmul_gflops"]["float32"] * 1e9
    exps = report.scaling_plot(
        os.path.join(out_dir, "softmax_time.png"), series, xlabel="vocabulary size V",
        ylabel="seconds per step (median)",
        title=f"output layer forward+backward, N={shape['N']} tokens, E={shape['E']}",
        ceiling=(vocabs, [6.0 * shape["N"] * V * shape["E"] / peak for V in vocabs]),
        ceiling_label="full softmax FLOPs at this machine's matmul rate")
    report.scaling_plot(os.path.join(out_dir, "softmax_memory.png"), mem, xlabel="vocabulary size V",
                        ylabel="MiB (compiled)", title="output layer forward+backward memory")
    return {"speedup_vs_full": speedup, "speedup_vs_torch_adaptive": vs_torch, "exponents": exps}


def _markdown(payload: dict) -> str:
    res, shape, summ = payload["results"], payload["shape"], payload["summary"]
    peak = payload["matmul_gflops"]["float32"]
    peak_key, peak_col, peak_what = report.peak_memory(payload["machine"], payload["isolated"])
    parts = [report.header_md(payload["machine"], payload["matmul_gflops"]), "",
             f"One output-layer training step (loss forward + backward w.r.t. parameters and "
             f"hidden states), N={shape['N']} tokens, E={shape['E']}, float32, Zipf-distributed "
             f"targets. Times: median (min–max) ms. Speedups are against `{REFERENCE}` (and "
             f"`{TORCH_ADAPTIVE}`) at the same V in this run. Memory: compiled executable, and "
             f"{peak_what}.",
             ""]
    for V in sorted({r["V"] for r in res}):
        rows = []
        for r in (r for r in res if r["V"] == V):
            t = r.get("time")
            g = r.get("gflops")
            opts = ", ".join(f"{k}={v}" for k, v in (r.get("options") or {}).items())
            rows.append([f"`{r['impl']}`" + (f" ({opts})" if opts else ""),
                         f"{report.fmt(t['median_s'], 'ms')} ({report.fmt(t['min_s'], 'ms')}–"
                         f"{report.fmt(t['max_s'], 'ms')})" if t else r.get("status", "–"),
                         report.fmt(summ["speedup_vs_full"].get(r["impl"], {}).get(V), "x"),
                         report.fmt(summ["speedup_vs_torch_adaptive"].get(r["impl"], {}).get(V), "x"),
                         report.fmt(r.get("compiled_memory", {}).get("total_bytes"), "MiB"),
                         report.fmt(r.get(peak_key), "MiB"),
                         f"{g:.1f} ({100 * g / peak:.0f}%)" if g else "–"])
        parts += [f"### V = {V}", "", report.table(
            ["method", "step ms", f"speedup vs `{REFERENCE}`", "vs torch adaptive", "compiled MiB",
             peak_col, "GFLOP/s (% of matmul)"], rows), ""]
    parts += ["### Scaling with V", "", report.table(
        ["method", "time ~ V^k"], [[f"`{i}`", f"{e:.2f}" if e is not None else "–"]
                                    for i, e in summ["exponents"].items()]), "",
        "Plots: `softmax_time.png`, `softmax_memory.png`."]
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hpnlp.bench import quality
    p.add_argument("--methods", type=harness.names_from(lambda: [*softmax_lib.names(), TORCH_ADAPTIVE]),
                   default=None, help="comma-separated output layers (default: all); "
                   f"{TORCH_ADAPTIVE} is timed beside them always, the peer of the report's "
                   "`vs torch adaptive` column")
    p.add_argument("--vocabs", type=harness.positive_ints("8192,32768"), default=None,
                   help="comma-separated vocabulary sizes (default: 32768,262144,1048576; "
                   "8192,32768 with --quick)")
    harness.add_isolate_flag(p)
    p.add_argument("--set", action="append", default=[], metavar="METHOD.FIELD=VALUE",
                   help="override an output layer's option for the timing run (repeatable), "
                        "e.g. adaptive.chunk_logits=67108864")
    p.add_argument("--quality", action="store_true",
                   help="instead: train the word LM with each method for equal time, exact perplexity")
    p.add_argument("--seconds", type=harness.positive_number(float), default=None,
                   help="--quality: training seconds per method (default 240, 10 with --quick)")
    p.add_argument("--tokenizers", type=harness.names_from(quality.TOKENIZERS), default=None,
                   help="--quality: comma-separated parts, words and/or bpe (V = 32000; default: both)")


def check_args(args) -> None:
    """Flags of one mode given to the other (they would be ignored) and --set items, before
    any work."""
    if args.quality:
        given = [f for f, v in (("--set", args.set), ("--vocabs", args.vocabs),
                                ("--no-isolate", args.no_isolate)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} change the timing run; --quality trains with each "
                             f"layer's defaults (drop {', '.join(given)})")
        if args.methods and TORCH_ADAPTIVE in args.methods:
            raise ValueError(f"--methods: --quality trains hpnlp's layers only (drop {TORCH_ADAPTIVE})")
        return
    given = [f for f, v in (("--seconds", args.seconds), ("--tokenizers", args.tokenizers)) if v]
    if given:
        raise ValueError(f"{', '.join(given)} set the --quality run; add --quality or drop them")
    try:
        parse_settings(args.set, args.methods, args.vocabs or default_vocabs(args.quick))
    except SystemExit as e:
        raise ValueError(str(e)) from None


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --methods, --vocabs or --tokenizers
    leaving out rows it has, or --quality's --seconds fewer than it trained (a bug hunt,
    session 102: `--quality --methods full --seconds 3` replaced the recorded report; the
    recorded runs' own commands give --seconds 90, --vocabs, --methods, so no fixed value
    is the full one); --no-isolate where the timing run was measured isolated (review r12:
    the V = 262144 block lost its peak RSS column)."""
    from hpnlp.bench import quality
    rows = [r for r in held.get("results") or () if isinstance(r, dict)]
    flags = []
    if args.quality:
        methods = [REFERENCE, *args.methods] if args.methods else softmax_lib.names()
        seconds = args.seconds or quality.default_seconds(args.quick)
        if isinstance(held.get("seconds"), (int, float)) and seconds < held["seconds"]:
            flags.append(f"--seconds {seconds:g}")
        given = (("methods", methods, "method"),
                 ("tokenizers", args.tokenizers or list(quality.TOKENIZERS), "tokenizer"))
    else:
        methods = ([REFERENCE, TORCH_ADAPTIVE, *args.methods] if args.methods
                   else [*softmax_lib.names(), TORCH_ADAPTIVE])
        given = (("methods", methods, "impl"),
                 ("vocabs", args.vocabs or default_vocabs(args.quick), "V"))
        if args.no_isolate and held.get("isolated") is True:
            flags.append("--no-isolate")
    for flag, this, key in given:  # rows recorded before `bpe` are of words
        if {r.get(key, "words" if key == "tokenizer" else None) for r in rows} - {None, *this}:
            flags.append(f"--{flag} {','.join(map(str, getattr(args, flag) or this))}")
    return flags


def main(args) -> dict:
    methods = args.methods
    if args.quality:
        from hpnlp.bench import quality
        payload = quality.run(args.out, quick=args.quick, methods=methods,
                              seconds=args.seconds, tokenizers=args.tokenizers)
        harness.exit_if_interrupted(payload["interrupted"], args.out)
        return payload
    payload = run(args.out, quick=args.quick, isolate=False if args.no_isolate else None,
                  methods=methods, vocabs=args.vocabs, settings=parse_settings(args.set, methods))
    harness.exit_if_interrupted(payload["interrupted"], args.out)
    return payload


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
