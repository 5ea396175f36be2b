"""Bad input to the newer commands (issue 46, item 10): one ``attnscope: error:`` line, exit code 2, nothing left
behind; the pattern of test_cli_errors.py, through the real entry point."""

from __future__ import annotations

import sys

import pytest

from .test_cli_errors import assert_one_error_line, exit_code


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.mark.parametrize("extra", [["--png"], ["--png", "--json"], ["--json", "--png"]])
def test_routes_refuses_every_output_before_writing_any(extra, tiny_llama, tmp_path, capsys):
    """The page's PNG path is a folder: refused, and neither the page nor the JSON is left behind."""
    (tmp_path / "r.png").mkdir()
    code = exit_code(["routes", "The cat sat on the mat", "-m", tiny_llama, "-o", str(tmp_path / "r.html"), *extra])
    assert_one_error_line(code, capsys.readouterr().err, "r.png is a folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["r.png"] and not any((tmp_path / "r.png").iterdir())


def test_routes_leaves_no_file_nor_folder_when_refused_after_the_model_loads(tiny_llama, tmp_path, capsys):
    """A refusal that comes after the checks (a position past the text) leaves neither files nor the folders made."""
    out = tmp_path / "new" / "r.html"
    code = exit_code(["routes", "The cat sat", "-m", tiny_llama, "-o", str(out), "--png", "--json",
                      "--position", "99"])
    assert_one_error_line(code, capsys.readouterr().err, "position 99 is outside")
    assert not any(tmp_path.iterdir())


def test_two_outputs_of_one_file_are_refused(tiny_llama, tmp_path, capsys):
    path = str(tmp_path / "same")
    code = exit_code(["generate", "Hi", "-m", tiny_llama, "--save", path, "--html", path])
    assert_one_error_line(code, capsys.readouterr().err, "is named for two outputs")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["qk", "--head", "0:0", "--key", "0"], ["routes"]])
def test_a_text_past_the_model_s_limit_is_refused_naming_the_limit(command, tiny_llama, tmp_path, capsys,
                                                                   monkeypatch):
    """qk ran 24,000 tokens past SmolLM2's 8,192 without a word; routes refused. The tiny Llama's limit is its
    tokenizer's (512)."""
    text = "The cat sat on the mat. " * 600
    monkeypatch.chdir(tmp_path)  # where routes writes routes.html by default
    code = exit_code([command[0], text, "-m", tiny_llama, *command[1:]])
    assert_one_error_line(code, capsys.readouterr().err, "'s limit of 512 tokens")
    assert not any(tmp_path.iterdir())


def test_an_error_starts_its_own_line_after_a_progress_bar(capsys):
    """A step that fails half-way leaves its bar's line open (the bar is still referenced by the traceback); the
    error must not run on after it."""
    from tqdm.auto import tqdm

    from attnscope.cli.main import _fail

    bar = tqdm(range(3), desc="patching", leave=False, file=sys.stderr)
    running = iter(bar)  # kept, as a failed loop's traceback keeps it: its end would close the bar
    next(running)
    assert _fail("something is wrong") == 2
    err = capsys.readouterr().err
    assert err.endswith("\nattnscope: error: something is wrong\n"), repr(err)


def test_a_damaged_entity_in_the_select_on_file_is_named_by_that_file(tiny_model_dir, tmp_path, capsys):
    """With two gold files, the refusal says which one holds the damaged ``Entity=`` value, before the model loads."""
    from .test_probing_chains import synthetic_document_conllu

    good, damaged = tmp_path / "test.conllu", tmp_path / "dev.conllu"
    good.write_text(synthetic_document_conllu(8))
    damaged.write_text(synthetic_document_conllu(8).replace("Entity=(1-thing", "Entity=(1-thing)junk", 1))
    code = exit_code(["probe", "coref", "--conllu", str(good), "--select-on", str(damaged), "-m",
                      str(tiny_model_dir("bert")), "-o", str(tmp_path / "out")])
    expect = f"--select-on: {damaged.name}, sentence 'd1-2', word 1: Entity="
    assert_one_error_line(code, capsys.readouterr().err, expect)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dev.conllu", "test.conllu"]


@pytest.mark.parametrize(("options", "expect"), [
    (["--evaluate", "--method", "atp", "--positions", "--verify", "2"], "none of --method, --verify, --positions"),
    (["--evaluate", "--mlps", "--no-graddrop", "--metric", "prob"], "none of --metric, --mlps, --no-graddrop"),
    (["--clean", "a b", "--corrupt", "c d", "--target", " e", "--quick", "--prompts", "3"],
     "--prompts, --quick go with --evaluate"),
])
def test_patch_refuses_the_options_its_mode_cannot_use(options, expect, tiny_llama, tmp_path, capsys):
    """``patch --evaluate`` ran its check and dropped the pairs' options, and patching pairs dropped --evaluate's:
    both refused before the model loads, leaving no folder."""
    code = exit_code(["patch", *options, "-m", tiny_llama, "-o", str(tmp_path / "out")])
    assert_one_error_line(code, capsys.readouterr().err, expect)
    assert not any(tmp_path.iterdir())


def test_a_second_output_refused_takes_away_the_folder_made_for_the_first(tiny_llama, tmp_path, capsys):
    (tmp_path / "taken.json").mkdir()
    code = exit_code(["qk", "The cat sat", "--head", "0:0", "--key", "0", "-m", tiny_llama, "--json",
                      str(tmp_path / "taken.json")])
    assert_one_error_line(code, capsys.readouterr().err, "taken.json is a folder")
    code = exit_code(["generate", "Hi", "-m", tiny_llama, "--save", str(tmp_path / "new" / "g.safetensors"),
                      "--html", str(tmp_path / "taken.json")])
    assert_one_error_line(code, capsys.readouterr().err, "taken.json is a folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["taken.json"]
