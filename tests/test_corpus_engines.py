"""What makes the local and Ray engines' reports equal bit for bit, checked without Ray (issue 36).

References: the local engine's reader (:func:`~attnscope.corpus.report.read_corpus`) cut into its sort windows,
for the windows the Ray engine's read tasks emit; exact rational arithmetic (:class:`fractions.Fraction`) for
the aggregate's sums and means; the aggregate of all rows at once for partials merged in any split and order.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from attnscope.analysis.aggregate import FRACTION_BITS, ExactSum, HeadsPartial
from attnscope.analysis.patterns import PATTERNS
from attnscope.corpus.ray_engine import CorpusPlan, Source, window_rows
from attnscope.corpus.report import corpus_window, read_corpus


@pytest.mark.parametrize("limit", [None, 20])
@pytest.mark.parametrize("window", [1, 4, 5, 64])
def test_ray_windows_are_the_local_engines_sort_windows_across_source_ends(tmp_path, limit, window):
    sizes = [3, 0, 7, 1, 12, 2]  # an empty file, and windows that span two, three and four files
    paths = []
    for number, size in enumerate(sizes):
        paths.append(tmp_path / f"part{number}.txt")
        paths[-1].write_text("".join(f"file {number} line {line}\n" for line in range(size)))
    local = read_corpus([str(path) for path in paths], limit).inputs
    offsets = list(np.cumsum([0, *sizes[:-1]]))
    plan = CorpusPlan([Source(str(path), str(path)) for path in paths], offsets, len(local), [])
    rows = [row for source in range(len(paths)) for row in window_rows(plan, source, window)]
    expected = [local[first:first + window] for first in range(0, len(local), window)]
    assert [row["input_id"] for row in rows] == [list(range(first, first + len(inputs)))
                                                 for first, inputs in zip(range(0, len(local), window), expected)]
    assert [list(zip(row["text"], row["source"], row["line"])) for row in rows] == [
        [(entry.text, entry.source, entry.line) for entry in inputs] for inputs in expected]


def test_the_ray_engines_window_is_the_local_engines_sort_window():
    from attnscope.capture.extract import SORT_WINDOW_BATCHES

    assert corpus_window(8) == 8 * SORT_WINDOW_BATCHES


def random_values(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values of every sign and of magnitudes from 1e-12 to 1e4, a few NaN."""
    values = rng.random(n) * 10.0 ** rng.integers(-12, 5, n) * rng.choice([-1.0, 1.0], n)
    values[rng.choice(n, n // 50, replace=False)] = np.nan
    return values


def test_exact_sums_give_the_exact_mean_rounded_once_in_any_split_and_order():
    rng = np.random.default_rng(0)
    values, cell = random_values(rng, 4000), rng.integers(0, 5, 4000)
    whole = ExactSum.of(values, cell, 5)
    for _ in range(3):
        pieces = np.array_split(rng.permutation(len(values)), 7)
        merged = [ExactSum.of(values[piece], cell[piece], 5) for piece in pieces]
        total = merged[0]
        for part in merged[1:]:
            total = total + part
        assert (total.parts == whole.parts).all()
    counts = np.array([np.sum((cell == c) & ~np.isnan(values)) for c in range(5)])
    for c, mean in enumerate(whole.divided_by(counts)):
        measured = values[(cell == c) & ~np.isnan(values)]
        quantised = [Fraction(round(Fraction(x) * 2**FRACTION_BITS), 2**FRACTION_BITS) for x in measured]
        assert mean == float(sum(quantised) / len(measured))  # Fraction -> float rounds once, to the nearest


def test_exact_sums_keep_infinities_and_leave_nan_out():
    values = np.array([np.inf, 1.0, -np.inf, np.inf, -np.inf, np.nan, 2.0, np.nan])
    sums = ExactSum.of(values, np.array([0, 0, 1, 2, 2, 3, 3, 4]), 5)
    got = sums.divided_by(np.array([2, 1, 2, 1, 0]))
    np.testing.assert_array_equal(got, [np.inf, -np.inf, np.nan, 2.0, np.nan])


def head_rows_of(rng: np.random.Generator, n_inputs: int, shape: tuple[int, int]) -> pd.DataFrame:
    """Synthetic head rows: one per (input, layer, head), a statistic, a label and a finding's evidence."""
    inputs, layers, heads = (grid.ravel() for grid in np.indices((n_inputs, *shape)))
    n = len(inputs)
    return pd.DataFrame({"input_id": inputs, "layer": layers, "head": heads, "n_tokens": np.full(n, 9),
                         "entropy": random_values(rng, n), "label": rng.choice(list(PATTERNS), n),
                         "kovaleva": "vertical", "ev_diagonal": rng.random(n)})


def test_heads_partials_merged_in_any_split_and_order_give_the_same_summary():
    rng = np.random.default_rng(1)
    rows = head_rows_of(rng, 60, (2, 3))
    expected = HeadsPartial.from_rows(rows, "m", {"previous_word": "diagonal"})
    for _ in range(3):
        cuts = np.sort(rng.choice(np.arange(1, 60), 5, replace=False))
        pieces = [rows[rows["input_id"].between(start, stop - 1)] for start, stop in zip([0, *cuts], [*cuts, 60])]
        partials = [HeadsPartial.from_rows(piece, "m", {"previous_word": "diagonal"})
                    for piece in (pieces[i] for i in rng.permutation(len(pieces)))]
        merged = partials[0]
        for partial in partials[1:]:
            merged = merged.merge(partial)
        pd.testing.assert_frame_equal(merged.summary(), expected.summary(), check_exact=True)
        assert merged.clearest("previous_word", 1, 2) == expected.clearest("previous_word", 1, 2)
