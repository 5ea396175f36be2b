"""Cache folders (converted GGUF models, the trained toy translator) are published atomically: two
processes building the same folder at once both end with one complete folder and no leftovers.

A test run and a command (or two workers) converting SmolLM2 on first use used to share one
staging folder, and the second rename failed with 'Directory not empty'."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from attnscope.models.loading import publish_folder


def _slow_build(name: str, started: threading.Barrier):  # type: ignore[no-untyped-def]
    def build(staging: Path) -> None:
        started.wait(timeout=10)  # both builders are inside build() before either renames
        (staging / "model.safetensors").write_text(name)
        time.sleep(0.05)
    return build


def test_two_builders_of_one_folder_both_get_one_complete_folder(tmp_path):
    folder, started, results, errors = tmp_path / "model", threading.Barrier(2), [], []

    def run(name: str) -> None:
        try:
            results.append(publish_folder(folder, _slow_build(name, started)))
        except Exception as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and results == [folder, folder]
    assert (folder / "model.safetensors").read_text() in {"first", "second"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no staging folder left behind


def test_a_failing_build_leaves_nothing_and_raises(tmp_path):
    def broken(staging: Path) -> None:
        (staging / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_folder(tmp_path / "model", broken)
    assert list(tmp_path.iterdir()) == []
