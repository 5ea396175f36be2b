"""Corpus analysis: inputs (the shipped Brown samples or a user's file) and the corpus report.

:func:`analyze_corpus` streams records once and writes, into one folder, the DuckDB file of
per-head x per-input statistics, PNG figures and an HTML report that shows them with tables:

* ``analysis_patterns.png``: the pattern-type distribution across heads (Kovaleva et al. 2019);
* ``analysis_token_types.png``: per-layer attention to [CLS], [SEP], punctuation and other tokens,
  raw (Clark et al. 2019, figure 2) beside norm-weighted (Kobayashi et al. 2020);
* ``analysis_head_map.png``: a layers x heads map of each head's dominant pattern;
* ``example_<pattern>.png``: for each of Vig's patterns, the clearest map of the head that shows it
  most clearly (the findings list names the top heads, 0-indexed);

and embeds, for each finding, the interactive head view (:func:`attnscope.present.view`) of that
head's clearest input, compressed, without the norm toggle's data, to keep the page small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..analysis.aggregate import HeadsPartial
from ..analysis.patterns import (
    PATTERNS,
    STABLE_MIN_INPUTS,
    STABLE_SHARE,
    CorpusPatterns,
    classify_heads,
    pattern_colour,
)
from ..analysis.stats import head_statistics, largest_measured
from ..analysis.store import DEFAULT_DB, HeadStore
from ..analysis.tokens import token_context
from ..data import brown_pairs
from ..errors import AttnscopeError
from ..inputs import BadLine, InputLine, corpus_files, parse_input_file
from ..records.attention import AttentionRecord

if TYPE_CHECKING:
    from ..capture.linear import PackedWeights
    from ..capture.tokens import Item
    from ..models.loading import LoadedModel

NAMED_CORPORA = ("brown", "brown-pairs")


@dataclass(frozen=True)
class CorpusInputs:
    """The inputs a CORPUS argument names, in corpus order, and the malformed lines that were skipped."""

    inputs: list[InputLine]
    skipped: list[BadLine]

    @property
    def items(self) -> list[tuple[str, str | None]]:
        return [entry.item for entry in self.inputs]


def named_corpus(name: str) -> list[InputLine]:
    """``brown`` (2,000 sentences) or ``brown-pairs`` (500 pairs) as inputs; ``source`` is the name."""
    from ..data import brown_sentences

    items = [(text, None) for text in brown_sentences()] if name == "brown" else brown_pairs()
    return [InputLine(text, pair, name, number) for number, (text, pair) in enumerate(items, 1)]


def corpus_sources(corpus: str | Sequence[str]) -> tuple[str | None, list[Path]]:
    """A CORPUS argument as (a corpus name, or None) and the files it names (folders expanded)."""
    names = [corpus] if isinstance(corpus, str) else list(corpus)
    if not names:
        raise AttnscopeError("give a corpus: 'brown', 'brown-pairs', files or a folder")
    if any(name in NAMED_CORPORA for name in names):
        if len(names) > 1:
            raise AttnscopeError(f"{' or '.join(NAMED_CORPORA)} is a whole corpus; give it alone")
        return names[0], []
    missing = [name for name in names if not Path(name).exists()]
    if missing:
        raise AttnscopeError(f"corpus {missing[0]!r} is neither 'brown', 'brown-pairs' nor an existing file or folder")
    return None, corpus_files([Path(name) for name in names])


def read_corpus(corpus: str | Sequence[str], limit: int | None = None, *, skip_bad: bool = False) -> CorpusInputs:
    """The inputs of a CORPUS argument: ``brown``, ``brown-pairs``, or files and folders of text lines,
    ``.jsonl`` or ``.parquet`` (see :func:`attnscope.inputs.parse_input_file`).

    A malformed line is an :class:`AttnscopeError` naming its file and line, or, with ``skip_bad``,
    left out and listed in ``skipped``. ``limit`` keeps the first N inputs.
    """
    if limit is not None and limit < 1:
        raise AttnscopeError("--limit must be at least 1")
    name, files = corpus_sources(corpus)
    inputs: list[InputLine] = named_corpus(name) if name else []
    skipped: list[BadLine] = []
    for path in files:
        if limit is not None and len(inputs) >= limit:
            break
        found, bad = parse_input_file(str(path), _read_bytes(path))
        if bad and not skip_bad:
            raise AttnscopeError(f"{bad[0].message} (--on-bad-line skip leaves such lines out)")
        inputs.extend(found)
        skipped.extend(bad)
    if not inputs:
        raise AttnscopeError("the corpus holds no inputs")
    return CorpusInputs(inputs[:limit], skipped)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise AttnscopeError(f"cannot read {path}: {error.strerror or error}") from None


def corpus_items(corpus: str | Sequence[str], limit: int | None = None) -> list[tuple[str, str | None]]:
    """Inputs named by a CORPUS argument as ``(text, pair)`` items (see :func:`read_corpus`)."""
    return read_corpus(corpus, limit).items


# ---- corpus report --------------------------------------------------------------------------
VIG_PATTERNS = ("previous_word", "next_word", "same_word", "same_word_other_sentence", "delimiter", "bag_of_words")
FINDING_SCORE = {name: name for name in VIG_PATTERNS} | {"bag_of_words": "uniformity"}
TOKEN_TYPES = {"[CLS]": "cls", "[SEP]": "sep", "punctuation": "punct"}
FINDING_HEADS = 3
STABLE_RULE = (f"a head is stable when its most common label is carried by at least {STABLE_SHARE:.0%} of the "
               f"inputs (and the corpus has at least {STABLE_MIN_INPUTS})")


@dataclass
class Example:
    """The clearest map seen so far of one head for one pattern: ``matrix`` ``[q_pos, k_pos]``."""

    score: float
    matrix: np.ndarray
    tokens: tuple[str, ...]
    input_id: int
    record: AttentionRecord | None = None  # kept for the embedded view; released when a clearer one comes


@dataclass(frozen=True)
class Finding:
    """The heads (0-indexed) that show one of Vig's patterns most clearly over the corpus."""

    pattern: str
    score_name: str
    heads: list[dict[str, Any]]  # layer, head, mean_score, share_labelled
    example: str | None = None  # file name of the example view (PNG) of the first head


