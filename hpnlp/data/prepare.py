"""Tokenize a corpus into on-disk shards that training streams through grain.

    python -m hpnlp.data.prepare --input 'corpus/*.txt' --tokenizer bpe --vocab_size 8000 \\
        --out /tmp/hpnlp/prepared
    python -m hpnlp.main --config experiments/lm.py:bytes --workdir /tmp/hpnlp/big \\
        --config.data.prepared=/tmp/hpnlp/prepared --config.data.tokenizer=bpe \\
        --config.data.vocab_size=8000

Inputs are plain text (a document is a paragraph: a run of non-blank lines, as for
`data.train_path`) or JSON lines (`--format jsonl`, or files ending in .jsonl, .json or
.ndjson, in any case: one document per line, its `--text_field`). The eval split is
`--eval_input`, or else every
`--eval_every`-th document. The tokenizer is `bytes`, or a `bpe`/`unigram` SentencePiece
model trained on an even sample of the training documents (at most `--tokenizer_sample_mb`)
or reused from a folder that holds one (`--tokenizer_from`: a run's workdir, another
prepared folder, or the tokenizer folder itself; its kind and size unless given).

Output (hpnlp/data/sharded.py reads it): `{train,eval}-NNNNN.array_record` (one record per
document, ids as uint8/uint16/int32), `counts-train.npy`, `counts-eval-targets.npy`, the
tokenizer and `meta.json`, written last. Memory is bounded (documents are tokenized in
batches of `--batch_mb` and written as they come; a document larger than that is one batch
on its own, tokenized whole at several times its size), a progress bar follows the input bytes,
and the work is checkpointed every `--shard_mb` of input: rerun the same command after an
interruption and it continues from the last checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Iterator

import numpy as np

from hpnlp.data import corpus, sharded, text_tasks, tokenizers
from hpnlp.paths import write_json
from hpnlp.progress import bar_interval
from hpnlp.stopping import Stopped, sigterm_as_interrupt

PROGRESS_FILE = "progress.json"  # checkpoint of an unfinished preparation
PROGRESS_COUNTS = "progress-counts.npz"
SAMPLE_MB = 256  # --tokenizer_sample_mb's default
EVAL_EVERY = 100  # --eval_every's default: document i is eval when i % 100 == 99
EVAL_CHECK_MB = 64  # --eval_input up to this size is read through before the train split


class PrepareError(ValueError):
    """Bad input to prepare: the message names the file (and line) and the fix."""


_NO_EVAL_TEXT = ("--eval_input {}: no eval text found (every document was empty); check the "
                 "files")
_NO_TRAIN_TEXT = ("--input {}: no training text found (every document was empty or went to "
                  "eval); check the files and --eval_every")
_NO_EVAL_DOC = ("--input {}: no eval document (fewer than --eval_every={} documents?); lower "
                "--eval_every or give --eval_input")


def expand(pattern: str, flag: str, out: str | None = None) -> list[str]:
    """The files of a comma-joined list of paths and globs; a glob's hits in `out` (--out, a
    folder inside the input's) left out."""
    paths, seen = [], {}
    mine = os.path.realpath(out) + os.sep if out else None
    for part in pattern.split(","):
        part = part.strip()
        if not part:
            raise PrepareError(f"{flag} {pattern!r} has an empty entry (a stray comma, or an "
                               "empty value); name the files, joined by commas")
        # a file's own name first, though it holds *?[ (a review, session 116: vol[1].txt
        # was read as a glob, another file prepared or "matches no file")
        hits = sorted(glob.glob(part)) if any(c in part for c in "*?[") and \
            not os.path.isfile(part) else [part]
        # a bug hunt (session 96): the rerun of `--input 'c2/*' --out c2/prep` met its own
        # output folder as an input ("is a folder")
        kept = [h for h in hits if part == h or not mine
                or not (os.path.realpath(h) + os.sep).startswith(mine)]
        if hits and not kept:
            raise PrepareError(f"{flag} {part!r} matches only --out {out} and its files; name "
                               "the input files, or choose an --out outside them")
        if not kept:
            raise PrepareError(f"{flag} {part!r} matches no file; check the path or the quotes "
                               "around the pattern")
        paths += kept
    for i, p in enumerate(paths):
        if os.path.isdir(p):
            raise PrepareError(f"{p}: is a folder ({flag}); name its files, e.g. '{p}/*.txt'")
        if not os.path.isfile(p):
            raise PrepareError(f"{p}: no such file ({flag}); give a text or JSON-lines file")
        if not os.access(p, os.R_OK):
            raise PrepareError(f"{p}: cannot be read (permissions); fix them or copy the file")
        if os.path.getsize(p) == 0:
            raise PrepareError(f"{p}: file is empty ({flag}); remove it from the input or add text")
        st = os.stat(p)  # a bug hunt (session 96): read twice, one copy could go to eval
        if (j := seen.setdefault((st.st_dev, st.st_ino), i)) != i:
            also = f" (as {paths[j]} and {p})" if paths[j] != p else ""
            raise PrepareError(f"{p}: given twice in {flag}{also}; name each file once")
    return paths


