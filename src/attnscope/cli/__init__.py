"""The ``attnscope`` command line (``main.py``)."""

from .main import *  # noqa: F403
from .main import COMMAND_MODULES, COMMANDS, THREADS_VARIABLE, _command_named, all_commands, error_line  # noqa: F401
