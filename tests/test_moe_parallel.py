"""Expert parallelism on 8 simulated CPU devices equals the 1-device run.

Experts sharded over `mesh.expert`, alone and composed with data and FSDP parallelism:
five training steps (dropout on, capacity tight enough that choices are dropped) give the
same losses, dropped-choice counts and parameters as one device routing the same groups
(`model.moe.groups=8`), and the compiled step moves tokens by all-to-all. A model whose
experts or groups the mesh does not split (a teacher, a source run) runs without the
all-to-all, as on one device; a bi-encoder's pool evaluation routes in the run's groups
inside and outside its mesh.
"""

import json

import numpy as np
import pytest
from test_parallel import _run as run_modes

MODES = {
    "expert": {"data": 1, "expert": 8},
    "data_x_expert": {"data": 2, "expert": 4},
    "fsdp_x_expert": {"data": 1, "fsdp": 2, "expert": 4},
}

CODE = r"""
import json, sys, tempfile
import jax, numpy as np
from hpnlp.config import default_configdict, from_configdict
from hpnlp.train import Trainer
from hpnlp.train.loop import _global

out_dir, modes = sys.argv[1], json.loads(sys.argv[2])
for name, mesh in modes.items():
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=32, depth=2, num_heads=2, mlp_dim=64, max_len=32, dropout=0.1)
    cd.model.moe.update(num_experts=8, top_k=2, router="top_k", groups=8, every=2,
                        capacity_factor=1.0, noisy=True)
    cd.train.update(steps=5, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, progress=False)
    cd.mesh.update(**mesh)
    tr = Trainer(from_configdict(cd), tempfile.mkdtemp())
    state, _ = tr.initial_state()
    losses, dropped = [], []
    with tr._context():
        batch0 = _global(next(tr.train_iter), tr.batch_sharding)
        hlo = tr.train_step.lower(state, batch0).compile().as_text()
        for i in range(5):
            batch = batch0 if i == 0 else _global(next(tr.train_iter), tr.batch_sharding)
            state, m = tr.train_step(state, batch)
            losses.append(float(m["loss"]) / float(m["weight"]))
            dropped.append(float(m["moe_dropped"]))
    flat = {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    np.savez(f"{out_dir}/{name}.npz", **flat)
    wi = state.params["trunk"]["block_1"]["moe"]["wi"]
    json.dump({"losses": losses, "dropped": dropped, "wi": [str(a) for a in wi.sharding.spec],
               "all_to_all": hlo.count("all-to-all(")}, open(f"{out_dir}/{name}.json", "w"))
print("MOE PARALLEL OK")
"""


def _run(out_dir, modes, devices, code=CODE, done="MOE PARALLEL OK"):
    run_modes(out_dir, modes, devices, code=code, done=done)


@pytest.mark.slow
def test_expert_parallel_matches_one_device(tmp_path):
    _run(tmp_path, {"one": {}}, 1)
    _run(tmp_path, MODES, 8)
    ref = json.load(open(tmp_path / "one.json"))
    ref_params = np.load(tmp_path / "one.npz")
    assert sum(ref["dropped"]) > 0 and ref["all_to_all"] == 0
    for name in MODES:
        got = json.load(open(tmp_path / f"{name}.json"))
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        assert got["dropped"] == ref["dropped"], name
        assert got["wi"][0] == "expert", (name, got["wi"])  # experts split over the expert axis
        assert got["all_to_all"] >= 4, name  # dispatch and return, forward and backward
        # Adam divides each gradient element by its own scale, so an element whose gradient
        # is ~0 (a rare byte's embedding) moves by up to lr per step in a direction that
        # float round-off picks (the devices sum in another order): 1e-4 here, against
        # lr = 3e-3; every other element agrees to 1e-5.
        params = np.load(tmp_path / f"{name}.npz")
        for key in ref_params.files:
            np.testing.assert_allclose(params[key], ref_params[key], atol=1e-4, rtol=1e-5,
                                       err_msg=f"{name} {key}")
            close = np.isclose(params[key], ref_params[key], atol=1e-5, rtol=1e-5)
            assert close.mean() > 0.999, (name, key, close.mean())