def _json_kind(obj) -> str:
    """JSON's name for what json.loads gave (a str is a "string")."""
    return {str: "string", list: "array", dict: "object", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(obj), type(obj).__name__)


JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # `--format auto`'s, in any case


def _is_jsonl(path: str, fmt: str) -> bool:
    # (a review, session 117: .ndjson and .JSONL files were read as text, each whole file
    # one document of JSON syntax)
    return fmt == "jsonl" or (fmt == "auto" and path.lower().endswith(JSONL_SUFFIXES))


def _check_not_compressed(path: str, head: bytes) -> None:
    if (why := corpus.compressed_error(path, head)) is not None:
        raise PrepareError(f"{path}: {why} and give the text file")


def documents(path: str, *, fmt: str, text_field: str, offset: int = 0,
              line: int = 0) -> Iterator[tuple[str, int, int]]:
    """(document, byte offset after it, line number after it) from `offset`; plain text by
    paragraphs, JSON lines by line. Errors name the file and the line."""
    jsonl = _is_jsonl(path, fmt)
    with open(path, "rb") as f:
        _check_not_compressed(path, f.read(10))
        f.seek(offset)
        pos, lineno, cur = offset, line, []
        while True:
            raw = f.readline()
            if not raw:
                break
            pos += len(raw)
            lineno += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if pos == len(raw) and raw.startswith(corpus.UTF16_BOMS):
                    raise PrepareError(f"{path}: {corpus.UTF16_BOM_ERROR}") from None
                raise PrepareError(f"{path}:{lineno}: byte {raw[e.start]:#04x} is not UTF-8 "
                                   f"({e.reason}); re-encode the file (e.g. `iconv -f latin1 -t "
                                   "utf-8`)") from None
            if "\0" in text:  # valid UTF-8, but no text (found by a README walk: taken)
                raise PrepareError(f"{path}:{lineno}: a NUL byte, so this is a binary file or "
                                   "UTF-16 without a byte-order mark, not UTF-8 text; give text "
                                   "(re-encode UTF-16, e.g. `iconv -f utf-16le -t utf-8`)")
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if jsonl:
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except ValueError as e:
                    raise PrepareError(f"{path}:{lineno}: not a JSON object ({e}); each line of a "
                                       "JSON-lines file must be one object") from None
                if not isinstance(obj, dict):
                    raise PrepareError(f"{path}:{lineno}: a JSON {_json_kind(obj)}, not an "
                                       "object; each line of a JSON-lines file must be one "
                                       f"object with the text in its {text_field!r} field")
                if text_field not in obj:
                    raise PrepareError(f"{path}:{lineno}: no {text_field!r} field (has "
                                       f"{sorted(obj)}); name the text field with --text_field")
                if not isinstance(obj[text_field], str):
                    raise PrepareError(f"{path}:{lineno}: field {text_field!r} holds a JSON "
                                       f"{_json_kind(obj[text_field])}, not text; give the "
                                       "text as a string, or name another field with --text_field")
                doc = obj[text_field]
                try:  # JSON's \ud83d escapes: a surrogate alone is no character (no UTF-8)
                    doc.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise PrepareError(
                        f"{path}:{lineno}: field {text_field!r} holds {doc[e.start]!r} at "
                        f"character {e.start}, a lone UTF-16 surrogate (a \\u escape cut "
                        "from its pair), which is not valid Unicode; remove or repair it "
                        "(e.g. decode the source with errors='replace')") from None
                if doc:
                    yield doc, pos, lineno
                continue
            body = text.rstrip("\n").rstrip("\r")
            if body.strip():
                cur.append(body)
            elif cur:
                yield "\n".join(cur) + "\n", pos, lineno
                cur = []
        if cur:
            yield "\n".join(cur) + "\n", pos, lineno


