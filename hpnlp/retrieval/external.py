"""Adapters to the search libraries people already use, behind hpnlp's `Index` interface:
faiss (`faiss-cpu`: flat, IVF, HNSW) and ScaNN (Guo et al. 2020: partitioning +
anisotropic quantization + reordering), by inner product, or (`metric="l2"`) by the
library's own Euclidean distance on the raw vectors, scored by minus its square. Each is
registered only in name when its library is missing; building one then says what to install.
"""

from __future__ import annotations

import abc
import os
import re

import numpy as np

from hpnlp.retrieval.base import (HostIndex, Index, RetrievalError, check_at_least,
                                  check_metric_option, register)


def _import(module: str, package: str):
    try:
        return __import__(module)
    except ImportError:
        raise RetrievalError(f"this index needs {package}: pip install {package} "
                             "(or pip install -e .[retrieval])") from None


def available(name: str) -> bool:
    """Whether the library behind index `name` imports here."""
    module = {"faiss": "faiss", "scann": "scann"}.get(name.split("_")[0])
    if module is None:
        return True
    try:
        __import__(module)
        return True
    except ImportError:
        return False


# faiss aborts the process on an HNSW m < 2, and a search width of 0 returns ids of -1
# (faiss) or NaN scores (ScaNN) instead of failing: each option is checked before the
# library sees it (`check_at_least`)


def _ties_by_id(scores_QK, ids_QK):
    """Rows re-ordered by (score desc, id asc), the order every index promises (faiss and
    ScaNN rank tied scores by the higher id first); padding (id -1) is made last by `search`."""
    scores_QK, ids_QK = np.asarray(scores_QK), np.asarray(ids_QK)
    key = np.where(np.isnan(scores_QK), -np.inf, scores_QK)  # ScaNN's padding
    order = np.lexsort((np.where(ids_QK < 0, np.iinfo(np.int64).max, ids_QK), -key), axis=-1)
    return (np.take_along_axis(scores_QK, order, axis=-1),
            np.take_along_axis(ids_QK, order, axis=-1))


class _Faiss(Index):
    """A faiss index with METRIC_INNER_PRODUCT, or METRIC_L2 (option `metric="l2"`); faiss
    numbers vectors in add order too."""

    # a bug hunt (session 101): the kNN-LM's L2 through inner product (keys [k, |k|^2]) built
    # HNSW's graph on k.k' + |k|^2 |k'|^2, whose links do not follow L2 neighbours (recall@16
    # 0.002 against exact), and IVF's cells likewise; faiss's own L2 on the raw keys instead
    METRICS = ("ip", "l2")
    AT_LEAST: dict = {}  # each option's least value, checked before `_build` (a review,
    # session 118: HNSW's m was checked after faiss built with it, and m < 0 made faiss's
    # level probabilities NaN, so its constructor looped, allocating, without end)

    def __init__(self, dim: int, **options):
        super().__init__(dim, **options)
        check_metric_option(self)
        check_at_least(self, self.AT_LEAST)
        self.faiss = _import("faiss", "faiss-cpu")
        self.index = self._build()

    def _metric(self):
        return (self.faiss.METRIC_L2 if self.options.get("metric") == "l2"
                else self.faiss.METRIC_INNER_PRODUCT)

    @abc.abstractmethod
    def _build(self):
        """The faiss index for `self.options` (None: made at the first add)."""

    def _add(self, x_ND):
        if not self.index.is_trained:
            self.index.train(x_ND)
        self.index.add(x_ND)

    def _search(self, q_QD, k):
        self._tune()
        d, ids = self.index.search(q_QD, k)
        return _ties_by_id(-d if self.options.get("metric") == "l2" else d, ids)

    def _tune(self) -> None:
        pass

    def _save_files(self, folder):
        self.faiss.write_index(self.index, os.path.join(folder, "faiss.index"))

    def _restore(self, folder, header):
        self.index = self.faiss.read_index(os.path.join(folder, "faiss.index"))
        if self.index.d != self.dim or self.index.ntotal != header["count"]:
            raise RetrievalError(f"{folder}: faiss.index holds {self.index.ntotal} vectors of dimension "
                                 f"{self.index.d}, the header {header['count']} of {self.dim}; save it again")


@register("faiss_flat")
class FaissFlat(_Faiss):
    """faiss IndexFlatIP (IndexFlatL2 for `metric="l2"`): exact brute force (BLAS products +
    heaps)."""

    # a bug hunt (session 101): it took any option and ignored it
    def __init__(self, dim: int, *, metric: str = "ip"):
        super().__init__(dim, metric=metric)

    def _build(self):
        return self.faiss.IndexFlat(self.dim, self._metric())