# A layer of `experts` experts routing in `groups` groups, applied with no mesh and under a
# {data: 1, expert: 4} mesh (the batch over data x expert: 4 shards); its outputs and
# statistics must agree.
FOREIGN = r"""
import json, sys
import flax.linen as nn
import jax, numpy as np
from hpnlp.config import MeshConfig, ModelConfig, MoEConfig
from hpnlp.moe.layer import MoE
from hpnlp.parallel.mesh import make_mesh
from hpnlp.train.carry import AUX

out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
x = jax.random.normal(jax.random.key(0), (8, 4, 8))
seg = np.ones((8, 4), np.int32)
mc = MeshConfig(data=1, expert=4)
for name, (experts, groups) in cases.items():
    mod = MoE(ModelConfig(width=8, mlp_dim=16, dropout=0.0, moe=MoEConfig(
        num_experts=experts, groups=groups, capacity_factor=1.0, eval_capacity_factor=1.0)))
    # its parameters alone: init's own `aux` report, applied with, would be read as this
    # call's (a review, session 116: the statistics compared init's with itself)
    params = {"params": jax.jit(mod.init)(jax.random.key(1), x, seg)["params"]}
    f = jax.jit(lambda p, x, seg: mod.apply(p, x, seg, mutable=[AUX]))
    one = f(params, x, seg)
    with jax.set_mesh(make_mesh(mc)), nn.logical_axis_rules(mc.rule_tuples()):
        four = f(params, x, seg)
    np.testing.assert_allclose(four[0], one[0], atol=1e-5, err_msg=name)
    assert len(one[1][AUX]["moe"]) == len(four[1][AUX]["moe"]) == 1, name
    for k, v in one[1][AUX]["moe"][0].items():
        np.testing.assert_allclose(four[1][AUX]["moe"][0][k], v, rtol=1e-5, err_msg=name)
    assert float(one[1][AUX]["moe"][0]["moe_dropped"]) > 0, name  # capacity binds
print("FOREIGN OK")
"""


@pytest.mark.slow  # a subprocess on 4 simulated devices, as the test above
def test_a_model_whose_experts_or_groups_the_mesh_does_not_split_runs_without_shard_map(
        tmp_path):
    """A review (session 107): this run's mesh is checked against this run's experts and
    groups only, but `train.init_from`'s source (cutting 6 experts to 4 on mesh.expert=4)
    and a distillation teacher (6 experts, or explicit groups=2, under a student's
    mesh.expert=4) are traced under it too, and the layer's shard_map refused them in a JAX
    error naming no field. Such a layer runs as GSPMD lays it out, as on one device."""
    _run(tmp_path, {"experts": [6, 4], "groups": [8, 2]}, 4, code=FOREIGN, done="FOREIGN OK")


POOL = r"""
import dataclasses, json, sys, tempfile
from hpnlp.config import default_configdict, from_configdict
from hpnlp.retrieval import encoder
from hpnlp.train import Trainer
from hpnlp.train.checkpoint import load_run_config
from hpnlp.train.loop import ReaderMesh

out_dir, workdir = sys.argv[1], tempfile.mkdtemp()
cd = default_configdict()
cd.data.update(task="verse_pairs", seq_len=16, batching="pad")
cd.model.update(kind="bi_encoder", width=16, depth=2, num_heads=2, mlp_dim=32, max_len=16)
cd.model.moe.update(num_experts=4, every=2, eval_capacity_factor=0.5)  # groups=0, drops
cd.train.update(steps=1, warmup_steps=0, batch_size=8, eval_batches=1, progress=False)
cd.mesh.update(data=2)
tr = Trainer(from_configdict(cd), workdir)
state, _ = tr.initial_state()
with tr._context():  # as the run loop's evals: in its mesh, two groups
    run = tr.evaluate(state)
# saved with the groups its steps route in, the loop item's entry as `Trainer.run` saves it
# (test_moe.py checks that it does): cheaper here than a train step's compile
tr.checkpointer.save(0, state, tr.train_iter.get_state(), {"routing_groups": tr.routing_groups()})
tr.checkpointer.close()
# outside any mesh: python -m hpnlp.retrieval encoder (and TextSearch), and a tool's
# Trainer.evaluate on one device (as `for_these_devices` lays the run out there)
tool = encoder.evaluate(workdir)
cfg = load_run_config(workdir)
reader = Trainer(dataclasses.replace(cfg, mesh=ReaderMesh(data=1)), workdir, read_only=True)
assert reader.routing_groups() == 1
one = reader.evaluate(reader.initial_state()[0])
json.dump({"run": run, "tool": tool, "one_device": one}, open(f"{out_dir}/pool.json", "w"))
print("POOL OK")
"""


@pytest.mark.slow  # a Trainer and two pool evaluations in a subprocess on 2 simulated devices
def test_a_pool_evaluation_routes_in_the_runs_groups_wherever_it_is_traced(tmp_path):
    """A review (session 107): with model.moe.groups=0 the bi-encoder's pool evaluation
    routed in the groups of the mesh it was traced under: one per data-parallel shard in the
    run loop, one at the run's end, in a tool's `Trainer.evaluate` and with several
    processes, so capacity dropped other choices and recall and MRR differed between them.
    The pool is now routed in the run's groups (`Trainer.split_model`) wherever. Then
    (session 107's review) `python -m hpnlp.retrieval encoder` used the unpinned model (one
    group outside a mesh), and a reader on one device pinned its own one group, not the two
    the run saved: both now measure what the run's own eval did."""
    _run(tmp_path, {}, 2, code=POOL, done="POOL OK")
    got = json.load(open(tmp_path / "pool.json"))
    for k in ("recall@1", "recall@10", "mrr"):
        for where in ("tool", "one_device"):
            assert got[where][k] == got["run"][k], (where, k, got[where][k], got["run"][k])
