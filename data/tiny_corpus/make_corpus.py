"""Rebuild train.txt / valid.txt from Debian's r-cran-janeaustenr package.

Run once by hand (not part of the package or the tests); needs the `rdata`
PyPI package to read R's serialization format:

        apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb deb
        python make_corpus.py deb/usr/lib/R/site-library/janeaustenr/data
"""

import gzip
import pathlib
import re
import struct
import sys
import zlib

import rdata

NOVELS = ("prideprejudice", "persuasion", "northangerabbey", "sensesensibility")
VALID_EVERY = 20  # every 20th chapter goes to valid.txt: a ~5% split by whole chapters
CHAPTER_HEADING = re.compile(r"^\s*chapter\s+\w+\s*$", re.IGNORECASE)


def _read_r_object(raw: bytes):
    return rdata.conversion.convert(rdata.parser.parse_data(raw))


def read_novels(data_dir: pathlib.Path) -> dict[str, list[str]]:
    """The package's lazy-load database: an index (.rdx) of zlib records in .rdb."""
    index = _read_r_object(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    blob = (data_dir / "Rdata.rdb").read_bytes()
    novels = {}
    for name in NOVELS:
        offset, length = (int(v) for v in index["variables"][name])
        record = blob[offset:offset + length]
        size = struct.unpack(">i", record[:4])[0]  # uncompressed size, then zlib data
        raw = zlib.decompress(record[4:])
        assert len(raw) == size, name
        novels[name] = [str(line) for line in _read_r_object(raw)]
    return novels


def paragraphs(lines: list[str]) -> list[str]:
    """Rejoin the hard-wrapped lines; drop italics underscores and '* * *' breaks."""
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
            continue
        text = " ".join(" ".join(current).replace("_", "").split())
        if text.strip("* "):
            out.append(text)
        current = []
    return out


def chapters(lines: list[str]) -> list[list[str]]:
    """Split a novel at its chapter headings (the title page goes with chapter 1)."""
    starts = [i for i, line in enumerate(lines) if CHAPTER_HEADING.match(line)]
    bounds = [0] + starts[1:] + [len(lines)]
    return [lines[a:b] for a, b in zip(bounds, bounds[1:])]


def main(data_dir: str) -> None:
    here = pathlib.Path(__file__).parent
    train, valid = [], []
    chapter_number = 0
    for lines in read_novels(pathlib.Path(data_dir)).values():
        for chapter in chapters(lines):
            chapter_number += 1
            split = valid if chapter_number % VALID_EVERY == 0 else train
            split.extend(paragraphs(chapter))
    for name, paras in (("train.txt", train), ("valid.txt", valid)):
        (here / name).write_text("\n\n".join(paras) + "\n", encoding="utf-8")
        print(name, len(paras), "paragraphs")


if __name__ == "__main__":
    main(sys.argv[1])
