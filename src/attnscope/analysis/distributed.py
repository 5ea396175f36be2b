"""The Ray engine of corpus analysis: the local engine's rows, computed by a pool of Ray actors.

1. Ray Data reads the corpus files in parallel and parses each with the local engine's parser
   (:func:`attnscope.inputs.parse_input_file`); the driver numbers the inputs in corpus order (files
   in order, then lines) and reports malformed lines with their file and line.
2. ``map_batches`` runs :class:`HeadRowsWorker` in an actor pool: each actor loads the model once and
   turns each batch into :func:`~attnscope.analysis.corpus.head_rows` (statistics, norm-weighted
   statistics, labels, confidences; never attention arrays). A dead actor is restarted and its batch
   retried (``ACTOR_RETRIES``); a batch is a block, so a retried batch replaces its part file.
3. Ray writes the rows as Parquet part files into ``OUT/parquet/head_stats/``; the driver checks that
   every (input, layer, head) is there exactly once, writes ``inputs``, ``meta`` and ``head_labels``
   beside them, and the same report as the local engine (``heads.duckdb``, figures, report.html).
   The driver re-runs only the handful of inputs whose maps the report shows.

Each actor runs torch on ``threads`` threads (the cluster's CPUs / actors) and asks Ray for half a CPU
less, so Ray Data's read and write tasks always find a CPU (whole-CPU actors on a 2-CPU machine
starve them and the job hangs).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import AttnscopeError
from ..inputs import BadLine, InputLine, parse_input_file
from .corpus import (
    CorpusInputs,
    CorpusReport,
    corpus_sources,
    examples_of,
    finding_inputs,
    head_rows,
    inputs_table,
    named_corpus,
    write_report,
)

ACTOR_RETRIES = 3  # restarts of a dead actor, and retries of the batch it held
ROWS_FOLDER = "parquet"
KEYS = ["input_id", "layer", "head"]


def ray_module() -> Any:
    """``ray`` with Ray Data, or one clear error saying how to install it."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise AttnscopeError("the Ray engine needs Ray: pip install 'attnscope[ray]'") from None
    return ray


class HeadRowsWorker:
    """A Ray actor's state: the model, loaded once; called on a window of inputs (pandas, columns
    ``input_id``, ``text``, ``pair``), it returns their head rows, computed ``batch_size`` at a time."""

    def __init__(self, model: str, dtype: str, threads: int, batch_size: int, progress: Any = None) -> None:
        import torch

        from ..capture.linear import PackedWeights
        from ..models.loading import load_model

        torch.set_num_threads(threads)
        self.loaded = load_model(model, dtype=dtype)
        self.packed = PackedWeights()  # oneDNN weights packed once per actor, as the local engine does per run
        self.batch_size = batch_size
        self.progress = progress

    def __call__(self, batch: Any) -> Any:
        from ..capture.extract import extract_corpus

        items = [(text, pair if isinstance(pair, str) else None) for text, pair in zip(batch["text"], batch["pair"])]
        records = list(extract_corpus(self.loaded, items, batch_size=self.batch_size, norms=True, progress=False,
                                      onednn=True, packed=self.packed, parallel_batches=1))
        rows = head_rows([int(i) for i in batch["input_id"]], records)
        if self.progress is not None:
            self.progress.add.remote(len(items))
        import pyarrow as pa

        return pa.Table.from_pandas(rows, preserve_index=False)  # typed by the frame: an all-NaN column stays double


class _Progress:
    """Inputs done so far, counted by the actors (a retried batch may count twice: the bar caps it)."""

    def __init__(self) -> None:
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n

    def value(self) -> int:
        return self.done


