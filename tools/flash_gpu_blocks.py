"""Time `chunked`'s GPU kernels (`hpnlp.attention.flash_gpu`) over block configurations, in
one process, beside PyTorch's SDPA and the XLA twin at the same shape: how the defaults in
`flash_gpu.default_blocks` were chosen. GPU only.

    JAX_PLATFORMS=cuda python tools/flash_gpu_blocks.py [--L 4096] [--B 1] [--H 8] [--D 64]
        [--out DIR] [--write]

Forward configurations are timed forward only; backward ones forward+backward with the
default forward. Float32 products at full precision (`highest`), as the attention bench
runs them. Writes blocks.json (every row; blocks_d<D>.json at another head dim) to --out;
`--write` stores the fastest forward and backward configuration of each dtype for this GPU
model and head dim in `flash_gpu.TUNED_PATH`, which `flash_gpu.default_blocks` reads from
then on. Both are written after each dtype's sweep, whole or not at all, so a sweep cut off
(a lent GPU's time running out) keeps what it timed, and the committed table is never left
cut: float32's rows alone go to blocks.partial.json beside the record, which the whole
sweep's blocks.json replaces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import jax
import jax.numpy as jnp

from hpnlp.attention import chunked, flash_gpu
from hpnlp.bench import harness
from hpnlp.paths import check_writable_dir, write_json

# (query block, key block, warps, pipeline stages) of the forward; (held block, looped block,
# warps, stages) of the two backward kernels.
FWD = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2),
       (128, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (128, 128, 8, 2)]
BWD = [(64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 2), (64, 32, 8, 2), (64, 64, 4, 2),
       (128, 16, 4, 2), (128, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2)]


def _inputs(B, L, H, D, dtype):
    ks = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, (B, L, H, D), jnp.float32).astype(dtype) for k in ks]


def _time(fn, args):
    try:
        t = harness.time_jax(fn, *args, repeats=20, min_time_s=0.3)
        return round(t.median_s * 1e3, 4)
    except Exception as e:  # a configuration Triton cannot compile (shared memory, registers)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _fastest(rows, what, key):
    timed = [r for r in rows if r["what"] == what and isinstance(r.get(key), float)]
    return min(timed, key=lambda r: r[key])["blocks"] if timed else {}


def _write_tuned(rows, head_dim) -> None:
    path = flash_gpu.TUNED_PATH
    table = flash_gpu.tuned_table(path)
    kind = jax.devices()[0].device_kind
    for dtype in (jnp.float32, jnp.bfloat16):
        mine = [r for r in rows if r["dtype"] == jnp.dtype(dtype).name]
        entry = _fastest(mine, "fwd", "fwd_ms") | _fastest(mine, "fwd+bwd", "fwd_bwd_ms")
        if entry:
            table.setdefault(kind, {})[flash_gpu.tuned_key(dtype, head_dim)] = entry
    # beside it, then moved over it (review r6: open(path, "w") cut the committed file first,
    # and a kill or a full disk then left every GPU `chunked` run failing on its JSON);
    # not paths.write_json: the committed file's keys are sorted and it ends in a newline
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    print(f"wrote {path}: {json.dumps(table.get(kind))}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--L", type=int, default=4096)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--write", action="store_true",
                   help="store the fastest configurations in flash_gpu.TUNED_PATH")
    a = p.parse_args(argv)
    for name in ("L", "B", "H", "D"):  # a bug hunt: a bad shape became rows of errors
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: give a positive size")
    if a.out:  # review r6: a file there was a traceback after every configuration was timed
        try:
            check_writable_dir(a.out, "--out")
        except ValueError as e:
            p.error(str(e))
    if jax.default_backend() != "gpu":
        print("flash_gpu_blocks: needs the GPU backend (JAX_PLATFORMS=cuda)", file=sys.stderr)
        return 2
    harness.full_float32_on_gpu()
    result = {"machine": harness.machine_info(), "shape": vars(a) | {"out": None}, "rows": []}
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v, w = _inputs(a.B, a.L, a.H, a.D, dtype)

        def fwd(blocks):
            return jax.jit(lambda q, k, v: flash_gpu.flash_attention(q, k, v, blocks=blocks))

        def fwd_bwd(blocks, fn=None):
            f = fn or (lambda q, k, v: flash_gpu.flash_attention(q, k, v, blocks=blocks))
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * w).astype(jnp.float32)),
                                    (0, 1, 2)))

        name = jnp.dtype(dtype).name
        rows = [{"dtype": name, "what": "default", "fwd_ms": _time(fwd(None), (q, k, v)),
                 "fwd_bwd_ms": _time(fwd_bwd(None), (q, k, v)),
                 "blocks": flash_gpu.default_blocks(dtype, a.D)}]
        xla = lambda q, k, v: chunked.chunked_attention(q, k, v, impl="xla")  # noqa: E731
        rows.append({"dtype": name, "what": "chunked (xla)",
                     "fwd_bwd_ms": _time(fwd_bwd(None, xla), (q, k, v))})
        for bq, bk, warps, stages in FWD:
            blocks = dict(fwd_q=bq, fwd_k=bk, fwd_warps=warps, fwd_stages=stages)
            rows.append({"dtype": name, "what": "fwd", "blocks": blocks,
                         "fwd_ms": _time(fwd(blocks), (q, k, v))})
        for outer, inner, warps, stages in BWD:
            blocks = dict(bwd_outer=outer, bwd_inner=inner, bwd_warps=warps, bwd_stages=stages)
            rows.append({"dtype": name, "what": "fwd+bwd", "blocks": blocks,
                         "fwd_bwd_ms": _time(fwd_bwd(blocks), (q, k, v))})
        torch = harness.torch_or_none()
        if torch is not None:
            dev = harness.torch_device(torch)
            tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
            tq, tk, tv = (torch.randn(a.B, a.H, a.L, a.D, device=dev, dtype=tdt,
                                      requires_grad=True) for _ in range(3))
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def step():  # fresh gradients, as jax's (`.backward()` added into .grad)
                return torch.autograd.grad(sdpa(tq, tk, tv).sum(), (tq, tk, tv))

            t, _ = harness.time_torch(torch, dev, step, repeats=20, min_time_s=0.3)
            rows.append({"dtype": name, "what": "torch sdpa",
                         "fwd_bwd_ms": round(t.median_s * 1e3, 4)})
        for r in rows:
            print(json.dumps(r), flush=True)
        result["rows"] += rows
        # after each dtype (review r6: a sweep cut off by the budget lost every row)
        if a.write:
            _write_tuned(result["rows"], a.D)
        if a.out:  # a sweep cut off after float32 is written beside the record, not over it
            # (a review, session 117: it replaced the committed two-dtype blocks.json)
            os.makedirs(a.out, exist_ok=True)
            stem = os.path.join(a.out, "blocks" if a.D == 64 else f"blocks_d{a.D}")
            whole = dtype == jnp.bfloat16
            write_json(stem + (".json" if whole else ".partial.json"), result)
            if whole and os.path.exists(stem + ".partial.json"):
                os.remove(stem + ".partial.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
