"""Text sources: the shipped King James Bible (see corpus/README.md) and users' files.

The corpus is decompressed and parsed once per process (about 0.1 s) and shared by every
task built from it. Train/eval is split by chapter: every 10th chapter of the canon
(global chapter index % 10 == 9: 118 of 1189) is eval. Splitting by chapter rather than
by window keeps a chapter's neighbouring text out of training when it is evaluated, and
taking every 10th rather than the last 10% keeps all 8 sections in both splits.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import lzma
import pathlib
import re
import shlex

# Section groups of the Protestant canon (Law .. General epistles + Revelation). Hebrews
# goes with the general epistles, as in most modern groupings (its authorship is unknown).
SECTIONS = (
    ("Law", ("Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy")),
    ("History", ("Joshua", "Judges", "Ruth", "1 Samuel", "2 Samuel", "1 Kings", "2 Kings",
                 "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther")),
    ("Poetry and Wisdom", ("Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon")),
    ("Major Prophets", ("Isaiah", "Jeremiah", "Lamentations", "Ezekiel", "Daniel")),
    ("Minor Prophets", ("Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum",
                        "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi")),
    ("Gospels and Acts", ("Matthew", "Mark", "Luke", "John", "Acts")),
    ("Pauline Epistles", ("Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians",
                          "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians",
                          "1 Timothy", "2 Timothy", "Titus", "Philemon")),
    ("General Epistles and Revelation", ("Hebrews", "James", "1 Peter", "2 Peter", "1 John",
                                         "2 John", "3 John", "Jude", "Revelation")),
)
SECTION_NAMES = tuple(name for name, _ in SECTIONS)
SECTION_OF_BOOK = {book: i for i, (_, books) in enumerate(SECTIONS) for book in books}
EVAL_EVERY = 10  # chapter i is eval iff i % EVAL_EVERY == EVAL_EVERY - 1


@dataclasses.dataclass(frozen=True)
class Chapter:
    index: int  # 0..1188 in canonical order
    book: str
    number: int  # chapter number within the book
    section: int  # index into SECTIONS
    text: str  # verses, one per line, each ending in "\n"; no book or chapter header

    @property
    def is_eval(self) -> bool:
        return self.index % EVAL_EVERY == EVAL_EVERY - 1


def corpus_path() -> pathlib.Path:
    return pathlib.Path(str(importlib.resources.files("hpnlp.data") / "corpus" / "kjv.txt.xz"))


@functools.lru_cache(maxsize=1)
def kjv_text() -> str:
    path = corpus_path()
    if not path.is_file():
        raise ValueError(f"{path}: the shipped corpus is missing; reinstall hpnlp or rebuild "
                         "it with `python tools/make_corpus.py`")
    return lzma.decompress(path.read_bytes()).decode("ascii")


@functools.lru_cache(maxsize=1)
def kjv_chapters() -> tuple[Chapter, ...]:
    """Parse the `# Book` / `## N` / verse-per-line format written by tools/make_corpus.py."""
    chapters: list[Chapter] = []
    book, number, verses = None, 0, []

    def flush():
        if verses:
            chapters.append(Chapter(len(chapters), book, number, SECTION_OF_BOOK[book],
                                    "\n".join(verses) + "\n"))

    for lineno, line in enumerate(kjv_text().split("\n"), 1):
        if line.startswith("## "):
            flush()
            number, verses = int(line[3:]), []
        elif line.startswith("# "):
            flush()
            book, verses = line[2:], []
            if book not in SECTION_OF_BOOK:
                raise ValueError(f"{corpus_path()}:{lineno}: unknown book {book!r}; "
                                 "corpus and hpnlp.data.corpus.SECTIONS disagree")
        elif line:
            verses.append(line)
    flush()
    if len(chapters) != 1189:
        raise ValueError(f"{corpus_path()}: {len(chapters)} chapters parsed, expected 1189; "
                         "rebuild it with `python tools/make_corpus.py`")
    return tuple(chapters)


VALIDATION_AT = 4  # data.eval_split='validation': train chapter i is held out iff i % EVAL_EVERY == 4


def kjv_splits(eval_split: str = "eval") -> tuple[list[Chapter], list[Chapter]]:
    """(train chapters, eval chapters); with `eval_split='validation'` the eval chapters are
    the training chapters at index `VALIDATION_AT` mod 10 (119 of 1071, one in nine), left
    out of training, and the real eval chapters are in neither."""
    chapters = kjv_chapters()
    train = [c for c in chapters if not c.is_eval]
    if eval_split == "validation":
        held = [c.index % EVAL_EVERY == VALIDATION_AT for c in train]
        return [c for c, h in zip(train, held) if not h], [c for c, h in zip(train, held) if h]
    return train, [c for c in chapters if c.is_eval]


# ---------------------------------------------------------------------------------------
# Users' plain-text files

# A compressed file's first bytes and how to unpack it (a bug hunt: a gzip file was told
# to re-encode from latin1; a stored zip's first line is valid UTF-8, so its own bytes are
# read whatever its lines decode to). Shared by prepare and `read_text_file`.
_COMPRESSED = ((re.compile(rb"\x1f\x8b"), "gzip", "gzip -dc {} > TEXT"),
               (re.compile(rb"BZh[1-9]1AY&SY"), "bzip2", "bzip2 -dc {} > TEXT"),
               (re.compile(rb"\xfd7zXZ\x00"), "xz", "xz -dc {} > TEXT"),
               (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd", "zstd -dc {} > TEXT"),
               (re.compile(rb"PK\x03\x04"), "zip", "unzip -p {} > TEXT"))
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # 0xfe and 0xff never occur in UTF-8
UTF16_BOM_ERROR = ("starts with a UTF-16 byte-order mark, so it is UTF-16, not UTF-8; "
                   "re-encode the file (e.g. `iconv -f utf-16 -t utf-8`)")


def compressed_error(path: str, head: bytes) -> str | None:
    """What to say of a file whose first bytes (`head`, 10 are enough) are a compressed
    format's, else None."""
    for magic, kind, unpack in _COMPRESSED:
        if magic.match(head):
            return (f"a {kind}-compressed file, not text; decompress it first (e.g. "
                    f"`{unpack.format(shlex.quote(path))}`)")
    return None


