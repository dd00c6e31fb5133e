"""kNN-LM (Khandelwal et al. 2020): interpolate a trained LM with a nearest-neighbour
distribution over a datastore of (context vector, next token) pairs from its training split.

    python -m hpnlp.retrieval knnlm --workdir TRAINED_LM --datastore DIR [--index exact]

1. **Datastore** (`build_datastore`): the trained LM reads its training split in order, one
   chunk per row from a fresh start: as training saw it for a Transformer LM however it was
   batched (a packed chunk attends within itself, its positions from 0), and for an LSTM/GRU
   LM trained on `data.batching='pad'`. An RNN LM trained on 'pack' (experiments/lm.py's
   default) read a short chunk with the state the chunks packed before it in its row left
   (hpnlp/models/recurrent.py), so its `lm_ppl` here, each chunk from a zero state, can
   differ a little from the run's own evaluation (review r11); the keys and the queries are
   read alike, so the kNN part is consistent. Every target token's context vector (the final
   hidden state the output layer reads) is a key, stored memory-mapped as float16
   (`keys.npy`, [N, E]), with the next token as its value (`values.npy`, int32).
   `datastore.json` names the model (a digest of its parameters, and the random-feature
   draw its passes read, `features_rngs`), so a datastore from another model is refused in
   one line.
2. **Search**: the keys go into any `hpnlp.retrieval` index. The paper's distance is L2:
   an index whose `METRICS` hold "l2" (`ivf`, faiss's, ScaNN's) searches the raw keys by
   its own `metric="l2"`; `exact` serves it by the usual augmentation, key [k, |k|^2]
   against query [2q, -1], whose inner product is |q|^2 - |q - k|^2 (a bug hunt (session
   101): the others built their cells or graph on those augmented keys, whose products the
   norms dominate: faiss_hnsw's recall@16 against exact was 0.002). Augmented keys stored
   below float32 (`exact` or `ivf` with dtype bfloat16 or float16) are refused: their |k|^2
   column loses its precision (`check_augmented_dtype`).
3. **Interpolation**: p(y) = lambda p_kNN(y) + (1 - lambda) p_LM(y), with p_kNN(y) the softmax
   of -distance / T over the k nearest keys, summed over those whose value is y. k, T and
   lambda are tuned on a validation half of the held-out chunks and reported on the other
   half; lambda = 0 is the LM exactly.

Shape letters: N datastore entries, E key width, T held-out tokens, K neighbours.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hpnlp import kernels
from hpnlp.paths import write_json
from hpnlp.progress import bar_interval
from hpnlp.retrieval.base import Index, RetrievalError, get, make

DATASTORE = "datastore.json"
VERSION = 1
METRICS = ("l2", "ip")
READ_ROWS = 1 << 20  # keys read from the memory map per add (`Datastore.index`)


def check_metric(metric: str) -> None:
    """Any metric but "l2" would otherwise be searched as "ip", silently."""
    if metric not in METRICS:
        raise RetrievalError(f"metric={metric!r}; choose 'l2' (the paper's) or 'ip'")


def own_l2(name: str, options: dict, metric: str) -> bool:
    """Whether index `name` with `options` serves the kNN-LM's `metric` by its own
    metric="l2" on the raw keys, rather than by inner product (keys [k, |k|^2] for L2)."""
    return metric == "l2" and get(name).searches_l2(options)


def check_augmented_dtype(name: str, options: dict, metric: str) -> None:
    """RetrievalError where the kNN-LM's L2 goes through keys [k, |k|^2] (not `own_l2`) into
    an index storing them below float32 (a bug hunt, session 107: the |k|^2 column, ~300 for
    an LM's context vectors, rounded by up to 0.6 in bfloat16, a weight e^0.6 at T = 1; and
    ivf's cells followed the norms, recall@8 0.31: what `ivf`'s own metric='l2' refuses)."""
    dtype = options.get("dtype", "float32")
    if metric == "l2" and dtype != "float32" and not own_l2(name, options, metric):
        cells = " (and its cells, fitted to them, follow the norms)" if name == "ivf" else ""
        raise RetrievalError(f"index_options dtype={dtype!r}: the {name!r} index serves the "
                             f"kNN-LM's L2 through keys [k, |k|^2], whose |k|^2 column loses "
                             f"its precision below float32{cells}; use dtype='float32'")


# -- the draw of a trained run's random features ---------------------------------------------

def reads_features(cfg) -> bool:
    """Whether a whole pass of `cfg`'s model reads the run's `features` stream: attention of
    random features (`Attention.random_features`) that draws them from it (Performer unless
    attention.options.redraw=False; LSH's rotations always) in a model with attention."""
    from hpnlp import attention
    from hpnlp.config.checks import RECURRENT_ARCHS
    return (cfg.model.arch not in RECURRENT_ARCHS
            and attention.draws_features(cfg.attention.name, cfg.attention.options))


def features_rngs(cfg, features_key, what: str) -> dict:
    """The rngs of a pass of `cfg`'s model outside training: {"features": features_key}, the
    draw its parameters trained with (`TrainState.features_key`), where the pass reads the
    run's `features` stream (`reads_features`); else {}. A RetrievalError where it reads it
    and no key is given: the attention would fall back to its seed's draw, one the parameters
    never trained with, and embed or score with another function, silently (a review, session
    106: the bi-encoder's pool evaluation, TextSearch and the kNN-LM did). As
    `hpnlp.models.generate.check_features_key`, but LSH too: decoding reads its cache by full
    attention, and a whole pass hashes by the stream's rotations."""
    if not reads_features(cfg):
        return {}
    if features_key is None:
        raise RetrievalError(f"attention.name={cfg.attention.name!r} draws its random features "
                             f"from the run's features stream, so {what} needs the draw it "
                             "trained with: pass features_key=state.features_key("
                             "cfg.train.feature_redraw_every) (knnlm.load_trained gives a run's)")
    return {"features": features_key}


def draw_id(features_key) -> str | None:
    """A short digest of a `features` key (the draw a datastore's keys came from); None: none."""
    if features_key is None:
        return None
    data = jnp.asarray(features_key)
    if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(data)
    return hashlib.sha1(np.ascontiguousarray(np.asarray(data)).tobytes()).hexdigest()[:16]


def check_draw(folder: str, header: dict, features_key) -> None:
    """RetrievalError where a datastore's keys came from another random-feature draw than the
    one `features_key` (None: a model that reads none) gives the queries."""
    have, want = header.get("features"), draw_id(features_key)
    if have != want:
        raise RetrievalError(f"{folder}: this datastore's keys come from the random-feature "
                             f"draw {have or 'of none'}, and this model's passes read "
                             f"{want or 'none'} (a Performer's draw moves every "
                             "train.feature_redraw_every steps; datastores of hpnlp before "
                             "session 106 read its seed's): pass the draw this model's passes "
                             "read (features_key=state.features_key(cfg.train."
                             "feature_redraw_every) for a model whose attention reads the run's "
                             "features stream, None for one that reads none; cfg=... filters "
                             "a run's key by its model), or build one for this run in a new "
                             "folder")


# -- the LM's context vectors ----------------------------------------------------------------

def ordered_batches(ex, *, rows: int, seq_len: int, select=None):
    """In-order LM batches of a split's chunks (one chunk per row from position 0, as
    `pad` batches them; `pack` shares a row, which only an RNN's state crosses), with the
    targets' flat positions. `select`: chunk indices to read (default all)."""
    chunks = np.arange(len(ex)) if select is None else np.asarray(select)
    for lo in range(0, len(chunks), rows):
        idx = chunks[lo:lo + rows]
        inputs = np.zeros((rows, seq_len), np.int32)
        targets = np.zeros((rows, seq_len), np.int32)
        seg = np.zeros((rows, seq_len), np.int32)
        for r, c in enumerate(idx):
            s, n = int(ex.starts[c]), int(ex.lengths[c])
            inputs[r, :n - 1] = ex.tokens[s:s + n - 1]
            targets[r, :n - 1] = ex.tokens[s + 1:s + n]
            seg[r, :n - 1] = 1
        pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
        yield {"inputs": inputs, "targets": targets, "segment_ids": seg, "positions": pos}


@functools.lru_cache(maxsize=8)
def _forward(model):
    """(params, batch, rngs=None) -> (hidden [B, L, E] float32, log p(target) [B, L]), jitted;
    one per model, so the datastore and both held-out halves share its compile; `rngs` from
    `features_rngs` (None: {}, a model that reads no draw)."""
    def run(module, batch):
        h_BLE = module.hidden(batch)
        logp_BLV = module.output.log_prob(h_BLE)
        return (h_BLE.astype(jnp.float32),
                jnp.take_along_axis(logp_BLV, batch["targets"][..., None], axis=-1)[..., 0])
    jitted = jax.jit(lambda params, batch, rngs: model.apply({"params": params}, batch,
                                                             method=run, rngs=rngs))
    return lambda params, batch, rngs=None: jitted(params, batch, rngs or {})


def params_digest(params) -> str:
    """A short digest of a model's parameters (which model made a datastore)."""
    h = hashlib.sha1()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(params)[0], key=lambda t: str(t[0])):
        h.update(str(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
    return h.hexdigest()[:16]


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True,
                mininterval=bar_interval(2.0))


def build_datastore(model, params, ex, folder: str, *, seq_len: int, rows: int = 64,
                    meta: dict | None = None, features_key=None) -> "Datastore":
    """Write the (key, value) datastore of split `ex` under `folder` (progress bar); keys
    float16 memory-mapped. Written to temporary names and renamed, so an interrupted build
    leaves no datastore that looks whole. `features_key`: the random-feature draw the model
    trained with, where its attention reads one (`features_rngs`)."""
    rngs = features_rngs(model.cfg, features_key, "the kNN-LM's datastore")
    os.makedirs(folder, exist_ok=True)
    n = int(np.sum(ex.lengths - 1))
    probe = next(ordered_batches(ex, rows=1, seq_len=seq_len, select=[0]))
    forward = _forward(model)
    width = int(forward(params, probe, rngs)[0].shape[-1])
    tmp = os.path.join(folder, "keys.tmp.npy")
    keys = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(n, width))
    values = np.empty((n,), np.int32)
    at = 0
    try:
        with _progress(n, "datastore") as bar:
            for batch in ordered_batches(ex, rows=rows, seq_len=seq_len):
                h_BLE, _ = forward(params, batch, rngs)
                real = batch["segment_ids"] > 0
                got = np.asarray(h_BLE)[real]
                keys[at:at + len(got)] = got.astype(np.float16)
                values[at:at + len(got)] = batch["targets"][real]
                at += len(got)
                bar.update(len(got))
        assert at == n, (at, n)
        keys.flush()
        del keys
        np.save(os.path.join(folder, "values.tmp.npy"), values)
    except BaseException:  # Ctrl-C included: no partial keys left (a README walk: 957 MB),
        # nor after the loop (a review, session 116: a stop in the flush or the values' save)
        for name in ("keys.tmp.npy", "values.tmp.npy"):
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))  # unlinked while mapped: freed after
        raise
    os.replace(os.path.join(folder, "keys.tmp.npy"), os.path.join(folder, "keys.npy"))
    os.replace(os.path.join(folder, "values.tmp.npy"), os.path.join(folder, "values.npy"))
    groups = routing_groups(model)
    header = {"format": "hpnlp.retrieval.datastore", "version": VERSION, "entries": n,
              "width": width, "model": params_digest(params),
              **({"features": draw_id(rngs["features"])} if rngs else {}),
              **({"routing_groups": groups} if groups else {}), **(meta or {})}
    write_json(os.path.join(folder, DATASTORE), header)  # whole, or absent
    return Datastore.open(folder)


