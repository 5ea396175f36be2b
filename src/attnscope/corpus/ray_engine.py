"""The Ray engine's common part: read a corpus on the workers, run a model in an actor pool, merge partials.

Every corpus job on Ray (``attnscope heads``, ``sinks`` and the mixing evaluation with ``--engine ray``)
runs the same three steps, and the driver never holds a row per input:

1. :func:`plan_corpus`: Ray tasks parse each source (a file, or a named corpus the package ships) and
   return only its count of inputs and its malformed lines (file and line); the driver turns the counts
   into each source's first input id (inputs are numbered in corpus order: sources in order, then lines).
2. :func:`corpus_dataset`: the same tasks parse the sources again, this time emitting their inputs with
   their ids, straight into the actor pool, in whole *windows* of ids ``[k * window, (k + 1) * window)``,
   one row each (a window that runs past the end of its source is completed by the task of the source
   it starts in). ``attnscope heads`` cuts them where the local engine's
   :func:`~attnscope.corpus.report.corpus_records` cuts its sort windows, so that both engines sort,
   batch and pad every input alike and their rows are equal bit for bit.
3. :func:`fold_on_ray`: each actor (:class:`PartialWorker`: the model loaded once) turns a window into a
   mergeable partial and returns it pickled with the :class:`~attnscope.analysis.aggregate.Coverage` of
   its input ids; the driver merges the partials as they stream in, so its memory is that of one
   partial. Merging the coverages proves each input was counted exactly once. A dead actor is restarted
   and its window retried; a job that stops progressing (a lost node whose work cannot be placed again)
   fails after ``stall_s`` seconds with one line naming what was lost, never with partial results.

Actors ask Ray for half a CPU less than the torch threads they run (at least half a CPU) and the parsing
tasks for a quarter, so parsing always finds a CPU beside the actors (whole-CPU actors on a 2-CPU
machine starve Ray Data's tasks and the job hangs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..analysis.aggregate import Coverage
from ..errors import AttnscopeError
from ..inputs import BadLine, InputLine, parse_input_file

ACTOR_RETRIES = 3  # restarts of a dead actor, and retries of the window it held
READ_CPUS = 0.25  # what a parsing task asks Ray for
BLOCK_BYTES = 32 * 1024  # Ray Data splits a parsed source into blocks of about this size: a window each
STALL_SECONDS = 300.0  # a job with no finished batch for this long fails (see the module docstring)
QUIET_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve")


def ray_module() -> Any:
    """``ray`` with Ray Data, or one clear error saying how to install it."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise AttnscopeError("the Ray engine needs Ray: pip install 'attnscope[ray]'") from None
    return ray


# ---- connecting -----------------------------------------------------------------------------------
@contextlib.contextmanager
def ray_session(ray: Any, address: str | None, *, verbose: bool = False,
                runtime_env: dict[str, Any] | None = None) -> Iterator[TextIO]:
    """Joined to the cluster at ``address`` (None: a Ray started here) for the ``with`` block, quietly unless
    ``verbose``; an already initialised Ray is used as it is. A cluster that cannot be reached is one clear
    error naming the address.

    Yields the stream progress goes to (stderr). Quiet: nothing written to stdout or stderr during the
    session (Ray's C++ core and its Python threads: state dumps and log tails when a node is lost, ...)
    is shown but that stream; errors are raised, and printed by the caller after the session."""
    if ray.is_initialized():
        if runtime_env is not None:  # it would be ignored: the job's workers belong to the caller's session
            raise AttnscopeError("Ray is already initialised in this process: give the runtime environment to "
                                 "ray.init instead of runtime_env")
        _configure_data(ray, verbose)
        yield sys.stderr
        return
    _check_reachable(address)
    _check_runtime_env(ray, runtime_env)
    level = logging.INFO if verbose else logging.ERROR
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
    _no_auto_init()
    if not verbose:
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    with contextlib.ExitStack() as stack:
        progress_stream = sys.stderr if verbose else stack.enter_context(_silenced())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default" if verbose else "ignore")
                ray.init(address=address, include_dashboard=False, log_to_driver=verbose, logging_level=level,
                         runtime_env=runtime_env)
        except (ConnectionError, TimeoutError, ValueError, RuntimeError) as error:
            where = f"the Ray cluster at {address}" if address else "a local Ray"
            raise AttnscopeError(f"cannot connect to {where}: {_message_line(error)}") from None
        stack.callback(ray.shutdown)
        _configure_data(ray, verbose)
        yield progress_stream


