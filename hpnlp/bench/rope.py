"""`python -m hpnlp.bench rope`: position embeddings compared on quality: the default byte LM
(experiments/lm.py, 128 positions a row) trained with `model.pos_emb` = "learned",
"sinusoidal" and "rope" (rotary, Su et al. 2021) for the same steps, in one run.

Each trained model is evaluated on the held-out split at the training length, and the two
whose positions have no table (sinusoidal, rope) also at `factor` times it: rows of 256
bytes, whose positions 128..255 no training row reached (the corpus's documents are long,
so packed rows hold one document's consecutive bytes). Reported: eval loss (nats per byte)
at each length, and at the longer one separately over the positions training saw and over
those it did not; the plot, eval loss against position. The learned table has no rows past
`model.max_len` (128), so the learned model is evaluated at the training length only.

The runs train in --workdir (a finished run of the same config is reused).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hpnlp.bench import compress, harness, report

POS_EMBS = ("learned", "sinusoidal", "rope")
TABLELESS = ("sinusoidal", "rope")  # no table: evaluated past the training length too
SIZES = {
    # experiments/lm.py's own steps and warmup: about 3.5 minutes a run on one core
    "full": dict(steps=800, warmup=100, eval_batches=None, factor=2, bucket=16),
    "quick": dict(steps=12, warmup=2, eval_batches=2, factor=2, bucket=16),
}
PARTS = ("quality",)


def _config(pos_emb: str, s: dict, *, seq_len: int | None = None):
    """experiments/lm.py's byte LM with `pos_emb`, trained `s["steps"]` (rows of `seq_len`,
    default the experiment's; model.max_len stays, so every run has the same signature)."""
    cd = compress.experiment("byte LM", dict(lm_steps=None, eval_batches=s["eval_batches"]))
    cd.train.steps, cd.train.warmup_steps = s["steps"], s["warmup"]
    cd.model.pos_emb = pos_emb
    if seq_len:
        cd.data.seq_len = seq_len
    return cd


def _long_config(cd, pos_emb: str, s: dict):
    """`_config` on rows `s["factor"]` times `cd`'s, its eval of about the same held-out bytes:
    eval batches of 1 / factor the rows (a review, session 118: the same count of batches
    of rows twice as long read twice the text, so the long eval's positions under L were
    another sample than the short eval's)."""
    long = _config(pos_emb, s, seq_len=s["factor"] * cd.data.seq_len)
    rows = cd.data.eval_batch_size or cd.train.batch_size
    if rows % s["factor"]:
        raise ValueError(f"rope bench: the eval batch of {rows} rows does not split into "
                         f"{s['factor']} for the long eval")
    long.data.eval_batch_size = rows // s["factor"]
    return long


def _trainer(cd, workdir: str, *, read_only: bool):
    from hpnlp.config import from_configdict, validate
    from hpnlp.train import Trainer
    return Trainer(validate(from_configdict(cd)), workdir, read_only=read_only)


def _position_eval(tr, state) -> dict:
    """`state`'s model evaluated on `tr`'s eval rows (its config's data.seq_len): eval loss
    over every token and per position ("loss_by_position" [L], nats; "tokens_by_position")."""
    from hpnlp import models
    from hpnlp.train.carry import model_params

    model = models.build(tr.cfg, deterministic=True)

    @jax.jit
    def eval_step(state, batch):
        logp_BLV = model.apply({"params": model_params(state.params)}, batch, method="log_probs")
        nll_BL = -jnp.take_along_axis(logp_BLV, batch["targets"][..., None], axis=-1)[..., 0]
        mask_BL = (batch["segment_ids"] > 0).astype(jnp.float32)
        L = mask_BL.shape[1]
        # by each token's own position (per segment), not its column
        onehot_BLP = jax.nn.one_hot(batch["positions"], L, dtype=jnp.float32)
        return {"loss_P": jnp.einsum("bl,blp->p", nll_BL * mask_BL, onehot_BLP),
                "tokens_P": jnp.einsum("bl,blp->p", mask_BL, onehot_BLP)}

    sums = tr.eval_sums(state, eval_step=eval_step)
    loss_P, tokens_P = np.asarray(sums["loss_P"]), np.asarray(sums["tokens_P"])
    return {"seq_len": tr.cfg.data.seq_len, "loss": float(loss_P.sum() / tokens_P.sum()),
            "tokens": int(tokens_P.sum()), "loss_by_position": loss_P.tolist(),
            "tokens_by_position": tokens_P.tolist()}


def _span(e: dict, lo: int, hi: int) -> float | None:
    """Eval loss over positions lo..hi-1 of a `_position_eval`."""
    loss, n = np.asarray(e["loss_by_position"])[lo:hi], np.asarray(e["tokens_by_position"])[lo:hi]
    return float(loss.sum() / n.sum()) if n.sum() else None


