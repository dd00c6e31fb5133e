"""`python -m hpnlp.bench kv_cache`: decoding through an int8 key/value cache
(`quant.kv_cache='int8'`) against the float32 cache, in one run on this CPU: speed, then
what it costs in quality.

1. Decoding (`decode`): the gqa bench's byte LM (width 512, 4 blocks, 8 heads of 64, MLP
   2048, 1024 positions, random weights) generates from a 16-byte prompt to its 1024
   positions (`hpnlp.models.generate`, greedy, the prompt prefilled, then one token a step
   through the exact cache and its CPU kernel), at batch 1 and 16, multi-head (8 key/value
   heads) and multi-query (1), each with the float32 and the int8 cache. Each batch's calls
   are timed interleaved. Reported: new tokens/s, the speed-up over the float32 multi-head
   cache at the same batch, the cache's size.
2. Quality (`quality`): the default byte LM (experiments/lm.py: 4 heads of 32, 800 steps)
   trained with 4 (multi-head), 2 and 1 key/value heads (the gqa bench's runs: the same
   configs, reused from --workdir), each evaluated with its float cache and with the int8
   one (eval through the forward pass, which with quant.kv_cache='int8' computes what
   decoding through that cache computes: tests/test_models.py checks the two agree), and the
   multi-head model trained with the int8 cache from the start (its keys and values
   fake-quantized, straight-through). Reported: eval loss, its change against the same
   weights' float cache, and how often the next byte's argmax is the float cache's.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import compress, gqa, harness, report

SIZES = {
    "full": dict(gqa.SIZES["full"], decode_variants=((8, "none"), (8, "int8"), (1, "none"),
                                                     (1, "int8")),
                 trained_int8_kv=(4,)),
    "quick": dict(gqa.SIZES["quick"], decode_variants=((4, "none"), (4, "int8"), (1, "none"),
                                                       (1, "int8")),
                  trained_int8_kv=(4,)),
}
PARTS = ("decode", "quality")
WORKDIR_PARTS = ("quality",)  # the parts that keep runs in --workdir


def _evaluate(cd, workdir: str) -> tuple[dict, np.ndarray]:
    """Eval metrics of the run trained in `workdir`, under config `cd` (its own, or with
    another key/value cache), and its next-token argmax on the first eval batch."""
    import jax

    from hpnlp import data as data_lib
    from hpnlp.config import from_configdict
    from hpnlp.train import Trainer
    from hpnlp.train.carry import model_params

    tr = Trainer(from_configdict(cd), workdir, read_only=True)
    state, _ = tr.initial_state()
    out = tr.evaluate(state)
    batch = next(iter(data_lib.make_iterator(tr.task, tr.cfg.data, split="eval",
                                             batch_size=tr.cfg.train.batch_size, **tr.iter_args)))
    logp = jax.jit(lambda p, b: tr.eval_model.apply({"params": p}, b, method="log_probs"))(
        model_params(state.params), batch)
    tr.checkpointer.close()
    return out, np.where(np.asarray(batch["segment_ids"]) > 0, np.argmax(logp, -1), -1)


def quality_rows(s: dict, workdir: str) -> list[dict]:
    H = compress.experiment("byte LM", dict(lm_steps=None, eval_batches=None)).model.num_heads
    runs = [(G, "none") for G in s["quality_kv"]] + [(G, "int8") for G in s["trained_int8_kv"]]
    rows = []
    for G, trained in tqdm(runs, desc="kv_cache quality", leave=False):
        name = f"kv{G}" if trained == "none" else f"kv{G}_int8_cache"
        out = os.path.join(workdir, name)
        cd = gqa._config({}, G, steps=s["lm_steps"], eval_batches=s["eval_batches"],
                         kv_cache=trained)
        summary = compress._train(cd, out)
        evals = {}
        for kv_cache in ("none", "int8"):
            cd.quant.kv_cache = kv_cache
            evals[kv_cache] = _evaluate(cd, out)
        (ev_f, top_f), (ev_q, top_q) = evals["none"], evals["int8"]
        valid = top_f >= 0
        rows.append({"kv_heads": G, "heads": H, "attention": gqa._kv_name(G, H),
                     "trained_with": "int8 cache" if trained == "int8" else "float32 cache",
                     "steps": summary["final_step"], "loss_float_cache": ev_f["loss"],
                     "loss_int8_cache": ev_q["loss"], "loss_change": ev_q["loss"] - ev_f["loss"],
                     "argmax_agreement": float(np.mean(top_f[valid] == top_q[valid]))})
    return rows


def _markdown(p: dict) -> str:
    out = [report.header_md(p["machine"], {}), ""]
    if p.get("decode"):
        out += gqa.decode_intro(p, "the float32 multi-head cache") + [
                report.table(["batch", "key/value heads", "attention", "cache", "new tokens/s",
                              "speed-up", "KV cache"],
                             [[str(r["batch"]), str(r["kv_heads"]), r["attention"],
                               "int8" if r["kv_cache"] == "int8" else "float32",
                               f"{r['tokens_per_s']:.1f}", report.fmt(r["speedup"], "x"),
                               report._bytes_short(r["cache_bytes"])]
                              for r in p["decode"]]), ""]
    if p.get("quality"):
        out += ["### Quality", "",
                "The default byte LM (experiments/lm.py), eval loss with the float32 cache and "
                "with the int8 one (the same weights); agreement: positions of the first eval "
                "batch whose next-byte argmax is the float32 cache's.", "",
                report.table(["key/value heads", "attention", "trained with", "steps",
                              "eval loss, float32 cache", "eval loss, int8 cache", "change",
                              "argmax agreement"],
                             [[str(r["kv_heads"]), r["attention"], r["trained_with"],
                               str(r["steps"]), f"{r['loss_float_cache']:.4f}",
                               f"{r['loss_int8_cache']:.4f}", f"{r['loss_change']:+.4f}",
                               f"{100 * r['argmax_agreement']:.2f}%"]
                              for r in p["quality"]]), ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def run(out_dir: str, *, quick: bool, workdir: str | None = None, parts=PARTS) -> dict:
    s = dict(SIZES["quick" if quick else "full"])
    payload = {"sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in s.items()},
               "machine": harness.machine_info(), "seconds": {}}
    reused = len(compress.REUSED)
    with tempfile.TemporaryDirectory() as tmp:
        harness.run_parts(payload, {"decode": lambda: gqa.decode_rows(s, s["decode_variants"]),
                                    "quality": lambda: quality_rows(s, workdir or tmp)}, parts)
    payload["reused_runs"] = len(compress.REUSED) - reused
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "kv_cache", payload, _markdown(payload))
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS, workdir_help="keep the trained runs here (and reuse "
                                "them; the gqa bench's --workdir holds three of them)")


main = harness.parts_main(run)
