"""`python -m hpnlp.bench sparse`: masks, the block sums, the breakeven and a quick run."""

import json
import os

import numpy as np
import pytest

from hpnlp.bench import harness, sparse


def test_masks_prune_exactly_what_they_say():
    w = np.random.default_rng(0).standard_normal((64, 24)).astype(np.float32)
    for q in (0.5, 0.9, 0.98):
        keep = sparse.magnitude_mask(w, q)
        assert (~keep).sum() == round(q * w.size)
        assert np.abs(w[keep]).min() >= np.abs(w[~keep]).max()  # the largest are kept
    keep = sparse.nm_mask(w)
    assert (keep.reshape(16, 4, 24).sum(1) == 2).all()  # 2 of every 4 along the contraction


def _block(q, impl, speedup):
    return {"pattern": "unstructured", "sparsity": q, "impl": impl,
            "speedup_vs_xla_dense": speedup}


def test_breakeven_is_where_a_sparse_product_wins_from_then_on():
    blocks = [_block(0.5, "torch csr", 0.3), _block(0.9, "torch csr", 1.1),
              _block(0.95, "torch csr", 0.9), _block(0.98, "torch csr", 2.0),
              _block(0.5, "scipy csr", 1.2), _block(0.9, "scipy csr", 1.5),
              _block(0.5, "jax bcoo", 0.1), _block(0.9, "jax bcoo", None),
              _block(0.5, "hpnlp csc", 0.5), _block(0.9, "hpnlp csc", 0.9)]
    got = sparse.breakeven(blocks)
    assert got["torch csr"] == 0.98  # the win at 90% does not last
    assert got["scipy csr"] == 0.5
    assert got["hpnlp csc"] is None  # measured, and never ahead
    # a block without a time (skipped, failed), or no block at all: not "never" (a review,
    # session 118: CI's machine read "`torch csr` never" without PyTorch)
    assert got["jax bcoo"] == got["torch dense"] == sparse.NOT_MEASURED


def _check_blocks(p: dict) -> None:
    """A timed block sums its products' times; an untimed one says why (a review, session
    109: a skipped impl's None was compared with the 0 of no timed rows)."""
    for b in p["block"]:
        mine = [r for r in p["rows"] if (r["pattern"], r["sparsity_asked"], r["impl"])
                == (b["pattern"], b["sparsity"], b["impl"])]
        if b["median_s"] is None:
            assert b["status"] != "ok" and any(r["status"] != "ok" for r in mine)
            continue
        assert b["status"] == "ok" and all(r["status"] == "ok" for r in mine)
        assert b["median_s"] == pytest.approx(sum(r["time"]["median_s"] for r in mine))


def test_a_run_without_pytorch_or_xla_dense_reports_the_rest(tmp_path, monkeypatch):
    """A review (session 109): CI has no PyTorch, and the quick-run test failed there; one
    implementation that raised lost the whole run; and a block without an `xla dense` time
    (a TF32 `wrong` on a GPU) made the report a TypeError."""
    monkeypatch.setattr(harness, "torch_or_none", lambda: None)
    monkeypatch.setitem(sparse.SIZES, "quick", dict(tokens=8, sparsities=(), repeats=1))

    def calls(x, w, torch):  # the real ones compile for seconds (BCOO's fromdense alone)
        assert torch is None  # what the run passes without PyTorch
        return {"xla dense": lambda: 1 / 0, "scipy csr": lambda: x @ w}
    monkeypatch.setattr(sparse, "_calls", calls)
    monkeypatch.setattr(sparse, "_plot", lambda p, out_dir: None)  # matplotlib: seconds
    p = sparse.run(str(tmp_path), quick=True, only=("out",))
    assert {r["impl"]: r["status"] for r in p["rows"]} == {
        "xla dense": "failed: ZeroDivisionError: division by zero", "scipy csr": "ok",
        "torch dense": "skipped (no PyTorch)", "torch csr": "skipped (no PyTorch)",
        "hpnlp csc": "skipped (no kernel here)", "jax bcoo": "skipped (no kernel here)"}
    _check_blocks(p)
    md = open(tmp_path / "results.md").read()
    ms = next(b["median_s"] for b in p["block"] if b["impl"] == "scipy csr")
    assert f"| {ms * 1e3:.2f} |" in md  # the ms alone: no speed-up to show
    assert "skipped (no PyTorch)" in md and "failed: ZeroDivisionError" in md


@pytest.mark.slow  # 7.9 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_quick_run_checks_every_product_and_sums_the_block(tmp_path):
    p = sparse.run(str(tmp_path), quick=True, only=("out", "mlp_out"))
    assert set(p["products"]) == {"out", "mlp_out"}
    settings = sparse.settings(sparse.SIZES["quick"])
    timed = [r for r in p["rows"] if r["status"] == "ok"]
    assert len(p["rows"]) == len(settings) * 2 * len(sparse.IMPLS)
    assert {r["impl"] for r in timed} >= {"xla dense", "hpnlp csc", "scipy csr", "jax bcoo"}
    if harness.torch_or_none() is None:  # CI installs no PyTorch: its rows say so
        assert {r["status"] for r in p["rows"] if r["impl"].startswith("torch")} == {
            "skipped (no PyTorch)"}
    x, w = np.ones((4, 8), np.float32), np.ones((8, 4), np.float32)
    assert set(sparse._calls(x, w, None)) == {"xla dense", "hpnlp csc", "scipy csr", "jax bcoo"}
    for r in timed:
        assert r["max_rel_err"] <= sparse.TOLERANCE and r["time"]["median_s"] > 0
        if r["pattern"] == "unstructured":
            assert abs(r["sparsity"] - r["sparsity_asked"]) < 1e-3
    _check_blocks(p)
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["breakeven"] == p["breakeven"]
    md = open(tmp_path / "results.md").read()
    assert "| sparsity |" in md and "| 2:4 |" in md and "Lowest sparsity" in md
    assert os.path.exists(tmp_path / "sparse_speedup.png")
