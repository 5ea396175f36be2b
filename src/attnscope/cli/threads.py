"""``--threads`` and ``$ATTNSCOPE_THREADS``: how many CPU threads torch may use."""

from __future__ import annotations

import argparse
import os

from ..arguments import check_threads, thread_count
from ..errors import AttnscopeError

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
        check_threads(threads, "threads")  # Python callers too: torch overflows past 64 bits
        import torch

        torch.set_num_threads(threads)