@contextlib.contextmanager
def data_starting(ray: Any) -> Iterator[None]:
    """Ray Data's actors of the cluster (its statistics, actor locations and autoscaling coordinator, which a
    cluster's first dataset starts: seconds of process start-up) starting on a thread while the block runs, e.g.
    while the driver loads its model; joined at the end, so that the job's dataset finds them ready."""

    def start() -> None:
        with contextlib.suppress(Exception):  # the job's own dataset starts them then
            ray.data.range(1).materialize()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def _configure_data(ray: Any, verbose: bool) -> None:
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the driver shows one bar, over inputs
    context.target_max_block_size = BLOCK_BYTES  # a big file's windows reach every actor, not one
    context.print_on_execution_start = verbose


def _check_reachable(address: str | None, timeout_s: float = 10.0) -> None:
    """A HOST:PORT address where nothing listens, or something other than Ray's GCS answers, fails now, in one
    line (Ray itself retries for minutes, silently)."""
    import socket

    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or "://" in (address or ""):  # None, "auto", "local", ray:// ...: Ray decides
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as connection:
            answer = _http2_answer(connection)
    except OSError as error:
        reason = "connection refused" if isinstance(error, ConnectionRefusedError) else error.strerror or str(error)
        raise AttnscopeError(f"cannot connect to the Ray cluster at {address}: {reason} (is 'ray start --head' "
                             "running there, and is the port its --port?)") from None
    if answer is not None and not _is_http2_settings(answer):
        raise AttnscopeError(f"cannot connect to the Ray cluster at {address}: {_what_answered(answer)}, not Ray's "
                             "GCS (is the port the one 'ray start --head' printed?)")


# Ray's GCS is a gRPC server, so HTTP/2: to a client's preface (RFC 9113, 3.4) it answers with a SETTINGS frame
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
HANDSHAKE_SECONDS = 5.0