@dataclass(frozen=True, eq=False)
class CorpusReport:
    """What ``analyze_corpus`` wrote: the HTML report, the DuckDB file and the figures, plus summaries."""

    out_dir: Path
    html: Path
    database: Path
    figures: dict[str, Path]
    summary: Any  # pandas DataFrame, one row per head
    findings: list[Finding]
    patterns: CorpusPatterns
    n_inputs: int
    model: str
    skipped: list[BadLine] = field(default_factory=list)  # malformed lines left out (skip_bad)
    engine: str = "local"

    def to_frame(self) -> Any:
        return self.summary

    def _repr_html_(self) -> str:
        caption = f"{self.model}: heads over {self.n_inputs} inputs (0-indexed); full report: {self.html}"
        return str(self.summary.style.set_caption(caption).format(precision=3).hide(axis="index").to_html())


def corpus_window(batch_size: int) -> int:
    """Inputs per sort window of :func:`corpus_records`: the Ray engine hands its actors whole windows."""
    from ..capture.extract import SORT_WINDOW_BATCHES

    return batch_size * SORT_WINDOW_BATCHES


def corpus_records(loaded: LoadedModel, items: Sequence[Item], batch_size: int, *,
                   packed: PackedWeights | None = None, parallel_batches: int | None = None) -> Iterator[AttentionRecord]:
    """The records corpus analysis turns into head rows, computed alike by every engine so that their rows are
    equal bit for bit. An input's attention depends, in its last bits, on how long its batch is padded
    (vectorised sums over the keys) and on the GEMM library; with MKL also on the batch's size (seen on an
    Intel Xeon with AMX); not on the thread count (1 to 16 on that Xeon and on an AMD EPYC with AVX-512). So
    the inputs are sorted and batched within windows of :func:`corpus_window` from the first item (the Ray
    engine gives each actor whole windows) and the linear layers always run on oneDNN (the local default
    leaves a one-batch corpus on MKL)."""
    from ..capture.extract import extract_corpus

    return extract_corpus(loaded, items, batch_size=batch_size, norms=True, progress=False, onednn=True,
                          packed=packed, parallel_batches=parallel_batches)


