"""The Ray engine of ``attnscope heads`` on a local Ray started here (2 CPUs), never an external cluster.

Reference: the local engine's rows of the same inputs (issue 16; issue 36: both engines run the same batches,
so the same ids, statistics and labels, bit for bit); a killed actor is retried and every (input, layer,
head) is there exactly once; a malformed line fails the job or is skipped, named by its file and line.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnscope.analysis.store import HeadStore
from attnscope.corpus.engines import analyze_heads
from attnscope.errors import AttnscopeError

ray = pytest.importorskip("ray")

N_SENTENCES = 300
ACTOR_TITLE = "HeadsWorker"  # Ray names an actor's process ray::MapWorker(MapBatches(HeadsWorker))
MARKER = f"ATTNSCOPE_TEST_RAY={os.getpid()}"  # in the environment of this Ray's processes: no other's actor is killed


@pytest.fixture(scope="module")
def local_ray():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(*MARKER.split("="))  # the processes ray.init starts inherit it
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def head_stats(database: Path) -> pd.DataFrame:
    with HeadStore(database) as store:
        return store.query("SELECT * FROM head_stats ORDER BY input_id, layer, head")


def reordering_tolerance(values: pd.DataFrame, n: int) -> np.ndarray:
    """Per column, how far two means of the same ``n`` float64 values per head, summed in different orders
    (pandas', DuckDB's parallel ``avg``, the exact sums of :class:`~attnscope.analysis.aggregate.ExactSum`), can
    lie apart. Each order's sum is off by at most (n - 1) u sum|x| (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., eq. 4.4), so its mean by (n - 1) u max|x|, plus u max|x| for the division: n u max|x|,
    twice that between two orders (u = 2^-53, float64's unit roundoff)."""
    return reordering_bound(values.abs().max().fillna(0.0).to_numpy(), n)  # a never-measured column: 0


def reordering_bound(largest: np.ndarray, n: int) -> np.ndarray:
    """:func:`reordering_tolerance` from ``largest``, the largest ``|x|`` of each cell's ``n`` float64 values."""
    unit_roundoff = np.finfo(np.float64).eps / 2
    return 2 * n * unit_roundoff * largest


def test_ray_rows_equal_the_local_engine(local_ray, tmp_path):
    # batches of 8: three windows of the local engine (128 + 128 + 44 inputs) over two actors
    local = analyze_heads("brown", tmp_path / "local", limit=N_SENTENCES, batch_size=8, progress=False)
    on_ray = analyze_heads("brown", tmp_path / "ray", limit=N_SENTENCES, batch_size=8, engine="ray", num_actors=2,
                           progress=False)
    expected, got = head_stats(local.database), head_stats(on_ray.database)
    assert on_ray.engine == "ray" and len(got) == N_SENTENCES * 72
    assert (got["input_id"].unique() == np.arange(N_SENTENCES)).all()
    pd.testing.assert_frame_equal(got, expected, check_exact=True)  # the same batches: the same bits
    # the merged partials' exact sums do not depend on how the inputs were split: the same figures
    pd.testing.assert_frame_equal(on_ray.summary, local.summary, check_exact=True)
    with HeadStore(on_ray.database) as store, HeadStore(local.database) as database:
        pd.testing.assert_frame_equal(store.query("SELECT * FROM head_labels ORDER BY layer, head"),
                                      database.query("SELECT * FROM head_labels ORDER BY layer, head"))
    def named(report):  # the heads each finding names, and the input whose map it shows
        return [(f.pattern, [(h["layer"], h["head"], h["example_input"]) for h in f.heads]) for f in report.findings]

    assert named(on_ray) == named(local) and (on_ray.patterns.counts == local.patterns.counts).all()
    # the report's figures against pandas' mean over every local row, summed in its own order
    reference = expected.drop(columns=["input_id", "n_tokens", "label", "kovaleva"]).groupby(
        ["layer", "head"], as_index=False).mean()
    tolerance = reordering_tolerance(reference, N_SENTENCES)
    for column, atol in zip(reference.columns, tolerance):
        np.testing.assert_allclose(on_ray.summary[column], reference[column], atol=atol, rtol=0, err_msg=column)
    # the Parquet folder the actors wrote is a store of its own, read where it lies (DuckDB's avg, in its order)
    with HeadStore(tmp_path / "ray" / "parquet") as folder, HeadStore(local.database) as database:
        top, expected_top = folder.top("sep", 5), database.top("sep", 5)
        assert top[["layer", "head", "inputs"]].equals(expected_top[["layer", "head", "inputs"]])
        np.testing.assert_allclose(top["mean"], expected_top["mean"], rtol=0,
                                   atol=reordering_tolerance(expected[["sep"]], N_SENTENCES)[0])
        assert folder.query("SELECT count(*) AS n FROM inputs").n[0] == N_SENTENCES


def write_corpus(folder: Path, n: int, bad_line: int) -> Path:
    """A JSONL corpus of ``n`` Brown sentences, the ``bad_line``-th line (1-based) not JSON."""
    from attnscope.data import brown_sentences

    lines = [json.dumps({"text": text}) for text in brown_sentences(n)]
    lines.insert(bad_line - 1, '{"text": "a line cut short')
    path = folder / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_line_fails_the_job_naming_file_and_line(local_ray, tmp_path):
    path = write_corpus(tmp_path, 5, bad_line=3)
    with pytest.raises(AttnscopeError, match=r"corpus\.jsonl line 3: not valid JSON"):
        analyze_heads([str(path)], tmp_path / "out", engine="ray", progress=False)


def actor_pids() -> list[int]:
    """This test's Ray processes whose title (Ray sets it in /proc/PID/cmdline) names the engine's actor."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if (ACTOR_TITLE in cmdline.read_bytes().decode(errors="replace")
                    and MARKER.encode() in cmdline.with_name("environ").read_bytes().split(b"\0")):
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return pids


def kill_one_actor_while_running(rows_dir: Path, killed: list[int], timeout: float = 180) -> None:
    """Once the first part file is written (the job is under way), SIGKILL one actor process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not killed:
        if rows_dir.is_dir() and any(rows_dir.iterdir()):
            for pid in actor_pids()[:1]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the actor's process in /proc (Linux)")
def test_a_killed_actor_is_retried_and_a_skipped_line_is_reported(local_ray, tmp_path):
    n = 120
    path = write_corpus(tmp_path, n, bad_line=7)
    out = tmp_path / "out"
    killed: list[int] = []
    killer = threading.Thread(target=kill_one_actor_while_running, args=(out / "parquet" / "head_stats", killed))
    killer.start()
    report = analyze_heads([str(path)], out, engine="ray", num_actors=2, batch_size=2, skip_bad=True,
                           progress=False)
    killer.join()
    assert killed, "no actor was killed while the job ran"
    assert [(bad.source, bad.line) for bad in report.skipped] == [(str(path), 7)]
    with HeadStore(report.database) as store:
        counts = store.query("SELECT input_id, layer, head, count(*) AS n FROM head_stats GROUP BY ALL")
        inputs = store.query("SELECT input_id, line FROM inputs ORDER BY input_id")
    assert len(counts) == n * 72 and (counts["n"] == 1).all()
    assert list(inputs["input_id"]) == list(range(n))
    assert list(inputs["line"]) == [*range(1, 7), *range(8, n + 2)]  # line 7 is left out, the order kept


def test_a_model_the_driver_cannot_load_fails_before_any_actor_starts(local_ray, tmp_path):
    with pytest.raises(AttnscopeError, match="no-such-model"):
        analyze_heads("brown", tmp_path / "out", model="no-such-model", engine="ray", limit=4, progress=False)
    assert not (tmp_path / "out" / "parquet").exists()


def test_an_earlier_runs_rows_are_never_counted_twice(local_ray, tmp_path):
    earlier = tmp_path / "out" / "parquet" / "head_stats"
    earlier.mkdir(parents=True)
    pd.DataFrame({"input_id": [0]}).to_parquet(earlier / "part-0.parquet")
    with pytest.raises(AttnscopeError, match="earlier run"):
        analyze_heads("brown", tmp_path / "out", engine="ray", limit=4, progress=False)


def test_a_missing_corpus_fails_before_ray_starts(monkeypatch, tmp_path):
    from attnscope.corpus import distributed

    def no_ray():  # starting Ray takes seconds: a corpus that does not exist must not cost them
        raise AssertionError("Ray was started for a corpus that does not exist")

    monkeypatch.setattr(distributed, "ray_module", no_ray)
    with pytest.raises(AttnscopeError, match="neither 'brown'"):
        analyze_heads(str(tmp_path / "missing.txt"), tmp_path / "out", engine="ray")


def test_sinks_on_ray_equal_the_local_report(local_ray, tmp_path):
    from attnscope.analysis.sinks import input_sinks, sink_report
    from attnscope.capture.extract import extract_corpus
    from attnscope.capture.loading import load_model
    from attnscope.corpus.distributed import SINKS_WINDOW_BATCHES, sinks_on_ray
    from attnscope.corpus.engines import Engine
    from attnscope.data import brown_sentences

    n, batch_size, factor = 60, 4, 5.0
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(brown_sentences(n)) + "\n")
    on_ray = sinks_on_ray([str(path)], model="minilm", dtype="float32", batch_size=batch_size, limit=None,
                          factor=factor, engine=Engine("ray", num_actors=2), progress=False)  # four windows of 16
    # here, the same batches as the actors (each window of 16 inputs in batches of 4): the same per-input values
    items, window = [(text, None) for text in brown_sentences(n)], batch_size * SINKS_WINDOW_BATCHES
    loaded = load_model("minilm")
    records = [record for start in range(0, n, window)
               for record in extract_corpus(loaded, items[start:start + window], batch_size=batch_size, norms=True,
                                            progress=False)]
    local = sink_report(records, factor)
    assert on_ray.n_inputs == local.n_inputs == n and on_ray.sink_tokens == local.sink_tokens
    per_input = [input_sinks(record, factor).measures for record in records]
    for name, values in local.measures.items():
        # the same n float64 values per (layer, head), summed in another order (the windows' sums merged as they
        # come back): at most 2 n u max|x| apart (reordering_tolerance)
        largest = np.fmax.reduce(np.abs([measures[name] for measures in per_input]), axis=0)  # NaN: never measured
        bound = reordering_bound(np.nan_to_num(largest), n)
        assert np.array_equal(np.isnan(on_ray.measures[name]), np.isnan(values)), name
        assert (np.nan_to_num(np.abs(on_ray.measures[name] - values)) <= bound).all(), name


def test_mixing_evaluation_on_ray_equals_the_local_table(local_ray):
    from attnscope.corpus.distributed import MIXING_BATCH, evaluate_mixing_on_ray
    from attnscope.corpus.engines import Engine
    from attnscope.experiments.faithfulness import evaluate_mixing

    n = MIXING_BATCH + 4  # two batches, one per actor
    local = evaluate_mixing(["minilm"], n, seed=3, progress=False)
    on_ray = evaluate_mixing_on_ray(["minilm"], n, seed=3, engine=Engine("ray", num_actors=2), progress=False)
    # each sentence is scored alone (its random baseline seeded by its index) and the table is summarised in
    # sentence order wherever the sentences ran: the same table, to the last bit
    assert on_ray == local


def test_a_runtime_environment_for_a_session_already_started_is_refused(local_ray, tmp_path):
    with pytest.raises(AttnscopeError, match="already initialised"):
        analyze_heads("brown", tmp_path / "out", engine="ray", limit=4, runtime_env={"env_vars": {"A": "b"}},
                      progress=False)