def analyze_on_ray(corpus: str | Sequence[str], out_dir: str | Path, *, model: str, dtype: str, batch_size: int,
                   limit: int | None, skip_bad: bool, num_actors: int | None, address: str | None,
                   progress: bool) -> CorpusReport:
    """:func:`attnscope.analysis.engines.analyze_heads` with ``engine="ray"`` (see the module docstring)."""
    from dataclasses import replace

    from ..models.loading import load_model

    if num_actors is not None and num_actors < 1:
        raise AttnscopeError("--num-actors must be at least 1")
    corpus_sources(corpus)  # a corpus that does not exist fails now, before Ray starts
    ray = ray_module()
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        read = read_corpus_on_ray(ray, corpus, limit, skip_bad=skip_bad)
        loaded = load_model(model, dtype=dtype)  # a model the driver cannot load fails here, before any actor starts
        out = Path(out_dir)
        rows_dir = out / ROWS_FOLDER / "head_stats"
        rows = compute_rows(ray, read.inputs, rows_dir, model=model, dtype=dtype, batch_size=batch_size,
                            num_actors=num_actors, progress=progress)
        report = _report(out, rows, read.inputs, loaded)
    finally:
        if started_here:
            ray.shutdown()
    return replace(report, skipped=read.skipped, engine="ray")


# ---- 1. reading ---------------------------------------------------------------------------------
def read_corpus_on_ray(ray: Any, corpus: str | Sequence[str], limit: int | None, *, skip_bad: bool) -> CorpusInputs:
    """The corpus' inputs in corpus order, the files read and parsed by Ray tasks (see the module docstring)."""
    if limit is not None and limit < 1:
        raise AttnscopeError("--limit must be at least 1")
    name, files = corpus_sources(corpus)
    if name is not None:
        return CorpusInputs(named_corpus(name)[:limit], [])
    order = {str(path.resolve()): index for index, path in enumerate(files)}
    parsed = ray.data.read_binary_files(list(order), include_paths=True).flat_map(_parse_file).take_all()
    parsed.sort(key=lambda row: (order[row["source"]], row["line"]))
    for row in parsed:  # name each file as the user did, as the local engine does
        row["source"] = str(files[order[row["source"]]])
    bad = [BadLine(row["source"], row["line"], row["error"]) for row in parsed if row["error"] is not None]
    fatal = [line for line in bad if line.line == 0 or not skip_bad]  # line 0: the whole file is unreadable
    if fatal:
        hint = "" if fatal[0].line == 0 else " (--on-bad-line skip leaves such lines out)"
        raise AttnscopeError(f"{fatal[0].message if fatal[0].line else fatal[0].reason}{hint}")
    inputs = [InputLine(row["text"], row["pair"], row["source"], row["line"]) for row in parsed if row["error"] is None]
    if not inputs:
        raise AttnscopeError("the corpus holds no inputs")
    return CorpusInputs(inputs[:limit], bad)


