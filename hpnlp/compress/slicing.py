"""A narrower Transformer from a wider one by rotating its residual stream (SliceGPT).

`train.distill.init = "pca"` starts a distilled student as this module computes it:
Ashkboos et al. 2024 ("SliceGPT: Compress Large Language Models by Deleting Rows and
Columns"), with one rotation for the whole stream. A pre-LayerNorm Transformer computes
the same function in any orthonormal basis of its residual stream that maps the mean
direction (which every LayerNorm subtracts) to the mean direction, once the norms' scales
and biases are folded into the weights that read them. In the basis of the
stream's principal components the trailing ones carry little, and a student of width Es
keeps the leading Es - 1 of them (plus the mean direction, which every norm removes): where
`select` and `importance` keep Es of the teacher's channels, this keeps the Es-dimensional
subspace the teacher's states mostly lie in (on the byte LM's teacher, 63 of its 128
components hold 97% of the normalized states' energy).

The basis (`stream_basis`): the covariance of every LayerNorm's input (norm1, norm2 of each
block, final_norm), each token's state centered over the channels and scaled to unit RMS
(what the norm hands on, before its scale), summed over the real tokens of the run's first
`train.distill.importance_batches` training batches (`stream_covariance`). P [Et, Es] holds
the leading Es - 1 eigenvectors and the mean direction 1/sqrt(Et), turned (one Householder
reflection within the student's space) so that the student's own mean direction 1/sqrt(Es)
is the teacher's: the mean a student norm subtracts from s = P^T x is the one the
teacher's subtracts from x, so the student's norms see what the teacher's see, less the
dropped components (SliceGPT, which drops the mean direction, first centers every weight
that writes the stream; keeping it, this need not).

The weights (`rotate`, from the teacher's weights already cut to the student's heads and
MLP neurons, their width axis whole), with r = sqrt(Et / Es) (a student norm divides by the
RMS over Es channels, the teacher's over Et):

- what writes the stream maps into the student's basis: the token table r E P (the trunk
  scales it by sqrt(width): sqrt(Es) r = sqrt(Et)), the position table P, the attention
  output and the MLP's output weight and bias W P;
- what reads a norm's output folds the norm's scale g and bias b in: W_s = r P^T diag(g) W,
  and b @ W joins the reader's bias (the MLP's input, an untied output layer, a
  classifier's head), whose norm then starts at scale 1 and bias 0. The attention's
  projections have no bias: their norm's bias is the least-squares b_s with W_s^T b_s = W^T
  b (exact when the student is the teacher's width);
- a tied output layer reads the final norm through the token table A = r E P, which the
  input side fixes: the final norm's scale g_s is the least-squares fit of the logits'
  weight on the student's normalized state, A diag(g_s) Z against r E diag(g) P Z (Z = I -
  11^T/Es: those states have zero mean), exact where the teacher's scale is one number;
  its bias the least-squares b_s with A b_s = E b.

At the teacher's width (and heads, neurons, depth) with an untied output, a classifier,
or a tied output whose final norm scales every channel alike, the student computes exactly
what the teacher computes (`tests/test_compress_sparse.py`);
narrower, it computes the teacher restricted to the leading components. Plain Transformer
blocks with a LayerNorm before attention and MLP only: mixtures of experts, latent
attention, sinusoidal positions (the student's table is its own function of position) and
output layers other than `full` are refused (`check`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp.config import config_error

NORMS = ("norm1", "norm2", "final_norm")


def check(cfg, teacher_cfg) -> None:
    """One line naming the field, where the student or teacher is no model `rotate` knows."""
    for who, c in (("this run", cfg), ("the teacher", teacher_cfg)):
        m = c.model
        why = None
        if m.moe.num_experts:
            why = (f"model.moe.num_experts={m.moe.num_experts} (its experts' MLPs and router "
                   "are not folded)")
        elif m.kv_latent_dim:
            why = f"model.kv_latent_dim={m.kv_latent_dim} (the latent's own norm is not folded)"
        elif m.pos_emb == "sinusoidal":
            why = "model.pos_emb='sinusoidal' (a narrower table is not a rotation of it)"
        elif m.kind == "lm" and c.output.name != "full":
            why = f"output.name={c.output.name!r} (its parameters are not a [V, E] table)"
        elif m.kind == "classifier" and m.memory.size:
            why = f"model.memory.size={m.memory.size} (its query is not folded)"
        elif m.kind not in ("lm", "classifier"):
            why = f"model.kind={m.kind!r}"
        if why:
            raise config_error("train.distill.init", "pca", f"rotates a plain Transformer's "
                               f"residual stream, but {who} has {why}; use init='importance'")


def stream_covariance(module_def, variables, batches, method, *, microbatches: int = 1,
                      rngs=None):
    """[E, E] float64: the sum over real tokens of x x^T, x each LayerNorm input (`NORMS`)
    centered over the channels and scaled to unit RMS (module doc), over `batches`.
    `module_def` must be built with model.remat='none': the inputs are grabbed by a method
    interceptor, which inside a remat's own trace grabs that trace's tracers (a review,
    session 107: an UnexpectedTracerError). `rngs`: the apply's (a random-feature draw)."""
    import flax.linen as nn

    from hpnlp.compress.distill import per_batch, token_weights

    def micro(variables, batch):
        inputs = []

        def grab(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and context.module.name in NORMS \
                    and isinstance(context.module, nn.LayerNorm):
                inputs.append(args[0])
            return next_fun(*args, **kwargs)
        with nn.intercept_methods(grab):
            module_def.apply(variables, batch, method=method, rngs=rngs)
        if not inputs:
            raise ValueError("the model called no LayerNorm named " + ", ".join(NORMS))
        w_BL = token_weights(batch)
        total = 0.0
        for x_BLE in inputs:
            x = x_BLE.astype(jnp.float32)
            x = x - x.mean(-1, keepdims=True)
            x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
            x = jnp.where((w_BL > 0)[..., None], x, 0.0) * jnp.sqrt(w_BL)[..., None]
            total = total + jnp.einsum("ble,blf->ef", x, x)
        return total

    return sum(np.asarray(b, np.float64)
               for b in per_batch(micro, variables, batches, microbatches))


def stream_basis(cov, width: int) -> np.ndarray:
    """P [Et, width]: orthonormal columns spanning the mean direction and the leading
    width - 1 principal components of `cov`, with P 1/sqrt(width) = 1/sqrt(Et) (module doc)."""
    et = cov.shape[0]
    if not 2 <= width <= et:
        raise ValueError(f"a student width of {width} from a stream of {et}: rotate keeps 2 to "
                         f"{et} channels")
    c = np.eye(et) - 1.0 / et
    _, vecs = np.linalg.eigh(c @ cov @ c)  # ascending; the mean direction is in the null space
    u0 = np.full(et, et ** -0.5)
    q, _ = np.linalg.qr(np.concatenate([u0[:, None], vecs[:, ::-1][:, :width - 1]], axis=1))
    q = q * np.sign(q[:, :1].T @ u0)  # its first column +u0 (QR may flip it)
    v = np.zeros(width)
    v[0] = 1.0
    v -= np.full(width, width ** -0.5)
    house = np.eye(width) - 2.0 * np.outer(v, v) / (v @ v) if v @ v > 1e-12 else np.eye(width)
    return q @ house  # house e_1 = 1/sqrt(width), so P 1/sqrt(width) = q e_1 = u0


def rotate(cut: dict, teacher: dict, P: np.ndarray, *, tied: bool) -> dict:
    """The student's weights {path: float64 array} from `cut` {student path: (teacher path,
    the teacher's weight cut to the student's heads and neurons, width axes whole)}, the
    teacher's flat weights and the basis P (module doc). Every path is one this knows, or
    ValueError names it."""
    et, es = P.shape
    r = np.sqrt(et / es)
    out, lsq = {}, {}  # lsq: norm path -> [its readers' folded weights (Es, n)], [W^T b]
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731

    def norm_of(tpath, name):  # the norm `name` of the block that holds `tpath`
        i = next(i for i, p in enumerate(tpath) if p.startswith("block_"))
        return tuple(tpath[:i + 1]) + (name,)

    def fold(t, norm, axis=0):  # a reader of `norm` (teacher path): (r P^T diag(g) W, b @ W)
        g, b = f64(teacher[norm + ("scale",)]), f64(teacher[norm + ("bias",)])
        w = np.moveaxis(f64(t), axis, 0)
        flat = w.reshape(et, -1)
        ws = (r * P.T @ (g[:, None] * flat)).reshape((es,) + w.shape[1:])
        return np.moveaxis(ws, 0, axis), (b @ flat).reshape(w.shape[1:])

    for path, (tpath, t) in cut.items():
        t = f64(t)
        tail = tpath[-2:]
        if tpath == ("embed", "embedding"):
            out[path] = r * t @ P
        elif tpath[-1] == "pos_embedding":
            out[path] = t @ P
        elif tail[0] == "attention" and tail[1] in ("qkv", "q", "kv"):
            norm = norm_of(tpath, "norm1")
            out[path], bias = fold(t, norm)
            spath = path[:path.index("attention")] + ("norm1",)
            ws, wb = lsq.setdefault(spath, ([], []))
            ws.append(out[path].reshape(es, -1))
            wb.append(bias.reshape(-1))
        elif tail == ("attention", "out") or tail in (("mlp_out", "kernel"), ("mlp_out", "bias")):
            out[path] = t @ P
        elif tail == ("mlp_in", "kernel"):
            out[path] = fold(t, norm_of(tpath, "norm2"))[0]
        elif tail == ("mlp_in", "bias"):
            kernel = cut[path[:-1] + ("kernel",)][1]
            out[path] = t + fold(kernel, norm_of(tpath, "norm2"))[1]
        elif tail in (("head", "kernel"), ("table", "kernel")):  # a classifier's head, untied
            axis = 0 if tail[0] == "head" else 1
            out[path] = fold(t, ("trunk", "final_norm"), axis)[0]
        elif tail in (("head", "bias"), ("table", "bias")):
            kernel = cut.get(path[:-1] + ("kernel",))
            if kernel is None:  # tied: the bias stays, the final norm is fit below
                out[path] = t
            else:
                axis = 0 if tail[0] == "head" else 1
                out[path] = t + fold(kernel[1], ("trunk", "final_norm"), axis)[1]
        elif tail[0] in NORMS and tail[1] in ("scale", "bias"):
            continue  # below, once their readers are known
        else:
            raise ValueError("/".join(tpath))
    for path, (tpath, t) in cut.items():
        if not (tpath[-2] in NORMS and tpath[-1] in ("scale", "bias")):
            continue
        if tpath[-1] == "scale" and not (tied and tpath[-2] == "final_norm"):
            out[path] = np.ones(es)
        elif path[:-1] in lsq:  # the attention's norm: b_s with W_s^T b_s = W^T b
            ws, wb = lsq[path[:-1]]
            out[path] = np.linalg.lstsq(np.concatenate(ws, 1).T, np.concatenate(wb),
                                        rcond=None)[0]
        elif tied and tpath[-2] == "final_norm":  # read through the token table (module doc)
            table = out[("embed", "embedding")]  # [V, Es]
            full = f64(teacher[("embed", "embedding")])
            g, b = (f64(teacher[tpath[:-1] + (k,)]) for k in ("scale", "bias"))
            if tpath[-1] == "scale":  # A diag(g_s) Z against r E diag(g) P Z (module doc)
                z = np.eye(es) - 1.0 / es  # the student's normalized states have zero mean
                want = r * (full * g) @ P @ z
                out[path] = np.linalg.lstsq((table.T @ table) * z, np.diag(table.T @ want @ z),
                                            rcond=None)[0]
            else:
                out[path] = np.linalg.lstsq(table, full @ b, rcond=None)[0]
        else:
            out[path] = np.zeros(es)
    return out