def _http2_answer(connection: Any) -> bytes | None:
    """The first bytes the server at ``connection`` answers an HTTP/2 preface with (b"": it closed; None: a cluster
    that speaks TLS, which this probe does not)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    connection.sendall(HTTP2_PREFACE)
    connection.settimeout(HANDSHAKE_SECONDS)
    answer = b""
    try:
        while len(answer) < 9 and (received := connection.recv(256)):
            answer += received
    except (TimeoutError, ConnectionResetError):
        pass  # silent, or gone: what came is the answer
    return answer


def _is_http2_settings(answer: bytes) -> bool:
    """Whether ``answer`` starts with an HTTP/2 frame header of a SETTINGS frame (type 4) on stream 0."""
    return len(answer) >= 9 and answer[3] == 4 and answer[5:9] == bytes(4)


def _what_answered(answer: bytes) -> str:
    if not answer:
        return "something accepts connections there but did not answer"
    first = answer.split(b"\n")[0].strip().decode("ascii", "replace")
    if first.startswith("HTTP/"):
        return f"an HTTP server answered ({first})"
    return f"something else answered ({first!r})" if first.isprintable() else "something else answered"


def _check_runtime_env(ray: Any, runtime_env: dict[str, Any] | None) -> None:
    """A runtime environment Ray would reject fails now, in one line (Ray's own check, before ``ray.init``)."""
    if runtime_env is None:
        return
    _check_env_vars(runtime_env.get("env_vars"))
    try:
        ray.runtime_env.RuntimeEnv(**runtime_env)
    except (TypeError, ValueError) as error:
        raise AttnscopeError(f"--runtime-env: {_message_line(error)}") from None
    known = _runtime_env_fields(ray)
    unknown = sorted(set(runtime_env) - known)
    if unknown:  # Ray passes them on to plugins, and without one of that name the job runs as if they were not there
        public = sorted(name for name in known if not name.startswith("_"))
        raise AttnscopeError(f"--runtime-env: Ray would ignore {', '.join(map(repr, unknown))} (no such field); "
                             f"its fields are {', '.join(public)}")


def _runtime_env_fields(ray: Any) -> set[str]:
    """The fields Ray's runtime environment acts on: its own, and those of the plugins whose schemas it loaded
    (while checking one: call it after ``RuntimeEnv(...)``)."""
    fields = set(ray.runtime_env.RuntimeEnv.known_fields)
    with contextlib.suppress(ImportError):  # where Ray keeps the plugins' schemas (a private module)
        from ray._private.runtime_env.plugin_schema_manager import RuntimeEnvPluginSchemaManager

        fields |= set(RuntimeEnvPluginSchemaManager.schemas)
    return fields


def _check_env_vars(env_vars: Any) -> None:
    """Ray's ``env_vars`` is an object of strings; say which value is not one (Ray names a Python type)."""
    if env_vars is None:
        return
    if not isinstance(env_vars, dict):
        raise AttnscopeError('--runtime-env: "env_vars" must be an object of names and strings, e.g. '
                             '{"env_vars": {"HF_HOME": "/shared/hf"}}')
    for name, value in env_vars.items():
        if not isinstance(value, str):
            raise AttnscopeError(f'--runtime-env: "env_vars" value of {name} must be a string (in quotes), got '
                                 f"{json.dumps(value)}")


def _message_line(error: BaseException, *, last: bool = False) -> str:
    """One line of an exception's message for a one-line error (the first, or the ``last``: where a remote
    traceback ends), or its type's name when it has none."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[-1] if last else lines[0]


def runtime_env_argument(value: str) -> dict[str, Any]:
    """``--runtime-env``: a JSON object, or the path of a ``.json`` file holding one (argparse type). A value
    that starts as JSON does (``{`` or ``[``) is JSON, never a file name."""
    import argparse

    from ..files import parse_json, read_text

    text, where = value, "the JSON"
    if not value.lstrip().startswith(("{", "[")):
        try:
            text, where = read_text(value), value
        except AttnscopeError as error:
            raise argparse.ArgumentTypeError(f"neither a JSON object nor a file that can be read ({error})") from None
    try:
        parsed = parse_json(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON: {error.msg} at line {error.lineno}, "
                                         f"column {error.colno}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{where} must be a JSON object, e.g. "
                                         '{"env_vars": {"HF_HOME": "/shared/hf"}}')
    return parsed


def _no_auto_init() -> None:
    """A Ray Data thread that outlives the job (its autoscaler, its stats) calls Ray after ``shutdown``; by
    default that starts a new local Ray in this process (whose lines then flood stdout). Never."""
    from ray._private import auto_init_hook

    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    auto_init_hook.enable_auto_connect = False  # read from the environment when Ray was imported


@contextlib.contextmanager
def _silenced() -> Iterator[TextIO]:
    """Everything this process writes to stdout and stderr goes nowhere (file descriptors 1 and 2, and
    Python's ``sys.stdout``/``sys.stderr``, which Ray's threads print node deaths and log tails to);
    yields a stream to the real stderr, for attnscope's progress bar."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr
    with (open(saved[2], "w", buffering=1, encoding=streams[1].encoding, errors="replace", closefd=False) as real_stderr,
          open(os.devnull, "w") as nowhere):
        for fd in (1, 2):
            os.dup2(nowhere.fileno(), fd)
        sys.stdout = sys.stderr = nowhere
        try:
            yield real_stderr
        finally:
            real_stderr.flush()
            sys.stdout, sys.stderr = streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


# ---- 1. and 2. reading on the workers -------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One source of inputs: a file (``path`` resolved, ``name`` as the user gave it) or a named corpus
    (``path`` None), read and parsed where a Ray task runs."""

    name: str
    path: str | None = None

    def parse(self) -> tuple[list[InputLine], list[BadLine]]:
        """Its inputs and malformed lines, named by ``name``; an unreadable file is an AttnscopeError."""
        if self.path is None:
            from .report import named_corpus

            return named_corpus(self.name), []
        try:
            data = Path(self.path).read_bytes()
        except OSError as error:
            raise AttnscopeError(f"cannot read {self.name}: {error.strerror or error}") from None
        return parse_input_file(self.name, data)


def corpus_sources_of(corpus: str | Sequence[str]) -> list[Source]:
    """The sources a CORPUS argument names (see :func:`attnscope.corpus.report.corpus_sources`)."""
    from .report import corpus_sources

    name, files = corpus_sources(corpus)
    return [Source(name)] if name is not None else [Source(str(path), str(path.resolve())) for path in files]


@dataclass(frozen=True)
class CorpusPlan:
    """Where each source's inputs start (``offsets[i]``: the id of source i's first input), the sources
    needed (the first ``len(offsets)``), the number of inputs kept, and the malformed lines skipped."""

    sources: list[Source]
    offsets: list[int]
    n_inputs: int
    skipped: list[BadLine]


def plan_corpus(ray: Any, sources: list[Source], limit: int | None, *, skip_bad: bool) -> CorpusPlan:
    """Count each source's inputs on the workers (see the module docstring); a malformed line fails with
    its file and line unless ``skip_bad``; an empty corpus fails."""
    if limit is not None and limit < 1:
        raise AttnscopeError("--limit must be at least 1")
    count = ray.remote(num_cpus=READ_CPUS)(_count_source)  # plain tasks: a first Ray Data job costs seconds
    counted = ray.get([count.remote(row) for row in _source_rows(sources, None)])
    offsets, skipped, total = [], [], 0
    for row in counted:
        if limit is not None and total >= limit:
            break  # as the local engine: sources past the limit are never read
        if row["error"]:
            raise AttnscopeError(row["error"])
        bad = [BadLine(sources[row["index"]].name, line, reason) for line, reason in zip(row["bad_lines"],
                                                                                          row["bad_reasons"])]
        if bad and not skip_bad:
            raise AttnscopeError(f"{bad[0].message} (--on-bad-line skip leaves such lines out)")
        offsets.append(total)
        skipped.extend(bad)
        total += row["count"]
    n_inputs = total if limit is None else min(total, limit)
    if not n_inputs:
        raise AttnscopeError("the corpus holds no inputs")
    return CorpusPlan(sources[:len(offsets)], offsets, n_inputs, skipped)


def _source_rows(sources: list[Source], offsets: list[int] | None) -> list[dict[str, Any]]:
    """One row per source: its index, name, path and first id."""
    return [{"index": i, "name": s.name, "path": s.path or "", "offset": offsets[i] if offsets else 0}
            for i, s in enumerate(sources)]


def _source_items(ray: Any, sources: list[Source], offsets: list[int] | None) -> Any:
    """A Ray dataset of :func:`_source_rows`, one block (so one task) per source."""
    return ray.data.from_items(_source_rows(sources, offsets), override_num_blocks=len(sources))


def _source_of(row: dict[str, Any]) -> Source:
    return Source(row["name"], row["path"] or None)


def _count_source(row: dict[str, Any]) -> dict[str, Any]:
    """A Ray task: one source's count of inputs and its malformed lines (``error``: the source is unreadable)."""
    try:
        inputs, bad = _source_of(row).parse()
    except AttnscopeError as error:
        return {"index": row["index"], "count": 0, "bad_lines": [], "bad_reasons": [], "error": str(error)}
    return {"index": row["index"], "count": len(inputs), "bad_lines": [b.line for b in bad],
            "bad_reasons": [b.reason for b in bad], "error": ""}


def corpus_dataset(ray: Any, plan: CorpusPlan, window: int) -> Any:
    """A Ray dataset of the plan's inputs, parsed on the workers, one row per window of ``window`` inputs (see
    the module docstring; :func:`window_rows`)."""

    def windows_of(row: dict[str, Any]) -> list[dict[str, Any]]:
        return window_rows(plan, row["index"], window)

    return _source_items(ray, plan.sources, plan.offsets).flat_map(windows_of, num_cpus=READ_CPUS)


def window_rows(plan: CorpusPlan, source: int, window: int) -> list[dict[str, Any]]:
    """The windows that start in source ``source``: ids ``[k * window, (k + 1) * window)`` cut at ``n_inputs``,
    each one row of lists ``input_id``, ``text``, ``pair``, ``source``, ``line`` (ids in corpus order); the
    last one takes its tail from the following sources."""
    stop = plan.offsets[source + 1] if source + 1 < len(plan.offsets) else plan.n_inputs
    starts = range(-(-plan.offsets[source] // window) * window, min(stop, plan.n_inputs), window)
    if not starts:
        return []
    inputs = _inputs_between(plan, source, starts[0], min(starts[-1] + window, plan.n_inputs))
    return [{name: [entry[name] for entry in inputs[first - starts[0]:first - starts[0] + window]]
             for name in WINDOW_FIELDS} for first in starts]


WINDOW_FIELDS = ("input_id", "text", "pair", "source", "line")


def _inputs_between(plan: CorpusPlan, source: int, first: int, stop: int) -> list[dict[str, Any]]:
    """Inputs ``first .. stop - 1`` (ids), read from source ``source`` on (where ``first`` lies) as far as needed."""
    inputs: list[dict[str, Any]] = []
    for index in range(source, len(plan.sources)):
        offset = plan.offsets[index]
        if offset >= stop:
            break
        parsed, _ = plan.sources[index].parse()
        inputs.extend({"input_id": offset + i, "text": entry.text, "pair": entry.pair, "source": entry.source,
                       "line": entry.line} for i, entry in enumerate(parsed) if first <= offset + i < stop)
    return inputs


def items_dataset(ray: Any, texts: Sequence[str], window: int) -> Any:
    """A small Ray dataset of ``input_id``, ``text`` (e.g. a fixed evaluation set the driver holds), one row per
    window of ``window`` texts."""
    return ray.data.from_items([{"input_id": list(range(first, min(first + window, len(texts)))),
                                 "text": list(texts[first:first + window])} for first in range(0, len(texts), window)])


# ---- 3. the actor pool and the merge --------------------------------------------------------------
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


class PartialWorker:
    """A Ray actor's state: the model, loaded once with torch on ``threads`` threads. Called on window rows
    (pandas, each cell a list; see :func:`corpus_dataset`), it returns one row per window: the pickled
    ``(Coverage, partial)`` of :meth:`partial` of the window's inputs (pandas, one row each, with
    ``input_id``), which subclasses define."""

    def __init__(self, model: str, dtype: str, threads: int, progress: Any = None) -> None:
        import torch

        from ..capture.loading import load_model

        torch.set_num_threads(threads)
        self.loaded = load_model(model, dtype=dtype)
        self.progress = progress

    def partial(self, inputs: Any) -> Any:
        raise NotImplementedError

    def done(self, n: int) -> None:
        """Tell the driver's progress bar that ``n`` more inputs are done."""
        if self.progress is not None:
            self.progress.add.remote(n)

    def __call__(self, windows: Any) -> Any:
        import pandas as pd

        partials = []
        for _, window in windows.iterrows():
            inputs = pd.DataFrame({name: list(values) for name, values in window.items()})
            coverage = Coverage.of(inputs["input_id"].to_numpy())
            partials.append(pickle.dumps((coverage, self.partial(inputs))))
        return pd.DataFrame({"partial": partials})


class _Progress:
    """Inputs done so far, counted by the actors (a retried window may count twice: the bar caps it)."""

    def __init__(self) -> None:
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n

    def value(self) -> int:
        return self.done


@dataclass
class Folded:
    """What :func:`fold_on_ray` returns: the merged partial and how many windows it came from."""

    value: Any
    windows: int


def fold_on_ray(ray: Any, dataset: Any, worker: type[PartialWorker], kwargs: dict[str, Any], *, n_inputs: int,
                num_actors: int | None, desc: str, progress: bool | TextIO, stall_s: float = STALL_SECONDS,
                unit: str = "input") -> Folded:
    """Run ``worker`` over ``dataset`` (window rows) in an actor pool, one window a call, and merge the
    partials as they arrive (``partial.merge(other)``); checks every input id ``0 .. n_inputs - 1`` was
    counted exactly once. ``kwargs``: the worker's arguments besides ``threads`` and ``progress``.
    ``progress``: a stream for the progress bar (True: stderr; False: none), counting ``unit``s."""
    actors, threads, cpus = actor_resources(ray.cluster_resources().get("CPU", 1), num_actors)
    counter = ray.remote(num_cpus=0)(_Progress).remote()
    with warnings.catch_warnings():  # Ray 2.60 names no parameter for retries; its own default is unbounded
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        partials = dataset.map_batches(
            worker, batch_size=1, batch_format="pandas", compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=cpus, fn_constructor_kwargs={**kwargs, "threads": threads, "progress": counter},
            max_restarts=ACTOR_RETRIES, max_task_retries=ACTOR_RETRIES, scheduling_strategy="SPREAD")
    merged: dict[str, Any] = {"coverage": Coverage(), "value": None, "windows": 0}

    def merge_all() -> None:
        for row in partials.iter_rows():
            coverage, value = pickle.loads(row["partial"])
            merged["coverage"] = merged["coverage"].merge(coverage)
            merged["value"] = value if merged["value"] is None else merged["value"].merge(value)
            merged["windows"] += 1

    _run_watched(ray, merge_all, counter, n_inputs, desc, progress, stall_s, unit)
    merged["coverage"].check_complete(n_inputs)
    return Folded(merged["value"], merged["windows"])


def _run_watched(ray: Any, job: Callable[[], None], counter: Any, total: int, desc: str,
                 progress: bool | TextIO, stall_s: float, unit: str = "input") -> None:
    """Run ``job`` on a thread while a tqdm bar (stderr) follows ``counter``; fail with one line when the
    job fails or stops progressing for ``stall_s`` seconds, naming the nodes lost meanwhile."""
    from tqdm.auto import tqdm

    failure: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as error:  # noqa: BLE001 - handed to the driver's thread below
            failure.append(error)

    alive = _alive_nodes(ray)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    last_change, done = time.monotonic(), 0
    stream = progress if not isinstance(progress, bool) else sys.stderr
    with tqdm(total=total, unit=unit, desc=desc, disable=progress is False, file=stream) as bar:
        while worker.is_alive():
            worker.join(0.5)
            now_done = min(total, _counted(ray, counter, done))
            if now_done != done:
                done, last_change = now_done, time.monotonic()
            bar.update(done - bar.n)
            if time.monotonic() - last_change > stall_s:
                raise AttnscopeError(f"the Ray job made no progress for {stall_s:.0f} s{_lost(ray, alive)}; "
                                     f"stopped after {done} of {total} {unit}s, nothing reported")
    if failure:
        if isinstance(failure[0], AttnscopeError):
            raise failure[0]
        raise AttnscopeError(f"the Ray job failed{_lost(ray, alive)}: {_message_line(failure[0], last=True)}"
                             ) from failure[0]


def _counted(ray: Any, counter: Any, fallback: int) -> int:
    """The progress counter's value (the last one seen if the counter cannot answer within a second)."""
    try:
        return int(ray.get(counter.value.remote(), timeout=1.0))
    except Exception:  # noqa: BLE001 - a busy or lost counter only delays the bar
        return fallback


def _alive_nodes(ray: Any) -> dict[str, str]:
    """Node id -> address of the cluster's live nodes."""
    return {node["NodeID"]: node.get("NodeManagerAddress", "?") for node in ray.nodes() if node.get("Alive")}


def _lost(ray: Any, alive_before: dict[str, str]) -> str:
    """' after losing node ADDRESS (id ...)' for nodes alive at the start and dead now, else ''."""
    try:
        now = _alive_nodes(ray)
    except Exception:  # noqa: BLE001 - the cluster itself is gone
        return " (the Ray cluster stopped answering)"
    lost = [f"{address} (node id {node_id[:12]})" for node_id, address in alive_before.items() if node_id not in now]
    return f" after losing node {', '.join(lost)}" if lost else ""
