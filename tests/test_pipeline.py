"""Stacked layers (model.stack_layers, nn.scan) and GPipe pipeline parallelism (mesh.pipeline).

The stacked trunk is checked against the per-block trunk with the same weights; the
pipelined training run against the 1-device run of the same stacked model (dropout off,
float32); with dropout on, `gpipe` against its slow twin `gpipe_reference`.
"""

import functools
import json
import os
import re
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp import models
from hpnlp.config import ConfigError, default_configdict, from_configdict, validate
from hpnlp.train import Trainer
from hpnlp.train.loop import _global

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5


def tiny(**model):
    cd = default_configdict()
    cd.name = "pipeline"
    cd.data.update(task="byte_lm", seq_len=16, batching="pack")
    cd.model.update(kind="lm", width=16, depth=4, num_heads=2, mlp_dim=32, max_len=16, dropout=0.0,
                    stack_layers=True)
    cd.model.update(**model)
    cd.train.update(steps=STEPS, batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, eval_batches=1,
                    progress=False)
    return cd


def stack_blocks(params, depth):
    """Per-block trunk params (block_0 ... block_{depth-1}) -> one stacked `blocks` tree."""
    trunk = {k: v for k, v in params["trunk"].items() if not k.startswith("block_")}
    trunk["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                   *[params["trunk"][f"block_{i}"] for i in range(depth)])
    return dict(params, trunk=trunk)


def random_params(model, *args, method=None, seed=0):
    """Random weights of `model`'s shapes (no jitted init: XLA compiles RNG slowly on CPU)."""
    shapes = nn.unbox(jax.eval_shape(functools.partial(model.init, method=method),
                                     jax.random.key(0), *args)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), shapes)


def lm_batch(B=4, L=16):
    rng = np.random.default_rng(0)
    seg = np.repeat([[1] * 10 + [2] * 4 + [0] * 2], B, 0)
    return {"inputs": jnp.asarray(rng.integers(0, 256, (B, L)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, 256, (B, L)), jnp.int32),
            "segment_ids": jnp.asarray(seg, jnp.int32),
            "positions": jnp.asarray(np.concatenate([np.arange(10), np.arange(6)])[None].repeat(B, 0),
                                     jnp.int32)}


