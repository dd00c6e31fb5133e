"""`python -m hpnlp.bench quant`: quantized products, decoding and models against float32.

Three parts, in one run on this CPU:

1. One linear layer [M tokens, K -> N] (full: 2048, 1024 -> 4096): float32 and bfloat16
   XLA products, the w8a8 product in XLA (int8 x int8 -> int32 `dot_general`, the
   kernel's twin) and as hpnlp's int8 kernel, the binary (XNOR-popcount) and int4
   weight-only products in XLA and as kernels, and, when torch is installed, PyTorch's
   float32 `nn.Linear` and `torch.ao.quantization.quantize_dynamic` int8 Linear on the
   same shape. Median time (interleaved rounds), GOP/s and its fraction of this machine's
   float32 matrix-product rate measured in the same run.
2. A width-512, depth-4 byte LM (random weights: speed only): decoding tokens/s at batch
   1 and 16 with the KV cache (`hpnlp.models.generate`) and the forward pass over
   [4, 512] tokens (prefill), for float32, bfloat16, w8a8 (int8 kernel, per-token
   activations) and int4 weight-only (int4 kernel, groups of 128), all attending with
   `chunked` (the flash-attention CPU kernel); each measurement
   timed in interleaved rounds across the four variants (medians).
3. Quality: the default byte LM (experiments/lm.py) and the text classifier
   (experiments/lra.py:text at 256 bytes) trained in float32, then PTQ bfloat16, w8, w8a8
   (static percentile ranges), int4 (groups of 32), and QAT runs for int4, ternary,
   binary and pow2 weights, each packed with `python -m hpnlp.compress quantize`: eval
   metric, size (each packed model's quantized.npz, not its few-KB quant.json; the float32
   row's is its parameters at 4 bytes each, no file), forward time (hpnlp.compress.ptq's
   summary). The QAT runs fine-tune the trained float32 model (`train.init_from`) for a
   quarter of its steps at 0.3x its learning rate (`QAT_STEPS_FRAC`, `QAT_LR_FRAC`), as
   QAT is usually applied.

Targets (issue 20; `targets` in results.json): int8 kernel / float32 XLA >= 2.5
(`int8_kernel_vs_f32`), binary kernel / float32 >= 15 (`binary_kernel_vs_f32`), int8
kernel ahead of PyTorch's dynamic int8 (`int8_kernel_vs_torch` >= 1), int4 decoding at
batch 1 / float32 >= 2 (`int4_decode_vs_f32`), w8a8 forward at sequence 512 / float32
>= 2 (`w8a8_forward_vs_f32`), PTQ w8a8 of the byte LM within 1% of its float32 eval loss
(`w8a8_loss_rel_increase` <= 0.01), QAT int4 within 2% (`qat_int4_loss_rel_increase`).
`--quick` shrinks every part (seconds to a few minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import harness, report

SIZES = {
    "full": dict(M=2048, K=1024, N=4096, width=512, depth=4, heads=8, mlp=2048, decode_len=128,
                 prefill=(4, 512), lm_steps=None, cls_steps=600, cls_len=256, group=128),
    "quick": dict(M=64, K=128, N=256, width=64, depth=1, heads=2, mlp=128, decode_len=16,
                  prefill=(1, 32), lm_steps=12, cls_steps=12, cls_len=64, group=32),
}
PTQ = {  # name -> QuantConfig fields (None: the float switch)
    "PTQ bfloat16": None,
    "PTQ w8": dict(weights="int8"),
    "PTQ w8a8": dict(weights="int8", activations="int8", act_scale="static",
                     calibration="percentile"),
    "PTQ int4": dict(weights="int4", group_size=32),
}
QAT = {"QAT int4": dict(weights="int4", group_size=32), "QAT ternary": dict(weights="ternary"),
       "QAT binary": dict(weights="binary"), "QAT pow2": dict(weights="pow2")}


# ----------------------------------------------------------------------- 1. the layer

def _linear_calls(M: int, K: int, N: int, group: int) -> tuple[dict, dict]:
    """Zero-argument blocking callables per row, and each row's operation count."""
    from hpnlp.compress import formats, kernels, packing

    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (M, K), jnp.float32)
    w = jax.random.normal(k2, (K, N), jnp.float32) * K ** -0.5
    c8, s8 = formats.get("int8").encode(w, (0,))
    w8 = kernels.prepare_int8_weight(c8, s8[0])
    cb, sb = formats.get("binary").encode(w, (0,))
    wb = kernels.prepare_binary_weight(packing.pack_bits(cb), sb[0], k=K)
    c4, s4 = formats.get("int4").encode(w, (0,), group=group)
    w4 = kernels.prepare_int4_weight(packing.pack_int4(c4.reshape(K, N)), s4.reshape(-1, N), k=K)
    xb, wbf = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    jits = {
        "float32 (XLA)": (jax.jit(lambda a, b: a @ b), (x, w)),
        "bfloat16 (XLA)": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
                           (xb, wbf)),
        "int8 w8a8 (XLA)": (jax.jit(kernels.int8_linear_xla), (x, w8)),
        "int8 w8a8 (kernel)": (jax.jit(lambda a, b: kernels.int8_linear(a, b, impl="kernel")), (x, w8)),
        "binary (XLA)": (jax.jit(kernels.binary_linear_xla), (x, wb)),
        "binary (kernel)": (jax.jit(lambda a, b: kernels.binary_linear(a, b, impl="kernel")), (x, wb)),
        "int4 weight-only (XLA)": (jax.jit(kernels.int4_linear_xla), (x, w4)),
        "int4 weight-only (kernel)": (jax.jit(lambda a, b: kernels.int4_linear(a, b, impl="kernel")),
                                      (x, w4)),
    }
    calls = {}
    for name, (fn, args) in jits.items():
        compiled = fn.lower(*args).compile()
        calls[name] = (lambda c=compiled, a=args: jax.block_until_ready(c(*a)))
    torch = harness.torch_or_none()
    if torch is not None:
        lin = torch.nn.Linear(K, N, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(w).T.copy()))
        with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices (they
            # point to torchao, not installed here); this is still torch's own int8 Linear
            warnings.filterwarnings("ignore", message="torch.ao.quantization is deprecated")
            warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
            qlin = torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
        xt = torch.from_numpy(np.array(x))  # a writable copy: torch warns on a read-only one

        def run(m):
            with torch.no_grad():
                m(xt)
        calls["torch float32 Linear"] = lambda: run(lin)
        calls["torch quantize_dynamic int8 Linear"] = lambda: run(qlin)
    return calls, {name: 2.0 * M * K * N for name in calls}


def linear_rows(M: int, K: int, N: int, *, group: int, repeats: int, rate: float) -> list[dict]:
    calls, ops = _linear_calls(M, K, N, group)
    timed = harness.time_interleaved(calls, repeats=repeats, warmup=1, min_time_s=0.2)
    rows = []
    for name, (t, cpu) in timed.items():
        gops = ops[name] / t.median_s / 1e9
        rows.append({"impl": name, "M": M, "K": K, "N": N, "time": t.as_dict(), "cpu_s": cpu,
                     "gops": gops, "frac_of_f32_rate": gops / rate if rate else None})
    return rows


# ------------------------------------------------------------------ 2. LM decoding

def _lm_config(s: dict, quant: dict | None, dtype: str = "float32"):
    from hpnlp.config import QuantConfig, default_configdict, from_configdict, validate

    cd = default_configdict()
    cd.data.task, cd.data.seq_len = "byte_lm", s["prefill"][1]
    cd.model.update(kind="lm", width=s["width"], depth=s["depth"], num_heads=s["heads"],
                    mlp_dim=s["mlp"], max_len=max(s["prefill"][1], s["decode_len"]), dropout=0.0,
                    dtype=dtype, param_dtype=dtype)
    cd.output.tie_embeddings = True
    # every variant attends with `chunked` (hpnlp's exact flash-attention CPU kernel), the
    # fastest exact attention hpnlp has on CPU: what a user serving this LM would pick
    cd.attention.name = "chunked"
    cfg = from_configdict(cd)
    if quant:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quant=QuantConfig(**quant)))
    return validate(cfg, num_devices=1)


