"""Embedded tasks, users' files and batching: everything a training run reads.

    from hpnlp import data
    task = data.make_task(cfg.data)                       # build once
    it = data.make_iterator(task, cfg.data, split="train", batch_size=32)
    batch = next(it)                                      # dict of numpy arrays

Tasks (`task_names()`): `listops` (LRA ListOps, generated or from an LRA TSV),
`byte_lm` / `word_lm` (language modelling on the shipped King James Bible, a user's
text file or a prepared on-disk corpus, by bytes, words or subwords: `data.tokenizer`), `doc_classify` / `doc_match` (byte-level long-document classification and
matching over the Bible's 8 canonical sections), `verse_pairs` (neighbouring verses as
positive pairs, for the bi-encoder), `verse_book` (a verse's book, most books with only
2-5 train verses: rare events for the key-value memory; data/rare_events.py). Nothing is
downloaded. Batch keys:

    classify: inputs, segment_ids [B, L]; label, weight [B]
    match:    inputs1, segment_ids1, inputs2, segment_ids2 [B, L]; label, weight, index [B]
              (index: the pair's example number in its split, -1 on a filler row)
    lm:       inputs, targets, segment_ids, positions [B, L]

Padding is only in the masks (segment id 0, weight 0); padded slots hold id 0.
"""

from __future__ import annotations

import dataclasses
import os

from hpnlp.data import listops, rare_events, text_tasks, tokenizers
from hpnlp.data.batching import BatchIterator
from hpnlp.data.task import Examples, Task

LM_TASKS = ("byte_lm", "word_lm")  # take data.tokenizer and data.prepared
BYTE_TASKS = ("doc_classify", "doc_match", "verse_pairs")  # byte ids, whatever the settings
_TASKS = {
    "doc_classify": (text_tasks.make_doc_task, text_tasks.info),
    "doc_match": (text_tasks.make_doc_task, text_tasks.info),
    "listops": (lambda cfg, name: listops.make_task(cfg), lambda cfg, name: listops.info(cfg)),
    "byte_lm": (text_tasks.make_lm_task, text_tasks.info),
    "word_lm": (text_tasks.make_lm_task, text_tasks.info),
    "verse_book": (rare_events.make_task, rare_events.info),
    "verse_pairs": (text_tasks.make_pairs_task, text_tasks.info),
}


def task_names() -> list[str]:
    return list(_TASKS)


def _entry(cfg):
    if cfg.task not in _TASKS:
        from hpnlp.config import ConfigError
        raise ConfigError(f"config field `data.task` = {cfg.task!r} is not allowed: "
                          f"choose one of {task_names()}")
    if cfg.seq_len < 1:
        from hpnlp.config import ConfigError
        raise ConfigError(f"config field `data.seq_len` = {cfg.seq_len!r} is not allowed: must be >= 1")
    if cfg.task not in LM_TASKS:
        for field in ("tokenizer", "prepared"):
            if getattr(cfg, field):
                from hpnlp.config import ConfigError
                raise ConfigError(f"config field `data.{field}` = {getattr(cfg, field)!r} is not "
                                  f"allowed for data.task={cfg.task!r}: it applies to the LM tasks "
                                  f"{list(LM_TASKS)}; leave it empty")
    return _TASKS[cfg.task]


# what draws generated ListOps' one sequence of expressions, beside data.seed: a run's
# examples are its first listops_num_train (+ listops_num_eval) of it, whatever their number
_LISTOPS_STREAM = ("task", "listops_min_length", "listops_max_length", "listops_max_depth",
                   "listops_max_args")


def _listops_seed(cfg) -> int:
    return abs(cfg.seed)  # as listops.generate's Random(seed) seeds it: -1 draws 1's


