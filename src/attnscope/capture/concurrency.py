"""Run several capture batches at once, each on its own thread with its own share of torch's threads.

On a 2-core machine one forward pass with two intra-op threads waits at every parallel region for
the slower thread, and stalls whenever another process takes one of the cores; two forward passes
with one thread each keep going on their own. Torch ops release the GIL, so the threads overlap.
Measured on MiniLM (300 Brown sentences, batches of 32, the machine of ``benchmarks/extract.py``):
no difference beyond noise (a few percent) on a quiet machine, about 1.9x the throughput (330
against 180 sentences/s) while one other process kept a core busy.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")
OrderedMap = Callable[[Callable[[Item], Result], Iterable[Item]], Iterator[Result]]


@contextmanager
def concurrent_map(workers: int) -> Iterator[OrderedMap]:
    """A ``map`` that runs up to ``workers`` calls at once and returns results in input order.

    Each worker thread gets ``torch.get_num_threads() // workers`` intra-op threads (at least 1)
    and runs every call in a copy of the caller's context, so capture sessions and interventions
    (``ContextVar``s) active around the call apply inside it. numpy's BLAS gets the same share while
    the pool lives (its threads would stall the same way: a 10x slower product measured). With one worker it is the builtin
    ``map``. ``torch.set_num_threads`` in a thread also sets torch's default for threads created
    later, so the caller's count is set back on exit.
    """
    if workers <= 1:
        yield map
        return
    from threadpoolctl import threadpool_limits  # scikit-learn's dependency

    saved = torch.get_num_threads()
    share = max(1, saved // workers)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="attnscope-batch", initializer=torch.set_num_threads,
                              initargs=(share,))
    blas = threadpool_limits(limits=share, user_api="blas")  # numpy's BLAS threads are process-wide

    def ordered_map(function: Callable[[Item], Result], items: Iterable[Item]) -> Iterator[Result]:
        futures = [pool.submit(contextvars.copy_context().run, function, item) for item in items]
        return (future.result() for future in futures)

    try:
        yield ordered_map
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(saved)
        blas.restore_original_limits()


def default_workers(requested: int | None, several_batches: bool) -> int:
    """Batches to run at once: as requested, else 2 when torch has 2+ threads and there is more than one batch."""
    if requested is not None:
        return max(1, requested)
    return 2 if several_batches and torch.get_num_threads() >= 2 else 1
