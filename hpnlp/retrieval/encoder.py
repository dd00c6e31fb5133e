"""Search with a trained bi-encoder (hpnlp.models.bi_encoder): its held-out retrieval
metrics, and an index over any texts.

    python -m hpnlp.retrieval encoder --workdir RUN [--out DIR]    # recall@1/10, MRR

    >>> search = TextSearch.from_run("/tmp/hpnlp/encoder")         # doctest: +SKIP
    >>> search.add(verses)                                         # doctest: +SKIP
    >>> search.search(["Blessed are the meek"], k=5)               # doctest: +SKIP
    [[(0.83, 'Blessed are the meek: for they shall inherit the earth.'), ...]]
"""

from __future__ import annotations

import os

import numpy as np

from hpnlp.models import bi_encoder as be
from hpnlp.paths import write_json
from hpnlp.retrieval import base
from hpnlp.retrieval.knnlm import check_out, features_rngs, load_run, load_trained

HINT = "python -m hpnlp.main --config experiments/encoder.py --workdir ..."


def load_encoder(workdir: str):
    """(cfg, eval model, params, task, step) of the bi-encoder trained in `workdir`
    (`knnlm.load_trained` also gives its random-feature draw)."""
    return load_run(workdir, "bi_encoder", HINT)


def evaluate(workdir: str, *, out: str | None = None) -> dict:
    """recall@1, recall@10 and MRR of the held-out pairs against the whole held-out pool
    (hpnlp.models.bi_encoder.evaluate_pool), routed in the run's MoE groups as its own
    evaluation was (`Trainer.split_model`); also written to OUT/summary.json."""
    if out:
        check_out(out, workdir, "encoder")
    cfg, model, params, task, step, features_key = load_trained(workdir, "bi_encoder", HINT)
    summary = {"command": "encoder", "workdir": os.path.abspath(workdir), "step": int(step),
               "task": task.name, "arch": cfg.model.arch, "loss": cfg.model.encoder.loss,
               "mined": bool(cfg.model.encoder.mine_every),
               **be.evaluate_pool(cfg, model, params, task, features_key=features_key)}
    if out:
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, "summary.json"), summary)
    return summary


def _texts(texts, method: str) -> list[str]:
    """`texts` as a list of strings; a bare string refused (a bug hunt: read as one text per
    character, searched and answered without a word)."""
    if isinstance(texts, (str, bytes)):
        raise base.RetrievalError(f"TextSearch.{method} takes a list of texts, and got one "
                                  f"string ({texts[:40]!r}); pass [text]")
    texts = list(texts)
    other = next((t for t in texts if not isinstance(t, str)), None)
    if other is not None:
        raise base.RetrievalError(f"TextSearch.{method} takes texts (str), and got "
                                  f"{type(other).__name__} {other!r:.40}")
    return texts


class TextSearch:
    """Texts embedded by a bi-encoder into an hpnlp.retrieval index (any name; exact by
    default), searched by text."""

    def __init__(self, cfg, model, params, encode_text, *, index: str = "exact",
                 dim: int | None = None, features_key=None, **options):
        """`dim`: the vectors' width, by default the model's (`bi_encoder.embedding_dim`).
        `features_key`: the random-feature draw the encoder trained with, where its attention
        reads one (`state.features_key(cfg.train.feature_redraw_every)`; `from_run` reads the
        run's): refused here without it (a review, session 106: embedded with the seed's)."""
        if cfg is not None:
            features_rngs(cfg, features_key, "TextSearch")
        self.cfg, self.model, self.params, self.encode_text = cfg, model, params, encode_text
        self.features_key = features_key
        dim = be.embedding_dim(model, params) if dim is None else dim
        if options.get("metric", "ip") != "ip":  # a review (session 117): scores of l2,
            # -|q - x|^2, were returned as cosines
            raise base.RetrievalError(f"TextSearch: metric={options['metric']!r}; its scores "
                                      "are the unit embeddings' cosines, an index's inner "
                                      "products: leave metric out (or 'ip')")
        self.index = base.make(index, dim, **options)
        self.texts: list[str] = []

    @classmethod
    def from_run(cls, workdir: str, *, index: str = "exact", **options) -> "TextSearch":
        cfg, model, params, task, _, features_key = load_trained(workdir, "bi_encoder", HINT)
        return cls(cfg, model, params, task.encode, index=index, features_key=features_key,
                   **options)

    def embed(self, texts) -> np.ndarray:
        """Unit vectors [n, E] of `texts` (each cut to data.seq_len tokens)."""
        L = self.cfg.data.seq_len
        ids = [np.asarray(self.encode_text(t))[:L] for t in texts]
        tokens = np.zeros((len(ids), L), np.int32)
        seg = np.zeros((len(ids), L), np.int32)
        for i, x in enumerate(ids):
            tokens[i, :len(x)], seg[i, :len(x)] = x, 1
        return be.embed_texts(self.model, self.params, tokens, seg,
                              features_key=self.features_key)

    def add(self, texts) -> None:
        texts = _texts(texts, "add")
        self.index.add(self.embed(texts))
        self.texts += texts

    def search(self, queries, k: int = 5) -> list[list[tuple[float, str]]]:
        """For each query text, its k nearest added texts as (cosine, text), nearest first;
        fewer than k where an approximate index's probes held fewer (a bug hunt: its padding,
        id -1, was shown as the last text added)."""
        scores, ids = self.index.search(self.embed(_texts(queries, "search")), k)
        return [[(float(s), self.texts[i]) for s, i in zip(srow, irow) if i >= 0]
                for srow, irow in zip(scores, ids)]
