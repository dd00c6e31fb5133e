"""Subword tokenizers for the LM tasks: `data.tokenizer = "bpe" | "unigram"` (SentencePiece).

`bytes` and `words` (text_tasks.byte_encode, text_tasks.WordVocab) need nothing trained;
`bpe` (Sennrich et al. 2016) and `unigram` (Kudo 2018) models of `data.vocab_size` pieces
are trained on the task's training text when a run starts, saved in its workdir
(`WORKDIR/tokenizer/`), and loaded from there when the run resumes or is read again.

Why SentencePiece rather than Hugging Face `tokenizers`: one small wheel with no
dependencies trains both model types from raw text, with no pre-tokenizer to choose
(whitespace is an ordinary symbol, "▁"), and with byte fallback (unseen characters become
their UTF-8 bytes) and identity normalization every text round-trips exactly; its model is
one protobuf file, which is all a workdir has to keep.

Lines are the unit SentencePiece sees: a text is split at "\\n", each line encoded, and
a newline piece (a reserved symbol that the trainer never sees in a line) joins them, so
`decode(encode(text)) == text` for any text. SentencePiece reads a literal "▁" (U+2581) as
its whitespace symbol, so a line is also split at each one, its segments encoded alone, and
the character's three UTF-8 byte pieces join them (found in review: "x▁y" came back "x y").
Ids are sorted by descending count on the training text (ties: SentencePiece's id), as word
ids are, so that id 0 is the most frequent piece and log-uniform samplers and the adaptive
softmax's frequency clusters apply as is.
Training is single-threaded and seeded: the same text and settings give the same ids.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from typing import Iterable, Sequence

import numpy as np

from hpnlp.data.task import checked_ids

SUBWORD = ("bpe", "unigram")
KINDS = ("bytes", "words") + SUBWORD
NEWLINE = "\n"
SPACE = "\u2581"  # SentencePiece's whitespace symbol
MODEL_FILE, META_FILE = "tokenizer.model", "tokenizer.json"
DIRNAME = "tokenizer"  # in a workdir or a prepared folder
MAX_LINE_BYTES = 1 << 16  # longer lines still encode; the trainer skips them


def _config_error(field: str, value, why: str):
    """`field`: a config field, or a command line's flag (`--vocab_size`), named as such."""
    from hpnlp.config import ConfigError
    if field.startswith("--"):  # a bug hunt: "config field `--vocab_size`"
        return ConfigError(f"{field} {value!r}: {why}")
    return ConfigError(f"config field `{field}` = {value!r} is not allowed: {why}")


