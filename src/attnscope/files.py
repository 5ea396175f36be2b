"""Every file attnscope writes goes through :func:`written`: a complete file or an error, never a
success that did not happen.

Writers (safetensors, matplotlib, pandas, pyarrow) do not all report a failed write: to
``/dev/full`` each of them returns as if it had written. So a writer writes into a temporary file
of the same folder, then :func:`written` checks that the file is there, flushes it to disk and
renames it over the target: a reader sees the old file or the whole new one, and a full disk
leaves the old file as it was. A target that exists and is not a regular file (a device such as
``/dev/full`` or ``/dev/stdout``, a named pipe, a symlink) is never replaced: the finished
temporary file is copied into it with writes that raise on failure.

>>> with written(Path("gen.safetensors")) as temporary:          # doctest: +SKIP
...     save_file(arrays, str(temporary))
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from .errors import AttnscopeError

_UMASK = os.umask(0o022)  # read once (setting it is the only way), at import, before any thread writes
os.umask(_UMASK)


@contextmanager
def written(path: str | Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s content to; when the block ends without error, it becomes
    ``path`` (see the module's docstring). Any failure, of the writer or of moving the file, is one
    :class:`AttnscopeError` line naming ``path``; the temporary file never stays behind."""
    path = Path(path)
    replace = not path.is_symlink() and (path.is_file() or not path.exists())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}",
                                        dir=path.parent if replace else None)
        os.close(handle)
    except OSError as error:
        raise _cannot_write(path, error) from None
    temporary = Path(name)
    try:
        yield temporary
        _finish(temporary, path, replace)
    except OSError as error:
        raise _cannot_write(path, error) from None
    finally:
        with suppress(OSError):
            temporary.unlink()


def _finish(temporary: Path, path: Path, replace: bool) -> None:
    if temporary.stat().st_size == 0:
        raise OSError("the writer wrote nothing")
    if not replace:
        with temporary.open("rb") as source, path.open("wb") as target:
            shutil.copyfileobj(source, target)
            target.flush()  # a full device refuses here, or when the file closes: both raise
        return
    with temporary.open("rb+") as handle:
        os.fsync(handle.fileno())
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_UMASK
    os.chmod(temporary, mode)  # what the file would have had if written in place (mkstemp makes 0600)
    os.replace(temporary, path)


def _cannot_write(path: Path, error: OSError) -> AttnscopeError:
    return AttnscopeError(f"cannot write {path}: {error.strerror or error}")


def cannot_read(path: str | Path, error: Exception, what: str = "text") -> AttnscopeError:
    """One line, in words, for a ``what`` file (text, record, ...) that could not be read:
    ``no such file: X``, ``X is a folder, not a record file``, or ``cannot read X: <reason>``."""
    path = Path(path)
    with suppress(OSError):  # a name the system cannot even look up (too long): the error itself says so
        if path.is_dir():
            return AttnscopeError(f"{path} is a folder, not a {what} file")
        if not path.exists() and not path.is_symlink():
            return AttnscopeError(f"no such file: {path}")
    if isinstance(error, UnicodeDecodeError):
        return AttnscopeError(f"cannot read {path}: it is not UTF-8 text (byte {error.start} is not UTF-8)")
    return AttnscopeError(f"cannot read {what} {path}: {getattr(error, 'strerror', None) or error}")


def read_text(path: str | Path) -> str:
    """A whole UTF-8 text file; one line in words (:func:`cannot_read`) if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise cannot_read(path, error) from None


def parse_json(text: str, **options: Any) -> Any:
    """``json.loads(text, **options)``, where a value nested too deeply for Python's parser (``[[[...]]]``,
    thousands of levels) is bad JSON like any other: :class:`json.JSONDecodeError`, not a RecursionError."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        start = len(text) - len(text.lstrip())  # where the value that nests too deeply begins
        raise json.JSONDecodeError("nested too deeply", text, start) from None
