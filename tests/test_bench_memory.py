"""`bench memory`: the HLO collective counter on handwritten HLO, the entry end to end on
8 simulated devices (files, FSDP's per-device params + optimizer bytes against
replicated, an all-reduce in data parallelism), and no collectives on one device."""

import json
import os

import jax
import pytest

from hpnlp.bench import memory
from hpnlp.bench.__main__ import main as bench_main

HLO = """\
HloModule m, entry_computation_layout={()->()}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%p), index=1
  %ar.loop = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %ar.loop)
}

%cond (p: (s32[], f32[16])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,4], b: bf16[2,2]) -> f32[] {
  %a = f32[8,4]{1,0} parameter(0)
  %ag = f32[32,4]{1,0} all-gather(%a), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}
  %ar.t = (f32[], /*index=1*/bf16[2,2]{1,0}) all-reduce(%s, %b), channel_id=3, replica_groups=[1,4]<=[4], to_apply=%add
  %rs = f32[2,4]{1,0} reduce-scatter(%a), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %a2a = f32[8,4]{1,0} all-to-all(%a), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}, dimensions={0}
  %cp = f32[8,4]{1,0} collective-permute(%a), channel_id=6, source_target_pairs={{0,1},{1,0}}
  %ags = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%a), channel_id=7, replica_groups={{0,1}}, dimensions={0}
  %w = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[] constant(0)
}
"""


def test_collective_counter_on_handwritten_hlo():
    rows = {r["name"]: r for r in memory.parse_collectives(HLO, 4)}
    assert set(rows) == {"ar.loop", "ag", "ar.t", "rs", "a2a", "cp", "ags"}
    expect = {  # name: (op, n, S bytes, per-device send bytes, trips)
        "ar.loop": ("all-reduce", 2, 64, 2 * 1 / 2 * 64, 5),  # in a 5-trip loop
        "ag": ("all-gather", 4, 512, 3 / 4 * 512, 1),
        "ar.t": ("all-reduce", 4, 4 + 8, 2 * 3 / 4 * 12, 1),  # tuple: f32[] + bf16[2,2]
        "rs": ("reduce-scatter", 4, 32 * 4, 3 / 4 * 128, 1),  # S = result x n
        "a2a": ("all-to-all", 2, 128, 1 / 2 * 128, 1),
        "cp": ("collective-permute", 4, 128, 128, 1),
        "ags": ("all-gather", 2, 256, 1 / 2 * 256, 1),  # the start tuple's result half
    }
    for name, (op, n, size, send, trips) in expect.items():
        r = rows[name]
        assert (r["op"], r["n"], r["buffer_bytes"], r["trips"]) == (op, n, size, trips), name
        assert r["send_bytes"] == pytest.approx(send), name
        assert r["in_loop"] == (name == "ar.loop") and not r["flags"], name
    s = memory.summarize_collectives(list(rows.values()))
    assert s["by_op"]["all-reduce"]["executions"] == 6 and s["in_loop_ops"] == 1
    assert s["by_op"]["all-reduce"]["send_bytes"] == pytest.approx(5 * 64 + 18)
    # A loop without a known trip count is counted once and flagged.
    unknown = memory.parse_collectives(HLO.replace('"known_trip_count":{"n":"5"}', ""), 4)
    loop = next(r for r in unknown if r["name"] == "ar.loop")
    assert loop["trips"] == 1 and loop["flags"] == ["unknown trip count"]


TINY = dict(task="byte_lm", vocab=256, width=32, depth=1, heads=8, mlp=64, L=16, B_per_device=1)


def test_the_fsdp_target_is_judged_only_at_the_8_devices_it_is_set_for():
    """Found by a README walk: --devices 2 reported FAIL against 1/6, which no split of 2
    devices can reach (a perfect one is 1/2)."""
    def row(kind, params_opt, n):
        return dict(status="ok", kind=kind, name=kind, devices=n,
                    per_device={"params_opt": params_opt},
                    collectives={"send_bytes": 0}, textbook={"bytes": 0})
    for n, fsdp, verdict in ((2, 50, None), (8, 13, True), (8, 20, False)):
        s = memory._summarize([row("data", 100, n), row("fsdp", fsdp, n)])
        assert s["fsdp_pass"] is verdict and s["fsdp_over_replicated_params_opt"] == fsdp / 100


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_memory_entry_on_8_simulated_devices(tmp_path):
    out = str(tmp_path / "memory")
    payload = memory.run(out, quick=True, devices=8, model=TINY,
                         only=("replicated (data=8)", "fsdp=8"))
    for f in ("results.json", "results.md", "memory_by_mode.png"):
        assert os.path.getsize(os.path.join(out, f)) > 0, f
    rep, fsdp = payload["results"]
    assert rep["status"] == "ok" and fsdp["status"] == "ok", payload["results"]
    assert rep["devices"] == 8 and rep["mesh_shape"]["data"] == 8 and fsdp["mesh_shape"]["fsdp"] == 8
    assert fsdp["per_device"]["params_opt"] < rep["per_device"]["params_opt"] / 6
    assert payload["summary"]["fsdp_pass"] is True
    assert rep["memory_analysis"]["argument"] >= rep["per_device"]["params_opt"]
    # Data parallelism syncs gradients with an all-reduce; FSDP gathers parameters.
    assert rep["collectives"]["by_op"]["all-reduce"]["executions"] >= 1
    assert fsdp["collectives"]["by_op"]["all-gather"]["executions"] >= 1
    assert rep["textbook"]["bytes"] == pytest.approx(2 * 7 / 8 * rep["global_param_bytes"])
    md = open(os.path.join(out, "results.md")).read()
    assert "PASS" in md and "HLO / formula" in md
    assert json.load(open(os.path.join(out, "results.json")))["devices"] == 8


def test_one_device_compiles_without_collectives():
    if jax.device_count() != 1:
        pytest.skip("this process has several devices")
    res = memory.measure(TINY, dict(name="single", kind="data", mesh=dict(data=1)))
    assert res["collectives"]["by_op"] == {} and res["textbook"]["bytes"] == 0
    assert res["per_device"]["opt_state"] == pytest.approx(2 * res["per_device"]["params"], rel=0.01)


def test_cli_registers_entry(capsys):
    with pytest.raises(SystemExit):
        bench_main(["memory", "--help"])
    assert "--devices" in capsys.readouterr().out