def datastore_split(train, max_tokens: int = 0):
    """The training chunks a datastore holds: all of `train`, or (`max_tokens` > 0) its first
    chunks, up to the one that reaches `max_tokens` entries."""
    if not max_tokens:
        return train
    from hpnlp.data.task import Examples
    n = int(np.searchsorted(np.cumsum(train.lengths - 1), max_tokens)) + 1
    return Examples(train.tokens, train.starts[:n], train.lengths[:n])


def routing_groups(model) -> int | None:
    """The MoE routing groups `model` routes in where they are fixed (set, or pinned to the
    run's by `Trainer.split_model`), else None: a datastore's keys are that function's."""
    moe = model.cfg.model.moe
    return int(moe.groups) if moe.enabled() and moe.groups else None


def datastore_for(model, params, ex, folder: str, *, seq_len: int, meta: dict | None = None,
                  features_key=None):
    """(datastore, built): the one in `folder` if this model built it of split `ex` (another
    model's, one of another random-feature draw, or one of another number of entries, is
    refused), else a new one of `ex`."""
    rngs = features_rngs(model.cfg, features_key, "the kNN-LM's datastore")
    if not os.path.isfile(os.path.join(folder, DATASTORE)):
        from hpnlp.paths import hold_workdir
        # built holding the folder, looked at again once held (a review, session 117: two
        # calls building one new folder at once shared its temporary files, one truncating
        # the other's keys); a datastore written whole is read by any number at once
        release = hold_workdir(folder, busy="{workdir}: another process is building a "
                               "datastore here; wait for it to finish, or give another "
                               "--datastore folder")
        try:
            if not os.path.isfile(os.path.join(folder, DATASTORE)):
                return build_datastore(model, params, ex, folder, seq_len=seq_len, meta=meta,
                                       features_key=rngs.get("features")), True
        finally:
            release()
    return _opened(model, params, ex, folder, rngs), False


