"""Attention variants behind one interface, chosen by name.

Every variant is a `flax.linen.Module` called as
`module(q_BLHD, k_BLHD, v_BLHD, mask, *, causal, deterministic) -> out_BLHD`, where `mask`
is `None` (no padding) or segment ids `[B, L]` int (0 = padding; tokens attend only within
their own segment, which covers both padding and packed sequences). No variant takes a
dense `[L, L]` mask: that would undo every memory saving.

    >>> import hpnlp.attention as A
    >>> A.names()                     # doctest: +SKIP
    ['dense', 'xla']
    >>> out = A.get("dense")()(q, k, v, seg, causal=True, deterministic=True)  # doctest: +SKIP
"""

from hpnlp.attention.base import (  # noqa: F401
    Attention, draws_features, register, registered, names, get)
from hpnlp.attention import (  # noqa: F401  (registration side effects)
    chunked, clustered, dense, kernel, linformer, lsh, ring, sinkhorn, sparse, synthesizer, xla)
