"""Where commands write: output folders that never mix two runs, and files checked before the work.

A command that fills a folder runs inside :func:`output_folder`. A new or empty folder is used as
is. A non-empty one is refused, unless ``overwrite`` is set *and* every file in it is listed in the
manifest (``attnscope-manifest.json``) that an earlier attnscope run wrote there: only then are
those files removed. So ``-o .`` or ``-o ~`` can never delete a user's own files. When the command
ends (even interrupted) the manifest lists what it wrote; a run refused on the way leaves nothing.

>>> with output_folder(Path("out"), overwrite=False, command="ablate") as folder:   # doctest: +SKIP
...     (folder / "table.csv").write_text("...")
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AttnscopeError
from ..files import parse_json

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..inputs import InputLine
    from ..records.attention import AttentionRecord

MANIFEST = "attnscope-manifest.json"
INDEX = "index.jsonl"


@contextmanager
def output_folder(path: Path, *, overwrite: bool, command: str) -> Iterator[Path]:
    """Prepare ``path`` (see the module's docstring), yield it, then write its manifest.

    Call it before the slow work, so a folder that cannot be used fails in a second, not after it. A run
    refused on the way (:class:`AttnscopeError`) leaves nothing it created: its files go, and so do the
    folder and its parents if it made them.
    """
    made = _missing_folders(path)
    prepare_output_folder(path, overwrite=overwrite)
    try:
        yield path
    except AttnscopeError:
        _remove_files(path, written_files(path))  # the folder was empty before: every file is this run's
        raise
    finally:
        if written_files(path):
            write_manifest(path, command)
        else:
            _remove_empty_folders(made)  # nothing was written: leave no empty folder behind


def prepare_output_folder(path: Path, *, overwrite: bool) -> None:
    """Make ``path`` an empty, writable folder, or raise :class:`AttnscopeError` saying why it is not."""
    if path.exists() and not path.is_dir():
        raise AttnscopeError(f"output folder {path} is a file; choose a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AttnscopeError(f"cannot create output folder {path}: {error.strerror or error}") from None
    present = written_files(path) + [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    if present:
        if not overwrite:
            raise AttnscopeError(f"output folder {path} is not empty ({_examples(path, present)}); choose a new "
                                 "folder, or pass --overwrite to replace an earlier attnscope run's files")
        _clear_earlier_run(path)
    _check_writable(path)


def written_files(folder: Path) -> list[Path]:
    """Every file (and symlink) under ``folder``, without following symlinked folders; not the manifest."""
    found = []
    for root, dirs, files in os.walk(folder):
        base = Path(root)
        found += [base / name for name in files]
        found += [base / name for name in dirs if (base / name).is_symlink()]
    return sorted(p for p in found if p != folder / MANIFEST)


def write_manifest(folder: Path, command: str) -> Path:
    """List every file now in ``folder`` as written by ``command`` (what a later ``--overwrite`` may remove)."""
    from ..version import __version__

    files = [p.relative_to(folder).as_posix() for p in written_files(folder)]
    manifest = folder / MANIFEST
    manifest.write_text(json.dumps({"written_by": f"attnscope {__version__}", "command": command, "files": files},
                                   indent=1) + "\n", encoding="utf-8")
    return manifest


def _clear_earlier_run(folder: Path) -> None:
    """Remove the files an earlier run listed in its manifest; refuse (removing nothing) if anything else is there."""
    listed = _manifest_files(folder)
    present = {p.relative_to(folder).as_posix() for p in written_files(folder)}
    foreign = sorted(present - listed)
    if foreign:
        raise AttnscopeError(f"--overwrite removes only files attnscope wrote, and {folder} also holds "
                             f"{len(foreign)} other file(s) (e.g. {foreign[0]}): move them, or choose a new folder")
    _remove_files(folder, [folder / name for name in present])
    (folder / MANIFEST).unlink()


def _remove_files(folder: Path, files: Iterable[Path]) -> None:
    """Remove ``files`` (in ``folder``), then every folder inside ``folder`` that this leaves empty."""
    for path in files:
        path.unlink()
    for root, dirs, _ in sorted(os.walk(folder), key=lambda entry: len(Path(entry[0]).parts), reverse=True):
        for name in dirs:
            with suppress(OSError):
                (Path(root) / name).rmdir()  # a folder the run made, now empty; a user's own folder stays


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first (what ``mkdir(parents=True)``
    makes)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty_folders(folders: Iterable[Path]) -> None:
    for folder in folders:  # innermost first, so each is empty once the one inside it is gone
        with suppress(OSError):
            folder.rmdir()


def _manifest_files(folder: Path) -> set[str]:
    manifest = folder / MANIFEST
    try:
        files = parse_json(manifest.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise AttnscopeError(f"--overwrite removes only files attnscope wrote, and {folder} has no readable "
                             f"{MANIFEST} listing them: choose a new folder") from None
    if not isinstance(files, list) or not all(isinstance(name, str) and _inside(name) for name in files):
        raise AttnscopeError(f"{manifest} is damaged (its file list is not a list of relative paths); "
                             "choose a new folder")
    return set(files)


def _inside(name: str) -> bool:
    """True for a relative path that stays inside its folder (no absolute path, no ``..``)."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _examples(folder: Path, present: list[Path]) -> str:
    names = sorted(p.relative_to(folder).as_posix() for p in present)
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}, e.g. {names[0]}"


