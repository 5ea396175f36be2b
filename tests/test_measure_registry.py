"""Adding a context-mixing measure is one registered object: a dummy measure registered here shows up
in the CLI's choices and help, the views' payload, and the explorer's menu and request schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnscope import AttnscopeError, load_model
from attnscope.analysis.mixing import (
    METHOD_ALIASES,
    METHODS,
    REFERENCES,
    ROLLOUT_RESIDUAL,
    Measure,
    get_measure,
    measure_choices,
    measures,
    method_name,
    register_measure,
    unregister_measure,
)
from attnscope.present.payload import MIXING_LABELS, payload_schema

jsonschema = pytest.importorskip("jsonschema")

TEXT = "The cat sat on the mat."


def uniform(layers, distances):
    """Every query takes the same share of every key: ``[layer, q_pos, k_pos]``, no head maps."""
    n = layers[0].attention.shape[-1]
    return np.full((len(layers), n, n), 1.0 / n), None


DUMMY = Measure("uniform", "uniform (dummy)", "a test's dummy measure", residual=False, compute=uniform,
                aliases=("flat",), cited="Nobody 2026")


@pytest.fixture
def dummy():
    register_measure(DUMMY)
    try:
        yield DUMMY
    finally:
        unregister_measure(DUMMY.name)


def payload_of(page_path) -> dict:
    text = page_path.read_text(encoding="utf-8")
    start = text.index('type="application/json"')
    return json.loads(text[text.index(">", start) + 1 : text.index("</script>", start)])


def test_the_built_in_measures_are_registered_in_order():
    assert [m.name for m in measures()] == list(METHODS) == ["attention", "norm", "norm_residual", "alti",
                                                             "value_zeroing"]
    assert measure_choices() == [*METHODS, "globenc"]
    assert dict(METHOD_ALIASES) == {"globenc": "norm_residual"}
    assert [name for name in METHODS if get_measure(name).intervention] == ["value_zeroing"]
    assert dict(ROLLOUT_RESIDUAL) == {"attention": 0.5, "norm": 0.5, "norm_residual": 0.0, "alti": 0.0,
                                      "value_zeroing": 0.0}


def test_a_name_or_alias_is_registered_once(dummy):
    with pytest.raises(AttnscopeError, match="already registered as globenc"):
        register_measure(Measure("other", "other", "other", residual=True, compute=uniform, aliases=("globenc",)))
    with pytest.raises(AttnscopeError, match="already registered as uniform"):
        register_measure(DUMMY)


def test_a_registered_measure_shows_in_the_old_tables(dummy):
    assert method_name("flat") == "uniform" and METHOD_ALIASES["flat"] == "uniform"
    assert REFERENCES["uniform"] == "a test's dummy measure" and MIXING_LABELS["uniform"] == "uniform (dummy)"
    assert ROLLOUT_RESIDUAL["uniform"] == 0.5
    assert measure_choices()[-2:] == ["globenc", "flat"] and "uniform" in measure_choices()


@pytest.mark.parametrize("command", [["view"], ["plot"], ["mixing"]])
def test_a_registered_measure_is_in_the_cli_help(dummy, command, capsys):
    from attnscope.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "uniform = flat" in help_text and "{attention,norm,norm_residual,alti,value_zeroing,uniform,globenc,flat}" in help_text
    if command == ["mixing"]:
        assert "uniform = flat (Nobody 2026)" in help_text


def test_a_registered_measure_is_a_cli_choice_and_ships_in_the_views_payload(dummy, tiny_model_dir, tmp_path, capsys):
    from attnscope.cli import main

    out = tmp_path / "views.html"
    folder = str(tiny_model_dir("bert"))
    assert main(["view", TEXT, "--model", folder, "--measure", "flat", "--measure", "alti", "-o", str(out)]) == 0
    assert "measures uniform, alti" in capsys.readouterr().out
    payload = payload_of(out)
    jsonschema.Draft202012Validator(payload_schema()).validate(payload)  # its enum of methods is read now
    shipped = payload["kinds"][0]["mixing"]
    assert [(entry["method"], entry["label"], entry["reference"]) for entry in shipped] == [
        ("uniform", "uniform (dummy)", "a test's dummy measure"), ("alti", "ALTI", "ALTI, Ferrando et al. 2022")]


def test_a_registered_measure_is_in_the_explorers_menu_schema_and_api(dummy, tiny_model_dir):
    testclient = pytest.importorskip("fastapi.testclient")
    from attnscope.serve.app import create_app

    client = testclient.TestClient(create_app(loaded=[load_model(str(tiny_model_dir("bert")))]),
                                   base_url="http://127.0.0.1:8765")
    menu = client.get("/api/models").json()["measures"]
    assert menu[-1] == {"method": "uniform", "label": "uniform (dummy)", "reference": "a test's dummy measure"}
    schema = client.get("/openapi.json").json()["components"]["schemas"]["MixingRequest"]["properties"]["method"]
    assert "uniform" in schema["enum"] and "flat" in schema["enum"] and "uniform = flat (Nobody 2026)" in schema["description"]
    answer = client.post("/api/mixing", json={"text": TEXT, "method": "flat"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["method"] == "uniform" and answer.json()["mixing"]["label"] == "uniform (dummy)"


def test_the_dummy_is_gone_after_its_test():
    assert "uniform" not in measure_choices() and "uniform" not in MIXING_LABELS
