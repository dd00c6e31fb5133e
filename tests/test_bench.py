"""The benchmark harness itself, on tiny sizes. No timing assertions: only that timings,
tables and plots come out, and that a missing peer is reported, not a crash."""

import json
import copy
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import attention as attention_lib
from hpnlp.bench import attention as bench_attention
from hpnlp.bench import harness, report
from hpnlp.stopping import Stopped


def test_time_jax_returns_ordered_stats():
    t = harness.time_jax(lambda x: x @ x, jnp.ones((64, 64)), repeats=3)
    assert t.repeats >= 3 and 0 < t.min_s <= t.median_s <= t.max_s and t.compile_s > 0
    # The memory of the same executable, from the one compile; not part of the timing dict.
    assert t.memory["argument_size_in_bytes"] == 64 * 64 * 4 and "memory" not in t.as_dict()


def test_time_interleaved_times_every_callable_in_rounds():
    order = []
    calls = {k: (lambda k=k: order.append(k)) for k in ("a", "b")}
    out = harness.time_interleaved(calls, repeats=3, warmup=1)
    assert order == ["a", "b"] * 4  # one warm-up each, then three rounds of a, b
    assert all(t.repeats == 3 and 0 <= t.min_s <= t.median_s <= t.max_s and cpu >= 0
               for t, cpu in out.values())


def test_compiled_memory_counts_temporaries():
    m = harness.compiled_memory(lambda x: (x @ x.T).sum(), jnp.ones((256, 64)))
    assert m["argument_size_in_bytes"] == 256 * 64 * 4 and m["total_bytes"] > 0


def test_fit_exponent():
    assert abs(harness.fit_exponent([1, 2, 4, 8], [3, 12, 48, 192]) - 2.0) < 1e-9


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_experiment_module_without_the_experiments_folder_says_why(tmp_path, monkeypatch):
    """A pip install ships the package without experiments/: the retrieval and softmax
    notebooks (and benches) failed in os.listdir with a bare FileNotFoundError."""
    monkeypatch.setattr(harness, "__file__", str(tmp_path / "site-packages" / "hpnlp" / "bench"
                                                 / "harness.py"))
    with pytest.raises(ValueError, match=r"experiments/lm.py: there is no experiments/ folder "
                       r"beside this hpnlp .*clone it and `pip install -e .`"):
        harness.experiment_module("lm.py")


@pytest.mark.slow  # over 8 s alone on a Xeon model 207 (2026-11-30)
def test_attention_bench_writes_table_plots_and_skips_missing_peer(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "torch_or_none", lambda: None)
    out = str(tmp_path / "b")
    payload = bench_attention.run(out, quick=True, causal=False, isolate=False,
                                  variants=["dense", "chunked"], lengths=[64, 128])
    names = {r["impl"] for r in payload["results"]}
    assert {"dense", "chunked", "jax.nn.dot_product_attention",
            "flax.linen.dot_product_attention"} <= names
    torch_rows = [r for r in payload["results"] if r["impl"].startswith("torch")]
    assert torch_rows and all(r["status"].startswith("skipped: torch not installed") for r in torch_rows)
    ok = [r for r in payload["results"] if r["status"] == "ok"]
    assert all(r["time"]["median_s"] > 0 for r in ok)
    assert all("gflops" in r for r in ok if r["impl"] in ("dense", "chunked", bench_attention.BOUND))
    # the XLA twin sits beside `chunked`'s kernel, which runs on a CPU only (elsewhere
    # `chunked` is that program: a lent H200 ran no twin row)
    twin = (bench_attention.XLA_TWIN,) if jax.default_backend() == "cpu" else ()
    for row in (bench_attention.BOUND, *twin, bench_attention.BF16_CHUNKED):
        assert {r["mode"] for r in ok if r["impl"] == row} == {"fwd", "fwd_bwd"}, row
    assert all(r["status"].startswith("skipped: torch") for r in payload["results"]
               if r["impl"] == bench_attention.BF16_TORCH)
    assert "targets" not in payload  # L=4096 was not run: no target could be measured
    for f in ("results.json", "results.md", "attention_time_fwd.png",
              "attention_time_fwd_bwd.png", "attention_memory.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0, f
    md = open(os.path.join(out, "results.md")).read()
    assert "matrix-product rate" in md and "`chunked`" in md and "skipped" in md
    assert "bfloat16 q, k, v and gradients: `chunked (bfloat16)`" in md
    assert json.load(open(os.path.join(out, "results.json")))["machine"]["cores"] >= 1


def test_chunked_products_only_bound_does_every_block_product(monkeypatch):
    # The bound's loops against the same products written densely (no softmax: S stands in
    # for P, dP for dS), with blocks small enough that there are 2 x 2 of them per head.
    from hpnlp.attention import chunked as ch
    monkeypatch.setattr(ch, "DEFAULT_BLOCK_Q", 16)
    monkeypatch.setattr(ch, "DEFAULT_BLOCK_K", 16)
    B, L, H, D = 1, 32, 2, 8
    q, k, v = bench_attention._inputs(L, B=B, H=H, D=D)
    fns = bench_attention._products_only(L, B=B, H=H, D=D)
    heads = lambda x: x[0].transpose(1, 0, 2)  # [H, L, D]
    qh, kh, vh = heads(q), heads(k), heads(v)
    s = qh @ kh.transpose(0, 2, 1)
    dp = vh @ vh.transpose(0, 2, 1)  # dO = v
    o, (dqt, dk, dv) = fns["fwd_bwd"](q, k, v)
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o, s @ vh, **tol)
    np.testing.assert_allclose(fns["fwd"](q, k, v), s @ vh, **tol)
    np.testing.assert_allclose(dqt.transpose(0, 2, 1), dp @ kh, **tol)
    np.testing.assert_allclose(dk, dp.transpose(0, 2, 1) @ qh, **tol)
    np.testing.assert_allclose(dv, s.transpose(0, 2, 1) @ vh, **tol)


# 6.1 s in the suite on the 2-core Zen 3 (2026-12-01 evening, the README command over 10 min):
# CI's slow part runs it. The default run tests no other call of `harness.isolated`: only
# how the report shows a payload's peak RSS (test_peak_memory_column_follows_the_backend_...)
@pytest.mark.slow
def test_isolated_run_reports_peak_rss_of_a_fresh_process():
    spec = dict(impl="dense", L=64, mode="fwd", causal=False, B=1, H=2, D=8, repeats=2)
    res = harness.isolated("hpnlp.bench.attention", spec, timeout_s=120)
    assert res["status"] == "ok" and res["peak_rss_bytes"] > 10 * 2**20
    bad = harness.isolated("hpnlp.bench.attention", dict(spec, impl="nope"), timeout_s=120)
    assert bad["status"].startswith("failed:")


@pytest.mark.slow
def test_train_bench_reports_mfu_and_relative_speed(tmp_path, monkeypatch):
    from hpnlp.bench import train as bench_train
    monkeypatch.setattr(bench_train, "LM_SIZES_QUICK", [("lm-tiny", 32, 1, 2, 64)])
    monkeypatch.setattr(bench_train, "PROBE_S", 0.05)
    out = str(tmp_path / "t")
    payload = bench_train.run(out, quick=True, isolate=False, variants=["chunked"], lengths=[64])
    lm = payload["summary"]["lm"]["lm-tiny"]
    assert lm["tokens_per_sec"] > 0 and 0 < lm["mfu"]
    rel = payload["summary"]["encoder_relative_to_dense"]
    assert rel["dense"][64]["relative_speed"] == 1.0 and "chunked" in rel
    # The bound row (attention replaced by its values) runs beside them, and leaves no trace
    # in the registry.
    assert bench_train.BOUND in rel and bench_train.BOUND not in attention_lib.names()
    md = open(os.path.join(out, "results.md")).read()
    assert "MFU" in md and "relative to the dense Transformer" in md
    assert os.path.getsize(os.path.join(out, "train_encoder_steps.png")) > 0
    assert all(len(r["probe_gflops"]) == 2 for r in payload["results"] if r["group"] == "encoder")
    assert 0 < lm["mfu_interleaved"] and payload["results"][0]["matmul_gflops_beside"] > 0
    assert "probed beside each row" in md and f"bound: {bench_train.BOUND}" in md


def test_train_bench_stopped_writes_its_report(tmp_path, monkeypatch):
    """A bug hunt (session 95): a Ctrl-C at the first row left --out empty; the report of
    the rows (none ran here) is written and says so."""
    from hpnlp.bench import train as bench_train
    monkeypatch.setattr(harness, "ceiling_rates", lambda quick: {"float32": 100.0})

    def stopped(spec, isolate):
        raise Stopped("stopped (SIGTERM)", 143)
    monkeypatch.setattr(bench_train, "_one", stopped)
    payload = bench_train.run(str(tmp_path), quick=True, isolate=False, variants=["chunked"],
                              lengths=[64])
    assert payload["interrupted"] == 143
    assert {r["status"] for r in payload["results"]} == {"not run: interrupted"}
    assert "**Interrupted:**" in (tmp_path / "results.md").read_text()


def test_train_bench_flags_ratios_taken_at_different_machine_speeds():
    from hpnlp.bench import train as bench_train

    def row(name, step_s, probe):
        return dict(group="encoder", name=name, L=1024, status="ok", steps_per_sec=1 / step_s,
                    peak_rss_bytes=2**30, probe_gflops=probe,
                    compiled_memory={"total_bytes": 2**30 if name == "dense" else 2**28},
                    time={"first_call_only": name == "dense"})

    payload = {"machine": harness.machine_info(), "matmul_gflops": {"float32": 200.0},
               "isolated": True,
               "results": [row("dense", 4.0, [200, 200]), row("local", 1.0, [210, 190]),
                           row("linear", 1.0, [100, 120]), row(bench_train.BOUND, 1.25, [200, 200])]}
    payload["summary"] = bench_train._summarize(payload)
    rel = payload["summary"]["encoder_relative_to_dense"]
    assert rel["local"][1024]["relative_speed"] == 4.0
    assert rel["linear"][1024]["machine_speed_ratio"] == pytest.approx(110 / 200)
    md = bench_train._markdown(payload)
    # speed / RSS / compiled memory; local clean, linear flagged
    assert "4.00x / 1.00x / 0.250x |" in md and "4.00x / 1.00x / 0.250x †" in md
    assert "memory (compiled)" in md and "model.remat='elementwise'" in md
    assert "ranged 110–200 GFLOP/s" in md and "the 1 ratio(s)" in md
    assert "first call after the compile: `dense` at 1024." in md
    # The bound (3.2x here) is the table's last row; the two 4x ratios read past it.
    assert md.index("`local`") < md.index("bound: (values only) | 3.20x")
    assert "2 ratio(s) read past it (`linear` at 1024, `local` at 1024)" in md


def test_train_encoder_cell_says_when_its_length_has_no_dense_row():
    """Review r12: a variant that ran fine where `dense` failed at that length read `ok`,
    hiding that its ratio is missing because the denominator is."""
    from hpnlp.bench import train as bench_train

    def row(name, status):
        return dict(group="encoder", name=name, L=1024, status=status, steps_per_sec=1.0,
                    compiled_memory={"total_bytes": 2**28}, time={})
    payload = {"machine": harness.machine_info(), "matmul_gflops": {"float32": 200.0},
               "isolated": False,
               "results": [row("dense", "failed: XlaRuntimeError: RESOURCE_EXHAUSTED"),
                           row("local", "ok")]}
    payload["summary"] = bench_train._summarize(payload)
    md = bench_train._markdown(payload)
    assert "| `local` | no dense row |" in md
    assert "| `dense` | failed: XlaRuntimeError: RESOURCE_EXHAUSTED |" in md


