"""Corpus analysis with a choice of engine: the same rows in-process (default) or on a Ray cluster.

Both engines read the corpus with one parser (:func:`attnscope.inputs.parse_input_file`), number the
inputs in corpus order (0-based ``input_id``), turn each batch of records into head rows with one
function (:func:`attnscope.corpus.report.head_rows`) and write the same report
(:func:`attnscope.corpus.report.write_report`). ``engine="ray"`` needs ``pip install 'attnscope[ray]'``;
Ray is imported only then.

>>> report = analyze_heads("brown", "report/")                                   # doctest: +SKIP
>>> report = analyze_heads(["a.jsonl", "more/"], "report/", engine="ray", num_actors=8,
...                        address="auto")                                       # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..analysis.sinks import SINK_FACTOR
from ..errors import AttnscopeError
from .engine_choice import Engine, check_engine_device
from .ray_engine import STALL_SECONDS
from .report import CorpusReport, analyze_corpus, corpus_items, corpus_records, read_corpus

if TYPE_CHECKING:
    from ..analysis.sinks import SinkReport


def analyze_heads(corpus: str | Sequence[str], out_dir: str | Path, *, model: str = "minilm",
                  dtype: str = "float32", device: str = "cpu", engine: str = "local", batch_size: int = 32,
                  limit: int | None = None, skip_bad: bool = False, num_actors: int | None = None,
                  address: str | None = None, progress: bool = True, stall_s: float = STALL_SECONDS,
                  verbose: bool = False, runtime_env: dict[str, Any] | None = None) -> CorpusReport:
    """The corpus report (statistics, patterns, figures, ``heads.duckdb``) of every head over ``corpus``.

    ``corpus``: ``"brown"``, ``"brown-pairs"``, or files and folders of text lines, ``.jsonl`` or
    ``.parquet``. ``skip_bad``: leave malformed lines out (listed in the report's ``skipped``) instead
    of failing. ``device``: where the local engine runs the model (the Ray engine's actors: the CPU).
    ``engine="ray"`` runs the model in a pool of ``num_actors`` Ray actors (default: one
    per CPU of the cluster) on the cluster at ``address`` (``"auto"``: the one ``ray start`` made;
    None: an already initialised Ray, else a local one); ``model`` must then be an alias or a folder
    every node can read. ``stall_s``: a Ray job with no finished batch for this long fails (a lost node
    whose work cannot be placed again); ``verbose``: show Ray's own log lines; ``runtime_env``: Ray's
    runtime environment of the workers (see :class:`~attnscope.corpus.ray_engine.Engine`).
    """
    where = Engine(engine, address, num_actors, stall_s, verbose, runtime_env)
    check_engine_device(where.name, device)
    if batch_size < 1:
        raise AttnscopeError("the batch size must be at least 1")
    if where.name == "ray":
        from .distributed import analyze_on_ray

        return analyze_on_ray(corpus, out_dir, model=model, dtype=dtype, batch_size=batch_size, limit=limit,
                              skip_bad=skip_bad, engine=where, progress=progress)
    return _analyze_locally(corpus, out_dir, model=model, dtype=dtype, device=device, batch_size=batch_size,
                            limit=limit, skip_bad=skip_bad, progress=progress)


def _analyze_locally(corpus: str | Sequence[str], out_dir: str | Path, *, model: str, dtype: str, device: str,
                     batch_size: int, limit: int | None, skip_bad: bool, progress: bool) -> CorpusReport:
    from ..capture.loading import load_model

    read = read_corpus(corpus, limit, skip_bad=skip_bad)
    records = corpus_records(load_model(model, dtype=dtype, device=device), read.items, batch_size)
    report = analyze_corpus(records, out_dir, total=len(read.inputs), progress=progress, inputs=read.inputs,
                            batch_size=batch_size)
    return replace(report, skipped=read.skipped)


def corpus_sinks(corpus: str | Sequence[str], *, model: str = "minilm", dtype: str = "float32", device: str = "cpu",
                 batch_size: int = 16, limit: int | None = None, factor: float = SINK_FACTOR,
                 engine: Engine | None = None) -> SinkReport:
    """:func:`~attnscope.analysis.sinks.sink_report` of every input of ``corpus`` (as :func:`analyze_heads`
    names it: ``"brown"``, ``"brown-pairs"``, a text file or ``.jsonl``), on the first ``limit``: here, or in
    the actor pool of a Ray ``engine`` (then on the CPU)."""
    if engine is not None and engine.name == "ray":
        from .distributed import sinks_on_ray

        return sinks_on_ray(corpus, model=model, dtype=dtype, batch_size=batch_size, limit=limit, factor=factor,
                            engine=engine)
    from tqdm.auto import tqdm

    from ..analysis.sinks import sink_report
    from ..capture.extract import extract_corpus
    from ..capture.loading import load_model
    from ..capture.tokens import split_item

    items = corpus_items(corpus, limit)
    for index, item in enumerate(items):
        split_item(item, index)  # reject bad input before the model loads
    records = extract_corpus(load_model(model, dtype=dtype, device=device), items, batch_size=batch_size, norms=True,
                             progress=False)
    return sink_report(tqdm(records, total=len(items), desc="sinks", unit="input"), factor=factor)