def head_rows(input_ids: Sequence[int], records: Sequence[AttentionRecord]) -> Any:
    """The per-batch function of corpus analysis, the same in every engine: a pandas DataFrame with
    one row per (``input_id``, ``layer``, ``head``), in that order (layers and heads 0-indexed).

    Columns: the keys, ``n_tokens``, every statistic of :mod:`attnscope.analysis.stats` (``norm_*``
    when the records hold norms), the pattern ``label``, its ``kovaleva`` type and ``confidence``, and
    the pattern evidence (``ev_*``). No attention array leaves this function.
    """
    import pandas as pd

    if len(input_ids) != len(records):
        raise AttnscopeError(f"{len(input_ids)} input ids for {len(records)} records")
    parts = [_input_rows(input_id, record) for input_id, record in zip(input_ids, records)]
    if not parts:
        return pd.DataFrame()
    return pd.DataFrame({name: np.concatenate([part[name] for part in parts]) for name in parts[0]})


def _input_rows(input_id: int, record: AttentionRecord) -> dict[str, np.ndarray]:
    """One input's rows as columns; every column holds ``layer * head`` values (layer-major)."""
    ctx = token_context(record)
    stats = head_statistics(record, ctx)
    patterns = classify_heads(record, ctx)
    layers, heads = np.indices(patterns.shape)
    row: dict[str, np.ndarray] = {"input_id": np.full(layers.size, input_id, dtype=np.int64),
                                  "layer": layers.ravel(), "head": heads.ravel(),
                                  "n_tokens": np.full(layers.size, len(record.tokens), dtype=np.int64)}
    row.update({name: value.ravel() for name, value in stats.values.items()})
    row.update({"label": patterns.labels.ravel().astype(object), "kovaleva": patterns.kovaleva().ravel(),
                "confidence": patterns.confidence.ravel()})
    row.update({f"ev_{name}": value.ravel() for name, value in patterns.evidence.items()})
    return row


