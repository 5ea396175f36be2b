"""The KV-budget curve: a budget's mask equals SinkWindow on the heads it streams (a KV group restricted as a whole,
every head at share 0, none at share 1), its bytes equal a hand count (grouped heads, a sliding-window layer), the
uniform budget's bytes equal the share's, and the command refuses bad input in one line, exit 2, nothing written.
Layers and heads are 0-indexed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from attnscope import load_model
from attnscope.capture.attention import intervene
from attnscope.capture.kv_budget import KVBudget, full_budget, kv_bytes, kv_layout
from attnscope.errors import AttnscopeError
from attnscope.experiments import kv_curve
from attnscope.experiments.interventions import SinkWindow
from attnscope.experiments.kv_curve import (
    CacheApplier,
    Choice,
    CurveSettings,
    KVCurve,
    MaskApplier,
    RunStore,
    budget_keeping,
    check_curve_settings,
    kv_budget_curve,
    masked,
    plot_curve,
    uniform_budget,
)
from attnscope.experiments.metrics import DocumentLoss

from .tiny_architectures import build_folder

SINK, WINDOW = 1, 2


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """2 layers, 4 query heads in 2 KV groups, head_dim 16, every layer global."""
    return build_folder("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tiny_llama(llama_folder):
    return load_model(str(llama_folder))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Layer 0 slides over 4 keys, layer 1 is global; 4 query heads in 2 KV groups, head_dim 16."""
    return load_model(str(build_folder("gemma3_text", tmp_path_factory.mktemp("gemma3"))))


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(input_ids=ids).logits.float()


IDS = torch.from_numpy(np.random.default_rng(0).integers(1000, 2000, size=(2, 12)))


# ---- the mask a budget applies ------------------------------------------------------------------------------
def test_share_0_restricts_every_head_and_share_1_none(tiny_llama):
    layout = kv_layout(tiny_llama)
    everyone = {layer: list(range(4)) for layer in range(2)}
    with intervene(SinkWindow(everyone, SINK, WINDOW)):
        reference = logits(tiny_llama, IDS)
    streaming = Choice("retrieval").budget(layout, 0.0, {"retrieval": layout.candidates}, SINK, WINDOW, 12, 0)
    with masked(tiny_llama, layout, streaming):
        assert torch.equal(logits(tiny_llama, IDS), reference)
    intact = logits(tiny_llama, IDS)
    full = Choice("retrieval").budget(layout, 1.0, {"retrieval": layout.candidates}, SINK, WINDOW, 12, 0)
    with masked(tiny_llama, layout, full):
        assert torch.equal(logits(tiny_llama, IDS), intact)
    assert (intact - reference).abs().max() > 1e-3  # the restriction changes the model: the test can fail


def test_a_streaming_kv_head_restricts_its_whole_query_group(tiny_llama):
    layout = kv_layout(tiny_llama)
    assert layout.group == 2
    budget = budget_keeping(layout, [(0, 0), (1, 0), (1, 1)], SINK, WINDOW)  # only layer 0's KV head 1 streams
    assert budget.evicting(12) == {(0, 1): WINDOW}
    with intervene(SinkWindow({0: [2, 3]}, SINK, WINDOW)):
        reference = logits(tiny_llama, IDS)
    with masked(tiny_llama, layout, budget):
        assert torch.equal(logits(tiny_llama, IDS), reference)
    with intervene(SinkWindow({0: [2]}, SINK, WINDOW)):  # one query head of the group is not the budget
        assert (logits(tiny_llama, IDS) - reference).abs().max() > 1e-4


def test_uniform_windows_of_different_sizes_are_each_heads_own(tiny_llama):
    layout = kv_layout(tiny_llama)
    recent = np.array([[2, 3], [3, 11]])  # (1, 1) keeps all 12 keys
    budget = KVBudget(np.zeros((2, 2), dtype=bool), SINK, 2, layout.windows, recent)
    with intervene(SinkWindow({0: [0, 1]}, SINK, 2), SinkWindow({0: [2, 3], 1: [0, 1]}, SINK, 3)):
        reference = logits(tiny_llama, IDS)
    with masked(tiny_llama, layout, budget):
        assert torch.equal(logits(tiny_llama, IDS), reference)


