"""The options of every command that can run on Ray: which engine, which cluster, how many actors."""

from __future__ import annotations

import argparse

from ..arguments import positive_int
from ..corpus.engine_choice import ENGINES, Engine, check_engine_device
from ..corpus.ray_engine import STALL_SECONDS, runtime_env_argument


def add_engine_arguments(parser: argparse.ArgumentParser, runs: str = "the model") -> None:
    """``--engine``, ``--address``, ``--num-actors`` (or ``--workers``), ``--stall-timeout``, ``--runtime-env``,
    ``--verbose`` (every corpus command, and the needle trials of ``head-functions``: ``runs`` says what the actors
    run)."""
    parser.add_argument("--engine", choices=list(ENGINES), default="local",
                        help=f"local: in this process (default); ray: {runs} in an actor pool on a Ray cluster "
                        "(pip install 'attnscope[ray]')")
    parser.add_argument("--address", help="--engine ray: the cluster to join, HOST:PORT of its head ('auto': the one "
                        "'ray start' made on this node; default: a Ray started here)")
    parser.add_argument("--num-actors", "--workers", type=positive_int, metavar="N",
                        help="--engine ray: model replicas, each an actor holding the model (default: one per CPU of "
                        "the cluster)")
    parser.add_argument("--stall-timeout", type=positive_int, default=int(STALL_SECONDS), metavar="SECONDS",
                        help="--engine ray: fail when no batch finishes for this long, e.g. after losing a node "
                        f"whose work cannot be placed again (default: {STALL_SECONDS:.0f})")
    parser.add_argument("--runtime-env", type=runtime_env_argument, metavar="JSON",
                        help="--engine ray: Ray's runtime environment for the workers, a JSON object or a .json file, "
                        "e.g. '{\"env_vars\": {\"HF_HOME\": \"/shared/hf\"}}' so every node finds the model; "
                        "attnscope itself must already be installed on every node")
    parser.add_argument("--verbose", action="store_true", help="--engine ray: also show Ray's own log lines")


def engine_from_args(args: argparse.Namespace) -> Engine:
    """The engine the options name; a device this machine lacks, or any but the CPU on Ray, is refused here."""
    engine = Engine(args.engine, args.address, args.num_actors, float(args.stall_timeout), args.verbose,
                    args.runtime_env)
    check_engine_device(engine.name, args.device)
    return engine