def _opened(model, params, ex, folder: str, rngs) -> "Datastore":
    """The datastore in `folder`, checked against this run's model and split (`datastore_for`)."""
    store = Datastore.open(folder, params=params, features_key=rngs.get("features"))
    want = int(np.sum(ex.lengths - 1))
    if store.header["entries"] != want:  # a README walk: a cap was silently ignored
        raise RetrievalError(
            f"{folder}: holds a datastore of {store.header['entries']:,} entries, and this "
            f"run asks for {want:,} (--max_datastore_tokens sets how many); give another "
            "--datastore folder, or delete this one to build it again")
    # (one group where none is recorded: a datastore built before session 116 routed in
    # one outside a mesh, as a model of no fixed groups does)
    recorded = store.header.get("routing_groups")
    theirs, mine = recorded or 1, routing_groups(model) or 1
    if theirs != mine:  # a review (session 116): a datastore built before the model was
        # pinned to the run's MoE routing groups holds another function's keys
        built = (f"in {theirs} MoE routing group(s)" if recorded else "in MoE routing "
                 "groups it does not record (built before session 116: one outside a mesh, "
                 "or model.moe.groups)")
        raise RetrievalError(
            f"{folder}: holds a datastore whose keys the model computed {built}, and this "
            f"run's model routes in {mine} (model.moe.groups, or the run's own); give "
            "another --datastore folder, or delete this one to build it again")
    return store