def head_evidence(rows: Any, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """``ev_*`` columns of one input's rows (``layer * head`` of them, layer-major) as name -> ``[layer, head]``."""
    return {name[3:]: rows[name].to_numpy(dtype=float).reshape(shape) for name in rows.columns
            if name.startswith("ev_")}


class _Collector:
    """Streams records once, a batch at a time: per-head rows for the database, clearest examples."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.best: dict[str, np.ndarray] = {}
        self.examples: dict[tuple[str, int, int], Example] = {}
        self.model = ""

    def add_batch(self, input_ids: list[int], records: list[AttentionRecord]) -> None:
        rows = head_rows(input_ids, records)
        self.frames.append(rows)
        for index, (input_id, record) in enumerate(zip(input_ids, records)):
            n_heads = record.n_layers * record.n_heads
            evidence = head_evidence(rows.iloc[index * n_heads:(index + 1) * n_heads],
                                     (record.n_layers, record.n_heads))
            self._keep_examples(input_id, record, evidence)
            self.model = record.model.name

    def _keep_examples(self, input_id: int, record: AttentionRecord, evidence: dict[str, np.ndarray]) -> None:
        for pattern in VIG_PATTERNS:
            score = evidence[FINDING_SCORE[pattern]]
            best = self.best.setdefault(pattern, np.full(score.shape, -np.inf))
            for layer, head in zip(*np.nonzero(np.isfinite(score) & (score > best))):  # maps where it applies
                best[layer, head] = score[layer, head]
                self.examples[(pattern, int(layer), int(head))] = Example(
                    float(score[layer, head]), np.array(record.attention[layer, head]), record.tokens, input_id, record)

    def rows(self) -> Any:
        import pandas as pd

        if not self.frames:
            raise AttnscopeError("the corpus holds no inputs")
        return pd.concat(self.frames, ignore_index=True)


def inputs_table(rows: Any, inputs: Sequence[InputLine]) -> Any:
    """The ``inputs`` table: ``input_id``, ``text``, ``pair``, ``n_tokens`` (from the head rows), and the
    ``source`` file and ``line`` each input came from. ``inputs[i]`` is input ``i``."""
    import pandas as pd

    tokens = rows.groupby("input_id", sort=True)["n_tokens"].first()
    ids = tokens.index.to_numpy()
    return pd.DataFrame({"input_id": ids, "text": [inputs[i].text for i in ids], "pair": [inputs[i].pair for i in ids],
                         "n_tokens": tokens.to_numpy(), "source": [inputs[i].source for i in ids],
                         "line": [inputs[i].line for i in ids]})


def _findings(patterns: CorpusPatterns, examples: dict[tuple[str, int, int], Example]) -> list[Finding]:
    findings = []
    order = list(PATTERNS)
    shares = patterns.counts / np.maximum(patterns.counts.sum(axis=-1, keepdims=True), 1)  # [layer, head, class]
    for pattern in VIG_PATTERNS:
        score = patterns.mean_evidence[FINDING_SCORE[pattern]]
        heads = [{"layer": layer, "head": head, "mean_score": float(score[layer, head]),
                  "share_labelled": float(shares[layer, head, order.index(pattern)]),
                  "example_input": examples[(pattern, layer, head)].input_id
                  if (pattern, layer, head) in examples else None}
                 for layer, head in largest_measured(score, FINDING_HEADS)]
        findings.append(Finding(pattern, FINDING_SCORE[pattern], heads))
    return findings


def _token_type_means(summary: Any, prefix: str) -> dict[str, np.ndarray] | None:
    """Token type -> ``[layer, head]`` mean share of attention, for the types the inputs had (a model
    without [CLS]/[SEP], such as a causal LM, has NaN there), and ``other`` for the rest."""
    if f"{prefix}cls" not in summary:
        return None
    layers = int(summary["layer"].max()) + 1
    grid = {name: summary[f"{prefix}{column}"].to_numpy().reshape(layers, -1) for name, column in TOKEN_TYPES.items()}
    grid = {name: values for name, values in grid.items() if np.isfinite(values).any()}
    grid["other"] = 1.0 - np.nansum(list(grid.values()), axis=0) if grid else np.ones((layers, len(summary) // layers))
    return grid


def analyze_corpus(records: Iterable[AttentionRecord], out_dir: str | Path, *, total: int | None = None,
                   progress: bool = True, inputs: Sequence[InputLine] | None = None,
                   batch_size: int = 32) -> CorpusReport:
    """Statistics and patterns of every head on every record; writes the report into ``out_dir``.

    Writes ``heads.duckdb`` (see :mod:`attnscope.analysis.store`), ``report.html`` and the PNG
    figures it shows. Records should carry norms (``extract_corpus(..., norms=True)``) for the
    norm-weighted figure. ``inputs`` (one per record, e.g. from :func:`read_corpus`) name each
    input's file and line in the database; without them the records' own text is kept.
    Records are turned into rows ``batch_size`` at a time by :func:`head_rows`, as the Ray engine
    does (:mod:`attnscope.corpus.distributed`). Layers and heads are 0-indexed throughout.
    """
    from tqdm.auto import tqdm

    collector = _Collector()
    seen: list[InputLine] = []
    numbered = enumerate(tqdm(records, total=total, unit="input", desc="analysing heads", disable=not progress))
    for batch in iter(lambda: list(islice(numbered, batch_size)), []):
        ids, batch_records = [i for i, _ in batch], [r for _, r in batch]
        seen.extend(InputLine(r.text[0] if r.text else "", r.text[1] if len(r.text) > 1 else None)
                    for r in batch_records)
        collector.add_batch(ids, batch_records)
    rows = collector.rows()
    table = inputs_table(rows, list(inputs) if inputs is not None else seen)

    def store(path: Path, meta: dict[str, str], head_labels: Any) -> None:
        HeadStore.create(path, rows, table, meta, head_labels=head_labels).close()

    return write_report(out_dir, heads_partial(rows, collector.model), collector.examples, store)


def heads_partial(rows: Any, model: str) -> HeadsPartial:
    """The mergeable aggregate of head rows the report is made from (see :mod:`attnscope.analysis.aggregate`)."""
    return HeadsPartial.from_rows(rows, model, FINDING_SCORE)


def write_report(out_dir: str | Path, aggregate: HeadsPartial, examples: dict[tuple[str, int, int], Example],
                 store: Callable[[Path, dict[str, str], Any], None],
                 extra_meta: dict[str, str] | None = None) -> CorpusReport:
    """The report of every input's head rows, from their aggregate (whichever engine made it):
    ``heads.duckdb`` (written by ``store(path, meta, head_labels)``), the figures and ``report.html`` in
    ``out_dir``. ``examples``: the clearest input of each (pattern, layer, head) the findings may show."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    patterns = aggregate.patterns()
    summary = aggregate.summary()
    summary.insert(2, "pattern", patterns.labels.ravel())
    summary.insert(3, "pattern_share", patterns.share.ravel())
    summary.insert(4, "stable", patterns.stable.ravel())
    database = out / DEFAULT_DB
    meta = {"model": aggregate.model, "inputs": str(aggregate.n_inputs), "attnscope": _version(),
            "layers_heads": "0-indexed", "stable_rule": STABLE_RULE, **(extra_meta or {})}
    store(database, meta, patterns.to_frame())
    findings = _findings(patterns, examples)
    figures = _write_figures(out, patterns, summary, findings, examples)
    findings = [replace(f, example=figures[f"example_{f.pattern}"].name) if f"example_{f.pattern}" in figures else f
                for f in findings]
    report = CorpusReport(out, out / "report.html", database, figures, summary, findings, patterns,
                          aggregate.n_inputs, aggregate.model)
    _write_html(report, _example_views(findings, examples))
    return report


def finding_inputs(aggregate: HeadsPartial) -> dict[tuple[str, int, int], int]:
    """For the heads the findings name: (pattern, layer, head) -> the input where the pattern's score is
    highest (the first such input on ties), as :class:`_Collector` keeps them while streaming."""
    wanted = {}
    for finding in _findings(aggregate.patterns(), {}):
        for head in finding.heads:
            clearest = aggregate.clearest(finding.pattern, head["layer"], head["head"])
            if clearest is not None:
                wanted[(finding.pattern, head["layer"], head["head"])] = clearest[1]
    return wanted


def examples_of(records: dict[int, AttentionRecord], aggregate: HeadsPartial,
                wanted: dict[tuple[str, int, int], int]) -> dict[tuple[str, int, int], Example]:
    """:class:`Example` of each wanted (pattern, layer, head) from the records of their inputs (by input id)."""
    examples = {}
    for (pattern, layer, head), input_id in wanted.items():
        record = records[input_id]
        score, _ = aggregate.clearest(pattern, layer, head)  # type: ignore[misc]
        examples[(pattern, layer, head)] = Example(score, np.array(record.attention[layer, head]), record.tokens,
                                                   input_id, record)
    return examples


def _example_views(findings: list[Finding], examples: dict[tuple[str, int, int], Example]) -> dict[str, str]:
    """Per finding, the HTML fragment of the head view of its top head's clearest input."""
    from ..present import view

    views = {}
    for finding in findings:
        example = examples.get((finding.pattern, finding.heads[0]["layer"], finding.heads[0]["head"])) \
            if finding.heads else None
        if example is not None and example.record is not None:
            title = (f"{finding.pattern}: see layer {finding.heads[0]['layer']} head {finding.heads[0]['head']} "
                     f"(0-indexed), input {example.input_id}")
            views[finding.pattern] = view(example.record, "head", norms=False, compress=True, title=title).fragment()
    return views


def _version() -> str:
    from ..version import __version__

    return __version__


def _write_figures(out: Path, patterns: CorpusPatterns, summary: Any, findings: list[Finding],
                   examples: dict[tuple[str, int, int], Example]) -> dict[str, Path]:
    from ..analysis.figures import head_map_figure, map_figure, pattern_distribution_figure, pyplot, token_types_figure

    plt = pyplot()
    kovaleva_of = {name: p.kovaleva for name, p in PATTERNS.items()}
    head_types = np.vectorize(kovaleva_of.__getitem__)(patterns.labels).ravel()
    head_shares = {t: float(np.mean(head_types == t)) for t in set(head_types)}
    figures = {
        "analysis_patterns": pattern_distribution_figure(patterns.shares(), kovaleva_of, head_shares),
        "analysis_token_types": token_types_figure(_token_type_means(summary, "") or {},
                                                   _token_type_means(summary, "norm_")),
        "analysis_head_map": head_map_figure(patterns.labels, patterns.confidence, list(PATTERNS),
                                             {n: p.short for n, p in PATTERNS.items()}, kovaleva_of),
    }
    for finding in findings:
        if finding.heads:
            top = finding.heads[0]
            example = examples.get((finding.pattern, top["layer"], top["head"]))
            if example is not None:
                title = (f"{finding.pattern}: layer {top['layer']} head {top['head']} (0-indexed), "
                         f"input {example.input_id}")
                figures[f"example_{finding.pattern}"] = map_figure(example.matrix, example.tokens, title)
    paths = {}
    for name, figure in figures.items():
        paths[name] = out / f"{name}.png"
        figure.savefig(paths[name], dpi=90)
        plt.close(figure)
    return paths


def _write_html(report: CorpusReport, views: dict[str, str]) -> None:
    """``views``: pattern -> HTML fragment of its example view (trusted markup from attnscope.present)."""
    from jinja2 import Environment, PackageLoader, select_autoescape
    from markupsafe import Markup

    environment = Environment(loader=PackageLoader("attnscope.corpus", "templates"),
                              autoescape=select_autoescape(["html", "j2"]))
    template = environment.get_template("report.html.j2")
    columns = ["layer", "head", "pattern", "pattern_share", "stable", "entropy", "uniform_entropy", "cls", "sep",
               "sink", "punct", "prev", "next", "self", "mean_distance"]
    columns += [c for c in ("norm_cls", "norm_sep", "norm_punct") if c in report.summary]
    columns = [c for c in columns if c in ("pattern", "stable") or report.summary[c].notna().any()]  # measured here
    rows = report.summary[columns].assign(stable=_stable_cells(report.patterns))
    rows = rows.to_dict(orient="records")
    shares = report.patterns.shares()
    report.html.write_text(template.render(
        model=report.model, n_inputs=report.n_inputs, figures={k: v.name for k, v in report.figures.items()},
        findings=report.findings, columns=columns, rows=rows, database=report.database.name,
        stable_rule=STABLE_RULE, n_stable=int(report.patterns.stable.sum()), n_heads=report.patterns.stable.size,
        n_mixed=int(report.patterns.mixed.sum()),
        views={pattern: Markup(fragment) for pattern, fragment in views.items()},
        pattern_rows=[{"name": n, "kovaleva": p.kovaleva, "source": p.source, "description": p.description,
                       "share": shares[n], "colour": pattern_colour(n)} for n, p in PATTERNS.items()],
    ), encoding="utf-8")


def _stable_cells(patterns: CorpusPatterns) -> list[str]:
    """The ``stable`` column per head (layer-major): ``yes``, ``mixed with <runner-up>`` (see
    :attr:`CorpusPatterns.mixed`) or ``no``."""
    cells = np.where(patterns.stable, "yes", np.where(patterns.mixed, "mixed with " + patterns.runner_up.astype(str), "no"))
    return cells.ravel().tolist()