def test_a_no_isolate_run_into_an_isolated_report_is_refused(tmp_path, capsys, monkeypatch):
    """Review r12: `train --no-isolate` (and softmax's, attention's) into a recorded --out
    replaced an isolated report, its RSS columns gone under README prose that cites them.
    Refused as --quick is; into a report measured in one process it runs."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import attention as bench_attention
    from hpnlp.bench import softmax as bench_softmax
    from hpnlp.bench import train as bench_train
    for mod in (bench_train, bench_softmax, bench_attention):
        monkeypatch.setattr(mod, "main", lambda args: pytest.fail("ran; not refused"))
    for entry in ("train", "softmax", "attention"):
        (tmp_path / "results.md").write_text(f"# hpnlp benchmark: {entry}\n\n...")
        (tmp_path / "results.json").write_text(json.dumps(
            {"quick": False, "isolated": True, "results": []}))
        with pytest.raises(SystemExit) as e:
            bench_main.main([entry, "--no-isolate", "--out", str(tmp_path)])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            f"--out {tmp_path} holds a full run's report of the {entry} bench, which this "
            "--no-isolate run would replace; give another --out")
        flags = {"train": dict(variants=None),
                 "attention": dict(variants=None, lengths=None, causal=False)}.get(entry, dict(
            methods=None, vocabs=None, set=[], quality=False, seconds=None, tokenizers=None))
        args = argparse.Namespace(entry=entry, out=str(tmp_path), profile=None, quick=False,
                                  no_isolate=True, **flags)
        (tmp_path / "results.json").write_text(json.dumps(
            {"quick": False, "isolated": False, "results": []}))
        bench_main.check_args(args)  # a report measured in one process: run again so
        bench_main.check_args(argparse.Namespace(**{**vars(args), "no_isolate": False}))


# 2.8 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_softmax_bench_compares_with_full_and_reports_missing_peer(tmp_path, monkeypatch):
    from hpnlp.bench import softmax as bench_softmax
    monkeypatch.setattr(harness, "torch_or_none", lambda: None)
    out = str(tmp_path / "s")
    settings = bench_softmax.parse_settings(["full.chunk_tokens=128"], ["full"])
    # `full` timed though only `sampled` is named: the speedups' reference (a bug hunt,
    # session 101: the notebook's speedup plot was drawn empty)
    payload = bench_softmax.run(out, quick=True, isolate=False, methods=["sampled"],
                                vocabs=[256, 512], settings=settings)
    rows = {(r["impl"], r["V"]): r for r in payload["results"]}
    assert rows[("sampled", 512)]["status"] == "ok"
    assert set(payload["summary"]["speedup_vs_full"]["sampled"]) == {256, 512}
    assert rows[("full", 512)]["status"] == "ok" and rows[("full", 512)]["gflops"] > 0
    assert rows[("full", 512)]["options"] == {"chunk_tokens": 128}  # --set reaches the layer
    assert rows[(bench_softmax.TORCH_ADAPTIVE, 256)]["status"].startswith("skipped: torch")
    assert payload["summary"]["speedup_vs_full"]["full"][256] == 1.0
    for f in ("results.json", "results.md", "softmax_time.png", "softmax_memory.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0, f
    assert "V = 512" in open(os.path.join(out, "results.md")).read()
    # marked quick by the bench itself, outside the CLI's report.recorded (session 107: the
    # colab's softmax.run(quick=True) wrote a report the README sync read as a full run's)
    assert json.load(open(os.path.join(out, "results.json")))["quick"] is True


@pytest.mark.parametrize("item, message", [
    ("adaptive.chunk_logits", "write METHOD.FIELD=VALUE"),
    ("nosuch.x=1", "not a timed output layer"),
    ("adaptive.chunk=1", r"`output\.options\.chunk` = 1 .*unknown option"),
    ("adaptive.chunk_logits=big", "not a Python literal"),
    ("adaptive.div_value='x'", r"`output\.options\.div_value` = 'x' .*must be a number"),
    ("adaptive.head_bias=1", r"`output\.options\.head_bias` = 1 .*must be True or False"),
    ("nce.sampler=2", r"`output\.options\.sampler` = 2 .*must be a string"),
    ("adaptive.vocab_size=3", "is set by the bench from --vocabs, not a --set option"),
])
def test_softmax_bench_set_errors_name_the_item(item, message):
    from hpnlp.bench import softmax as bench_softmax
    with pytest.raises(harness.BenchInputError, match=message):
        bench_softmax.parse_settings([item])
    assert bench_softmax.parse_settings(["adaptive.chunk_logits=1024", "adaptive.div_value=2.0",
                                         "full.dtype='bfloat16'"]) == {
        "adaptive": {"chunk_logits": 1024, "div_value": 2.0}, "full": {"dtype": "bfloat16"}}
    with pytest.raises(harness.BenchInputError, match="not a timed output layer"):
        bench_softmax.parse_settings(["adaptive.chunk_logits=1"], ["full"])
    # the reference, timed always, takes settings beside --methods without it; the torch
    # peer is built as adaptive is set, which needs cutoffs (a review, session 118)
    assert bench_softmax.parse_settings(["full.dtype='bfloat16'"], ["sampled"]) == {
        "full": {"dtype": "bfloat16"}}
    with pytest.raises(harness.BenchInputError, match="peer is built with adaptive's cutoffs"):
        bench_softmax.parse_settings(["adaptive.cutoffs=None"])
    assert bench_softmax.peer_options(8192, {"adaptive": {"div_value": 2.0, "chunk_logits": 9}}) \
        == {"cutoffs": (64, 512, 2048), "div_value": 2.0}
    assert bench_softmax.parse_settings(["adaptive.cutoffs=(5,300)", "full.dtype='bfloat16'"],
                                        vocabs=[1000, 512]) == {  # built at each V: fine
        "adaptive": {"cutoffs": (5, 300)}, "full": {"dtype": "bfloat16"}}
    with pytest.raises(harness.BenchInputError, match="full at V=64: data type 'x' not under"):
        bench_softmax.parse_settings(["full.dtype='x'"], vocabs=[64])
    # the cutoffs at small V stay strictly increasing in (0, V) (a bug hunt: V=100 read 0 first)
    assert [bench_softmax.adaptive_cutoffs(V) for V in (3, 100, 8192)] == [
        [1], [1, 6, 25], [64, 512, 2048]]


def test_softmax_bench_help_says_the_torch_peer_is_always_timed(capsys):
    """A bug hunt (session 97): --help read "(default: all, plus torch...)", as if --methods
    left the PyTorch peer out; the bench times it always (the `vs torch adaptive` column)."""
    from hpnlp.bench.__main__ import main
    with pytest.raises(SystemExit):
        main(["softmax", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "(default: all); torch.AdaptiveLogSoftmaxWithLoss is timed beside them always" in said


def test_time_jax_max_time_caps_repeats_of_slow_calls():
    import time as _time

    import jax
    slow = lambda x: jax.pure_callback(lambda v: (_time.sleep(0.05), v)[1], x, x)  # noqa: E731
    t = harness.time_jax(slow, jnp.ones(3), repeats=20, max_time_s=0.1)
    assert 1 <= t.repeats <= 3 and not t.first_call_only
    # A warm-up call alone past the cap is the timing: no second call.
    calls = []
    slower = lambda x: jax.pure_callback(  # noqa: E731
        lambda v: (calls.append(1), _time.sleep(0.06), v)[2], x, x)
    t = harness.time_jax(slower, jnp.ones(3), repeats=5, max_time_s=0.05)
    assert t.first_call_only and t.repeats == 1 and len(calls) == 1 and t.median_s >= 0.05


@pytest.mark.slow
def test_lra_bench_reports_accuracy_beside_baseline_and_relative_speed(tmp_path, monkeypatch):
    from hpnlp.bench import lra
    tiny = dict(lra.settings(True), seq_len={"listops": 32, "text": 32, "retrieval": 32}, width=16,
                heads=2, mlp=32, batch=4, steps={"listops": 3, "text": 3, "retrieval": 3},
                eval_batches=2, listops_num_train=64, listops_num_eval=16, dense_seeds=[0, 1])
    monkeypatch.setattr(lra, "settings", lambda quick: dict(tiny))
    out = str(tmp_path / "lra")
    payload = lra.run(out, quick=True, variants=["local"], tasks=["listops"], isolate=False)
    # dense first (the base), at each seed; the other variants once
    assert [(r["variant"], r["seed"]) for r in payload["results"]] == [
        ("dense", 0), ("dense", 1), ("local", 0)]
    assert all(r["status"] == "ok" and r["steps"] == 3 for r in payload["results"])
    summ = payload["summary"]
    assert summ["dense"]["listops"]["relative_speed"] == 1.0
    assert 0.0 <= summ["local"]["listops"]["accuracy"] <= 1.0
    assert "dense (seed 1)" in summ
    spread = payload["dense_spread"]["listops"]
    accs = [r["accuracy"] for r in payload["results"] if r["variant"] == "dense"]
    assert spread["accuracies"] == accs and spread["spread"] == pytest.approx(max(accs) - min(accs))
    assert set(spread["beat"] + spread["trail"]) <= {"local"}
    # a --quick run writes no targets (at other settings than theirs: a bug hunt, session 95);
    # a run writes those of the tasks it ran (text was not asked for: not a miss)
    saved = json.load(open(os.path.join(out, "results.json")))
    assert "targets" not in payload and "targets" not in saved and saved["quick"]
    t = lra._targets(payload)
    assert list(t) == ["listops_dense_accuracy_vs_majority"]
    t, base = t["listops_dense_accuracy_vs_majority"], payload["results"][0]["baseline_accuracy"]
    assert t["bound"] == 15.0 and t["op"] == ">=" and t["value"] == pytest.approx(
        100 * (sum(accs) / 2 - base))
    md = open(os.path.join(out, "results.md")).read()
    assert "`local`" in md and "majority class" in md and "listops acc." in md
    assert "`dense (seed 1)`" in md and "seed-to-seed spread" in md and "### Targets" not in md
    assert report.QUICK_NO_TARGETS in md
    assert os.path.getsize(os.path.join(out, "lra_accuracy_speed.png")) > 0


def test_lra_relative_memory_reads_the_devices_peak_where_runs_have_one():
    """A review (session 116): on an accelerator the relative memory read each run's host
    RSS (the runtime's, ~1.0x for every variant), not the device's peak bytes in use."""
    from hpnlp.bench import lra

    def res(variant, rss, device):
        return {"task": "listops", "variant": variant, "seed": 0, "status": "ok",
                "accuracy": 0.5, "steps_per_sec": 10.0, "peak_rss_bytes": rss,
                "peak_device_bytes": device}
    gpu = lra._summarize({"tasks": ["listops"], "results": [res("dense", 100, 40),
                                                            res("local", 101, 10)]})
    assert gpu["local"]["listops"]["relative_memory"] == pytest.approx(0.25)
    cpu = lra._summarize({"tasks": ["listops"], "results": [res("dense", 100, None),
                                                            res("local", 50, None)]})
    assert cpu["local"]["listops"]["relative_memory"] == pytest.approx(0.5)


def test_lra_bench_stopped_writes_its_report(tmp_path, monkeypatch):
    """Review (session 95): a Ctrl-C lost every row of a run whose rows take up to 30 min."""
    from hpnlp.bench import lra

    def stopped(spec):
        raise Stopped("stopped (SIGTERM)", 143)
    monkeypatch.setattr(lra, "measure", stopped)
    payload = lra.run(str(tmp_path), quick=True, variants=["local"], tasks=["listops"],
                      isolate=False)
    assert payload["interrupted"] == 143
    assert {r["status"] for r in payload["results"]} == {"not run: interrupted"}
    assert "**Interrupted:**" in (tmp_path / "results.md").read_text()
    from hpnlp.bench import quality  # softmax --quality: minutes a row
    monkeypatch.setattr(quality, "train_for", lambda *a, **k: stopped(None))
    payload = quality.run(str(tmp_path / "quality"), quick=True, methods=["full"], seconds=1.0)
    assert payload["interrupted"] == 143 and payload["results"][0] == {
        "method": "full", "tokenizer": "words", "status": "not run: interrupted"}


def test_an_lra_run_of_some_variants_or_tasks_is_marked_subset(tmp_path, monkeypatch):
    """Review r6: `lra --variants dense --tasks listops` wrote a report marked whole, which
    `python -m hpnlp.bench` then kept from a full rerun into its --out and
    tools/sync_readme.py copied into README.md. The matching task beside the default two is
    more than a whole run, not a part of one."""
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import lra
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tools"))
    import sync_readme

    def measure(spec):  # no training: the mark depends on the rows asked for only
        return {"task": spec["task"], "variant": spec["variant"], "seed": spec["seed"],
                "status": "ok", "accuracy": 0.5, "eval_loss": 1.0, "baseline_accuracy": 0.2,
                "steps": 1, "steps_per_sec": 10.0, "peak_rss_bytes": None, "param_count": 1}
    monkeypatch.setattr(lra, "measure", measure)
    monkeypatch.setattr(lra, "_plot", lambda payload, out_dir: None)

    def subset(name, **kw):
        lra.run(str(tmp_path / name), isolate=False, **kw)
        return json.load(open(tmp_path / name / "results.json")).get("subset")
    assert subset("a", quick=False, variants=["dense"], tasks=["listops"]) == {
        "variants": ["dense"], "tasks": ["listops"]}
    assert bench_main._full_report(str(tmp_path / "a"), lra) is None
    monkeypatch.setattr(sync_readme, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match=re.escape(
            'the report of a run of a part of the rows (`subset`: {"variants": ["dense"]')):
        sync_readme.check_whole("a/results.md")
    assert subset("b", quick=False, variants=["local"]) == {"variants": ["dense", "local"]}
    assert subset("c", quick=False, tasks=["text"]) == {"tasks": ["text"]}
    assert subset("d", quick=False, tasks=["listops", "text", "retrieval"]) is None
    assert subset("e", quick=False, variants=attention_lib.names(),
                  tasks=["text", "listops"]) is None
    assert bench_main._full_report(str(tmp_path / "e"), lra) is not None
    assert subset("f", quick=True) is None  # marked `quick`, its three variants no subset


def test_lra_bench_configs_are_taken_as_new_runs_at_one_step_too():
    """Review r2: `lra --steps 1` failed every row, its warmup of 1 refused at one step (the
    warmup's rate 0 the only one applied); and generated ListOps is no longer than the
    rows (the bench runs it at 128: data.listops_max_length set with data.seq_len)."""
    from hpnlp.bench import lra
    from hpnlp.config import from_configdict, validate
    from hpnlp.config.checks import check_new_run
    for quick in (False, True):
        for steps in (None, 1, 2):
            s = lra.settings(quick)
            if steps:
                s["steps"] = {t: steps for t in lra.TASKS}
            for task in lra.TASKS:
                cfg = validate(from_configdict(lra._config(task, "dense", s)), num_devices=1)
                check_new_run(cfg)
                assert cfg.train.warmup_steps == {1: 0, 2: 1}.get(steps, s["steps"][task] // 10)


def test_lra_report_says_how_much_of_the_held_out_split_its_accuracy_covers(tmp_path,
                                                                             monkeypatch):
    """Review r2: "Accuracy on the held-out split", while text's is over 64 batches of 16,
    1,024 of its 1,589 windows, and its majority baseline over all of them."""
    from hpnlp.bench import lra

    def measure(spec):  # no training: the report's text depends on the settings only
        return {"task": spec["task"], "variant": spec["variant"], "seed": spec["seed"],
                "status": "ok", "accuracy": 0.5, "eval_loss": 1.0, "baseline_accuracy": 0.2,
                "steps": 1, "steps_per_sec": 10.0, "peak_rss_bytes": None, "param_count": 1}
    monkeypatch.setattr(lra, "measure", measure)
    monkeypatch.setattr(lra, "_plot", lambda payload, out_dir: None)
    lra.run(str(tmp_path), quick=False, variants=["dense"], isolate=False)
    md = (tmp_path / "results.md").read_text()
    assert "Accuracy on the held-out split" not in md
    assert ("Accuracy over the first 64 eval batches of 16 rows (at most 1,024 held-out "
            "examples, in a fixed shuffled order)") in md
    assert "1,024 of the text task's 1,589 windows" in md and "whole split" in md
    assert "1,024 of the text task's 1,589 windows" in " ".join(lra.__doc__.split())


def test_target_meets_its_bound_and_not_measured_never_does():
    assert report.target(0.7, 0.8, "<=") == {"value": 0.7, "bound": 0.8, "op": "<=", "met": True}
    assert not report.target(0.81, 0.8, "<=")["met"] and report.target(2.0, 2.0, ">=")["met"]
    assert report.target(None, 2.0, ">=") == {"value": None, "bound": 2.0, "op": ">=", "met": False}
    assert report.ratio(1.0, None) is None and report.ratio(None, 2.0) is None
    with pytest.raises(ValueError, match="op"):
        report.target(1.0, 1.0, ">")


def _targets_table(tmp_path, monkeypatch):
    """tools/targets_table.py reading records under `tmp_path`, and the path of record `b`'s
    results.json (its folder not made)."""
    import importlib
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tools"))
    tt = importlib.import_module("targets_table")
    monkeypatch.setattr(tt, "ROOT", str(tmp_path))
    return tt, tmp_path / "docs" / "benchmarks" / "b" / "results.json"


def test_a_target_whose_value_is_not_finite_is_not_met_and_the_table_takes_it(
        tmp_path, monkeypatch):
    """A bug hunt (session 103): report.target recorded an infinite value as meeting a ">="
    target, and wrote a NaN (a diverged run's loss) that tools/targets_table.py then refused
    with the whole record."""
    for value, op in ((float("inf"), ">="), (float("-inf"), "<="), (float("nan"), "<="),
                      (float("nan"), ">=")):
        assert not report.target(value, 2.0, op)["met"]
    tt, rec = _targets_table(tmp_path, monkeypatch)
    rec.parent.mkdir(parents=True)
    with open(rec, "w") as f:  # as report.write writes it: NaN
        json.dump({"targets": {"loss": report.target(float("nan"), 0.01, "<=")}}, f)
    assert [r[4:] for r in tt.rows()] == [(pytest.approx(float("nan"), nan_ok=True), "<=",
                                           0.01, False)]
    assert "| nan | <= 0.01 | **no** |" in tt.render()
    assert "| `loss` | nan | <= 0.01 | NO |" in report.targets_md(
        {"loss": report.target(float("nan"), 0.01, "<=")})


def test_targets_table_renders_measured_bound_and_met():
    md = report.targets_md({"fast": report.target(0.5, 0.8, "<="),
                            "slow": report.target(3.0, 2.0, "<="),
                            "missing": report.target(None, 1.5, ">=")})
    assert md.startswith("### Targets\n\n| target | measured | bound | met |")
    assert "| `fast` | 0.500 | <= 0.8 | yes |" in md and "| `slow` | 3.000 | <= 2.0 | NO |" in md
    assert "| `missing` | not measured | >= 1.5 | NO |" in md
    assert report.targets_md(None) == "" and report.targets_md({}) == ""
    import tempfile  # and every results.json names its bench (gqa's and kv_cache's did not)
    with tempfile.TemporaryDirectory() as out:
        report.write(out, "softmax quality", {}, "")
        assert json.load(open(os.path.join(out, "results.json"))) == {
            "benchmark": "softmax_quality"}
    assert report.targets_md({"fast": report.target(0.5, 0.8, "<=")}, quick=True).startswith(
        "No targets: this run's sizes or steps (`--quick`, `--steps`)")


def test_targets_table_names_a_bad_record_and_computes_met(tmp_path, monkeypatch):
    """A bug hunt (session 96): tools/targets_table.py on a cut results.json was a
    JSONDecodeError naming no file, a target without `op` read "None 2.5", and `met` was
    copied as stored rather than computed from value, op and bound."""
    tt, rec = _targets_table(tmp_path, monkeypatch)
    rec.parent.mkdir(parents=True)
    good = {"value": 3.0, "bound": 2.5, "op": "<=", "met": True}  # stored `met` is wrong
    rec.write_text(json.dumps({"targets": {"t": good}}))
    assert [r[4:] for r in tt.rows()] == [(3.0, "<=", 2.5, False)]
    rec.write_text(json.dumps({"targets": {"t": good}})[:20])
    with pytest.raises(SystemExit, match=r"b/results.json: cannot be read \(.*rerun its bench"):
        tt.rows()
    rec.write_text(json.dumps({"targets": {"t": {"value": 3.0, "bound": 2.5, "met": False}}}))
    with pytest.raises(SystemExit, match=r"b/results.json: target 't' = .* is not a target"):
        tt.rows()


def test_targets_table_skips_interrupted_rows_and_names_a_bad_machine(tmp_path, monkeypatch):
    """A bug hunt (session 99): OUT/interrupted (an interrupted run's rows beside a whole
    report) was counted as a record; a `machine` that was not a map, a number for its date,
    a string for its cpu_detail or null features were tracebacks; Infinity read as met."""
    tt, rec = _targets_table(tmp_path, monkeypatch)
    (rec.parent / "interrupted").mkdir(parents=True)
    good = {"value": 3.0, "bound": 2.5, "op": "<="}
    (rec.parent / "interrupted" / "results.json").write_text(json.dumps(
        {"interrupted": 130, "targets": {"t": good}}))
    machine = {"date": "2026-01-02T00:00", "cpu": "c", "cpu_detail": {"features": ["avx2"]}}
    rec.write_text(json.dumps({"targets": {"t": good}, "machine": machine}))
    assert [r[1:4] for r in tt.rows()] == [("b", "c AVX2", "2026-01-02")]
    assert "1 (target, record) pairs" in tt.render()
    # a run timed under the profiler is no record (a review, session 114)
    rec.write_text(json.dumps({"targets": {"t": good}, "machine": machine, "profiled": "/t"}))
    assert tt.rows() == []
    rec.write_text(json.dumps({"targets": {"t": good}, "machine": machine}))
    for bad, field in (("epyc", "`machine`"), ({"date": 20261205}, "`machine.date`"),
                       ({"cpu_detail": "AMD"}, "`machine.cpu_detail`"),
                       ({"cpu_detail": {"features": None}}, "`machine.cpu_detail.features`")):
        rec.write_text(json.dumps({"targets": {"t": good}, "machine": bad}))
        with pytest.raises(SystemExit, match=re.escape(f"b/results.json: {field} = ")):
            tt.rows()
    rec.write_text(json.dumps({"targets": {"t": {**good, "op": ">=", "met": True,
                                                 "value": float("inf")}}}))
    assert [r[4:] for r in tt.rows()] == [(float("inf"), ">=", 2.5, False)]  # (session 103)


def test_a_partial_record_writes_and_lists_no_target_defined_over_a_whole_run(tmp_path,
                                                                             monkeypatch):
    """Review r10: an LRA run stopped after dense seed 0, into a folder with no whole report
    (so into that folder itself), wrote `listops_dense_accuracy_vs_majority`, defined as the
    mean over dense's seeds, from that one seed, and tools/targets_table.py listed it (and
    any --quick, subset or died record's targets) as a record, while tools/sync_readme.py
    refused it for README.md."""
    from hpnlp.bench import lra
    ok = {"task": "listops", "variant": "dense", "status": "ok", "baseline_accuracy": 0.2}
    results = [dict(ok, seed=0, accuracy=0.6)] + [
        {"task": "listops", "variant": "dense", "seed": s, "status": harness.INTERRUPTED}
        for s in (1, 2)]
    payload = {"settings": {"dense_seeds": [0, 1, 2]}, "tasks": ["listops"], "results": results}
    payload["dense_spread"] = lra._dense_spread(payload)
    t = lra._targets(payload)["listops_dense_accuracy_vs_majority"]
    assert t["value"] is None and not t["met"]
    payload["results"] = [dict(ok, seed=s, accuracy=a) for s, a in ((0, 0.6), (1, 0.5), (2, 0.4))]
    payload["dense_spread"] = lra._dense_spread(payload)
    t = lra._targets(payload)["listops_dense_accuracy_vs_majority"]
    assert t["value"] == pytest.approx(30.0) and t["met"]
    tt, rec = _targets_table(tmp_path, monkeypatch)
    rec.parent.mkdir(parents=True)
    good = {"value": 3.0, "bound": 2.5, "op": ">="}
    for flag in ({"interrupted": 130}, {"interrupted": 143}, {"died": ["dense"]},
                 {"quick": True}, {"subset": {"variants": ["dense"]}}):
        rec.write_text(json.dumps({**flag, "targets": {"t": good}}))
        assert tt.rows() == [], flag
    # a record from before the key (session 99), its rows stopped: interrupted too (a review,
    # session 118: two H100 records counted whole), by the table, sync_readme and the bench
    stopped = {"targets": {"t": good}, "results": [{"status": "ok"},
                                                   {"status": harness.INTERRUPTED}]}
    rec.write_text(json.dumps(stopped))
    import sync_readme  # (tools/, on the path from _targets_table)
    assert tt.rows() == [] and sync_readme.interrupted(stopped)
    assert sync_readme.INTERRUPTED_ROW == harness.INTERRUPTED
    from hpnlp.bench import __main__ as bench_main
    assert bench_main._full_report(str(rec.parent), lra) is None
    rec.write_text(json.dumps({"interrupted": False, "quick": False, "targets": {"t": good}}))
    assert [r[:2] for r in tt.rows()] == [("t", "b")]


def test_targets_table_takes_a_record_of_some_parts(tmp_path, monkeypatch):
    """Review r6: records()' docstring promised a SystemExit for a --parts run's record, which
    the table takes on purpose: its targets are those of the parts it ran."""
    tt, rec = _targets_table(tmp_path, monkeypatch)
    rec.parent.mkdir(parents=True)
    targets = report.targets_of_parts(["distill"], {
        "distill": {"d": report.target(2.0, 1.5, ">=")},
        "prune": {"p": report.target(1.0, 1.5, ">=")}})
    rec.write_text(json.dumps({"benchmark": "compress", "parts": ["distill"],
                               "targets": targets}))
    assert [r[:2] + r[4:] for r in tt.rows()] == [("d", "b", 2.0, ">=", 1.5, True)]
    assert "### compress" in tt.render()  # the bench it names (review r6), not its folder


def test_targets_table_makes_one_table_per_bench_whatever_targets_its_records_hold(
        tmp_path, monkeypatch):
    """Review r6: records were grouped by their set of target names, so a bench that gained a
    target and was re-recorded in its main folder only split in two `### rnn` sections (the
    others' folders' common prefix `rnn_`, stripped), and README.md copied the first, which
    held the main record alone. A record's bench is the one its results.json names, else its
    results.md's title, else the start of its folder's name that names a bench module."""
    tt, rec = _targets_table(tmp_path, monkeypatch)
    t = report.target(2.0, 1.5, ">=")
    records = {"rnn": ({"benchmark": "rnn", "targets": {"a": t, "b": t, "c": t}}, None),
               "rnn_x": ({"targets": {"a": t, "b": t}}, "# hpnlp benchmark: rnn\n"),
               "rnn_y": ({"targets": {"a": t, "b": report.target(1.0, 1.5, ">=")}}, None)}
    for folder, (payload, title) in records.items():
        (rec.parent.parent / folder).mkdir(parents=True)
        (rec.parent.parent / folder / "results.json").write_text(json.dumps(payload))
        if title:
            (rec.parent.parent / folder / "results.md").write_text(title)
    md = tt.render()
    assert md.count("### rnn") == 1
    table = md.split("### rnn\n\n")[1].split("\n\n")[0].splitlines()
    assert table[0] == "| record | machine | date | `a` >= 1.5 | `b` >= 1.5 | `c` >= 1.5 | met |"
    assert [row.split(" | ", 1)[1] for row in table[2:]] == [
        "? | ? | 2 | 2 | 2 | 3 of 3 |", "? | ? | 2 | 2 | – | 2 of 2 |",
        "? | ? | 2 | **1** | – | 1 of 2 |"]
    assert [row.split(" | ")[0] for row in table[2:]] == [
        f"| [`{f}`]({f}/results.md)" for f in ("rnn", "rnn_x", "rnn_y")]
    (rec.parent.parent / "rnn_y" / "results.json").write_text(json.dumps(
        {"benchmark": "rnn\n### x", "targets": {"a": t}}))
    with pytest.raises(SystemExit, match=r"rnn_y/results.json: `benchmark` = 'rnn\\n### x' is "
                                         r"not a bench's name"):
        tt.render()


def _attention_row(impl, L, mode, median_s=None, status="ok"):
    row = {"impl": impl, "L": L, "mode": mode, "causal": False, "status": status}
    if median_s is not None:
        row["time"] = {"median_s": median_s, "min_s": median_s, "max_s": median_s}
        row["gflops"] = 1.0
    return row


def test_attention_targets_are_chunked_over_torch_at_4096():
    ba = bench_attention
    res = [_attention_row("chunked", 4096, "fwd_bwd", 0.4),
           _attention_row("torch.scaled_dot_product_attention", 4096, "fwd_bwd", 0.5),
           _attention_row("chunked", 1024, "fwd_bwd", 0.01),  # another L: not a target
           _attention_row(ba.BF16_CHUNKED, 4096, "fwd_bwd", 0.3),
           _attention_row(ba.BF16_TORCH, 4096, "fwd_bwd", status="skipped: torch not installed")]
    t = ba._targets(res)
    assert set(t) == {"chunked_vs_torch_f32", "chunked_vs_torch_bf16"}
    assert t["chunked_vs_torch_f32"] == {"value": pytest.approx(0.8), "bound": 0.8, "op": "<=",
                                         "met": True}
    assert t["chunked_vs_torch_bf16"] == {"value": None, "bound": 0.8, "op": "<=", "met": False}
    res[3:] = [_attention_row(ba.BF16_TORCH, 4096, "fwd_bwd", 0.2)]  # bf16 chunked failed
    assert ba._targets(res)["chunked_vs_torch_bf16"]["value"] is None
    res.append(_attention_row(ba.BF16_CHUNKED, 4096, "fwd_bwd", 0.3))
    assert ba._targets(res)["chunked_vs_torch_bf16"] == {"value": pytest.approx(1.5), "bound": 0.8,
                                                         "op": "<=", "met": False}


def test_attention_markdown_shows_targets_and_bf16_rows():
    ba = bench_attention
    res = [_attention_row(i, 4096, m, s) for i, s in (("chunked", 0.4), (ba.BF16_CHUNKED, 0.3))
           for m in ("fwd", "fwd_bwd")]
    payload = {"machine": harness.machine_info(), "isolated": False,
               "matmul_gflops": {"float32": 100.0, "bfloat16": 50.0},
               "shape": {"B": 1, "H": 8, "D": 64, "causal": False}, "results": res,
               "summary": {"speedup_vs_reference": {"fwd_bwd": {}}, "exponents": {},
                           "crossover_L": {}},
               "targets": ba._targets(res)}
    md = ba._markdown(payload)
    assert "float32 (bfloat16 q, k, v and gradients: `chunked (bfloat16)`;" in md
    assert "| `chunked (bfloat16)` |" in md and "1.0 (2%)" in md  # 1 GFLOP/s of the bf16 50
    assert "### Targets" in md and "| `chunked_vs_torch_f32` | not measured | <= 0.8 | NO |" in md
    del payload["targets"]
    assert "### Targets" not in ba._markdown(payload)


def test_attention_rows_follow_the_backend():
    ba = bench_attention
    cpu = ba.row_names(["dense", "chunked", "xla"], causal=False, backend="cpu")
    assert cpu == [*ba.PEERS, "dense", "chunked", ba.XLA_TWIN, ba.BOUND, ba.BF16_CHUNKED,
                   ba.BF16_TORCH]
    # On a GPU `chunked` is its Pallas kernels, so its twin runs too, and cuDNN's flash
    # attention joins; on a TPU `chunked` is its XLA program (no twin row).
    gpu = ba.row_names(["dense", "chunked"], causal=True, backend="gpu")
    assert gpu == [*ba.PEERS, "dense", "chunked", ba.XLA_TWIN, ba.BF16_CHUNKED, ba.BF16_TORCH,
                   ba.CUDNN]
    tpu = ba.row_names(["dense", "chunked"], causal=True, backend="tpu")
    assert tpu == [*ba.PEERS, "dense", "chunked", ba.BF16_CHUNKED, ba.BF16_TORCH]
    assert ba.row_names(["dense"], causal=False, backend="gpu") == [*ba.PEERS, "dense"]
    assert ba.CUDNN in ba.SHORT and ba._dtype(ba.CUDNN) == jnp.bfloat16


def test_attention_markdown_on_a_gpu_reports_device_memory():
    ba = bench_attention
    res = [_attention_row("chunked", 1024, m, 0.01) for m in ("fwd", "fwd_bwd")]
    res[1]["peak_device_bytes"] = 3 * 2**20
    machine = {**harness.machine_info(), "backend": "gpu", "devices": ["NVIDIA H100 80GB HBM3"],
               "float32_precision": "highest",
               "kernels": {"flash_gpu_blocks": {"16bit_d64": {"fwd_q": 64, "fwd_k": 32}}}}
    payload = {"machine": machine, "isolated": True, "matmul_gflops": {"float32": 100.0},
               "shape": {"B": 1, "H": 8, "D": 64, "causal": False}, "results": res,
               "summary": {"speedup_vs_reference": {"fwd_bwd": {}}, "exponents": {},
                           "crossover_L": {}}}
    md = ba._markdown(payload)
    assert "- accelerator: 1 x NVIDIA H100 80GB HBM3; float32 products at JAX precision highest" in md
    assert "peak device MiB" in md and "peak RSS MiB" not in md
    assert "- kernels: `chunked`'s GPU kernels' blocks: 16bit_d64 fwd_q=64, fwd_k=32" in md
    assert "| `chunked` |" in md and "| 3 |" in md
    cpu_run = {**harness.machine_info(), "backend": "cpu", "devices": ["cpu"]}  # wherever the test runs
    assert "accelerator" not in report.header_md(cpu_run, {})


# 2.9 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_attention_bench_interrupted_reports_what_ran(tmp_path, monkeypatch, capsys):
    ba = bench_attention
    monkeypatch.setattr(harness, "ceiling_rates", lambda dtypes, quick: {"float32": 100.0,
                                                                         "bfloat16": 100.0})
    calls = []

    def measure(spec):  # the third configuration is where Ctrl-C lands
        calls.append(spec)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return _attention_row(spec["impl"], spec["L"], spec["mode"], 0.01)
    monkeypatch.setattr(ba, "measure", measure)
    payload = ba.run(str(tmp_path), quick=True, causal=False, isolate=False,
                     variants=["dense"], lengths=[64])
    status = [r["status"] for r in payload["results"]]
    assert len(calls) == 3 and status[:2] == ["ok", "ok"]
    assert status[2:] == ["not run: interrupted"] * (len(status) - 2) and len(status) > 3
    assert "not run: interrupted" in open(tmp_path / "results.md").read()
    assert "**Interrupted:** the rows that read" in open(tmp_path / "results.md").read()
    assert payload["interrupted"] and json.load(open(tmp_path / "results.json"))["interrupted"]
    with pytest.raises(SystemExit) as exit_:  # a script sees the run was cut short
        harness.exit_if_interrupted(payload["interrupted"], str(tmp_path))
    assert exit_.value.code == 130
    harness.exit_if_interrupted(False, str(tmp_path))  # a whole run exits normally

    # --quick at the targets' L (B=1, H=4, D=32): no targets map, said (a bug hunt, session 95:
    # they read as met beside the recorded runs)
    monkeypatch.setattr(ba, "measure", lambda spec: _attention_row(spec["impl"], spec["L"],
                                                                  spec["mode"], 0.01))
    payload = ba.run(str(tmp_path / "q"), quick=True, causal=False, isolate=False,
                     variants=["chunked"], lengths=[4096])
    assert "targets" not in payload and payload["quick"]
    assert report.QUICK_NO_TARGETS in open(tmp_path / "q" / "results.md").read()
    # stopped again into that folder: its whole report is kept, the rows that ran are beside
    # it (a bug hunt, session 95: they replaced it); a whole run again leaves them
    calls.clear()
    monkeypatch.setattr(ba, "measure", measure)
    ba.run(str(tmp_path / "q"), quick=True, causal=False, isolate=False, variants=["dense"],
           lengths=[64])
    assert not json.load(open(tmp_path / "q" / "results.json"))["interrupted"]
    assert json.load(open(tmp_path / "q" / "interrupted" / "results.json"))["interrupted"]
    with pytest.raises(SystemExit):
        harness.exit_if_interrupted(130, str(tmp_path / "q"))
    assert (f"interrupted: {tmp_path / 'q' / 'interrupted'} reports the rows that ran (the whole "
            f"report of the run before is kept in {tmp_path / 'q'})") in capsys.readouterr().err
    monkeypatch.setattr(ba, "measure", lambda spec: _attention_row(spec["impl"], spec["L"],
                                                                  spec["mode"], 0.01))
    ba.run(str(tmp_path / "q"), quick=True, causal=False, isolate=False, variants=["dense"],
           lengths=[64])
    assert json.load(open(tmp_path / "q" / "interrupted" / "results.json"))["interrupted"]
    assert not json.load(open(tmp_path / "q" / "results.json"))["interrupted"]
    # a quick run of other variants says it has no targets too (a bug hunt, session 98)
    assert report.QUICK_NO_TARGETS in open(tmp_path / "q" / "results.md").read()

    def terminated(spec):  # a SIGTERM (hpnlp's handler raises Stopped): exit 143, as other CLIs
        raise Stopped("stopped (SIGTERM)", 143)
    rows, stopped = harness.run_rows([{"L": 1}, {"L": 2}], terminated, dict, desc="rows")
    assert rows == [{"L": 1, "status": "not run: interrupted"}, {"L": 2, "status":
                                                                 "not run: interrupted"}]
    with pytest.raises(SystemExit) as exit_:
        harness.exit_if_interrupted(stopped, str(tmp_path))
    assert exit_.value.code == 143


def test_a_stop_lost_in_a_gc_callback_is_sent_again_as_its_own_signal(monkeypatch):
    """A bug hunt (session 99): a SIGTERM whose Stopped landed in a garbage-collection callback
    (printed by sys.unraisablehook, lost) was sent again as a SIGINT: "interrupted", 130."""
    import _thread
    import signal
    import sys
    import types

    import hpnlp
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # pytest's own handlers kept
    sent = []  # the signal each hook call would send again, recorded instead (not to pytest)
    monkeypatch.setattr(_thread, "start_new_thread", lambda fn, args: sent.append(args[0]))
    hpnlp._interrupts_in_one_line(["python", "-m", "hpnlp.bench"])
    for e in (Stopped("stopped (SIGTERM)", 143), KeyboardInterrupt()):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(e), exc_value=e,
                                                 exc_traceback=None, err_msg=None, object=None))
    assert sent == [signal.SIGTERM, signal.SIGINT]


def test_peak_memory_column_follows_the_backend_and_isolation():
    cpu, gpu = {"backend": "cpu"}, {"backend": "gpu"}
    assert report.peak_memory(cpu, True) == ("peak_rss_bytes", "peak RSS MiB",
                                             "the peak RSS of a fresh process")
    assert "not measured" in report.peak_memory(cpu, False)[2]
    key, col, what = report.peak_memory(gpu, False)
    assert (key, col) == ("peak_device_bytes", "peak device MiB")
    assert "JAX rows not measured" in what and "max_memory_allocated" in what
    assert "fresh process" in report.peak_memory(gpu, True)[2]


def test_torch_peers_run_where_jax_runs():
    torch = pytest.importorskip("torch")
    assert harness.torch_device(torch) == ("cuda" if jax.default_backend() == "gpu"
                                           and torch.cuda.is_available() else "cpu")
    def call():
        pass
    assert harness.torch_synced(torch, "cpu", call) is call  # a CPU call blocks already


def test_machine_info_names_the_cpu_precisely(tmp_path):
    info = harness.machine_info()
    if not os.path.exists("/proc/cpuinfo") or info["machine"] not in ("x86_64", "AMD64"):
        pytest.skip("cpu_detail's vendor and family come from an x86 Linux /proc/cpuinfo")
    d = info["cpu_detail"]
    assert d["vendor"] in ("GenuineIntel", "AuthenticAMD") and isinstance(d["family"], int)
    assert isinstance(d["features"], list) and set(d["features"]) <= set(harness.KERNEL_ISA)
    assert d["features"] == sorted(d["features"])
    line = report.cpu_md(info)
    assert line.startswith(f"- CPU: {info['cpu']}; {d['vendor']} family {d['family']}")
    assert "- CPU: " in report.header_md(info, {})
    # Missing files: fields absent, no error; results recorded before cpu_detail still render.
    assert harness.cpu_detail(str(tmp_path / "no"), str(tmp_path / "no")) == {}
    old = {k: v for k, v in info.items() if k != "cpu_detail"}
    assert report.cpu_md(old) is None and "- machine: " in report.header_md(old, {})


def test_cores_and_torch_threads_are_the_cores_this_process_may_run_on(monkeypatch):
    """Review r6: the PyTorch peers got `os.cpu_count()` threads and the header said as many
    cores, where hpnlp's kernels and XLA run on the process's affinity: under a cpuset the
    peer oversubscribed its cores, and a slowed peer read as a met target."""
    import sys
    import types
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    info = harness.machine_info()
    assert info["cores"] == 1 and info["host_cpus"] == 8
    threads = []
    torch = types.SimpleNamespace(set_num_threads=threads.append)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert harness.torch_or_none() is torch and threads == [1]


def test_cpu_detail_reads_the_first_processor_and_its_caches(tmp_path):
    (tmp_path / "cpuinfo").write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC 9654\nstepping\t: 1\nflags\t\t: fpu avx2 fma avx512f "
        "avx512_bf16 sse\n\nprocessor\t: 1\nvendor_id\t: other\n")
    for i, (level, kind, size) in enumerate([("1", "Data", "32K"), ("1", "Instruction", "32K"),
                                             ("2", "Unified", "1024K"), ("3", "Unified", "32M")]):
        d = tmp_path / "cache" / f"index{i}"
        d.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(text + "\n")
    d = harness.cpu_detail(str(tmp_path / "cpuinfo"), str(tmp_path / "cache"))
    assert d == {"vendor": "AuthenticAMD", "family": 25, "model": 17, "stepping": 1,
                 "features": ["avx2", "avx512_bf16", "avx512f", "fma"],
                 "cache_bytes": {"l1d": 32 * 2**10, "l2": 2**20, "l3": 32 * 2**20}}
    line = report.cpu_md({"cpu": "AMD EPYC 9654", "cpu_detail": d})
    assert line == ("- CPU: AMD EPYC 9654; AuthenticAMD family 25, model 17, stepping 1; ISA: avx2, "
                    "avx512_bf16, avx512f, fma; caches: L1d 32 KiB per core, L2 1 MiB per core, "
                    "L3 32 MiB")


GRAVITON_CPUINFO = ("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes "
                   "pmull sha1 sha2 crc32 atomics sve\nCPU implementer\t: 0x41\n"
                   "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\n"
                   "CPU revision\t: 1\n\nprocessor\t: 1\nCPU part\t: 0xd0c\n")


def test_an_arm_cpu_is_named_and_macos_peak_rss_is_bytes(tmp_path, monkeypatch):
    """Session 107: an aarch64 Linux header read "- machine:  (aarch64)" and "- CPU: ?" (its
    /proc/cpuinfo has no model name, vendor or family, but an implementer and a part), the
    targets table called it "? (AVX2 only)", and on macOS, where ru_maxrss is in bytes, every
    peak RSS was 1024 times its size."""
    import sys
    import types
    from hpnlp import kernels
    from hpnlp.train import loop
    (tmp_path / "cpuinfo").write_text(GRAVITON_CPUINFO)
    d = harness.cpu_detail(str(tmp_path / "cpuinfo"), str(tmp_path / "no"))
    assert d == {"implementer": "0x41", "part": "0xd40", "variant": "0x1", "revision": 1,
                 "features": []}
    monkeypatch.setattr(kernels, "cpu_info", lambda: kernels._read_cpuinfo(
        str(tmp_path / "cpuinfo")))
    monkeypatch.setattr(harness.platform, "processor", lambda: "")
    monkeypatch.setattr(harness.platform, "machine", lambda: "aarch64")
    info = harness.machine_info()
    assert info["cpu"] == "aarch64" and info["cpu_detail"]["part"] == "0xd40"
    line = report.header_md(info, {}).splitlines()[2]  # (then this machine's caches)
    assert line.startswith("- CPU: aarch64; implementer 0x41, part 0xd40, variant 0x1, "
                           "revision 1; ISA: none of the kernels' extensions")
    tt, _ = _targets_table(tmp_path, monkeypatch)
    assert tt.short_machine(info) == "aarch64 (implementer 0x41, part 0xd40)"
    assert tt.machine(info) == "aarch64 (implementer 0x41, part 0xd40, variant 0x1, revision 1)"
    x86 = {"cpu": "Intel(R) Xeon(R) Processor", "machine": "x86_64",
           "cpu_detail": {"vendor": "GenuineIntel", "model": 85, "stepping": 7,
                          "features": ["avx2"]}}
    assert tt.short_machine(x86) == "Intel Xeon model 85, stepping 7 (AVX2 only)"
    x86["cpu_detail"]["features"] = []
    assert tt.short_machine(x86) == "Intel Xeon model 85, stepping 7 (x86_64)"
    # macOS: no /proc/cpuinfo; sysctl names the CPU, and ru_maxrss counts bytes
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(kernels, "cpu_info", dict)
    monkeypatch.setattr(harness.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        stdout="Apple M2\n" if cmd == ["sysctl", "-n", "machdep.cpu.brand_string"] else ""))
    assert harness.cpu_model() == "Apple M2"
    monkeypatch.setattr(harness.resource, "getrusage",
                        lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**20))
    monkeypatch.setattr(harness, "PROC_STATUS", str(tmp_path / "no"))  # no /proc: ru_maxrss
    assert harness.peak_rss_bytes() == 3 * 2**20
    assert loop._peak_memory()["host_peak_rss_bytes"] == 3 * 2**20
    monkeypatch.setattr(sys, "platform", "linux")  # KiB there
    assert harness.peak_rss_bytes() == loop._peak_memory()["host_peak_rss_bytes"] == 3 * 2**30


def test_peak_rss_is_this_process_images_own_not_its_parents(tmp_path, monkeypatch):
    """A review (session 109): on Linux ru_maxrss survives exec, so a fresh child of
    subprocess.run (vfork) read its parent's peak, and every `isolated` row read at least the
    bench parent's peak: 128 MiB touched here showed up in a child that never held it."""
    import inspect
    import subprocess
    import sys
    from hpnlp.train import loop
    # the function's own code in a fresh interpreter, without the seconds of importing JAX
    code = (f"import resource, sys\nPROC_STATUS = {harness.PROC_STATUS!r}\n"
            + inspect.getsource(harness.peak_rss_bytes) + "\nprint(peak_rss_bytes())")
    big = np.ones(2**24)  # 128 MiB, touched: this process's peak is at least that
    try:
        child = int(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                   text=True, check=True).stdout)
    finally:
        del big
    assert harness.peak_rss_bytes() >= 2**27 > 4 * child  # a bare Python's: ~14 MiB
    # the training loop's summary reads the same mark (the data and lra benches report it)
    (tmp_path / "status").write_text("Name:\tpython\nVmHWM:\t       5 kB\nVmRSS:\t 4 kB\n")
    monkeypatch.setattr(harness, "PROC_STATUS", str(tmp_path / "status"))
    assert harness.peak_rss_bytes() == loop._peak_memory()["host_peak_rss_bytes"] == 5 * 2**10


def test_the_targets_table_names_a_xeon_or_an_epyc_only_where_the_cpu_is_one(
        tmp_path, monkeypatch):
    """A review (session 109): the vendor alone named the machine, so a Ryzen read "AMD EPYC
    family 25 model 97" and a Core i7 "Intel Xeon model 154, stepping 3"."""
    tt, _ = _targets_table(tmp_path, monkeypatch)
    ryzen = {"cpu": "AMD Ryzen 9 7950X 16-Core Processor", "machine": "x86_64",
             "cpu_detail": {"vendor": "AuthenticAMD", "family": 25, "model": 97,
                            "features": ["avx2", "avx512f"]}}
    assert tt.short_machine(ryzen) == "AMD Ryzen 9 7950X 16-Core Processor"
    core = {"cpu": "12th Gen Intel(R) Core(TM) i7-12700K", "machine": "x86_64",
            "cpu_detail": {"vendor": "GenuineIntel", "family": 6, "model": 151, "stepping": 2,
                           "features": ["avx2"]}}
    assert tt.short_machine(core) == "12th Gen Intel(R) Core(TM) i7-12700K (AVX2 only)"
    # the records' own names keep their short forms (README's embedded tables)
    epyc = dict(ryzen, cpu="AMD EPYC", cpu_detail=dict(ryzen["cpu_detail"], model=17))
    assert tt.short_machine(epyc) == "AMD EPYC Zen 4"
    xeon = dict(core, cpu="Intel(R) Xeon(R) Processor")
    assert tt.short_machine(xeon) == "Intel Xeon model 151, stepping 2 (AVX2 only)"
    assert tt.short_machine(dict(core, cpu="")) == ("Intel family 6 model 151, stepping 2 "
                                                    "(AVX2 only)")


def test_quality_reports_write_the_header_that_names_the_cpu():
    """A bug hunt (session 102): softmax --quality and rnn --quality wrote a header of their
    own, "- machine: AMD EPYC, 2 cores", no CPU line; so did their recorded reports."""
    from hpnlp.bench import quality, rnn_quality
    info = {"date": "d", "cpu": "AMD EPYC", "machine": "x86_64", "cores": 2, "backend": "cpu",
            "versions": {}, "cpu_detail": {"vendor": "AuthenticAMD", "family": 25}}
    head = report.header_md(info, {})
    assert "- CPU: AMD EPYC; AuthenticAMD family 25" in head
    assert quality.markdown({"machine": info, "seconds": 1.0, "quick": True,
                             "tokenizers": ["words"], "results": []}).startswith(head + "\n\n")
    assert rnn_quality.markdown({"machine": info, "quick": True,
                                 "results": []}).startswith(head + "\n\n")
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "benchmarks")
    for folder in ("softmax_quality", "softmax_quality_bpe", "rnn_quality"):
        with open(os.path.join(root, folder, "results.json")) as f:
            machine = json.load(f)["machine"]
        with open(os.path.join(root, folder, "results.md")) as f:
            assert f.read().split("\n\n")[1] == report.header_md(machine, {}), folder


def test_recorded_reports_are_what_their_bench_renders_from_their_json():
    """Review r10: docs/benchmarks/lra/results.md (and README.md's copy) still said "Accuracy
    on the held-out split", rendered before lra._markdown said that accuracy covers the first
    eval batches. A record whose bench renders its table from results.json alone reads as
    `report.write` would write it today (re-render with the bench's markdown function, then
    `python tools/sync_readme.py`)."""
    from hpnlp.bench import compress, distill_recipes, lra, rnn_quality
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "benchmarks")
    for folder, title, markdown in (
            ("lra", "lra", lra._markdown), ("rnn_quality", "rnn quality", rnn_quality.markdown),
            ("compress", "compress", compress._markdown),
            ("distill_recipes", "distill_recipes", distill_recipes._markdown),
            ("distill_recipes_lm", "distill_recipes", distill_recipes._markdown)):
        with open(os.path.join(root, folder, "results.json")) as f:
            payload = json.load(f)
        assert not payload.get("interrupted"), folder  # (report.write's note would lead)
        with open(os.path.join(root, folder, "results.md")) as f:
            assert f.read() == f"# hpnlp benchmark: {title}\n\n{markdown(payload)}\n", folder