@dataclasses.dataclass
class Datastore:
    folder: str
    header: dict
    keys: np.ndarray  # [N, E] float16, memory-mapped
    values: np.ndarray  # [N] int32

    @classmethod
    def open(cls, folder: str, *, params=None, features_key=None, cfg=None) -> "Datastore":
        """Open the datastore in `folder`; with `params`, refuse one built by another model,
        or under another random-feature draw than `features_key`, the draw the model's
        passes read (`check_draw`): with `cfg` (the model's config), the run's key as
        `load_trained` gives it, whatever the model (`features_rngs` keeps it where the model
        reads one, refuses its absence by name); without, the key of a model that reads one,
        None for one that reads none."""
        path = os.path.join(folder, DATASTORE)
        if not os.path.isfile(path):
            raise RetrievalError(f"{folder}: no {DATASTORE}; build the datastore first "
                                 "(python -m hpnlp.retrieval knnlm --workdir RUN --datastore DIR)")
        try:  # a bug hunt (session 96): a cut file was a JSON error naming no file, and one
            # without its "model" a KeyError traceback
            with open(path) as f:
                header = json.load(f)
        except (OSError, ValueError) as e:
            raise RetrievalError(f"{path}: unreadable ({e}); delete the folder and build the "
                                 "datastore again") from None
        if not isinstance(header, dict):
            raise RetrievalError(f"{path}: not a datastore header (a JSON object); delete the "
                                 "folder and build the datastore again")
        if header.get("version") != VERSION:
            raise RetrievalError(f"{path}: datastore version {header.get('version')}, this hpnlp reads "
                                 f"{VERSION}; delete the folder and build it again")
        need = (("entries", int), ("width", int)) + ((("model", str),) if params is not None
                                                    else ())  # "model": checked against params
        lost = [k for k, t in need
                if not isinstance(header.get(k), t) or isinstance(header.get(k), bool)]
        if lost:
            raise RetrievalError(f"{path}: no valid {', '.join(repr(k) for k in lost)} in it; "
                                 "delete the folder and build the datastore again")
        if params is not None and header["model"] != params_digest(params):
            raise RetrievalError(f"{folder}: this datastore was built by another model (parameters "
                                 f"{header['model']}, from {header.get('workdir', '?')} step "
                                 f"{header.get('step', '?')}); build one for this run in a new folder")
        if params is not None:
            if cfg is not None:  # the diff review: a dense LM's run key was refused as a draw
                features_key = features_rngs(cfg, features_key,
                                             "the kNN-LM's datastore").get("features")
            check_draw(folder, header, features_key)
        # a bug hunt: a truncated file was numpy's error, naming neither the file nor the fix
        arrays = {}
        for name, mmap in (("keys", "r"), ("values", None)):
            try:
                arrays[name] = np.load(os.path.join(folder, f"{name}.npy"), mmap_mode=mmap)
            except (OSError, ValueError, EOFError) as e:
                raise RetrievalError(f"{os.path.join(folder, name + '.npy')}: unreadable ({e}); "
                                     "delete the folder and build the datastore again") from None
        keys, values = arrays["keys"], arrays["values"]
        if keys.shape != (header.get("entries"), header.get("width")) or \
                values.shape != (header.get("entries"),):
            raise RetrievalError(f"{folder}: keys.npy {keys.shape} and values.npy {values.shape} "
                                 f"do not match {DATASTORE}'s {header.get('entries')} entries of "
                                 f"width {header.get('width')}; delete the folder and build the "
                                 "datastore again")
        return cls(folder, header, keys, values)

    def index(self, name: str = "exact", *, metric: str = "l2", read_rows: int = READ_ROWS,
              **options) -> Index:
        """An index over the keys (for L2 by the index's own metric or augmented, see the
        module docstring), filled in blocks of `read_rows` from the memory map; `options` are
        the index's own (a bug hunt: this was `block`, and took the exact index's `block`
        option as its own)."""
        check_metric(metric)
        check_augmented_dtype(name, options, metric)
        native = own_l2(name, options, metric)
        augmented = metric == "l2" and not native
        index = make(name, self.keys.shape[1] + augmented, **options,
                     **({"metric": "l2"} if native else {}))
        for lo in range(0, len(self.keys), read_rows):
            k = np.asarray(self.keys[lo:lo + read_rows], np.float32)
            index.add(augment_keys(k) if augmented else k)
        # trained and packed here, not in the first search (a README walk: ivf's k-means ran
        # inside the first eval batch, its bar at 0% for a minute and build_s 4 s of 77)
        index.prepare()
        return index


def augment_keys(k_NE):
    return np.concatenate([k_NE, np.sum(k_NE * k_NE, axis=1, keepdims=True)], axis=1)


def augment_queries(q_TE):
    return np.concatenate([2.0 * q_TE, -np.ones((len(q_TE), 1), q_TE.dtype)], axis=1)


# -- evaluation ------------------------------------------------------------------------------

@dataclasses.dataclass
class Neighbours:
    """What interpolation needs for T held-out tokens: the LM's log p(target) [T], the K
    nearest keys' distances [T, K] (ascending) and whether each one's value is the target."""

    lm_logp: np.ndarray
    dist: np.ndarray
    hit: np.ndarray
    search_s: float = 0.0  # seconds spent searching
    lm_s: float = 0.0  # seconds in the LM forward