def saw_validation(mine, theirs) -> bool:
    """Whether a run trained with DataConfig `theirs` may have trained on the examples that
    `mine` (`eval_split='validation'`) holds out: a run that did not hold them out too, or
    generated ListOps drawn or cut otherwise (its held-out examples are a slice of one
    generated sequence). The shipped corpus holds out the same chapters for every task. A
    run of a user's file or prepared folder read none of the shipped or generated examples
    (a review, session 118: it was refused, told to use a run trained with a validation
    split that such a run cannot take)."""
    if mine.eval_split != "validation" or theirs.train_path or theirs.prepared:
        return False
    if theirs.eval_split != "validation":
        return True
    if mine.task == "listops" or theirs.task == "listops":
        fields = ("task", "listops_num_train", "listops_num_eval", *_LISTOPS_STREAM[1:])
        return (_listops_seed(mine) != _listops_seed(theirs)
                or any(getattr(mine, f) != getattr(theirs, f) for f in fields))
    return False


def saw_eval(mine, theirs) -> bool:
    """Whether a run trained with DataConfig `theirs` trained on the examples that `mine`
    (`eval_split='eval'`, generated ListOps) evaluates on: its eval set is the slice after
    its listops_num_train of the sequence that data.seed and the generator fields draw, so
    a run drawing the same sequence and training on more of it trained on that slice (review
    r2: `train.init_from` a run of listops_num_train=40000 into one of 20000 was taken)."""
    if mine.eval_split != "eval" or mine.task != "listops" or mine.train_path:
        return False
    same = (not theirs.train_path and _listops_seed(mine) == _listops_seed(theirs)
            and all(getattr(mine, f) == getattr(theirs, f) for f in _LISTOPS_STREAM))
    held = theirs.listops_num_eval if theirs.eval_split == "validation" else 0  # its last
    return same and theirs.listops_num_train - held > mine.listops_num_train


def _first_differing(fields) -> str | None:
    """The first (field, mine, theirs) that differs, as "field=theirs (this run: mine)"."""
    for field, a, b in fields:
        if a != b:
            return f"{field}={b!r} (this run: {a!r})"
    return None


def _text_fields(mine, theirs) -> list[tuple]:
    """(field, mine, theirs) of what sets the training text of DataConfigs `mine` and
    `theirs`: the files, whether the train file's last lines are held out, the shipped
    corpus's split."""
    from hpnlp.config.fields import same_data_path
    # a path saved relative (before session 98) and this run's absolute one: the same file
    fields = [(f"data.{f}", a, a if same_data_path(b, a) else b)
              for f, a, b in (("train_path", mine.train_path, theirs.train_path),
                              ("prepared", mine.prepared, theirs.prepared))]
    if mine.train_path and bool(mine.eval_path) != bool(theirs.eval_path):
        # without data.eval_path the train file's last lines are held out, so the words and
        # pieces come from other text (a bug hunt, session 100: two word runs of one file,
        # 478 of 500 ids other words, drafted and distilled for each other unsaid)
        fields.append(("data.eval_path", mine.eval_path, theirs.eval_path))
    if not (mine.train_path or mine.eval_path or mine.prepared):  # found in review: the
        # shipped corpus's training chapters depend on the split, and so do words and pieces
        fields.append(("data.eval_split", mine.eval_split, theirs.eval_split))
    return fields


# WORKDIR/text.json: what a run's training text was (`train_text_digest`), kept beside its
# checkpoints by the Trainer where the text is a user's file or a prepared folder
TEXT_FILE = "text.json"


