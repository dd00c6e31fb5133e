"""XLA:CPU reads past the end of a padded operand (jaxlib 0.10.2, AVX-512 CPUs).

    python docs/repro/xla_cpu_pad_overread.py                      # SIGSEGV (exit 139) on an affected CPU
    XLA_FLAGS=--xla_cpu_max_isa=AVX2 python docs/repro/xla_cpu_pad_overread.py   # prints "ok"

A loop fusion `a + pad(b * 0.5 - 1, (0, 1024))` with `b` of 2048 floats loads `b` at every
one of the output's 3072 positions. To make the over-read fault every time rather than
now and then, `b` is placed so that it ends exactly at a page that cannot be read (an
mprotect'ed guard page) and handed to XLA without a copy (DLPack). No hpnlp code is
involved. See docs/xla_defects.md.
"""

import ctypes
import mmap

import jax
import jax.numpy as jnp
import numpy as np

N, EXTRA = 2048, 1024
PAGE = mmap.PAGESIZE


def guarded_floats(n: int):
    """n float32 ones that end exactly where an unreadable page begins (and the mapping)."""
    pages = -(-4 * n // PAGE)
    buf = mmap.mmap(-1, (pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if ctypes.CDLL(None).mprotect(ctypes.c_void_p(base + pages * PAGE), PAGE, 0) != 0:
        raise OSError("mprotect failed")
    x = np.frombuffer(buf, np.float32, count=n, offset=pages * PAGE - 4 * n)
    x[:] = 1.0
    return x, buf


if __name__ == "__main__":
    b_np, _mapping = guarded_floats(N)
    b = jax.dlpack.from_dlpack(b_np)  # zero-copy: XLA reads the guarded memory itself
    assert b.unsafe_buffer_pointer() == b_np.ctypes.data, "DLPack import copied the array"
    a = jnp.ones(N + EXTRA, jnp.float32)
    out = jax.jit(lambda a, b: a + jnp.pad(b * 0.5 - 1.0, (0, EXTRA)))(a, b)
    expected = np.concatenate([np.full(N, 0.5), np.ones(EXTRA)]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), expected)
    print("ok", jax.__version__, flush=True)
