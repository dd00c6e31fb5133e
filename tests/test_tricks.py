"""Each speed trick's slow and fast versions compute the same thing (and jit agrees too)."""

import json
import jax
import numpy as np
import pytest

from hpnlp.bench import tricks


# per_example takes over 10 s on the 2-core CPU: CI's slow part runs it; per_example_long
# 5.6 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite read 7 min
# 58 s for 1838 tests) runs there too (tests/test_per_example.py checks the same products)
@pytest.mark.parametrize("trick", [pytest.param(t, id=t.name, marks=[pytest.mark.slow] if
                                                t.name in ("per_example", "per_example_long")
                                                else [])
                                   for t in tricks.TRICKS])
def test_slow_and_fast_agree(trick):
    args = trick.inputs(True)
    slow, fast = trick.slow(*args), trick.fast(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), slow, fast)
    if trick.jittable:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                     jax.jit(trick.fast)(*args), slow)


def test_bags_mean_uses_real_lengths_not_padding():
    table, bags, ids, lengths = tricks.TRICKS[3].inputs(True)
    _, mean = tricks.bags_fast(table, bags, ids, lengths)
    b = int(np.argmin(lengths))
    np.testing.assert_allclose(mean[b], np.asarray(table)[bags[b]].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tricks_bench_writes_table(tmp_path):
    names = ("hoist", "transfer", "dots")  # jittable and not; every trick's agreement is tested above
    payload = tricks.run(str(tmp_path), quick=True, names=names)
    assert [r["trick"] for r in payload["results"]] == list(names)
    assert all(r["eager_slow"]["median_s"] > 0 for r in payload["results"])
    assert "eager speedup" in (tmp_path / "results.md").read_text()


def test_closing_line_names_only_the_plots_written(tmp_path, monkeypatch, capsys):
    """`python -m hpnlp.bench tricks` said it wrote "results.json, results.md and plots"
    and wrote no plot: the line names the PNGs this run wrote, or says there are none."""
    from hpnlp.bench import __main__ as bench_main
    monkeypatch.setattr(tricks, "TRICKS", tuple(t for t in tricks.TRICKS if t.name == "dots"))
    bench_main.main(["tricks", "--quick", "--out", str(tmp_path)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"wrote {tmp_path}/results.json, results.md (no plots)", last
    old = tmp_path / "old.png"  # an earlier run's plot, left as it was: not this run's
    old.write_bytes(b"")
    before = bench_main._plots(str(tmp_path))
    (tmp_path / "new.png").write_bytes(b"")
    assert bench_main.wrote_message(str(tmp_path), before).endswith("and 1 plot: new.png")


def test_tricks_bench_stopped_keeps_the_rows_that_ran_and_labels_its_sizes(tmp_path, monkeypatch):
    """A bug hunt (session 95): a Ctrl-C left --out empty, and --quick rows were labelled
    with the full run's sizes."""
    import dataclasses
    from hpnlp.bench import __main__ as bench_main

    def stop(quick):
        raise KeyboardInterrupt
    per_example = {t.name: t for t in tricks.TRICKS}["per_example"]
    dots = next(t for t in tricks.TRICKS if t.name == "dots")
    monkeypatch.setattr(tricks, "TRICKS", (dots, dataclasses.replace(dots, name="x", inputs=stop)))
    with pytest.raises(SystemExit) as e:
        bench_main.main(["tricks", "--quick", "--out", str(tmp_path)])
    assert e.value.code == 130
    md = (tmp_path / "results.md").read_text()
    assert "**Interrupted:**" in md and "| `x` |" in md and "not run: interrupted" in md
    assert [r.get("status") for r in json.load(open(tmp_path / "results.json"))["results"]] == [
        None, "not run: interrupted"]
    assert per_example.said(True).startswith("per-example gradient norms, 4 examples of 4..16 ")
    assert per_example.said(False).startswith("per-example gradient norms, 128 examples of 8..32 ")