@pytest.mark.parametrize("choice", ["retrieval", "uniform"])
def test_one_forward_pass_through_a_budgeted_cache_is_the_masks_loss(tiny_llama, choice):
    """The loss on a document piece is one forward pass; through a fresh budgeted cache its streaming heads see
    their sink + window within the pass (prefill evicts only after it): the mask's loss, to float error."""
    layout = kv_layout(tiny_llama)
    task = DocumentLoss(tiny_llama, length=24, n=2, skip=SINK + WINDOW)
    budget = Choice(choice).budget(layout, 0.5, {"retrieval": layout.candidates}, SINK, WINDOW, 24, 0)
    with torch.inference_mode():
        cached = CacheApplier().loss(tiny_llama, task, budget)
        masked_loss = MaskApplier().loss(tiny_llama, task, budget)
        intact = float(task.summarise(task.evaluate_all()))
    assert cached == pytest.approx(masked_loss, rel=1e-5, abs=1e-6)
    assert abs(cached - intact) > 1e-4  # the budget changes the loss: the test can fail


# ---- bytes ------------------------------------------------------------------------------------------------
def test_bytes_equal_a_hand_count_with_grouped_heads_and_a_sliding_layer(tiny_gemma3):
    layout = kv_layout(tiny_gemma3)
    assert layout.windows == (4, 0) and layout.candidates == [(1, 0), (1, 1)]
    per_key = 2 * 16 * 4  # a key and a value of 16 float32 numbers, per KV head
    # full: layer 0's 2 KV heads hold their window of 4 keys less the next query's own (3), layer 1's 2 hold all 100
    assert kv_bytes(full_budget(layout), 100, 16) == (2 * 3 + 2 * 100) * per_key
    assert kv_bytes(budget_keeping(layout, [], SINK, WINDOW), 100, 16) == (2 * 3 + 2 * 3) * per_key
    assert kv_bytes(budget_keeping(layout, [(1, 1)], SINK, WINDOW), 100, 16) == (2 * 3 + 100 + 3) * per_key
    assert kv_bytes(full_budget(layout), 3, 16) == (2 * 3 + 2 * 3) * per_key  # a text shorter than the window


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("tokens", [20, 101])
def test_the_uniform_budget_holds_the_shares_bytes(tiny_gemma3, share, tokens):
    layout = kv_layout(tiny_gemma3)
    ranked = Choice("retrieval").budget(layout, share, {"retrieval": layout.candidates}, 4, 5, tokens, 0)
    uniform = uniform_budget(layout, share, 4, 5, tokens)
    assert kv_bytes(uniform, tokens, 16) == kv_bytes(ranked, tokens, 16)
    assert len(set(uniform.head_windows()[uniform.streamed])) <= 2  # one size, the remainder one key more on some


# ---- the table and the page ------------------------------------------------------------------------------------
def hand_curve() -> KVCurve:
    settings = CurveSettings(shares=(0.0, 1.0), choices=("random", "uniform"), draws=3)
    records = [{"share": share, "choice": "random", "draw": draw, "full_kv_heads": int(share * 4), "accuracy": acc,
                "loss": 3.0 - share + 0.1 * draw, "kv_bytes": 100 if share else 25, "kv_saving": 1.0 if share else 4.0,
                "streaming": []} for share, draw, acc in [(0.0, 0, 0.0), (0.0, 1, 0.5), (0.0, 2, 1.0),
                                                           (1.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 2, 1.0)]]
    records += [{"share": share, "choice": "uniform", "draw": 0, "full_kv_heads": 0, "accuracy": 0.25,
                 "loss": 2.5, "kv_bytes": 100 if share else 25, "kv_saving": 1.0 if share else 4.0, "streaming": []}
                for share in (0.0, 1.0)]
    return KVCurve("hand", settings, 64, 100, 2.0, 2, 3, records)


def test_the_table_gives_random_draws_a_mean_and_a_t_interval():
    """The interval of a mean accuracy is clipped to 0..1 (a t-interval of 3 draws, 0, 0.5 and 1, would reach from
    -0.74 to 1.74); a loss's is not."""
    frame = hand_curve().to_frame().set_index(["share", "choice"])
    row = frame.loc[(0.0, "random")]
    t = 4.302652729911275  # t(0.975, 2 dof)
    assert row["accuracy"] == 0.5 and (row["accuracy_low"], row["accuracy_high"]) == (0.0, 1.0)
    assert 0.5 - t * 0.5 / np.sqrt(3) < 0.0  # the unclipped interval leaves 0..1: the clipping is tested
    assert row["loss"] == pytest.approx(3.1)
    half = t * 0.1 / np.sqrt(3)  # t x sd (0.1) / sqrt(3)
    assert (row["loss_low"], row["loss_high"]) == pytest.approx((3.1 - half, 3.1 + half))
    assert row["kv_saving"] == 4.0
    assert np.isnan(frame.loc[(0.0, "uniform"), "accuracy_low"])  # one value, no interval


