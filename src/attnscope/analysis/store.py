"""Per-head x per-input statistics in an embedded DuckDB database, exportable to Parquet.

Tables (layers and heads 0-indexed):

* ``inputs``: ``input_id``, ``text``, ``pair``, ``n_tokens``;
* ``head_stats``: one row per (``input_id``, ``layer``, ``head``): every statistic of
  :mod:`attnscope.analysis.stats` (``norm_*`` when norms were captured), the pattern ``label``,
  its ``kovaleva`` type and ``confidence``, and the pattern evidence (``ev_*``);
* ``head_labels``: one row per (``layer``, ``head``): the head's most common (modal) ``label`` over the
  inputs, the ``share`` of inputs that carried it, ``stable`` (see ``meta``'s ``stable_rule``), the
  ``runner_up`` label, its ``runner_up_share`` and ``mixed`` (two labels carry the stable share together),
  ``inputs`` and the share of every label (``share_<label>``);
* ``meta``: ``key``, ``value`` (model name, attnscope version, the stability rule, ...);
* ``head_functions`` and ``head_function_groups`` (written by :func:`store_head_scores`, ``attnscope
  head-functions --store``): head-function scores per (``layer``, ``head``) and per (``layer``, ``kv_head``), as
  :meth:`~attnscope.analysis.head_functions.HeadScores.to_frame` gives them, with a ``model`` column; their
  model and settings in ``meta`` (``head_functions_model``, ``head_functions_settings``). Beside
  ``head_labels`` they join on ``layer, head``.

A store opens a DuckDB file, or a folder of Parquet files with the same tables (what
``attnscope heads --engine ray`` writes into ``OUT/parquet/``, or ``heads --parquet DIR`` exports): each
table is ``DIR/<table>.parquet`` or a folder ``DIR/<table>/`` of part files, read where it lies.

>>> store = HeadStore("report/heads.duckdb")                                     # doctest: +SKIP
>>> store.query("SELECT layer, head, avg(sep) AS sep FROM head_stats "
...             "WHERE layer BETWEEN 3 AND 5 GROUP BY ALL HAVING avg(sep) > 0.5")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from ..errors import AttnscopeError

if TYPE_CHECKING:
    from .head_functions import HeadScores

DEFAULT_DB = "heads.duckdb"
KEY_COLUMNS = ("input_id", "layer", "head", "n_tokens")  # numeric, but no metric to rank heads by
TEXT_COLUMNS = ("label", "kovaleva")
TABLES = ("head_stats", "inputs", "meta", "head_labels", "head_functions", "head_function_groups")


def _duckdb() -> Any:
    try:
        import duckdb
    except ImportError:
        raise AttnscopeError("the head store needs DuckDB: pip install duckdb") from None
    return duckdb


class HeadStore:
    """A DuckDB file of head statistics (see the module docstring for its tables)."""

    def __init__(self, path: str | Path, read_only: bool = True) -> None:
        self.path = Path(path)
        if read_only and not self.path.exists():
            raise AttnscopeError(f"no head database at {self.path}; write one with 'attnscope heads CORPUS -o DIR'")
        duckdb = _duckdb()
        try:
            if self.path.is_dir():
                self.connection = duckdb.connect()  # in memory, with views over the Parquet files
                _parquet_views(self.connection, self.path)
            else:
                self.connection = duckdb.connect(str(self.path), read_only=read_only)
                # views over Parquet (the Ray engine's) name their files relative to the database's folder
                self.connection.execute("SET file_search_path = ?", [str(self.path.resolve().parent)])
        except duckdb.Error as error:
            raise AttnscopeError(f"cannot open {self.path} as a DuckDB database: {error}") from None

    @classmethod
    def create(cls, path: str | Path, head_rows: Any, inputs: Any, meta: dict[str, str],
               head_labels: Any | None = None) -> HeadStore:
        """Write the tables from pandas DataFrames (replacing an existing file); a table given as None is
        left out."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        store = cls(path, read_only=False)
        import pandas as pd

        meta_frame = pd.DataFrame({"key": list(meta), "value": list(meta.values())})
        tables = {"head_stats": head_rows, "inputs": inputs, "meta": meta_frame, "head_labels": head_labels}
        for name, frame in tables.items():
            if frame is None:
                continue
            store.connection.register("frame_view", frame)
            store.connection.execute(f"CREATE TABLE {name} AS SELECT * FROM frame_view")
            store.connection.unregister("frame_view")
        return store

    @classmethod
    def create_over_parquet(cls, path: str | Path, folder: str, tables: tuple[str, ...], meta: dict[str, str],
                            head_labels: Any) -> HeadStore:
        """A database whose ``tables`` are views of Parquet part files ``<folder>/<table>/*.parquet`` (``folder``
        relative to the database's own folder, so the report folder can move), plus ``meta`` and
        ``head_labels`` tables; nothing of the part files is copied."""
        store = cls.create(path, None, None, meta, head_labels=head_labels)
        for table in tables:
            source = _sql_path(Path(folder) / table / "*.parquet")
            store.connection.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{source}')")
        return store

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def query(self, sql: str, parameters: list[Any] | None = None) -> Any:
        """Run SQL and return a pandas DataFrame (errors in the SQL become one-line AttnscopeErrors)."""
        duckdb = _duckdb()
        try:
            return self.connection.execute(sql, parameters or []).df()
        except duckdb.Error as error:
            raise AttnscopeError(f"SQL error: {str(error).splitlines()[0]}") from None

    def metrics(self) -> list[str]:
        """Numeric columns of ``head_stats`` that ``top`` can rank by."""
        rows = self.connection.execute("SELECT column_name, data_type FROM information_schema.columns "
                                       "WHERE table_name = 'head_stats' ORDER BY ordinal_position").fetchall()
        return [name for name, kind in rows if name not in KEY_COLUMNS and name not in TEXT_COLUMNS
                and kind in ("DOUBLE", "FLOAT", "BIGINT", "INTEGER")]

    def top(self, metric: str, n: int = 10, layers: tuple[int, int] | None = None, ascending: bool = False) -> Any:
        """Heads ranked by the mean of ``metric`` over inputs: ``layer``, ``head``, ``mean``, ``inputs``.

        ``layers``: an inclusive 0-indexed range. Inputs where the metric did not apply are skipped.
        """
        known = self.metrics()
        if metric not in known:
            raise AttnscopeError(f"unknown metric {metric!r}; choose from {', '.join(known)}")
        if n < 1:
            raise AttnscopeError("the number of heads must be at least 1")
        where = "WHERE layer BETWEEN ? AND ?" if layers else ""
        order = "ASC" if ascending else "DESC"
        sql = (f'SELECT layer, head, avg("{metric}") AS mean, count("{metric}") AS inputs FROM head_stats {where} '
               f"GROUP BY layer, head HAVING count(\"{metric}\") > 0 ORDER BY mean {order}, layer, head LIMIT ?")
        return self.query(sql, [*(layers or ()), n])

    def meta(self) -> dict[str, str]:
        """The ``meta`` table as a dict (empty where there is none)."""
        tables = {name for (name,) in self.connection.execute("SELECT table_name FROM information_schema.tables")
                  .fetchall()}
        return dict(self.connection.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}

    def export_parquet(self, folder: str | Path, tables: tuple[str, ...] = TABLES) -> list[Path]:
        """Every table (of ``tables``) as ``folder/<table>.parquet``; returns the paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        present = {name for (name,) in self.connection.execute("SELECT table_name FROM information_schema.tables")
                   .fetchall()}
        for table in [name for name in tables if name in present]:  # head_labels is missing from older files
            target = folder / f"{table}.parquet"
            self.connection.execute(f"COPY {table} TO '{_sql_path(target)}' (FORMAT PARQUET)")
            written.append(target)
        return written


HEAD_FUNCTION_TABLES = {"head_functions": "head", "head_function_groups": "kv_head"}  # table -> to_frame's ``per``


def check_head_store(path: str | Path, model: str | None = None) -> None:
    """Refuse, in one line, a ``path`` that :func:`store_head_scores` could not write: a file that is no DuckDB
    database, or (with ``model``) one whose head labels are of another model. A missing file is fine."""
    path = Path(path)
    if not path.exists():
        return
    with HeadStore(path, read_only=True) as store:
        labelled = store.meta().get("model")
    if model is not None and labelled is not None and labelled != model:
        raise AttnscopeError(f"{path} holds head labels of {labelled}, not {model}: its rows would not join; "
                             "choose another store")


def store_head_scores(path: str | Path, scores: HeadScores) -> Path:
    """Write ``scores`` into the DuckDB file ``path`` (made if missing) as the tables ``head_functions`` and
    ``head_function_groups`` (replacing earlier ones), beside whatever else it holds; returns ``path``."""
    path = Path(path)
    check_head_store(path, scores.model)
    with HeadStore(path, read_only=False) as store:
        store.connection.execute("BEGIN TRANSACTION")
        for table, per in HEAD_FUNCTION_TABLES.items():
            frame = scores.to_frame(per)
            frame.insert(0, "model", scores.model)
            store.connection.register("frame_view", frame)
            store.connection.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT * FROM frame_view")
            store.connection.unregister("frame_view")
        store.connection.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR, value VARCHAR)")
        meta = {"head_functions_model": scores.model, "head_functions_settings": json.dumps(scores.settings)}
        store.connection.execute("DELETE FROM meta WHERE key IN (SELECT unnest(?))", [list(meta)])
        store.connection.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
        store.connection.execute("COMMIT")
    return path


def _parquet_views(connection: Any, folder: Path) -> None:
    """A view per table found in ``folder``: ``<table>.parquet`` or ``<table>/**/*.parquet``."""
    found = 0
    for table in TABLES:
        single, parts = folder / f"{table}.parquet", folder / table
        source = single if single.is_file() else parts / "**" / "*.parquet" if parts.is_dir() else None
        if source is not None:
            connection.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{_sql_path(source)}')")
            found += 1
    if not found:
        raise AttnscopeError(f"{folder} holds no head tables ({', '.join(f'{t}.parquet' for t in TABLES)})")


def _sql_path(path: Path) -> str:
    return str(path).replace("'", "''")
