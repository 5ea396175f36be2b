"""The Ray engine of ``attnscope heads``, ``attnscope sinks`` and the mixing evaluation: the local engine's reports, their figures
computed and aggregated on the workers.

The corpus is read and parsed by Ray tasks and the model runs in an actor pool
(:mod:`attnscope.corpus.ray_engine`). Each actor turns a window of inputs (one of the local engine's sort
windows, :func:`~attnscope.corpus.report.corpus_window`) into the records of
:func:`~attnscope.corpus.report.corpus_records`, as the local engine computes them, and those into
:func:`~attnscope.corpus.report.head_rows`, writes them, and its inputs, as
Parquet part files named by the window's first input id (``OUT/parquet/head_stats/`` and
``OUT/parquet/inputs/``; a retried window replaces its own files, written whole or not at all), and returns
only their :class:`~attnscope.analysis.aggregate.HeadsPartial`. The driver merges the partials, so its
memory does not grow with the corpus, and proves exactly-once without reading the rows back: the windows'
input ids tile ``0 .. N-1`` (merged coverage), each window held every (layer, head) of its inputs once
(checked by the actor), and DuckDB's count of the rows and files on disk equals the windows' (metadata
only). It then writes the same report as the local engine; ``heads.duckdb`` holds ``meta`` and
``head_labels`` and views of the Parquet tables (paths relative to the report folder). The few inputs
whose maps the report shows are re-run on the driver.

``attnscope sinks`` goes the same way with :class:`SinksWorker`: each window's sums of the sink measures
(:class:`~attnscope.analysis.sinks.SinkTotals`) are merged into the report's means; and ``attnscope mixing
--evaluate`` with :class:`MixingWorker`: each window of sentences' rank correlations, merged into the table.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from ..analysis.aggregate import HeadsPartial
from ..analysis.sinks import SinkReport, SinkTotals
from ..arguments import check_seed
from ..errors import AttnscopeError
from .engine_choice import Engine
from .ray_engine import (
    PartialWorker,
    corpus_dataset,
    corpus_sources_of,
    data_starting,
    fold_on_ray,
    items_dataset,
    plan_corpus,
    ray_module,
    ray_session,
)
from .report import (
    CorpusReport,
    corpus_records,
    corpus_window,
    examples_of,
    finding_inputs,
    head_rows,
    heads_partial,
    write_report,
)

ROWS_FOLDER = "parquet"
MIXING_BATCH = 8  # evaluation sentences a window: a few seconds of work each, spread over every actor
SINKS_WINDOW_BATCHES = 4  # batches a window of attnscope sinks
PARTS = ("head_stats", "inputs")
INPUT_COLUMNS = (("input_id", "int64"), ("text", "string"), ("pair", "string"), ("n_tokens", "int64"),
                 ("source", "string"), ("line", "int64"))


class HeadsWorker(PartialWorker):
    """Turns a window of inputs into head rows, writes them and the inputs as Parquet, returns their aggregate."""

    def __init__(self, model: str, dtype: str, threads: int, batch_size: int, out_dir: str,
                 progress: Any = None) -> None:
        from ..capture.linear import PackedWeights

        super().__init__(model, dtype, threads, progress)
        self.packed = PackedWeights()  # oneDNN weights packed once per actor, as the local engine does per run
        self.batch_size = batch_size
        self.folder = Path(out_dir)

    def partial(self, inputs: Any) -> HeadsPartial:
        items = [(text, pair if isinstance(pair, str) else None) for text, pair in zip(inputs["text"], inputs["pair"])]
        records = []
        for record in corpus_records(self.loaded, items, self.batch_size, packed=self.packed, parallel_batches=1):
            records.append(record)
            if len(records) % self.batch_size == 0:
                self.done(self.batch_size)
        self.done(len(records) % self.batch_size)
        ids = [int(i) for i in inputs["input_id"]]
        rows = head_rows(ids, records)
        name = f"part-{min(ids):012d}.parquet"
        table = inputs.assign(n_tokens=[len(r.tokens) for r in records])
        write_part(self.folder / "head_stats" / name, rows)
        write_part(self.folder / "inputs" / name, table[[name for name, _ in INPUT_COLUMNS]], INPUT_COLUMNS)
        return heads_partial(rows, self.loaded.name)


def write_part(path: Path, frame: Any, schema: Sequence[tuple[str, str]] | None = None) -> None:
    """``frame`` as the Parquet file ``path``, whole or not at all (written aside, then renamed over any
    earlier attempt's file). ``schema``: (column, Arrow type) pairs, so that an all-None column keeps its type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    arrow_schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in schema]) if schema else None
    table = pa.Table.from_pandas(frame, schema=arrow_schema, preserve_index=False)  # an all-NaN column stays double
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, aside)
    os.replace(aside, path)