def test_a_recorded_tables_accuracy_band_is_drawn_within_0_and_1():
    """A table recorded before the interval was clipped (bounds -0.74 and 1.74) is drawn with its accuracy band
    within 0..1; the loss band is drawn as recorded."""
    frame = hand_curve().to_frame()
    random = frame["choice"] == "random"
    frame.loc[random, ["accuracy_low", "accuracy_high"]] = [-0.74, 1.74]
    figure = plot_curve(frame, ("retrieval", "random", "uniform"), "hand")
    accuracy_band, loss_band = (ax.collections[0].get_paths()[0].vertices[:, 1] for ax in figure.axes)
    assert accuracy_band.min() == 0.0 and accuracy_band.max() == 1.0
    low, high = frame.loc[random, "loss_low"].min(), frame.loc[random, "loss_high"].max()
    assert loss_band.min() == pytest.approx(low) and loss_band.max() == pytest.approx(high)


def test_the_page_holds_the_curve_and_the_table(tmp_path):
    page = hand_curve().write_html(tmp_path / "curve.html")
    assert (tmp_path / "curve.png").stat().st_size > 1000
    text = page.read_text()
    assert 'src="curve.png"' in text and "uniform" in text and "KV budget curve: hand" in text


# ---- the curve on a real model ----------------------------------------------------------------------------
@pytest.mark.slow  # about 35 s per way on 2 busy cores: 2 needle generations and 4 loss passes of SmolLM2
@pytest.mark.parametrize("apply", ["mask", "cache"])
def test_the_curve_on_smollm2_meets_full_and_streaming_attention_at_its_ends(smollm2, apply):
    """The mask's points equal full attention and a SinkWindow on every head exactly; the budgeted cache's to float
    error (fused attention over its parts)."""
    settings = CurveSettings(shares=(0.0, 1.0), choices=("retrieval", "uniform"), draws=1, sink=4, window=16,
                             lengths=(256,), depths=(0.9,), needles=("passkey-1",), loss_pieces=1, new_tokens=16)
    scores = {"retrieval": np.random.default_rng(0).random((30, 9))}
    curve = kv_budget_curve(smollm2, scores, settings, apply=apply)
    frame = curve.to_frame().set_index(["share", "choice"])
    loss = DocumentLoss(smollm2, length=256, n=1, skip=20)
    with torch.inference_mode():
        intact = float(loss.summarise(loss.evaluate_all()))
        with intervene(SinkWindow({layer: range(9) for layer in range(30)}, 4, 16)):
            streaming = float(loss.summarise(loss.evaluate_all()))
    same = (lambda a, b: a == b) if apply == "mask" else (lambda a, b: a == pytest.approx(b, rel=1e-5))
    assert curve.trials == 1 and curve.applied == apply
    for choice in ("retrieval", "uniform"):
        assert same(frame.loc[(1.0, choice), "loss"], intact) and frame.loc[(1.0, choice), "accuracy"] == 1.0
        assert same(frame.loc[(0.0, choice), "loss"], streaming)
        assert frame.loc[(1.0, choice), "kv_saving"] == 1.0
        assert frame.loc[(0.0, choice), "peak_rss_mb"] > 100  # measured: the model's weights at least
    assert streaming > intact + 0.05  # StreamingLLM on every head costs loss: the test can fail
    assert frame.loc[(0.0, "retrieval"), "kv_bytes"] == 30 * 3 * (4 + 16) * 2 * 64 * 4  # 30 layers, 3 KV heads


# ---- runs kept between calls --------------------------------------------------------------------------------
def test_a_curve_given_its_runs_again_reads_them_back_and_runs_nothing_else(smollm2, tmp_path, monkeypatch):
    settings = CurveSettings(shares=(0.0, 1.0), choices=("retrieval",), draws=1, sink=4, window=16, lengths=(256,),
                             depths=(0.9,), needles=("passkey-1",), loss_pieces=1, new_tokens=16)
    scores = {"retrieval": np.random.default_rng(0).random((30, 9))}
    runs = tmp_path / "runs.jsonl"
    first = kv_budget_curve(smollm2, scores, settings, runs=runs)
    assert len(runs.read_text().splitlines()) == 4  # the full trial, the streaming trial, the two budgets' losses

    def ran_again(*args, **kwargs):
        raise AssertionError("a kept run ran again")

    monkeypatch.setattr(kv_curve, "run_trial", ran_again)
    monkeypatch.setattr(CacheApplier, "loss", ran_again)
    again = kv_budget_curve(smollm2, scores, settings, runs=runs)
    assert again.records == first.records and again.baseline_loss == first.baseline_loss
    with pytest.raises(AssertionError, match="ran again"):  # longer answers: another run, nothing read back
        kv_budget_curve(smollm2, scores, dataclasses.replace(settings, new_tokens=12), runs=runs)


