"""Ring attention on 8 simulated CPU devices matches `dense`, outputs and gradients, whole
or a tile at a time."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = r"""
import itertools
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh
from hpnlp.attention.dense import dense_attention
from hpnlp.attention.ring import ring_attention
assert jax.device_count() == 8
mesh = Mesh(np.asarray(jax.devices()).reshape(1, 8), ("data", "sequence"),
            axis_types=(AxisType.Auto,) * 2)
B, L, H, D = 2, 64, 2, 8
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, L, H, D)) for kk in ks)
seg = jnp.asarray((np.arange(L)[None] < np.array([[L], [37]])).astype(np.int32))
packed = jnp.asarray(np.repeat([[1] * 20 + [2] * 30 + [0] * 14], B, 0).astype(np.int32))
w = jax.random.normal(jax.random.key(1), (B, L, H, D))
# block None: each device's 8 positions in one tile; 2: 4 x 4 tiles a ring step, with the
# causal ones above the diagonal skipped
for block, causal, mask in itertools.product((None, 2), (False, True), (None, seg, packed)):
    ref = dense_attention(q, k, v, mask, causal=causal)
    ring = lambda q, k, v: ring_attention(q, k, v, mask, causal=causal, mesh=mesh, block=block)
    out = jax.jit(ring)(q, k, v)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    f = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) * w))
    dense = lambda q, k, v: dense_attention(q, k, v, mask, causal=causal)
    g_ref = jax.grad(f(dense), (0, 1, 2))(q, k, v)
    g = jax.jit(jax.grad(f(ring), (0, 1, 2)))(q, k, v)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert bool(jnp.all(jnp.isfinite(out)))
# A value head dim of its own (a bug hunt, session 99: the sum was built at the query's)
v12 = jax.random.normal(jax.random.key(2), (B, L, H, 12))
np.testing.assert_allclose(ring_attention(q, k, v12, seg, causal=True, mesh=mesh),
                           dense_attention(q, k, v12, seg, causal=True), atol=1e-5, rtol=1e-5)
w12 = jax.random.normal(jax.random.key(3), (B, L, H, 12))  # and its gradients (review)
grads = [jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w12), (0, 1, 2))(q, k, v12) for f in (
    lambda q, k, v: ring_attention(q, k, v, seg, causal=True, mesh=mesh),
    lambda q, k, v: dense_attention(q, k, v, seg, causal=True))]
for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
# A mesh of Explicit axes (jax.make_mesh's default; a bug hunt, session 100: shard_map
# refused the inputs, sharded or not)
explicit = jax.make_mesh((8,), ("sequence",))
assert explicit.axis_types == (AxisType.Explicit,)
np.testing.assert_allclose(ring_attention(q, k, v, seg, causal=True, mesh=explicit),
                           dense_attention(q, k, v, seg, causal=True), atol=1e-5, rtol=1e-5)
with jax.set_mesh(explicit):
    g = jax.grad(lambda q: jnp.sum(ring_attention(q, k, v, seg, causal=True) * w))(q)
np.testing.assert_allclose(g, jax.grad(lambda q: jnp.sum(
    dense_attention(q, k, v, seg, causal=True) * w))(q), atol=1e-5, rtol=1e-5)
# The backward pass holds about what the forward does per step, not every step's scores (a
# bug hunt, session 99: autodiff of the loop kept n steps' [L/n, L/n] scores, 9x the forward)
from jax.sharding import NamedSharding, PartitionSpec as P
x = jax.ShapeDtypeStruct((1, 2048, 1, 16), jnp.float32,
                         sharding=NamedSharding(mesh, P(None, "sequence")))
loss = lambda q, k, v: jnp.sum(ring_attention(q, k, v, None, causal=True, mesh=mesh))
temp = lambda f: f.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
fwd, bwd = temp(jax.jit(loss)), temp(jax.jit(jax.grad(loss, (0, 1, 2))))
assert bwd < 4 * fwd, (fwd, bwd)
# Each ring step's scores are held a tile at a time: 32 x 32 tiles of the 256 positions each
# device holds take under a quarter of the memory of one 256 x 256 tile, forward and backward
tiled = lambda q, k, v: jnp.sum(ring_attention(q, k, v, None, causal=True, mesh=mesh, block=32))
assert temp(jax.jit(tiled)) < fwd / 4, (temp(jax.jit(tiled)), fwd)
assert temp(jax.jit(jax.grad(tiled, (0, 1, 2)))) < bwd / 4, bwd
try:
    ring_attention(q[:, :60], k[:, :60], v[:, :60], None, causal=False, mesh=mesh)
    raise SystemExit("expected an error for L=60 on 8 devices")
except ValueError as e:
    assert "must divide into 8 devices" in str(e)
try:
    ring_attention(q, k, v, None, causal=False, mesh=mesh, block=3)
    raise SystemExit("expected an error for block=3 of 8 positions a device")
except ValueError as e:
    assert "block=3 must divide each device's 8 positions" in str(e), e
# a numpy integer is a block too (a bug hunt, session 101: np.int64(4) was refused)
assert np.array_equal(ring_attention(q, k, v, None, causal=True, mesh=mesh, block=np.int64(2)),
                      ring_attention(q, k, v, None, causal=True, mesh=mesh, block=2))
for bad in ("2", 2.0, True):
    try:
        ring_attention(q, k, v, None, causal=False, mesh=mesh, block=bad)
        raise SystemExit(f"expected an error for block={bad!r}")
    except ValueError as e:
        assert "must be an integer dividing each device's 8 positions" in str(e), e
# no positions: zeros, as chunked's (a review, session 118: max() of an empty range)
empty = ring_attention(q[:, :0], k[:, :0], v12[:, :0], None, causal=True, mesh=mesh)
assert empty.shape == (B, 0, H, 12)
print("RING OK")
"""


@pytest.mark.slow
def test_ring_attention_matches_dense_on_8_devices():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "RING OK" in proc.stdout, proc.stderr[-3000:]


def test_ring_memory_tool_refuses_a_block_in_one_line_before_compiling():
    # a bug hunt (session 101): --block 3 ended in a traceback from inside the first compile
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import ring_memory
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    for argv, said in ((["--lengths", "1024", "--block", "3"], "--block 3: must be a positive "
                        "divisor of each device's L / devices = 256"),
                       (["--lengths", "64", "--block", "0"], "--block 0:"),
                       (["--lengths", "1022"], "--lengths 1022: must divide into --devices 4")):
        with pytest.raises(SystemExit) as e:
            ring_memory.main(argv)
        assert str(e.value).startswith(said), e.value