def _check_first_add(lists: int, first: int) -> None:
    """One line where faiss_ivf's `lists` cells are more than the `first` add's vectors."""
    if lists > first:
        raise RetrievalError(f"faiss_ivf index: lists={lists} cells but the first add has "
                             f"only {first} vectors to train them on; use lists <= "
                             f"{first} or add more vectors at once")


@register("faiss_ivf")
class FaissIVF(_Faiss):
    """faiss IndexIVFFlat: cells of faiss's k-means, assigned and scanned by inner product
    (`metric="l2"`: by L2). Options: `lists` (cells; 0: min(N // 39, round(4 sqrt(N))), at
    least 1, for the N vectors of the first add: faiss's k-means asks 39 per cell), `nprobe`
    cells scanned per query, `metric`."""

    AT_LEAST = {"lists": 0, "nprobe": 1}

    def __init__(self, dim: int, *, lists: int = 0, nprobe: int = 16, metric: str = "ip"):
        super().__init__(dim, lists=lists, nprobe=nprobe, metric=metric)

    def _build(self):
        return None  # the cell count may depend on the first add

    def _add(self, x_ND):
        if self.index is None:
            lists = self.options["lists"] or int(max(1, min(len(x_ND) // 39, round(4 * np.sqrt(len(x_ND))))))
            _check_first_add(lists, len(x_ND))
            self.options["lists"] = lists
            quantizer = self.faiss.IndexFlat(self.dim, self._metric())
            self.index = self.faiss.IndexIVFFlat(quantizer, self.dim, lists, self._metric())
            self._quantizer = quantizer  # faiss does not own it from Python
        super()._add(x_ND)

    def check_build(self, n: int, *, first: int | None = None) -> None:
        """`Index.check_build`: `lists` cells past the first add's vectors, which faiss
        trains them on."""
        if self.options["lists"]:
            _check_first_add(self.options["lists"], n if first is None else first)

    def _tune(self):
        self.index.nprobe = int(self.options["nprobe"])

    def _save_files(self, folder):
        if self.index is not None:  # None until the first add: nothing to write
            super()._save_files(folder)

    def _restore(self, folder, header):
        if header["count"]:
            super()._restore(folder, header)


@register("faiss_hnsw")
class FaissHNSW(_Faiss):
    """faiss IndexHNSWFlat (Malkov & Yashunin 2018). Options: `m` links per node,
    `ef_construction`, `ef_search` (the recall/speed knob), `metric`."""

    AT_LEAST = {"m": 2, "ef_construction": 1, "ef_search": 1}

    def __init__(self, dim: int, *, m: int = 32, ef_construction: int = 80, ef_search: int = 64,
                 metric: str = "ip"):
        super().__init__(dim, m=m, ef_construction=ef_construction, ef_search=ef_search,
                         metric=metric)

    def _build(self):
        index = self.faiss.IndexHNSWFlat(self.dim, int(self.options["m"]), self._metric())
        index.hnsw.efConstruction = int(self.options["ef_construction"])
        return index

    def _tune(self):
        self.index.hnsw.efSearch = int(self.options["ef_search"])


_SCANN_AH_CENTERS = 16  # ScaNN's asymmetric hashing: centres per block, each needs a vector


def _check_scann(n: int, leaves: int) -> None:
    """One line where ScaNN cannot be built over `n` vectors into `leaves` leaves."""
    if n < _SCANN_AH_CENTERS:  # a bug hunt: ScaNN's RuntimeError, or (from the kNN-LM or a
        # TextSearch) a traceback
        raise RetrievalError(f"scann index: its hashing trains {_SCANN_AH_CENTERS} centres "
                             f"per block on the vectors added, and it holds {n}; add "
                             f"at least {_SCANN_AH_CENTERS}, or use 'exact' for so few")
    if leaves > n:
        raise RetrievalError(f"scann index: leaves={leaves} but only {n} vectors to "
                             f"partition; use leaves <= {n} (or 0: chosen from the count) "
                             "or add more vectors")


@register("scann")
class ScaNN(HostIndex):
    """ScaNN's tree (partitioning) + asymmetric hashing + exact reordering, dot product
    (`metric="l2"`: squared L2). Built on the first search from everything added (ScaNN
    indexes are not incremental). Options: `leaves` (0: min(N // 100, round(2 sqrt(N))),
    at least 1, chosen again at each build for the N vectors added so far), `leaves_to_search`,
    `reorder` candidates rescored exactly (on the LM's context vectors, which are far from
    unit norm, recall@10 is set by `reorder`: 0.46 at 100, 0.96 at 1000 on 20K of them,
    whatever the leaves searched), `metric`."""

    METRICS = ("ip", "l2")  # (a bug hunt, session 101: see _Faiss)

    def __init__(self, dim: int, *, leaves: int = 0, leaves_to_search: int = 32, reorder: int = 100,
                 metric: str = "ip"):
        super().__init__(dim, leaves=leaves, leaves_to_search=leaves_to_search, reorder=reorder,
                         metric=metric)
        check_at_least(self, {"leaves": 0, "leaves_to_search": 1, "reorder": 1})
        check_metric_option(self)
        self.scann = _import("scann", "scann")
        self.searcher = None
        self._leaves = None  # the searcher's leaf count (`_chosen_leaves` of its build's N)

    def _stale(self, x_ND):
        self.searcher = None

    def _chosen_leaves(self, n: int) -> int:
        """The leaf count of a build over `n` vectors: the `leaves` option, or (0) one chosen
        from n."""
        return self.options["leaves"] or int(max(1, min(n // 100, round(2 * np.sqrt(n)))))

    def _build(self):
        x = self.vectors()
        o = self.options
        # review r1: the count chosen for leaves=0 was written over the option, so every
        # rebuild after more adds (and a reload, from index.json) kept the first build's count
        leaves = self._chosen_leaves(len(x))
        _check_scann(len(x), leaves)
        self._leaves = leaves
        builder = self.scann.scann_ops_pybind.builder(
            x, 10, "squared_l2" if o.get("metric") == "l2" else "dot_product")
        builder = builder.tree(num_leaves=leaves, num_leaves_to_search=min(o["leaves_to_search"], leaves),
                               training_sample_size=min(len(x), 250_000))
        # a bug hunt (session 101): the anisotropic loss (Guo et al. 2020) weighs the error
        # along each vector for inner products; ScaNN's builder refuses it on the partition
        # for any other distance ("AVQ only applies to dot product distance"), and
        # ann-benchmarks' ScaNN runs set 0.2 for dot_product, NaN (off) for squared_l2
        aq = float("nan") if o.get("metric") == "l2" else 0.2
        builder = builder.score_ah(2, anisotropic_quantization_threshold=aq)
        self.searcher = builder.reorder(o["reorder"]).build()

    def check_build(self, n: int, *, first: int | None = None) -> None:
        """`Index.check_build`: fewer vectors than its hashing trains on, or `leaves` past
        them (ScaNN builds from all of them)."""
        _check_scann(n, self.options["leaves"])

    def prepare(self) -> None:
        if self.searcher is None:
            self._build()

    def _search(self, q_QD, k):
        if self.searcher is None:
            self._build()
        if not len(q_QD):  # ScaNN raises on no queries; every other index returns [0, k]
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        o = self.options
        ids, scores = self.searcher.search_batched(q_QD, final_num_neighbors=k,
                                                   leaves_to_search=min(o["leaves_to_search"],
                                                                        self._leaves),
                                                   pre_reorder_num_neighbors=max(o["reorder"], k))
        return _ties_by_id(-scores if o.get("metric") == "l2" else scores, ids)

    def _ready_to_save(self) -> None:
        if self.count and self.searcher is None:
            self._build()

    def _save_files(self, folder):
        """The vectors (so that a reloaded index can take more) and the built searcher
        (none while empty: ScaNN cannot build one from no vectors)."""
        if not self.count:
            return super()._save_files(folder)
        self._ready_to_save()
        super()._save_files(folder)
        path = os.path.join(folder, "scann")
        os.makedirs(path, exist_ok=True)
        # a bug hunt (session 98): ScaNN wrote absolute asset paths, so a moved folder would
        # not load and a copy searched the first folder's partition and codes (other ids);
        # relative ones are read from the folder the searcher is loaded from
        self.searcher.serialize(path, relative_path=True)

    def _restore(self, folder, header):
        super()._restore(folder, header)
        if header["count"]:
            path = os.path.join(folder, "scann")
            _check_own_assets(folder, path)
            self.searcher = self.scann.scann_ops_pybind.load_searcher(path)
            # saved over all `count` vectors (`_save_files` builds a stale searcher first)
            self._leaves = self._chosen_leaves(header["count"])


def _check_own_assets(folder: str, path: str) -> None:
    """Refuses a searcher saved (by an hpnlp before session 98) with absolute asset paths
    into another folder than its own: ScaNN would read that folder's files, no error."""
    try:
        with open(os.path.join(path, "scann_assets.pbtxt")) as f:
            assets = re.findall(r'asset_path:\s*"([^"]*)"', f.read())
    except OSError:
        return  # ScaNN's load says what is missing
    own = os.path.realpath(path)
    for asset in assets:
        if os.path.isabs(asset) and os.path.realpath(os.path.dirname(asset)) != own:
            raise RetrievalError(f"{folder}: saved by an older hpnlp with absolute paths into "
                                 f"{os.path.dirname(os.path.dirname(asset))}, not its own "
                                 "folder (ScaNN would search that folder's index); build the "
                                 "index again and save it")