def test_quant_bench_targets_and_table_from_a_payload():
    from hpnlp.bench import quant
    ms = lambda s: {"median_s": s, "min_s": s, "max_s": s, "repeats": 1, "compile_s": 0.0,  # noqa: E731
                    "first_call_only": False}
    linear = [{"impl": n, "time": ms(t), "gops": 1.0, "frac_of_f32_rate": 0.5}
              for n, t in (("float32 (XLA)", 0.30), ("int8 w8a8 (kernel)", 0.10),
                           ("binary (kernel)", 0.01), ("torch quantize_dynamic int8 Linear", 0.2))]
    lm = [{"variant": v, "prefill_s": p, "prefill_tokens_per_s": 1.0 / p,
           "decode_b1_tokens_per_s": d, "decode_b16_tokens_per_s": d}
          for v, p, d in (("float32", 0.4, 100.0), ("w8a8 (int8 kernel)", 0.1, 150.0),
                          ("int4 weight-only (int4 kernel)", 0.2, 250.0))]
    quality = [{"model": "byte LM", "variant": v, "eval": {"loss": 2.0 * (1 + r)}, "accuracy": None,
                "loss_rel_increase": r, "size_bytes": 1024, "forward_s": 0.01}
               for v, r in (("float32", 0.0), ("PTQ w8a8", 0.004), ("QAT int4", 0.03))]
    t = quant._targets(linear, lm, quality)
    assert t["int8_kernel_vs_f32"]["value"] == pytest.approx(3.0) and t["int8_kernel_vs_f32"]["met"]
    assert t["binary_kernel_vs_f32"]["value"] == pytest.approx(30.0)
    assert t["int8_kernel_vs_torch"]["value"] == pytest.approx(2.0)
    assert t["int4_decode_vs_f32"]["value"] == pytest.approx(2.5) and t["int4_decode_vs_f32"]["met"]
    assert t["w8a8_forward_vs_f32"]["value"] == pytest.approx(4.0)
    assert t["w8a8_loss_rel_increase"]["met"] and not t["qat_int4_loss_rel_increase"]["met"]
    payload = {"sizes": quant.SIZES["quick"], "machine": {
        "date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu", "versions": {}},
        "f32_rate": 100.0, "kernel_layout": {}, "linear": linear, "lm": lm, "quality": quality,
        "targets": t, "_f32_time": 0.30}
    md = quant._markdown(payload)
    assert "### Targets" in md and "`qat_int4_loss_rel_increase`" in md and "| NO |" in md
    assert "3.00x" in md  # int8 kernel vs float32 in the layer table
    # a part --parts left out has no table (a bug hunt, session 98: an empty one was drawn)
    md = quant._markdown(dict(payload, lm=[], quality=[]))
    assert "### Linear layer" in md and "### LM decoding" not in md and "### Quality" not in md


