"""The ``attnscope`` command line, the top floor: each command parses its arguments, calls one public
function of the library and prints (``main.py`` holds the parser and the exit codes; one module per
capability holds its commands; ``outputs.py`` the output folders they write). The library never imports
from here.

>>> from attnscope.cli import main
>>> main(["models", "--json"])     # doctest: +SKIP
"""

from __future__ import annotations

from .command import Command as Command
from .main import COMMANDS as COMMANDS
from .main import EXIT_BROKEN_PIPE as EXIT_BROKEN_PIPE
from .main import EXIT_USER_ERROR as EXIT_USER_ERROR
from .main import all_commands as all_commands
from .main import build_parser as build_parser
from .main import check_utf8 as check_utf8
from .main import error_line as error_line
from .main import main as main
from .model_options import add_compute_arguments as add_compute_arguments
from .model_options import add_model_arguments as add_model_arguments
from .model_options import load_from_args as load_from_args
from .threads import ONE_STREAM_MAX_CORES as ONE_STREAM_MAX_CORES
from .threads import THREADS_VARIABLE as THREADS_VARIABLE
from .threads import apply_threads as apply_threads

__all__ = ["COMMANDS", "EXIT_BROKEN_PIPE", "EXIT_USER_ERROR", "ONE_STREAM_MAX_CORES", "THREADS_VARIABLE", "Command",
           "add_compute_arguments", "add_model_arguments", "all_commands", "apply_threads", "build_parser",
           "check_utf8", "error_line", "load_from_args", "main"]
