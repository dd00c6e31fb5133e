"""The `Index` interface every search method shares, its file format, and its checks.

An index holds vectors of one dimension, numbered 0, 1, 2, ... in the order they were
added, and answers maximum-inner-product queries: `search(Q_QxD, k)` -> (scores [Q, k]
float32 best first, ids [Q, k] int64). Ties rank the lower id first everywhere, so the
exact indexes agree with a brute-force `numpy` sort to the last id. (For cosine
similarity, add and query unit vectors.) The kinds that build a structure from the vectors
themselves (`ivf`, the faiss kinds, `scann`: `METRICS` holds "l2") also take the option
`metric="l2"`: the nearest vectors by Euclidean distance, scored by minus its square (best
first still), where L2 through inner product (the kNN-LM's keys [k, |k|^2]) would build
their cells or graph on the wrong geometry.

On disk an index is a folder: `index.json` (format, version, kind, dimension, count and
the options it was built with) beside the method's own arrays or library file. `load`
reads the header first and refuses a folder of another format version, kind or
dimension in one line, before anything large is read.

Shape letters: N database vectors, Q queries, D dimension, K results per query.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from hpnlp.paths import write_json
from hpnlp.registry import Registry

FORMAT = "hpnlp.retrieval.index"
VERSION = 1
HEADER = "index.json"

_registry = Registry("index")
register, names = _registry.register, _registry.names


def get(name: str) -> type:
    return _registry.get(name)


_MAX_SQUARED_NORM = float(np.finfo(np.float32).max) / 4  # inner products stay finite
_FLOAT16_MAX = float(np.finfo(np.float16).max)


class RetrievalError(ValueError):
    """Bad input to an index (wrong dimension, k too large, a foreign file): one line
    naming what was wrong and the fix."""


def check_metric_option(index) -> None:
    """One line for a `metric` option `index` does not serve (its class's `METRICS`)."""
    metric = index.options.get("metric", "ip")
    if metric not in index.METRICS:
        raise RetrievalError(f"{index.registry_name} index: metric={metric!r}; use one of "
                             f"{index.METRICS} ('ip': inner product, 'l2': Euclidean)")


def _floating(dtype) -> bool:
    """numpy's floats, and ml_dtypes' (jax's bfloat16, float8_*), which numpy files under no
    kind of number (kind "V"); numpy alone, so that this module needs no jax."""
    if dtype.kind != "V":
        return dtype.kind == "f"
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:  # a void, or ml_dtypes' int4
        return False
    return True


def check_at_least(index, at_least: dict) -> None:
    """One line for an option of `index` that is not an integer >= its least value
    (`at_least`: name -> least), before anything is built or handed to a library."""
    for name, least in at_least.items():
        v = index.options[name]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
            raise RetrievalError(f"{index.registry_name} index: {name}={v!r}; give an integer "
                                 f">= {least}")
        index.options[name] = int(v)  # a numpy integer, stored as one, failed save's json


class Index(abc.ABC):
    """Base class: dimension and count checks, the header, `save`.

    Subclasses implement `_add(X_NxD float32)`, `_search(Q_QxD float32, k)`,
    `_save_files(folder)` (everything but the header) and `_restore(folder, header)`.
    """

    registry_name = "index"
    METRICS: tuple[str, ...] = ("ip",)  # what its `metric` option may be ("ip" alone: none)
    keeps_added = False  # whether `_add` keeps the array it is given (`add` then copies the
    # caller's; faiss copies into its own)

    def __init__(self, dim: int, **options: Any):
        # a review (session 118): int(dim) alone took 128.7 as 128 and True as 1
        whole = (not isinstance(dim, bool) and float(dim).is_integer()
                 if isinstance(dim, (int, float, np.integer, np.floating)) else False)
        if not whole or int(dim) <= 0:
            raise RetrievalError(f"index dimension {dim!r} must be a positive integer")
        self.dim = int(dim)
        self.options = options
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}(dim={self.dim}, count={self.count}{', ' if opts else ''}{opts})"

    # -- checks -------------------------------------------------------------------------
    def _vectors(self, x, what: str) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim == 1:
            x = x[None]
        if x.ndim != 2 or x.shape[1] != self.dim:  # (a bug hunt: a 0-d array failed in here,
            # and 3-d ones were told to rebuild the index with the dimension it has)
            other = f", or rebuild the index with dim={x.shape[1]}" if x.ndim == 2 else ""
            raise RetrievalError(f"{what} of shape {tuple(np.shape(x))} do not fit this {self.registry_name!r} "
                              f"index of dimension {self.dim}; give [n, {self.dim}] arrays (the "
                              f"same encoder{other})")
        # a bug hunt (session 101): numpy does not count ml_dtypes' bfloat16 as floating, and
        # bfloat16 vectors were refused as not floating-point
        if not _floating(x.dtype) and not np.issubdtype(x.dtype, np.integer):
            raise RetrievalError(f"{what} have dtype {x.dtype}; give floating-point vectors")
        x = np.ascontiguousarray(x, np.float32)
        if not np.all(np.isfinite(x)):
            raise RetrievalError(f"{what} contain NaN or infinity (row {int(np.argmin(np.isfinite(x).all(1)))}); "
                              "search needs finite vectors")
        # a bug hunt: past this norm two vectors' inner product can overflow float32, and the
        # infinite scores were dropped as padding (no neighbours; ScaNN aborted the process)
        with np.errstate(over="ignore"):  # an overflow reads inf: refused all the same
            sq = np.einsum("nd,nd->n", x, x)
        if len(sq) and sq.max() > _MAX_SQUARED_NORM:
            row = int(sq.argmax())
            raise RetrievalError(f"{what} reach norm "
                                 f"{np.linalg.norm(x[row].astype(np.float64)):.3g} (row {row}), "
                                 f"past the {np.sqrt(_MAX_SQUARED_NORM):.3g} "
                                 "whose inner products float32 holds; scale them down (unit "
                                 "vectors for cosine similarity)")
        return x

    def check_build(self, n: int, *, first: int | None = None) -> None:
        """RetrievalError where this index, as its options stand, cannot be built here over
        `n` vectors added in pieces, the first of `first` (None: all n) of them: the line its
        build would give, said before the vectors are computed (review r10: the kNN-LM
        refused lists past its datastore's entries only once they were all computed). An
        index that any count fits does nothing."""

    def prepare(self) -> None:
        """Build what searches read now (trained cells, packed panels, a ScaNN searcher)
        rather than in the first search, so that the time counts as building; an index with
        nothing to build does nothing."""

    def add(self, vectors) -> None:
        """Append `vectors` [N, D]; they get ids count, count + 1, ..."""
        x = self._vectors(vectors, "vectors to add")
        if self.keeps_added and isinstance(vectors, np.ndarray) and np.may_share_memory(
                x, vectors):
            # a review (session 114): the index kept the caller's float32 array, and what it
            # builds later (blocks, panels, IVF cells) read whatever was written there since
            x = x.copy()
        top = float(np.abs(x).max()) if x.size else 0.0
        if self.options.get("dtype") == "float16" and top > _FLOAT16_MAX:  # a bug hunt: cast
            # to inf, then searched to no neighbours at all
            raise RetrievalError(f"vectors to add reach {top:.3g}, past float16's "
                                 f"{_FLOAT16_MAX:g}, which this index stores them as; use "
                                 "dtype='bfloat16' or 'float32', or scale them down")
        if len(x):
            self._add(x)
            self.count += len(x)

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-`k` inner products of each query: (scores [Q, K] float32, ids [Q, K] int64),
        best first; ties rank the lower id first (faiss may keep another of the ids tied
        at the k-th place). Where an approximate index's probes hold fewer than k vectors,
        the rest of the row is id -1 with score -inf, in every index."""
        q = self._vectors(queries, "queries")
        try:
            whole = not isinstance(k, bool) and int(k) == k
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole:
            raise RetrievalError(f"k={k!r}: give a whole number of results per query")
        k = int(k)
        if k <= 0:
            raise RetrievalError(f"k={k}: ask for at least one result")
        if self.count == 0:
            raise RetrievalError(f"this {self.registry_name!r} index is empty; add vectors before searching")
        if k > self.count:
            raise RetrievalError(f"k={k} is larger than the {self.count} vectors in this "
                              f"{self.registry_name!r} index; ask for k <= {self.count} or add vectors")
        scores, ids = self._search(q, k)
        scores, ids = np.array(scores, np.float32), np.array(ids, np.int64)
        # a bug hunt: ScaNN pads with id 0 and a NaN score, faiss with -1 and -3.4e38, and the
        # padding was taken as neighbours (a kNN-LM perplexity of NaN)
        pad = (ids < 0) | ~np.isfinite(scores)
        ids[pad], scores[pad] = -1, -np.inf
        return scores, ids

    # -- files --------------------------------------------------------------------------
    def header(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "kind": self.registry_name,
                "dim": self.dim, "count": self.count, "options": self.options}

    def save(self, folder: str) -> str:
        """Write the index to `folder` (created); returns the folder."""
        os.makedirs(folder, exist_ok=True)
        # what can still fail, before an index already saved there loses its header (a
        # review, session 116: IVF's cells trained, and refused, only in `_save_files`)
        self._ready_to_save()
        json.dumps(self.header())
        if os.path.exists(os.path.join(folder, HEADER)):  # a bug hunt: a save cut off over an
            os.remove(os.path.join(folder, HEADER))  # index loaded its old header, new vectors
        self._save_files(folder)
        write_json(os.path.join(folder, HEADER), self.header())  # last: a folder with one is whole
        return folder

    @classmethod
    def searches_l2(cls, options: dict) -> bool:
        """Whether an index of these `options` takes `metric="l2"` (the kNN-LM's L2 by the
        index's own metric; otherwise through inner product)."""
        return "l2" in cls.METRICS

    @classmethod
    def options_here(cls, options: dict, folder: str) -> dict:
        """The saved `options` of an index loaded from `folder`, adjusted to this machine
        where one is a layout rather than data (the exact index's `shards`)."""
        return options

    def _ready_to_save(self) -> None:
        """Build what `_save_files` writes where that can fail (cells trained, a searcher
        built): `save` calls it before it removes the header of an index already there."""

    @abc.abstractmethod
    def _save_files(self, folder: str) -> None: ...

    @abc.abstractmethod
    def _restore(self, folder: str, header: dict) -> None: ...

    @abc.abstractmethod
    def _add(self, x_ND: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _search(self, q_QD: np.ndarray, k: int): ...


class HostIndex(Index):
    """An index that keeps the added vectors on the host and builds what it searches from
    them on demand (`vectors()`); `_stale(x_ND)` is told of every add. Saved as
    `arrays.npz`: the vectors and whatever `_arrays()` adds; `_restored(npz)` reads those."""

    keeps_added = True

    def __init__(self, dim: int, **options: Any):
        super().__init__(dim, **options)
        self._host: list[np.ndarray] = []

    def _add(self, x_ND):
        self._host.append(x_ND)
        self._stale(x_ND)

    def _stale(self, x_ND) -> None:
        """Called after `x_ND` was appended: drop (or extend) what was built."""

    def vectors(self) -> np.ndarray:
        """All vectors [N, D] in id order."""
        if len(self._host) > 1:
            self._host = [np.concatenate(self._host)]
        return self._host[0] if self._host else np.zeros((0, self.dim), np.float32)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"vectors": self.vectors()}

    def _save_files(self, folder: str) -> None:
        np.savez(os.path.join(folder, "arrays.npz"), **self._arrays())

    def _restore(self, folder: str, header: dict) -> None:
        with np.load(os.path.join(folder, "arrays.npz")) as f:
            self._host = [f["vectors"]]
            self._restored(f)
        if self._host[0].shape != (header["count"], self.dim):
            raise RetrievalError(f"{folder}: arrays.npz holds vectors of shape "
                                 f"{self._host[0].shape}, the header {header['count']} of "
                                 f"dimension {self.dim}; save the index again")

    def _restored(self, npz) -> None:
        """Read what `_arrays` added to the vectors."""


def read_header(folder: str, *, dim: int | None = None, kind: str | None = None) -> dict:
    path = os.path.join(folder, HEADER)
    if not os.path.isfile(path):
        raise RetrievalError(f"{folder}: no {HEADER}; not a saved hpnlp index, or its save was "
                             "cut off (save one with index.save(folder))")
    try:
        with open(path) as f:
            header = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RetrievalError(f"{path}: unreadable index header ({e}); save the index again") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise RetrievalError(f"{path}: format {header.get('format')!r} version {header.get('version')!r}; "
                          f"this hpnlp reads {FORMAT!r} version {VERSION}: rebuild the index "
                          "with this version")
    if dim is not None and header.get("dim") != dim:
        raise RetrievalError(f"{path}: an index of dimension {header.get('dim')}, but dimension {dim} "
                          "was asked for; load the index built from this encoder, or rebuild it")
    if kind is not None and header.get("kind") != kind:
        raise RetrievalError(f"{path}: a {header.get('kind')!r} index, not {kind!r}")
    return header


def load(folder: str, *, dim: int | None = None, kind: str | None = None) -> Index:
    """The index saved in `folder`; `dim` / `kind`, when given, must match its header."""
    header = read_header(folder, dim=dim, kind=kind)
    cls = get(header["kind"])
    options = header.get("options", {})
    try:  # a bug hunt (session 101): an edited or foreign option was a TypeError traceback
        index = cls(header["dim"], **cls.options_here(options, folder))
    except RetrievalError as e:
        # a bug hunt (session 101): the index's own line (a library to install, options it
        # refuses together) was reworded as foreign options, "save the index again"
        raise RetrievalError(f"{os.path.join(folder, HEADER)}: {e}") from None
    except (TypeError, ValueError) as e:
        raise RetrievalError(f"{os.path.join(folder, HEADER)}: options {options!r} are not "
                             f"those of a {header['kind']!r} index ({e}); save the index "
                             "again") from None
    try:  # a bug hunt: a truncated file was BadZipFile, or the library's own error
        index._restore(folder, header)
    except RetrievalError:
        raise
    except Exception as e:  # noqa: BLE001 -- numpy, zipfile, faiss, ScaNN: each its own
        raise RetrievalError(f"{folder}: the saved index is damaged or incomplete "
                             f"({type(e).__name__}: {e}); save it again") from None
    index.count = int(header["count"])
    return index


def make(name: str, dim: int, **options) -> Index:
    """A new empty index of the registered `name` (see `names()`)."""
    return get(name)(dim, **options)