def neighbours(model, params, ex, store: Datastore, index: Index, *, seq_len: int, k: int,
               metric: str = "l2", select=None, rows: int = 64, query_block: int = 4096,
               features_key=None) -> Neighbours:
    """The LM and its k nearest datastore entries for every target of the chosen chunks;
    `features_key`: the random-feature draw the LM trained with (`features_rngs`), the one its
    datastore was built with."""
    check_metric(metric)
    rngs = features_rngs(model.cfg, features_key, "the kNN-LM's search")
    check_draw(store.folder, store.header, rngs.get("features"))
    forward = _forward(model)
    lm, dist, hit = [], [], []
    t_lm = t_search = 0.0
    total = int(np.sum(ex.lengths[np.arange(len(ex)) if select is None else select] - 1))
    with _progress(total, "kNN-LM eval") as bar:
        for batch in ordered_batches(ex, rows=rows, seq_len=seq_len, select=select):
            t0 = time.perf_counter()
            h_BLE, logp_BL = jax.block_until_ready(forward(params, batch, rngs))
            t_lm += time.perf_counter() - t0
            real = batch["segment_ids"] > 0
            q_TE, target_T = np.asarray(h_BLE)[real], batch["targets"][real]
            # The keys are float16: round the queries the same way (a key is its own nearest).
            q_TE = q_TE.astype(np.float16).astype(np.float32)
            t0 = time.perf_counter()
            for lo in range(0, len(q_TE), query_block):
                d, ids = search(index, q_TE[lo:lo + query_block], k, metric)
                dist.append(d)
                # id -1 (fewer than k vectors scanned) is no hit, whatever values[-1] holds
                hit.append((store.values[ids] == target_T[lo:lo + query_block, None])
                           & (ids >= 0))
            t_search += time.perf_counter() - t0
            lm.append(np.asarray(logp_BL)[real])
            bar.update(len(target_T))
    return Neighbours(np.concatenate(lm), np.concatenate(dist), np.concatenate(hit),
                      search_s=t_search, lm_s=t_lm)


def search(index: Index, q_TE, k: int, metric: str = "l2"):
    """(distances [T, K] ascending, ids [T, K]) of the k nearest keys in an index made by
    `Datastore.index`: squared L2 (by the index's own metric, or through the augmentation)
    or, for "ip", minus the inner product."""
    check_metric(metric)
    native = index.options.get("metric") == "l2"
    if native and metric != "l2":
        raise RetrievalError(f"this {index.registry_name!r} index searches by L2 "
                             f"(metric='l2'), and metric={metric!r} was asked for; make the "
                             "index with the metric it is searched by")
    augmented = metric == "l2" and not native
    s, ids = index.search(augment_queries(q_TE) if augmented else q_TE, k)
    if augmented:
        s = s - np.sum(q_TE * q_TE, axis=1, keepdims=True)
    return (np.maximum(-s, 0.0) if metric == "l2" else -s), ids


def interpolate(nb: Neighbours, *, k: int, temperature: float, lam: float) -> np.ndarray:
    """log p(target) [T] of the interpolated model with the first k neighbours."""
    if not 0.0 <= lam <= 1.0:
        raise RetrievalError(f"lambda={lam} must be in [0, 1]")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):  # a bug hunt: 2.5 was a
        raise RetrievalError(f"k={k!r}: give a whole number of neighbours")  # slice traceback
    if k > nb.dist.shape[1]:
        raise RetrievalError(f"k={k} but only {nb.dist.shape[1]} neighbours were searched")
    if k < 1 or not temperature > 0:  # else p_kNN is 0/0 or the logits -d/0: NaN, silently
        raise RetrievalError(f"k={k}, temperature={temperature}: need k >= 1 and temperature > 0")
    logits_TK = -nb.dist[:, :k].astype(np.float64) / temperature
    # a row of padding alone (an IVF probe that scanned no vector: every distance inf) has
    # no neighbour, p_kNN 0 (found in review: -inf - -inf made its, and the perplexity, NaN)
    top_T1 = logits_TK.max(axis=1, keepdims=True)
    w_TK = np.exp(logits_TK - np.where(np.isneginf(top_T1), 0.0, top_T1))
    total_T = np.sum(w_TK, axis=1)
    p_knn_T = np.sum(w_TK * nb.hit[:, :k], axis=1) / np.where(total_T > 0, total_T, 1.0)
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log(lam) + np.log(p_knn_T), np.log1p(-lam) + nb.lm_logp.astype(np.float64))


def perplexity(logp_T) -> float:
    return float(np.exp(-np.mean(np.asarray(logp_T, np.float64))))


GRID = {"k": (8, 16, 32, 64), "temperature": (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0),
        "lam": (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)}


