"""The curated public API: every name in ``__all__`` resolves, and nothing private leaks in."""

import subprocess
import sys

import attnscope


def test_every_public_name_resolves():
    for name in attnscope.__all__:
        assert getattr(attnscope, name) is not None, name
    assert all(not name.startswith("_") or name == "__version__" for name in attnscope.__all__)


def test_importing_the_package_does_not_import_torch():
    code = "import sys, attnscope, attnscope.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True).stdout.strip() == "False"


def test_package_is_typed():
    from importlib.resources import files

    assert files("attnscope").joinpath("py.typed").is_file()


def test_ci_type_checks_what_py_typed_promises():
    """Users' type checkers read the annotations py.typed ships, so CI runs mypy over src: ``.ci/run`` runs
    ``make lint`` (not inside ``make test``: mypy costs a minute of CPU on a cold cache), whose recipe runs it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ci_steps = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    makefile = (root / "Makefile").read_text()
    lint_recipe = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert "make lint" in ci_steps
    assert "$(BIN)/mypy src" in [line.strip() for line in lint_recipe]


def test_star_import_needs_no_optional_extra():
    """`from attnscope import *` resolves every name in __all__: none may need an optional extra
    (the notebook widget, Ray), which a default install lacks."""
    code = ("import sys; sys.modules['anywidget'] = None; sys.modules['ray'] = None\n"
            "from attnscope import *\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr[-500:]


def test_qk_attribution_is_public_and_imported_on_first_use():
    code = ("import sys, attnscope\nbefore = 'attnscope.attribution.qk' in sys.modules\n"
            "print(before, attnscope.qk_attribution.__module__, 'qk_attribution' in attnscope.__all__)")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert done.stdout.split() == ["False", "attnscope.attribution.qk", "True"], done.stderr[-500:]
