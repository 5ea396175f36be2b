"""The options of every command that loads a model (``--model``, ``--dtype``, ``--device``, ``--threads``)."""

from __future__ import annotations

import argparse

from ..arguments import MAX_THREADS, thread_count
from ..models.registry import ALIASES, DEFAULT_MODEL
from .threads import ONE_STREAM_MAX_CORES, THREADS_VARIABLE


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


def load_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model named by ``--model``/``--dtype``/``--device``."""
    from ..capture.loading import load_model

    return load_model(args.model, dtype=args.dtype, device=args.device)