def test_quant_report_is_dated_when_the_run_starts(tmp_path, monkeypatch):
    """A bug hunt (session 102): quant read the date after its three parts, every other
    bench before its work. (The work faked: only the order is checked.)"""
    from hpnlp import kernels as kernel_build
    from hpnlp.bench import quant
    from hpnlp.compress import kernels
    calls = []
    info = {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
            "versions": {}}
    monkeypatch.setattr(harness, "machine_info", lambda: calls.append("date") or info)
    monkeypatch.setattr(kernel_build, "reuse_freed_memory", lambda: calls.append("work"))
    monkeypatch.setattr(harness, "matmul_rate", lambda *a, **k: calls.append("work") or 1.0)
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "none")
    got = quant.run(str(tmp_path), quick=True, parts=())
    assert got["repeats"] == 3  # (session 107)
    assert calls == ["date", "work", "work"]
    # the parts it ran are its own payload's (a review, session 116: a call from Python, not
    # through the CLI's wrapper, read as a whole run)
    assert got["parts"] == [] and json.load(open(tmp_path / "results.json"))["parts"] == []


def test_recorded_reports_name_only_plots_kept_beside_them():
    """A bug hunt (session 102): softmax_h200_chunk_logits/*/results.md read "Plots:
    `softmax_time.png`, ..." in folders that hold none."""
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = []
    for md in glob.glob(os.path.join(root, "docs", "benchmarks", "**", "results.md"),
                        recursive=True):
        with open(md) as f:
            lines = [line for line in f if re.match(r"Plots?: ", line) and "not kept" not in line]
        missing += [f"{os.path.relpath(md, root)}: {name}" for line in lines
                    for name in re.findall(r"`([^`]+\.png)`", line)
                    if not os.path.exists(os.path.join(os.path.dirname(md), name))]
    assert not missing


def test_compress_plot_sizes_a_pruned_row_by_its_pruned_kernels(tmp_path, monkeypatch):
    """A review (session 118): the quality-against-size plot took a pruned row's sparsity of
    every parameter (the 95% runs at a third of their nonzeros), and joined two parts'
    "dense, scratch" baselines in one line."""
    from hpnlp.bench import compress
    assert compress.prunable_params("byte LM") == 2 * (128 * 384 + 128 * 128 + 2 * 128 * 512)
    drawn = []
    import matplotlib.axes
    real = matplotlib.axes.Axes.plot

    def plot(self, xs, ys, *a, label=None, **kw):
        drawn.append((label, list(xs)))
        return real(self, xs, ys, *a, label=label, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    row = dict(model="byte LM", params=445184, size_bytes=4 * 445184, value=1.4)
    compress._plot({"prune": [dict(row, method="prune magnitude", sparsity=0.95)],
                    "structured": [dict(row, method="dense, scratch")],
                    "lowrank": [dict(row, method="dense, scratch", params=100)]}, str(tmp_path))
    got = dict(drawn)
    assert got["prune magnitude"] == [pytest.approx(4 * (445184 - 0.95 * 393216) / 1024)]
    assert {"dense, scratch (structured)", "dense, scratch (lowrank)"} <= set(got)
    assert (tmp_path / "quality_vs_size.png").exists()


def test_compress_bench_targets_and_table_from_a_payload():
    from hpnlp.bench import compress

    # the size searches: bisection finds what the exhaustive search finds
    rng = np.random.default_rng(0)
    for _ in range(100):
        values = np.sort(rng.choice(1000, rng.integers(1, 30), replace=False)).tolist()
        size = (lambda v: v * v) if rng.random() < 0.5 else (lambda v: -3 * v)
        lo, hi = sorted((size(values[0]), size(values[-1])))
        target = rng.uniform(lo - 50, hi + 50)
        best = min(abs(size(v) - target) for v in values)
        assert abs(size(compress.closest(values, size, target)) - target) == best

    def row(model, method, value, params=1000, fwd=0.02, teacher_fwd=0.04, **kw):
        return {"model": model, "method": method, "setting": "", "params": params,
                "size_bytes": params * 4, "metric": "loss" if model == "byte LM" else "accuracy",
                "value": value, "eval": {}, "forward_s": fwd, "teacher_forward_s": teacher_fwd, **kw}
    distill = [row("byte LM", "teacher", 1.5, 4000, 0.04), row("byte LM", "student, scratch", 2.1),
               row("byte LM", "student, distilled", 1.9), row("byte LM", compress.DISTILLED, 1.7),
               row("text classifier", "teacher", 0.80),
               row("text classifier", "student, scratch", 0.60, seed_values=[0.62, 0.58]),
               row("text classifier", "student, distilled", 0.7),
               row("text classifier", compress.DISTILLED, 0.65)]
    # the size target reads Deep Compression's row, whichever comes first
    pipeline = [row("byte LM", "low rank + w8a8", 1.55, teacher_size_bytes=16000),
                row("byte LM", compress.PIPELINE, 1.8, teacher_size_bytes=16000)]
    pipeline[1]["size_bytes"] = 1000
    structured = [row("byte LM", "structured prune + shrink", 1.53, 2000, fwd=0.025,
                      half_params=True, teacher_value=1.5),
                  row("byte LM", "dense, scratch", 1.6, 2000, fwd=0.025, teacher_value=1.5)]
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "distill": distill, "structured": structured, "pipeline": pipeline,
               "prune": [row("byte LM", "prune magnitude", 1.6, fwd=0.04, sparsity=0.9,
                             sparse="w_sparse", sparse_forward_s=0.016)]}  # served sparse too
    t = payload["targets"] = compress._targets(payload)
    assert t["distill_gap_closed_lm"]["value"] == pytest.approx(0.4 / 0.6)  # loss: lower is better
    assert t["distill_gap_closed_lm"]["met"]
    assert t["distill_gap_closed_text"]["value"] == pytest.approx(0.25)  # accuracy: higher is better
    assert not t["distill_gap_closed_text"]["met"]
    assert t["pipeline_size_ratio"]["value"] == pytest.approx(16.0) and t["pipeline_size_ratio"]["met"]
    assert t["structured_half_params_speedup"]["value"] == pytest.approx(1.6)
    assert t["structured_half_params_loss_rel"]["value"] == pytest.approx(0.02)
    assert t["lowrank_half_params_speedup"]["value"] is None  # not run: never met
    assert not t["lowrank_half_params_speedup"]["met"]
    md = compress._markdown(payload)
    assert "`distill_gap_closed_text`" in md and "| NO |" in md and "2.00x" in md  # student vs teacher
    assert "structured prune + shrink" in md and "1.60x" in md
    assert "| 1.00x; sparse 2.50x |" in md  # the pruned model dense, then served sparse
    assert "text classifier, student, scratch: 0.6200, 0.5800" in md  # a mean's seeds
    assert (f"Gap closed, byte LM: `student, distilled` 0.333, `{compress.DISTILLED}` 0.667 "
            "(the last, the targets' row).") in md  # a row not run is left out
    # a scratch student past the teacher leaves no gap to close: not measured, not met (a
    # review, session 116: a worse distilled student read as closing 5 times the gap)
    assert compress.gap_closed(0.470, 0.495, 0.490, "accuracy") is None
    assert compress.gap_closed(1.45, 1.38, 1.40, "loss") is None
    assert compress.gap_closed(0.65, 0.60, 0.80, "accuracy") == pytest.approx(0.25)
    md = compress._markdown(dict(payload, distill=distill[:-1]))  # no targets' row
    assert "Gap closed, text classifier: `student, distilled` 0.5.\n" in md
    # each model's students: soft targets alone, its recipe's initialization alone, its recipe
    # (the initialization alone once, where that is the recipe)
    for model, recipe in compress.TARGETS_RECIPE.items():
        rows = compress.distilled_students(model)
        alone = {k: v for k, v in recipe.items() if k in ("init", "init_blocks")} | {"alpha": 0.0}
        assert len(rows) == (2 if alone == recipe else 3)
        assert rows[-1][:3] == (compress.DISTILLED, compress.recipe_setting(recipe), recipe)
        assert rows[1][2] == alone
    assert compress.recipe_setting(dict(alpha=0.5, temperature=1.0, init="select", attention=1.0)
                                   ) == "init=select, T=1, alpha=0.5, attention 1"
    assert compress.recipe_setting(dict(alpha=0.0, init="importance", init_blocks="last")
                                   ) == "init=importance, last blocks, alpha=0"


def test_moe_bench_targets_and_table_from_a_payload():
    from hpnlp.bench import moe

    def lm(name, experts, loss, loads=()):
        return {"name": name, "experts": experts, "top_k": 1, "params": 1000 * (experts or 1),
                "eval_loss": loss, "tokens_per_sec": 1e4, "eval_loss_equal_time": loss + 0.1,
                "step_equal_time": 100, "evals": [{"step": 200, "loss": loss, "train_s": 10.0}],
                "load": [{"step": s, "load": [[0.5, 0.5]], "max_vs_mean": v, "dropped": 0.0}
                         for s, v in loads], "warmup_steps": 10}
    layer = [{"tokens": 8192, "dispatch": "dense MLP", "total_s": 0.2, "vs_dense": 1.0},
             {"tokens": 8192, "dispatch": "capacity 1.0", "total_s": 0.24, "vs_dense": 1.2,
              "split_s": {"routing": 0.01, "dispatch": 0.01, "experts": 0.2, "combine": 0.02}},
             {"tokens": 8192, "dispatch": "dropless", "total_s": 0.3, "vs_dense": 1.5,
              "split_s": {"routing": 0.01, "dispatch": 0.01, "experts + combine": 0.28}}]
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "lm": [lm("dense", 0, 2.0), lm("E=8 top-1", 8, 1.95, [(5, 9.0), (20, 1.5), (30, 1.7)])],
               "layer": layer, "parallel": [{"mesh": {"expert": 8}, "all_to_all_ops": 8,
                                             "hlo_bytes_per_device": 100, "formula_bytes_per_device": 100,
                                             "sent_off_device_bytes": 87}]}
    t = payload["targets"] = moe._targets(payload)
    assert t["moe_layer_overhead_vs_dense_8k"] == {"value": 1.2, "bound": 1.3, "op": "<=", "met": True}
    assert t["moe_e8_top1_eval_loss_vs_dense"]["value"] == pytest.approx(-0.05)
    assert t["moe_e8_top1_eval_loss_vs_dense"]["met"]
    assert t["max_expert_load_vs_mean"]["value"] == 1.7  # the window at step 5 is warmup
    md = moe._markdown(payload)
    assert "-0.0500" in md and "1.20x" in md and "(in experts)" in md and "### Targets" in md
    # its LM runs reused from --workdir said (a review, session 118: "lm 0", unexplained)
    md = moe._markdown({**payload, "seconds": {"lm": 0.07, "layer": 30.0}, "reused_runs": 7})
    assert ("Wall time per part (s): lm 0, layer 30. 7 finished runs were reused from "
            "--workdir, so their training is not in these times.") in md


def test_a_part_left_out_has_no_targets_not_missed_ones():
    """A bug hunt (session 103): moe, quant, compress and retrieval wrote the targets of the
    parts --parts left out as `not measured ... NO` (lra leaves out a task --tasks left
    out); a payload that timed no parts (older ones) keeps them all."""
    from hpnlp.bench import compress, moe, quant, retrieval
    layer = [{"tokens": 8192, "dispatch": "capacity 1.0", "total_s": 1.1, "vs_dense": 1.1}]
    assert list(moe._targets({"seconds": {"layer": 1.0}, "layer": layer, "lm": []})) == [
        "moe_layer_overhead_vs_dense_8k"]
    assert len(moe._targets({"layer": layer, "lm": []})) == 3
    assert list(quant._targets([], [], [], ("lm",))) == ["int4_decode_vs_f32",
                                                         "w8a8_forward_vs_f32"]
    assert len(quant._targets([], [], [])) == 7
    assert list(compress._targets({"seconds": {"pipeline": 1.0, "forward timing": 1.0}})) == [
        "pipeline_size_ratio"]
    knn = [{"lm": "bytes", "test": {"ppl_reduction": 0.1}}]
    assert retrieval._targets({"seconds": {"knnlm": 1.0}, "knnlm": knn}) == {
        "knn_lm_ppl_reduction_bytes": report.target(0.1, 0.05, ">="),
        "knn_lm_ppl_reduction_words": report.target(None, 0.05, ">=")}


def test_retrieval_approximate_targets_are_not_measured_without_the_exact_row():
    """Session 107: where the exact row at the largest n was missing (failed, or skipped for
    memory) but ivf rows ran, both approximate-search targets read "measured 0.000"."""
    from hpnlp.bench import retrieval
    ivf = [{"n": 1000, "index": "ivf", "qps": 500.0, "recall": 0.95}]
    exact = {"n": 1000, "index": "exact", "qps": 400.0, "gflops": 8.0, "matmul_gflops": 10.0}
    names = ("approx_recall_at_5x_qps", "approx_qps_vs_exact_at_0.9_recall")
    for rows in (ivf, [{**exact, "missing": "skipped: too big"}, *ivf]):
        t = retrieval._targets({"seconds": {"search": 1.0}, "search": rows})
        assert [t[k]["value"] for k in (*names, "exact_search_matmul_fraction")] == [None] * 3
    # measured, and none fast enough: 0, as before
    t = retrieval._targets({"seconds": {"search": 1.0}, "search": [exact, *ivf]})
    assert [t[k]["value"] for k in names] == [0.0, pytest.approx(1.25)]


def test_speculative_bench_table_from_a_payload():
    from hpnlp.bench import speculative

    def row(mode, batch, draft, k, sec, **kw):
        return dict({"target": "wide", "target_params": 1000, "target_loss": 1.5, "mode": mode,
                     "batch": batch, "draft": draft, "k": k, "draft_params": 100 if k else None,
                     "draft_loss": 1.7 if k else None, "seconds": sec,
                     "tokens_per_s": 10 / sec, "speedup": 2.0 / sec}, **kw)
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": speculative.SIZES["quick"], "seconds": {"train": 5.0, "decode": 2.0},
               "rows": [row("greedy", 2, "target alone", 0, 2.0),
                        row("greedy", 1, "target alone", 0, 2.0),
                        row("greedy", 1, "distilled", 2, 1.0, acceptance=0.75,
                            tokens_per_call=2.5, equals_target=True),
                        row("greedy", 1, "scratch", 2, 2.5, acceptance=0.25, tokens_per_call=1.5,
                            equals_target=False)]}
    md = speculative._markdown(payload)
    assert "### wide: 1,000 parameters, eval loss 1.5000" in md
    assert "| 1 | greedy | distilled | 2 | 10.0 | 2.00x | 0.75 | 2.5 | yes |" in md
    assert "| 1 | greedy | scratch | 2 | 4.0 | 0.80x | 0.25 | 1.5 | **no** |" in md
    assert "| 1 | greedy | target alone | – | 5.0 | 1.00x | – | – | – |" in md
    assert md.index("| 1 | greedy | scratch") < md.index("| 2 | greedy | target alone")  # by batch
    assert "batch 1 (one prompt a call) and batch 2" in md


def test_data_bench_targets_and_table_from_a_payload():
    from hpnlp.bench import data as bench_data
    prep = {"mb_per_sec": 50.0, "seconds": 40.0, "train_tokens": 2_000_000, "train_documents": 500}
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes_bytes": {"small": 20 * 2**20, "large": 2 * 2**30}, "steps": 200,
               "prepare": {"small": prep, "large": {"reused": "/x"}},
               "loader": {"status": "ok", "tokens_per_sec": 2e6},
               "in_memory_loader": {"status": "failed: boom"},
               "train": {"small": {"status": "ok", "tokens_per_sec": 1e4, "peak_rss_bytes": 1000},
                         "large": {"status": "ok", "tokens_per_sec": 2e4, "peak_rss_bytes": 1300}}}
    t = payload["targets"] = bench_data._targets(payload)
    assert t["loader_vs_step_tokens"] == {"value": 100.0, "bound": 10.0, "op": ">=", "met": True}
    assert t["rss_2gb_vs_20mb"]["value"] == pytest.approx(1.3) and not t["rss_2gb_vs_20mb"]["met"]
    md = bench_data._markdown(payload)
    assert "| 2 GB corpus | reused |" in md and "2,000,000 tokens/s" in md and "failed: boom" in md
    assert "`--quick`" not in md and "### Targets" in md
    quick = {**payload, "quick": True, "sizes_bytes": {"small": 2 * 2**20, "large": 20 * 2**20}}
    del quick["targets"]  # a --quick run has none (`rss_2gb_vs_20mb` at 20 MB over 2 MB)
    assert report.QUICK_NO_TARGETS in bench_data._markdown(quick)
    payload["train"]["large"] = {"status": "failed: killed (out of memory?)"}
    assert bench_data._targets(payload)["rss_2gb_vs_20mb"] == {"value": None, "bound": 1.2,
                                                              "op": "<=", "met": False}


def test_an_interrupted_data_bench_removes_its_own_folder(tmp_path, monkeypatch):
    """A review (session 116): without --workdir the bench's temporary folder (a 2 GB text
    and its shards) was removed at its normal end only: a Ctrl-C left it in /tmp."""
    from hpnlp.bench import data as bench_data
    seen = []

    def interrupted(root, *args):
        seen.append(root)
        os.makedirs(root, exist_ok=True)
        open(os.path.join(root, "large_2048MB.txt"), "w").close()
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_data, "_run_in", interrupted)
    monkeypatch.setattr(bench_data.harness, "machine_info", lambda: {})
    with pytest.raises(KeyboardInterrupt):
        bench_data.run(str(tmp_path / "out"), quick=True)
    assert seen and not os.path.exists(seen[0])
    with pytest.raises(KeyboardInterrupt):  # a --workdir is the user's: kept
        bench_data.run(str(tmp_path / "out"), quick=True, workdir=str(tmp_path / "w"))
    assert seen[1] == str(tmp_path / "w") and os.path.exists(seen[1])


def test_data_bench_reuses_a_prepared_folder_of_its_own_size_only(tmp_path, monkeypatch):
    """A bug hunt: the full run reused a --quick run's 2 and 20 MB folders as its 20 MB and
    2 GB corpora, their counts shown as 0 (now: named by size, counts read from meta.json)."""
    from hpnlp.bench import data as bench_data
    from hpnlp.bench import report
    prepared = []

    def prepare(text, out):
        os.makedirs(out)
        (tmp_path / "w" / "shard").write_bytes(b"x" * 10)
        splits = {k: {"shards": ["../shard"], "documents": 3, "tokens": 40} for k in
                  ("train", "eval")}
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump({"splits": splits}, f)
        prepared.append(os.path.basename(out))
        return {"mb_per_sec": 1.0, "seconds": 1.0}
    monkeypatch.setattr(bench_data, "_write_text", lambda path, size: open(path, "w").close())
    monkeypatch.setattr(bench_data, "_prepare", prepare)
    monkeypatch.setattr(bench_data, "_isolated", lambda spec: {"status": "failed: not run"})
    monkeypatch.setattr(report, "write", lambda *a: None)
    bench_data.run(str(tmp_path / "o"), quick=True, workdir=str(tmp_path / "w"))
    p = bench_data.run(str(tmp_path / "o"), quick=False, workdir=str(tmp_path / "w"))
    assert prepared == ["prepared_2MB", "prepared_20MB", "prepared_2048MB"]
    assert p["prepare"]["small"] == {"reused": str(tmp_path / "w" / "prepared_20MB"),
                                     "prepared_bytes": 20, "train_documents": 3,
                                     "train_tokens": 40, "eval_documents": 3, "eval_tokens": 40}


def test_data_bench_keeps_its_text_for_an_unfinished_preparation(tmp_path, monkeypatch):
    """A bug hunt (session 99): after a Ctrl-C the rerun wrote the text again, so prepare found
    it changed since its checkpoint and refused to resume; a failed run left the text (2 GiB)
    behind. Now a text there (whole: written beside it, then moved) is reused, and removed
    unless an unfinished preparation needs it."""
    from hpnlp.bench import data as bench_data
    from hpnlp.data.prepare import PROGRESS_FILE
    write, written, seen = bench_data._write_text, [], []
    monkeypatch.setattr(bench_data, "_write_text",
                        lambda path, size: (written.append(path), write(path, size)))

    def prepare(text, out):  # 1st: a Ctrl-C after a checkpoint; 2nd: done; 3rd: an error
        seen.append(os.stat(text).st_mtime_ns)
        os.makedirs(out, exist_ok=True)
        if len(seen) == 1:
            open(os.path.join(out, PROGRESS_FILE), "w").close()
            raise Stopped("interrupted; rerun the same command to continue from it", 130)
        if len(seen) == 3:
            raise SystemExit(f"prepare failed on {text}")
        return {"done": True}
    monkeypatch.setattr(bench_data, "_prepare", prepare)
    text, out = str(tmp_path / "large_1MB.txt"), str(tmp_path / "prepared")
    with pytest.raises(Stopped):
        bench_data._prepare_text(text, 100, out)
    assert os.path.getsize(text) == 100  # kept, whole (no .tmp beside it)
    assert sorted(os.listdir(tmp_path)) == ["large_1MB.txt", "prepared"]
    assert bench_data._prepare_text(text, 100, out) == {"done": True}
    assert len(written) == 1 and seen[0] == seen[1] and not os.path.exists(text)
    with pytest.raises(SystemExit):
        bench_data._prepare_text(text, 100, str(tmp_path / "other"))
    assert len(written) == 2 and sorted(os.listdir(tmp_path)) == ["other", "prepared"]