def train_text_digest(cfg) -> str | None:
    """The sha256 of what DataConfig `cfg`'s vocabulary and token counts are built from, where
    that is a user's file or a prepared folder (the shipped corpus's text is fixed per
    data.eval_split): data.train_path's bytes, or a prepared folder's train split as prepare
    recorded it (its shards and their sha256s), its tokenizer and its train counts. None for
    other tasks, or where it cannot be read (building the task names that)."""
    import hashlib
    import json

    from hpnlp.data import sharded
    if cfg.task not in LM_TASKS or not (cfg.prepared or cfg.train_path):
        return None
    try:
        if not cfg.prepared:
            return sharded.file_sha256(cfg.train_path)
        with open(os.path.join(cfg.prepared, sharded.META_FILE)) as f:
            meta = json.load(f)
        h = hashlib.sha256(json.dumps([meta["splits"]["train"], meta["tokenizer"]],
                                      sort_keys=True).encode())
        h.update(sharded.file_sha256(os.path.join(cfg.prepared, sharded.COUNTS_FILE)).encode())
        return h.hexdigest()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepared_eval_digest(cfg) -> str | None:
    """A digest of DataConfig `cfg`'s prepared folder's eval split (its meta entry and eval
    target counts), as `train_text_digest` is of its train split; None where it cannot be
    read (its reader's own error names it)."""
    import hashlib
    import json

    from hpnlp.data import sharded
    try:
        with open(os.path.join(cfg.prepared, sharded.META_FILE)) as f:
            split = json.load(f)["splits"]["eval"]
        h = hashlib.sha256(json.dumps(split, sort_keys=True).encode())
        h.update(sharded.file_sha256(os.path.join(cfg.prepared,
                                                  sharded.EVAL_TARGET_COUNTS_FILE)).encode())
        return h.hexdigest()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def task_text_digest(task) -> str | None:
    """The `train_text_digest` a built Task was made with (its meta's), or None."""
    digest = task.meta.get("text_digest")
    return digest if isinstance(digest, str) else None


def save_text_record(task, cfg, workdir: str) -> None:
    """Keep what the training text of a run (DataConfig `cfg`, its built `task`) in `workdir`
    is (TEXT_FILE), for the runs that later distill from it or start from it to compare
    (`different_text`); a stale one is removed where the text has no digest (the shipped
    corpus). Process 0 of a run started from step 0 calls it, at its first save."""
    from hpnlp.paths import write_json
    path = os.path.join(workdir, TEXT_FILE)
    digest = task_text_digest(task)
    if digest is None:
        if os.path.exists(path):
            os.remove(path)
        return
    field = "data.prepared" if cfg.prepared else "data.train_path"
    write_json(path, {"field": field, "path": cfg.prepared or cfg.train_path, "sha256": digest})


def kept_text(workdir: str) -> dict | None:
    """The contents of the run in `workdir`'s TEXT_FILE ({"field", "sha256"}), or None."""
    import json
    try:
        with open(os.path.join(workdir, TEXT_FILE)) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


def _kept_text_digest(workdir: str, field: str, kept: dict | None = None) -> str | None:
    """The digest of the `field` text the run in `workdir` trained on (its TEXT_FILE; `kept`:
    its contents, where given), or None: a run saved before it was kept, or of other text."""
    kept = kept_text(workdir) if kept is None else kept
    try:
        digest = kept["sha256"] if kept["field"] == field else None
    except (KeyError, TypeError):
        return None
    return digest if isinstance(digest, str) else None


def _changed_text(mine, their_workdir: str | None, my_text: str | None) -> str | None:
    """Where the run in `their_workdir` trained on data.train_path (or data.prepared) as
    `mine` names it, but with other contents than `my_text` (this run's `train_text_digest`):
    that field and both digests, for an error; else None. A review (r3): two word runs of
    one file edited between them passed as the same text, their paths compared, and the
    ids of one named other words in the other; a count-laid-out output, another tree."""
    if not (their_workdir and my_text):
        return None
    field = "data.prepared" if mine.prepared else "data.train_path"
    theirs = _kept_text_digest(their_workdir, field)
    if theirs is None or theirs == my_text:
        return None
    return (f"{field}={mine.prepared or mine.train_path!r} as it was then: its contents changed "
            f"since that run trained (sha256 {theirs[:12]}..., now {my_text[:12]}...)")


def different_text(mine, theirs, their_workdir: str | None = None,
                   my_text: str | None = None) -> str | None:
    """What makes the training text of a run trained with DataConfig `theirs` (in
    `their_workdir`, where given) other than `mine`'s (as `different_encoding` says it), or
    None: for two runs that encode alike, what makes their token counts (`Task.token_counts`)
    differ. Bytes are bytes whatever the text, but their counts are the text's (a bug hunt,
    session 103: a distillation teacher's Huffman tree was rebuilt from the student's
    counts). `my_text`: this run's `train_text_digest`, compared with the one that run kept
    where both are known; None compares the fields alone."""
    return (_first_differing(_text_fields(mine, theirs))
            or _changed_text(mine, their_workdir, my_text))