def _all_documents(paths, args, start=(0, 0, 0)):
    """(file index, document, offset, line) over every file from a checkpoint."""
    fi0, off0, line0 = start
    for fi in range(fi0, len(paths)):
        off, line = (off0, line0) if fi == fi0 else (0, 0)
        for doc, pos, lineno in documents(paths[fi], fmt=args.format, text_field=args.text_field,
                                          offset=off, line=line):
            yield fi, doc, pos, lineno


def _tokenizer_from(d: str):
    """The tokenizer saved in `d` (a run's workdir, a prepared folder or a tokenizer folder)."""
    for cand in (d, os.path.join(d, tokenizers.DIRNAME)):
        if os.path.isfile(os.path.join(cand, tokenizers.META_FILE)):
            try:
                return tokenizers.Subword.load(cand, fix="name another tokenizer, or leave "
                                               "--tokenizer_from out to train one")
            except ValueError as e:
                raise PrepareError(f"--tokenizer_from {d}: {e}") from None
    raise PrepareError(f"--tokenizer_from {d}: holds no tokenizer ({tokenizers.DIRNAME}/"
                       f"{tokenizers.META_FILE}); name a run's workdir, a prepared folder "
                       "or a tokenizer folder")


def resolve_tokenizer_flags(args):
    """--tokenizer and --vocab_size as given; left out, those of --tokenizer_from's tokenizer,
    else bytes and 8000. Given and differing from --tokenizer_from's, or given for bytes
    (as --tokenizer_sample_mb): an error. Returns the --tokenizer_from tokenizer (None
    without the flag), loaded once for `make_tokenizer`."""
    tok = None
    if args.tokenizer_from:
        if args.tokenizer == "bytes":
            raise PrepareError(f"--tokenizer_from {args.tokenizer_from} reuses a bpe or unigram "
                               "tokenizer, and --tokenizer bytes needs none; drop one of the two")
        if args.tokenizer_sample_mb is not None:  # taken and ignored (a review of session 104)
            raise PrepareError(f"--tokenizer_from {args.tokenizer_from} reuses a trained "
                               f"tokenizer, which --tokenizer_sample_mb "
                               f"{args.tokenizer_sample_mb} does not size; drop one of the two")
        tok = _tokenizer_from(args.tokenizer_from)
        given = (args.tokenizer, args.vocab_size)
        args.tokenizer = tok.kind if args.tokenizer is None else args.tokenizer
        args.vocab_size = tok.vocab_size if args.vocab_size is None else args.vocab_size
        if (tok.kind, tok.vocab_size) != (args.tokenizer, args.vocab_size):
            named = " and ".join(f"--{f} {v}" for f, v in zip(("tokenizer", "vocab_size"), given)
                                 if v is not None)
            raise PrepareError(f"--tokenizer_from {args.tokenizer_from}: holds a {tok.kind} "
                               f"tokenizer of {tok.vocab_size} pieces, not what {named} asks for; "
                               "leave those flags out to take the tokenizer's, or make them agree")
    if args.tokenizer in (None, "bytes"):
        # a review (r6): taken and ignored, so `--vocab_size 32000` without `--tokenizer bpe`
        # prepared bytes, said only when a run asked for bpe
        how = "bytes (the default)" if args.tokenizer is None else "bytes (--tokenizer bytes)"
        for flag in ("vocab_size", "tokenizer_sample_mb"):
            if getattr(args, flag) is not None:
                raise PrepareError(f"--{flag} {getattr(args, flag)} sizes a bpe/unigram tokenizer, "
                                   f"and the tokenizer is {how}; add --tokenizer bpe or unigram, "
                                   f"or drop --{flag}")
        args.tokenizer = "bytes"
    if args.vocab_size is None:
        args.vocab_size = 8000
    if args.tokenizer_sample_mb is None:
        args.tokenizer_sample_mb = SAMPLE_MB
    return tok


