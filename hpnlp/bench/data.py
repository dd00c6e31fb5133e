"""`python -m hpnlp.bench data`: prepared corpora streamed through grain, at two sizes.

The shipped corpus' text is repeated into a 20 MB and a 2 GB plain-text file (paragraphs =
chapters) and each is prepared with `python -m hpnlp.data.prepare` (byte tokenizer: the
default LM's). Then, each in a fresh process:

- loader: the streamed iterator alone (hpnlp/data/sharded.py) with the default LM's
  batches (experiments/lm.py: 32 rows x 128 tokens, packed) over the 2 GB folder: real
  tokens/s, beside the in-memory BatchIterator on the shipped corpus (the path it replaces);
- training: the default LM trained from each folder for the same steps: tokens/s (compile
  excluded) and the process's peak RSS.

Targets (issue 24; `targets` in results.json): `loader_vs_step_tokens` (the loader's
tokens/s over the training step's, >= 10: the loader never bounds training) and
`rss_2gb_vs_20mb` (peak RSS training from 2 GB over from 20 MB, <= 1.2: memory does not
grow with the corpus). `--quick`: 2 MB and 20 MB, fewer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from hpnlp.bench import harness, report

MB = 2**20


def _write_text(path: str, size: int) -> None:
    """`size` characters of the shipped corpus, repeated, as `path`: written beside it and
    moved into place, so a `path` present is whole (`run` reuses it)."""
    from hpnlp.data import corpus
    block = "\n".join(c.text for c in corpus.kjv_chapters()) + "\n"
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            written = 0
            while written < size:
                piece = block[:size - written] if size - written < len(block) else block
                f.write(piece)
                written += len(piece)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def _prepare(text: str, out: str) -> dict:
    from hpnlp.data import prepare
    t0 = time.perf_counter()
    rc = prepare.main(["--input", text, "--out", out, "--tokenizer", "bytes", "--quiet"])
    if rc:
        raise SystemExit(f"prepare failed on {text}")
    dt = time.perf_counter() - t0
    return {"seconds": dt, "input_bytes": os.path.getsize(text),
            "mb_per_sec": os.path.getsize(text) / MB / dt, **_counts(out)}


def _prepare_text(text: str, size: int, out: str) -> dict:
    """`_prepare` of a `size`-character text written as `text`, or the one already there
    (`_write_text` leaves only whole ones), and the text removed after, unless `out` holds an
    unfinished preparation, whose rerun reads it again. A bug hunt (session 99): the text was
    written again on each run, so a rerun after a Ctrl-C found it changed (its modification
    time) and refused to resume, and a failed run left the text (2 GiB) behind. Named by its
    size, as the folders are, so a --quick run's text is not the full run's."""
    from hpnlp.data.prepare import PROGRESS_FILE
    if not os.path.isfile(text):
        _write_text(text, size)
    try:
        result = _prepare(text, out)
    except BaseException:
        if not os.path.isfile(os.path.join(out, PROGRESS_FILE)):
            with contextlib.suppress(OSError):
                os.remove(text)
        raise
    os.remove(text)
    return result


def _counts(out: str) -> dict:
    """A prepared folder's size on disk and its splits' documents and tokens."""
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    size = sum(os.path.getsize(os.path.join(out, s)) for sp in meta["splits"].values()
               for s in sp["shards"])
    return {"prepared_bytes": size, **{f"{k}_{x}": meta["splits"][k][x]
                                       for k in ("train", "eval") for x in ("documents", "tokens")}}


def _lm_config(prepared: str, steps: int):
    cfg = harness.experiment_module("lm.py").get_config("bytes")
    cfg.data.prepared = prepared
    cfg.train.update(steps=steps, warmup_steps=min(cfg.train.warmup_steps, steps // 2),
                     eval_every=0, eval_batches=2, checkpoint_every=0, progress=False,
                     log_every=max(steps // 4, 1))
    return cfg


def measure(spec: dict) -> dict:
    from hpnlp import data
    from hpnlp.config import from_configdict
    if spec["part"] == "train":
        from hpnlp import train
        cfg = _lm_config(spec["prepared"], spec["steps"])
        with tempfile.TemporaryDirectory() as workdir:
            s = train.run(cfg, workdir)
        return {"status": "ok", "tokens_per_sec": s["throughput"]["tokens_per_sec"],
                "steps_per_sec": s["throughput"]["steps_per_sec"], "steps": s["final_step"],
                "eval_loss": s["eval"]["loss"],
                "peak_rss_bytes": s["peak_memory"]["host_peak_rss_bytes"]}
    cd = _lm_config(spec["prepared"], 10)
    if not spec["prepared"]:  # the in-memory path on the shipped corpus
        cd.data.prepared = ""
    cfg = from_configdict(cd)
    task = data.make_task(cfg.data)
    it = data.make_iterator(task, cfg.data, split="train", batch_size=cfg.train.batch_size)
    for _ in range(5):
        next(it)
    before, t0 = it.stats()["tokens"], time.perf_counter()
    for _ in range(spec["batches"]):
        next(it)
    dt = time.perf_counter() - t0
    tokens = it.stats()["tokens"] - before
    return {"status": "ok", "tokens_per_sec": tokens / dt, "batches": spec["batches"],
            "seconds": dt, "padding_fraction": it.stats()["padding_fraction"]}


def _isolated(spec):
    return harness.isolated("hpnlp.bench.data", spec, timeout_s=3600)


def run(out_dir: str, *, quick: bool, workdir: str | None = None) -> dict:
    small, large = (2 * MB, 20 * MB) if quick else (20 * MB, 2048 * MB)
    steps, batches = (20, 200) if quick else (200, 2000)
    os.makedirs(out_dir, exist_ok=True)
    info = harness.machine_info()
    # without --workdir, a folder of its own, removed however the run ends (a review,
    # session 116: an interrupted run left its 2 GB text and shards in /tmp)
    if workdir:
        return _run_in(workdir, out_dir, quick, info, small, large, steps, batches)
    with tempfile.TemporaryDirectory() as root:
        return _run_in(root, out_dir, quick, info, small, large, steps, batches)


def _run_in(root: str, out_dir: str, quick: bool, info: dict, small: int, large: int,
            steps: int, batches: int) -> dict:
    from tqdm.auto import tqdm
    os.makedirs(root, exist_ok=True)
    sizes = {"small": small, "large": large}
    prepared = {}
    bar = tqdm(total=6, desc="data bench", dynamic_ncols=True)
    # named by their size (a bug hunt: a --quick run's 2 and 20 MB folders were reused by the
    # full run as its 20 MB and 2 GB corpora, their counts shown as 0)
    dirs = {name: os.path.join(root, f"prepared_{size // MB}MB") for name, size in sizes.items()}
    try:
        for name, size in sizes.items():
            out = dirs[name]
            if os.path.isfile(os.path.join(out, "meta.json")):
                prepared[name] = {"reused": out, **_counts(out)}
            else:
                prepared[name] = _prepare_text(os.path.join(root, f"{name}_{size // MB}MB.txt"),
                                               size, out)
            bar.update(1)
    except BaseException:
        bar.close()  # the error's line below the bar, not glued to it
        raise
    large_dir, small_dir = dirs["large"], dirs["small"]
    loader = _isolated({"part": "loader", "prepared": large_dir, "batches": batches})
    bar.update(1)
    in_memory = _isolated({"part": "loader", "prepared": "", "batches": batches})
    bar.update(1)
    train = {n: _isolated({"part": "train", "prepared": d, "steps": steps})
             for n, d in (("small", small_dir), ("large", large_dir))}
    bar.update(2)
    bar.close()
    payload = {"benchmark": "data", "machine": info,
               "sizes_bytes": sizes, "steps": steps, "prepare": prepared,
               "loader": loader, "in_memory_loader": in_memory, "train": train}
    report.targets_unless_quick(payload, quick, lambda: _targets(payload))
    report.write(out_dir, "data", payload, _markdown(payload))
    return payload


def _targets(p: dict) -> dict:
    """The loader's tokens/s over the step's (both on the large folder) and the peak RSS of
    training from the large folder over the small one; None where a part failed."""
    ok = lambda r: r.get("status") == "ok"  # noqa: E731
    loader, train = p["loader"], p["train"]
    ratio = (loader["tokens_per_sec"] / train["large"]["tokens_per_sec"]
             if ok(loader) and ok(train["large"]) else None)
    rss = (train["large"]["peak_rss_bytes"] / train["small"]["peak_rss_bytes"]
           if ok(train["large"]) and ok(train["small"]) else None)
    return {"loader_vs_step_tokens": report.target(ratio, 10.0, ">="),
            "rss_2gb_vs_20mb": report.target(rss, 1.2, "<=")}


def _markdown(p: dict) -> str:
    size = lambda n: f"{n / MB:.0f} MB" if n < 1024 * MB else f"{n / 2**30:.0f} GB"  # noqa: E731
    sizes = p["sizes_bytes"]
    rows = []
    for name in ("small", "large"):
        pr, tr = p["prepare"][name], p["train"][name]
        rows.append([f"{size(sizes[name])} corpus",
                     f"{pr['mb_per_sec']:.1f} MB/s ({pr['seconds']:.1f} s)" if "mb_per_sec" in pr else "reused",
                     f"{pr.get('train_tokens', 0) / 1e6:.1f}M / {pr.get('train_documents', 0)}",
                     report.fmt(tr.get("tokens_per_sec")) if tr.get("status") == "ok" else tr.get("status", "–"),
                     report.fmt(tr.get("peak_rss_bytes"), "MiB") if tr.get("status") == "ok" else "–"])
    ld, im = p["loader"], p["in_memory_loader"]
    cell = lambda r: f"{r['tokens_per_sec']:,.0f}" if r.get("status") == "ok" else r.get("status")  # noqa: E731
    parts = [report.header_md(p["machine"], {}), "",
             f"The default LM (`experiments/lm.py`: bytes, 32 x 128 tokens packed, width 128, depth "
             f"2) trained {p['steps']} steps from each prepared folder, each run in a fresh process "
             "(`python -m hpnlp.bench data`).", "",
             report.table(["corpus", "prepare", "train tokens / documents", "training tokens/s",
                           "peak RSS (MiB)"], rows), "",
             f"Loader alone, packed batches of the default LM over the {size(sizes['large'])} "
             f"folder: **{cell(ld)} tokens/s** (the in-memory iterator on the shipped corpus: "
             f"{cell(im)} tokens/s).", ""]
    parts += [report.targets_md(p.get("targets"), p.get("quick"))]
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=None, help="keep the prepared folders here (reused when "
                   "present) instead of a temporary folder")


def main(args) -> dict:
    return run(args.out, quick=args.quick, workdir=args.workdir)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
