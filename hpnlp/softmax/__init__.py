"""Output layers over large vocabularies, chosen by name.

Every method is a `flax.linen.Module` constructed with `vocab_size=V` and offering
`loss(hidden, targets, mask, *, deterministic)` (per-token loss, zero where `mask` is 0),
`log_prob(hidden)` (normalized log-probabilities over the vocabulary) and
`top_k(hidden, k)`. Call them with `module.apply(vars, ..., method="loss")`.
`nll_and_argmax(layer, hidden, targets)` is what evaluation reads of `log_prob`, token-chunked
where the layer can (not yet adaptive, hierarchical, binary_code: their whole [N, V]);
`trains_nll(name)` says whether a layer's `loss` is -log p(target).
"""

from hpnlp.softmax.base import (Frequencies, can_tie, check_config, frequencies, get, map_token_chunks,  # noqa: F401
                                layout_options, names, nll_and_argmax, register, trains_nll)
from hpnlp.softmax import adaptive, binary_code, full, sampled, tree, vmf  # noqa: F401  (registration side effects)