def _encoder_name(c) -> str:
    """The encoding a DataConfig's task reads text with ("bytes", "words", a subword kind,
    or "" for a task of no text): verse_book encodes with word_lm's words, learned from its
    training chapters (review r2: two splits' runs passed as one)."""
    if c.task in LM_TASKS:
        return text_tasks.lm_tokenizer(c, c.task)
    return "words" if c.task == "verse_book" else c.tokenizer


def different_encoding(mine, theirs, their_workdir: str | None = None,
                       my_sha256: str | None = None, my_text: str | None = None) -> str | None:
    """What makes a run trained with DataConfig `theirs` (in `their_workdir`, where given)
    encode text otherwise than `mine` (this run's, whose subword model's sha256 is
    `my_sha256` where given: `task_tokenizer_sha256`) (the field and both values, for an
    error), or None where the two encode alike: the same task and tokenizer (byte_lm's and
    word_lm's own named or not), and, for a vocabulary learned from the training text (words,
    verse_book's too; subwords), the same model where both subword models are known
    (`tokenizer_sha256`), else the same text (`different_text`, with `my_text`): a tokenizer
    is trained deterministically, so the same kind, size and text give the same pieces.
    Bytes are bytes whatever the text."""
    name = _encoder_name
    first = _first_differing
    why = first([("data.task", mine.task, theirs.task),
                 ("data.tokenizer", name(mine), name(theirs))])
    if why or name(mine) in ("", "bytes"):
        return why
    # Subword models on disk on both sides are compared themselves, not the paths they came
    # from (a bug hunt, session 96: a folder prepared with that run's own tokenizer was
    # refused, and one prepared anew at the same path would have passed); this run's own
    # too, as its task holds it (a bug hunt (session 102): data.train_path edited between the
    # runs, the same path and size passed, and a student trained against a teacher of other
    # pieces; from memory, not the file, which only process 0 writes)
    a, b = my_sha256 or tokenizer_sha256(mine), tokenizer_sha256(theirs, their_workdir)
    if a and b:
        return None if a == b else (f"another {name(mine)} tokenizer (its model's sha256 "
                                    f"{b[:12]}..., this run's {a[:12]}...)")
    why = different_text(mine, theirs, their_workdir, my_text)
    if why or mine.prepared:  # (review, session 96: the sizes read after, a folder gone
        return why            # failed inside task_info) a prepared folder's size is its own
    size = "word_vocab_size" if name(mine) == "words" else "vocab_size"  # the size asked for
    if task_info(mine)["vocab_size"] != task_info(theirs)["vocab_size"]:
        return first([("data." + size, getattr(mine, size), getattr(theirs, size))])
    return None


def task_tokenizer_sha256(task) -> str | None:
    """The sha256 of the subword model a built Task encodes with (its meta's), or None
    (bytes, words): what every process of a run holds, whoever saved the file."""
    sha = (task.meta.get("tokenizer") or {}).get("model_sha256")
    return sha if isinstance(sha, str) else None


def tokenizer_sha256(cfg, workdir: str | None = None) -> str | None:
    """The sha256 of the subword model that encodes DataConfig `cfg`'s text, where one is on
    disk: the one a run kept (`workdir`/tokenizer), else its `data.prepared` folder's; None
    where neither is (a tokenizer trained when the data is built, or none)."""
    import json
    places = [os.path.join(workdir, tokenizers.DIRNAME, tokenizers.META_FILE)] if workdir else []
    if cfg.prepared:
        places.append(os.path.join(cfg.prepared, "meta.json"))
    for path in places:
        try:
            with open(path) as f:
                meta = json.load(f)
            sha = meta.get("model_sha256") or meta.get("tokenizer", {}).get("model_sha256")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(sha, str):
            return sha
    return None