def _parse_file(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One file's bytes -> one row per input or malformed line (``error`` says why; line 0: the file)."""
    source = str(Path(row["path"]).resolve())
    try:
        inputs, bad = parse_input_file(source, row["bytes"])
    except AttnscopeError as error:
        return [{"source": source, "line": 0, "text": None, "pair": None, "error": str(error)}]
    found = [{"source": source, "line": entry.line, "text": entry.text, "pair": entry.pair, "error": None}
             for entry in inputs]
    return found + [{"source": source, "line": line.line, "text": None, "pair": None, "error": line.reason}
                    for line in bad]


# ---- 2. the actor pool --------------------------------------------------------------------------
def actor_resources(cluster_cpus: float, num_actors: int | None) -> tuple[int, int, float]:
    """(actors, torch threads per actor, CPUs each actor asks Ray for) on a cluster of ``cluster_cpus``.

    >>> actor_resources(2, None)
    (2, 1, 0.5)
    >>> actor_resources(16, 4)
    (4, 4, 3.5)
    """
    actors = num_actors or max(1, int(cluster_cpus))
    threads = max(1, int(cluster_cpus // actors))
    return actors, threads, max(0.5, threads - 0.5)


def compute_rows(ray: Any, inputs: list[InputLine], rows_dir: Path, *, model: str, dtype: str, batch_size: int,
                 num_actors: int | None, progress: bool) -> Any:
    """Head rows of every input (a DataFrame sorted by input, layer, head), written by the actor pool as
    Parquet part files into ``rows_dir``; input ``i`` of ``inputs`` is ``input_id`` i."""
    import pandas as pd

    from ..capture.extract import SORT_WINDOW_BATCHES

    if rows_dir.is_dir() and any(rows_dir.iterdir()):  # Ray adds part files: an earlier run's would count twice
        raise AttnscopeError(f"{rows_dir} already holds rows of an earlier run; choose a new output folder")
    actors, threads, cpus = actor_resources(ray.cluster_resources().get("CPU", 1), num_actors)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # part files in input order
    context.enable_progress_bars = False  # the driver shows one bar, over inputs
    # A block is one window of the local engine (extract_corpus sorts each window by length into batches), so
    # both engines run the same batches and give the same numbers; a retry redoes one window.
    window = batch_size * SORT_WINDOW_BATCHES
    blocks = [pd.DataFrame({"input_id": range(start, min(start + window, len(inputs))),
                            "text": [entry.text for entry in inputs[start:start + window]],
                            "pair": [entry.pair for entry in inputs[start:start + window]]})
              for start in range(0, len(inputs), window)]
    counter = ray.remote(num_cpus=0)(_Progress).remote()
    with warnings.catch_warnings():  # Ray 2.60 names no parameter for retries; its own default is unbounded
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        rows = ray.data.from_pandas(blocks).map_batches(
            HeadRowsWorker, batch_size=window, batch_format="pandas",
            compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus,
            fn_constructor_kwargs={"model": model, "dtype": dtype, "threads": threads, "batch_size": batch_size,
                                   "progress": counter},
            max_restarts=ACTOR_RETRIES, max_task_retries=ACTOR_RETRIES)
    _run_with_progress(lambda: rows.write_parquet(str(rows_dir)), counter, len(inputs), progress, ray)
    return checked_rows(pd.read_parquet(rows_dir), len(inputs))


def _run_with_progress(job: Any, counter: Any, total: int, progress: bool, ray: Any) -> None:
    """Run ``job`` on a thread while a tqdm bar follows ``counter``; re-raise what the job raised."""
    from tqdm.auto import tqdm

    failure: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as error:  # noqa: BLE001 - handed to the driver's thread below
            failure.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    with tqdm(total=total, unit="input", desc="analysing heads (ray)", disable=not progress) as bar:
        while worker.is_alive():
            worker.join(0.5)
            bar.update(min(total, ray.get(counter.value.remote())) - bar.n)
    if failure:
        last_line = (str(failure[0]).strip().splitlines() or [type(failure[0]).__name__])[-1]
        raise AttnscopeError(f"the Ray job failed: {last_line}") from failure[0]


def checked_rows(rows: Any, n_inputs: int) -> Any:
    """``rows`` sorted by input, layer and head, after checking each (input, layer, head) is there once."""
    rows = rows.sort_values(KEYS, ignore_index=True)
    if rows.duplicated(KEYS).any():
        raise AttnscopeError("the Ray job wrote some (input, layer, head) rows twice")
    found = rows["input_id"].nunique()
    if found != n_inputs or rows.groupby("input_id").size().nunique() != 1:
        raise AttnscopeError(f"the Ray job wrote rows for {found} of {n_inputs} inputs")
    return rows


# ---- 3. the report ------------------------------------------------------------------------------
def _report(out: Path, rows: Any, inputs: list[InputLine], loaded: Any) -> CorpusReport:
    """The local engine's report of ``rows``; the inputs whose maps it shows are re-run on the driver."""
    from ..capture.extract import extract_corpus
    from .store import HeadStore

    wanted = finding_inputs(rows, loaded.name)
    ids = sorted(set(wanted.values()))
    records = dict(zip(ids, extract_corpus(loaded, [inputs[i].item for i in ids], norms=True, progress=False)))
    report = write_report(out, rows, inputs_table(rows, inputs), loaded.name, examples_of(records, rows, wanted),
                          {"engine": "ray", "rows": str(out / ROWS_FOLDER / "head_stats")})
    with HeadStore(report.database) as store:  # the Parquet folder holds every table, as the database does
        store.export_parquet(out / ROWS_FOLDER, tables=("inputs", "meta", "head_labels"))
    return report
