"""hpnlp.compress.spmm: the sparse (CSC) weight product against float64 and its XLA twin,
at every row block, on shapes that leave partial tiles; its checks of bad input."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpnlp.compress import spmm

needs_kernel = pytest.mark.kernel(spmm.KERNEL)


def _weight(rng, K, N, sparsity):
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[rng.random((K, N)) < sparsity] = 0.0
    return w


# (M, K, N, sparsity): whole 16 x 16 tiles and partial ones (M, K, N not multiples of 8
# or 16), one row (decoding), an empty weight, a dense one, empty columns at 99%.
SHAPES = [(40, 48, 32, 0.9), (37, 13, 21, 0.5), (1, 70, 33, 0.8), (19, 16, 16, 1.0),
          (33, 50, 37, 0.0), (64, 128, 40, 0.99)]


def test_prepare_keeps_exactly_the_nonzeros():
    w = _weight(np.random.default_rng(0), 30, 20, 0.7)
    w[:, 3] = 0.0  # an empty column
    sw = spmm.prepare_sparse_weight(w)
    assert sw.shape == (30, 20) and sw.nnz == np.count_nonzero(w)
    assert abs(sw.density - np.count_nonzero(w) / w.size) < 1e-12
    assert sw.nbytes == 4 * (21 + 2 * sw.nnz)
    np.testing.assert_array_equal(np.asarray(sw.dense()), w)
    cp, row = np.asarray(sw.col_ptr), np.asarray(sw.row)
    assert cp[3] == cp[4]  # the empty column has no entries
    for n in range(20):  # rows ascending within a column
        assert np.all(np.diff(row[cp[n]:cp[n + 1]]) > 0)
    # found in review: a bfloat16 weight was refused as "not float" (NumPy's issubdtype)
    wb = jnp.asarray(w, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(spmm.prepare_sparse_weight(wb).dense()),
                                  np.asarray(wb, np.float32))


def test_sparse_files_round_trip_bfloat16_leaves(tmp_path):
    """Found in review: `sparsify` of a run with model.param_dtype='bfloat16' wrote its
    bfloat16 leaves as raw bytes npz cannot type (|V2), and loading them failed. They come
    back bfloat16, as `ptq.save` stores them. (The model's own shapes: `sparsify.load`
    checks every array against them, a bug hunt, session 99.)"""
    import flax.traverse_util as traverse
    from test_compress_sparse import tiny

    from hpnlp.compress import ptq, sparsify
    from hpnlp.compress.qlinear import Sparse
    from hpnlp.config import from_configdict, validate
    cfg = validate(from_configdict(tiny()))
    flat = {tuple(k.split("/")[1:]): np.ones(x.shape, np.float32)
            for k, x in ptq.model_entries(cfg, packed=False)[0].items()}
    w = _weight(np.random.default_rng(1), 16, 32, 0.5)
    scale = jnp.linspace(-2.0, 3.25, 16).astype(jnp.bfloat16)
    flat[("trunk", "final_norm", "scale")] = scale
    flat[("trunk", "block_0", "mlp_in", "kernel")] = Sparse(spmm.prepare_sparse_weight(w),
                                                          shape=(16, 32), k_dims=1)
    sparsify.save(str(tmp_path), cfg, traverse.unflatten_dict(flat), {})
    _, back = sparsify.load(str(tmp_path))
    norm = back["trunk"]["final_norm"]["scale"]
    assert norm.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(norm), np.asarray(scale))
    kernel = back["trunk"]["block_0"]["mlp_in"]["kernel"]
    np.testing.assert_array_equal(np.asarray(kernel.w.dense()), w)


@needs_kernel
def test_kernel_matches_float64_at_every_row_block():
    rng = np.random.default_rng(1)
    for M, K, N, q in SHAPES:
        w, x = _weight(rng, K, N, q), rng.standard_normal((M, K)).astype(np.float32)
        sw = spmm.prepare_sparse_weight(w)
        want = x.astype(np.float64) @ w.astype(np.float64)
        scale = max(1.0, np.abs(want).max())
        # every row block on 1 and 3 threads (more than the small ones' row blocks), and
        # the twin, in one compile per shape
        runs = [(v, t) for v in spmm.VECTORS for t in (1, 3)]
        every = jax.jit(lambda a, b: [spmm.sparse_matmul_xla(a, b)] + [
            spmm.sparse_matmul(a, b, impl="kernel", vectors=v, threads=t) for v, t in runs])
        twin, *got = every(jnp.asarray(x), sw)
        assert np.abs(np.asarray(twin) - want).max() <= 1e-5 * scale
        for (v, t), y in zip(runs, got):
            assert np.abs(np.asarray(y) - want).max() <= 1e-5 * scale, (M, K, N, q, v, t)


# Outside an XLA call (the tuning probe) the row blocks are claimed by threads started for
# the call: with 1 of 3 helpers able to start, the product runs on 2 (and is the dense one)
# where it called std::terminate (found in review).
SPMM_CASES = r"""
#include <cmath>
int run_case(const std::string& name) {
  starts_left = name == "none" ? 0 : 1;
  CHECK(hpnlp_spmm_probe(64, 40, 24, 5, 1, 4) >= 0.0);
  const int M = 70, K = 9, N = 5;  // blocks of NR rows: more than 4 of them
  std::vector<float> x(M * K), val, y(M * N, -1.0f), want(M * N, 0.0f);
  std::vector<int32_t> col_ptr{0}, row;
  for (int i = 0; i < M * K; ++i) x[i] = float(i % 7) - 3.0f;
  for (int n = 0; n < N; ++n) {
    for (int k = n % 2; k < K; k += 2) {
      row.push_back(k), val.push_back(0.5f * float(k + n));
      for (int m = 0; m < M; ++m) want[m * N + n] += x[m * K + k] * val.back();
    }
    col_ptr.push_back(int32_t(row.size()));
  }
  run(Csc{M, K, N, x.data(), col_ptr.data(), row.data(), val.data(), y.data()}, 1, 4);
  for (int i = 0; i < M * N; ++i) CHECK(std::abs(y[i] - want[i]) <= 1e-4f * std::abs(want[i]));
  return 0;
}
"""


@pytest.fixture(scope="module")
def spmm_harness(tmp_path_factory):
    from test_rnn_fused import build_harness
    return build_harness(tmp_path_factory.mktemp("spmm_harness"), spmm.KERNEL.source,
                         SPMM_CASES)


@needs_kernel
@pytest.mark.slow  # the harness's build: 2-3 s
@pytest.mark.parametrize("case", ["one", "none"])
def test_a_helper_that_cannot_start_leaves_the_work_to_the_others(spmm_harness, case):
    proc = spmm_harness(case)
    assert proc.returncode == 0 and f"ok {case}" in proc.stdout, proc.stdout + proc.stderr


@needs_kernel
def test_auto_runs_the_kernel_under_jit_and_vmap():
    rng = np.random.default_rng(2)
    w, x = _weight(rng, 24, 16, 0.8), rng.standard_normal((3, 5, 24)).astype(np.float32)
    sw = spmm.prepare_sparse_weight(w)
    f = jax.jit(jax.vmap(lambda a: spmm.sparse_matmul(a, sw)))
    assert "hpnlp_csc_matmul" in f.lower(jnp.asarray(x)).as_text()
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x))), x @ w, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_gradients_through_the_kernel_are_the_dense_twins():
    """An FFI call has no derivative of its own: the kernel's backward pass is the dense
    twin's, x's and the nonzeros' values' (what a sparse fine-tune would train), jitted."""
    rng = np.random.default_rng(3)
    w, x = _weight(rng, 24, 16, 0.8), jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
    sw, cot = spmm.prepare_sparse_weight(w), jnp.asarray(rng.standard_normal((5, 16)),
                                                         jnp.float32)

    def grads(impl):
        def loss(a, val):
            return jnp.vdot(spmm.sparse_matmul(a, spmm.SparseWeight(sw.col_ptr, sw.row, val,
                                                                    k=sw.k), impl=impl), cot)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, sw.val)

    got, want = grads("kernel"), grads("xla")
    cols = np.nonzero(w.T)[0]  # each nonzero's column; its value's gradient is x^T cot there
    np.testing.assert_allclose(np.asarray(want[1]), (np.asarray(x).T @ np.asarray(cot))[
        np.asarray(sw.row), cols], rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _repeated():
    """A weight [2, 2] whose columns list their row twice (a non-canonical CSC), and x."""
    w = spmm.SparseWeight(jnp.asarray([0, 2, 4], jnp.int32), jnp.asarray([0, 0, 1, 1], jnp.int32),
                          jnp.asarray([1.0, 2.0, 4.0, 8.0], jnp.float32), k=2)
    return w, jnp.asarray([[1.0, 0.5], [2.0, -1.0]], jnp.float32)


def test_a_row_repeated_in_a_column_adds_in_the_twin():
    """Review r5: the twin's dense() kept one of a repeated entry's values (by scatter
    order), where the kernel sums them; it sums them too (no kernel needed to check)."""
    w, x = _repeated()
    np.testing.assert_array_equal(np.asarray(w.dense()), [[3.0, 0.0], [0.0, 12.0]])
    np.testing.assert_array_equal(np.asarray(jax.jit(spmm.sparse_matmul, static_argnames="impl")(
        x, w, impl="xla")), np.asarray(x) @ np.float32([[3.0, 0.0], [0.0, 12.0]]))


@needs_kernel
def test_a_row_repeated_in_a_column_adds_in_the_kernel_and_the_twin():
    """Review r5: a column listing a row twice (a non-canonical CSC) was summed by the kernel
    and overwritten by the twin's dense() (one of the two values, by scatter order), so
    impl="auto" and "xla" differed. Both sum it, under jit too, and the gradients agree."""
    w, x = _repeated()
    want = np.asarray(x) @ np.float32([[3.0, 0.0], [0.0, 12.0]])
    both = jax.jit(lambda a, b: [spmm.sparse_matmul(a, b, impl=i) for i in ("kernel", "xla")])
    for y in both(x, w):
        np.testing.assert_array_equal(np.asarray(y), want)

    def grad(impl):
        def loss(val):
            return spmm.sparse_matmul(x, spmm.SparseWeight(w.col_ptr, w.row, val, k=2),
                                      impl=impl).sum()
        return np.asarray(jax.grad(loss)(w.val))
    np.testing.assert_array_equal(grad("kernel"), grad("xla"))


def test_bad_input_says_what_and_how():
    sw = spmm.prepare_sparse_weight(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="has K = 3 but the weight has K = 4"):
        spmm.sparse_matmul(jnp.ones((2, 3)), sw)
    with pytest.raises(ValueError, match="float32"):
        spmm.sparse_matmul(jnp.ones((2, 4), jnp.int32), sw)
    with pytest.raises(ValueError, match="impl must be one of"):
        spmm.sparse_matmul(jnp.ones((2, 4)), sw, impl="gpu")
    with pytest.raises(ValueError, match="SparseWeight"):
        spmm.sparse_matmul(jnp.ones((2, 4)), jnp.eye(4))
    with pytest.raises(ValueError, match=r"must be \[K, N\]"):
        spmm.prepare_sparse_weight(np.ones(4, np.float32))
    # whichever path runs (found in review: impl="xla" took threads=0 and vectors=3; review
    # r5: vectors=True ran as 1, and 4.0 as 4)
    for impl in ("xla", "auto"):
        for vectors in (3, True, 4.0):
            with pytest.raises(ValueError, match="vectors must be one of"):
                spmm.sparse_matmul(jnp.ones((2, 4)), sw, vectors=vectors, impl=impl)
        for threads in (0, 2.5):
            with pytest.raises(ValueError, match="threads must be an integer >= 1"):
                spmm.sparse_matmul(jnp.ones((2, 4)), sw, threads=threads, impl=impl)
    if spmm.available():
        # arrays that do not describe a K x N matrix are refused by the kernel, not read
        bad = spmm.SparseWeight(sw.col_ptr, sw.row.at[2].set(7), sw.val, k=4)
        with pytest.raises(Exception, match=r"row index is outside \[0, K\)"):
            jax.block_until_ready(spmm.sparse_matmul(jnp.ones((2, 4)), bad, impl="kernel"))


# ---------------------------------------------------------------- a pruned run served sparse


@pytest.mark.slow  # 7.2 s in the suite on the 2-core Zen 3 (2026-12-01): CI's slow part runs it
def test_a_pruned_run_is_served_by_the_sparse_kernel(tmp_path, capsys):
    """`python -m hpnlp.compress sparsify`: a run pruned 90% (one-shot, unstructured) is
    written with its four block products stored by their nonzeros; it evaluates as the
    masked model did, reloads to identical outputs, and bad input is one line."""
    from test_compress_sparse import tiny

    from hpnlp.compress import sparsify
    from hpnlp.compress.__main__ import main
    from hpnlp.compress.qlinear import Sparse
    from hpnlp.train import run

    cd = tiny(prune=dict(method="magnitude", sparsity=0.9, schedule="oneshot", start_step=1))
    cd.train.update(steps=2, checkpoint_every=2)
    run(cd, str(tmp_path / "pruned"))
    out = str(tmp_path / "pruned_sparse")
    assert main(["sparsify", "--workdir", str(tmp_path / "pruned"), "--out", out,
                 "--eval_batches", "1"]) == 0
    s = json.load(open(os.path.join(out, "summary.json")))
    assert sorted(s["converted"]) == ["trunk/block_0/attention/out", "trunk/block_0/attention/qkv",
                                      "trunk/block_0/mlp_in/kernel", "trunk/block_0/mlp_out/kernel"]
    assert all(abs(q - 0.9) < 0.01 for q in s["converted"].values())
    assert abs(s["eval"]["loss_rel_diff"]) < 1e-5 and s["reload_identical"]
    assert s["size_bytes"]["converted_sparse"] < 0.3 * s["size_bytes"]["converted_dense"]
    cfg, params = sparsify.load(out)
    qkv = params["trunk"]["block_0"]["attention"]["qkv"]
    assert isinstance(qkv, Sparse) and qkv.shape == (16, 3, 2, 8) and qkv.k_dims == 1
    assert isinstance(params["embed"]["embedding"], jax.Array)  # not a product weight it takes
    # the compress bench's use: the sparse run reused for the same checkpoint, its forward
    # the masked run's
    from hpnlp.bench import compress
    before = os.path.getmtime(os.path.join(out, "summary.json"))
    assert compress._sparsified(str(tmp_path / "pruned"), {"eval_batches": 1}) == out
    assert os.path.getmtime(os.path.join(out, "summary.json")) == before
    (dense, d_args), (sparse, s_args) = (compress._forward_fn(str(tmp_path / "pruned"), sparse=x)
                                         for x in (None, out))
    # the CPU kernel where it builds; elsewhere (a GPU, no compiler) the sparse weights run
    # the XLA twin (`how` says so)
    kernel = spmm.available()
    assert ("hpnlp_csc_matmul" in sparse.lower(*s_args).as_text()) == kernel
    assert s["forward"]["how"].startswith("the XLA twin: ") != kernel
    for a, b in zip(jax.tree.leaves(dense(*d_args)), jax.tree.leaves(sparse(*s_args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    # bad input: one line naming the flag, before anything is written
    assert main(["sparsify", "--workdir", str(tmp_path / "pruned"), "--out",
                 str(tmp_path / "o"), "--min_sparsity", "1.0"]) == 1
    assert "min_sparsity" in capsys.readouterr().err and not os.path.exists(tmp_path / "o")
    assert main(["sparsify", "--workdir", str(tmp_path / "pruned"), "--out",
                 str(tmp_path / "o"), "--min_sparsity", "0.95"]) == 1
    err = capsys.readouterr().err
    assert "no product weight is at least 95% zeros" in err and "lower --min_sparsity" in err
    assert main(["sparsify", "--workdir", str(tmp_path / "none"), "--out",
                 str(tmp_path / "o")]) == 1
    assert "hpnlp.compress: error:" in capsys.readouterr().err


def test_a_quantization_aware_run_is_refused_before_anything_is_read(tmp_path, capsys):
    """Found by a bug hunt (session 89): `sparsify` of a run trained with quant.weights
    served it in float weights and activations, exit 0, a different model than trained."""
    from hpnlp.compress.__main__ import main
    from hpnlp.config import default_configdict, from_configdict
    from hpnlp.train.checkpoint import Checkpointer
    cd = default_configdict()
    cd.data.task, cd.model.kind, cd.quant.weights = "byte_lm", "lm", "binary"
    Checkpointer(str(tmp_path / "qat"), from_configdict(cd), keep=1).close()  # config.json
    os.makedirs(tmp_path / "qat" / "checkpoints" / "10")  # as if trained: never read
    assert main(["sparsify", "--workdir", str(tmp_path / "qat"), "--out",
                 str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "`quant.weights` = 'binary'" in err and "trained quantized (QAT)" in err
    assert not os.path.exists(tmp_path / "o")