def check_files_of_run(cfg, workdir: str) -> None:
    """A run read (not trained) whose data.train_path or data.eval_path (DataConfig `cfg`,
    its config.json's: absolute since session 98) is not there now is a ConfigError naming
    the field and the fix (a bug hunt, session 98: a project moved, "no such file")."""
    from hpnlp.config import config_error
    for field in ("train_path", "eval_path"):
        path = getattr(cfg, field)
        if path and not os.path.exists(path):
            raise config_error(f"data.{field}", path, f"the run in {workdir} read this file, "
                               "which is not there now (moved?); restore it, or set "
                               f"data.{field} in {os.path.join(workdir, 'config.json')} to "
                               "where it is now")


def check_text_of_run(cfg, task, workdir: str, *, kept: dict | None = None) -> None:
    """A run resumed or read (Config `cfg`, its `task` built now) whose vocabulary is learned
    from its training text (words; a subword model not kept with the run) or whose output
    layer is laid out by that text's token counts, with data.train_path's (or
    data.prepared's) contents changed since it trained (its TEXT_FILE): a ConfigError naming
    the field and the fix, before any weights are read. Bytes are bytes whatever the text.
    A bug hunt (session 110): `generate` of a word run whose file had one word replaced by
    another everywhere decoded the new word, its id given to the old one's embedding (the
    same ids in the same places: the data stream's digest of them passed).

    `kept`: the run's TEXT_FILE contents as a folder made from it keeps them (a quantized
    model's quant.json, whose run, `workdir`, is gone: a review, session 118); a vocabulary
    learned from the text (words: a subword model is refused there without its run's) is then
    taken as read from it."""
    from hpnlp.compress.distill import counts_shape_output
    from hpnlp.config import config_error
    my_text = task_text_digest(task)
    if not my_text:
        return
    field = "data.prepared" if cfg.data.prepared else "data.train_path"
    theirs = _kept_text_digest(workdir, field, kept)
    if theirs is None or theirs == my_text:
        return
    vocab = (_encoder_name(cfg.data) not in ("", "bytes") if kept is not None else
             different_encoding(cfg.data, cfg.data, workdir, task_tokenizer_sha256(task), my_text))
    what = [w for w, reads in (
        ("vocabulary", vocab),
        ("output layer's layout (its token counts)", counts_shape_output(cfg))) if reads]
    if what:
        where = ("as the quantized folder's quant.json keeps it" if kept is not None
                 else os.path.join(workdir, TEXT_FILE))
        raise config_error(field, cfg.data.prepared or cfg.data.train_path,
                           f"the run in {workdir} trained on its contents as they were then "
                           f"(sha256 {theirs[:12]}..., {where}), "
                           f"which changed since (now {my_text[:12]}...), and its "
                           f"{' and '.join(what)} would be built from the new contents under "
                           "its trained weights; restore that file, or train a new run on it")


def check_prepared_of_run(cfg, workdir: str) -> None:
    """A run that has trained from `data.prepared` (DataConfig `cfg`; its tokenizer kept in
    `workdir`) is resumed or read with that folder as it was: one gone, or holding another
    subword model now, is a ConfigError naming it and the fix (a bug hunt, session 96: told
    to write the folder with a new preparation, or refused for its data stream)."""
    from hpnlp.config import config_error
    from hpnlp.train.checkpoint import has_checkpoint
    if not (cfg.prepared and has_checkpoint(workdir)):
        return
    kept = os.path.join(workdir, tokenizers.DIRNAME)

    def again(aside: str) -> str:
        return (f"restore it, or {aside}prepare the corpus there again with the run's own "
                f"tokenizer (python -m hpnlp.data.prepare --tokenizer_from {workdir} --out "
                f"{cfg.prepared} ...)" if os.path.isdir(kept) else "restore it")
    if not os.path.exists(os.path.join(cfg.prepared, "meta.json")) and not os.path.exists(
            os.path.join(cfg.prepared, "progress.json")):
        raise config_error("data.prepared", cfg.prepared, f"the run in {workdir} was trained "
                           "from this folder, which holds no meta.json now (moved or "
                           "deleted?), and reads its vocabulary, token counts and shards "
                           f"there; {again('')}, or set data.prepared in "
                           f"{os.path.join(workdir, 'config.json')} to where it is now")
    theirs = tokenizer_sha256(dataclasses.replace(cfg, prepared=""), workdir)
    mine = tokenizer_sha256(cfg)
    if theirs and mine and theirs != mine:
        raise config_error("data.prepared", cfg.prepared, f"this folder's tokenizer (sha256 "
                           f"{mine[:12]}...) is not the one the run in {workdir} was trained "
                           f"with ({kept}, sha256 {theirs[:12]}...); {again('move it aside and ')}")


