"""``python -m attnscope.cli``, as ``python -m attnscope`` and the ``attnscope`` script."""

import sys

from .main import main

sys.exit(main())