def check_grid(grid: dict) -> None:
    """A RetrievalError naming the value where `grid` holds a setting `interpolate` refuses:
    checked before the datastore is built and searched (a review, session 114: only `tune`,
    after both, refused a temperature of 0 or a lambda past 1)."""
    if not isinstance(grid, dict):
        raise RetrievalError(f"grid={grid!r}: give a dict of 'k', 'temperature' and 'lam' lists")
    for name in ("k", "temperature", "lam"):  # a bug hunt: an empty k was a TypeError
        if not len(grid.get(name, ())):
            raise RetrievalError(f"grid[{name!r}] is empty; give at least one value to try")
    for k in grid["k"]:
        if not kernels.is_integer(k) or k < 1:
            raise RetrievalError(f"grid['k'] holds {k!r}: give whole numbers of neighbours >= 1")
    for t in grid["temperature"]:
        if isinstance(t, bool) or not isinstance(t, (int, float, np.number)) or not t > 0:
            raise RetrievalError(f"grid['temperature'] holds {t!r}: give temperatures > 0")
    for lam in grid["lam"]:
        if isinstance(lam, bool) or not isinstance(lam, (int, float, np.number)) \
                or not 0.0 <= lam <= 1.0:
            raise RetrievalError(f"grid['lam'] holds {lam!r}: give weights in [0, 1]")


def tune(nb: Neighbours, grid: dict = GRID) -> dict:
    """The (k, temperature, lambda) of the grid with the lowest perplexity on `nb`; a grid k
    past the neighbours searched counts as all of them (found in review: with fewer than the
    grid's smallest k, from a small datastore or k_max, no k was tried and `run` failed)."""
    searched = nb.dist.shape[1]
    if searched < 1:
        raise RetrievalError("no neighbours were searched (an empty datastore?); build the "
                             "datastore from a run's training text first")
    check_grid(grid)
    best = None
    for k in sorted({min(k, searched) for k in grid["k"]}):
        for t in grid["temperature"]:
            for lam in grid["lam"]:
                ppl = perplexity(interpolate(nb, k=k, temperature=t, lam=lam))
                if best is None or ppl < best["ppl"] or math.isnan(best["ppl"]):
                    best = {"k": k, "temperature": t, "lam": lam, "ppl": ppl}
    if math.isnan(best["ppl"]):  # found in review: the grid's first setting was "best"
        raise RetrievalError("the perplexity is NaN at every setting of the grid: the LM's "
                             "log-probabilities or the neighbours' distances hold NaN (a run "
                             "that diverged?); evaluate the run, and retrain it if its loss is NaN")
    return best