@pytest.mark.slow  # over 8 s on the 2-core CPU: CI's slow part runs it
def test_stacked_trunk_matches_per_block_trunk():
    """nn.scan over one stacked tree (with and without remat inside the scan) == `depth`
    separate blocks: log-probs and their vector-Jacobian product (all parameters' grads)."""
    depth = 3
    batch = lm_batch()
    build = lambda **model: models.build(  # noqa: E731
        validate(from_configdict(tiny(depth=depth, **model)), num_devices=1), deterministic=True)
    m_plain, m_stacked, m_remat = build(stack_layers=False), build(), build(remat="full")
    params = random_params(m_plain, batch)
    converted = stack_blocks(params, depth)
    boxed = jax.eval_shape(m_stacked.init, jax.random.key(0), batch)["params"]
    assert jax.tree.structure(nn.unbox(boxed)) == jax.tree.structure(converted)
    assert boxed["trunk"]["blocks"]["mlp_in"]["kernel"].names == ("layers", "embed", "mlp")
    ct_BLV = jnp.asarray(np.random.default_rng(1).normal(size=(4, 16, 256)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def out_and_grads(model, p):
        logp_BLV, vjp = jax.vjp(lambda p: model.apply({"params": p}, batch, method="log_probs"), p)
        return logp_BLV, vjp(ct_BLV)[0]

    want_logp, want_grads = out_and_grads(m_plain, params)
    want_grads = stack_blocks(want_grads, depth)
    for model in (m_stacked, m_remat):
        logp, grads = out_and_grads(model, converted)
        np.testing.assert_allclose(logp, want_logp, atol=1e-5, rtol=1e-5)
        chex.assert_trees_all_close(grads, want_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_stacked_trunk_decodes_like_per_block_trunk(pos_emb):
    """Decode mode scans the stacked blocks over a stacked cache: same log-probs per token
    (rope: the scan hands every layer the positions beside the segment ids)."""
    depth, B = 2, 2
    tok_B1 = jnp.zeros((B, 1), jnp.int32)
    steps = []
    for stack in (False, True):
        cfg = validate(from_configdict(tiny(depth=depth, stack_layers=stack, pos_emb=pos_emb)),
                       num_devices=1)
        model = models.build(cfg, deterministic=True, decode=True)
        shapes = jax.eval_shape(functools.partial(model.init, method="decode_step"),
                                jax.random.key(0), tok_B1)
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])  # as init_cache
        step = jax.jit(lambda p, c, t, model=model: model.apply(
            {"params": p, "cache": c}, t, method="decode_step", mutable=["cache"]))
        steps.append((step, cache))
    params = random_params(models.build(validate(from_configdict(
        tiny(depth=depth, stack_layers=False, pos_emb=pos_emb)), num_devices=1), deterministic=True),
        lm_batch())
    (step_p, cache_p), (step_s, cache_s) = steps
    assert cache_s["trunk"]["blocks"]["attention"]["state"]["k"].shape[0] == depth
    for tok in ([3, 7], [200, 1], [5, 5], [9, 0]):
        t_B1 = jnp.asarray(tok, jnp.int32)[:, None]
        logp_p, upd_p = step_p(params, cache_p, t_B1)
        logp_s, upd_s = step_s(stack_blocks(params, depth), cache_s, t_B1)
        np.testing.assert_allclose(logp_s, logp_p, atol=1e-5, rtol=1e-5)
        cache_p, cache_s = upd_p["cache"], upd_s["cache"]


# 8 simulated devices: pipeline x data meshes train the stacked model; report losses,
# params, shardings, and whether the lowered step holds the stage-to-stage ppermute.
_PIPELINED = r"""
import json, sys, tempfile
import jax, numpy as np
from hpnlp.config import from_configdict
from hpnlp.train import Trainer
from hpnlp.train.loop import _global

out_dir, base, meshes = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

def scan_lengths(jaxpr, inside=False):
    # Lengths of the scans inside shard_map bodies: the tick loop and the layer loop.
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and inside:
            found.add(eqn.params["length"])
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found |= scan_lengths(sub, inside or eqn.primitive.name == "shard_map")
    return found

for name, mesh in meshes.items():
    cd = dict(base, mesh=dict(base["mesh"], **mesh))
    tr = Trainer(from_configdict(cd), tempfile.mkdtemp())
    state, _ = tr.initial_state()
    losses = []
    with tr._context():
        for _ in range(int(cd["train"]["steps"])):
            batch = _global(next(tr.train_iter), tr.batch_sharding)
            state, m = tr.train_step(state, batch)
            losses.append(float(m["loss"]) / float(m["weight"]))
        traced = tr.train_step.trace(tr.abstract_state, batch)
        hlo = traced.lower().as_text()
    eval_sums = tr.eval_sums(state)
    kernel = state.params["trunk"]["blocks"]["mlp_in"]["kernel"]
    mu = state.opt_state[1][0].mu["trunk"]["blocks"]["mlp_in"]["kernel"]
    np.savez(f"{out_dir}/{name}.npz", **{jax.tree_util.keystr(p): np.asarray(x)
                                        for p, x in jax.tree_util.tree_leaves_with_path(state.params)})
    json.dump({"losses": losses, "eval_loss": float(eval_sums["loss"]), "kernel": [str(a) for a in kernel.sharding.spec],
               "mu": [str(a) for a in mu.sharding.spec], "ppermute": "collective_permute" in hlo,
               "scans": sorted(scan_lengths(traced.jaxpr.jaxpr))},
              open(f"{out_dir}/{name}.json", "w"))

# Dropout on: gpipe == its slow twin (each microbatch through all layers), masks included.
import functools, jax.numpy as jnp
from hpnlp.models.transformer import Block
from hpnlp.parallel.pipeline import apply_layers, gpipe, gpipe_reference
m = from_configdict(dict(cd, model=dict(cd["model"], dropout=0.3, vocab_size=256,
                                        pos_emb="learned"))).model  # blocks fed no positions
stage = functools.partial(apply_layers, Block(m, tr.cfg.attention, True, deterministic=False))
micro = tr.cfg.mesh.pipeline_microbatches
x = jax.random.normal(jax.random.key(1), batch["segment_ids"].shape + (m.width,))
ct = 0.01 * jax.random.normal(jax.random.key(2), x.shape)  # gradients O(1), as the 1e-5 assumes
def out_and_grads(fn):
    def run(p, x, key):
        y, vjp = jax.vjp(lambda p, x: fn(stage, p, x, batch["segment_ids"], {"dropout": key},
                                         microbatches=micro), p, x)
        return y, vjp(ct)
    return jax.jit(run)
with tr._context():
    blocks = state.params["trunk"]["blocks"]
    fast, slow = out_and_grads(gpipe), out_and_grads(gpipe_reference)
    (y, g), (y_ref, g_ref) = fast(blocks, x, jax.random.key(3)), slow(blocks, x, jax.random.key(3))
    y_other, _ = fast(blocks, x, jax.random.key(4))
np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), g, g_ref)
assert not np.allclose(y, y_other), "another dropout key must give other masks"
print("PIPELINE OK")
"""

# M = 8 != P (the count reaches the trunk from the config); 2 rows per microbatch, 1 per
# data shard. (Each further mesh costs ~20 s of CPU, mostly compiling init and the step.)
MESHES = {"pipe4_data2_m8": {"pipeline": 4, "data": 2, "pipeline_microbatches": 8}}


@pytest.mark.slow
def test_pipeline_training_matches_one_device(tmp_path):
    """GPipe over 8 simulated devices (P=4 stages x 2 data shards, M=8) == the 1-device
    stacked run: losses and parameters after 5 AdamW steps; stacked params and Adam moments
    split over `pipeline` on the layer axis; and the step really runs M + P - 1 ticks of
    depth / P layers, passing activations between stages. With rope positions, which ride
    through the stages beside the segment ids. With `chunked` attention (found in review: its
    cond failed shard_map's type check inside a stage)."""
    cd = tiny()
    cd.model.pos_emb = "rope"
    cd.attention.name = "chunked"
    cd.train.batch_size = 16
    out = str(tmp_path)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _PIPELINED, out, json.dumps(cd.to_dict()),
                             json.dumps(MESHES)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # The reference, meanwhile, in this process: no pipeline axis, so one nn.scan.
        ref = Trainer(from_configdict(cd), str(tmp_path / "ref"))
        state, _ = ref.initial_state()
        losses = []
        with ref._context():
            for _ in range(STEPS):
                state, m = ref.train_step(state, _global(next(ref.train_iter), ref.batch_sharding))
                losses.append(float(m["loss"]) / float(m["weight"]))
        want = {jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
        eval_loss = float(ref.eval_sums(state)["loss"])
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "PIPELINE OK" in stdout, stderr[-3000:]
    for name in MESHES:
        info = json.load(open(os.path.join(out, f"{name}.json")))
        np.testing.assert_allclose(info["losses"], losses, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(info["eval_loss"], eval_loss, rtol=1e-5, err_msg=name)
        got = np.load(os.path.join(out, f"{name}.npz"))
        assert set(got.files) == set(want)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, atol=1e-5, rtol=1e-5, err_msg=f"{name} {key}")
        assert info["kernel"][0] == "pipeline" and info["mu"] == info["kernel"], info
        assert info["ppermute"], f"{name}: no collective_permute in the step, so no pipeline ran"
        P = MESHES[name]["pipeline"]
        M = MESHES[name]["pipeline_microbatches"] or P
        # ticks and layers per stage (beside chunked attention's own loops over blocks)
        assert {M + P - 1, 4 // P} <= set(info["scans"]), info


def _check(cd, field, match, num_devices=8):
    with pytest.raises(ConfigError, match=match) as e:
        validate(from_configdict(cd), num_devices=num_devices)
    assert f"`{field}`" in str(e.value)


def test_pipeline_config_errors():
    ok = tiny()
    ok.mesh.update(pipeline=4, data=2)
    assert validate(from_configdict(ok), num_devices=8).mesh.pipeline == 4
    cd = tiny(stack_layers=False)
    cd.mesh.update(pipeline=4, data=2)
    _check(cd, "mesh.pipeline", r"model.stack_layers=True")
    cd = tiny()
    cd.mesh.update(pipeline=4, data=2, pipeline_microbatches=3)
    _check(cd, "mesh.pipeline_microbatches", r"train.batch_size / train.grad_accum = 8")
    cd = tiny()
    cd.mesh.update(pipeline=2, data=4, pipeline_microbatches=4)
    cd.train.grad_accum = 2  # 4 rows per step
    validate(from_configdict(cd), num_devices=8)
    cd.mesh.pipeline_microbatches = 8
    _check(cd, "mesh.pipeline_microbatches", r"= 4; choose a divisor of 4")
    cd = tiny()  # a bug hunt (session 90): taken and ignored
    cd.mesh.update(pipeline=1, pipeline_microbatches=2)
    _check(cd, "mesh.pipeline_microbatches", r"mesh.pipeline is 1", num_devices=1)
    cd = tiny(depth=3)  # depth % pipeline, named as such (a bug hunt, session 101: the
    # `layers` rule's check offered "map the rule to None", refused in turn)
    cd.mesh.update(pipeline=4, data=2)
    _check(cd, "model.depth", r"its 3 layers do not split into mesh.pipeline=4 stages; choose "
           r"a depth that 4 divides or a mesh.pipeline that divides 3$")
    cd = tiny()
    cd.mesh.update(pipeline=2, data=4, rules={"layers": None})
    _check(cd, "mesh.rules.layers", r"must be 'pipeline'")
    for rule, axes in (("activation_embed", "pipeline"), ("mlp", "pipeline")):
        cd = tiny()  # a bug hunt (session 90): JAX's error at the first step's trace
        cd.mesh.update(pipeline=2, data=4, rules={rule: axes})
        _check(cd, f"mesh.rules.{rule}", r"only mesh.rules.layers may name 'pipeline'")
    cd = tiny()
    cd.attention.name = "ring"
    cd.mesh.update(pipeline=2, sequence=2, data=2)
    _check(cd, "mesh.pipeline", r"set mesh.sequence=1 or mesh.pipeline=1")
    cd = tiny()  # a review (session 116): the bubble ticks' k-means gradients were added;
    cd.attention.name = "clustered"  # training is refused, a reader of a saved run reads it
    cd.mesh.update(pipeline=2, data=4)
    cfg = validate(from_configdict(cd), num_devices=8)
    from hpnlp.config.checks import check_training
    with pytest.raises(ConfigError, match=r"`mesh.pipeline` = 2 .*cannot yet train clustered "
                       r"attention"):
        check_training(cfg)
    cd = tiny(arch="lstm")
    _check(cd, "model.stack_layers", r"model.arch='lstm'", num_devices=1)
    cd = tiny(arch="lstm", stack_layers=False)
    cd.mesh.update(pipeline=2, data=4)
    _check(cd, "mesh.pipeline", r"model.arch='lstm'")
    cd = tiny(reversible=True)
    _check(cd, "model.stack_layers", r"model.reversible=False", num_devices=1)


def test_gpipe_tells_a_pass_of_its_own_rows_to_pad_them():
    """A review (r2): `gpipe`'s batch-split error told the user to change train.batch_size,
    which validate has already checked: only a pass of its own rows (a model.apply, a pool,
    mining) reaches it. It names the pad, whole_microbatches. The check precedes any trace,
    so an abstract mesh of 2 stages and no stage function suffice."""
    from jax.sharding import AbstractMesh

    from hpnlp.parallel.pipeline import gpipe
    mesh = AbstractMesh((2,), ("pipeline",))
    for B, micro, M in ((4, 3, 3), (3, 0, 2)):  # 0: one microbatch per stage
        with pytest.raises(ValueError, match=re.escape(
                f"pipeline: a pass's batch of {B} rows does not split into {M} microbatches "
                f"(mesh.pipeline_microbatches, 0: mesh.pipeline); pad its rows to a multiple of "
                f"{M} (hpnlp.parallel.pipeline.whole_microbatches)")):
            gpipe(None, {"w": jnp.zeros((2, 1))}, jnp.zeros((B, 1, 1)),
                  jnp.zeros((B, 1), jnp.int32), microbatches=micro, mesh=mesh)
    # a count that is no whole number >= 0 (a review, session 114: -2 passed `8 % -2` and
    # failed in a reshape naming nothing; 2.0 as a float shape), here and in the context
    from hpnlp.parallel.pipeline import use_microbatches
    for micro in (-2, 2.0):
        match = re.escape(f"pipeline: microbatches={micro!r}; give a whole number >= 0")
        with pytest.raises(ValueError, match=match):
            gpipe(None, {"w": jnp.zeros((2, 1))}, jnp.zeros((8, 1, 1)),
                  jnp.zeros((8, 1), jnp.int32), microbatches=micro, mesh=mesh)
        with pytest.raises(ValueError, match=match):
            with use_microbatches(micro):
                pass


def test_a_pipelined_run_of_random_features_is_refused_for_decoding(monkeypatch):
    """Found in review: the stages (`apply_layers`) fold each layer's index into the
    features key, the unpipelined `nn.scan` that decodes splits it, so a Performer layer
    draws another projection there. Checked on one device with `gpipe`'s slow twin (its
    keys; test_pipeline_training_matches_one_device: the same function where nothing is
    drawn); `generate` refuses decoding such a run in one line."""
    from hpnlp.models.generate import check_decodes
    from hpnlp.parallel import pipeline
    batch = lm_batch()
    batch["segment_ids"] = jnp.ones_like(batch["segment_ids"])  # performer: padding only
    batch["positions"] = jnp.broadcast_to(jnp.arange(16), (4, 16))
    key = jax.random.key(7)
    cd = tiny(depth=2)
    cd.data.batching = "pad"
    cd.attention.update(name="performer", options={"num_features": 16})
    model = models.build(validate(from_configdict(cd), num_devices=1), deterministic=True)
    params = random_params(model, batch)
    # a fresh jit each: the stages are read when it traces
    f = lambda: jax.jit(lambda p: model.apply(  # noqa: E731
        {"params": p}, batch, method="log_probs", rngs={"features": key}))(params)
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "pipeline_stages", lambda axis="pipeline": 2)
        patch.setattr(pipeline, "gpipe", lambda stage, params, x, seg, rngs, microbatches:
                      pipeline.gpipe_reference(stage, params, x, seg, rngs, microbatches=2))
        piped = f()
    assert float(jnp.max(jnp.abs(piped - f()))) > 1e-2

    cd.mesh.update(pipeline=2, data=1)
    cfg = validate(from_configdict(cd), num_devices=2)
    with pytest.raises(ValueError, match=r"^decoding a mesh.pipeline=2 run .* decode a run "
                       r"trained with mesh.pipeline=1 or attention.options.redraw=False$"):
        check_decodes(cfg)
    cd.attention.options = {"num_features": 16, "redraw": False}  # the seed's: one draw
    check_decodes(validate(from_configdict(cd), num_devices=2))
    cd.attention.name, cd.attention.options = "lsh", {}  # decodes by full attention: no draw
    check_decodes(validate(from_configdict(cd), num_devices=2))


def test_generate_takes_a_minus_one_pipeline_run_that_trained_in_one_stage(tmp_path, capsys):
    """A review (session 118): `generate` refused every mesh.pipeline=-1 Performer run as
    pipelined, though one trained on one device filled a single stage and decodes the draws
    it trained with; the stages its checkpoint records decide (a config-only workdir: the
    load fails after the check, at its empty checkpoint)."""
    import importlib

    from hpnlp.compress import distill
    from hpnlp.train.checkpoint import Checkpointer
    generate = importlib.import_module("hpnlp.models.generate")
    cd = tiny(depth=2)
    cd.data.batching = "pad"
    cd.attention.update(name="performer", options={"num_features": 16})
    cd.mesh.update(data=1, pipeline=-1)
    Checkpointer(str(tmp_path), validate(from_configdict(cd), num_devices=1), keep=1).close()
    os.makedirs(tmp_path / "checkpoints" / "1")
    for stages, refused in ((2, True), (None, True), (1, False)):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(distill, "checkpoint_pipeline_stages", lambda workdir: stages)
            assert generate.main(["--workdir", str(tmp_path), "--prompt", "a"]) != 0
        err = capsys.readouterr().err
        assert ("would draw other random features per layer" in err) == refused, err


def test_a_pipelined_run_of_random_features_read_on_one_device_says_so(capsys):
    """A review of session 108: laid out for the devices here (`reader_mesh`: pipeline 1), a
    pipelined Performer run's config no longer says it was pipelined, so `generate`'s
    refusal could not see it: the reader's line says what its decodes and evaluations
    compute."""
    from hpnlp.train.loop import reader_mesh
    cd = tiny(depth=2)
    cd.data.batching = "pad"
    cd.attention.update(name="performer", options={"num_features": 16})
    cd.mesh.update(pipeline=2, data=1)
    cfg = validate(from_configdict(cd), num_devices=2)
    mesh, k, why = reader_mesh(cfg, 1)
    assert mesh.pipeline == 1 and k == 1
    assert "draws random features per layer otherwise in one stage" in why
    assert "decodes here compute another function" in why
    cd.mesh.update(data=2, pipeline=-1)  # filled the devices it trained on (here 4: 2 stages),
    _, _, why = reader_mesh(validate(from_configdict(cd), num_devices=4), 1)  # unsaid in it
    assert "decodes here may compute another function" in why
    cd.attention.name, cd.attention.options = "dense", {}  # nothing drawn, nothing said
    _, _, why = reader_mesh(validate(from_configdict(cd), num_devices=2), 1)
    assert "random features" not in why
    # a -1 pipeline that fits here in another count than its checkpoint trained in (a
    # review, session 118: kept unsaid): said by the stages the checkpoint records
    from hpnlp.compress import distill
    from hpnlp.train.loop import for_these_devices
    cd.attention.update(name="performer", options={"num_features": 16})
    cd.mesh.update(data=1, pipeline=-1)
    cfg = validate(from_configdict(cd), num_devices=1)
    for trained, said in ((2, True), (1, False), (None, False)):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(distill, "checkpoint_pipeline_stages", lambda workdir: trained)
            assert for_these_devices(cfg, "RUN").mesh == cfg.mesh
        err = capsys.readouterr().err
        assert ("RUN trained in 2 pipeline stage(s) (mesh.pipeline=-1) and is laid out in 1 "
                "on the 1 device(s) here" in err) == said, err
    # a -1 mesh that fits, its run refused here only for what a reader replaces anyway
    # (cuDNN attention off a GPU): kept, not read as a mesh that does not fit (a review,
    # session 118)
    cd.model.dtype = "bfloat16"
    cd.attention.name, cd.attention.options = "xla", {"implementation": "cudnn"}
    mesh, _, why = reader_mesh(validate(from_configdict(cd), devices=False), 1)
    assert why is None and mesh.pipeline == -1


# 8 simulated devices: a student pipelined over 4 stages (2 data shards) built with a teacher
# of stacked layers (train.distill.teacher=argv[1]); argv[2]: the student's workdir.
_TEACHER = r"""
import json, os, sys
from hpnlp.config import ConfigError, from_configdict
from hpnlp.train import Trainer

teacher, work, cd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cd["train"]["distill"] = dict(cd["train"]["distill"], teacher=teacher)
try:
    Trainer(from_configdict(dict(cd, mesh=dict(cd["mesh"], pipeline=4, data=2))), work)
    print("BUILT")
except ConfigError as e:
    print("REFUSED", json.dumps([str(e), os.path.exists(os.path.join(work, "config.json"))]))
# stages that split both depths: it builds (the teacher is pipelined like the student)
tr = Trainer(from_configdict(dict(cd, mesh=dict(cd["mesh"], pipeline=2, data=4))), work + "2")
assert tr.carries[0].teacher_cfg.model.depth == 6
print("OK")
"""


# 4.7 s on the 2-core Xeon model 167 (2026-12-06): over the ~8 s a test may take on the Zen 3;
# the only check of a teacher's depth against the pipeline stages: CI's slow part runs it
@pytest.mark.slow
def test_a_stacked_teacher_whose_depth_the_pipeline_does_not_split_is_refused_at_build(
        tmp_path):
    """Review r4: a distillation teacher's stacked blocks run in the student's step, so under
    its mesh.pipeline stages; a depth they do not split built, config.json was written, and
    the first step's trace failed with a bare ValueError naming the teacher's model.depth as
    this run's. Refused at the build, naming train.distill.teacher, before config.json."""
    teacher = tiny(depth=6)
    teacher.train.update(steps=1, warmup_steps=0)
    Trainer(from_configdict(teacher), str(tmp_path / "teacher")).run()  # on 1 device
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TEACHER, str(tmp_path / "teacher"),
                           str(tmp_path / "student"), json.dumps(tiny().to_dict())], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.endswith("OK\n"), proc.stderr[-3000:]
    assert proc.stdout.startswith("REFUSED "), proc.stdout
    message, written = json.loads(proc.stdout.splitlines()[0][len("REFUSED "):])
    assert "`train.distill.teacher`" in message and "\n" not in message
    assert re.search(r"the teacher's 6 stacked layers \(its model\.depth\) run in this run's "
                     r"mesh\.pipeline=4 stages, which do not split them; distill from a teacher "
                     r"whose model\.depth 4 divides \(or one of model\.stack_layers=False\), or "
                     r"set mesh\.pipeline to one that divides both 4 and 6$", message), message
    assert not written  # refused before config.json


# 8 simulated devices: each teacher of argv[1] (name -> [attention, mesh]) saved at its init,
# then each student of argv[2] (name -> [teacher, mesh, attention]) built or refused (before
# its config.json); argv[3]: the folder, argv[4]: the config both start from.
_TEACHERS = r"""
import json, os, sys
from hpnlp.config import ConfigError, from_configdict
from hpnlp.train import Trainer

teachers, students, work = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
cd = json.loads(sys.argv[4])
for name, (attention, mesh, *model) in teachers.items():
    tr = Trainer(from_configdict(dict(cd, attention=attention, mesh=dict(cd["mesh"], **mesh),
                                      model=dict(cd["model"], **(model[0] if model else {})))),
                 os.path.join(work, name))
    state, _ = tr.initial_state()
    tr.checkpointer.save(0, state, tr.train_iter.get_state(), {})
    tr.checkpointer.close()
said = {}
for name, (teacher, mesh, attention) in students.items():
    distill = dict(cd["train"]["distill"], teacher=os.path.join(work, teacher))
    student = dict(cd, mesh=dict(cd["mesh"], **mesh), attention=attention,
                   train=dict(cd["train"], distill=distill))
    try:
        Trainer(from_configdict(student), os.path.join(work, name))
        said[name] = "BUILT"
    except ConfigError as e:
        said[name] = [str(e), os.path.exists(os.path.join(work, name, "config.json"))]
print(json.dumps(said))
"""


@pytest.mark.slow  # two teachers saved and four students built on 8 simulated devices
def test_a_teacher_that_would_compute_otherwise_in_the_students_layout_is_refused(tmp_path):
    """A review (session 116): a teacher's stacked blocks run in the student's step, under
    its mesh (session 117: an MoE teacher routing by capacity too). A Performer teacher
    (features redrawn) trained in one stage gave a pipelined
    student soft targets of other random features per layer (pipeline stages key them
    otherwise), without a word; a ring teacher whose block does not divide each device's
    share of the student's lengths failed at the first trace, naming attention.options.block,
    the student's own and fine. Both are refused at the build, naming
    train.distill.teacher; a student in a layout the teacher computes alike builds."""
    cd = tiny()
    cd.data.batching = "pad"  # (a Performer cannot separate packed documents)
    dense, ring = {"name": "dense", "options": {}}, {"name": "ring", "options": {}}
    moe = {"moe": dict(cd.model.moe.to_dict(), num_experts=4, router="top_k", top_k=2,
                       groups=8)}
    teachers = {"performer": ({"name": "performer", "options": {}}, {"data": 8}),
                "ring": ({"name": "ring", "options": {"block": 8}}, {"sequence": 2, "data": 4}),
                "moe": (dense, {"data": 8}, moe)}
    students = {"moe_pipelined": ("moe", {"pipeline": 2, "data": 4}, dense),
                "performer_pipelined": ("performer", {"pipeline": 2, "data": 4}, dense),
                "performer_one_stage": ("performer", {"data": 8}, dense),
                "ring_sequence_4": ("ring", {"sequence": 4, "data": 2}, ring),
                "ring_sequence_2": ("ring", {"sequence": 2, "data": 4}, ring)}
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TEACHERS, json.dumps(teachers),
                           json.dumps(students), str(tmp_path), json.dumps(cd.to_dict())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.splitlines()[-1])
    assert said["performer_one_stage"] == said["ring_sequence_2"] == "BUILT", said
    for name, want in (("performer_pipelined", r"the teacher's attention.name='performer' "
                        r"draws random features per layer, which it drew in mesh.pipeline=1 "
                        r"and this run's 2 stages would draw otherwise; set mesh.pipeline=1"),
                       # an MoE teacher by capacity routes each microbatch alone there (a
                       # review, session 117)
                       ("moe_pipelined", r"the teacher's MoE layers route by capacity, which "
                        r"this run's mesh.pipeline=2 stages would bind over each microbatch "
                        r"alone"),
                       ("ring_sequence_4", r"the teacher's ring attention "
                        r"\(attention.options.block=8\) runs over this run's mesh.sequence=4 "
                        r"devices, whose shares of the lengths \[16\] \(4 positions\) it does "
                        r"not divide")):
        message, written = said[name]
        assert "`train.distill.teacher`" in message and re.search(want, message), message
        assert not written, name  # refused before config.json