def _check_writable(folder: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise AttnscopeError(f"cannot write into output folder {folder}: {error.strerror or error}") from None


def check_output_file(path: Path) -> None:
    """Fail now, with one line, if ``path`` cannot be written later (its folder is made if missing)."""
    if path.is_dir():
        raise AttnscopeError(f"output file {path} is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AttnscopeError(f"cannot create the folder of {path}: {error.strerror or error}") from None
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise AttnscopeError(f"cannot write {path}: permission denied")


@contextmanager
def output_files(*paths: Path | None) -> Iterator[None]:
    """Check every file a command will write (None: an output not asked for) before its slow work, with
    :func:`check_output_file`, and that no two are the same file. A run refused or failing on the way
    (:class:`AttnscopeError`, :class:`OSError`) leaves none of the files it had written that were not there before,
    nor the folders made for them."""
    given = [path for path in paths if path is not None]
    resolved = [os.path.abspath(path) for path in given]
    for index, path in enumerate(given):
        if resolved[index] in resolved[:index]:
            raise AttnscopeError(f"{path} is named for two outputs; give each its own file name")
    made = [folder for path in given for folder in _missing_folders(path.parent)]
    new: list[Path] = []
    try:
        for path in given:
            check_output_file(path)  # makes the file's folder: a later file refused takes it away again
        new = [path for path in given if not path.exists()]
        yield
    except (AttnscopeError, OSError):
        for path in new:
            path.unlink(missing_ok=True)
        _remove_empty_folders(sorted(set(made), key=lambda folder: -len(folder.parts)))
        raise


def record_name(index: int) -> str:
    """The file name of the ``index``-th record (0-based) in an output folder."""
    return f"record_{index:06d}.safetensors"


def save_records(records: Iterable[AttentionRecord], inputs: Sequence[InputLine], folder: Path, *,
                 float16: bool = False, saved: bool = False) -> int:
    """Save the records (one per input, in order) as ``record_NNNNNN.safetensors`` in ``folder`` and list
    each in ``index.jsonl``: file, text, pair, model, and the input's source file and line (or None).
    ``saved``: the records are already in their files (streamed there); only index them.

    The index grows as records are written, so an interrupted run still says what its files hold.
    Returns the number of records written.
    """
    count = 0
    with (folder / INDEX).open("w", encoding="utf-8") as index:
        for count, (record, entry) in enumerate(zip(records, inputs, strict=True), 1):
            name = record_name(count - 1)
            if not saved:
                record.save(folder / name, float16=float16)
            row = {"file": name, "text": entry.text, "pair": entry.pair, "model": record.model.name,
                   "source": entry.source, "line": entry.line}
            index.write(json.dumps(row, ensure_ascii=False) + "\n")
            index.flush()
    return count


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn a failed write of ``path`` (disk full, ``/dev/full``) into one line naming it."""
    try:
        yield
    except OSError as error:
        raise AttnscopeError(f"cannot write {path}: {error.strerror or error}") from None


def write_check(folder: Path, name: str, data: dict[str, Any], figure: Figure) -> list[str]:
    """A check's ``NAME.json`` (``data``, one line) and its figure as ``NAME.png`` and ``NAME.svg`` in ``folder``:
    the paths written."""
    from ..present.figures import save_figure

    summary = folder / f"{name}.json"
    summary.write_text(json.dumps(data) + "\n", encoding="utf-8")
    return [str(summary), *(str(save_figure(figure, folder / f"{name}.{suffix}")) for suffix in ("png", "svg"))]


def interval_text(value: Sequence[float | None]) -> str:
    """``[mean, low, high]`` as ``+0.123 [+0.045, +0.201]`` (``n/a`` without a mean; the mean alone without bounds)."""
    mean, low, high = value
    if mean is None:
        return "n/a"
    return f"{mean:+.3f}" + ("" if low is None or high is None else f" [{low:+.3f}, {high:+.3f}]")