def text_digest(docs: Iterable[str]) -> str:
    """sha256 of the training text, to tell whether a saved tokenizer was trained on it."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class Subword:
    """A trained SentencePiece model with hpnlp's frequency-sorted ids."""

    kind: str  # "bpe" | "unigram"
    model_proto: bytes
    order: np.ndarray  # [V] int32: hpnlp id -> SentencePiece id
    trained_on: str  # text_digest of the training text

    @property
    def vocab_size(self) -> int:
        return len(self.order)

    @functools.cached_property
    def _sp(self):
        import sentencepiece as spm
        return spm.SentencePieceProcessor(model_proto=self.model_proto)

    @functools.cached_property
    def _ours(self) -> np.ndarray:  # SentencePiece id -> hpnlp id
        inv = np.empty(len(self.order), np.int32)
        inv[self.order] = np.arange(len(self.order), dtype=np.int32)
        return inv

    @property
    def newline_id(self) -> int:
        return int(self._ours[self._sp.piece_to_id(NEWLINE)])

    def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text -> int32 ids (one SentencePiece call for all their lines)."""
        if isinstance(texts, str):  # else each character would be encoded as a text
            raise TypeError("encode_many takes a list of texts; encode one text with encode(text)")
        lines, per_text = [], []  # per text, the segments of each of its lines
        for t in texts:
            row = []
            for line in t.split(NEWLINE):
                segments = line.split(SPACE) if SPACE in line else [line]
                lines += segments
                row.append(len(segments))
            per_text.append(row)
        pieces = self._sp.encode(lines) if lines else []
        nl, space = self._sp.piece_to_id(NEWLINE), self._space_ids
        out, i = [], 0
        for row in per_text:
            flat = []
            for j, n in enumerate(row):
                if j:
                    flat.append(nl)
                for k in range(n):
                    if k:
                        flat += space
                    flat += pieces[i]
                    i += 1
            out.append(self._ours[np.asarray(flat, np.int64)] if flat else np.zeros(0, np.int32))
        return out

    @functools.cached_property
    def _space_ids(self) -> list[int]:  # a literal SPACE as its UTF-8 byte pieces
        return [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE.encode()]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_many([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        sp_ids = self.order[checked_ids(ids, self.vocab_size)].tolist()
        nl = self._sp.piece_to_id(NEWLINE)
        lines, cur = [], []
        for i in sp_ids:
            if i == nl:
                lines.append(cur)
                cur = []
            else:
                cur.append(i)
        lines.append(cur)
        return NEWLINE.join(self._decode_line(line) for line in lines)

    def _decode_line(self, sp_ids: list[int]) -> str:
        space, segments, cur, k = self._space_ids, [], [], 0
        while k < len(sp_ids):
            if sp_ids[k] == space[0] and sp_ids[k:k + 3] == space:
                segments.append(cur)
                cur, k = [], k + 3
            else:
                cur.append(sp_ids[k])
                k += 1
        segments.append(cur)
        return SPACE.join(self._sp.decode(s) if s else "" for s in segments)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """The piece of each id (for inspection: "▁the", "<0x0A>", ...)."""
        return [self._sp.id_to_piece(int(self.order[i]))
                for i in checked_ids(ids, self.vocab_size)]

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size,
                "model_sha256": hashlib.sha256(self.model_proto).hexdigest(),
                "trained_on": self.trained_on}

    def save(self, directory: str) -> None:
        """Write `directory/tokenizer.model` and `tokenizer.json` (replaced atomically).
        A file there, or a folder holding anything else (a run's workdir), is refused, not
        replaced."""
        if os.path.exists(directory):
            other = (sorted(set(os.listdir(directory)) - {MODEL_FILE, META_FILE})
                     if os.path.isdir(directory) else None)
            if other is None or other:
                what = "is a file" if other is None else (
                    f"holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}")
                # a file: its own path is the folder asked for (a run's WORKDIR/tokenizer), so
                # the fix is the file's (a review, session 116: it suggested the same path)
                fix = (f"save it to a folder of its own (e.g. {os.path.join(directory, DIRNAME)})"
                       if other else "move or delete that file, or save the tokenizer elsewhere")
                raise ValueError(f"{directory}: {what}, which saving the tokenizer would delete; "
                                 f"{fix}")
        parent = os.path.dirname(os.path.abspath(directory))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
        with open(os.path.join(tmp, MODEL_FILE), "wb") as f:
            f.write(self.model_proto)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump({**self.describe(), "order": self.order.tolist(),
                       "order_sha256": _order_sha256(self.order)}, f)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(tmp, directory)

    @classmethod
    def load(cls, directory: str, *, fix: str | None = None) -> "Subword":
        """The tokenizer kept in `directory`; a ValueError naming it, ending in `fix` (default:
        delete the folder to train it again), where it is damaged; a missing folder is named
        as such."""
        if fix is None:
            if not os.path.isdir(directory):
                raise ValueError(f"{directory}: no such folder; give the folder a tokenizer was "
                                 f"saved to (Subword.save; a run keeps its own in WORKDIR/{DIRNAME})")
            fix = "delete the folder to train it again"
        meta_path = os.path.join(directory, META_FILE)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if not isinstance(meta, dict):  # a review (session 114): a TypeError traceback
                raise ValueError(f"{META_FILE} holds no JSON object")
            with open(os.path.join(directory, MODEL_FILE), "rb") as f:
                proto = f.read()
            order = np.asarray(meta["order"], np.int32)
            if order.ndim != 1:
                raise ValueError("its \"order\" is no list of ids")
            tok = cls(meta["kind"], proto, order, meta["trained_on"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{directory}: not a readable hpnlp tokenizer ({e}); {fix}") from None
        if hashlib.sha256(proto).hexdigest() != meta.get("model_sha256"):
            raise ValueError(f"{directory}/{MODEL_FILE} does not match {META_FILE} (a partial "
                             f"copy?); {fix}")
        # the id order too (a bug hunt, session 96: two ids swapped by hand decoded text
        # otherwise without a word); folders saved before it had a digest are checked whole
        order = tok.order
        if (sorted(order.tolist()) != list(range(len(order))) or
                meta.get("order_sha256", _order_sha256(order)) != _order_sha256(order)):
            raise ValueError(f"{directory}/{META_FILE}: its \"order\" is not the one saved "
                             f"with the model (edited by hand?); {fix}")
        return tok


def _order_sha256(order) -> str:
    return hashlib.sha256(np.asarray(order, np.int32).tobytes()).hexdigest()


def train(kind: str, vocab_size: int, docs: Sequence[str], *, field: str = "data.vocab_size",
          digest: str | None = None, source: str = "the training text") -> Subword:
    """Train a `kind` model of exactly `vocab_size` pieces on `docs` (texts; their lines are
    the trainer's sentences). A size the text cannot support is a ConfigError naming `field`
    and the largest size it supports; text with no line short enough to train on, a
    ValueError naming `source` (where the text came from)."""
    import sentencepiece as spm
    if kind not in SUBWORD:
        raise ValueError(f"tokenizer kind {kind!r}; choose one of {SUBWORD}")
    if isinstance(docs, str):  # else each character would be a training document
        raise TypeError("the tokenizer trains on a list of texts; give [text], not text")
    lines = [line for d in docs for line in d.split(NEWLINE) if line]
    if not lines:
        raise ValueError(f"{source}: the tokenizer's training text is empty; give it some text")
    # SentencePiece skips every line over MAX_LINE_BYTES, and with none left failed with its
    # own check's text, naming neither the text nor why (found by a README walk: a 32 MB
    # single-line file)
    # (a line of at most MAX_LINE_BYTES / 4 characters fits: the check stops at the first)
    if all(len(line) > MAX_LINE_BYTES // 4 and len(line.encode("utf-8")) > MAX_LINE_BYTES
           for line in lines):
        longest = max(len(line.encode("utf-8")) for line in lines)
        raise ValueError(f"{source}: every line is longer than the {MAX_LINE_BYTES:,} bytes the "
                         f"tokenizer trains on (the longest {longest:,}), so it has nothing "
                         "to learn from; break the text into lines or paragraphs")
    buf = io.BytesIO()
    spm.set_random_generator_seed(0)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, model_type=kind,
            vocab_size=int(vocab_size), character_coverage=1.0, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=False, user_defined_symbols=[NEWLINE],
            bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0, num_threads=1,
            max_sentence_length=MAX_LINE_BYTES, minloglevel=2)
    except RuntimeError as e:
        msg = str(e)
        high = re.search(r"value <= (\d+)", msg)
        if high:
            raise _config_error(field, vocab_size, f"the training text supports at most "
                                f"{high.group(1)} {kind} pieces; lower it"
                                + (" or use bpe, which goes further" if kind == "unigram" else "")
                                + " (or train on more text)") from None
        low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if low:
            raise _config_error(field, vocab_size, f"a {kind} model of this text needs at least "
                                f"{low.group(2)} pieces (256 byte pieces, the special symbols and "
                                "every character); raise it") from None
        raise ValueError(f"SentencePiece could not train a {kind} model of {vocab_size} pieces: "
                         f"{msg}") from None
    proto = buf.getvalue()
    tok = Subword(kind, proto, np.arange(vocab_size, dtype=np.int32), digest or text_digest(docs))
    counts = np.zeros(vocab_size, np.int64)
    for ids in tok.encode_many(docs):
        counts += np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)
    return Subword(kind, proto, order, tok.trained_on)


@functools.lru_cache(maxsize=4)
def _train_cached(kind: str, vocab_size: int, docs: tuple[str, ...], digest: str,
                  source: str) -> Subword:
    return train(kind, vocab_size, docs, digest=digest, source=source)


def _kept_by_no_checkpoint(directory: str, cfg, digest: str) -> bool:
    """Whether the tokenizer kept in `directory` (WORKDIR/tokenizer) is of other settings
    than `cfg`'s (kind, size, training text `digest`) in a workdir that holds no checkpoint:
    the run that saved it stopped before its first one, so a rerun starts over (a review,
    session 116: it was refused the kept tokenizer, told to use a new workdir)."""
    import jax

    from hpnlp.train.checkpoint import has_checkpoint
    if jax.process_count() > 1 or has_checkpoint(os.path.dirname(os.path.abspath(directory))):
        return False  # (several processes: one would replace the folder the others read)
    try:
        tok = Subword.load(directory)
    except ValueError:  # damaged: said by the load of a run that keeps it
        return False
    return (tok.kind, tok.vocab_size, tok.trained_on) != (cfg.tokenizer, cfg.vocab_size, digest)


def for_run(cfg, train_docs: Sequence[str], directory: str | None, *,
            save: bool = True) -> tuple[Subword, str]:
    """(tokenizer, "loaded" | "trained") for a run: the one saved in `directory` when there is
    one (refused if it is of another kind or size, or was trained on other text), else trained
    on `train_docs` and saved there (`save`, process 0 only)."""
    digest = text_digest(train_docs)
    if directory and os.path.isfile(os.path.join(directory, META_FILE)) and save and \
            _kept_by_no_checkpoint(directory, cfg, digest):
        pass  # a new run's, whose first run stopped before any checkpoint: trained anew below
    elif directory and os.path.isfile(os.path.join(directory, META_FILE)):
        from hpnlp.train.checkpoint import has_checkpoint
        kept = not save or has_checkpoint(os.path.dirname(os.path.abspath(directory)))
        # a damaged folder of a run that keeps it (a resume, a reader) is not trained again:
        # "delete the folder" left such a run unable to start at all (a review, session 118)
        tok = Subword.load(directory, fix=(
            "restore the run's tokenizer folder from a copy: its weights read these ids, and "
            "a run with checkpoints (or a reader of one) does not train it again"
            if kept else None))
        # a run of several processes whose first try saved no checkpoint (one process
        # replacing the folder the others read: not done; a review, session 116)
        anew = ("" if kept else f" (the workdir holds no checkpoint: delete {directory} to "
                "train one anew)")
        if (tok.kind, tok.vocab_size) != (cfg.tokenizer, cfg.vocab_size):
            raise _config_error("data.tokenizer", cfg.tokenizer,
                                f"{directory} holds a {tok.kind} tokenizer of {tok.vocab_size} "
                                f"pieces and this config asks for {cfg.tokenizer} of "
                                f"{cfg.vocab_size} (data.vocab_size); use the run's own settings, "
                                f"or a new workdir{anew}")
        if tok.trained_on != digest:
            # a review (session 116): said of data.train_path whatever changed (a run of the
            # shipped corpus resumed under another data.eval_split named train_path = ''), and
            # "use the run's own settings" to a run whose file had changed
            field, value = (("data.train_path", cfg.train_path) if cfg.train_path else
                            ("data.eval_split", cfg.eval_split))
            raise _config_error(field, value, f"the tokenizer in {directory} was trained on "
                                "other text than this config's training split: the run's "
                                f"{'file changed since, or ' if cfg.train_path else ''}the "
                                "fields that choose the split (data.eval_split, data.eval_path) "
                                "differ from the run's; "
                                f"{'restore the file, or ' if cfg.train_path else ''}use the "
                                f"run's own data settings, or a new workdir{anew}")
        return tok, "loaded"
    if directory and not save:  # a bug hunt: a reader of a run (generate) whose tokenizer
        # folder was gone trained another one, and wrote other text from the same ids
        from hpnlp.config import ConfigError
        raise ConfigError(f"{os.path.join(directory, META_FILE)} is missing: the run's "
                          f"{cfg.tokenizer} tokenizer, which reading or resuming the run needs "
                          "(one trained now could split text otherwise); restore the run's "
                          "tokenizer folder")
    tok = _train_cached(cfg.tokenizer, int(cfg.vocab_size), tuple(train_docs), digest,
                        f"data.train_path={cfg.train_path}" if cfg.train_path
                        else "the training split")
    if directory and save:
        import jax
        if jax.process_index() == 0:
            tok.save(directory)
    return tok, "trained"