def test_softmax_quality_trains_every_method_on_one_schedule_whatever_its_speed():
    """Review r10: a warmup of 50 steps in a fixed time budget left `full` (40 timed steps) at
    0.8x the rate and `class_based` (10) at 0.2x while the fast methods trained at the full
    rate. Every method now starts at the rate; a record made with the warmup says which rows
    ended inside it."""
    from hpnlp.bench import quality
    from hpnlp.train.state import learning_rate_schedule
    for t in quality.TOKENIZERS:
        for m in ("full", "class_based", "sampled"):
            train = quality._config(m, False, t).train
            assert train.warmup_steps == 0 and train.schedule == "constant", (t, m)
            assert float(learning_rate_schedule(train)(0)) == pytest.approx(train.lr)
    info = {"date": "d", "cpu": "c", "machine": "x86_64", "cores": 2, "backend": "cpu",
            "versions": {}}
    results = [{"method": m, "tokenizer": "bpe", "vocab_size": 32000, "steps": n,
                "perplexity": 1.0, "ppl_vs_full": 0.0, "within_5pct": True, "speedup": 1.0,
                "per_word_ppl": 1.0} for m, n in (("full", 40), ("class_based", 10),
                                                  ("sampled", 280))]
    payload = {"machine": info, "seconds": 60.0, "quick": False, "tokenizers": ["bpe"],
               "results": results}
    recorded = quality.markdown(payload)  # the committed records: no `warmup_steps`
    assert "after 50 warmup steps" in recorded
    assert ("Ended inside the warmup (the share of the lr its last step applied): `full` 0.8x, "
            "`class_based` 0.2x.") in recorded
    now = quality.markdown(dict(payload, warmup_steps=quality.WARMUP_STEPS))
    assert "from the first step (no warmup" in now and "inside the warmup" not in now


def test_softmax_quality_compares_each_tokenization_with_its_own_full(tmp_path, monkeypatch):
    from hpnlp.bench import quality
    ppl = {("words", "full"): 80.0, ("words", "sampled"): 82.0, ("bpe", "full"): 100.0,
           ("bpe", "sampled"): 120.0}

    def fake_train_for(method, seconds, workdir, *, quick, tokenizer):
        if method == "nce":
            raise RuntimeError("boom")
        p = ppl[(tokenizer, method)]
        return {"method": method, "tokenizer": tokenizer, "vocab_size": quality.TOKENIZERS[tokenizer][1],
                "steps": 10 if method == "full" else 30, "train_seconds": 1.0,
                "steps_per_sec": 10.0 if method == "full" else 30.0, "eval_loss": np.log(p),
                "perplexity": p, "per_word_ppl": p * 1.1, "bits_per_byte": 1.5}

    monkeypatch.setattr(quality, "train_for", fake_train_for)
    out = str(tmp_path / "q")
    payload = quality.run(out, quick=True, methods=["sampled", "nce"], seconds=1.0)
    assert payload["subset"] == {"methods": ["full", "sampled", "nce"]}  # session 102
    rows = {(r["tokenizer"], r["method"]): r for r in payload["results"]}
    assert [k for k in rows if k[0] == "bpe"] == [("bpe", "full"), ("bpe", "sampled"), ("bpe", "nce")]
    assert rows[("words", "sampled")]["ppl_vs_full"] == pytest.approx(0.025)
    assert rows[("words", "sampled")]["within_5pct"] and rows[("bpe", "sampled")]["speedup"] == 3.0
    assert rows[("bpe", "sampled")]["ppl_vs_full"] == pytest.approx(0.2)
    assert not rows[("bpe", "sampled")]["within_5pct"]
    assert rows[("bpe", "nce")]["status"] == "failed: RuntimeError: boom"
    assert payload["warmup_steps"] == 0  # the next record's markdown says so
    md = open(os.path.join(out, "results.md")).read()
    assert "**Words, V = 12070**" in md and "**BPE subwords, V = 32000**" in md
    assert "| `sampled` | 120.0 | 132.0 | +20.0% | no | 30 | 3.00x |" in md  # per word beside
    assert "| `sampled` | 82.0 | +2.5% | yes | 30 | 3.00x |" in md
    assert os.path.getsize(os.path.join(out, "softmax_quality.png")) > 0
    only = quality.run(str(tmp_path / "b"), quick=True, methods=["sampled"], seconds=1.0,
                       tokenizers=["bpe"])
    assert {r["tokenizer"] for r in only["results"]} == {"bpe"}
    with pytest.raises(ValueError, match="choose from"):
        quality.run(str(tmp_path / "c"), quick=True, tokenizers=["chars"])


def test_prune_transfer_bench_compares_criteria_on_the_lms_trunk_from_a_payload(tmp_path):
    from hpnlp.bench import compress, prune_transfer as pt
    s = compress.SIZES["quick"]
    cls, lm = pt.classifier(s, 6), compress.experiment("byte LM", s)
    fields = ("width", "depth", "num_heads", "mlp_dim", "max_len")
    assert [getattr(cls.model, f) for f in fields] == [getattr(lm.model, f) for f in fields]
    assert cls.data.task == "doc_classify" and cls.train.steps == 6 and cls.model.causal
    assert cls.data.seq_len == lm.data.seq_len

    def row(method, sp, acc):
        return {"method": method, "sparsity": sp, "accuracy": acc, "loss": 1.0, "params": 10}
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": {"steps": 200, "sparsities": [0.9]}, "lm": {"loss": 1.4, "params": 12},
               "majority_accuracy": 0.29,
               "rows": [row(pt.SCRATCH, 0.0, 0.4), row(pt.DENSE, 0.0, 0.6),
                        row("magnitude", 0.9, 0.5), row("movement", 0.9, 0.55),
                        row("random", 0.9, 0.3)]}
    assert pt.margins(payload) == {0.9: pytest.approx(0.05)}
    md = pt._markdown(payload)
    assert "| 90% | 0.5000 | 0.5500 | 0.3000 | +0.0500 |" in md
    assert "from the LM's trunk 0.6000; from scratch 0.4000" in md and "200 steps" in md
    pt._plot(payload, str(tmp_path))
    assert (tmp_path / "accuracy_vs_sparsity.png").exists()


def test_distill_recipes_bench_reads_gap_closed_on_validation_from_a_payload(tmp_path):
    from hpnlp.bench import distill_recipes

    def row(method, value, seeds=None, gap=None):
        return {"model": "text classifier", "method": method, "params": 100, "value": value,
                "seed_values": seeds, "gap_closed": gap}
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": {"student_steps": {"text classifier": 200}}, "seeds": 2,
               "teacher": {"value": 0.6, "params": 400},
               "recipes": [row("student, scratch", 0.4, [0.38, 0.42]),
                           row("selected weights, T=1, alpha=0.5", 0.55, [0.54, 0.56], 0.75),
                           row("selected weights, T=2, alpha=0.5", 0.5, [0.5, 0.5], 0.5)],
               "seconds": 12.0, "reused_runs": 0}
    md = distill_recipes._markdown(payload)
    assert "| selected weights, T=1, alpha=0.5 | 0.5500 | 0.5400, 0.5600 | 0.750 |" in md
    assert "Best on validation: `selected weights, T=1, alpha=0.5` (gap closed 0.750)" in md
    assert "Learning-rate check" not in md
    # the learning-rate check: each student again at multiples of the teacher's rate, the
    # gap read against the scratch student at the same rate
    lr = [dict(row("student, scratch, lr x3", 0.5), fields=None, lr_scale=3.0),
          dict(row("selected weights, T=1, alpha=0.5, lr x3", 0.56), fields={"alpha": 0.5},
               lr_scale=3.0)]
    md = distill_recipes._markdown(dict(payload, lr_check=lr, teacher_lr=1e-3))
    assert "| x1 | 0.4000 | 0.5500 | 0.750 |" in md and "| x3 | 0.5000 | 0.5600 | 0.600 |" in md
    assert "(scratch x3: 0.5000; the recipe x3: 0.5600), the recipe closes 0.600" in md
    assert "mean of 2 seeds" in md and "200 steps" in md
    distill_recipes._plot(payload, str(tmp_path))
    assert (tmp_path / "recipes.png").exists()
    assert [name for name, _ in distill_recipes.RECIPES][:1] == ["student, scratch"]
    assert distill_recipes.RECIPES[3][1] == dict(alpha=0.5, temperature=1.0, init="select")
    # the byte LM's: a loss, so the best is the lowest; its rates sorted, half included
    lm = dict(payload, model="byte LM", seeds=1, sizes={"student_steps": {"byte LM": None}},
              teacher={"value": 1.5, "params": 400}, teacher_lr=3e-3,
              recipes=[row("student, scratch", 2.0), row("soft targets, T=1, alpha=0.5", 1.9,
                                                          gap=0.2),
                       row("selected weights, T=1, alpha=0.5", 1.75, gap=0.5)],
              lr_check=[dict(row("student, scratch, lr x2", 1.8), fields=None, lr_scale=2.0),
                        dict(row("x", 1.6), fields={"alpha": 0.5}, lr_scale=2.0),
                        dict(row("student, scratch, lr x0.5", 2.2), fields=None, lr_scale=0.5),
                        dict(row("y", 1.95), fields={"alpha": 0.5}, lr_scale=0.5)])
    md = distill_recipes._markdown(lm)
    assert "Byte LM, validation split" in md and "the teacher's steps, one seed each" in md
    assert "| recipe | loss | each seed | gap closed |" in md
    assert "Best on validation: `selected weights, T=1, alpha=0.5` (gap closed 0.500)" in md
    assert md.index("| x0.5 | 2.2000 | 1.9500 | 0.357 |") < md.index("| x1 | 2.0000 | 1.7500 |")
    assert "| x2 | 1.8000 | 1.6000 | 0.667 |" in md
    assert "(scratch x2: 1.8000; the recipe x2: 1.6000), the recipe closes 0.667" in md
    assert "teacher's learning-rate check" not in md
    md = distill_recipes._markdown(dict(lm, teacher_lr_check=[
        dict(row("teacher, lr x3", 1.45), lr_scale=3.0), dict(row("teacher, lr x2", 1.4),
                                                               lr_scale=2.0)]))
    assert "| x1 | 1.5000 |\n| x2 | 1.4000 |\n| x3 | 1.4500 |" in md
    # the students distil from a teacher at x3 (compress.TEACHER_LR), the check around it
    md = distill_recipes._markdown(dict(lm, base_lr=3e-3, teacher=dict(lm["teacher"],
                                                                        lr_scale=3.0),
                                        teacher_lr_check=[
        dict(row("teacher, lr x1", 1.55), lr_scale=1.0), dict(row("teacher, lr x2", 1.4),
                                                              lr_scale=2.0)]))
    assert "| x1 | 1.5500 |\n| x2 | 1.4000 |\n| x3 | 1.5000 |" in md
    assert "distils from the teacher at x3" in md and "rate, 0.003 (every row above" in md
    assert "structured check" not in md
    # the structured check: the compress bench's structured fine-tune at (rate, steps)
    st = [dict(row("structured prune", v), setting="60%", lr_scale=k, steps=n,
               loss_rel=(v - 1.5) / 1.5)
          for k, n, v in ((1.0, 800, 1.47), (3.0, 400, 1.65), (1.0, 400, 1.6))]
    md = distill_recipes._markdown(dict(lm, structured_check=st))
    assert "to 60% sparsity" in md
    assert md.index("| x1 | 400 | 1.6000 | +0.067 |") < md.index("| x3 | 400 | 1.6500 | +0.100 |"
                                                                 ) < md.index("| x1 | 800 |")
    assert "Best: x1 for 800 steps (1.4700, -0.020)" in md
    distill_recipes._plot(lm, str(tmp_path))


def test_the_compress_targets_recipe_is_the_one_validation_picked():
    """Each model's targets' row in the compress bench trains the recipe its recorded
    distill_recipes run found best on its validation split, one that run measured, so the
    choice never read the eval chapters the targets are scored on; and its students train at
    the learning rates that run's check found best there."""
    from hpnlp.bench import compress, distill_recipes
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    records = {"text classifier": "distill_recipes", "byte LM": "distill_recipes_lm"}
    assert set(records) == set(compress.MODELS) == set(compress.TARGETS_RECIPE)
    for model, record in records.items():
        with open(os.path.join(root, "docs", "benchmarks", record, "results.json")) as f:
            payload = json.load(f)
        assert payload.get("model", distill_recipes.MODEL) == model
        recorded, checked = payload["recipes"], payload["lr_check"]
        best = max((r for r in recorded if r["gap_closed"] is not None),
                   key=lambda r: r["gap_closed"])
        assert best["fields"] == compress.TARGETS_RECIPE[model]
        assert [r["fields"] for r in recorded] == [f for _, f in distill_recipes.recipes(model)]
        assert {r["lr_scale"] for r in recorded} == {distill_recipes.RECIPE_LR[model]}
        # one rate for the scratch student, one for the targets' recipe (and every distilled
        # row), each the best of its check
        scales = set(distill_recipes.LR_SCALES[model]["full"]) | {
            distill_recipes.RECIPE_LR[model]}
        for kind, fields in (("scratch", None), ("distilled", best["fields"])):
            runs = [r for r in recorded if r["fields"] == fields] + [
                r for r in checked if r["fields"] == fields]
            assert sorted(r["lr_scale"] for r in runs) == sorted(scales), (model, kind)
            top = (min if model == "byte LM" else max)(runs, key=lambda r: r["value"])  # loss
            assert compress.STUDENT_LR[model][kind] == top.get("lr_scale", 1.0), (model, kind)
        # the teacher every student distils from trains at the rate of its check that beats
        # the experiment's own by more than 1% of the metric, else at the experiment's
        rate = lambda r: r.get("lr_scale", 1.0)  # noqa: E731
        teachers = {rate(r): r["value"] for r in [payload["teacher"]] + payload.get(
            "teacher_lr_check", [])}
        assert sorted(teachers) == list(distill_recipes.TEACHER_LR_SCALES[model]["full"])
        sign = -1 if model == "byte LM" else 1  # a loss, an accuracy
        top = max(teachers, key=lambda k: sign * teachers[k])
        better = sign * (teachers[top] - teachers[1.0]) > 0.01 * abs(teachers[1.0])
        assert compress.TEACHER_LR[model] == (top if better else 1.0) == rate(
            payload["teacher"]), model
    # the byte LM's structured fine-tune: the best (rate, steps) of its structured check
    with open(os.path.join(root, "docs", "benchmarks", records["byte LM"], "results.json")) as f:
        structured = json.load(f)["structured_check"]
    assert [(r["lr_scale"], r["steps"]) for r in structured] == list(
        distill_recipes.STRUCTURED_CHECK["byte LM"]["full"])
    best = min(structured, key=lambda r: r["value"])
    assert (best["lr_scale"], best["steps"]) == (
        compress.STRUCTURED_LR, compress.SIZES["full"]["structured_steps"])
    assert best["setting"] == f"{compress.structured_sparsity(compress.SIZES['full']):.0%}"


# 2.6 s in the fast suite on the Xeon model 167 stepping 1 (2026-12-06, --durations: the
# suite read 6 min 16 s for 1729 tests, about 12 min at the Zen 3's ratio): CI's slow part runs it
@pytest.mark.slow
def test_compress_queues_every_run_ahead_after_what_it_reads(tmp_path):
    """`compress.runs_ahead`, queued in the side-by-side processes before the parts run:
    each run once, the teachers first, those that read no other run before those that do,
    and every run a queued run reads is queued too (none waits on a run nobody trains);
    a part run alone queues its own runs and the teacher it reads, nothing of the others."""
    from hpnlp.bench import compress
    s, wd = compress.SIZES["quick"], str(tmp_path)
    runs = compress.runs_ahead(s, wd, compress.PARTS)
    outs = [out for _, out in runs]
    assert len(set(outs)) == len(outs)
    teachers = [os.path.join(wd, f"{m.replace(' ', '_')}_teacher") for m in compress.MODELS]
    assert outs[:2] == teachers
    reads = [bool(compress._sources(cd)) for cd, _ in runs]
    assert reads == sorted(reads) and 0 < sum(reads) < len(reads)
    assert {d for cd, _ in runs for d in compress._sources(cd)} <= set(outs)
    lowrank = [out for _, out in compress.runs_ahead(s, wd, ("lowrank",))]
    assert lowrank[0] == teachers[0] and all("lowrank_" in o or "dense_width_" in o
                                             for o in lowrank[1:]), lowrank


