"""Parallel modes on 8 simulated CPU devices equal the 1-device run.

For data, FSDP, tensor and sequence parallelism, the combinations data x tensor,
fsdp x tensor, multi-query attention under tensor parallelism (its key/value head
replicated) and multi-head latent attention under fsdp x tensor: five training steps (dropout on) give the same losses
and parameters as one device, to 1e-5 in float32, and the compiled step's parameter and
optimizer-state shardings are the ones `cfg.mesh.rules` says. (Pipeline parallelism:
tests/test_pipeline.py.)
"""

import json
import os
import subprocess
import sys

import pytest

import hpnlp  # noqa: F401  (before any JAX computation: its XLA flags)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MLA = {"kv_latent_dim": 32, "pos_emb": "rope"}
MODES = {  # name: (mesh axis sizes, attention[, model fields])
    "data": ({"data": 8}, "dense"),
    "fsdp": ({"data": 1, "fsdp": 8}, "dense"),
    "tensor": ({"data": 1, "tensor": 8}, "dense"),
    "sequence": ({"data": 1, "sequence": 8}, "ring"),
    "data_x_tensor": ({"data": 4, "tensor": 2}, "dense"),
    "fsdp_x_tensor": ({"data": 1, "fsdp": 4, "tensor": 2}, "dense"),
    # multi-query attention under tensor parallelism: its one key/value head replicated
    "tensor_mqa": ({"data": 1, "tensor": 8, "rules": {"kv_heads": None}}, "dense",
                   {"num_kv_heads": 1}),
    # multi-head latent attention (its latent dims replicated, its heads split), with RoPE
    "fsdp_x_tensor_mla": ({"data": 1, "fsdp": 4, "tensor": 2}, "dense", MLA),
}

CODE = r"""
import json, sys, tempfile
import flax.linen as nn
import jax, numpy as np
from hpnlp.config import default_configdict, from_configdict
from hpnlp.train import Trainer
from hpnlp.train.loop import _global

out_dir, modes = sys.argv[1], json.loads(sys.argv[2])

def config(mesh, attention, model=None):
    cd = default_configdict()
    cd.data.update(task="byte_lm", seq_len=32, batching="pack")
    cd.model.update(kind="lm", width=64, depth=1, num_heads=8, mlp_dim=128, max_len=32, dropout=0.1)
    cd.model.update(**(model or {}))
    cd.attention.name = attention
    cd.train.update(steps=5, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, progress=False)
    cd.mesh.update(**mesh)
    return from_configdict(cd)

for name, (mesh, attention, *model) in modes.items():
    tr = Trainer(config(mesh, attention, *model), tempfile.mkdtemp())
    state, _ = tr.initial_state()
    losses = []
    with tr._context():
        for _ in range(5):
            state, m = tr.train_step(state, _global(next(tr.train_iter), tr.batch_sharding))
            losses.append(float(m["loss"]) / float(m["weight"]))
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    np.savez(f"{out_dir}/{name}.npz", **flat)
    # Shardings: the state the compiled step returned vs the rules' logical -> mesh mapping.
    want = tr.state_sharding
    mismatched = [jax.tree_util.keystr(p) for (p, w), x in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(state))
        if not w.is_equivalent_to(x.sharding, x.ndim)]
    name_qkv = "qkv" if "qkv" in state.params["trunk"]["block_0"]["attention"] else "q"
    qkv = state.params["trunk"]["block_0"]["attention"][name_qkv]
    mu = state.opt_state[1][0].mu["trunk"]["block_0"]["attention"][name_qkv]
    emb = state.params["embed"]["embedding"]
    json.dump({"losses": losses, "mismatched": mismatched,
               "qkv": [str(a) for a in qkv.sharding.spec], "mu": [str(a) for a in mu.sharding.spec],
               "embed": [str(a) for a in emb.sharding.spec]},
              open(f"{out_dir}/{name}.json", "w"))
print("PARALLEL OK")
"""


