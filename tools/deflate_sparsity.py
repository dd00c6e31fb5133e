"""How much room the zeros of a pruned int8 weight take in a zip-deflated npz, as
`python -m hpnlp.compress quantize` writes its packed weights (README "Pruning").

A 512 x 512 matrix of Gaussian weights, quantized to int8 per column (absmax), its
smallest-magnitude entries set to zero at each sparsity; prints the compressed size over
the raw int8 bytes. Deterministic (seed 0).

    python tools/deflate_sparsity.py
"""

import io

import numpy as np


def deflated_share(sparsity: float, n: int = 512, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, n))
    q = np.clip(np.round(w / np.abs(w).max(0) * 127), -127, 127).astype(np.int8)
    q[np.abs(w) < np.quantile(np.abs(w), sparsity)] = 0  # magnitude pruning
    buf = io.BytesIO()
    np.savez_compressed(buf, w=q)
    return len(buf.getvalue()) / q.nbytes


if __name__ == "__main__":
    for s in (0.0, 0.5, 0.75, 0.9):
        print(f"{s:4.0%} zeros: {deflated_share(s):.2f} of the int8 bytes")
