"""Output folders never mix two runs, and --overwrite removes only what attnscope wrote (issue 19, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnscope import AttentionRecord
from attnscope.cli.outputs import MANIFEST, output_folder
from attnscope.errors import AttnscopeError

from .test_experiments_cli import one_error_line, run

FOLDER_COMMANDS = {
    "extract": ["extract", "hi"],
    "ablate": ["ablate"],
    "prune": ["prune"],
    "heads": ["heads", "brown"],
    "probe deps": ["probe", "deps"],
    "probe coref": ["probe", "coref"],
    "probe edges": ["probe", "edges"],
    "primer": ["primer"],
}


def test_a_second_extract_into_the_same_folder_is_refused_and_the_first_run_kept(tmp_path, capsys):
    sentences, pairs, out = tmp_path / "sentences.txt", tmp_path / "pairs.jsonl", tmp_path / "records"
    sentences.write_text("I went to the store.\n\nThe cat sat.\nHello there.\n")
    pairs.write_text('{"text": "I went home.", "pair": "It rained."}\n{"text": "Good night."}\n')
    assert run(capsys, "extract", "--file", str(sentences), "--out", str(out))[0] == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}

    code, _, err = run(capsys, "extract", "--file", str(pairs), "--out", str(out))
    assert code == 2 and "is not empty" in one_error_line(err) and "--overwrite" in one_error_line(err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # nothing the user had is lost

    assert run(capsys, "extract", "--file", str(pairs), "--out", str(out), "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["attnscope-manifest.json", "index.jsonl",
                                                     "record_000000.safetensors", "record_000001.safetensors"]
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert [(row["text"], row["pair"], row["line"]) for row in index] == [("I went home.", "It rained.", 1),
                                                                          ("Good night.", None, 2)]
    assert all(row["source"] == str(pairs) and row["model"] == "minilm" for row in index)
    for row in index:  # each file holds the input the index names
        assert AttentionRecord.load(out / row["file"]).text == tuple(t for t in (row["text"], row["pair"]) if t)


def test_the_index_names_each_input_s_line_in_a_text_file(tmp_path, capsys):
    sentences, out = tmp_path / "sentences.txt", tmp_path / "records"
    sentences.write_text("\nFirst line.\n\n\nSecond line.\n")
    assert run(capsys, "extract", "--file", str(sentences), "--out", str(out))[0] == 0
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert [(row["file"], row["text"], row["line"]) for row in index] == [
        ("record_000000.safetensors", "First line.", 2), ("record_000001.safetensors", "Second line.", 5)]


@pytest.mark.parametrize("command", list(FOLDER_COMMANDS))
def test_every_folder_command_refuses_a_folder_with_the_user_s_files_even_with_overwrite(command, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    args = FOLDER_COMMANDS[command]
    for extra in ([], ["--overwrite"]):
        code, _, err = run(capsys, *args, "-o", str(folder), *extra)
        assert code == 2, err
        assert ("is not empty" if not extra else "no readable attnscope-manifest.json") in one_error_line(err)
    assert [p.name for p in folder.iterdir()] == ["thesis.tex"]
    assert (folder / "thesis.tex").read_text() == "years of work"


def test_overwrite_removes_only_what_the_manifest_lists(tmp_path):
    folder = tmp_path / "out"
    with output_folder(folder, overwrite=False, command="test"):
        (folder / "sub").mkdir()
        (folder / "sub" / "a.csv").write_text("1")
        (folder / "b.png").write_text("2")
    assert json.loads((folder / MANIFEST).read_text())["files"] == ["b.png", "sub/a.csv"]

    (folder / "notes.txt").write_text("the user's")
    with pytest.raises(AttnscopeError, match="1 other file"), output_folder(folder, overwrite=True, command="test"):
        pass
    assert (folder / "b.png").exists() and (folder / "notes.txt").exists()  # refused before removing anything

    (folder / "notes.txt").unlink()
    with output_folder(folder, overwrite=True, command="test"):
        assert list(folder.iterdir()) == []  # cleared, the run's own sub-folder too
        (folder / "c.csv").write_text("3")
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "c.csv"]


def test_a_manifest_that_points_outside_its_folder_is_refused(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "x.csv").write_text("1")
    (folder / MANIFEST).write_text(json.dumps({"files": ["x.csv", "../precious.txt"]}))
    with pytest.raises(AttnscopeError, match="damaged"), output_folder(folder, overwrite=True, command="test"):
        pass
    assert outside.read_text() == "keep" and (folder / "x.csv").exists()


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "never"
    code, _, err = run(capsys, "extract", "hi", "--out", str(out), "--model", "no-such-model")
    assert code == 2 and "unknown model" in one_error_line(err)
    assert not out.exists()


# ---- every write is checked (issue 25, item 8) -----------------------------------------------------
FULL = Path("/dev/full")  # a device whose every write fails with ENOSPC; it must stay a device
needs_full = pytest.mark.skipif(not FULL.is_char_device(), reason="no /dev/full")


def full_link(tmp_path: Path, name: str) -> Path:
    """``name`` in ``tmp_path``: a symlink to /dev/full (writers pick the format by the suffix)."""
    link = tmp_path / name
    link.symlink_to(FULL)
    return link


@needs_full
@pytest.mark.parametrize("write", ["record", "generation", "html", "png", "parquet", "csv", "summary"])
def test_a_write_onto_a_full_device_is_one_error_and_the_device_stays(write, tmp_path, tiny_model_dir):
    import pandas as pd

    from attnscope.experiments.report import write_summary, write_table
    from attnscope.present.figures import plot, save_figure
    from attnscope.present.html import write_page

    writes = {
        "record": lambda path: _record(tiny_model_dir).save(path),
        "generation": lambda path: _generation(tiny_model_dir).save(path),
        "html": lambda path: write_page(path, "<p>hi</p>"),
        "png": lambda path: save_figure(plot(_record(tiny_model_dir), "head", layer=0, head=0), path),
        "parquet": lambda path: write_table(pd.DataFrame({"a": [1.0]}), path),
        "csv": lambda path: write_table(pd.DataFrame({"a": [1.0]}), path),
        "summary": lambda path: write_summary(path, "t", {"a": 1}, [], pd.DataFrame({"a": [1]})),
    }
    suffix = {"record": ".safetensors", "generation": ".safetensors", "html": ".html", "summary": ".html"}
    for target in (FULL, full_link(tmp_path, f"out{suffix.get(write, '.' + write)}")):
        if write in ("png", "parquet", "csv") and target == FULL:
            continue  # the format comes from the suffix: only the link names one
        with pytest.raises(AttnscopeError, match=f"cannot write {target}: No space left on device"):
            writes[write](target)
        assert FULL.is_char_device()  # never replaced by a regular file (safetensors' own save did that)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"out{suffix.get(write, '.' + write)}"]  # no leftovers


def test_a_failed_write_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path):
    from attnscope.files import written

    target = tmp_path / "view.html"
    target.write_text("the user's earlier page")
    target.chmod(0o640)
    with pytest.raises(RuntimeError), written(target) as temporary:
        temporary.write_text("half a pa")
        raise RuntimeError("the writer failed half-way")
    assert target.read_text() == "the user's earlier page" and [p.name for p in tmp_path.iterdir()] == ["view.html"]
    with written(target) as temporary:
        temporary.write_text("the new page")
    assert target.read_text() == "the new page" and (target.stat().st_mode & 0o777) == 0o640
    with pytest.raises(AttnscopeError, match="cannot write .*: the writer wrote nothing"), written(tmp_path / "x"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


@needs_full
@pytest.mark.parametrize("option", ["--save", "--html"])
def test_cli_generate_onto_a_full_device_fails_in_one_line(option, tiny_model_dir, capsys):
    code, out, err = run(capsys, "generate", "hi", "-m", str(tiny_model_dir("llama")), "-n", "2", option, str(FULL))
    assert code == 2 and one_error_line(err) == f"attnscope: error: cannot write {FULL}: No space left on device"
    assert "generation record:" not in out and "step view:" not in out and FULL.is_char_device()


def _record(tiny_model_dir) -> AttentionRecord:
    from attnscope import extract, load_model

    return extract(load_model(str(tiny_model_dir("bert"))), "I went to the store.")


def _generation(tiny_model_dir):
    from attnscope import generate, load_model

    return generate(load_model(str(tiny_model_dir("llama"))), "I went", max_new_tokens=2)
