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

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..data import brown_pairs
from ..errors import AttnscopeError
from ..record import AttentionRecord
from .patterns import (
    PATTERNS,
    STABLE_MIN_INPUTS,
    STABLE_SHARE,
    CorpusPatterns,
    HeadPatterns,
    classify_heads,
    pattern_colour,
)
from .stats import head_statistics, largest_measured
from .store import DEFAULT_DB, HeadStore
from .tokens import token_context


def corpus_items(corpus: str, limit: int | None = None) -> list[tuple[str, str | None]]:
    """Inputs named by a CORPUS argument: ``brown`` (2,000 sentences), ``brown-pairs`` (500 pairs), or a
    file (one text per line, or ``.jsonl`` with ``text`` and optional ``pair``)."""
    from ..data import brown_sentences

    if corpus == "brown":
        items: list[tuple[str, str | None]] = [(text, None) for text in brown_sentences()]
    elif corpus == "brown-pairs":
        items = [(first, second) for first, second in brown_pairs()]
    else:
        from ..inputs import read_inputs

        path = Path(corpus)
        if not path.is_file():
            raise AttnscopeError(f"corpus {corpus!r} is neither 'brown', 'brown-pairs' nor an existing file")
        items = read_inputs(path)
    if limit is not None:
        if limit < 1:
            raise AttnscopeError("--limit must be at least 1")
        items = items[:limit]
    return items


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

    def to_frame(self) -> Any:
        return self.summary

    def _repr_html_(self) -> str:
        caption = f"{self.model}: heads over {self.n_inputs} inputs (0-indexed); full report: {self.html}"
        return str(self.summary.style.set_caption(caption).format(precision=3).hide(axis="index").to_html())