def test_compress_scratch_twins_train_as_many_steps_as_the_models_they_are_read_against(
        monkeypatch):
    """The dense models from scratch beside the low-rank and the structured rows train the
    teacher's steps plus the fine-tune's, as those rows do in all (review r10: the low-rank
    twin trained the teacher's 800 against the factorized model's 800 + 200), and the
    low-rank twin's folder names its steps so a workdir's earlier 800-step run is not taken
    for it."""
    from hpnlp.bench import compress

    def size(cd):  # monotone in what the parts bisect over, without tracing (3 s -> 0.1 s)
        m = cd.model
        mats = 2 * m.lowrank.rank * (m.width + m.mlp_dim) if m.lowrank.rank else (
            2 * m.width * m.mlp_dim)
        return mats + 4 * m.width * m.num_heads * (m.head_dim or m.width // m.num_heads)
    monkeypatch.setattr(compress, "param_count", size)
    s, wd = compress.SIZES["full"], "/wd"
    teacher = compress.teacher_config("byte LM", s).train.steps
    _, ranked, (dense, out), width = compress._lowrank_runs(s, wd, "/wd/teacher")
    assert {cd.train.steps for cd, _ in ranked.values()} == {s["prune_steps"]}
    assert dense.train.steps == teacher + s["prune_steps"]
    assert out == os.path.join(wd, f"dense_width_{width}_{teacher + s['prune_steps']}_steps")
    (pruned, _), (twin, _) = compress._structured_runs(s, wd, "/wd/teacher")[1:]
    assert twin.train.steps == teacher + pruned.train.steps


def test_reused_runs_are_those_finished_before_the_bench_run(tmp_path, monkeypatch):
    """A report's `reused_runs` (whose training its times leave out) counts the runs `_train`
    reused that were in the workdir before the bench run started, not those its side-by-side
    processes (or an earlier part) trained this time and `_train` then found finished."""
    from hpnlp.bench import compress
    for run in ("earlier", "unfinished", "retrained"):
        (tmp_path / run).mkdir()
    (tmp_path / "earlier" / "summary.json").write_text("{}")
    (tmp_path / "retrained" / "summary.json").write_text("{}")
    before = compress.runs_in(str(tmp_path))
    (tmp_path / "side_by_side").mkdir()
    # nor a folder an interrupted run left, nor a run trained anew since (a review, session
    # 115: both counted as reused)
    for run in ("side_by_side", "unfinished", "retrained"):
        (tmp_path / run / "summary.json").write_text("{}")
    os.utime(tmp_path / "retrained" / "summary.json", ns=(1, before[str(
        tmp_path / "retrained")] + 10**9))
    monkeypatch.setattr(compress, "REUSED", [str(tmp_path / r) for r in (
        "earlier", "side_by_side", "unfinished", "retrained")])
    assert compress.reused_since(before) == 1
    assert compress.runs_in(str(tmp_path / "absent")) == {}


def test_a_finished_run_is_reused_only_if_what_it_read_has_not_changed(tmp_path, monkeypatch):
    """`compress._train` reuses a finished run of the same config; a student's config names
    its teacher (or the run it starts from) by folder, so a teacher retrained since (another
    learning rate, the same folder) makes the student's run stale: it trains again."""
    import hpnlp.train
    import hpnlp.train.checkpoint
    from hpnlp.bench import compress
    from hpnlp.config import from_configdict
    trained = []
    monkeypatch.setattr(hpnlp.train, "run", lambda cd, out: trained.append(out) or {"new": 1})
    monkeypatch.setattr(compress, "REUSED", [])
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    for field in ("distill", "init_from"):
        cd = compress.experiment("byte LM", compress.SIZES["quick"])
        if field == "distill":
            cd.train.distill.teacher = str(teacher)
        else:
            cd.train.init_from = str(teacher)
        monkeypatch.setattr(hpnlp.train.checkpoint, "load_run_config",
                            lambda out, cd=cd: from_configdict(cd))
        for d, t in ((teacher, 1000), (student, 2000)):
            d.mkdir(exist_ok=True)
            (d / "summary.json").write_text("{}")
            os.utime(d / "summary.json", (t, t))
        assert compress._train(cd, str(student)) == {} and not trained, field  # reused
        os.utime(teacher / "summary.json", (3000, 3000))  # the teacher trained again
        assert compress._train(cd, str(student)) == {"new": 1}, field
        assert trained == [str(student)] and os.listdir(student) == [], field  # afresh
        trained.clear()
    assert compress.REUSED == [str(student)] * 2
    # a user's file beside the stale run is not deleted with it (a review, session 115: the
    # check came before the teacher's, and the folder went, unsaid)
    (student / "summary.json").write_text("{}")
    os.utime(student / "summary.json", (2000, 2000))  # before the teacher's (3000)
    (student / "notes.txt").write_text("mine")
    with pytest.raises(compress.RunConflict, match=r"holds files that are not a run's "
                       r"\(notes.txt\), which this bench would delete with the run it trains "
                       r"anew"):
        compress._train(cd, str(student))
    assert (student / "notes.txt").read_text() == "mine" and not trained


def test_a_finished_run_with_a_cut_summary_evaluates_again(tmp_path, monkeypatch):
    """A bug hunt (session 96): a reused run's cut summary.json was a JSONDecodeError, then
    "a training run failed in its own process"; it is run again (which evaluates a finished
    run and writes its summary whole), as a run without one is, and not deleted."""
    import hpnlp.train
    import hpnlp.train.checkpoint
    from hpnlp.bench import compress
    from hpnlp.config import from_configdict
    trained = []
    monkeypatch.setattr(hpnlp.train, "run", lambda cd, out: trained.append(out) or {"new": 1})
    monkeypatch.setattr(compress, "REUSED", [])
    cd = compress.experiment("byte LM", compress.SIZES["quick"])
    monkeypatch.setattr(hpnlp.train.checkpoint, "load_run_config",
                        lambda out: from_configdict(cd))
    run = tmp_path / "dense"
    run.mkdir()
    (run / "summary.json").write_text('{"eval": {"loss": 1')
    assert compress._train(cd, str(run)) == {"new": 1}
    assert trained == [str(run)] and run.exists() and compress.REUSED == []


def test_a_saved_run_of_another_config_is_refused_not_deleted(tmp_path, monkeypatch, capsys):
    """A bug hunt: `_train` deleted a finished run of another config (the full bench's, met
    by a --quick run in one --workdir; another bench's sharing it) and trained in its place.
    Now it is refused in one line, and --quick keeps its runs in W/quick; a folder of
    another config with nothing saved is still cleared and trained afresh."""
    import hpnlp.train
    from hpnlp.bench import compress
    from hpnlp.bench.__main__ import main
    trained = []
    monkeypatch.setattr(hpnlp.train, "run", lambda cd, out: trained.append(out) or {"new": 1})
    full, quick = (compress.experiment("byte LM", compress.SIZES[s]) for s in ("full", "quick"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")  # not one this version reads: not deleted either
    (run / "summary.json").write_text("{}")
    with pytest.raises(compress.RunConflict, match=f"{run} holds a saved run this bench cannot "
                       "read"):
        compress._train(quick, str(run))
    assert (run / "summary.json").exists() and not trained
    (run / "summary.json").unlink()
    (run / "notes.txt").write_text("mine")  # not a run's: refused, not deleted (a bug hunt)
    with pytest.raises(compress.RunConflict, match=rf"^{run} holds files that are not a run's "
                       r"\(notes.txt\), which this bench would delete with the run it trains anew"):
        compress._train(full, str(run))
    (run / "notes.txt").unlink()  # nothing saved: cleared, trained afresh
    (run / "metrics.jsonl").write_text("")
    assert compress._train(full, str(run)) == {"new": 1} and os.listdir(run) == []
    # held by another process, as a run still training with nothing saved (a review,
    # session 117: deleted under it): WorkdirBusy, the folder untouched
    import fcntl

    from hpnlp.paths import WorkdirBusy
    (run / "metrics.jsonl").write_text("")
    fd = os.open(run, os.O_RDONLY)  # another open file: its flock refuses this process's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WorkdirBusy):
            compress._train(full, str(run))
    finally:
        os.close(fd)
    assert os.listdir(run) == ["metrics.jsonl"] and trained == [str(run)]
    (run / "metrics.jsonl").unlink()
    # the reason is said: what the config differs in, or why it cannot be read (a bug hunt:
    # a copied workdir's runs started from the old path, and a run without its checkpoints,
    # were both "another config", with "delete" as the fix)
    from hpnlp.config import from_configdict, validate
    from hpnlp.train.checkpoint import Checkpointer
    moved = copy.deepcopy(full)
    moved.train.init_from = str(tmp_path / "old" / "teacher")
    saved = validate(from_configdict(moved))
    Checkpointer(str(run), saved, keep=1).close()
    (run / "summary.json").write_text("{}")
    with pytest.raises(compress.RunConflict, match=r"holds a saved run this bench cannot read "
                       r"\(workdir .* has no checkpoint"):
        compress._train(full, str(run))
    os.makedirs(run / "checkpoints" / "1")
    full.train.init_from = str(tmp_path / "new" / "teacher")
    with pytest.raises(compress.RunConflict, match=r"\(train.init_from: saved '.*/old/teacher', "
                       r"now '.*/new/teacher': it starts from a run in another folder"):
        compress._train(full, str(run))

    def conflict(args):
        raise compress.RunConflict(f"{args.workdir}/teacher holds a saved run")
    monkeypatch.setattr(compress, "main", conflict)
    with pytest.raises(SystemExit, match=rf"hpnlp.bench compress: error: {tmp_path}/w/quick/"
                                         "teacher holds"):
        main(["compress", "--quick", "--out", str(tmp_path / "o"), "--workdir",
              str(tmp_path / "w")])


def test_bench_arguments_are_checked_before_any_work(tmp_path, capsys):
    """Found by the crash hunt: an --out that is a file failed after the whole run (a
    traceback), and --lengths abc or 0 failed as a traceback or ran to a table of errors."""
    from hpnlp.bench.__main__ import main
    (tmp_path / "f").write_text("x")
    for argv, match in ((["speculative", "--quick", "--out", str(tmp_path / "f")],
                         "--out .*/f is a file, not a folder"),
                        (["compress", "--quick", "--out", str(tmp_path / "o"), "--workdir",
                          str(tmp_path / "f" / "w")], "--workdir .*/f is a file, so the folder"),
                        (["attention", "--quick", "--out", str(tmp_path / "o"), "--lengths", "abc"],
                         "'abc' is not a comma-separated list of integers"),
                        (["attention", "--quick", "--out", str(tmp_path / "o"), "--lengths", "64,0"],
                         "every value must be >= 1"),
                        (["speculative", "--quick", "--out", str(tmp_path / "o"), "--targets", "huge"],
                         "'huge': choose from default, wide"),
                        (["speculative", "--quick", "--out", str(tmp_path / "o"), "--ks", "4,x"],
                         "'4,x' is not a comma-separated list of integers"),
                        (["speculative", "--quick", "--out", str(tmp_path / "o"), "--targets", "wide"],
                         "--quick runs the default target only")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert re.search(match, err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, match", [
    (["train", "--variants", "bogus"], "--variants: unknown \\['bogus'\\]; choose from"),
    (["attention", "--causal", "--variants", "chunked,linformer,sinkhorn"],
     "--variants linformer, sinkhorn: bidirectional only, so --causal cannot time them"),
    (["lra", "--variants", "dense,bogus"], "--variants: unknown \\['bogus'\\]"),
    (["lra", "--steps", "-3"], "--steps: '-3': must be > 0"),
    (["lra", "--tasks", "bogus"], "--tasks: unknown"),
    (["rnn", "--quality", "--steps", "0"], "--steps: '0': must be > 0"),
    (["rnn", "--steps", "5"], "--steps sets the --quality run"),
    (["rnn", "--impls", "hpnlp LSTM (scan, one product),bogus"], "--impls: unknown \\['bogus'\\]"),
    (["softmax", "--vocabs", "abc"], "--vocabs: 'abc' is not a comma-separated list"),
    (["softmax", "--vocabs", "0"], "every value must be >= 1"),
    (["softmax", "--quality", "--methods", "bogus"], "--methods: unknown \\['bogus'\\]"),
    (["softmax", "--quality", "--seconds", "-1"], "--seconds: '-1': must be > 0"),
    (["softmax", "--quality", "--tokenizers", "chars"], "--tokenizers: unknown \\['chars'\\]"),
    (["softmax", "--quality", "--vocabs", "64"], "--vocabs change the timing run"),
    (["softmax", "--seconds", "3"], "--seconds set the --quality run"),
    (["softmax", "--set", "full.bogus=1"], "unknown option for FullSoftmax"),
    # values no V takes failed each row after the run, exit 0 (a bug hunt, session 97)
    (["softmax", "--set", "adaptive.div_value=-1"],
     r"--set adaptive.div_value=-1: adaptive at V=8192: config field .*div_value` = -1 .*> 0"),
    (["softmax", "--vocabs", "1000", "--set", "sampled.num_samples=0"],
     r"sampled at V=1000: config field .*num_samples` = 0 is not allowed"),
    (["softmax", "--vocabs", "65536,1000", "--set", "adaptive.cutoffs=(5,30000)"],
     r"adaptive at V=1000: .*cutoffs` = \(5, 30000\) .*strictly increasing"),
    (["memory", "--devices", "3"], "--devices=3: model heads=8 is not divisible by 3"),
    (["memory", "--devices", "0"], "--devices=0: the comparison needs at least 2"),
    (["quant", "--parts", "bogus"], "--parts: unknown \\['bogus'\\]"),
    (["quant", "--repeats", "0"], "--repeats: '0': must be > 0"),
    (["compress", "--parts", ""], "--parts: '' names nothing"),
    (["retrieval", "--parts", "search,bogus"], "--parts: unknown \\['bogus'\\]"),
    (["tricks", "--out", ""], "--out is empty; give a folder$"),
    # taken and ignored (a review, session 117)
    (["quant", "--parts", "linear,lm", "--workdir", "/tmp"],
     "--workdir /tmp: only the quality part keeps runs there; drop it, or add --parts quality"),
    (["moe", "--parts", "layer", "--workdir", "/tmp"], "only the lm part keeps runs there"),
    (["data", "--workdir", ""], "--workdir is empty; give a folder \\(or leave the flag out\\)"),
])
def test_bench_flag_values_are_refused_in_one_line_before_any_work(tmp_path, capsys, argv, match):
    """Found by the crash hunt: an unknown --variants (train, lra), --steps -3 or softmax
    --quality --methods bogus ran every row to a report of failures; --parts bogus (quant) wrote
    an empty report; --vocabs abc, --devices 3, --parts bogus (compress, moe, retrieval) and
    --tokenizers bogus failed as tracebacks; --seconds -1 trained; --out '' ran the whole bench;
    rnn's 'hpnlp LSTM (scan, one product)' could not be named in --impls."""
    from hpnlp.bench.__main__ import main
    out = ["--out", str(tmp_path / "o")] if "--out" not in argv else []
    with pytest.raises(SystemExit) as e:
        main([argv[0], "--quick", *out, *argv[1:]])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(match, last), last
    assert not (tmp_path / "o").exists()


def test_profile_is_refused_where_the_rows_run_in_processes_of_their_own(tmp_path):
    """A review (session 117): `--profile` traced the parent and none of the isolated rows."""
    import argparse
    from hpnlp.bench.__main__ import check_args
    prof = str(tmp_path / "prof")

    def args(entry, **kw):
        return argparse.Namespace(entry=entry, out=str(tmp_path / "o"), profile=prof,
                                  **{"quick": False, **kw})
    for entry in ("attention", "softmax", "train"):
        with pytest.raises(ValueError, match=r"--profile traces this process, and "
                                             f"{entry} runs its measured work in processes of "
                                             r"its own; add --no-isolate \(or --quick"):
            check_args(args(entry, no_isolate=False))
        check_args(args(entry, no_isolate=True))  # measured here: traced
        check_args(args(entry, no_isolate=False, quick=True))
    check_args(args("softmax", no_isolate=False, quality=True))  # trains here
    for entry in ("compress", "data", "lra", "memory"):
        with pytest.raises(ValueError, match=f"{entry} runs its measured work in processes of "
                                             "its own$"):
            check_args(args(entry, quick=True))
    with pytest.raises(ValueError, match="; leave out --parts parallel$"):
        check_args(args("moe", parts=["lm", "parallel"]))
    check_args(args("moe", parts=["lm", "layer"]))
    check_args(args("rnn"))


def test_bench_out_holding_another_bench_report_is_refused(tmp_path, capsys):
    """Found by the crash hunt: a bench run with --out of another bench's folder replaced its
    results.json and results.md; a rerun of the same bench still writes anew."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    (tmp_path / "results.md").write_text("# hpnlp benchmark: attention\n\n...")
    with pytest.raises(SystemExit) as e:
        bench_main.main(["tricks", "--quick", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "holds the attention bench's results" in capsys.readouterr().err
    (tmp_path / "results.md").write_text("# hpnlp benchmark: tricks\n\n...")
    args = argparse.Namespace(entry="tricks", out=str(tmp_path), profile=None, quick=True)
    bench_main.check_args(args)  # the same bench's earlier report: written anew
    # a user's own results.md, or a results.json with no report beside it (a bug hunt)
    (tmp_path / "results.md").write_text("My own experiment notes\n")
    with pytest.raises(ValueError, match=r"holds a results\.md that is not an hpnlp bench's"):
        bench_main.check_args(args)
    os.remove(tmp_path / "results.md")
    (tmp_path / "results.json").write_text('{"my": 1}')
    with pytest.raises(ValueError, match=r"holds a results\.json that is not an hpnlp bench's"):
        bench_main.check_args(args)


def test_a_quick_or_part_run_into_a_full_report_is_refused(tmp_path, capsys):
    """A bug hunt (session 97): `moe --quick --parts parallel --out docs/benchmarks/moe` ran
    and replaced the recorded 1.5-hour report with one table. Now refused before any work;
    a quick or partial report, or a full run, is written anew as before."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    (tmp_path / "results.md").write_text("# hpnlp benchmark: moe\n\n...")
    full = {"seconds": {"lm": 1.0, "layer": 1.0, "parallel": 1.0}}  # recorded before `quick`
    (tmp_path / "results.json").write_text(json.dumps(full))
    with pytest.raises(SystemExit) as e:
        bench_main.main(["moe", "--quick", "--parts", "parallel", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--out {tmp_path} holds a report that does not record whether it was a --quick run "
        "(one older than this check, taken as a full run's) of the moe bench, which this "
        "--quick --parts parallel run would replace; give another --out")
    (tmp_path / "results.json").write_text(json.dumps({"quick": False, **full}))
    args = argparse.Namespace(entry="moe", out=str(tmp_path), profile=None, quick=False,
                              parts=["parallel"], workdir=None)
    with pytest.raises(ValueError, match="which this --parts parallel run would replace"):
        bench_main.check_args(args)
    bench_main.check_args(argparse.Namespace(**{**vars(args), "parts": ["parallel", "lm",
                                                                         "layer"]}))
    for other in ({"quick": True, **full}, {"seconds": {"parallel": 1.0}},
                  {"parts": ["parallel"], **full}, {"interrupted": 130, **full}):
        (tmp_path / "results.json").write_text(json.dumps(other))
        bench_main.check_args(args)  # not a full run's: written anew
    # what the CLI run was asked for goes into its report (a bench's own `quick` stays)
    with report.recorded(quick=True, parts=["parallel"]):
        report.write(str(tmp_path), "moe", {"quick": False}, "")
    assert {k: json.load(open(tmp_path / "results.json"))[k] for k in ("quick", "parts")} == {
        "quick": False, "parts": ["parallel"]}
    report.write(str(tmp_path / "b"), "moe", {}, "")  # outside: nothing recorded
    assert "quick" not in json.load(open(tmp_path / "b" / "results.json"))


def test_an_lra_steps_run_into_a_full_report_is_refused(tmp_path):
    """A bug hunt (session 99): `lra --steps 2 --out docs/benchmarks/lra` replaced the recorded
    report, although its report marks such a run quick (no targets): refused, as --quick is."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    (tmp_path / "results.md").write_text("# hpnlp benchmark: lra\n\n...")
    (tmp_path / "results.json").write_text(json.dumps({"quick": False}))
    args = argparse.Namespace(entry="lra", out=str(tmp_path), profile=None, quick=False,
                              steps=2, variants=["dense"], tasks=["listops"])
    with pytest.raises(ValueError, match=re.escape(
            "holds a full run's report of the lra bench, which this --steps 2")):
        bench_main.check_args(args)
    # a part of its rows too (review: --variants dense replaced the recorded table)
    with pytest.raises(ValueError, match=r"which this --variants \['dense'\] run would"):
        bench_main.check_args(argparse.Namespace(**{**vars(args), "steps": None,
                                                    "tasks": None}))
    bench_main.check_args(argparse.Namespace(**{**vars(args), "steps": None, "variants": None,
                                                "tasks": None}))  # a full run


def test_a_run_of_fewer_rows_steps_or_seconds_than_the_report_in_out_is_refused(
        tmp_path, capsys, monkeypatch):
    """A bug hunt (session 102): `rnn --impls "hpnlp GRU"`, `rnn --quality --steps N` and
    `softmax --quality --methods full --seconds 3` replaced the recorded reports. The full
    value is the report's (the recorded commands give --steps 300, --seconds 90, --vocabs):
    those commands still run; a subset's report is no full one, nor README material."""
    import argparse
    import importlib
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import rnn as bench_rnn
    from hpnlp.bench import softmax as bench_softmax
    for mod in (bench_rnn, bench_softmax):  # a run not refused fails here, not minutes later
        monkeypatch.setattr(mod, "main", lambda args: pytest.fail("ran; not refused"))

    def held(name, **payload):
        (tmp_path / "results.md").write_text(f"# hpnlp benchmark: {name}\n\n...")
        (tmp_path / "results.json").write_text(json.dumps({"quick": False, **payload}))

    def refused(argv):
        with pytest.raises(SystemExit) as e:
            bench_main.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]
    held("rnn", results=[{"impl": n} for n in bench_rnn.IMPLS])
    assert refused(["rnn", "--impls", "hpnlp GRU"]).endswith(
        f"--out {tmp_path} holds a full run's report of the rnn bench, which this --impls "
        '"hpnlp GRU" run would replace; give another --out')
    args = argparse.Namespace(entry="rnn", out=str(tmp_path), profile=None, quick=False,
                              impls=list(bench_rnn.IMPLS), quality=False, steps=None)
    bench_main.check_args(args)  # every row
    # a run timed under the profiler (a review, session 114: it wrote an ordinary record, its
    # JAX rows traced and PyTorch's peers not): no full run's, refused into a recorded folder
    assert refused(["rnn", "--profile", str(tmp_path / "trace")]).endswith(
        f"which this --profile {tmp_path / 'trace'} run would replace; give another --out")
    held("rnn", profiled=str(tmp_path / "trace"), results=[{"impl": n} for n in bench_rnn.IMPLS])
    assert bench_main._full_report(str(tmp_path), bench_rnn) is None
    held("rnn", results=[{"impl": n} for n in bench_rnn.IMPLS])
    held("rnn quality", results=[{"variant": "plain", "steps": 300}])
    assert "which this --steps 30 run would" in refused(["rnn", "--quality", "--steps", "30"])
    bench_main.check_args(argparse.Namespace(**{**vars(args), "impls": None, "quality": True,
                                                "steps": 300}))
    held("softmax quality", seconds=90.0, tokenizers=["words"],
         results=[{"method": m, "tokenizer": "words"} for m in ("full", "sampled")])
    assert "which this --seconds 3 --methods full run would" in refused(
        ["softmax", "--quality", "--methods", "full", "--seconds", "3"])
    args = argparse.Namespace(entry="softmax", out=str(tmp_path), profile=None, quick=False,
                              methods=["sampled"], vocabs=None, set=[], no_isolate=False,
                              quality=True, seconds=90.0, tokenizers=None)
    bench_main.check_args(args)  # `full` runs whatever --methods names
    with pytest.raises(ValueError, match="which this --tokenizers bpe run"):
        bench_main.check_args(argparse.Namespace(**{**vars(args), "tokenizers": ["bpe"]}))
    held("softmax", results=[{"impl": "full", "V": 32768}, {"impl": "adaptive", "V": 262144}])
    assert "which this --vocabs 32768 run would" in refused(["softmax", "--vocabs", "32768"])
    bench_main.check_args(argparse.Namespace(**{**vars(args), "quality": False, "seconds": None,
                                                "methods": ["adaptive"],
                                                "vocabs": [32768, 262144]}))
    # a subset's report: written anew, marked, and refused by tools/sync_readme.py
    held("softmax", subset={"methods": ["full"]}, results=[{"impl": "full", "V": 32768}])
    bench_main.check_args(argparse.Namespace(**{**vars(args), "quality": False,
                                                "seconds": None, "vocabs": [8192]}))
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tools"))
    sync_readme = importlib.import_module("sync_readme")
    monkeypatch.setattr(sync_readme, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match=r"a run of a part of the rows \(`subset`: "):
        sync_readme.check_whole("results.md")
    held("softmax", profiled="/tmp/trace", results=[{"impl": "full", "V": 32768}])
    with pytest.raises(SystemExit, match=r"a run timed under the profiler \(`profiled`: "):
        sync_readme.check_whole("results.md")


def test_a_quant_run_of_fewer_repeats_than_the_report_in_out_is_refused(
        tmp_path, capsys, monkeypatch):
    """A review (session 107): `quant --repeats 1` replaced the recorded report, its LM rows and the
    targets read from them one call over one call, unmarked."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import quant
    monkeypatch.setattr(quant, "main", lambda args: pytest.fail("ran; not refused"))
    (tmp_path / "results.md").write_text("# hpnlp benchmark: quant\n\n...")
    for held, repeats in (({"repeats": 7}, 1), ({"repeats": 9}, 8), ({}, 6)):  # ({}: older)
        (tmp_path / "results.json").write_text(json.dumps({"quick": False, **held}))
        with pytest.raises(SystemExit) as e:
            bench_main.main(["quant", "--repeats", str(repeats), "--out", str(tmp_path)])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            f"--out {tmp_path} holds a full run's report of the quant bench, which this "
            f"--repeats {repeats} run would replace; give another --out")
    args = argparse.Namespace(entry="quant", out=str(tmp_path), profile=None, quick=False,
                              repeats=None, parts=list(quant.PARTS), workdir=None)
    for repeats in (None, 7, 20):  # the default, as many or more
        bench_main.check_args(argparse.Namespace(**{**vars(args), "repeats": repeats}))
    (tmp_path / "results.json").write_text(json.dumps({"quick": False, "repeats": 3}))
    bench_main.check_args(argparse.Namespace(**{**vars(args), "repeats": 3}))


def test_every_bench_run_records_whether_it_was_quick():
    """Session 107: half the benches marked `quick` only through the CLI's report.recorded,
    so a `run(quick=True)` from Python (the colab's softmax.run) wrote a report the README
    sync and the --out guard took for a full run's. Each `run` must say it itself: a
    payload["quick"] = ..., a {"quick": ...} payload or report.targets_unless_quick."""
    import ast
    import inspect
    import textwrap
    from hpnlp.bench import __main__ as bench_main

    def records_quick(node) -> bool:
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            return isinstance(node.slice, ast.Constant) and node.slice.value == "quick"
        if isinstance(node, ast.Dict):
            return any(isinstance(k, ast.Constant) and k.value == "quick" for k in node.keys)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr == "targets_unless_quick"
        return False
    missing = []
    for name, mod in bench_main.ENTRIES.items():
        # `run`, and a `_run_in` it hands its work to (data's: its folder removed however it
        # ends, session 116)
        funcs = [mod.run] + ([mod._run_in] if hasattr(mod, "_run_in") else [])
        trees = [ast.parse(textwrap.dedent(inspect.getsource(f))) for f in funcs]
        if not any(records_quick(node) for tree in trees for node in ast.walk(tree)):
            missing.append(name)
    assert missing == []


def test_train_speculative_or_attention_runs_of_fewer_rows_are_refused_and_marked(
        tmp_path, monkeypatch):
    """A bug hunt (session 103): `train --variants dense`, `speculative --ks 2` and
    `attention --variants chunked` replaced the recorded reports, and their reports were not
    marked a `subset`. Attention's records are made with --variants/--lengths: the rows held
    count, not the flags given."""
    import argparse
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import speculative
    from hpnlp.bench import train as bench_train

    def check(entry, payload, **flags):
        (tmp_path / "results.md").write_text(f"# hpnlp benchmark: {entry}\n\n...")
        (tmp_path / "results.json").write_text(json.dumps({"quick": False, **payload}))
        bench_main.check_args(argparse.Namespace(entry=entry, out=str(tmp_path), quick=False,
                                                 profile=None, **flags))
    train = {"results": [{"group": "lm", "name": "lm-256"}] + [
        {"group": "encoder", "name": n} for n in ("dense", "chunked", bench_train.BOUND)]}
    with pytest.raises(ValueError, match="which this --variants dense run would replace"):
        check("train", train, variants=["dense"], no_isolate=False)
    check("train", train, variants=["chunked"], no_isolate=False)
    check("train", train, variants=None, no_isolate=False)
    spec = {"rows": [{"target": t, "k": k} for t in speculative.TARGET_NAMES.values()
                     for k in (0, 2, 4)]}
    with pytest.raises(ValueError, match="which this --ks 2 run would replace"):
        check("speculative", spec, workdir=None, targets=None, ks=[2])
    with pytest.raises(ValueError, match="which this --targets wide run would replace"):
        check("speculative", spec, workdir=None, targets=["wide"], ks=[2, 4])
    check("speculative", spec, workdir=None, targets=None, ks=[4, 2, 8])
    att = {"results": [{"impl": i, "L": 4096} for i in (
        "dense", "chunked", bench_attention.XLA_TWIN, "torch.scaled_dot_product_attention")]}
    flags = dict(causal=False, no_isolate=False)
    with pytest.raises(ValueError, match="which this --variants chunked run would replace"):
        check("attention", att, variants=["chunked"], lengths=[4096], **flags)
    with pytest.raises(ValueError, match="which this --lengths 1024 run would replace"):
        check("attention", att, variants=None, lengths=[1024], **flags)
    check("attention", att, variants=["dense", "chunked"], lengths=[4096], **flags)
    att["results"] = att["results"][1:]  # a per-CPU record: its own command runs again
    check("attention", att, variants=["chunked"], lengths=[4096], **flags)
    att["shape"] = {"causal": False}  # and not causal over it: its bidirectional rows and
    with pytest.raises(ValueError, match="which this --causal run would replace"):  # targets
        check("attention", att, variants=["chunked"], lengths=[4096], causal=True,
              no_isolate=False)
    # and their reports are marked, as rnn's and softmax --quality's (sync_readme refuses them)
    monkeypatch.setattr(harness, "ceiling_rates", lambda quick: {"float32": 100.0})
    monkeypatch.setattr(bench_train, "_one", lambda spec, isolate: {**spec, "status": "failed"})
    monkeypatch.setattr(bench_train, "_plot", lambda payload, out: None)
    assert bench_train.run(str(tmp_path / "t"), quick=True, isolate=False, variants=["chunked"],
                           lengths=[64])["subset"] == {"variants": ["chunked"]}
    assert "subset" not in bench_train.run(str(tmp_path / "t"), quick=True, isolate=False,
                                           variants=attention_lib.names(), lengths=[64])
    monkeypatch.setattr(speculative, "train_models", lambda s, workdir: {})
    monkeypatch.setattr(speculative, "decode_rows", lambda s, models: [])
    monkeypatch.setattr(speculative, "_plot", lambda payload, out: None)
    assert speculative.run(str(tmp_path / "s"), quick=False, ks=[2])["subset"] == {"ks": [2]}
    assert speculative.run(str(tmp_path / "s"), quick=False, targets=["wide"])["subset"] == {
        "targets": ["4x wide, 2x deep"]}
    assert "subset" not in speculative.run(str(tmp_path / "s"), quick=False,
                                           ks=[2, 4, 6, 8, 10, 12])


def test_a_report_of_some_of_its_parts_is_not_copied_into_readme_or_targets(
        tmp_path, monkeypatch):
    """A bug hunt (session 103): tools/sync_readme.py embedded a `moe --parts parallel`
    report as a whole one (python -m hpnlp.bench's own _full_report takes it as not whole);
    tools/targets_table.py lists the targets such a report holds, those of its parts
    (`report.targets_of_parts`), so a bench given a new part keeps its records' rows."""
    import importlib
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "tools"))
    sync_readme, tt = (importlib.import_module(m) for m in ("sync_readme", "targets_table"))
    monkeypatch.setattr(sync_readme, "ROOT", str(tmp_path))
    monkeypatch.setattr(tt, "ROOT", str(tmp_path))
    folder = tmp_path / "docs" / "benchmarks" / "moe"
    folder.mkdir(parents=True)
    (folder / "results.md").write_text("# hpnlp benchmark: moe\n\ntable\n")
    targets = {"t": report.target(1.0, 1.3, "<=")}
    whole = {"quick": False, "seconds": {"lm": 1.0, "layer": 1.0, "parallel": 1.0},
             "targets": targets}
    (folder / "results.json").write_text(json.dumps(whole))
    sync_readme.check_whole("docs/benchmarks/moe/results.md")
    assert len(tt.rows()) == 1
    for part in ({"parts": ["parallel"]}, {"seconds": {"parallel": 1.0}}):
        (folder / "results.json").write_text(json.dumps({**whole, **part}))
        with pytest.raises(SystemExit, match=re.escape(
                "the report of a run without its part(s) lm, layer (`--parts`), not of a "
                "whole run; rerun its benchmark in full")):
            sync_readme.check_whole("docs/benchmarks/moe/results.md")
        assert len(tt.rows()) == 1
    assert sync_readme.bench_parts("moe") == ("lm", "layer", "parallel")
    from hpnlp.bench import __main__ as bench_main  # read from source as the modules hold it
    for name, module in bench_main.ENTRIES.items():
        assert sync_readme.bench_parts(name) == tuple(getattr(module, "PARTS", ())), name
    assert sync_readme.bench_parts("softmax") == sync_readme.bench_parts("../x") == ()


def test_the_documented_softmax_quality_commands_run_their_records_tokenizers():
    """A bug hunt (session 103): the words-only record's command gave no --tokenizers, and
    --quality runs every tokenizer by default: it would train the BPE part too."""
    from hpnlp.bench import quality
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = open(os.path.join(root, "docs", "benchmarks.md")).read()
    commands = re.findall(r"`python -m hpnlp\.bench softmax --quality ([^`]*)--out (\S+)`", doc)
    assert len(commands) >= 2
    for flags, out in commands:
        given = re.search(r"--tokenizers (\S+)", flags)
        with open(os.path.join(root, out, "results.json")) as f:
            recorded = json.load(f).get("tokenizers") or ["words"]  # (before `bpe`: words)
        assert (given.group(1).split(",") if given else list(quality.TOKENIZERS)) == recorded


def test_a_failed_report_write_keeps_the_old_report_and_says_so_in_one_line(
        tmp_path, monkeypatch):
    """A bug hunt (session 97): under a file-size limit results.json was cut in place, the old
    report lost, and the error a traceback. Each file is now written whole beside the old one
    (results.json last) and the bench CLI names the file in one line."""
    import errno
    from hpnlp.bench import __main__ as bench_main
    from hpnlp.bench import tricks
    out = str(tmp_path)
    report.write(out, "tricks", {"rows": [1], "quick": True}, "old table")
    old = {f: open(os.path.join(out, f)).read() for f in ("results.md", "results.json")}

    def cut(obj, f, **kw):
        f.write('{"rows": [')
        raise OSError(errno.EFBIG, "File too large")
    monkeypatch.setattr(report.json, "dump", cut)
    monkeypatch.setattr(tricks, "main", lambda args: report.write(out, "tricks", {}, "new"))
    with pytest.raises(SystemExit, match=re.escape(
            f"python -m hpnlp.bench tricks: error: {out}/results.json: cannot be written (File "
            "too large); the file there before is kept")):
        bench_main.main(["tricks", "--quick", "--out", out])
    assert {f: open(os.path.join(out, f)).read() for f in old} == old
    assert sorted(os.listdir(out)) == ["results.json", "results.md"]  # no temporary left

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure()

    def cut(path, **kw):  # a plot cut the same way keeps the one drawn before
        open(path, "wb").write(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(fig, "savefig", cut)
    (tmp_path / "p.png").write_bytes(b"old plot")
    with pytest.raises(report.ReportWriteError, match=r"p\.png: cannot be written \(No space"):
        report.savefig(fig, str(tmp_path / "p.png"))
    assert not plt.fignum_exists(fig.number)  # closed all the same
    assert (tmp_path / "p.png").read_bytes() == b"old plot"
    assert not (tmp_path / "p.png.tmp").exists()

    def elsewhere(args):  # not the report's: its traceback stays
        raise FileNotFoundError(errno.ENOENT, "No such file", str(tmp_path.parent / "data"))
    monkeypatch.setattr(tricks, "main", elsewhere)
    with pytest.raises(FileNotFoundError):
        bench_main.main(["tricks", "--quick", "--out", out])


def test_a_plot_a_report_does_not_draw_is_removed(tmp_path):
    """A bug hunt (session 97): `retrieval --parts knnlm` into the folder of a `--parts
    search` run wrote a report with no search rows beside the old retrieval.png; so did the
    other benches whose plot is drawn only for some rows (gqa, memory, rope)."""
    from hpnlp.bench import gqa, memory, retrieval, rope
    names = ("retrieval.png", "gqa_decode.png", "memory_by_mode.png", "rope_loss_by_position.png")
    for name in names:
        (tmp_path / name).write_bytes(b"an earlier run's")
    retrieval._plot({"search": [{"index": "faiss", "n": 10, "missing": True}]}, str(tmp_path))
    gqa._plot({"decode": []}, str(tmp_path))
    memory._plot({"results": [{"status": "failed: x"}]}, str(tmp_path / "memory_by_mode.png"))
    rope._plot({"quality": []}, str(tmp_path))
    assert not any((tmp_path / name).exists() for name in names)
    retrieval._plot({}, str(tmp_path))  # none there: nothing to remove


TOOL_REFUSALS = [
    (["kernel_ab.py", "--rev", "HEAD", "--length", "-5"], "--length -5: give a positive number"),
    (["kernel_ab.py", "--rev", "HEAD", "--bwd-blocks", "0,16"], "--bwd-blocks '0,16': give QUERIES,KEYS"),
    (["kernel_ab.py", "--rev", "HEAD", "--rev-fwd-blocks", "64,60"],
     "--rev-fwd-blocks '64,60': give QUERIES,KEYS"),
    (["kernel_ab.py", "--rev", "HEAD", "--kernel", "lstm", "--rev-bwd-blocks", "64,64"],
     "and the --\\*fwd-blocks/--\\*bwd-blocks are flash attention.s options"),
    (["kernel_ab.py", "--rev", "HEAD", "--widen", "1"], "--widen chooses the bfloat16 kernel's"),
    (["kernel_ab.py", "--rev", "HEAD", "--kernel", "spmm", "--causal"],
     "are flash attention.s options"),
    (["kernel_ab.py", "--rev", "HEAD", "--kernel", "lstm", "--rev-dw-blocks", "128"],
     "--rev-dw-blocks '128': give KC,MC, two positive numbers, with --kernel lstm"),
    (["lm_attention_ab.py", "--experiment", "lm"], "experiments/lm: no such experiment; choose from"),
    (["lm_attention_ab.py", "--experiment", "lm.py:bogus"], "unknown argument\\(s\\) \\['bogus'\\]"),
    (["float_product_ab.py", "--rounds", "0"], "--rounds: 0: must be at least 1"),
    (["malloc_ab.py", "--steps", "2"], "give --rounds >= 1 and --steps >= 5"),
    (["make_corpus.py", "--raw", "/nonexistent/dump"], "--raw /nonexistent/dump: no such file"),
    (["moe_serve_ab.py", "--workdir", "/nonexistent", "--quantized", "/nonexistent"],
     "--workdir /nonexistent: no config.json there"),
    (["movement_oneshot.py", "--workdir", "/nonexistent", "--sparsity", "1.5"],
     "--sparsity 1.5: must be in \\(0, 1\\)"),
    # {tmp}: the test's tmp_path, where `config_only` is a run stopped before its end (review
    # r6: its missing summary.json was a traceback after every init's evaluation)
    (["distill_init_loss.py", "--teacher", "{tmp}/config_only"],
     "--teacher .*/config_only: no readable summary.json there"),
    # review r6: a file as --out was a traceback after every configuration was timed
    (["flash_gpu_blocks.py", "--out", "{tmp}/config_only/config.json"],
     "--out .*/config_only/config.json is a file, not a folder"),
    (["ring_memory.py", "--devices", "0"], "--devices: 0: must be at least 1"),
]
# Runs each tool as `python tools/NAME.py ARGS` would (as __main__, tools/ on the path), all in
# one process: one JAX start-up instead of one per tool (2.3 s each on a 2-core EPYC Zen 3).
# Prints [exit code, stderr] per command, as the interpreter would have exited.
_TOOL_DRIVER = """
import contextlib, io, json, os, runpy, sys
tools, commands = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, tools)
results = []
for argv in commands:
    err, code = io.StringIO(), 0
    sys.argv = [os.path.join(tools, argv[0]), *argv[1:]]
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
            if code is not None and not isinstance(code, int):  # sys.exit("message")
                print(code, file=sys.stderr)
                code = 1
    results.append([code or 0, err.getvalue()])
print("RESULTS " + json.dumps(results))
"""


# 3.5 s in the fast suite on the Xeon model 207 (2026-12-07, --durations: the suite
# read 7 min 58 s for 1838 tests): CI's slow part runs it
@pytest.mark.slow
def test_tools_refuse_bad_flags_in_one_line_before_timing(tmp_path):
    """Found by the crash hunt: --rounds 0 compiled everything and printed nan; kernel_ab's
    --length -5 or --bwd-blocks 0,0 failed in the probe after both builds (abc: a
    traceback); an unknown --experiment and a missing --raw failed as tracebacks. Each
    command exits 2 with the match on its last line of stderr."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text("{}")
    commands = [[a.replace("{tmp}", str(tmp_path)) for a in argv] for argv, _ in TOOL_REFUSALS]
    proc = subprocess.run([sys.executable, "-c", _TOOL_DRIVER, os.path.join(root, "tools"),
                           json.dumps(commands)], capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    wrong = [(" ".join(argv), code, err[-500:]) for (argv, match), (code, err)
             in zip(TOOL_REFUSALS, results)
             if code != 2 or not err.strip()
             or not re.search(match, err.strip().splitlines()[-1])]
    assert not wrong, wrong


def test_gqa_bench_table_from_a_payload():
    from hpnlp.bench import gqa
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": {**gqa.SIZES["quick"], "batches": [1, 4], "decode_kv": [4, 2, 1]},
               "decode": [{"batch": 1, "kv_heads": 4, "attention": "multi-head",
                           "tokens_per_s": 100.0, "speedup": 1.0, "cache_bytes": 2 ** 20,
                           "params": 1000},
                          {"batch": 1, "kv_heads": 1, "attention": "multi-query",
                           "tokens_per_s": 150.0, "speedup": 1.5, "cache_bytes": 2 ** 18,
                           "params": 900},
                          {"batch": 1, "kv_heads": 4, "kv_latent_dim": 32,
                           "attention": "multi-head latent, 32 dims", "tokens_per_s": 120.0,
                           "speedup": 1.2, "cache_bytes": 2 ** 18, "params": 950}],
               "quality": [{"method": "from scratch", "kv_heads": 4, "attention": "multi-head",
                            "steps": 12, "params": 1000, "loss": 2.5, "loss_vs_multi_head": 0.0},
                           {"method": "uptrained from multi-head", "kv_heads": 1,
                            "attention": "multi-query", "steps": 4, "params": 900, "loss": 2.6,
                            "loss_vs_multi_head": 0.1, "loss_pooled": 3.0}],
               "seconds": {"decode": 9.0, "quality": 38.0}}
    md = gqa._markdown(payload)
    assert "| 1 | 1 | multi-query | 150.0 | 1.50x | 256 KiB | 900 |" in md
    assert "| 1 | latent | multi-head latent, 32 dims | 120.0 | 1.20x | 256 KiB | 950 |" in md
    assert "| uptrained from multi-head | 1 | multi-query | 4 | 900 | 2.6000 | +0.1000 | 3.0000 |" in md
    assert "| from scratch | 4 | multi-head | 12 | 1,000 | 2.5000 | +0.0000 | – |" in md


@pytest.mark.slow  # about 50 s on the 2-core CPU: CI's slow part runs it
def test_gqa_bench_quick_run(tmp_path):
    from hpnlp.bench import gqa
    p = gqa.run(str(tmp_path / "out"), quick=True, workdir=str(tmp_path / "w"))
    assert [(r["kv_heads"], r["kv_latent_dim"]) for r in p["decode"]] == [
        (4, 0), (2, 0), (1, 0), (4, 32)] * 2
    assert all(r["tokens_per_s"] > 0 for r in p["decode"])
    # a latent of 32 numbers per position: the cache of one key/value head of 16 (k and v)
    assert [r["cache_bytes"] for r in p["decode"][:4]] == [8192 * 4, 8192 * 2, 8192, 8192]
    assert [(r["method"], r["kv_heads"], r["kv_latent_dim"]) for r in p["quality"]] == [
        ("from scratch", 4, 0), ("from scratch", 2, 0), ("from scratch", 1, 0),
        ("from scratch", 4, 64), ("from scratch", 4, 64),
        ("continued from multi-head, lr 0.003", 4, 0),
        ("uptrained from multi-head, lr 0.003", 2, 0),
        ("uptrained from multi-head, lr 0.003", 1, 0),
        ("uptrained (SVD) from multi-head, lr 0.003", 2, 0),
        ("uptrained (SVD) from multi-head, lr 0.003", 1, 0),
        ("uptrained (SVD, 2 batches) from multi-head, lr 0.003", 2, 0),
        ("uptrained (SVD, 2 batches) from multi-head, lr 0.003", 1, 0),
        ("converted (SVD) from multi-head, lr 0.003", 4, 64),
        ("converted (SVD, 2 batches) from multi-head, lr 0.003", 4, 64)]
    assert all(np.isfinite(r["loss"]) for r in p["quality"])
    assert os.path.exists(tmp_path / "out" / "gqa_decode.png")


def test_moe_convert_scratch_baselines_warm_up_as_their_sources():
    """A review (session 118): `lm_steps` set --quick's 2-step warmup on the 1000-step
    from-scratch baselines, whose sources warmed up the experiment's 100; configs only."""
    from hpnlp.bench import moe_convert
    full, quick = moe_convert.SIZES["full"], moe_convert.SIZES["quick"]
    source, total = moe_convert._steps(full)
    cd, _ = moe_convert._scratch(full, "W", (4, 1))
    assert cd.train.steps == total and cd.train.warmup_steps == \
        moe_convert._source(full, "W", 4, 1, "s")[0].train.warmup_steps == 100
    assert moe_convert._scratch(quick, "W", (4, 1))[0].train.warmup_steps == 2


def test_moe_convert_bench_table_from_a_payload():
    from hpnlp.bench import moe_convert
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": moe_convert.SIZES["quick"], "steps": [12, 16],
               "prune": [{"method": "source", "experts": 4, "top_k": 1, "steps": 12,
                          "params": 2000, "loss": 3.0, "loss_vs_scratch": None},
                         {"method": "kept 2 of 4: routed", "experts": 2, "top_k": 1, "steps": 4,
                          "params": 1000, "loss": 2.9, "loss_vs_scratch": -0.1,
                          "loss_before": 3.1},
                         {"method": "half of each expert's neurons, shrunk (of 32)",
                          "experts": 4, "top_k": 1, "steps": 4, "params": 1100, "loss": 2.95,
                          "loss_vs_scratch": 0.02, "width": 16},
                         {"method": "each expert at rank 5 (SVD)", "experts": 4, "top_k": 1,
                          "steps": 4, "params": 1150, "loss": 2.97, "loss_vs_scratch": -0.01,
                          "loss_before": 3.2, "rank": 5}],
               "upcycle": [{"method": "source", "experts": 0, "top_k": 1, "steps": 12,
                            "params": 500, "loss": 2.8, "loss_vs_scratch": None},
                           {"method": "upcycled into 4 experts", "experts": 4, "top_k": 2,
                            "steps": 4, "params": 2000, "loss": 2.7, "loss_vs_scratch": 0.05,
                            "loss_before": 2.9, "loss_before_dropless": 2.8}],
               "seconds": {"prune": 9.0, "upcycle": 8.0}}
    md = moe_convert._markdown(payload)
    assert "| source | 4 experts, top-1 | 12 | 2,000 | 3.0000 | – | – |" in md
    assert ("| kept 2 of 4: routed | 2 experts, top-1 | 4 | 1,000 | 2.9000 | -0.1000 | 3.1000 |"
            in md)
    assert ("| upcycled into 4 experts | 4 experts, top-2 | 4 | 2,000 | 2.7000 | +0.0500 | "
            "2.9000 |" in md)
    assert "| source | dense | 12 | 500 | 2.8000 | – | – |" in md
    assert "the 2-expert LM for 16 steps" in md
    assert ("| half of each expert's neurons, shrunk (of 32) | 4 experts of width 16, top-1 | 4 "
            "| 1,100 | 2.9500 | +0.0200 | – |" in md)
    assert "from scratch below it: that narrow MoE for 16 steps." in md
    assert ("| each expert at rank 5 (SVD) | 4 experts of rank 5, top-1 | 4 | 1,150 | 2.9700 | "
            "-0.0100 | 3.2000 |" in md)
    assert "from scratch below it: that factorized MoE for 16 steps." in md
    assert "nothing dropped: 2.8000, the dense source 2.8000)." in md


@pytest.mark.slow  # about 2.3 min on the 2-core Xeon model 207: CI's slow part runs it
def test_moe_convert_bench_quick_run(tmp_path):
    from hpnlp.bench import compress, moe_convert
    p = moe_convert.run(str(tmp_path / "out"), quick=True, workdir=str(tmp_path / "w"))
    # every run was trained side by side before the rows asked for it (they found each
    # finished), and none was there before this bench run
    runs = {str(d) for d in (tmp_path / "w").iterdir() if not d.name.endswith("_shrunk")}
    assert len(runs) == 14 and runs <= {os.path.abspath(r) for r in compress.REUSED}
    assert p["reused_runs"] == 0 and p["seconds"]["runs side by side"] > 0
    assert [(r["method"], r["experts"], r["top_k"]) for r in p["prune"]] == [
        ("source", 4, 1), ("source, continued", 4, 1), ("kept 2 of 4: routed", 2, 1),
        ("kept 2 of 4: merged", 2, 1), ("kept 2 of 4: random", 2, 1), ("from scratch", 2, 1),
        (f"half of each expert's neurons, shrunk (of {p['prune'][6]['width'] * 2})", 4, 1),
        ("from scratch", 4, 1), (f"each expert at rank {p['prune'][8]['rank']} (SVD)", 4, 1),
        ("from scratch", 4, 1)]
    assert [(r["method"], r["experts"], r["top_k"]) for r in p["upcycle"]] == [
        ("source", 0, 1), ("source, continued", 0, 1), ("upcycled into 4 experts", 4, 2),
        ("from scratch", 4, 2)]
    assert all(np.isfinite(r["loss"]) for r in p["prune"] + p["upcycle"])
    # the upcycled model starts as the dense source (top_k gates; nothing dropped at eval)
    assert p["upcycle"][2]["loss_before_dropless"] == pytest.approx(p["upcycle"][0]["loss"],
                                                                    rel=1e-5)
    assert p["prune"][2]["params"] < p["prune"][0]["params"]
    narrow, scratch = p["prune"][6:8]  # the shrunk narrow experts and that MoE from scratch
    assert narrow["params"] == scratch["params"] < p["prune"][0]["params"]
    assert narrow["width"] == scratch["width"] and scratch["loss_vs_scratch"] == 0
    low, scratch = p["prune"][8:]  # each expert factorized, and that MoE from scratch
    assert low["params"] == scratch["params"] < p["prune"][0]["params"]
    assert low["rank"] == scratch["rank"] and np.isfinite(low["loss_before"])


def test_rope_bench_table_from_a_payload():
    from hpnlp.bench import rope
    long = {"seq_len": 8, "loss": 2.75, "loss_by_position": [2.0] * 8,
            "tokens_by_position": [1.0] * 8}
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": dict(rope.SIZES["quick"], bucket=2),
               "quality": [{"pos_emb": "learned", "steps": 12, "params": 1000, "seq_len": 4,
                            "loss": 2.5, "eval": dict(long, seq_len=4)},
                           {"pos_emb": "rope", "steps": 12, "params": 900, "seq_len": 4,
                            "loss": 2.4, "eval": dict(long, seq_len=4), "long": long,
                            "loss_long": 2.75, "loss_long_seen": 2.5, "loss_long_unseen": 3.0}],
               "seconds": {"quality": 38.0}}
    md = rope._markdown(payload)
    assert "| `learned` | 1,000 | 2.5000 | – | – | – |" in md
    assert "| `rope` | 900 | 2.4000 | 2.7500 | 2.5000 | 3.0000 |" in md
    assert "at 8, positions >= 4" in md
    assert rope._span(long, 4, 8) == 2.0


@pytest.mark.slow  # about 45 s on the 2-core CPU: CI's slow part runs it
def test_rope_bench_quick_run(tmp_path):
    from hpnlp.bench import rope
    p = rope.run(str(tmp_path / "out"), quick=True, workdir=str(tmp_path / "w"))
    assert [r["pos_emb"] for r in p["quality"]] == ["learned", "sinusoidal", "rope"]
    for r in p["quality"]:  # the bench's own eval is the trainer's
        assert abs(r["loss"] - r["run_eval_loss"]) < 1e-4
        assert ("loss_long" in r) == (r["pos_emb"] != "learned")
    assert p["quality"][2]["long"]["seq_len"] == 2 * p["quality"][2]["seq_len"]
    assert all(np.isfinite(r["loss_long_unseen"]) for r in p["quality"][1:])
    assert os.path.exists(tmp_path / "out" / "rope_loss_by_position.png")


def test_kv_cache_bench_table_from_a_payload():
    from hpnlp.bench import gqa, kv_cache
    assert gqa.cache_bytes(gqa.SIZES["quick"]["decode"], 1, 4) == 8192 * 4
    assert gqa.cache_bytes(gqa.SIZES["quick"]["decode"], 1, 4, "int8") == 2 * 64 * 4 * 20
    payload = {"machine": {"date": "d", "cpu": "c", "machine": "m", "cores": 2, "backend": "cpu",
                           "versions": {}},
               "sizes": dict(kv_cache.SIZES["quick"], batches=[1, 4]),
               "decode": [{"batch": 4, "kv_heads": 4, "attention": "multi-head",
                           "kv_cache": "none", "tokens_per_s": 100.0, "speedup": 1.0,
                           "cache_bytes": 2 ** 20},
                          {"batch": 4, "kv_heads": 4, "attention": "multi-head",
                           "kv_cache": "int8", "tokens_per_s": 180.0, "speedup": 1.8,
                           "cache_bytes": 2 ** 18}],
               "quality": [{"kv_heads": 1, "attention": "multi-query",
                            "trained_with": "float32 cache", "steps": 12,
                            "loss_float_cache": 2.5, "loss_int8_cache": 2.5012,
                            "loss_change": 0.0012, "argmax_agreement": 0.9951}],
               "seconds": {"decode": 9.0, "quality": 38.0}}
    md = kv_cache._markdown(payload)
    assert "| 4 | 4 | multi-head | int8 | 180.0 | 1.80x | 256 KiB |" in md
    assert "| 1 | multi-query | float32 cache | 12 | 2.5000 | 2.5012 | +0.0012 | 99.51% |" in md


@pytest.mark.slow  # about 70 s on the 2-core CPU: CI's slow part runs it
def test_kv_cache_bench_quick_run(tmp_path):
    from hpnlp.bench import kv_cache
    p = kv_cache.run(str(tmp_path / "out"), quick=True, workdir=str(tmp_path / "w"))
    assert [(r["kv_heads"], r["kv_cache"]) for r in p["decode"]] == [
        (4, "none"), (4, "int8"), (1, "none"), (1, "int8")] * 2
    assert all(r["tokens_per_s"] > 0 for r in p["decode"])
    assert [(r["kv_heads"], r["trained_with"]) for r in p["quality"]] == [
        (4, "float32 cache"), (2, "float32 cache"), (1, "float32 cache"), (4, "int8 cache")]
    for r in p["quality"]:  # the int8 cache changes the model, a little
        assert r["loss_int8_cache"] != r["loss_float_cache"]
        assert abs(r["loss_change"]) < 0.05 and r["argmax_agreement"] > 0.95


@pytest.mark.slow  # 7.5 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_runs_side_by_side_train_once_each_one_core_a_process(tmp_path):
    """harness.train_side_by_side (the compress bench's parts train their runs so): every
    job once, each in a process of its own pinned to one core where there are two or more,
    the same processes for every batch inside `side_by_side_processes` (a single run of the
    first batch trains here); runs queued ahead (`train_ahead`) train once each, in those
    processes, even where a batch asks for them again, and only where a batch has no run
    left for a process (a batch's runs start before the ahead runs not yet handed out); a
    block that raises ends its processes at once; a failed job raises in the caller,
    naming the runs, and one that cannot reach the processes (a lambda) before any starts."""
    import json

    import side_by_side_worker as w
    from hpnlp.bench import harness

    def ran(n, tag):
        lines = [(tmp_path / f"{tag}{i}" / "ran.jsonl").read_text().splitlines()
                 for i in range(n)]
        assert all(len(x) == 1 for x in lines), f"a run of {tag} trained twice: {lines}"
        return [json.loads(x[0]) for x in lines]
    ahead = [(i, str(tmp_path / f"ahead{i}")) for i in range(4)]
    with harness.side_by_side_processes():
        harness.train_side_by_side(w.record, [(0, str(tmp_path / "one0"))])
        for tag in ("a", "b"):
            harness.train_side_by_side(w.record, [(i, str(tmp_path / f"{tag}{i}"))
                                                  for i in range(3)])
        harness.train_ahead(w.record_slowly, ahead)
        harness.train_side_by_side(w.record_slowly, [(i, str(tmp_path / f"c{i}"))
                                                     for i in range(2)] + ahead[::3])
    assert [r["pid"] for r in ran(1, "one")] == [os.getpid()]
    if len(os.sched_getaffinity(0)) < 2:  # one core: here, one after another
        assert {r["pid"] for r in ran(3, "a") + ran(3, "b") + ran(2, "c")} == {os.getpid()}
        assert not (tmp_path / "ahead0").exists()  # nothing ahead: the batches train them
        return
    everything = ran(3, "a") + ran(3, "b") + ran(2, "c") + ran(4, "ahead")
    pids = {r["pid"] for r in everything}  # one set of processes, at most one a core
    assert os.getpid() not in pids and len(pids) <= len(os.sched_getaffinity(0))
    assert all(len(r["cores"]) == 1 and r["cores"][0] in os.sched_getaffinity(0)
               for r in everything)
    # two processes took the first two ahead runs (half a second each: the batch waits on
    # the first); the batch's two then started before the other two (the last the batch's)
    assert max(r["start"] for r in ran(2, "c")) < min(r["start"] for r in ran(4, "ahead")[2:])
    # a block that raises (an interrupt, a failed part) ends its processes at once, not
    # after the run ahead they are training (a minute's)
    with pytest.raises(KeyboardInterrupt):
        with harness.side_by_side_processes() as pool:
            harness.train_ahead(w.record_then_wait, [(0, str(tmp_path / "long"))])
            procs = list(pool.procs)
            raise KeyboardInterrupt
    assert all(p.exitcode is not None for p in procs) and not (tmp_path / "long" / "done").exists()
    with pytest.raises(TypeError, match=r"must pickle"):  # said here, not hung on
        harness.train_side_by_side(lambda i, out: None, [(0, "x"), (1, "y")])
    with pytest.raises(RuntimeError, match=r"failed in its own process .*r0b"):
        harness.train_side_by_side(w.record, [(-1, str(tmp_path / "bad")),
                                              (0, str(tmp_path / "r0b"))])


def test_retrieval_bench_datastores_follow_their_cap_and_their_lm(tmp_path, monkeypatch):
    """Found by running `bench retrieval --quick`: its search part asked the kNN-LM part's
    capped datastore for the whole training split, and the refusal stopped the bench. The
    search part now reads the split as capped; the capped and whole datastores get their own
    folders, and an LM trained afresh takes its old datastores with it."""
    from hpnlp.bench import compress as bench_compress
    from hpnlp.bench import retrieval as bench_retrieval
    quick, full = bench_retrieval.SIZES["quick"], bench_retrieval.SIZES["full"]
    assert full["datastore_tokens"] == 0 < quick["datastore_tokens"]
    assert (bench_retrieval._datastore(quick, "bytes", "w")
            != bench_retrieval._datastore(full, "bytes", "w"))
    monkeypatch.setattr(bench_compress, "_train", lambda cd, out: {})
    out = str(tmp_path / bench_retrieval.lm_config(quick, "bytes").name)
    stores = ("datastore_bytes", "datastore_bytes_first100000", "datastore_words")
    for reused, left in (([out], stores), ([], ("datastore_words",))):
        for name in stores:
            os.makedirs(tmp_path / name, exist_ok=True)
        monkeypatch.setattr(bench_compress, "REUSED", reused)
        assert bench_retrieval._trained(quick, "bytes", str(tmp_path)) == out
        assert sorted(os.listdir(tmp_path)) == sorted(left)


def test_retrieval_bench_memory_part_reuses_its_runs_and_deletes_nothing(tmp_path, monkeypatch):
    """Review r11: `bench retrieval --parts memory` deleted W/head and W/memory whatever they
    held (another tool's output in a shared --workdir too), and retrained both on every
    rerun. It goes through `_train` as the bench's other parts do: foreign files are a
    RunConflict, left in place, and finished runs of its configs are reused."""
    import hpnlp.train
    import hpnlp.train.checkpoint
    from hpnlp.bench import compress as bench_compress
    from hpnlp.bench import kv_memory
    from hpnlp.config import from_configdict
    trained = []
    monkeypatch.setattr(hpnlp.train, "run", lambda cd, out: trained.append(out) or {})
    monkeypatch.setattr(bench_compress, "REUSED", [])
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "notes.txt").write_text("mine")
    with pytest.raises(bench_compress.RunConflict, match=rf"^{tmp_path / 'head'} holds files "
                       r"that are not a run's \(notes.txt\)"):
        kv_memory.rows(True, str(tmp_path))
    assert (tmp_path / "head" / "notes.txt").read_text() == "mine" and not trained
    (tmp_path / "head" / "notes.txt").unlink()
    # finished runs of both configs (their config.json read as the bench's own): reused
    monkeypatch.setattr(hpnlp.train.checkpoint, "load_run_config", lambda out: from_configdict(
        kv_memory.config(os.path.basename(out), True)))
    for arg in ("head", "memory"):
        os.makedirs(tmp_path / arg, exist_ok=True)
        (tmp_path / arg / "summary.json").write_text('{"final_step": 300}')
    classes = 66
    monkeypatch.setattr(kv_memory, "per_class", lambda wd: {
        "count": np.ones(classes), "head": np.zeros(classes),
        **({"memory": np.ones(classes)} if wd.endswith("memory") else {})})
    rows = kv_memory.rows(True, str(tmp_path))
    assert not trained and sorted(bench_compress.REUSED) == [str(tmp_path / a)
                                                              for a in ("head", "memory")]
    assert [(r["prediction"], r["steps"], r["run_seconds"]) for r in rows[:3]] == [
        ("head", 300, None), ("memory", 300, None), ("head", 300, None)]


@pytest.mark.parametrize("impl", ["jax.nn.dot_product_attention", "dense", "synthesizer"])
def test_attention_fwd_bwd_times_a_whole_train_step(monkeypatch, impl):
    """A review (session 106): the gradients alone of sum(output) let XLA drop the forward's
    P V product of every row whose output ends in it (5 of a step's 6 products), and no row
    differentiated its own parameters (Synthesizer's [H, F, L] logits product). The timed
    callable does at least the 6 products and, for a variant with parameters, their gradient."""
    seen = {}

    def fake(fn, *args, **kw):
        seen["flops"] = jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]
        seen["args"] = args
        return harness.Timing(1.0, 1.0, 1.0, 1, 0.0)
    monkeypatch.setattr(harness, "time_jax", fake)
    L, D = 128, 64
    bench_attention.measure(dict(impl=impl, L=L, mode="fwd_bwd", causal=False, B=1, H=1, D=D,
                                 repeats=1))
    products = 6 * 2 * L * L * D
    if impl == "synthesizer":  # + its logits product's weight gradient, 2 L^2 F (F = D here)
        products += 2 * L * L * D
    assert seen["flops"] >= products
    _, grads = jax.jit(bench_attention._step(bench_attention._jax_fn(
        impl, L, False, B=1, H=1, D=D)[0]))(*seen["args"])
    assert jax.tree.structure(grads[0]) == jax.tree.structure(seen["args"][0])  # the params'


