"""`python -m hpnlp.bench gqa`: grouped-query and multi-query attention (`model.num_kv_heads`)
and multi-head latent attention (`model.kv_latent_dim`) against multi-head attention, in one
run on this CPU: decoding speed and the key/value cache, then quality trained from scratch
(and, for grouped heads, uptrained).

1. Decoding (`decode`): a byte LM of width 512, 4 blocks, 8 heads of 64, MLP 2048 and 1024
   positions (random weights: speed does not depend on them) generates from a 16-byte
   prompt to its 1024 positions (`hpnlp.models.generate`, greedy, the prompt prefilled in
   one call, then one token a step through the exact key/value cache and its CPU kernel),
   at batch 1 and 16, with 8 (multi-head), 4, 2 and 1 (multi-query) key/value heads, and
   with latents of 256 and 128 dims (the caches of 2 and 1 key/value heads; the latent is
   read absorbed, every head's query against the one cached row). Each batch's calls are
   timed interleaved (`harness.time_interleaved`). Reported: new tokens/s, the speed-up over
   multi-head at the same batch, the cache's size and the parameters.
2. Quality (`quality`): the default byte LM (experiments/lm.py: 4 heads of 32, 800 steps)
   trained with 4 (multi-head), 2 and 1 key/value heads and with latents of 128 and 64 dims
   (the caches of 2 and 1 key/value heads), with the latent's layer norm and without it
   (`model.kv_latent_norm`, off in the conversions below); and the multi-head run uptrained
   (Ainslie et al. 2023, `hpnlp.compress.gqa`: each group's key and value heads mean-pooled,
   then `uptrain_steps` more steps, 5% of its 800 as in the paper, at the run's learning rate
   3e-3 and at a tenth of it, each with the schedule's warmup and cosine decay) to 2 and 1,
   with each pooled model's eval loss before those steps too; the same with each group's
   heads fitted by SVD instead of averaged (`train.init_kv_heads='svd'`: the group's key
   and value weights at rank D, the rest folded into queries and output projection); the
   multi-head run itself trained the same steps at the same rates (the control: what the
   steps alone give); and the multi-head run converted into each latent (MHA2MLA, Ji et
   al. 2025, `hpnlp.compress.mla`: the joint truncated SVD of each block's key and value
   weights, the latent without its layer norm), then trained the same steps at the same
   rates. The SVD fits run twice: on the weights alone, and weighted by the attention
   inputs of `calib_batches` (8) training batches (`train.init_kv_calibration`).
   Reported: eval loss and its change against multi-head, parameters.

The runs train in --workdir (a finished run of the same config is reused).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import compress, harness, report

SIZES = {
    "full": dict(decode=dict(width=512, depth=4, num_heads=8, mlp_dim=2048, max_len=1024),
                 prompt=16, batches=(1, 16), decode_kv=(8, 4, 2, 1), decode_latent=(256, 128),
                 repeats=5, lm_steps=None, uptrain_steps=40, uptrain_lrs=(3e-3, 3e-4),
                 calib_batches=8,
                 quality_kv=(4, 2, 1), quality_latent=(128, 64), eval_batches=None),
    "quick": dict(decode=dict(width=64, depth=1, num_heads=4, mlp_dim=128, max_len=64),
                  prompt=4, batches=(1, 4), decode_kv=(4, 2, 1), decode_latent=(32,), repeats=2,
                  lm_steps=12, uptrain_steps=4, uptrain_lrs=(3e-3,), calib_batches=2,
                  quality_kv=(4, 2, 1),
                  quality_latent=(64,), eval_batches=2),
}
PARTS = ("decode", "quality")
WORKDIR_PARTS = ("quality",)  # the parts that keep runs in --workdir


def _kv_name(G: int, H: int, latent: int = 0) -> str:
    if latent:
        return f"multi-head latent, {latent} dims"
    return "multi-head" if G == H else "multi-query" if G == 1 else f"grouped, {G} groups"


def _config(model: dict, G: int, *, steps: int | None = None, eval_batches: int | None = None,
            kv_cache: str = "none", latent: int = 0):
    """experiments/lm.py's byte LM with `model`'s fields, G key/value heads, the key/value
    cache `kv_cache` (quant.kv_cache) and a latent of `latent` dims (model.kv_latent_dim)."""
    cd = compress.experiment("byte LM", dict(lm_steps=steps, eval_batches=eval_batches))
    cd.model.update(model)
    cd.data.seq_len = min(cd.data.seq_len, cd.model.max_len)
    cd.model.num_kv_heads = 0 if G == cd.model.num_heads else G
    cd.model.kv_latent_dim = latent
    cd.quant.kv_cache = kv_cache
    return cd


def cache_bytes(m: dict, B: int, G: int, kv_cache: str = "none", latent: int = 0) -> int:
    """The decode cache's bytes: keys and values of every block (or, with a latent, its row
    of `latent` numbers, keys and values both), float32 or int8 codes with a float32 scale
    per position and head (row)."""
    D = m["width"] // m["num_heads"]
    if latent:
        return m["depth"] * B * m["max_len"] * (latent + 4 if kv_cache == "int8" else 4 * latent)
    per_head = D + 4 if kv_cache == "int8" else 4 * D
    return 2 * m["depth"] * B * m["max_len"] * G * per_head


def decode_rows(s: dict, variants=None) -> list[dict]:
    """Greedy `generate` timed interleaved per batch, for each (key/value heads, kv_cache) or
    (key/value heads, kv_cache, latent dims) of `variants` (default: s["decode_kv"], then
    s["decode_latent"], with the float cache); the speed-up is over the first variant at the
    same batch."""
    import flax.linen as nn

    from hpnlp import models
    from hpnlp.config import from_configdict, validate
    from hpnlp.train.loop import dummy_batch

    m = s["decode"]
    H, T = m["num_heads"], m["max_len"]
    variants = [(*v, 0)[:3] for v in variants or [(G, "none") for G in s["decode_kv"]] + [
        (H, "none", C) for C in s.get("decode_latent", ())]]
    rng = np.random.default_rng(0)
    built = {}
    for G, kv_cache, latent in variants:
        cfg = validate(from_configdict(_config(m, G, kv_cache=kv_cache, latent=latent)))
        model = models.build(cfg, deterministic=True)
        params = jax.jit(lambda k, model=model: nn.unbox(model.init(
            k, dummy_batch("lm", 1, cfg.data.seq_len))["params"]))(jax.random.key(0))
        built[G, kv_cache, latent] = (cfg, params)
    rows = []
    for B in s["batches"]:
        prompt = rng.integers(0, 256, (B, s["prompt"])).astype(np.int32)
        calls = {}
        for key, (cfg, params) in built.items():
            fn = jax.jit(lambda p, pr, cfg=cfg: models.generate(cfg, p, pr, length=T, greedy=True))
            calls[key] = lambda fn=fn, p=params: jax.block_until_ready(fn(p, prompt))
        times = harness.time_interleaved(calls, repeats=s["repeats"])
        for (G, kv_cache, latent), (timing, cpu) in times.items():
            cfg, params = built[G, kv_cache, latent]
            new = B * (T - s["prompt"])
            rows.append({"batch": B, "kv_heads": G, "heads": H,
                         "attention": _kv_name(G, H, latent), "kv_cache": kv_cache,
                         "kv_latent_dim": latent,
                         "tokens_per_s": new / timing.median_s, "seconds": timing.median_s,
                         "seconds_min": timing.min_s, "seconds_max": timing.max_s,
                         "cpu_seconds": cpu, "compile_s": timing.compile_s,
                         "cache_bytes": cache_bytes(m, B, G, kv_cache, latent),
                         "params": sum(x.size for x in jax.tree.leaves(params))})
        base = next(r for r in rows if r["batch"] == B)
        for r in rows:
            if r["batch"] == B:
                r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def _pooled_eval(cd, workdir: str) -> dict:
    """Eval metrics of the model `cd` starts as (its `train.init_from` pooled), untrained."""
    from hpnlp.config import from_configdict
    from hpnlp.train import Trainer
    tr = Trainer(from_configdict(cd), workdir)
    state, _ = tr.initial_state()
    out = tr.evaluate(state)
    tr.checkpointer.close()
    return out


def quality_rows(s: dict, workdir: str) -> list[dict]:
    rows = []
    H = compress.experiment("byte LM", dict(lm_steps=None, eval_batches=None)).model.num_heads
    mha_dir = os.path.join(workdir, f"kv{H}")
    latents = s.get("quality_latent", ())
    bar = tqdm(total=len(s["quality_kv"]) + 2 * len(latents)
               + (3 * len(s["quality_kv"]) - 2 + 2 * len(latents)) * len(s["uptrain_lrs"]),
               desc="gqa quality", leave=False)
    # from scratch: each key/value head count, each latent with its layer norm and without
    # (as the conversions below have it)
    for G, latent, norm in ([(G, 0, True) for G in s["quality_kv"]]
                            + [(H, C, True) for C in latents] + [(H, C, False) for C in latents]):
        cd = _config({}, G, steps=s["lm_steps"], eval_batches=s["eval_batches"], latent=latent)
        cd.model.kv_latent_norm = norm
        out = os.path.join(workdir, (f"latent{latent}" + ("" if norm else "_no_norm")) if latent
                           else f"kv{G}")
        summary = compress._train(cd, out)
        rows.append({"method": "from scratch", "kv_heads": G, "heads": H, "kv_latent_dim": latent,
                     "attention": _kv_name(G, H, latent) + ("" if norm else ", no norm"),
                     "steps": summary["final_step"], "params": summary["param_count"],
                     "loss": summary["eval"]["loss"]})
        bar.update()
    # from the multi-head run: itself (the control: what the extra steps alone give), its
    # key/value heads averaged or fitted by SVD per group, or converted into a latent
    # (the SVD fits also weighted by the inputs of `calib_batches` training batches)
    fewer, n = [G for G in s["quality_kv"] if G < H], s["calib_batches"]
    for G, latent, init, calib in (
            [(H, 0, "mean", 0)] + [(G, 0, "mean", 0) for G in fewer]
            + [(G, 0, "svd", c) for c in (0, n) for G in fewer]
            + [(H, C, "", c) for c in (0, n) for C in latents]):
        pooled = None
        for lr in s["uptrain_lrs"]:
            cd = _config({}, G, steps=s["uptrain_steps"], eval_batches=s["eval_batches"],
                         latent=latent)
            cd.model.kv_latent_norm = not latent  # converted: the latent's norm off (mla)
            cd.train.init_from = mha_dir
            cd.train.init_kv_calibration = calib
            if G < H:
                cd.train.init_kv_heads = init
            cd.train.warmup_steps = max(1, s["uptrain_steps"] // 10)
            cd.train.lr = lr
            if pooled is None:
                with tempfile.TemporaryDirectory() as tmp:
                    pooled = _pooled_eval(cd, tmp)
            name = (f"uptrain_latent{latent}" if latent else f"uptrain_kv{G}"
                    + ("_svd" if init == "svd" else "")) + (f"_calib{calib}" if calib else "")
            summary = compress._train(cd, os.path.join(workdir, f"{name}_lr{lr:g}"))
            fit = f"SVD, {calib} batches" if calib else "SVD"
            how = (f"converted ({fit})" if latent else "continued" if G == H
                   else f"uptrained ({fit})" if init == "svd" else "uptrained")
            rows.append({"method": f"{how} from multi-head, lr {lr:g}", "kv_heads": G,
                         "kv_latent_dim": latent, "heads": H,
                         "attention": _kv_name(G, H, latent) + (", no norm" if latent else ""),
                         "steps": summary["final_step"], "params": summary["param_count"],
                         "loss": summary["eval"]["loss"], "loss_pooled": pooled["loss"]})
            bar.update()
    bar.close()
    base = next(r["loss"] for r in rows if r["kv_heads"] == H and not r["kv_latent_dim"])
    for r in rows:
        r["loss_vs_multi_head"] = r["loss"] - base
    return rows


def decode_intro(p: dict, baseline: str) -> list[str]:
    """The decoding table's heading and what it timed; speed-ups are over `baseline`."""
    d = p["sizes"]["decode"]
    return ["### Decoding", "",
            f"Byte LM of width {d['width']}, {d['depth']} blocks, {d['num_heads']} heads of "
            f"{d['width'] // d['num_heads']}, MLP {d['mlp_dim']}, random weights; "
            f"`generate` from a {p['sizes']['prompt']}-byte prompt to {d['max_len']} bytes, "
            f"greedy. Median of {p['sizes']['repeats']} interleaved calls per batch; "
            f"speed-up over {baseline} at the same batch.", ""]


