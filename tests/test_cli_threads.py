"""``--threads`` / ``$ATTNSCOPE_THREADS``: torch's CPU threads for a command (one thread can be far faster than two
while another process keeps a core busy; benchmarks/threads.py measures it)."""

from __future__ import annotations

import pytest
import torch

from attnscope.cli import main


@pytest.fixture(autouse=True)
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_threads_option_sets_torchs_threads(capsys, monkeypatch):
    monkeypatch.delenv("ATTNSCOPE_THREADS", raising=False)
    torch.set_num_threads(2)
    assert main(["report", "The cat sat on the mat.", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1


def test_the_environment_variable_is_the_default_and_the_option_wins(capsys, monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv("ATTNSCOPE_THREADS", "1")
    assert main(["report", "The cat sat on the mat."]) == 0
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("ATTNSCOPE_THREADS", "3")
    assert main(["report", "The cat sat on the mat.", "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2


# "²" passes str.isdigit; 2**66 overflows torch's thread count (issue 36): both refused like any bad count
@pytest.mark.parametrize("value", ["0", "two", "-1", "\u00b2", "99999999999999999999", "1025"])
def test_a_bad_thread_count_is_one_line(capsys, monkeypatch, value):
    monkeypatch.setenv("ATTNSCOPE_THREADS", value)
    assert main(["report", "The cat sat on the mat."]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "ATTNSCOPE_THREADS" in error[0]
    monkeypatch.delenv("ATTNSCOPE_THREADS")
    with pytest.raises(SystemExit) as exited:  # argparse's own usage error
        main(["report", "The cat sat on the mat.", f"--threads={value}"])
    assert exited.value.code == 2 and "--threads" in capsys.readouterr().err


@pytest.mark.parametrize(("cores", "option", "expected"), [(2, [], 1), (8, [], 3), (2, ["--threads", "2"], 2)])
def test_generation_takes_one_thread_on_a_small_machine(capsys, monkeypatch, tiny_model_dir, cores, option, expected):
    """One stream of batch-one steps: on 2 cores a second thread gained 7% alone and cost 2.6x beside a busy
    process (benchmarks/threads.py), so generate uses one there unless told otherwise."""
    monkeypatch.delenv("ATTNSCOPE_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    torch.set_num_threads(3)
    model = str(tiny_model_dir("llama"))
    assert main(["generate", "The cat sat.", "-m", model, "-n", "2", "--json", *option]) == 0
    assert torch.get_num_threads() == expected