class _Collector:
    """Streams records once: per-head rows for the database, pattern counts, clearest examples."""

    def __init__(self) -> None:
        self.columns: dict[str, list[np.ndarray]] = {}
        self.inputs: list[dict[str, Any]] = []
        self.counter: CorpusPatterns | None = None
        self.heads: list[HeadPatterns] = []
        self.best: dict[str, np.ndarray] = {}
        self.examples: dict[tuple[str, int, int], Example] = {}
        self.model = ""

    def add(self, input_id: int, record: AttentionRecord) -> None:
        ctx = token_context(record)
        stats = head_statistics(record, ctx)
        patterns = classify_heads(record, ctx)
        layers, heads = np.indices(patterns.shape)
        row: dict[str, np.ndarray] = {"input_id": np.full(layers.size, input_id), "layer": layers.ravel(),
                                      "head": heads.ravel()}
        row.update({name: value.ravel() for name, value in stats.values.items()})
        row.update({"label": patterns.labels.ravel(), "kovaleva": patterns.kovaleva().ravel(),
                    "confidence": patterns.confidence.ravel()})
        row.update({f"ev_{name}": value.ravel() for name, value in patterns.evidence.items()})
        for name, value in row.items():
            self.columns.setdefault(name, []).append(value)
        self.inputs.append({"input_id": input_id, "text": record.text[0] if record.text else "",
                            "pair": record.text[1] if len(record.text) > 1 else None, "n_tokens": len(record.tokens)})
        self.counter = CorpusPatterns.add(self.counter, patterns)
        self.model = record.model.name
        self._keep_examples(input_id, record, patterns)

    def _keep_examples(self, input_id: int, record: AttentionRecord, patterns: HeadPatterns) -> None:
        for pattern in VIG_PATTERNS:
            score = patterns.evidence[FINDING_SCORE[pattern]]
            best = self.best.setdefault(pattern, np.full(score.shape, -np.inf))
            for layer, head in zip(*np.nonzero(np.isfinite(score) & (score > best))):  # maps where it applies
                best[layer, head] = score[layer, head]
                self.examples[(pattern, int(layer), int(head))] = Example(
                    float(score[layer, head]), np.array(record.attention[layer, head]), record.tokens, input_id, record)

    def frames(self) -> tuple[Any, Any]:
        import pandas as pd

        if not self.inputs:
            raise AttnscopeError("the corpus holds no inputs")
        heads = pd.DataFrame({name: np.concatenate(parts) for name, parts in self.columns.items()})
        return heads, pd.DataFrame(self.inputs)


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
                   progress: bool = True) -> CorpusReport:
    """Statistics and patterns of every head on every record; writes the report into ``out_dir``.

    Writes ``heads.duckdb`` (see :mod:`attnscope.analysis.store`), ``report.html`` and the PNG
    figures it shows. Records should carry norms (``extract_corpus(..., norms=True)``) for the
    norm-weighted figure. Layers and heads are 0-indexed throughout.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    collector = _Collector()
    for input_id, record in enumerate(tqdm(records, total=total, unit="input", desc="analysing heads",
                                           disable=not progress)):
        collector.add(input_id, record)
    head_rows, inputs = collector.frames()
    assert collector.counter is not None
    patterns = collector.counter
    numeric = [c for c in head_rows.columns if c not in ("input_id", "label", "kovaleva")]
    summary = head_rows[numeric].groupby(["layer", "head"], as_index=False).mean()
    summary.insert(2, "pattern", patterns.labels.ravel())
    summary.insert(3, "pattern_share", patterns.share.ravel())
    summary.insert(4, "stable", patterns.stable.ravel())
    database = out / DEFAULT_DB
    meta = {"model": collector.model, "inputs": str(len(inputs)), "attnscope": _version(),
            "layers_heads": "0-indexed", "stable_rule": STABLE_RULE}
    HeadStore.create(database, head_rows, inputs, meta, head_labels=patterns.to_frame()).close()
    findings = _findings(patterns, collector.examples)
    figures = _write_figures(out, patterns, summary, findings, collector.examples)
    findings = [replace(f, example=figures[f"example_{f.pattern}"].name) if f"example_{f.pattern}" in figures else f
                for f in findings]
    report = CorpusReport(out, out / "report.html", database, figures, summary, findings, patterns,
                          len(inputs), collector.model)
    _write_html(report, _example_views(findings, collector.examples))
    return report


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
    from .. import __version__

    return __version__


def _write_figures(out: Path, patterns: CorpusPatterns, summary: Any, findings: list[Finding],
                   examples: dict[tuple[str, int, int], Example]) -> dict[str, Path]:
    from .figures import head_map_figure, map_figure, pattern_distribution_figure, pyplot, token_types_figure

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

    environment = Environment(loader=PackageLoader("attnscope.analysis", "templates"),
                              autoescape=select_autoescape(["html", "j2"]))
    template = environment.get_template("report.html.j2")
    columns = ["layer", "head", "pattern", "pattern_share", "stable", "entropy", "uniform_entropy", "cls", "sep",
               "sink", "punct", "prev", "next", "self", "mean_distance"]
    columns += [c for c in ("norm_cls", "norm_sep", "norm_punct") if c in report.summary]
    columns = [c for c in columns if c in ("pattern", "stable") or report.summary[c].notna().any()]  # measured here
    rows = report.summary[columns].assign(stable=report.summary["stable"].map({True: "yes", False: "no"}))
    rows = rows.to_dict(orient="records")
    shares = report.patterns.shares()
    report.html.write_text(template.render(
        model=report.model, n_inputs=report.n_inputs, figures={k: v.name for k, v in report.figures.items()},
        findings=report.findings, columns=columns, rows=rows, database=report.database.name,
        stable_rule=STABLE_RULE, n_stable=int(report.patterns.stable.sum()), n_heads=report.patterns.stable.size,
        views={pattern: Markup(fragment) for pattern, fragment in views.items()},
        pattern_rows=[{"name": n, "kovaleva": p.kovaleva, "source": p.source, "description": p.description,
                       "share": shares[n], "colour": pattern_colour(n)} for n, p in PATTERNS.items()],
    ), encoding="utf-8")