def byte_ids(cfg) -> bool:
    """Whether the task of DataConfig `cfg` reads UTF-8 bytes as its token ids (the byte-level
    text tasks, and an LM task with the bytes tokenizer): any two such tasks share their ids."""
    if cfg.task in LM_TASKS:
        return text_tasks.lm_tokenizer(cfg, cfg.task) == "bytes"
    return cfg.task in BYTE_TASKS


def task_info(cfg) -> dict:
    """{"kind", "vocab_size", "num_classes"} (and, for LM tasks, "frequency_sorted": whether
    id 0 is the most frequent token and counts fall with the id) without building the data
    set (for config validation before anything compiles). word_lm on a user file reports
    data.word_vocab_size, an upper bound on the vocabulary make_task will build."""
    make, info = _entry(cfg)
    if cfg.prepared:
        from hpnlp.data import sharded
        return sharded.info(cfg, cfg.task)
    return info(cfg, cfg.task)


def make_task(cfg, *, workdir: str | None = None, save_tokenizer: bool = True) -> Task:
    """Build the task named by cfg.task (DataConfig); deterministic in cfg.seed. A subword
    tokenizer (data.tokenizer) is kept in `workdir`/tokenizer: loaded when there, else trained
    and saved there (unless `save_tokenizer` is False); without a workdir it is trained in
    memory. With data.prepared the task reads on-disk shards (hpnlp/data/sharded.py). An LM
    task of a user's file or a prepared folder holds its `train_text_digest` (meta
    "text_digest": `task_text_digest`)."""
    make, _ = _entry(cfg)
    if cfg.prepared:
        from hpnlp.data import sharded
        task = sharded.make_task(cfg, cfg.task, workdir=workdir if save_tokenizer else None)
    elif cfg.task in LM_TASKS:
        task = make(cfg, cfg.task, save_tokenizer=save_tokenizer,
                    tokenizer_dir=os.path.join(workdir, tokenizers.DIRNAME) if workdir else None)
    else:
        return make(cfg, cfg.task)
    digest = train_text_digest(cfg)  # what the text was: a user's file, a prepared folder
    return dataclasses.replace(task, meta={**task.meta, "text_digest": digest}) if digest else task


def make_iterator(task: Task, cfg, *, split: str, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> BatchIterator:
    """Batches of `split` ("train": infinite, shuffled; "eval": one pass). `batch_size` is
    global: process p of n gets rows [p*B/n, (p+1)*B/n) of the same global batch."""
    if task.meta.get("prepared"):  # on-disk shards read through grain
        from hpnlp.data.sharded import ShardedIterator
        return ShardedIterator(task, cfg, split=split, batch_size=batch_size,
                               process_index=process_index, process_count=process_count)
    if cfg.batching == "stream":  # rows continue across batches (Transformer-XL memory)
        from hpnlp.data.stream import StreamIterator
        return StreamIterator(task, cfg, split=split, batch_size=batch_size,
                              process_index=process_index, process_count=process_count)
    return BatchIterator(task, cfg, split=split, batch_size=batch_size,
                         process_index=process_index, process_count=process_count)


__all__ = ["BatchIterator", "Examples", "Task", "make_iterator", "make_task", "task_info",
           "task_names"]