LM_VARIANTS = {"float32": (None, "float32"), "bfloat16": (None, "bfloat16"),
               "w8a8 (int8 kernel)": (dict(weights="int8", activations="int8"), "float32"),
               "int4 weight-only (int4 kernel)": (dict(weights="int4"), "float32")}


def lm_rows(s: dict, *, repeats: int) -> list[dict]:
    """Prefill and decoding speed of every variant in LM_VARIANTS. Each measurement is timed
    interleaved across the variants (`harness.time_interleaved`: a round calls every variant
    once, in turn; the median of the rounds), so the machine's drift over the minutes of the
    run falls on the float32 model and its quantized twins alike and their ratios stay fair
    (timed one variant after another, the float32 batch-1 decoding rate varied 221 to 289
    tokens/s between runs)."""
    from hpnlp import models
    from hpnlp.compress import ptq
    from hpnlp.models.generate import generate
    from hpnlp.train.loop import dummy_batch

    B, L = s["prefill"]
    n = s["decode_len"]
    base = None
    calls = {"prefill": {}, 1: {}, 16: {}}
    for name, (quant, dtype) in tqdm(LM_VARIANTS.items(), desc="LM variants", leave=False):
        if quant and quant["weights"] == "int4":
            quant = dict(quant, group_size=s["group"])
        cfg = _lm_config(s, quant, dtype)
        model = models.build(cfg, deterministic=True)
        batch = dummy_batch("lm", B, L)
        batch["inputs"] = np.asarray(jax.random.randint(jax.random.key(1), (B, L), 0, 256), np.int32)
        if base is None:  # one set of float32 weights for every variant
            base = jax.jit(lambda k: jax.tree.map(
                lambda p: p.unbox() if hasattr(p, "unbox") else p,
                model.init(k, batch)["params"], is_leaf=lambda p: hasattr(p, "unbox")))(jax.random.key(0))
        params = jax.tree.map(lambda p: p.astype(jnp.dtype(dtype)), base)
        if quant:
            params = ptq.serve(model, ptq.packed_params(model, params, batch), batch)
        prefill = jax.jit(lambda p, b, model=model: model.apply({"params": p}, b, method="log_probs"))
        calls["prefill"][name] = lambda f=prefill, p=params, b=batch: jax.block_until_ready(f(p, b))
        decode = jax.jit(lambda p, pr, pl, cfg=cfg: generate(cfg, p, pr, pl, length=n))
        for db in (1, 16):
            calls[db][name] = (lambda f=decode, p=params, pr=jnp.zeros((db, 1), jnp.int32),
                               pl=jnp.ones((db,), jnp.int32): jax.block_until_ready(f(p, pr, pl)))
    timed = {kind: harness.time_interleaved(c, repeats=repeats if kind != 16 else max(2, repeats // 2))
             for kind, c in tqdm(calls.items(), desc="LM timing", leave=False)}
    rows = []
    for name in LM_VARIANTS:
        prefill_s = timed["prefill"][name][0].median_s
        row = {"variant": name, "prefill_s": prefill_s, "prefill_tokens_per_s": B * L / prefill_s}
        for db in (1, 16):
            row[f"decode_b{db}_tokens_per_s"] = db * n / timed[db][name][0].median_s
        rows.append(row)
    return rows


# --------------------------------------------------------------------- 3. quality

def _experiment(kind: str, s: dict):
    """The byte LM (experiments/lm.py) or the text classifier (experiments/lra.py:text)."""
    if kind == "byte LM":
        cd = harness.experiment_module("lm.py").get_config("bytes")
        if s["lm_steps"]:
            cd.train.steps, cd.train.warmup_steps = s["lm_steps"], 2
            cd.train.eval_batches = 4
    else:
        cd = harness.experiment_module("lra.py").get_config("text")
        cd.data.seq_len = cd.model.max_len = s["cls_len"]
        cd.train.steps, cd.train.warmup_steps = s["cls_steps"], min(100, s["cls_steps"] // 5)
    cd.train.checkpoint_every = 0
    cd.train.eval_every = 0
    cd.train.progress = False
    return cd


# QAT as it is usually run: fine-tuning the trained float32 model with the quantizers in
# the forward pass, for a quarter of its steps at 0.3x its learning rate.
QAT_STEPS_FRAC, QAT_LR_FRAC = 0.25, 0.3


def _qat_experiment(kind: str, s: dict, float_dir: str):
    cd = _experiment(kind, s)
    cd.train.init_from = float_dir
    cd.train.steps = max(2, int(cd.train.steps * QAT_STEPS_FRAC))
    cd.train.warmup_steps = min(cd.train.warmup_steps, max(1, cd.train.steps // 10))
    cd.train.lr = cd.train.lr * QAT_LR_FRAC
    return cd


def quality_rows(s: dict, workdir: str) -> list[dict]:
    from hpnlp.bench.compress import _train as run  # a finished run of the same config is
    # reused, one of another config refused, one whose float run trained since trained anew
    # (a review, session 115: hpnlp.train.run resumed each, its float run unchecked)
    from hpnlp.compress import ptq
    from hpnlp.config import QuantConfig

    rows = []
    for model_name in ("byte LM", "text classifier"):
        tag = model_name.replace(" ", "_")
        float_dir = os.path.join(workdir, f"{tag}_float32")
        cd = _experiment(model_name, s)
        trained = run(cd, float_dir)
        metric = "loss"
        jobs = [(name, float_dir, q) for name, q in PTQ.items()]
        for name, q in QAT.items():
            qcd = _qat_experiment(model_name, s, float_dir)
            for k, v in q.items():
                setattr(qcd.quant, k, v)
            qdir = os.path.join(workdir, f"{tag}_{name.replace(' ', '_')}")
            run(qcd, qdir)
            jobs.append((name, qdir, q))
        first = None
        for name, src, q in tqdm(jobs, desc=f"{model_name}: quantize", leave=False):
            out = os.path.join(workdir, f"{tag}_{name.replace(' ', '_')}_packed")
            if q is None:
                summ = ptq.quantize(src, out, float_dtype="bfloat16")
            else:
                summ = ptq.quantize(src, out, QuantConfig(**q))
            if first is None:  # the float32 row, from the first summary's float side
                first = summ
                rows.append({"model": model_name, "variant": "float32", "task": trained["task"],
                             "eval": summ["eval"]["float32"],
                             "size_bytes": summ["size_bytes"]["float32_params"],
                             "forward_s": summ["forward"]["float32_s"], "loss_rel_increase": 0.0,
                             "accuracy": summ["eval"]["float32"].get("accuracy")})
            ref = first["eval"]["float32"][metric]
            rows.append({"model": model_name, "variant": name, "task": trained["task"],
                         "eval": summ["eval"]["quantized"], "size_bytes": summ["size_bytes"]["quantized_file"],
                         "forward_s": summ["forward"]["quantized_s"],
                         "forward_how": summ["forward"]["how"],
                         "loss_rel_increase": summ["eval"]["quantized"][metric] / ref - 1.0,
                         "accuracy": summ["eval"]["quantized"].get("accuracy")})
    return rows


# ------------------------------------------------------------------------- report

def _targets(linear: list[dict], lm: list[dict], quality: list[dict], parts=None) -> dict:
    """The targets of the `parts` run (None: all)."""
    t = {r["impl"]: r["time"]["median_s"] for r in linear}
    f32 = t.get("float32 (XLA)")
    lmv = {r["variant"]: r for r in lm}
    q = {(r["model"], r["variant"]): r for r in quality}
    get = lambda key: q[key]["loss_rel_increase"] if key in q else None  # noqa: E731
    dec = lambda v: lmv.get(v, {}).get("decode_b1_tokens_per_s")  # noqa: E731
    pre = lambda v: lmv.get(v, {}).get("prefill_s")  # noqa: E731
    return report.targets_of_parts(parts, {
        "linear": {
            "int8_kernel_vs_f32": report.target(report.ratio(f32, t.get("int8 w8a8 (kernel)")),
                                                2.5, ">="),
            "binary_kernel_vs_f32": report.target(report.ratio(f32, t.get("binary (kernel)")),
                                                  15.0, ">="),
            "int8_kernel_vs_torch": report.target(report.ratio(
                t.get("torch quantize_dynamic int8 Linear"), t.get("int8 w8a8 (kernel)")),
                1.0, ">=")},
        "lm": {
            "int4_decode_vs_f32": report.target(report.ratio(
                dec("int4 weight-only (int4 kernel)"), dec("float32")), 2.0, ">="),
            "w8a8_forward_vs_f32": report.target(report.ratio(
                pre("float32"), pre("w8a8 (int8 kernel)")), 2.0, ">=")},
        "quality": {
            "w8a8_loss_rel_increase": report.target(get(("byte LM", "PTQ w8a8")), 0.01, "<="),
            "qat_int4_loss_rel_increase": report.target(get(("byte LM", "QAT int4")), 0.02,
                                                        "<=")}})


def _markdown(p: dict) -> str:
    s = p["sizes"]
    out = [report.header_md(p["machine"], {"float32": p["f32_rate"]}), "",
           f"Kernel paths: {p['kernel_layout']}", "", f"Allocator: {p.get('malloc', '–')}"]
    # a part --parts left out has no table (a bug hunt, session 98: an empty one)
    if p["linear"]:
        out += ["", f"### Linear layer [{s['M']} tokens, {s['K']} -> {s['N']}]", "",
                report.table(["impl", "median ms", "GOP/s", "of f32 rate", "vs float32"], [
                    [r["impl"], report.fmt(r["time"]["median_s"], "ms"), f"{r['gops']:.1f}",
                     f"{r['frac_of_f32_rate']:.0%}" if r["frac_of_f32_rate"] else "–",
                     report.fmt(report.ratio(p["_f32_time"], r["time"]["median_s"]), "x")]
                    for r in p["linear"]])]
    if p["lm"]:
        out += ["", f"### LM decoding and prefill (width {s['width']}, depth {s['depth']}, "
                f"random weights)", "",
                report.table(["variant", f"prefill tok/s [{s['prefill'][0]}x{s['prefill'][1]}]",
                              "decode tok/s batch 1", "decode tok/s batch 16"], [
                    [r["variant"], f"{r['prefill_tokens_per_s']:.0f}",
                     f"{r['decode_b1_tokens_per_s']:.1f}", f"{r['decode_b16_tokens_per_s']:.1f}"]
                    for r in p["lm"]])]
    if p["quality"]:
        out += ["", "### Quality, size and speed of quantized models", "",
                report.table(["model", "variant", "eval loss", "accuracy", "loss vs float32",
                              "size KiB", "forward ms"], [
                    [r["model"], r["variant"], f"{r['eval']['loss']:.4f}",
                     f"{r['accuracy']:.4f}" if r.get("accuracy") is not None else "–",
                     f"{r['loss_rel_increase']:+.2%}", f"{r['size_bytes'] / 1024:.0f}",
                     report.fmt(r["forward_s"], "ms")] for r in p["quality"]])]
    out += ["", report.targets_md(p.get("targets"), p.get("quick"))]
    return "\n".join(out)


PARTS = ("linear", "lm", "quality")
WORKDIR_PARTS = ("quality",)  # the parts that keep runs in --workdir
REPEATS = 7  # a full run's timing repeats per row


def less_than(args, held: dict) -> list[str]:
    """The flags that make this run less than the report `held` in --out (`python -m
    hpnlp.bench` then refuses it, as it does --quick): --repeats fewer than it timed (its
    `repeats`; `REPEATS` for a report older than that record). A review (session 107): `--repeats 1`
    replaced the recorded report, its LM rows and their targets one call over one call."""
    had = held.get("repeats")
    had = had if isinstance(had, int) and not isinstance(had, bool) else REPEATS
    return [f"--repeats {args.repeats}"] if args.repeats and args.repeats < had else []


def run(out_dir: str, *, quick: bool, repeats: int | None = None, parts=PARTS,
        workdir: str | None = None) -> dict:
    from hpnlp import kernels as kernel_build
    from hpnlp.compress import kernels

    # stamped at the start, as every other bench's (a bug hunt, session 102: it read the end)
    info = harness.machine_info()
    # Every row, XLA's float32 included, runs with freed buffers kept mapped (as a serving
    # process with tcmalloc would): otherwise each call page-faults its [M, N] output in
    # again, a fixed cost that hides what the products themselves take.
    reuse = kernel_build.reuse_freed_memory()
    s = SIZES["quick" if quick else "full"]
    repeats = repeats or (3 if quick else REPEATS)
    rate = harness.matmul_rate(jnp.float32, n=256 if quick else 2048)
    linear = linear_rows(s["M"], s["K"], s["N"], group=s["group"], repeats=repeats,
                         rate=rate) if "linear" in parts else []
    lm = lm_rows(s, repeats=repeats) if "lm" in parts else []
    quality = []
    if "quality" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            quality = quality_rows(s, workdir or tmp)
    payload = {"sizes": s, "repeats": repeats, "machine": info, "f32_rate": rate,
               "malloc": "freed buffers reused (hpnlp.kernels.reuse_freed_memory)" if reuse
               else "the C library's default",
               "kernel_layout": kernels.layout() if kernels.available() else kernels.unavailable_reason(),
               "linear": linear, "lm": lm, "quality": quality,
               # the parts it ran, in its own payload (a review, session 116: only the CLI's
               # wrapper wrote them, so a call from Python read as a whole run)
               "parts": list(parts)}
    report.targets_unless_quick(payload, quick, lambda: _targets(linear, lm, quality, parts))
    payload["_f32_time"] = next((r["time"]["median_s"] for r in linear if r["impl"] == "float32 (XLA)"),
                                None)
    report.write(out_dir, "quant", payload, _markdown(payload))
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=harness.positive_number(int), default=None,
                   help=f"timing repeats per row (default {REPEATS}, 3 with --quick)")
    p.add_argument("--parts", type=harness.names_from(PARTS), default=list(PARTS),
                   help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--workdir", default=None, help="keep the quality runs' workdirs here")


def main(args) -> dict:
    return run(args.out, quick=args.quick, repeats=args.repeats, parts=tuple(args.parts),
               workdir=args.workdir)
