"""The ``attnscope`` command line: parses arguments, calls one public function, sets the exit code.

Every command is a ``Command`` in ``COMMANDS``; each gets its own ``--help`` with examples.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from ..errors import AttnscopeError
from ..progress import end_progress_lines
from ..version import __version__
from .analysis import COMMANDS as ANALYSIS_COMMANDS
from .attribution import COMMANDS as ATTRIBUTION_COMMANDS
from .capture import COMMANDS as CAPTURE_COMMANDS
from .command import Command
from .corpus import COMMANDS as CORPUS_COMMANDS
from .experiments import COMMANDS as EXPERIMENTS_COMMANDS
from .head_functions import COMMANDS as HEAD_FUNCTIONS_COMMANDS
from .kv_budget import COMMANDS as KV_BUDGET_COMMANDS
from .lab import COMMANDS as LAB_COMMANDS
from .models import COMMANDS as MODELS_COMMANDS
from .present import COMMANDS as PRESENT_COMMANDS
from .probing import COMMANDS as PROBING_COMMANDS
from .sentences import COMMANDS as SENTENCES_COMMANDS
from .serve import COMMANDS as SERVE_COMMANDS
from .threads import apply_threads

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away


# Each module of this package holds its commands as a ``COMMANDS`` tuple; here in the order ``--help`` shows them.
COMMANDS: tuple[Command, ...] = (*CAPTURE_COMMANDS, *MODELS_COMMANDS, *PRESENT_COMMANDS, *ANALYSIS_COMMANDS,
                                 *CORPUS_COMMANDS, *HEAD_FUNCTIONS_COMMANDS, *KV_BUDGET_COMMANDS, *EXPERIMENTS_COMMANDS, *ATTRIBUTION_COMMANDS, *SENTENCES_COMMANDS,
                                 *PROBING_COMMANDS,
                                 *LAB_COMMANDS, *SERVE_COMMANDS)


def all_commands() -> tuple[Command, ...]:
    """Every command, in the order ``--help`` lists them (:data:`COMMANDS`)."""
    return COMMANDS


class _Parser(argparse.ArgumentParser):
    """argparse with attnscope's one error line (and the usage above it), exit code 2."""

    def error(self, message: str):  # type: ignore[no-untyped-def]
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("attnscope").strip()  # "report", "probe deps", or "" at the top
        self.exit(EXIT_USER_ERROR, f"attnscope: error: {command + ': ' if command else ''}{error_line(message)}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with ``only``, just that command gets its options (the others keep
    their name and help line), so ``attnscope --help`` and ``attnscope COMMAND --help`` import nothing
    another command needs (torch included)."""
    parser = _Parser(
        prog="attnscope",
        description="See what a transformer's attention looks at: capture every layer and head offline.",
        epilog="Run 'attnscope COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"attnscope {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in all_commands():
        sub = commands.add_parser(command.name, help=command.help, description=command.help, epilog=command.epilog,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if only is None or command.name == only:
            command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def _command_named(argv: list[str]) -> str:
    """The COMMAND in ``argv`` (the first word that is not an option; the top level's take no values), or ''."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def check_utf8(argv: list[str]) -> None:
    """Refuse an argument that is not valid UTF-8 (Python keeps such bytes as lone surrogates)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise AttnscopeError(f"argument {shown!r} is not valid UTF-8; attnscope reads text and file names "
                                 "as UTF-8") from None


class _Quiet:
    """Warnings as one 'attnscope: warning:' line each, not Python's two-line format."""

    def __enter__(self) -> None:
        self._previous = warnings.showwarning
        warnings.showwarning = lambda message, *rest, **kw: print(f"attnscope: warning: {message}", file=sys.stderr)

    def __exit__(self, *exc: object) -> None:
        warnings.showwarning = self._previous


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_utf8(argv)
        args = build_parser(_command_named(argv)).parse_args(argv)
        apply_threads(getattr(args, "threads", None), one_stream=getattr(args, "one_stream", False))
        with _Quiet():
            return int(args.run(args))
    except AttnscopeError as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        end_progress_lines()
        print("attnscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader stopped early (``attnscope ... | head``): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor a second one at exit's flush
        return EXIT_BROKEN_PIPE
    except ConnectionError as error:  # e.g. a Ray cluster that refuses the connection: not a file's fault
        return _fail(f"cannot connect: {error.strerror or error}")
    except OSError as error:  # a file that passed the early checks but failed on writing (a full disk, /dev/full)
        return _fail(f"{error.filename}: {error.strerror}" if error.filename else f"a file operation failed: {error}")


def _fail(message: str) -> int:
    end_progress_lines()
    print(f"attnscope: error: {error_line(message)}", file=sys.stderr)
    return EXIT_USER_ERROR


# characters: a line past LONG_LINE has echoed an argument back (a 100,000-character text): its words past
# LONG_WORD are cut; past LONGEST_LINE, far beyond any message of ours, the line's middle goes too
LONG_LINE, LONG_WORD, LONGEST_LINE = 300, 80, 1000


def error_line(message: str) -> str:
    """``message`` as it is printed: a huge argument echoed back in it is cut (see :data:`LONG_LINE`)."""
    if len(message) <= LONG_LINE:
        return message
    cut = re.sub(rf"\S{{{LONG_WORD + 1},}}", lambda word: _shortened(word.group(), LONG_WORD), message)
    return cut if len(cut) <= LONGEST_LINE else _shortened(cut, LONGEST_LINE)


def _shortened(text: str, size: int) -> str:
    """``text`` in ``size`` characters: its start and its last few (a closing quote, a file's extension)
    around an ellipsis."""
    tail = size // 4
    return f"{text[:size - tail - 3]}...{text[-tail:]}"