def analyze_on_ray(corpus: str | Sequence[str], out_dir: str | Path, *, model: str, dtype: str, batch_size: int,
                   limit: int | None, skip_bad: bool, engine: Engine, progress: bool) -> CorpusReport:
    """:func:`attnscope.corpus.engines.analyze_heads` with ``engine="ray"`` (see the module docstring)."""
    from ..capture.loading import load_model

    sources = corpus_sources_of(corpus)  # a corpus that does not exist fails now, before Ray starts
    rows_dir = Path(out_dir) / ROWS_FOLDER
    for part in PARTS:  # Ray adds part files: an earlier run's would count twice
        if (rows_dir / part).is_dir() and any((rows_dir / part).iterdir()):
            raise AttnscopeError(f"{rows_dir / part} already holds rows of an earlier run; choose a new output folder")
    ray = ray_module()
    with ray_session(ray, engine.address, verbose=engine.verbose, runtime_env=engine.runtime_env) as stderr:
        plan = plan_corpus(ray, sources, limit, skip_bad=skip_bad)
        with data_starting(ray):
            loaded = load_model(model, dtype=dtype)  # a model the driver cannot load fails here, before any actor starts
        folded = fold_on_ray(ray, corpus_dataset(ray, plan, corpus_window(batch_size)), HeadsWorker,
                             {"model": model, "dtype": dtype, "batch_size": batch_size,
                              "out_dir": str(rows_dir.resolve())},
                             n_inputs=plan.n_inputs, num_actors=engine.num_actors, desc="analysing heads (ray)",
                             progress=progress and stderr, stall_s=engine.stall_s)
        check_parts(rows_dir, folded.value, plan.n_inputs, folded.windows)
        report = _report(Path(out_dir), folded.value, loaded)
    return replace(report, skipped=plan.skipped, engine="ray")


def check_parts(rows_dir: Path, aggregate: HeadsPartial, n_inputs: int, windows: int) -> None:
    """The Parquet folder holds exactly what the merged windows counted: one file per window and table,
    ``aggregate.rows`` head rows and ``n_inputs`` inputs with ids ``0 .. n_inputs - 1`` (DuckDB over the
    files' metadata and id columns; nothing is read into the driver but the counts)."""
    import duckdb

    expected = {"head_stats": aggregate.rows, "inputs": n_inputs}
    for part, rows in expected.items():
        folder = rows_dir / part
        files = sum(1 for entry in os.scandir(folder) if entry.name.endswith(".parquet")) if folder.is_dir() else 0
        found = cast(tuple[Any, ...], duckdb.connect().execute(  # an aggregate query: always one row
            "SELECT count(*), min(input_id), max(input_id) FROM read_parquet(?)", [str(folder / "*.parquet")]
        ).fetchone()) if files else (0, None, None)
        if files != windows or tuple(found) != (rows, 0, n_inputs - 1):
            raise AttnscopeError(f"{folder} holds {found[0]} rows in {files} files, expected {rows} in {windows} "
                                 "(a window's files are missing or were written twice); nothing reported")
    for leftover in [entry for part in PARTS for entry in (rows_dir / part).glob(".*.tmp")]:
        leftover.unlink(missing_ok=True)  # a killed actor's unfinished file, never renamed into the table


def _report(out: Path, aggregate: HeadsPartial, loaded: Any) -> CorpusReport:
    """The local engine's report of ``aggregate``; the inputs whose maps it shows are re-run on the driver."""
    from ..analysis.store import HeadStore
    from ..capture.extract import extract_corpus

    wanted = finding_inputs(aggregate)
    ids = sorted(set(wanted.values()))
    with HeadStore(out / ROWS_FOLDER) as folder:  # the few inputs the findings show, by SQL
        texts = folder.query("SELECT input_id, text, pair FROM inputs WHERE input_id IN (SELECT unnest(?)) "
                             "ORDER BY input_id", [ids])
    items = [(text, pair if isinstance(pair, str) else None) for text, pair in zip(texts["text"], texts["pair"])]
    records = dict(zip(texts["input_id"].astype(int), extract_corpus(loaded, items, norms=True, progress=False)))

    def store(path: Path, meta: dict[str, str], head_labels: Any) -> None:
        HeadStore.create_over_parquet(path, ROWS_FOLDER, PARTS, meta, head_labels).close()

    report = write_report(out, aggregate, examples_of(records, aggregate, wanted), store,
                          {"engine": "ray", "rows": str(out / ROWS_FOLDER / "head_stats")})
    with HeadStore(report.database) as database:  # the Parquet folder holds every table, as the database does
        database.export_parquet(out / ROWS_FOLDER, tables=("meta", "head_labels"))
    return report