def test_the_pool_is_evaluated_in_the_runs_pipeline_outside_its_loop():
    """Review r13 (session 109): `Trainer.evaluate` measured a bi-encoder's held-out pool
    outside the run's mesh where it was called outside the loop (a run resumed at
    train.steps, a user's call), so a pipelined Performer or LSH trunk, which draws its
    features per stage, embedded the pool with another function than its steps. The pool
    now runs in the Trainer's context. Stand-ins: nothing compiles."""
    import types

    from jax.sharding import AbstractMesh

    from hpnlp.parallel.pipeline import pipeline_stages
    from hpnlp.train import loop
    seen = []

    class Model:
        @staticmethod
        def split_metrics(cfg, model, params, task, *, features_key=None):
            seen.append(pipeline_stages())
            return {"mrr": 1.0}

    class State:
        params, rng, step = {"w": np.zeros(2, np.float32)}, np.zeros(2, np.uint32), 3

        def replace(self, **kw):
            return self

        def features_key(self, every):
            return None

    tr = object.__new__(loop.Trainer)
    tr.eval_model, tr.lm, tr.task = Model(), False, None
    tr.cfg = types.SimpleNamespace(train=types.SimpleNamespace(feature_redraw_every=0))
    tr.eval_sums = lambda state: {"weight": 1.0, "loss": 0.5}
    tr.split_model = lambda step: None
    tr._context = lambda: jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("pipeline",)))
    out = tr.evaluate(State())
    assert seen == [2] and out["mrr"] == 1.0


# a Trainer's build and two saves: ~3 s on the Xeon model 207; CI's slow part runs it
@pytest.mark.slow
def test_a_teachers_pipeline_stages_are_read_from_its_checkpoint(tmp_path):
    """A review (session 116): a teacher of mesh.pipeline=-1 (every device) says in its
    config how many stages it trained in no more; its checkpoint's loop item does, which
    the check of its random-feature draw against the student's stages reads."""
    from hpnlp.compress.distill import checkpoint_pipeline_stages
    tr = Trainer(from_configdict(tiny()), str(tmp_path / "t"))
    state, _ = tr.initial_state()
    tr.checkpointer.save(0, state, tr.train_iter.get_state(), {})
    tr.checkpointer.wait()
    assert checkpoint_pipeline_stages(str(tmp_path / "t")) is None  # not recorded
    tr.checkpointer.save(1, state.replace(step=state.step + 1), tr.train_iter.get_state(),
                         {"pipeline_stages": 4})
    tr.checkpointer.close()
    assert checkpoint_pipeline_stages(str(tmp_path / "t")) == 4
    assert checkpoint_pipeline_stages(str(tmp_path / "none")) is None
    assert not os.path.exists(tmp_path / "none")  # a reader creates nothing
