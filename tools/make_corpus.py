"""Rebuild hpnlp/data/corpus/kjv.txt.xz from Debian's `bible-kjv-text` package.

    sudo apt-get install bible-kjv          # pulls in bible-kjv-text (the text itself)
    python tools/make_corpus.py             # runs `bible`, writes the .xz
    python tools/make_corpus.py --raw kjv_raw.txt   # or clean an existing dump

The raw dump is `bible -l100000 "Gen1:1-Rev22:21"`: a chapter header line ("Genesis 1",
"1 Kings 3") then one line per verse ("  1 In the beginning ..."). We keep the book and
chapter structure as `# Book` / `## N` header lines and drop verse numbers, because
hpnlp's tasks split and label by chapter and book and a verse number is noise to a
language model. One verse per line, so a line end is a verse end.

The output is deterministic (no timestamps in the xz stream), so rebuilding from the same
package version gives the same bytes; the script prints the SHA-256 for the README.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import os
import pathlib
import re
import subprocess
import sys

OUT = pathlib.Path(__file__).resolve().parents[1] / "hpnlp/data/corpus/kjv.txt.xz"
HEADER = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]*?) (\d+)$")
VERSE = re.compile(r"^  (\d+) (\S.*)$")


def clean(raw: str) -> str:
    """Raw `bible` dump -> '# Book' / '## chapter' / one verse per line."""
    out: list[str] = []
    book, chapter, verse = None, 0, 0
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        if m := HEADER.match(line):
            name, num = m.group(1), int(m.group(2))
            if name != book:
                if num != 1:
                    sys.exit(f"line {lineno}: book {name!r} starts at chapter {num}, not 1")
                book = name
                out.append(f"# {book}")
            elif num != chapter + 1:
                sys.exit(f"line {lineno}: {book} chapter {num} follows chapter {chapter}")
            chapter, verse = num, 0
            out.append(f"## {num}")
        elif m := VERSE.match(line):
            num, text = int(m.group(1)), m.group(2).strip()
            if book is None or num != verse + 1:
                sys.exit(f"line {lineno}: verse {num} out of order in {book} {chapter}")
            if text.startswith("#"):
                sys.exit(f"line {lineno}: a verse starting with '#' would read as a header")
            verse = num
            out.append(text)
        else:
            sys.exit(f"line {lineno}: neither a chapter header nor a verse: {line!r}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", help="an existing `bible -l100000 ...` dump; default: run `bible`")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    if args.raw and not os.path.isfile(args.raw):
        parser.error(f"--raw {args.raw}: no such file; give a `bible -l100000 ...` dump or leave --raw out")
    if os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a folder; give the .xz file to write")
    if args.raw:
        try:
            raw = pathlib.Path(args.raw).read_text(encoding="ascii")
        except UnicodeDecodeError as e:  # a bug hunt: a traceback
            parser.error(f"--raw {args.raw}: byte {e.start} is not ASCII; the `bible` dump "
                         "is plain ASCII: give one, or leave --raw out")
    else:
        try:
            raw = subprocess.run(["bible", "-l100000", "Gen1:1-Rev22:21"], check=True,
                                 capture_output=True, text=True).stdout
        except FileNotFoundError:  # a bug hunt: a traceback
            parser.error("the `bible` program is not installed: sudo apt-get install bible-kjv "
                         "(or give an existing dump with --raw)")
    text = clean(raw)
    books = sum(line.startswith("# ") for line in text.splitlines())
    chapters = sum(line.startswith("## ") for line in text.splitlines())
    if (books, chapters) != (66, 1189):
        sys.exit(f"expected 66 books and 1189 chapters, got {books} and {chapters}")
    data = lzma.compress(text.encode("ascii"), preset=9 | lzma.PRESET_EXTREME)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_bytes(data)
    print(f"{args.out}: {len(text.encode())} bytes of text -> {len(data)} bytes xz, "
          f"{books} books, {chapters} chapters, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