# ---- attnscope sinks ------------------------------------------------------------------------------
class SinksWorker(PartialWorker):
    """Turns a window of inputs into the sums of their sink measures (:class:`~attnscope.analysis.sinks.SinkTotals`)."""

    def __init__(self, model: str, dtype: str, threads: int, batch_size: int, factor: float,
                 progress: Any = None) -> None:
        super().__init__(model, dtype, threads, progress)
        self.batch_size = batch_size
        self.factor = factor

    def partial(self, inputs: Any) -> SinkTotals:
        from ..capture.extract import extract_corpus

        items = [(text, pair if isinstance(pair, str) else None) for text, pair in zip(inputs["text"], inputs["pair"])]
        records = extract_corpus(self.loaded, items, batch_size=self.batch_size, norms=True, progress=False)
        totals = SinkTotals.of(records, self.factor)
        self.done(len(items))
        return totals


def sinks_on_ray(corpus: str | Sequence[str], *, model: str, dtype: str, batch_size: int, limit: int | None,
                 factor: float, engine: Engine, progress: bool = True) -> SinkReport:
    """:func:`~attnscope.analysis.sinks.sink_report` of a corpus, computed by an actor pool and merged from
    each window's sums (exactly once: the windows' input ids tile the corpus)."""
    from ..capture.loading import load_model

    sources = corpus_sources_of(corpus)
    ray = ray_module()
    with ray_session(ray, engine.address, verbose=engine.verbose, runtime_env=engine.runtime_env) as stderr:
        plan = plan_corpus(ray, sources, limit, skip_bad=False)
        with data_starting(ray):
            load_model(model, dtype=dtype)  # a model the driver cannot load fails here, before any actor starts
        folded = fold_on_ray(ray, corpus_dataset(ray, plan, batch_size * SINKS_WINDOW_BATCHES), SinksWorker,
                             {"model": model, "dtype": dtype, "batch_size": batch_size, "factor": factor},
                             n_inputs=plan.n_inputs, num_actors=engine.num_actors, desc="sinks (ray)",
                             progress=progress and stderr, stall_s=engine.stall_s)
    return folded.value.report()


# ---- the mixing evaluation -----------------------------------------------------------------------------
class SentenceCorrelations:
    """A mergeable partial of the mixing evaluation: each sentence's correlations by sentence index. The
    bootstrap interval needs every sentence's value, so the partial keeps them (fourteen floats a sentence:
    the evaluation's few hundred sentences, not a corpus)."""

    def __init__(self, rows: dict[int, dict[str, tuple[float, float]]]) -> None:
        self.rows = rows

    def merge(self, other: SentenceCorrelations) -> SentenceCorrelations:
        return SentenceCorrelations({**self.rows, **other.rows})  # disjoint: the coverage proves it


class MixingWorker(PartialWorker):
    """Scores a window of evaluation sentences (:func:`~attnscope.experiments.faithfulness.correlations_by_sentence`)."""

    def __init__(self, model: str, dtype: str, threads: int, seed: int, progress: Any = None) -> None:
        super().__init__(model, dtype, threads, progress)
        self.seed = seed

    def partial(self, inputs: Any) -> SentenceCorrelations:
        from ..experiments.faithfulness import correlations_by_sentence

        numbered = list(zip(inputs["input_id"].tolist(), inputs["text"].tolist()))
        rows = correlations_by_sentence(self.loaded, numbered, seed=self.seed)
        self.done(len(numbered))
        return SentenceCorrelations(rows)


def evaluate_mixing_on_ray(models: Sequence[str], n_sentences: int, *, seed: int, engine: Engine,
                           progress: bool = True, say: Callable[[str], None] | None = None
                           ) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`~attnscope.experiments.faithfulness.evaluate_mixing` with each model in an actor pool: the
    sentences are scored on the workers and only their correlations come back (the same table: a
    sentence's scores do not depend on where it ran)."""
    from ..capture.loading import load_model
    from ..experiments.faithfulness import evaluation_sentences, summarise_sentences

    check_seed(seed, "seed")
    sentences = evaluation_sentences(n_sentences)
    for name in models:
        load_model(name)  # a model the driver cannot load fails here, before Ray starts
    ray = ray_module()
    results = {}
    with ray_session(ray, engine.address, verbose=engine.verbose, runtime_env=engine.runtime_env) as stderr:
        for name in models:
            start = time.perf_counter()
            folded = fold_on_ray(ray, items_dataset(ray, sentences, MIXING_BATCH), MixingWorker,
                                 {"model": name, "dtype": "float32", "seed": seed}, n_inputs=len(sentences),
                                 num_actors=engine.num_actors,
                                 desc=f"mixing faithfulness ({name}, ray)", progress=progress and stderr,
                                 stall_s=engine.stall_s)
            results[name] = summarise_sentences(folded.value.rows, seed)
            if say is not None:
                say(f"{name}: {len(sentences)} sentences in {time.perf_counter() - start:.0f} s on Ray")
    return results
