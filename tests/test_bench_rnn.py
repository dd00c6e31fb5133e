"""The RNN benchmark on tiny sizes: timings, speedups against flax, table and plot come
out. No timing assertions."""

import json
import os

from hpnlp.bench import rnn as bench_rnn


def test_rnn_bench_writes_results_table_and_plot(tmp_path):
    out = str(tmp_path / "rnn")
    payload = bench_rnn.run(out, quick=True, sizes=dict(B=2, L=8, E=8, H=8),
                            impls=["hpnlp GRU", "flax GRUCell"])
    ok = [r for r in payload["results"] if r["status"] == "ok"]
    assert len(ok) == 4, payload["results"]
    assert all(r["time"]["median_s"] > 0 and r["cpu_s"] >= 0 and r["gflops"] > 0 for r in ok)
    speed = payload["summary"]["speedup_vs_flax"]
    assert set(speed) == {"hpnlp GRU"}
    assert all(speed[n][m]["wall"] > 0 for n in speed for m in ("fwd", "fwd_bwd"))
    for f in ("results.json", "results.md", "rnn_time.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0, f
    md = open(os.path.join(out, "results.md")).read()
    assert "matrix-product rate" in md and "`flax GRUCell`" in md and "vs `flax" in md
    assert json.load(open(os.path.join(out, "results.json")))["shape"]["L"] == 8
