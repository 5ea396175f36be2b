"""Corpus analysis with a choice of engine: the same rows in-process (default) or on a Ray cluster.

Both engines read the corpus with one parser (:func:`attnscope.inputs.parse_input_file`), number the
inputs in corpus order (0-based ``input_id``), turn each batch of records into head rows with one
function (:func:`attnscope.analysis.corpus.head_rows`) and write the same report
(:func:`attnscope.analysis.corpus.write_report`). ``engine="ray"`` needs ``pip install 'attnscope[ray]'``;
Ray is imported only then.

>>> report = analyze_heads("brown", "report/")                                   # doctest: +SKIP
>>> report = analyze_heads(["a.jsonl", "more/"], "report/", engine="ray", num_actors=8,
...                        address="auto")                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..errors import AttnscopeError
from .corpus import CorpusReport, analyze_corpus, read_corpus

ENGINES = ("local", "ray")


def analyze_heads(corpus: str | Sequence[str], out_dir: str | Path, *, model: str = "minilm",
                  dtype: str = "float32", engine: str = "local", batch_size: int = 32, limit: int | None = None,
                  skip_bad: bool = False, num_actors: int | None = None, address: str | None = None,
                  progress: bool = True) -> CorpusReport:
    """The corpus report (statistics, patterns, figures, ``heads.duckdb``) of every head over ``corpus``.

    ``corpus``: ``"brown"``, ``"brown-pairs"``, or files and folders of text lines, ``.jsonl`` or
    ``.parquet``. ``skip_bad``: leave malformed lines out (listed in the report's ``skipped``) instead
    of failing. ``engine="ray"`` runs the model in a pool of ``num_actors`` Ray actors (default: one
    per CPU of the cluster) on the cluster at ``address`` (``"auto"``: the one ``ray start`` made;
    None: an already initialised Ray, else a local one); ``model`` must then be an alias or a folder
    every node can read.
    """
    if engine not in ENGINES:
        raise AttnscopeError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if batch_size < 1:
        raise AttnscopeError("the batch size must be at least 1")
    if engine == "ray":
        from .distributed import analyze_on_ray

        return analyze_on_ray(corpus, out_dir, model=model, dtype=dtype, batch_size=batch_size, limit=limit,
                              skip_bad=skip_bad, num_actors=num_actors, address=address, progress=progress)
    if num_actors is not None or address is not None:
        raise AttnscopeError("--num-actors and --address are options of --engine ray")
    return _analyze_locally(corpus, out_dir, model=model, dtype=dtype, batch_size=batch_size, limit=limit,
                            skip_bad=skip_bad, progress=progress)


def _analyze_locally(corpus: str | Sequence[str], out_dir: str | Path, *, model: str, dtype: str, batch_size: int,
                     limit: int | None, skip_bad: bool, progress: bool) -> CorpusReport:
    from ..capture.extract import extract_corpus
    from ..models.loading import load_model

    read = read_corpus(corpus, limit, skip_bad=skip_bad)
    records = extract_corpus(load_model(model, dtype=dtype), read.items, batch_size=batch_size, norms=True,
                             progress=False)
    report = analyze_corpus(records, out_dir, total=len(read.inputs), progress=progress, inputs=read.inputs,
                            batch_size=batch_size)
    return replace(report, skipped=read.skipped)