def quality_rows(s: dict, workdir: str) -> list[dict]:
    rows = []
    bar = tqdm(total=len(POS_EMBS), desc="rope quality", leave=False)
    for pos_emb in POS_EMBS:
        out = os.path.join(workdir, pos_emb)
        cd = _config(pos_emb, s)
        summary = compress._train(cd, out)
        L = cd.data.seq_len
        row = {"pos_emb": pos_emb, "steps": summary["final_step"], "params": summary["param_count"],
               "seq_len": L, "steps_per_s": summary["throughput"]["steps_per_sec"],
               "run_eval_loss": summary["eval"]["loss"]}  # the trainer's: the same eval
        tr = _trainer(cd, out, read_only=True)
        state, _ = tr.initial_state()  # the trained run's last checkpoint
        row["eval"] = _position_eval(tr, state)
        tr.checkpointer.close()
        row["loss"] = row["eval"]["loss"]
        if pos_emb in TABLELESS:
            # the same weights on longer rows (a trainer of its own: the run's checkpoint
            # holds a data stream of other rows, which a resume would refuse)
            with tempfile.TemporaryDirectory() as tmp:
                long_tr = _trainer(_long_config(cd, pos_emb, s), tmp, read_only=False)
                long = _position_eval(long_tr, state)
                long_tr.checkpointer.close()
            row.update(long=long, loss_long=long["loss"], loss_long_seen=_span(long, 0, L),
                       loss_long_unseen=_span(long, L, s["factor"] * L))
        rows.append(row)
        bar.update()
    bar.close()
    return rows


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def _markdown(p: dict) -> str:
    out = [report.header_md(p["machine"], {}), ""]
    if p.get("quality"):
        s = p["sizes"]
        L = p["quality"][0]["seq_len"]
        long = s["factor"] * L
        out += ["### Quality", "",
                f"The default byte LM (experiments/lm.py: width 128, 2 blocks, 4 heads, rows of "
                f"{L} bytes, packed) trained {p['quality'][0]['steps']} steps with each "
                "`model.pos_emb`; eval loss in nats per byte on the held-out split at the "
                f"training length ({L}) and, where positions have no table, at {long}: over all "
                f"its positions, over 0..{L - 1} (lengths training saw) and over "
                f"{L}..{long - 1} (never seen). The learned table ends at model.max_len={L}.", "",
                report.table(["model.pos_emb", "params", f"eval loss at {L}",
                              f"at {long}", f"at {long}, positions < {L}",
                              f"at {long}, positions >= {L}"],
                             [[f"`{r['pos_emb']}`", f"{r['params']:,}", _fmt(r["loss"]),
                               _fmt(r.get("loss_long")), _fmt(r.get("loss_long_seen")),
                               _fmt(r.get("loss_long_unseen"))] for r in p["quality"]]), ""]
    out += report.seconds_md(p)
    return "\n".join(out)


def _plot(p: dict, out_dir: str) -> None:
    """Eval loss against position (means over buckets of `bucket` positions)."""
    if not p.get("quality"):
        report.drop_plot(os.path.join(out_dir, "rope_loss_by_position.png"))  # an earlier run's
        return
    import matplotlib.pyplot as plt
    bucket = p["sizes"]["bucket"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in p["quality"]:
        e = r.get("long", r["eval"])
        loss, n = np.asarray(e["loss_by_position"]), np.asarray(e["tokens_by_position"])
        k = len(loss) // bucket
        lb, nb = (x[:k * bucket].reshape(k, bucket).sum(1) for x in (loss, n))
        ok = nb > 0
        ax.plot((np.arange(k) * bucket + bucket / 2)[ok], lb[ok] / nb[ok], marker="o", ms=3,
                label=f"{r['pos_emb']} (rows of {e['seq_len']})")
    ax.axvline(p["quality"][0]["seq_len"], color="black", ls="--", lw=1, label="training length")
    ax.set_xlabel("position in the row")
    ax.set_ylabel("eval loss (nats per byte)")
    ax.set_title("Byte LM: eval loss by position, trained on rows of "
                 f"{p['quality'][0]['seq_len']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.savefig(fig, os.path.join(out_dir, "rope_loss_by_position.png"))


def run(out_dir: str, *, quick: bool, workdir: str | None = None, parts=PARTS) -> dict:
    s = dict(SIZES["quick" if quick else "full"])
    payload = {"sizes": s, "machine": harness.machine_info(), "seconds": {}}
    reused = len(compress.REUSED)
    with tempfile.TemporaryDirectory() as tmp:
        if "quality" in parts:
            t0 = time.perf_counter()
            payload["quality"] = quality_rows(s, workdir or tmp)
            payload["seconds"]["quality"] = time.perf_counter() - t0
    payload["reused_runs"] = len(compress.REUSED) - reused
    payload["quick"] = bool(quick)  # its own, not only the CLI's (session 107)
    report.write(out_dir, "rope", payload, _markdown(payload))
    _plot(payload, out_dir)
    return payload


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_parts_arguments(p, PARTS,
                                workdir_help="keep the trained runs here (and reuse them)")


main = harness.parts_main(run)