def test_torch_fwd_bwd_rows_return_fresh_gradients(monkeypatch):
    """A review (session 107): PyTorch's rows called `.backward()`, which added each call's
    gradients into the leaves' `.grad` (three more passes over [B, H, L, D] a call) where
    `jax.value_and_grad` returns fresh ones; the softmax peer did the same for its hidden
    states. Each timed call now returns its own gradients (equal call to call, not summed)."""
    torch = pytest.importorskip("torch")
    from hpnlp.bench import softmax as bench_softmax
    calls = []

    def fake(torch_, device, call, **kw):
        for _ in range(2):
            calls.append(call())
        return harness.Timing(1.0, 1.0, 1.0, 1, 0.0), None
    monkeypatch.setattr(harness, "time_torch", fake)
    bench_attention.measure(dict(impl="torch.scaled_dot_product_attention", L=8,
                                 mode="fwd_bwd", causal=True, B=1, H=1, D=4, repeats=1))
    (loss, (dq, dk, dv)), (loss2, (dq2, _, _)) = calls  # the value and fresh gradients
    assert dq.shape == dk.shape == dv.shape == (1, 1, 8, 4) and float(loss) == float(loss2)
    torch.testing.assert_close(dq, dq2)  # the second call's, not the sum of both
    calls.clear()
    bench_softmax.measure(dict(impl=bench_softmax.TORCH_ADAPTIVE, V=64, N=16, E=8, repeats=1,
                               options={}))
    (g1, g2) = calls
    torch.testing.assert_close(g1[0], g2[0])  # h's gradient, not twice it