def _run(out_dir, modes, devices, code=CODE, done="PARALLEL OK"):
    """`code` in a fresh process on `devices` simulated CPU devices; it must print `done`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    proc = subprocess.run([sys.executable, "-c", code, str(out_dir), json.dumps(modes)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and done in proc.stdout, proc.stderr[-4000:]


@pytest.mark.slow
def test_every_mode_matches_one_device_and_follows_the_rules(tmp_path):
    import numpy as np

    ref_dir, par_dir = tmp_path / "ref", tmp_path / "par"
    ref_dir.mkdir(), par_dir.mkdir()
    _run(ref_dir, {"dense": ({"data": 1}, "dense"), "ring": ({"data": 1}, "ring"),
                   "dense_mqa": ({"data": 1}, "dense", {"num_kv_heads": 1}),
                   "dense_mla": ({"data": 1}, "dense", MLA)}, devices=1)
    _run(par_dir, MODES, devices=8)
    for name, (mesh, attention, *model) in MODES.items():
        # the reference run of the same model
        attention += ("_mla" if "kv_latent_dim" in model[0] else "_mqa") if model else ""
        ref = json.load(open(ref_dir / f"{attention}.json"))
        got = json.load(open(par_dir / f"{name}.json"))
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        assert got["losses"][-1] < got["losses"][0], name  # it trained
        ref_p, got_p = np.load(ref_dir / f"{attention}.npz"), np.load(par_dir / f"{name}.npz")
        assert sorted(ref_p.files) == sorted(got_p.files)
        for k in ref_p.files:
            np.testing.assert_allclose(got_p[k], ref_p[k], atol=1e-5, rtol=1e-5, err_msg=f"{name} {k}")
        assert got["mismatched"] == [], (name, got["mismatched"])
        assert got["mu"] == got["qkv"], name  # Adam moments sharded like their parameter
        # qkv kernel [embed, 3, heads, kv]: embed over fsdp, heads over tensor (multi-query's
        # q [embed, heads, kv])
        want_qkv = ["fsdp" if mesh.get("fsdp", 1) > 1 else "None", *(() if model else ("None",)),
                    "tensor" if mesh.get("tensor", 1) > 1 else "None", "None"]
        assert _effective(got["qkv"], mesh) == want_qkv + ["None"] * bool(model), (name, got["qkv"])


def _effective(spec, mesh):
    """A spec as the devices see it: size-1 axes shard nothing; trailing Nones may be dropped."""
    spec = [a if mesh.get(a, 1) > 1 else "None" for a in spec]
    return spec + ["None"] * (4 - len(spec))


def test_make_mesh_of_more_devices_than_there_are_names_the_mesh():
    """It was numpy's "cannot reshape array of size 1 into shape (8,1,1,1,1,1)"."""
    import jax

    from hpnlp.config import MeshConfig
    from hpnlp.parallel import make_mesh
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match=r"mesh \{'data': 8\} needs 8 devices and there are 1 "):
        make_mesh(MeshConfig(data=8), one)
    with pytest.raises(ValueError, match=r"needs a multiple of 4 devices and there are 1 "):
        make_mesh(MeshConfig(data=-1, tensor=4), one)
    assert make_mesh(MeshConfig(data=-1), one).shape["data"] == 1


def test_state_shardings_replicate_dims_their_axes_do_not_divide():
    """A dim the rule's mesh axes do not divide is replicated, the rest as the rules say: an
    adaptive softmax's head (its cutoff plus clusters, 61 here, cut at token frequencies when
    the model is built, which validate cannot check) failed in device_put under
    mesh.tensor=2 (found by the crash hunt). An abstract mesh: no devices needed."""
    import flax.linen as nn
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from hpnlp.config import MeshConfig
    from hpnlp.parallel import state_shardings
    from hpnlp.parallel.mesh import AXES

    sizes = dict(data=1, fsdp=1, tensor=2, sequence=1, pipeline=1, expert=1)
    mesh = AbstractMesh(tuple(sizes[a] for a in AXES), AXES,
                        axis_types=(AxisType.Auto,) * len(AXES))

    class M(nn.Module):
        @nn.compact
        def __call__(self):
            zeros = nn.initializers.zeros
            return [self.param(n, nn.with_logical_partitioning(zeros, ("embed", "vocab")), s)
                    for n, s in (("head", (16, 61)), ("full", (16, 64)))]

    abstract = jax.eval_shape(lambda: M().init(jax.random.key(0)))
    got = state_shardings(abstract, mesh, MeshConfig().rule_tuples())["params"]
    assert tuple(got["full"].spec) == ("fsdp", "tensor")
    assert tuple(got["head"].spec) == ("fsdp", None)