def _markdown(p: dict) -> str:
    out = [report.header_md(p["machine"], {}), ""]
    if p.get("decode"):
        out += decode_intro(p, "multi-head") + [
                report.table(["batch", "key/value heads", "attention", "new tokens/s",
                              "speed-up", "KV cache", "params"],
                             [[str(r["batch"]), _kv_heads_cell(r), r["attention"],
                               f"{r['tokens_per_s']:.1f}", report.fmt(r["speedup"], "x"),
                               report._bytes_short(r["cache_bytes"]), f"{r['params']:,}"]
                              for r in p["decode"]]), ""]
    if p.get("quality"):
        out += ["### Quality", "",
                "The default byte LM (experiments/lm.py), eval loss; continued: the multi-head "
                "run itself trained the steps shown (the control: what those steps alone "
                "give); uptrained: its key/value heads mean-pooled per group (SVD: fitted per "
                "group at rank D, `train.init_kv_heads='svd'`; N batches: weighted by the "
                "attention inputs of N training batches, `train.init_kv_calibration`), then "
                "trained the same steps "
                "(`pooled` is the loss before them); converted: its key and value weights' "
                "joint truncated SVD as a latent without layer norm (`hpnlp.compress.mla`), "
                "then trained likewise (`pooled`: converted, untrained). A latent's key/value "
                "heads are the query heads, every one read from the latent.", "",
                report.table(["method", "key/value heads", "attention", "steps", "params",
                              "eval loss", "vs multi-head", "pooled, untrained"],
                             [[r["method"], _kv_heads_cell(r), r["attention"], str(r["steps"]),
                               f"{r['params']:,}", f"{r['loss']:.4f}",
                               f"{r['loss_vs_multi_head']:+.4f}",
                               f"{r['loss_pooled']:.4f}" if "loss_pooled" in r else "–"]
                              for r in p["quality"]]), ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def _kv_heads_cell(r: dict) -> str:
    return "latent" if r.get("kv_latent_dim") else str(r["kv_heads"])


def _plot(p: dict, out_dir: str) -> None:
    """New tokens/s against the cache's bytes per position, per batch: grouped heads (8 to
    1) on one line, latents on another."""
    if not p.get("decode"):
        report.drop_plot(os.path.join(out_dir, "gqa_decode.png"))  # an earlier run's
        return
    series = {}
    T = p["sizes"]["decode"]["max_len"]
    for r in sorted(p["decode"], key=lambda r: r["cache_bytes"]):
        family = "latent" if r.get("kv_latent_dim") else "key/value heads"
        xs, ys = series.setdefault(f"batch {r['batch']}, {family}", ([], []))
        xs.append(r["cache_bytes"] / (r["batch"] * T))
        ys.append(r["tokens_per_s"])
    report.scaling_plot(os.path.join(out_dir, "gqa_decode.png"), series,
                        xlabel="cache bytes per position (all blocks)", ylabel="new tokens/s",
                        title="generate() with smaller key/value caches")


def run(out_dir: str, *, quick: bool, workdir: str | None = None, parts=PARTS) -> dict:
    s = dict(SIZES["quick" if quick else "full"])
    payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
               "machine": harness.machine_info(), "seconds": {}}
    reused = len(compress.REUSED)
    with tempfile.TemporaryDirectory() as tmp:
        harness.run_parts(payload, {"decode": lambda: decode_rows(s),
                                    "quality": lambda: quality_rows(s, workdir or tmp)}, parts)
    payload["reused_runs"] = len(compress.REUSED) - reused
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "gqa", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS, workdir_help="keep the trained runs here (and reuse them)")


main = harness.parts_main(run)