def test_a_run_kept_under_other_settings_is_not_read_back(tmp_path):
    path = tmp_path / "runs.jsonl"
    RunStore(path, ("smollm2", 16)).put(("needle", (1, 2, 3)), {"value": 1.0, "peak": None})
    assert RunStore(path, ("smollm2", 16)).get(("needle", (1, 2, 3))) == {"value": 1.0, "peak": None}
    assert RunStore(path, ("smollm2", 24)).get(("needle", (1, 2, 3))) is None
    assert RunStore(path, ("smollm2", 16)).get(("needle", (1, 2, 4))) is None


def test_a_run_cut_off_as_it_was_written_is_dropped_and_the_others_read_back(tmp_path):
    path = tmp_path / "runs.jsonl"
    store = RunStore(path, ("smollm2",))
    store.put(("loss", 1), {"value": 4.0, "peak": None})
    kept = path.read_text()
    path.write_text(kept + '{"key": "ab12", "run": {"val')  # the process stopped in the middle of a line
    again = RunStore(path, ("smollm2",))
    assert again.get(("loss", 1)) == {"value": 4.0, "peak": None} and path.read_text() == kept
    path.write_text(kept.rstrip("\n"))  # a whole last line without its newline is a run
    assert RunStore(path, ("smollm2",)).get(("loss", 1)) is not None and path.read_text() == kept


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "no-such-folder" / "runs.jsonl", "cannot write the curve's runs"),
    (lambda tmp: tmp, "is not a file"),
    (lambda tmp: (tmp / "notes.txt").write_text("my notes") and tmp / "notes.txt", "line 1 is not a run"),
    (lambda tmp: (tmp / "runs.jsonl").write_text('{"key": "a"}\n') and tmp / "runs.jsonl", "line 1 is not a run"),
])
def test_a_runs_file_that_cannot_be_used_is_refused_in_one_line(tmp_path, make, message):
    path = make(tmp_path)
    before = path.read_text() if path.is_file() else None
    with pytest.raises(AttnscopeError, match=message):
        RunStore(path, ("smollm2",))
    assert (path.read_text() if path.is_file() else None) == before  # a user's file is left as it was


# ---- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    (CurveSettings(shares=(0.0, 1.5)), "within 0..1"),
    (CurveSettings(draws=0), "at least 1 draw"),
    (CurveSettings(lengths=(128,), window=200), "cover the shortest text"),
    (CurveSettings(choices=("best",)), "unknown choice"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(AttnscopeError, match=message):
        check_curve_settings(settings)


def run_cli(capsys, *argv):
    from attnscope.cli import main

    try:
        code = main(["kv-budget", *map(str, argv)])
    except SystemExit as exit:  # argparse's own refusals (a type check) exit from the parser
        code = exit.code
    return code, capsys.readouterr()


@pytest.mark.parametrize("options, message", [
    (["--shares", "0,1.5"], "within 0..1"),
    (["--draws", "0"], "draws"),
    (["--lengths", "64", "--window", "64"], "shortest text"),
    (["--apply", "both"], "invalid choice"),
    (["--runs", "no-such-folder/runs.jsonl"], "cannot write the curve's runs"),
])
def test_the_command_refuses_bad_input_before_loading(capsys, tmp_path, options, message):
    code, out = run_cli(capsys, "no-such-model", *options, "--png", tmp_path / "curve.png")
    assert code == 2 and message in out.err and "Traceback" not in out.err
    assert [line for line in out.err.splitlines() if "error" in line] == [out.err.strip().splitlines()[-1]]
    assert not list(tmp_path.iterdir())


def test_the_command_refuses_another_models_scores(capsys, tmp_path, llama_folder):
    scores = tmp_path / "other.parquet"
    pd.DataFrame({"layer": np.repeat(np.arange(3), 5), "head": np.tile(np.arange(5), 3),
                  "retrieval": np.zeros(15)}).to_parquet(scores)
    out_dir = tmp_path / "out"
    code, out = run_cli(capsys, llama_folder, "--scores", scores, "--lengths", "64", "--window", "8", "--html", out_dir / "page.html")
    assert code == 2 and "another model" in out.err and "Traceback" not in out.err
    assert not out_dir.exists()
