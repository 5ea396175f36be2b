"""The examples of the README and the documentation pages: their fences, and a runner that executes them.

A fence is an *example* when its language is Python or a shell (``shell``, ``bash``, ``sh``, ``console``, or
none). Every example runs in the test suite (tests/test_docs_examples.py) unless an HTML comment
``<!-- not run: REASON -->`` stands right before it (before its generated region's opening line, for a fence
inside one). ``python tests/docs_examples.py SEGMENTS.json`` runs one page's examples in order, in the current
folder: Python fences in one namespace (as in a notebook), shell fences with ``bash -e``; the first failure
names its page and line and exits non-zero.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PYTHON = {"python", "py", "pycon"}
SHELL = {"shell", "bash", "sh", "console", ""}
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>.*?) -->$")
REGION_OPENING = re.compile(r"^<!-- figures:[\w-]+ -->$")


@dataclass(frozen=True)
class Example:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    kind: str  # "python" | "shell"
    code: str
    not_run: str | None  # the reason it is not run, or None: it runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def examples(page: str, text: str) -> list[Example]:
    """The example fences of one page, in order, each with its ``not run`` reason if it has one."""
    lines = text.splitlines()
    found, start, lang = [], None, ""
    for number, line in enumerate(lines):
        match = FENCE.match(line)
        if match is None:
            continue
        if start is None:
            start, lang = number, match.group("lang").lower()
            continue
        if lang in PYTHON | SHELL:
            kind = "python" if lang in PYTHON else "shell"
            found.append(Example(page, start + 1, kind, "\n".join(lines[start + 1:number]) + "\n",
                                 not_run_reason(lines, start)))
        start = None
    return found


def not_run_reason(lines: list[str], fence: int) -> str | None:
    """The reason of the ``<!-- not run: ... -->`` comment right before line ``fence`` (blank lines and a
    generated region's opening line may stand between them), or None."""
    before = fence - 1
    while before >= 0 and (not lines[before].strip() or REGION_OPENING.match(lines[before])):
        before -= 1
    match = NOT_RUN.match(lines[before]) if before >= 0 else None
    return match.group("reason").strip() if match else None


def markers(text: str) -> list[int]:
    """The 1-based lines of every ``not run`` comment of a page."""
    return [number + 1 for number, line in enumerate(text.splitlines()) if NOT_RUN.match(line)]


def run(segments: list[dict[str, str]]) -> int:
    namespace: dict[str, object] = {"__name__": "__main__"}
    for segment in segments:
        print(f"--- {segment['where']} ({segment['kind']})", flush=True)
        if segment["kind"] == "python":
            exec(compile(segment["code"], segment["where"], "exec"), namespace)  # noqa: S102 - the docs' own examples
            continue
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", segment["code"]], check=False)
        if done.returncode != 0:
            print(f"{segment['where']}: the shell example exited with {done.returncode}", file=sys.stderr)
            return 1
    return 0


def segments(found: list[Example]) -> list[dict[str, str]]:
    """What :func:`run` takes: the examples that run, as JSON-ready dictionaries."""
    return [{key: value for key, value in asdict(example).items() if key != "not_run"} | {"where": example.where}
            for example in found if example.not_run is None]


if __name__ == "__main__":
    raise SystemExit(run(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