def test_moe_layer_rows_time_a_whole_train_step():
    """A session-106 find: the gradients alone of sum(mlp(x) * r) let XLA drop the dense
    MLP's second forward product, the baseline of moe_layer_overhead_vs_dense_8k; the timed
    step computes all six (two forward, four backward)."""
    from hpnlp.bench import moe
    T, M, F = 64, 16, 32
    p = {"wi": jnp.ones((M, F)), "bi": jnp.zeros((1, F)), "wo": jnp.ones((F, M)),
         "bo": jnp.zeros((1, M))}
    x = r = jnp.ones((T, M))
    flops = moe.step(moe.dense_mlp).lower(p, x, r).compile().cost_analysis()["flops"]
    assert flops >= 6 * 2 * T * M * F


def test_quant_quality_reuses_its_runs_as_the_compress_bench_does(tmp_path, monkeypatch):
    """A review (session 115): the quant bench's quality part trained by hpnlp.train.run,
    which resumed a finished run of a changed config unsaid and never checked that a QAT run
    started from the float run now in the workdir. It trains by `compress._train` (reused,
    refused or trained anew: tested above); nothing trains or quantizes here."""
    import hpnlp.train
    from hpnlp.bench import compress, quant
    from hpnlp.compress import ptq

    def trains(*_, **__):
        raise AssertionError("trained by hpnlp.train.run, not compress._train")
    monkeypatch.setattr(hpnlp.train, "run", trains)
    calls = []
    monkeypatch.setattr(compress, "_train", lambda cd, out: calls.append(
        (out, cd.train.init_from)) or {"task": "t"})
    ev = {"loss": 2.0, "accuracy": 0.5}
    monkeypatch.setattr(ptq, "quantize", lambda *a, **k: {
        "eval": {"float32": ev, "quantized": ev}, "size_bytes": {
            "float32_params": 4, "quantized_file": 1},
        "forward": {"float32_s": 1.0, "quantized_s": 1.0, "how": "x"}})
    rows = quant.quality_rows(quant.SIZES["quick"], str(tmp_path))
    floats = [out for out, init in calls if not init]
    assert len(floats) == 2 and all(init in floats for _, init in calls if init)
    assert len(calls) == 2 * (1 + len(quant.QAT)) and len(rows) == 2 * (
        1 + len(quant.PTQ) + len(quant.QAT))


def test_a_distill_recipes_run_of_another_model_into_a_recorded_report_is_refused(
        tmp_path, monkeypatch, capsys):
    """A README walk (session 116): the byte LM's distill_recipes command without its
    `--model 'byte LM'` replaced the recorded byte LM report with the text classifier's.
    Refused as --quick is; the report's own model runs."""
    from hpnlp.bench import distill_recipes
    from hpnlp.bench.__main__ import main as bench_main
    ran = []
    monkeypatch.setattr(distill_recipes, "main", lambda args: ran.append(args.model))
    (tmp_path / "results.md").write_text("# hpnlp benchmark: distill_recipes\n\n...")
    (tmp_path / "results.json").write_text(json.dumps({"quick": False, "model": "byte LM"}))
    with pytest.raises(SystemExit) as e:
        bench_main(["distill_recipes", "--out", str(tmp_path)])
    assert e.value.code == 2 and ran == []
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"--out {tmp_path} holds a full run's report of the distill_recipes bench, which this "
        "--model 'text classifier' run would replace; give another --out")
    bench_main(["distill_recipes", "--model", "byte LM", "--out", str(tmp_path)])
    assert ran == ["byte LM"]


def test_side_by_side_runs_no_more_processes_than_the_cgroup_allows(monkeypatch):
    """A review (session 118): SideBySide counted its cores by affinity alone, so a container
    limited to 2 CPUs on a 64-CPU host started a training process per host CPU."""
    from hpnlp import kernels
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(kernels, "cgroup_cpu_limit", lambda *a: 2.0)
    assert harness.SideBySide().cores == [0, 1]
    monkeypatch.setattr(kernels, "cgroup_cpu_limit", lambda *a: None)
    assert len(harness.SideBySide().cores) == 64