def read_bytes_of_text(path: str, what: str) -> bytes:
    """The bytes of the file `path` that should be text, or a ValueError ending in `what` (the
    field and what it must name): one it cannot read (a review, r3: a file without read
    permission ended in a PermissionError traceback), a compressed file, or UTF-16 with a
    byte-order mark (these were told to re-encode from latin1, which makes mojibake)."""
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e}); {what} that this user "
                         "can read (fix its permissions or copy it)") from None
    if (why := compressed_error(path, raw[:10])) is not None:
        raise ValueError(f"{path}: {why}; {what}")
    if raw.startswith(UTF16_BOMS):
        raise ValueError(f"{path}: {UTF16_BOM_ERROR}; {what}")
    return raw


def read_text_file(path: str, field: str) -> str:
    """A UTF-8 text file, or a ValueError that names the file, the line and the field."""
    p = pathlib.Path(path)
    what = f"{field} must name a UTF-8 plain-text file"
    if not p.is_file():
        raise ValueError(f"{path}: {'is a folder, not a file' if p.is_dir() else 'no such file'}; "
                         f"{what}")
    raw = read_bytes_of_text(path, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: byte {raw[e.start]:#04x} at column {col} is not "
                         f"UTF-8 ({e.reason}); {what} (re-encode it, e.g. "
                         f"`iconv -f latin1 -t utf-8`)") from None
    if "\0" in text:  # valid UTF-8, but no text
        line = text[:text.index("\0")].count("\n") + 1
        raise ValueError(f"{path}:{line}: a NUL byte, so this is a binary file or UTF-16 without "
                         f"a byte-order mark, not UTF-8 text; {what} (re-encode UTF-16, e.g. "
                         "`iconv -f utf-16le -t utf-8`)")
    # a review (r6): U+FEFF is not whitespace, so a "UTF-8 with BOM" file of no text passed
    # the check and failed later (at the first eval, for data.eval_path) without its name
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise ValueError(f"{path}: file is empty; {what} with some text in it")
    return text


def documents(lines: list[str]) -> list[str]:
    """Paragraphs (runs of non-blank lines) -> documents, each line ending in "\\n".

    Paragraphs are the documents so that packing and segment ids keep unrelated text apart
    the way they keep chapters apart in the shipped corpus.
    """
    docs, cur = [], []
    for line in lines:
        line = line.rstrip("\r")
        if line.strip():
            cur.append(line)
        elif cur:
            docs.append("\n".join(cur) + "\n")
            cur = []
    if cur:
        docs.append("\n".join(cur) + "\n")
    return docs


def user_lm_documents(cfg) -> tuple[list[str], list[str], dict]:
    """(train documents, eval documents, source) from data.train_path / data.eval_path.

    Without an eval file the last 10% of the train file's lines are held out: lines, not
    paragraphs, so that a file with no blank lines still gets an eval split.
    """
    from hpnlp.config import ConfigError
    if cfg.eval_path and not cfg.train_path:
        raise ConfigError(f"data.eval_path={cfg.eval_path!r} needs data.train_path too; "
                          "set both, or neither to use the shipped corpus")
    lines = read_text_file(cfg.train_path, "data.train_path").split("\n")
    if cfg.eval_path:
        eval_lines = read_text_file(cfg.eval_path, "data.eval_path").split("\n")
        source = {"train": cfg.train_path, "eval": cfg.eval_path}
    else:
        real = [i for i, line in enumerate(lines) if line.strip()]
        if len(real) < 2:
            raise ValueError(f"{cfg.train_path}: one line of text cannot be split into train and "
                             "eval; add lines or set data.eval_path")
        cut = real[len(real) - max(1, len(real) // 10)]
        lines, eval_lines = lines[:cut], lines[cut:]
        source = {"train": cfg.train_path, "eval": f"last 10% of lines of {cfg.train_path}"}
    return documents(lines), documents(eval_lines), source
