"""`chunked`'s GPU kernels (`hpnlp.attention.flash_gpu`) against the `dense` oracle and the
XLA twin: outputs and dq, dk, dv. On a CPU the kernels run in Pallas's interpreter, the same
kernel bodies and block loops (tiny shapes, small blocks so every loop runs several steps);
the `accelerator` tests run the compiled Triton kernels on a GPU."""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hpnlp.attention as A
import hpnlp.attention.chunked as C
import hpnlp.attention.flash_gpu as F
from hpnlp.attention.dense import dense_attention

H = 2
# Small blocks: forward 16 x 16, backward 32 held x 16 looped, so that causal masks cut
# blocks at several offsets and the dK/dV loop starts past the first query block.
SMALL = dict(fwd_q=16, fwd_k=16, bwd_outer=32, bwd_inner=16)


def _qkv(B, L, S, D, Dv=None, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, L, H, D), (B, S, H, D), (B, S, H, Dv or D), (B, L, H, Dv or D)]
    q, k, v, w = (jax.random.normal(kk, s, jnp.float32) for kk, s in zip(ks, shapes))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w


def _segments(B, L):
    """Row 0: ragged right padding; row 1: all padding; row 2: two packed segments."""
    seg = np.zeros((B, L), np.int32)
    seg[0, :L - 11] = 1
    seg[2, :13], seg[2, 13:L - 3] = 1, 2
    return jnp.asarray(seg)


@functools.partial(jax.jit, static_argnums=(0, 6))
def _out_and_grads(fn, q, k, v, w, mask, causal):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask, causal=causal), q, k, v)
    return out, vjp(w.astype(out.dtype))


def _kernel(interpret=True, blocks=SMALL):
    return functools.partial(F.flash_attention, interpret=interpret, blocks=blocks)


def _assert_close(got, want, tol):
    for name, g, r in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=tol, rtol=tol, err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_segments_padding_and_causal_match_dense(causal):
    """L = 40 pads to 64 (keys of segment 0), head dim 8 pads to 16; the all-padding row
    gives zeros, not NaN, and so do its gradients."""
    q, k, v, w = _qkv(3, 40, 40, 8, seed=1)
    seg = _segments(3, 40)
    got = _out_and_grads(_kernel(), q, k, v, w, seg, causal)
    _assert_close(got, _out_and_grads(dense_attention, q, k, v, w, seg, causal), 1e-5)
    chex.assert_tree_all_finite(got)
    assert float(jnp.abs(got[0][1]).max()) == 0.0
    assert all(float(jnp.abs(g[1]).max()) == 0.0 for g in got[1])


