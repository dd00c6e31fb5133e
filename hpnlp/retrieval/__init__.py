"""Retrieval and memory: vector indexes behind one interface, the kNN-LM.

    >>> import numpy as np
    >>> from hpnlp import retrieval
    >>> vectors_ND = np.random.default_rng(0).standard_normal((1000, 128), np.float32)
    >>> index = retrieval.make("exact", 128)  # or ivf, faiss_flat, faiss_ivf, faiss_hnsw, scann
    >>> index.add(vectors_ND)
    >>> scores_QK, ids_QK = index.search(vectors_ND[:3], k=10)
    >>> ids_QK.shape
    (3, 10)
    >>> folder = index.save("/tmp/hpnlp_idx"); index = retrieval.load(folder, dim=128)

Every index numbers vectors in add order and ranks ties by the lower id; `exact` and
`faiss_flat` are exact, the others approximate (recall against `exact` is what the
retrieval benchmark measures).

`hpnlp.retrieval.memory` is a key-value memory with ages (Kaiser et al. 2017, "Learning to
Remember Rare Events"): exact lookup, the margin loss and the update rule, as pure jittable
functions; the classifier uses it with `model.memory.size` > 0.
"""

from hpnlp.retrieval.base import Index, RetrievalError, get, load, make, names, read_header, register  # noqa: F401
from hpnlp.retrieval import exact, external, ivf  # noqa: F401  (registration side effects)
from hpnlp.retrieval.exact import blocked_top_k, exact_reference  # noqa: F401
from hpnlp.retrieval.external import available  # noqa: F401