def make_tokenizer(args, paths: list[str], reused=None):
    """(encode_many, describe dict, tokenizer or None); `reused`: --tokenizer_from's, loaded."""
    if args.tokenizer == "bytes":
        return (lambda docs: [text_tasks.byte_encode(d) for d in docs],
                {"kind": "bytes", "vocab_size": 256}, None)
    if args.tokenizer_from:
        tok = reused or _tokenizer_from(args.tokenizer_from)
        return tok.encode_many, tok.describe(), tok
    # An even sample of training documents: every k-th, k from the input size.
    total = sum(os.path.getsize(p) for p in paths)
    stride = max(1, -(-total // (args.tokenizer_sample_mb << 20)))
    sample, i, held = [], 0, 0
    for j, (_, doc, _, _) in enumerate(_all_documents(paths, args)):
        if not args.eval_input and j % args.eval_every == args.eval_every - 1:
            held += 1
            continue  # an eval document (found in review: the tokenizer learned from them)
        if i % stride == 0:
            sample.append(doc)
        i += 1
    if not args.eval_input and i and not held:  # a bug hunt (session 98): this was said
        # only after the tokenizer was trained and every document tokenized
        raise PrepareError(_NO_EVAL_DOC.format(args.input, args.eval_every))
    if not i:  # a review (r6): said as "the tokenizer's training text is empty", unnamed
        raise PrepareError(_NO_TRAIN_TEXT.format(args.input))
    # MiB of UTF-8, as --tokenizer_sample_mb (a bug hunt, session 96: of characters)
    print(f"training a {args.tokenizer} tokenizer of {args.vocab_size} pieces on "
          f"{len(sample)} documents ({sum(len(d.encode()) for d in sample) / 2**20:.1f} MiB: "
          "a large sample trains for minutes, in about 30 times its size in memory; "
          "--tokenizer_sample_mb bounds both)", file=sys.stderr)
    tok = tokenizers.train(args.tokenizer, args.vocab_size, sample, field="--vocab_size",
                           source=f"--input {args.input}")
    return tok.encode_many, tok.describe(), tok


def _check_out(out: str) -> None:
    """PrepareError where --out cannot hold the corpus: not a folder, or one holding a
    training run or other files (a folder of this tool's own is resumed or refused by its
    settings in `prepare`)."""
    from hpnlp.paths import check_new_output, check_writable_dir
    try:
        check_writable_dir(out, "--out")
        if os.path.isdir(out) and not {sharded.META_FILE, PROGRESS_FILE} & set(os.listdir(out)):
            check_new_output(out, None)
    except ValueError as e:
        raise PrepareError(str(e)) from None


def _read_own_json(path: str, keys: tuple[str, ...]) -> dict:
    """This tool's meta.json or progress.json in --out; PrepareError naming it where it is
    damaged (not JSON, or without `keys`)."""
    try:
        with open(path) as f:
            obj = json.load(f)
        why = None if isinstance(obj, dict) else f"a JSON {_json_kind(obj)}, not an object"
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        obj, why = None, str(e)
    missing = [k for k in keys if k not in obj] if why is None else []
    if why or missing:
        why = why or f"no {' or '.join(map(repr, missing))} entry"
        raise PrepareError(f"{path} is damaged ({why}), so the folder cannot be resumed or "
                           "reused; delete the folder to prepare it afresh, or choose a new --out")
    return obj


def _counts_files(out: str) -> list[str]:
    """The token counts an unfinished preparation saved (`progress-counts*.npz`; the one its
    progress names, and any a kill left beside it)."""
    return glob.glob(os.path.join(out, "progress-counts*.npz"))


def _discard(out: str, created: bool) -> None:
    """Remove what an unfinished preparation wrote in `out` (the folder itself if this call
    made it)."""
    import shutil
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    if os.path.exists(os.path.join(out, PROGRESS_FILE)):
        os.remove(os.path.join(out, PROGRESS_FILE))
    for f in glob.glob(os.path.join(out, "*-*.array_record")) + _counts_files(out):
        os.remove(f)
    shutil.rmtree(os.path.join(out, tokenizers.DIRNAME), ignore_errors=True)


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _settings_diff(saved, settings: dict) -> str:
    """What differs between the settings a folder was prepared with and this command's, as
    flags: " (--shard_mb: was 1, now 2)", " (--input now also matches big/k9.txt)", or ""
    (a bug hunt, session 98: "with other settings" named none, so a glob matching one more
    file now read as the same command refused)."""
    if not isinstance(saved, dict):
        return " (its settings are not recorded)"
    said = []
    for key in ("inputs", "eval_inputs"):
        flag = "--input" if key == "inputs" else "--eval_input"
        was, now = saved.get(key) or [], settings[key]
        added = [p for p in now if p not in was]
        gone = [p for p in was if p not in now]
        for files, how in ((added, "now also matches"), (gone, "no longer matches")):
            if files:
                more = f" and {len(files) - 3} more" if len(files) > 3 else ""
                said.append(f"{flag} {how} {', '.join(map(_shown, files[:3]))}{more}")
        if not (added or gone) and was != now:
            said.append(f"{flag} lists its files in another order")
    defaults = {"tokenizer_sample_mb": SAMPLE_MB, "tokenizer_from_sha256": None}
    for key in dict.fromkeys([*settings, *saved]):
        if key in ("inputs", "eval_inputs") or key == "eval_every" and (
                0 in (saved.get(key), settings.get(key))):  # --eval_input named above
            continue
        was, now = saved.get(key, defaults.get(key)), settings.get(key, defaults.get(key))
        if was == now:
            continue
        if key == "tokenizer_from_sha256":
            was, now = (f"sha256 {x[:12]}..." if isinstance(x, str) else "not given"
                        for x in (was, now))
            key = "tokenizer_from"
        said.append(f"--{key}: was {was}, now {now}")
    return f" ({'; '.join(said)})" if said else ""


def prepare(args) -> dict:
    """`_prepare`, holding --out while it writes (released however it ends)."""
    held = []
    try:
        return _prepare(args, held)
    finally:
        for release in held:
            release()


def _prepare(args, held: list) -> dict:
    from array_record.python import array_record_module as ar
    from tqdm.auto import tqdm
    from hpnlp.config import ConfigError

    reused = resolve_tokenizer_flags(args)
    if args.tokenizer not in ("bytes",) + tokenizers.SUBWORD:
        raise PrepareError(f"--tokenizer {args.tokenizer!r}: choose bytes, bpe or unigram (word "
                           "vocabularies are built in memory: data.tokenizer='words' without "
                           "data.prepared)")
    paths = expand(args.input, "--input", args.out)
    eval_paths = expand(args.eval_input, "--eval_input", args.out) if args.eval_input else []
    both = [q for q in eval_paths if any(os.path.samefile(q, t) for t in paths)]
    if both:  # a bug hunt: taken, and every eval document was one trained on
        raise PrepareError(f"--eval_input {both[0]} is also an --input: the eval text must be "
                           "held out; give another file, or drop --eval_input (every "
                           "--eval_every-th document is then held out)")
    if args.text_field != "text" and not any(_is_jsonl(q, args.format)
                                             for q in paths + eval_paths):
        # found by a bug hunt: taken and ignored
        raise PrepareError(f"--text_field {args.text_field!r} names a field of JSON lines, but "
                           "no input is JSON lines (.jsonl/.json/.ndjson, or --format jsonl); drop "
                           "it, "
                           "or give --format jsonl")
    if eval_paths and args.eval_every is not None:  # a review (session 114): taken and ignored
        raise PrepareError(f"--eval_every {args.eval_every} holds out every N-th --input document, "
                           "and --eval_input names the eval text; drop one of the two")
    if args.eval_every is None:
        args.eval_every = EVAL_EVERY
    if not eval_paths and args.eval_every < 2:
        raise PrepareError("--eval_every must be >= 2 (every N-th document is eval) unless "
                           "--eval_input names the eval text")
    for flag, least in (("vocab_size", 1), ("tokenizer_sample_mb", 1), ("batch_mb", 1),
                        ("shard_mb", 0)):  # 0: a shard per document
        if getattr(args, flag) < least:
            raise PrepareError(f"--{flag} {getattr(args, flag)}: it must be >= {least}")
    if eval_paths and sum(map(os.path.getsize, eval_paths)) <= EVAL_CHECK_MB << 20:
        # a bug hunt (session 96): a bad eval line was met after the whole train split
        if not sum(1 for _ in _all_documents(eval_paths, args)):
            raise PrepareError(_NO_EVAL_TEXT.format(args.eval_input))
    out = args.out
    _check_out(out)
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    from hpnlp.paths import WRITING, hold_workdir
    # a review (session 117): the same command started again while the first still wrote
    # took its progress for a stopped run's and removed the shard it was writing
    held.append(hold_workdir(out, busy=WRITING))
    meta_path = os.path.join(out, sharded.META_FILE)
    settings = {"inputs": [os.path.abspath(p) for p in paths],
                "eval_inputs": [os.path.abspath(p) for p in eval_paths],
                "eval_every": 0 if eval_paths else args.eval_every, "format": args.format,
                "text_field": args.text_field, "tokenizer": args.tokenizer,
                "vocab_size": args.vocab_size if args.tokenizer != "bytes" else 256,
                "shard_mb": args.shard_mb}
    # a bug hunt: a rerun with another --tokenizer_from (or sample) was "already prepared" and
    # kept the old tokenizer; each is a setting where it is not the default (so that folders
    # prepared before keep matching their own flags)
    if reused is not None:
        settings["tokenizer_from_sha256"] = reused.describe()["model_sha256"]
    elif args.tokenizer != "bytes" and args.tokenizer_sample_mb != SAMPLE_MB:
        settings["tokenizer_sample_mb"] = args.tokenizer_sample_mb
    # a bug hunt: an input edited since was "already prepared" (or resumed at its old offset)
    stamps = {os.path.abspath(p): [st.st_size, st.st_mtime_ns]
              for p in paths + eval_paths for st in [os.stat(p)]}

    def changed(saved: dict, state: dict | None = None) -> str | None:
        """The first input edited since `saved`; with a checkpoint's `state`, of those it has
        read (a bug hunt, session 96: a fix to a file not read yet made the checkpoint
        unresumable): the files before its position, the one it stopped in, and all
        training files where the tokenizer trained here sampled them."""
        read = stamps if state is None else {os.path.abspath(p) for si, ps in enumerate(
            (paths, eval_paths)) for fi, p in enumerate(ps)
            if (si, fi) < (state["stream"], state["file"])
            or (si, fi) == (state["stream"], state["file"]) and state["offset"]
            or si == 0 and args.tokenizer != "bytes" and reused is None}
        return next((p for p, stamp in stamps.items()
                     if p in read and saved.get(p, stamp) != stamp), None)
    if os.path.isfile(meta_path):
        old = _read_own_json(meta_path, ())
        if old.get("settings") == settings and old.get("complete"):
            edited = changed(old.get("input_stamps", {}))
            if edited:
                raise PrepareError(f"--out {out} was prepared from {edited} "
                                   "before it changed (its size or modification time differ); "
                                   "delete that folder to prepare it again, or choose a new --out")
            try:  # a bug hunt (session 96): a damaged shard was "already prepared"
                sharded.check_prepared(out, old)
            except ValueError as e:
                raise PrepareError(str(e)) from None
            print(f"{out} is already prepared with these settings", file=sys.stderr)
            return old
        raise PrepareError(f"--out {out} already holds a prepared corpus made with other settings"
                           f"{_settings_diff(old.get('settings'), settings)}; choose a new --out "
                           "or delete that folder")
    progress_path = os.path.join(out, PROGRESS_FILE)
    progress = None
    if os.path.isfile(progress_path):
        progress = _read_own_json(progress_path, ("settings", "state"))
        if not os.path.isfile(os.path.join(out, progress.get("counts", PROGRESS_COUNTS))):
            raise PrepareError(f"--out {out} holds an unfinished preparation without its "
                               f"{progress.get('counts', PROGRESS_COUNTS)}, so it cannot be "
                               "resumed; delete the folder to "
                               "prepare it afresh, or choose a new --out")
        if progress["settings"] != settings:
            raise PrepareError(f"--out {out} holds an unfinished preparation with other "
                               f"settings{_settings_diff(progress['settings'], settings)}; rerun "
                               "it with its own flags, or choose a new --out")
        edited = changed(progress.get("input_stamps", {}), progress["state"])
        if edited:
            raise PrepareError(f"--out {out} holds an unfinished preparation of "
                               f"{edited}, which changed since (its "
                               "size or modification time differ), so it cannot be resumed; "
                               "delete the folder to prepare it afresh, or choose a new --out")
    tok_dir = os.path.join(out, tokenizers.DIRNAME)
    try:
        if progress and args.tokenizer != "bytes":  # resume with the tokenizer already trained
            # (a review, session 116: "delete the folder to train it again" led to "no such
            # folder": the kept shards were encoded with it, so only a fresh --out trains one)
            tok = tokenizers.Subword.load(tok_dir, fix=f"the shards kept in {out} were encoded "
                                          f"with it: delete {out} to prepare afresh, or choose "
                                          "a new --out")
            encode_many, tok_info = tok.encode_many, tok.describe()
        else:
            encode_many, tok_info, tok = make_tokenizer(args, paths, reused)
            if tok is not None:
                tok.save(tok_dir)
    except (ConfigError, ValueError) as e:  # ValueError: SentencePiece refusing the settings
        if not progress:  # a bug hunt (session 98): a bad input met while sampling left --out
            _discard(out, created)
        raise PrepareError(str(e)) from None
    V = tok_info["vocab_size"]
    dtype = sharded.ids_dtype(V)

    # Both splits' documents as one ordered stream: (split, file index, doc, offset, line).
    streams = [("train", paths)] + ([("eval", eval_paths)] if eval_paths else [])
    if progress:
        state = progress["state"]
        npz = np.load(os.path.join(out, progress.get("counts", PROGRESS_COUNTS)))
        counts = {"train": npz["train"], "eval_targets": npz["eval_targets"]}
        for split in ("train", "eval"):  # shards past the checkpoint are partial: redo them
            keep = set(state["shards"][split])
            for f in glob.glob(os.path.join(out, f"{split}-*.array_record")):
                if os.path.basename(f) not in keep:
                    os.remove(f)
    else:
        state = {"stream": 0, "file": 0, "offset": 0, "line": 0, "doc": 0, "bytes": 0,
                 "next_shard": 0, "shards": {"train": [], "eval": []},
                 "documents": {"train": 0, "eval": 0}, "tokens": {"train": 0, "eval": 0}}
        counts = {"train": np.zeros(V, np.int64), "eval_targets": np.zeros(V, np.int64)}
    total_bytes = sum(os.path.getsize(p) for _, ps in streams for p in ps)
    bar = tqdm(total=total_bytes, initial=state["bytes"], unit="B", unit_scale=True,
               desc="prepare", dynamic_ncols=True, disable=args.quiet,
               mininterval=bar_interval())
    writers: dict = {}

    def open_writer(split):
        name = f"{split}-{state['next_shard']:05d}.array_record"
        writers[split] = (ar.ArrayRecordWriter(os.path.join(out, name), "group_size:1"), name)

    def checkpoint(where):
        for split, (w, name) in writers.items():
            w.close()
            state["shards"][split].append(name)
            # each shard's digest, for a run's data state (a bug hunt, session 100: a resume
            # trained on a folder prepared again from an edited text silently)
            state.setdefault("sha256", {"train": [], "eval": []})[split].append(
                sharded.file_sha256(os.path.join(out, name)))
        writers.clear()
        state.update(where)
        state["next_shard"] += 1
        save_progress()

    def save_progress():
        # the counts under a name of their own, which the progress names: a kill between the
        # two writes leaves the progress with the counts it was saved with (a bug hunt: one
        # file replaced before the other would count the documents between twice)
        name = f"progress-counts-{state['next_shard']:05d}.npz"
        np.savez(os.path.join(out, name + ".tmp.npz"), **counts)
        os.replace(os.path.join(out, name + ".tmp.npz"), os.path.join(out, name))
        write_json(progress_path, {"settings": settings, "state": state,
                                   "input_stamps": stamps, "counts": name})
        for f in _counts_files(out):
            if os.path.basename(f) != name:
                os.remove(f)

    if not progress:  # found in review: stopped before its first shard's checkpoint, a run
        save_progress()  # left files its rerun refused as another's; now it starts over
    shard_bytes, batch_bytes = args.shard_mb << 20, args.batch_mb << 20
    pending, pending_bytes, since_ckpt = [], 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        ids = encode_many([d for _, d in pending])
        for (split, _), x in zip(pending, ids):
            if not len(x):
                continue
            if split not in writers:
                open_writer(split)
            writers[split][0].write(x.astype(dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes())
            state["documents"][split] += 1
            state["tokens"][split] += len(x)
            if split == "train":
                counts["train"] += np.bincount(x, minlength=V)
            else:
                counts["eval_targets"] += np.bincount(x[1:], minlength=V)
        pending, pending_bytes = [], 0

    try:
        for si in range(state["stream"], len(streams)):
            split_name, ps = streams[si]
            start = ((state["file"], state["offset"], state["line"]) if si == state["stream"]
                     else (0, 0, 0))
            last = start
            for fi, doc, pos, lineno in _all_documents(ps, args, start):
                split = split_name if split_name == "eval" or eval_paths or \
                    (state["doc"] % args.eval_every) != args.eval_every - 1 else "eval"
                state["doc"] += 1
                step = pos - (last[1] if fi == last[0] else 0)
                bar.update(step)
                state["bytes"] += step
                since_ckpt += step
                last = (fi, pos, lineno)
                pending.append((split, doc))
                pending_bytes += len(doc.encode("utf-8"))  # --batch_mb's bytes, not characters
                if pending_bytes >= batch_bytes:
                    flush()
                if since_ckpt >= shard_bytes:
                    flush()
                    checkpoint({"stream": si, "file": fi, "offset": pos, "line": lineno})
                    since_ckpt = 0
            flush()
            if si + 1 < len(streams):
                checkpoint({"stream": si + 1, "file": 0, "offset": 0, "line": 0})
                since_ckpt = 0
        flush()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`main`): its own line, saying the
        bar.close()  # rerun continues (a bug hunt: glued to the bar, or nothing for SIGTERM)
        raise Stopped(f"{str(e) or 'interrupted'}; what was checkpointed in {out} is kept: rerun "
                      "the same command to continue from it", getattr(e, "exit_code", 130)
                      ) from None
    except PrepareError:  # bad input met while streaming (a line not UTF-8, not JSON)
        bar.close()  # its line ended, so the error starts its own (a README walk)
        for w, _ in writers.values():
            w.close()
        writers.clear()
        if not state["next_shard"]:  # no shard to resume from: a rerun starts afresh
            _discard(out, created)
        raise
    checkpoint({"stream": len(streams), "file": 0, "offset": 0, "line": 0})
    bar.close()
    why = None
    if state["documents"]["train"] == 0:
        why = _NO_TRAIN_TEXT.format(args.input)
    elif state["tokens"]["train"] <= state["documents"]["train"]:
        why = (f"--input {args.input}: every training document is one token, so there is no "
               "token to predict; give longer documents")
    elif state["documents"]["eval"] and state["tokens"]["eval"] <= state["documents"]["eval"]:
        where = f"--eval_input {args.eval_input}" if args.eval_input else f"--input {args.input}"
        why = (f"{where}: every eval document is one token, so there is no token to predict; "
               "give longer documents")
    elif state["documents"]["eval"] == 0 and args.eval_input:
        why = _NO_EVAL_TEXT.format(args.eval_input)
    elif state["documents"]["eval"] == 0:
        why = _NO_EVAL_DOC.format(args.input, args.eval_every)
    if why:  # nothing kept to resume: a rerun with the fix starts afresh
        _discard(out, created)
        raise PrepareError(why)
    np.save(os.path.join(out, sharded.COUNTS_FILE), counts["train"])
    np.save(os.path.join(out, sharded.EVAL_TARGET_COUNTS_FILE), counts["eval_targets"])
    sha = state.get("sha256", {})  # a preparation resumed from before they were recorded:
    sha = {s: sha[s] if len(sha.get(s, ())) == len(state["shards"][s]) else [  # all read now
        sharded.file_sha256(os.path.join(out, name)) for name in state["shards"][s]]
        for s in ("train", "eval")}
    meta = {"format": sharded.FORMAT, "complete": True, "settings": settings,
            "input_stamps": stamps, "tokenizer": tok_info, "dtype": dtype,
            "splits": {s: {"shards": state["shards"][s], "documents": state["documents"][s],
                           "tokens": state["tokens"][s], "sha256": sha[s]}
                       for s in ("train", "eval")}}
    write_json(meta_path, meta)
    os.remove(progress_path)
    for f in _counts_files(out):
        os.remove(f)
    return meta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpnlp.data.prepare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="text or JSON-lines file(s): a path, a glob, "
                   "or several joined by commas")
    p.add_argument("--out", required=True, help="the prepared folder (data.prepared)")
    p.add_argument("--tokenizer", default=None, help="bytes | bpe | unigram (default: bytes, or "
                   "--tokenizer_from's kind)")
    p.add_argument("--vocab_size", type=int, default=None, help="pieces of a bpe/unigram model "
                   "(default: 8000, or --tokenizer_from's)")
    p.add_argument("--tokenizer_from", default="", help="reuse the tokenizer of a run's workdir, "
                   "a prepared folder or a tokenizer folder (its kind and size, unless given)")
    p.add_argument("--tokenizer_sample_mb", type=int, default=None,
                   help="train the tokenizer on an even sample of at most this much text "
                   f"(its training holds about 30 times this in memory; default {SAMPLE_MB})")
    p.add_argument("--eval_input", default="", help="eval text (else every --eval_every-th document)")
    p.add_argument("--eval_every", type=int, default=None, help="document i is eval when "
                   f"i %% N == N - 1 (default {EVAL_EVERY}; not with --eval_input)")
    p.add_argument("--format", default="auto", choices=("auto", "text", "jsonl"),
                   help="auto: .jsonl/.json/.ndjson files (any case) are JSON lines, the rest text")
    p.add_argument("--text_field", default="text", help="the text of a JSON line")
    p.add_argument("--shard_mb", type=int, default=256, help="input MiB per shard (and checkpoint); 0: a shard per document")
    p.add_argument("--batch_mb", type=int, default=8, help="text tokenized at once (memory bound)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    from hpnlp.paths import WorkdirBusy
    args = parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():  # as Ctrl-C: what was checkpointed is kept, and said
            meta = prepare(args)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WorkdirBusy as e:  # another prepare writes into --out (a review, session 117)
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = meta["splits"]
    print(f"{args.out}: train {s['train']['documents']} documents / {s['train']['tokens']} tokens, "
          f"eval {s['eval']['documents']} / {s['eval']['tokens']} "
          f"({meta['tokenizer']['kind']}, vocab {meta['tokenizer']['vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
