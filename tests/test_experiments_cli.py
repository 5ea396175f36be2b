"""``attnscope ablate`` and ``attnscope prune`` as a user runs them: files written, exit codes, one-line errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from attnscope import cli
from attnscope.experiments import load_pruned

from .conftest import SENTENCES


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("attnscope: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_ablate_writes_heatmap_table_and_summary(tiny_model_dir, texts, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "ablate", "--model", str(tiny_model_dir("bert")), "--data", str(texts),
                          "--layers", "1", "--bootstrap", "100", "-o", str(out))
    assert code == 0
    table = pd.read_csv(out / "ablation_heads.csv")
    assert list(table["layer"]) == [1] * 4 and list(table["head"]) == [0, 1, 2, 3]
    assert (table["metric"] == "cosine").all() and table["baseline"].iloc[0] == pytest.approx(1.0, abs=1e-6)
    assert (out / "ablation_heads.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out / "summary.html").read_text()
    assert "0-indexed" in summary and "ablation_heads.png" in summary and "prefix caching" in summary
    # issue 19.1: only layer 1 was ablated and every head hurts cosine to the intact model, so the
    # least harmful head of layer 1 is "most helpful" (an empty cell of layer 0, read as 0, won before)
    assert (table["delta"] < 0).all()
    lines = {line.split(":")[0]: line for line in stdout.splitlines() if line.startswith("most ")}
    for name, row in (("most harmful", table["delta"].idxmin()), ("most helpful (or least harmful)",
                                                                   table["delta"].idxmax())):
        assert lines[name].startswith(f"{name}: layer 1 head {table['head'][row]}: {table['delta'][row]:+.4g} [")
    assert "nan" not in stdout.lower()


def test_ablate_whole_layers_of_a_decoder_into_duckdb(tiny_model_dir, texts, tmp_path, capsys):
    import duckdb

    out = tmp_path / "out"
    code, _, _ = run(capsys, "ablate", "--model", str(tiny_model_dir("llama")), "--metric", "loss", "--data",
                     str(texts), "--sweep", "layers", "--mode", "uniform", "--format", "duckdb", "-o", str(out))
    assert code == 0
    with duckdb.connect(str(out / "ablation_layers.duckdb")) as db:
        rows = db.execute("SELECT layer, head FROM ablation ORDER BY layer").fetchall()
    assert rows == [(0, -1), (1, -1), (2, -1)]


def test_ablate_cross_attention_of_an_encoder_decoder_with_bleu(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"text": s, "pair": s}) for s in ("Hello.", "I went home.", "Hi.")))
    out = tmp_path / "out"
    code, _, _ = run(capsys, "ablate", "--model", str(tiny_model_dir("bart")), "--metric", "bleu", "--data", str(data),
                     "--kind", "cross", "--layers", "0", "--bootstrap", "50", "-o", str(out))
    assert code == 0
    table = pd.read_csv(out / "ablation_heads.csv")
    assert (table["kind"] == "cross").all() and len(table) == 4
    assert "no (naive loop" in (out / "summary.html").read_text()


def test_prune_writes_curve_model_and_speedup(tiny_model_dir, texts, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "prune", "--model", str(tiny_model_dir("llama")), "--metric", "loss", "--data",
                          str(texts), "--percent", "30", "-o", str(out))
    assert code == 0
    curve = pd.read_csv(out / "pruning_curve.csv")
    assert curve["heads_pruned"].iloc[0] == 0 and curve["heads_pruned"].is_monotonic_increasing
    importance = pd.read_csv(out / "importance.csv")
    assert len(importance) == 18
    pruned = load_pruned(out / "pruned_model")
    n_heads = [site.out_proj.in_features // 8 for site in pruned.sites.values()]  # d_head = 48 / 6
    assert sum(n_heads) == 18 - curve["heads_pruned"].iloc[3]
    assert "speed-up" in (out / "summary.html").read_text() and "measured speed-up: " in stdout


def test_prune_an_encoder_decoder_writes_the_curve_but_no_sliced_model(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("sacrebleu")
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"text": s, "pair": s}) for s in ("Hello.", "I went home.")))
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "prune", "--model", str(tiny_model_dir("bart")), "--metric", "bleu", "--data",
                          str(data), "--max-percent", "20", "-o", str(out))
    assert code == 0
    assert list(pd.read_csv(out / "pruning_curve.csv")["heads_pruned"]) == [0, 2, 5]  # of 24 heads in 3 kinds
    assert set(pd.read_csv(out / "importance.csv")["kind"]) == {"encoder", "decoder", "cross"}
    assert not (out / "pruned_model").exists() and "not written: physical pruning is not supported" in stdout


def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, texts, tmp_path, capsys):
    bert, llama = str(tiny_model_dir("bert")), str(tiny_model_dir("llama"))
    cases = [
        (("ablate", "--model", bert, "--data", str(tmp_path / "missing.txt")), "no such file: "),
        (("ablate", "--model", llama, "--metric", "cosine", "--data", str(texts)), "for sentence encoders"),
        (("prune", "--model", bert, "--metric", "cosine", "--data", str(texts)), "gradient is zero"),
        (("prune", "--model", llama, "--metric", "loss", "--data", str(texts), "--percent", "35"), "multiple of 10"),
        (("ablate", "--model", bert, "--data", str(texts), "--layers", "9"), "--layers: layer 9 does not exist"),
    ]
    for args, fragment in cases:
        code, _, err = run(capsys, *args, "-o", str(tmp_path / "out"))
        assert code == 2 and fragment in one_error_line(err), args


@pytest.mark.parametrize("args", [["-n", "1"], ["--data", "{one}"], ["--data", "{one}", "--metric", "loss"]])
def test_ablate_with_one_example_refuses_the_bootstrap_in_one_line(tiny_model_dir, texts, tmp_path, capsys, args):
    one = tmp_path / "one.txt"
    one.write_text("I went to the store.\n\n   \n")  # one usable line, a blank one, one of spaces
    model = tiny_model_dir("llama" if "loss" in args else "bert")
    data = [] if "--data" in args else ["--data", str(texts)]
    code, _, err = run(capsys, "ablate", "--model", str(model), *data, *(a.format(one=one) for a in args), "--layers",
                       "0", "-o", str(tmp_path / "out"))
    assert code == 2 and "needs at least 2 examples and the data gives 1" in one_error_line(err)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_ablate_with_one_example_and_no_bootstrap_reports_the_change_without_an_interval(tiny_model_dir, texts,
                                                                                        tmp_path, capsys):
    code, stdout, _ = run(capsys, "ablate", "--model", str(tiny_model_dir("bert")), "--data", str(texts), "-n", "1",
                          "--bootstrap", "0", "--layers", "0", "-o", str(tmp_path / "out"))
    assert code == 0 and "(1 examples)" in stdout and "(no bootstrap interval)" in stdout


def test_help_has_examples(capsys):
    for command in ("ablate", "prune"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert "examples:" in out and "--metric" in out
