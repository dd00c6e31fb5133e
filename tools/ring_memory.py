"""Ring attention's compiled memory per device, forward and gradient, against `chunked`.

    python tools/ring_memory.py [--devices 4] [--lengths 1024 2048 4096 8192]

Compiles (does not run) `hpnlp.attention.ring.ring_attention` on simulated CPU devices
(one batch row, one head of width 16, causal) and prints XLA's temporary bytes per device
of the forward and of the gradient with respect to q, k and v, beside `chunked` (impl='xla')
and `dense` on one device at the same length. The ring's backward pass is a second trip
around the ring (a custom VJP); before it (session 99's bug hunt), autodiff of the loop kept
every step's [L/n, L/n] scores: 326 MB per device at L=8192 on 4 devices, where the forward
holds 34 MB. Each ring step now goes a tile at a time (`block`, default up to 1024 x 1024;
session 100): at L=16384 the forward fell from 135.9 MB to 9.9, the gradient from 337.7 to
22.6. tests/test_attention_ring.py checks the gradient stays under 4x the forward and that
small tiles take under a quarter of one whole step's memory. `--block B` sets the tile.
"""

from __future__ import annotations

import argparse
import os
import sys

from ablib import at_least  # (imports JAX; its devices are made only after the flags below)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (review r6: 0 was a ZeroDivisionError, -1 reached XLA as a device count)
    ap.add_argument("--devices", type=at_least(1), default=4)
    ap.add_argument("--lengths", type=at_least(1), nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--block", type=int, default=None,
                    help="each ring step's tile (a divisor of L / devices); default: chosen")
    args = ap.parse_args(argv)
    for L in args.lengths:  # every setting checked before the first compile (a bug hunt,
        # session 101: a bad --block ended in a traceback from inside the first one)
        if L % args.devices:
            sys.exit(f"--lengths {L}: must divide into --devices {args.devices}")
        if args.block is not None and (args.block <= 0 or (L // args.devices) % args.block):
            sys.exit(f"--block {args.block}: must be a positive divisor of each device's "
                     f"L / devices = {L // args.devices} positions for --lengths {L}")
    from hpnlp.compile_flags import with_flags  # (review d2: appended after a bare token such
    # as intra_op_parallelism_threads=1, XLA never read the count, and the mesh failed)
    try:
        os.environ["XLA_FLAGS"] = with_flags(
            os.environ.get("XLA_FLAGS", ""),
            [f"--xla_force_host_platform_device_count={args.devices}"])
    except ValueError as e:  # a flags file's name: XLA_FLAGS=... says what to do instead
        sys.exit(str(e))
    from hpnlp import xla_workarounds
    xla_workarounds.apply()  # again for the simulated devices (a review, session 117: applied
    # at `import hpnlp` for one, it left JAX's persistent compilation cache on)
    import jax
    if "JAX_PLATFORMS" not in os.environ:  # (JAX read the variable when ablib imported it)
        jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hpnlp.attention.chunked import chunked_attention
    from hpnlp.attention.dense import dense_attention
    from hpnlp.attention.ring import ring_attention

    mesh = Mesh(np.asarray(jax.devices()).reshape(args.devices), ("sequence",))

    def temp_mb(loss, x):
        fwd = jax.jit(loss).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
        grad = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
        return fwd / 1e6, grad.memory_analysis().temp_size_in_bytes / 1e6

    print(f"temporary MB per device ({args.devices} simulated devices for ring; B=1, H=1, D=16, "
          "causal)")
    print("| L | ring fwd | ring grad | chunked (xla) fwd | chunked grad | dense fwd | dense grad |")
    print("|---|---|---|---|---|---|---|")
    for L in args.lengths:
        sharded = jax.ShapeDtypeStruct((1, L, 1, 16), jnp.float32,
                                       sharding=NamedSharding(mesh, P(None, "sequence")))
        one = jax.ShapeDtypeStruct((1, L, 1, 16), jnp.float32)
        ring = temp_mb(lambda q, k, v: jnp.sum(ring_attention(q, k, v, None, causal=True,
                                                              mesh=mesh, block=args.block)),
                      sharded)
        chunked = temp_mb(lambda q, k, v: jnp.sum(chunked_attention(q, k, v, None, causal=True,
                                                                    impl="xla")), one)
        dense = temp_mb(lambda q, k, v: jnp.sum(dense_attention(q, k, v, causal=True)), one)
        print(f"| {L} | " + " | ".join(f"{x:.1f}" for x in (*ring, *chunked, *dense)) + " |")


if __name__ == "__main__":
    main()
