"""Writers shared by the result types of experiments and probing: tables, figures, the HTML summary.

Figures are matplotlib (Agg, no display needed); tables go to CSV, Parquet or DuckDB by suffix;
the summary page is a fixed template filled with escaped text, a pandas table and links to the
figures written beside it. The result types import this module to draw and save themselves; it
knows none of them, so the dependency goes one way.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any

from ..errors import AttnscopeError

TABLE_FORMATS = ("csv", "parquet", "duckdb")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_figure(figure: Any, path: str | Path | None, dpi: int = 130) -> Any:
    """Lay out ``figure``; save it to ``path`` (and release it) when given."""
    figure.tight_layout()
    if path is not None:
        from ..files import written

        with written(path) as temporary:
            figure.savefig(temporary, dpi=dpi)
        pyplot().close(figure)
    return figure


def table_format(path: Path) -> str:
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in TABLE_FORMATS:
        raise AttnscopeError(f"cannot write a table to {path.name}: use a .csv, .parquet or .duckdb file")
    return fmt


def write_table(frame: Any, path: Path, table: str = "results") -> Path:
    """Write ``frame`` as CSV, Parquet (needs pyarrow) or a DuckDB database with one table ``table``."""
    from ..files import written

    fmt = table_format(path)
    with written(path) as temporary:
        if fmt == "csv":
            frame.to_csv(temporary, index=False)
        elif fmt == "parquet":
            try:
                frame.to_parquet(temporary, index=False)
            except ImportError:
                raise AttnscopeError("writing Parquet needs pyarrow: pip install pyarrow") from None
        else:
            temporary.unlink()  # DuckDB makes its own database file
            _write_duckdb(frame, temporary, table)
    return path


def _write_duckdb(frame: Any, path: Path, table: str) -> None:
    try:
        import duckdb
    except ImportError:
        raise AttnscopeError("writing DuckDB needs duckdb: pip install duckdb") from None
    path.unlink(missing_ok=True)
    with duckdb.connect(str(path)) as connection:
        connection.register("frame", frame)
        connection.execute(f'CREATE TABLE "{table}" AS SELECT * FROM frame')


PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>$title</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: right; }
td:first-child { font-weight: bold; text-align: left; }
</style>
</head>
<body>
<h1>$title</h1>
$facts
$figures
<h2>$table_title</h2>
$table
</body>
</html>
""")

IMAGE = Template('<p><img src="$src" alt="$src"></p>')


def write_summary(path: Path, title: str, facts: Mapping[str, Any], figures: Sequence[str], table: Any,
                  table_title: str = "Table") -> Path:
    """An HTML page: ``facts`` as a list, the figure files (relative to ``path``) and ``table`` (a DataFrame)."""
    import pandas as pd

    fact_table = pd.DataFrame({"fact": list(facts), "value": [str(v) for v in facts.values()]})
    images = "\n".join(IMAGE.substitute(src=html.escape(name, quote=True)) for name in figures)
    page = PAGE.substitute(title=html.escape(title), facts=fact_table.to_html(index=False, header=False, border=0),
                           figures=images,
                           table_title=html.escape(table_title),
                           table=table.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0))
    from ..files import written

    with written(path) as temporary:
        temporary.write_text(page, encoding="utf-8")
    return path