def split_halves(n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out chunks -> (validation, test): alternate chunks, so both halves span the
    whole held-out corpus."""
    idx = np.arange(n_chunks)
    return idx[0::2], idx[1::2]




# -- a trained run, end to end ---------------------------------------------------------------

def load_trained(workdir: str, kind: str, hint: str):
    """(cfg, eval model, params, task, step, features_key) of the `kind` run trained in
    `workdir`; `hint` says how to train one. `features_key`: the random-feature draw its
    parameters trained with (`TrainState.features_key`, its last train step's), which a pass
    of a model whose attention reads the `features` stream needs (`features_rngs`). A
    bi-encoder's eval model routes in the run's MoE groups (`Trainer.split_model`)."""
    from hpnlp.train.carry import model_params
    from hpnlp.train.checkpoint import load_run_config
    from hpnlp.train.loop import Trainer
    cfg = load_run_config(workdir)
    if cfg.model.kind != kind:
        raise RetrievalError(f"{workdir}: a {cfg.model.kind!r} run; this needs model.kind={kind!r} "
                             f"({hint})")
    if cfg.model.arch == "transformer_xl":  # a bug hunt: an AttributeError traceback once
        # the datastore's folder was made (its hidden states come with the segment's memory)
        raise RetrievalError(f"{workdir}: a model.arch='transformer_xl' run reads each segment "
                             "with the memory of the ones before, which the kNN-LM's passes over "
                             "the text do not carry; use a Transformer or LSTM LM")
    trainer = Trainer(cfg, workdir, read_only=True)
    step = trainer.checkpointer.latest_step()
    if step is None:
        raise RetrievalError(f"{workdir}: no checkpoint to read; train it first ({hint})")
    state, _ = trainer.initial_state()
    trainer.checkpointer.close()
    # routed in the MoE groups the run's own evaluation measured it in (`Trainer.split_model`;
    # a review, session 107: a bi-encoder's pool routed as one group, other drops; session
    # 116: so did the kNN-LM's language model, its keys and perplexities another function's)
    model = trainer.split_model(state.step)
    return (cfg, model, jax.device_get(model_params(state.params)), trainer.task,
            step, state.features_key(cfg.train.feature_redraw_every))


def load_run(workdir: str, kind: str, hint: str):
    """(cfg, eval model, params, task, step): `load_trained` less the random-feature draw (for
    a model whose attention reads none)."""
    return load_trained(workdir, kind, hint)[:5]


def check_index(name: str, options: dict, k: int = 0, metric: str = "l2", *,
                entries: int | None = None) -> None:
    """RetrievalError where index `name` with `options` cannot be made, or (as far as its
    options tell) cannot give `k` neighbours, or (given the datastore's `entries`) cannot be
    built over them here (`Index.check_build`), before the datastore (minutes) is built: an
    empty one of a small width is made and dropped, with the metric `Datastore.index` gives
    it for the kNN-LM's `metric` (a bug hunt (session 101): it was made without, so options
    refused with metric="l2" passed here and failed after the datastore was built)."""
    if "metric" in options:  # the index's own, set from the kNN-LM's (a TypeError in `run`)
        raise RetrievalError(f"index_options metric={options['metric']!r}: the kNN-LM sets "
                             "the index's metric from its own (--metric); leave it out")
    try:
        own = {"metric": "l2"} if own_l2(name, options, metric) else {}
        index = make(name, 8, **options, **own)
    except TypeError as e:
        raise RetrievalError(f"index_options {options}: not options of the {name!r} index "
                             f"({e})") from None
    except (ValueError, KeyError) as e:
        raise RetrievalError(f"index {name!r} with options {options}: {e}") from None
    check_augmented_dtype(name, options, metric)
    check_k(index, k)
    if entries is not None:  # review r10: refused by `store.index`, after the datastore pass
        index.check_build(entries, first=min(entries, READ_ROWS))


def check_k(index: Index, k: int) -> None:
    """RetrievalError where `index` cannot give each query k neighbours (an IVF index scanning
    fewer vectors), said without "lower k": the command has no k (a bug hunt, session 98)."""
    check = getattr(index, "check_k", None)
    if check is not None and k:
        check(k, fix="raise nprobe or chunk in the index options (the kNN-LM searches each "
                     f"token's {k} nearest entries)")


DATASTORE_FILES = (DATASTORE, DATASTORE + ".tmp", "keys.npy", "values.npy", "keys.tmp.npy",
                   "values.tmp.npy")


def _summary_source(summary: dict) -> tuple[str | None, str]:
    """(command, run) a summary.json was written by: `python -m hpnlp.retrieval knnlm` or
    `encoder` (named in it; inferred from its fields where written before they were)."""
    command = summary.get("command") or ("knnlm" if "datastore" in summary else
                                         "encoder" if "mined" in summary else None)
    return command, os.path.realpath(str(summary.get("workdir", "")))


def check_out(out: str, workdir: str, command: str, datastore: str | None = None) -> None:
    """RetrievalError where writing OUT/summary.json would write over a run's files, or over
    a summary of another command or run (a bug hunt: the kNN-LM's replaced an encoder's,
    unsaid); the datastore's files are this command's own where `out` is `datastore`."""
    from hpnlp.paths import check_new_output
    same = datastore is not None and os.path.realpath(out) == os.path.realpath(datastore)
    try:  # (a bug hunt: a first run into --datastore's folder passed, its rerun was refused)
        check_new_output(out, workdir, may_replace=("summary.json",) + (
            DATASTORE_FILES if same else ()))
    except ValueError as e:
        raise RetrievalError(str(e)) from None
    path = os.path.join(out, "summary.json")
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            was = _summary_source(json.load(f))
    except (OSError, ValueError, AttributeError) as e:
        # a bug hunt (session 96): a cut summary (a run stopped as it wrote it, perhaps this
        # command's own) was called "a summary.json of another command"
        raise RetrievalError(f"--out {out} holds a summary.json that cannot be read "
                             f"({type(e).__name__}: {e}), perhaps cut as it was written; move it "
                             "aside (or delete it) and run again, or give a new folder") from None
    if was != (command, os.path.realpath(workdir)):
        whose = (f"python -m hpnlp.retrieval {was[0]} of {was[1]}" if was[0]
                 else "another command")
        raise RetrievalError(f"--out {out} holds a summary.json of {whose}, which this one would "
                             "replace; give a new folder, or move that file aside")


def check_datastore_folder(datastore: str, workdir: str) -> None:
    """RetrievalError where building the datastore in `datastore` would write into the run
    itself, into a file's path, or beside files that are not a datastore's (or its summary)."""
    from hpnlp.paths import check_new_output
    try:
        check_new_output(datastore, workdir, "--datastore",
                         may_replace=DATASTORE_FILES + ("summary.json",))
    except ValueError as e:
        raise RetrievalError(str(e)) from None


LM_HINT = "python -m hpnlp.main --config experiments/lm.py --workdir ..."


def load_lm(workdir: str):
    """(cfg, eval model, params, task, step) of the LM trained in `workdir` (`load_trained`
    also gives its random-feature draw)."""
    return load_run(workdir, "lm", LM_HINT)


def run(workdir: str, datastore: str, *, index: str = "exact", index_options: dict | None = None,
        metric: str = "l2", max_eval_tokens: int = 0, max_datastore_tokens: int = 0,
        k_max: int = 64, grid: dict = GRID, out: str | None = None) -> dict:
    """kNN-LM on a trained LM: the datastore (built unless `datastore` holds this model's),
    neighbours of the held-out targets, k / T / lambda tuned on the validation half and the
    perplexity with and without the datastore on the test half. `max_eval_tokens` > 0 reads
    only the first chunks of each half (about that many tokens in all);
    `max_datastore_tokens` > 0 builds the datastore from the first training chunks only."""
    check_metric(metric)
    if not kernels.is_integer(k_max) or k_max < 1:
        # a review (session 114): 0 or 2.5 failed in the first search, the datastore built
        raise RetrievalError(f"k_max={k_max!r}: give a whole number of neighbours >= 1")
    check_grid(grid)
    for name, value in (("max_eval_tokens", max_eval_tokens), ("max_datastore_tokens", max_datastore_tokens)):
        if not isinstance(value, int) or value < 0:
            raise RetrievalError(f"{name}={value!r}: give a count of tokens >= 1, or 0 for all")
    # the k it searches: no more than a capped datastore's entries (review, session 98; its
    # whole chunks are counted once the run is read, below)
    check_index(index, index_options or {}, min(k_max, max_datastore_tokens or k_max), metric)
    check_datastore_folder(datastore, workdir)
    if out:
        check_out(out, workdir, "knnlm", datastore)
    cfg, model, params, task, step, features_key = load_trained(workdir, "lm", LM_HINT)
    # before the chunk count (a bug hunt, session 110: a prepared task's in-memory splits are
    # empty, and the count blamed the held-out split's size)
    if cfg.data.prepared:
        raise RetrievalError(f"{workdir} trained on a prepared corpus (data.prepared="
                             f"{cfg.data.prepared}), whose text stays in its shards; the kNN-LM "
                             "builds its datastore from a run's in-memory training split: use a "
                             "run of the shipped corpus or a data.train_path file")
    if len(task.eval) < 2:  # a bug hunt: one chunk left the test half empty, a traceback
        # after the datastore was built
        raise RetrievalError(f"{workdir}'s held-out split has {len(task.eval)} chunk(s) of "
                             f"data.seq_len={cfg.data.seq_len} tokens; the kNN-LM tunes on "
                             "alternate chunks and tests on the others, so it needs at least 2: "
                             "a longer data.eval_path file (or a run with a shorter seq_len)")
    from hpnlp.config.checks import eval_is_train
    if eval_is_train(cfg.data):  # refused to a new run (`check_new_run`), not a saved one
        # a review (session 107): every held-out target's own entry was in the datastore, at
        # distance 0 (its context and hidden state the same), and the perplexity fell to ~1
        raise RetrievalError(f"{workdir} evaluates on its training file (data.eval_path = "
                             f"data.train_path = {cfg.data.eval_path}), so the datastore would "
                             "hold every held-out target; train the LM with a held-out "
                             "data.eval_path")
    L = cfg.data.seq_len
    meta = {"workdir": os.path.abspath(workdir), "step": step, "task": task.name}
    t0 = time.perf_counter()
    train = datastore_split(task.train, max_datastore_tokens)
    entries = int(np.sum(train.lengths - 1))
    check_index(index, index_options or {}, min(k_max, entries), metric, entries=entries)
    store, built = datastore_for(model, params, train, datastore, seq_len=L, meta=meta,
                                 features_key=features_key)
    t_store = time.perf_counter() - t0
    t0 = time.perf_counter()
    idx = store.index(index, metric=metric, **(index_options or {}))
    t_index = time.perf_counter() - t0
    kk = min(k_max, len(store.keys))
    check_k(idx, kk)  # a chunk chosen from the cells: known once they are trained
    valid, test = split_halves(len(task.eval))
    if max_eval_tokens:
        per_chunk = max(1.0, float(np.mean(task.eval.lengths - 1)))
        n = max(1, int(max_eval_tokens / 2 / per_chunk))
        valid, test = valid[:n], test[:n]
    nb_valid = neighbours(model, params, task.eval, store, idx, seq_len=L, k=kk, metric=metric,
                          select=valid, features_key=features_key)
    nb_test = neighbours(model, params, task.eval, store, idx, seq_len=L, k=kk, metric=metric,
                         select=test, features_key=features_key)
    best = tune(nb_valid, grid)
    lm_ppl = perplexity(nb_test.lm_logp)
    knn_ppl = perplexity(interpolate(nb_test, k=best["k"], temperature=best["temperature"],
                                     lam=best["lam"]))
    tokens = len(nb_test.lm_logp)
    summary = {
        "command": "knnlm", "workdir": os.path.abspath(workdir), "step": step, "task": task.name,
        "datastore": {"folder": os.path.abspath(datastore), "entries": int(len(store.keys)),
                      "width": int(store.keys.shape[1]), "built": built, "seconds": t_store,
                      "bytes": int(store.keys.nbytes + store.values.nbytes)},
        "index": {"name": index, "options": idx.options, "metric": metric, "build_s": t_index},
        "tuned_on_validation": best,
        "test": {"tokens": tokens, "lm_ppl": lm_ppl, "knn_lm_ppl": knn_ppl,
                 "ppl_reduction": 1.0 - knn_ppl / lm_ppl,
                 "lm_ms_per_token": 1e3 * nb_test.lm_s / tokens,
                 "search_ms_per_token": 1e3 * nb_test.search_s / tokens},
    }
    if out:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, "summary.json"), summary)
    return summary
