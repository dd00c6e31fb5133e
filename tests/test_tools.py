"""The tools' own logic (tools/*.py) beyond the one-line refusals of bad flags, which
tests/test_bench.py::test_tools_refuse_bad_flags_in_one_line_before_timing checks."""

import importlib
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import pytest

import hpnlp  # noqa: F401  (before any JAX computation: its XLA flags, which a tool reads)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str):
    """tools/NAME.py as a module, imported as `python tools/NAME.py` finds its neighbours."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))


def test_xla_workaround_ab_switches_the_isa_cap_alone(monkeypatch):
    """Review r6: its "off" arm was HPNLP_XLA_WORKAROUNDS=0, which also dropped the steps'
    YNN-fusions-off compile option (1.05x on the byte LM's train step), so the speed
    docs/xla_defects.md credited to the AVX2 cap was partly YNN's. The arms now differ in the
    cap alone, where it applies (the CPU and jaxlib made to be such here)."""
    from hpnlp import xla_workarounds as xw
    from hpnlp.train import step

    tool = _tool("xla_workaround_ab")
    monkeypatch.setattr(xw, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setattr(xw.importlib.metadata, "version", lambda name: xw.PAD_OVERREAD_JAXLIB[0])
    arms = {}
    for on in (True, False):
        env = tool.arm_env(on)
        for name in ("XLA_FLAGS", "HPNLP_XLA_WORKAROUNDS", "HPNLP_ISA_WORKAROUND"):
            monkeypatch.setenv(name, env[name])
        arms[on] = (xw.pad_overread_flag(), step.step_compiler_options())
    assert arms[True][0] == xw.ISA_FLAG and arms[False][0] is None
    assert arms[True][1] == arms[False][1]  # the steps' compile options alike
    if step._xla_knows(tuple(step.CPU_NO_YNN_FUSION_OPTIONS.items())):
        assert "xla_cpu_experimental_ynn_fusion_type" in arms[False][1]
    # the arms start from the user's XLA_FLAGS, not those hpnlp's import here added to them
    monkeypatch.setattr(xw, "APPLIED", [xw.ISA_FLAG])
    monkeypatch.setenv("XLA_FLAGS", f"{xw.ISA_FLAG} --xla_cpu_enable_fast_math=false")
    assert tool.given_xla_flags() == "--xla_cpu_enable_fast_math=false"


def test_interleaved_times_leave_the_inputs_making_out_of_the_clock(monkeypatch):
    """Review r6: the inputs `fresh()` made were taken as made when the clock started, but
    JAX dispatches asynchronously, so an input still being computed then counted as the
    timed calls' time. Every input is waited for before the clock starts: checked by the
    order of the calls (review d2: a wall-clock comparison failed on a preempted core)."""
    ablib = _tool("ablib")
    events = []
    inputs = [(object(),), (object(),)]
    made = iter(inputs)
    monkeypatch.setattr(ablib.jax, "block_until_ready",
                        lambda x: events.append(("ready", x)) or x)
    monkeypatch.setattr(ablib.time, "perf_counter", lambda: events.append(("clock",)) or 0.0)
    ablib.interleaved_times({"identity": (lambda y: y, lambda: next(made))}, rounds=1, calls=2)
    first_clock = events.index(("clock",))
    assert ("ready", inputs) in events[:first_clock], events


def test_flash_gpu_blocks_write_keeps_the_table_whole_when_cut_off(tmp_path, monkeypatch):
    """Review r6: `--write` opened the committed table for writing, emptying it, before its
    dump: a kill or a full disk there left a file every GPU `chunked` run then failed on.
    A dump that stops half-way now leaves the table as it was (and no .tmp beside it); a
    whole one stores this device's fastest configurations, keys sorted, ending in a newline."""
    from hpnlp.attention import flash_gpu

    tool = _tool("flash_gpu_blocks")
    path = tmp_path / "flash_gpu_blocks.json"
    shutil.copy(flash_gpu.TUNED_PATH, path)
    before = path.read_text()
    monkeypatch.setattr(flash_gpu, "TUNED_PATH", str(path))
    rows = [{"dtype": "float32", "what": "fwd", "blocks": {"fwd_q": 64}, "fwd_ms": 2.0},
            {"dtype": "float32", "what": "fwd", "blocks": {"fwd_q": 32}, "fwd_ms": 1.0},
            {"dtype": "float32", "what": "fwd+bwd", "blocks": {"bwd_inner": 16},
             "fwd_bwd_ms": 3.0}]
    dump = json.dump

    def cut(obj, f, **kw):  # the first bytes reach the file, then the process dies
        f.write(json.dumps(obj, **kw)[:20])
        raise KeyboardInterrupt
    monkeypatch.setattr(json, "dump", cut)
    with pytest.raises(KeyboardInterrupt):
        tool._write_tuned(rows, 64)
    assert path.read_text() == before and os.listdir(tmp_path) == [path.name]
    monkeypatch.setattr(json, "dump", dump)
    tool._write_tuned(rows, 64)
    text = path.read_text()
    table = json.loads(text)
    assert text.endswith("}\n") and list(table) == sorted(table)
    kind = jax.devices()[0].device_kind
    assert table[kind][flash_gpu.tuned_key(jnp.float32, 64)] == {"fwd_q": 32, "bwd_inner": 16}


def test_grad_norm_parts_sets_options_and_refuses_mistakes_in_one_line():
    """Review r6: `--set attention.options.num_clusters=8` (the README's next step after
    `--set attention.name=clustered`) was a KeyError traceback, a missing field or 64.0 for
    an int a traceback, and `train.progress=flase` silently false. An option now reaches the
    config, parsed as hpnlp.main parses `--config.attention.options.KEY=VALUE`, and each
    mistake is one line naming its --set."""
    from hpnlp.config import from_configdict, validate

    tool = _tool("grad_norm_parts")

    def load():
        return tool.load_configdict(os.path.join(ROOT, "experiments/lra.py:listops"))
    cd = tool.apply_sets(load(), ["attention.name=clustered",
                                  "attention.options.num_clusters=8", "train.progress=false",
                                  "model.dropout=0"])
    assert cd.attention.options.num_clusters == 8 and cd.train.progress is False
    assert cd.model.dropout == 0.0
    validate(from_configdict(cd))
    for item, said in (("model.widht=3", "no such config field: 'widht' Did you mean"),
                       ("model.width.x=3", "no such config field: model.width.x"),
                       ("model.width=64.0", "model.width takes an integer; '64.0' is not one"),
                       ("train.progress=flase", "train.progress is a boolean; give true or "
                        "false"),
                       ("model.width", "give field.path=value")):
        with pytest.raises(SystemExit, match=f"^--set {item}: {said}"):
            tool.apply_sets(load(), [item])


def test_a_targets_value_is_shown_on_its_side_of_the_bound_and_links_keep_their_scheme():
    """A review (session 117): 0.8004 under "<= 0.8" read "0.800" (and "0.8" in targets.md)
    marked missed; 1.9996 under ">= 2" read "2". Digits are added until the shown value is
    not the bound; a value far from it is shown as before. And sync_readme's relink made an
    absolute link's scheme a path ("https" of https://...)."""
    from hpnlp.bench.report import beside_bound, targets_md
    assert beside_bound(0.8004, 0.8, 3, "f") == "0.8004"
    assert beside_bound(1.9996, 2.0, 3, "g") == "1.9996"
    assert beside_bound(0.73612, 0.8, 3, "f") == "0.736"  # as before
    assert beside_bound(0.8, 0.8, 3, "f") == "0.800"  # the bound itself
    table = targets_md({"x": {"value": 0.8004, "bound": 0.8, "op": "<=", "met": False}})
    assert "| `x` | 0.8004 | <= 0.8 | NO |" in table
    targets_table = _tool("targets_table")
    assert targets_table.number(0.8004, 0.8) == "0.8004" and targets_table.number(0.5) == "0.5"
    sync_readme = _tool("sync_readme")
    text = "[plot](a.png) and [site](https://a.org/x) and [top](#targets)"
    assert sync_readme.relink(text, "docs/benchmarks/b") == (
        "[plot](docs/benchmarks/b/a.png) and [site](https://a.org/x) and [top](#targets)")