def test_cross_attention_lengths_and_value_dim_differ():
    """24 queries over 56 keys (no mask: the padded keys alone get segment ids), values of
    head dim 16 beside queries and keys of 8, causal (top-left aligned, as `dense`)."""
    q, k, v, w = _qkv(2, 24, 56, 8, Dv=16, seed=2)
    for causal in (False, True):
        got = _out_and_grads(_kernel(), q, k, v, w, None, causal)
        _assert_close(got, _out_and_grads(dense_attention, q, k, v, w, None, causal), 1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_matches_float32_and_never_nans(dtype):
    q, k, v, w = _qkv(3, 40, 40, 16, seed=3, dtype=dtype)
    seg = _segments(3, 40)
    out, grads = _out_and_grads(_kernel(), q, k, v, w, seg, True)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    chex.assert_tree_all_finite((out, grads))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _assert_close((out, grads), _out_and_grads(dense_attention, *f32, w, seg, True), 5e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_no_mask_matches_dense(causal):
    """A review (r14): with no mask and lengths the blocks divide the kernels take no
    segment ids (the path of every padding-free batch); L = 48 pads the queries alone to 64,
    zero rows that run with no ids."""
    for L in (48, 64):
        q, k, v, w = _qkv(2, L, 64, 16, seed=6)
        got = _out_and_grads(_kernel(), q, k, v, w, None, causal)
        _assert_close(got, _out_and_grads(dense_attention, q, k, v, w, None, causal), 1e-5)


def test_blocks_are_checked():
    q, k, v, _ = _qkv(1, 16, 16, 16)
    with pytest.raises(ValueError, match="fwd_k.*power of two"):
        F.flash_attention(q, k, v, blocks={"fwd_k": 24}, interpret=True)
    # a float tile, warps or stages below 1 (a review, session 118: a TypeError of `&`, and
    # Triton's compile)
    for blocks, match in (({"fwd_q": 32.0}, r"blocks\['fwd_q'\] = 32.0 must be a power of two"),
                          ({"fwd_warps": 0}, r"blocks\['fwd_warps'\] = 0 must be a positive"),
                          ({"bwd_stages": True}, r"blocks\['bwd_stages'\] = True must be a")):
        with pytest.raises(ValueError, match=match):
            F.flash_attention(q, k, v, blocks=blocks, interpret=True)


def test_the_gpu_kernel_is_not_chosen_off_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the kernel is chosen: test_auto_runs_the_kernel_on_a_gpu")
    assert "GPU backend" in F.blocker(64, 64, jnp.float32)


def test_what_the_gpu_kernel_takes_on_a_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(F, "compute_capability", lambda: (9, 0))  # a Hopper
    assert F.blocker(64, 48, jnp.bfloat16) is None
    assert "float32 are checked and faster than XLA up to 64" in F.blocker(128, 128, jnp.float32)
    assert F.blocker(128, 128, jnp.bfloat16) is None  # 16-bit products: up to 128
    assert "up to 128" in F.blocker(256, 64, jnp.float16)
    assert "dtype int8" in F.blocker(64, 64, jnp.int8)
    # impl='kernel' trains on the GPU kernels; decoding has no GPU kernel, so it reads by XLA
    assert C.ChunkedAttention(impl="kernel").cache_impl() == "auto"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    # nor is the CPU's decode kernel the training one: "auto" (test_kernel_impl_decodes_float16)
    assert C.ChunkedAttention(impl="kernel").cache_impl() == "auto"
    assert C.ChunkedAttention(impl="xla").cache_impl() == "xla"


def test_float32_takes_the_gpu_kernel_only_at_measured_blocks(monkeypatch):
    """A review (r14): on a GPU with no measured float32 blocks the rule's blocks ran 1.21x
    slower than the XLA program (an H200, head dim 64), and `auto` took them on every GPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(F, "compute_capability", lambda: (9, 0))  # a Hopper
    monkeypatch.setattr(F, "_device_kind", lambda: "Other GPU")
    assert "float32 at head dim 64 on 'Other GPU', which has no measured blocks (float32_d64" \
        in F.blocker(64, 64, jnp.float32)
    assert F.blocker(64, 64, jnp.bfloat16) is None  # 16-bit: the rule's blocks beat XLA
    monkeypatch.setattr(F, "_device_kind", lambda: "NVIDIA H200")  # flash_gpu_blocks.json's
    assert F.blocker(64, 64, jnp.float32) is None
    assert "float32_d32" in F.blocker(32, 32, jnp.float32)  # a width it has no entry for


def test_an_explicit_kernel_runs_float32_at_the_rules_blocks(monkeypatch):
    """A diff review (d2): the measured-blocks rule refused impl='kernel' too, so a float32
    run saved on the H200 could not resume on an H100 (nor at head dim 32 on the H200). It is
    `auto`'s choice only; the head dim and capability limits hold for both."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(F, "compute_capability", lambda: (9, 0))  # a Hopper
    monkeypatch.setattr(F, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert "no measured blocks" in C.kernel_blocker(64, 64, "auto", None, None, jnp.float32)
    assert C.kernel_blocker(64, 64, "kernel", None, None, jnp.float32) is None
    assert F.blocker(32, 32, jnp.float32, impl="kernel") is None
    assert "up to 64" in C.kernel_blocker(128, 128, "kernel", None, None, jnp.float32)
    monkeypatch.setattr(F, "compute_capability", lambda: (7, 5))
    assert "compute capability 7.5" in F.blocker(64, 64, jnp.float32, impl="kernel")


def test_gpus_before_ampere_are_refused(monkeypatch):
    """A review (r14): the kernels were compiled only on Hopper; below compute capability
    8.0 bfloat16 products and the rule's shared memory are untried, and would fail at
    compile time naming neither the GPU nor impl='xla'."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    device = types.SimpleNamespace(compute_capability="7.5", device_kind="Tesla T4")
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [device])
    assert F.compute_capability() == (7, 5)
    why = F.blocker(64, 64, jnp.bfloat16)
    assert "compute capability 7.5 (the GPU kernels need 8.0 or newer" in why
    assert "impl='xla'" in why
    with pytest.raises(ValueError, match="impl='kernel' cannot run here: compute capability 7.5"):
        C.chunked_attention(*_qkv(1, 16, 16, 16, dtype=jnp.bfloat16)[:3], impl="kernel")
    device.compute_capability = "8.6"
    assert F.blocker(64, 64, jnp.bfloat16) is None
    # a ROCm GPU, which has no CUDA compute capability (a review, session 115: it passed)
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [types.SimpleNamespace(
        device_kind="AMD Instinct MI300X")])
    assert "no CUDA compute capability" in F.blocker(64, 64, jnp.bfloat16)


def test_kernel_impl_decodes_float16():
    """Review r1 (session 105): impl='kernel' trained in float16 on the CPU (the training
    kernel widens it to float32), then decoding asked the cache kernel, which takes float32
    and bfloat16 only, for impl='kernel' and failed, naming no config field. It decodes by
    the cache's "auto" now: the dense layer's decode, to float16 rounding."""
    B, T, D = 2, 8, 16
    q, k, v, _ = _qkv(B, T, T, D, seed=3, dtype=jnp.float16)
    dense, chunked = A.get("dense")(), C.ChunkedAttention(impl="kernel")

    @jax.jit
    def decode(q, k, v):
        outs = []
        for m in (dense, chunked):
            cache, out = m.init_cache(B, T, H, D, jnp.float16), []
            for t in range(T):
                o, cache = m.decode_step(cache, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
                out.append(o)
            outs.append(jnp.concatenate(out, 1))
        return outs

    want, got = decode(q, k, v)
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-3)
    full = dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(got.astype(jnp.float32), full, atol=1e-2)


def test_empty_lengths_and_bad_shapes():
    q, k, v, _ = _qkv(1, 16, 16, 16)
    assert F.flash_attention(q[:, :0], k, v, interpret=True).shape == (1, 0, H, 16)
    assert F.flash_attention(q, k[:, :0], v[:, :0], interpret=True).shape == (1, 16, H, 16)
    with pytest.raises(ValueError, match="segment ids .* must equal the key length"):
        F.flash_attention(q, k[:, :8], v[:, :8], jnp.ones((1, 16), jnp.int32), interpret=True)


@pytest.mark.accelerator
def test_auto_runs_the_kernel_on_a_gpu():
    q, k, v, _ = _qkv(1, 128, 128, 64, dtype=jnp.bfloat16)
    hlo = jax.jit(lambda q, k, v: C.chunked_attention(q, k, v)).lower(q, k, v).as_text()
    assert "hpnlp_flash_fwd" in hlo
    x = jnp.zeros((1, 128, 2, 64), jnp.float32)  # float32: at this GPU's measured blocks only
    hlo = jax.jit(lambda x: C.chunked_attention(x, x, x)).lower(x).as_text()
    assert ("hpnlp_flash_fwd" in hlo) == (F.blocker(64, 64, jnp.float32) is None)
    for dtype, kernel in ((jnp.bfloat16, True), (jnp.float32, False)):  # head dim 128
        x = jnp.zeros((1, 128, 2, 128), dtype)
        hlo = jax.jit(lambda x: C.chunked_attention(x, x, x)).lower(x).as_text()
        assert ("hpnlp_flash_fwd" in hlo) == kernel, dtype
    hlo = jax.jit(lambda q, k, v: C.chunked_attention(q, k, v, impl="xla")).lower(q, k, v).as_text()
    assert "hpnlp_flash" not in hlo


@pytest.mark.accelerator
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_kernels_match_the_xla_twin(dtype, causal):
    """The Triton kernels at the default blocks, on a length they do not divide (segments,
    padding) and head dim 64."""
    q, k, v, w = _qkv(3, 200, 200, 64, seed=4, dtype=dtype)
    seg = _segments(3, 200)
    got = _out_and_grads(_kernel(interpret=False, blocks=None), q, k, v, w, seg, causal)
    twin = _out_and_grads(functools.partial(C.chunked_attention, impl="xla"),
                          q, k, v, w, seg, causal)
    chex.assert_tree_all_finite(got)
    _assert_close(got, twin, 2e-5 if dtype == jnp.float32 else 5e-2)


@pytest.mark.accelerator
def test_compiled_kernels_memory_is_linear_in_length():
    def temp_bytes(length):
        q = jnp.zeros((1, length, 2, 64), jnp.bfloat16)
        loss = lambda q, k, v: jnp.sum(F.flash_attention(q, k, v).astype(jnp.float32))  # noqa: E731
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, q, q).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, big = temp_bytes(2048), temp_bytes(8192)
    # 6144 more tokens cost under a sixteenth of their extra [L, L] float32 scores per head.
    assert big - small < (8192**2 - 2048**2) * 4 * 2 / 16, (small, big)


def test_measured_blocks_are_read_per_gpu_model(tmp_path, monkeypatch):
    path = tmp_path / "blocks.json"
    path.write_text('{"Some GPU": {"16bit_d64": {"fwd_q": 32, "bwd_warps": 8}}}')
    monkeypatch.setattr(F, "TUNED_PATH", str(path))
    monkeypatch.setattr(F, "_device_kind", lambda: "Some GPU")
    got = F.default_blocks(jnp.bfloat16, 64)
    assert (got["fwd_q"], got["bwd_warps"], got["fwd_k"]) == (32, 8, 64)
    assert F.default_blocks(jnp.float32, 64)["fwd_q"] == 64  # no entry: the rule
    monkeypatch.setattr(F, "_device_kind", lambda: "Another GPU")
    assert F.default_blocks(jnp.bfloat16, 64)["fwd_q"] == 128
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON.*flash_gpu_blocks.py --write"):
        F.tuned_table(str(bad))


@pytest.mark.accelerator
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernels_at_head_dim_128(dtype):
    """Head dim 128, at this GPU's measured blocks where it has them: `auto` takes this width
    for 16-bit inputs (`MAX_HEAD_DIM`); float32 is called directly."""
    q, k, v, w = _qkv(2, 200, 200, 128, seed=5, dtype=dtype)
    seg = _segments(3, 200)[1:]
    for causal in (False, True):
        got = _out_and_grads(_kernel(interpret=False, blocks=None), q, k, v, w, seg, causal)
        twin = _out_and_grads(functools.partial(C.chunked_attention, impl="xla"),
                              q, k, v, w, seg, causal)
        _assert_close(got, twin, 2e-5 if dtype == jnp.float32 else 5e-2)
