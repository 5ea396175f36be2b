"""The terminal's step table says what distinguishes each step: the key a choice attended to most once
every head's attention sinks are left out, not the same secondary sink at every step."""

from __future__ import annotations

import numpy as np
import pytest

from attnscope.analysis.step_table import most_attended, step_rows, step_sinks
from attnscope.records.attention import ModelInfo
from attnscope.records.generation import GenerationRecord, packed_length, row_offset

LAYERS, HEADS, PROMPT, STEPS, SECOND_SINK = 2, 3, 8, 6, 3


def _generation_with_a_second_sink() -> GenerationRecord:
    """Rows where every head puts 0.3 on position 0 and 0.55 on position 3 (a secondary sink, over 5x the
    uniform share of these short rows) at every position, and the rest of each row on the previous token: what
    distinguishes a step is that token."""
    n = PROMPT + STEPS
    rows = np.zeros((LAYERS, HEADS, packed_length(n)), dtype=np.float32)
    for position in range(n):
        row = np.zeros(position + 1, dtype=np.float32)
        row[0] += 0.3
        if position > SECOND_SINK:
            row[SECOND_SINK] += 0.55
        row[max(position - 1, 0)] += 1.0 - row.sum()
        rows[..., row_offset(position) : row_offset(position + 1)] = row
    candidates = np.tile(np.arange(2), (STEPS, 1))
    probs = np.tile(np.array([0.9, 0.1], dtype=np.float32), (STEPS, 1))
    arrays = {"rows": rows, "token_ids": np.arange(n), "special_mask": np.zeros(n, bool), "word_ids": np.arange(n),
              "candidate_ids": candidates, "candidate_probs": probs, "chosen_probs": probs[:, 0].copy()}
    model = ModelInfo("synthetic", "llama", LAYERS, HEADS, HEADS, 8, True, False, 0.125)
    return GenerationRecord(model=model, tokens=tuple(f" w{i}" for i in range(n)), prompt_length=PROMPT,
                            arrays=arrays, candidate_tokens=((" a", " b"),) * STEPS, prompt="synthetic",
                            settings={"do_sample": False})


def test_the_secondary_sink_is_found_and_left_out():
    record = _generation_with_a_second_sink()
    sinks = step_sinks(record)
    assert sinks[..., 0].all() and sinks[..., SECOND_SINK].all()
    assert sinks.sum() == 2 * LAYERS * HEADS  # no other key is a sink
    # left out, each step's most attended key is the token before it, which moves with the step
    for step in range(STEPS):
        chooser = PROMPT + step - 1
        position, weight = most_attended(record, step, sinks)
        assert position == chooser - 1 and weight == pytest.approx(0.15)
    assert len({row["most_attended"]["position"] for row in step_rows(record)}) == STEPS


def test_position_zero_alone_would_leave_the_secondary_sink_at_every_step():
    record = _generation_with_a_second_sink()
    only_first = np.zeros_like(step_sinks(record))
    only_first[..., 0] = True
    assert {most_attended(record, step, only_first)[0] for step in range(STEPS)} == {SECOND_SINK}
