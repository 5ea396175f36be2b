"""A real two-node Ray cluster on this machine, and a node lost mid-job.

Two ``ray start --block`` nodes (a head and a second node, one CPU each, bound to this machine, their
files in the test's own temporary folder) are started; ``attnscope heads --engine ray --address ...``
runs against them, and the second node's raylet is killed with SIGKILL while the job runs. The job must
either finish with every (input, layer, head) once and the local engine's report, or fail with one
line naming the node it lost, leaving no report; always within a bounded time. The nodes and their
workers are stopped, and the folder removed, whatever happens.

Reference: the local engine's CLI run on the same corpus and batch size (stdout findings, and every row, bit for
bit: both engines batch every input alike).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).with_name("ray")
N_SENTENCES = 160
JOB_TIMEOUT = 420  # seconds: the whole heads run on the cluster, kill and recovery included
START_TIMEOUT = 120  # seconds for a node to start
BATCH_SIZE = "2"  # windows of 32 inputs: five, over both nodes
MARKER = "ATTNSCOPE_TEST_CLUSTER"  # in every process of the cluster's environment, so cleanup finds each one
ACTOR_TITLE = b"HeadsWorker"

pytestmark = [pytest.mark.skipif(not RAY.exists(), reason="needs Ray's `ray` command beside this Python"),
              pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds processes in /proc (Linux)")]


def free_ports(n: int) -> list[int]:
    """``n`` different ports free now (held open together, so none is handed out twice)."""
    probes = [socket.socket() for _ in range(n)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    return free_ports(1)[0]


def cluster_env(folder: Path) -> dict[str, str]:
    """This checkout's sources first on every node; quick node-death detection; no token in ~/.ray."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            MARKER: str(folder), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3"}


class Cluster:
    """Ray nodes started by this test, each ``ray start --block`` in its own process group."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = cluster_env(folder)
        self.ports = iter(free_ports(20))  # the head's port and every component's on both nodes
        self.port = next(self.ports)
        self.nodes: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_node(self, head: bool) -> subprocess.Popen[bytes]:
        ports = [option for name in ("node-manager", "object-manager", "metrics-export", "runtime-env-agent",
                                     "dashboard-agent-grpc", "dashboard-agent-listen", "min-worker")
                 for option in (f"--{name}-port", str(next(self.ports)))]
        role = (["--head", "--port", str(self.port), "--temp-dir", str(self.folder / "ray"), "--include-dashboard",
                 "false"] if head else ["--address", self.address])
        log = self.folder / f"node{len(self.nodes)}.log"
        with log.open("wb") as out:
            node = subprocess.Popen([str(RAY), "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
                                     "--disable-usage-stats", "--max-worker-port", "0", *ports, *role],
                                    env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes.append(node)
        deadline = time.monotonic() + START_TIMEOUT
        while b"Ray runtime started" not in log.read_bytes():
            if node.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"a Ray node did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        return node

    def processes(self) -> list[int]:
        """Every live process of this cluster (its environment carries the marker), this process aside."""
        pids = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"{MARKER}={self.folder}".encode() in environ.read_bytes().split(b"\0"):
                    pids.append(int(environ.parent.name))
            except OSError:  # ended meanwhile, or not ours
                continue
        return [pid for pid in pids if pid != os.getpid()]

    def raylet_of(self, node: subprocess.Popen[bytes]) -> int:
        """The pid of ``node``'s raylet (a process of its group named raylet)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                name = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
            except (OSError, IndexError):
                continue
            if name == "raylet" and int(fields[2]) == node.pid:  # fields[2]: the process group
                return int(stat.parent.name)
        raise AssertionError("the second node has no raylet")

    def stop(self) -> None:
        """SIGTERM each node's group, SIGKILL what is left (and workers that left the group) after a grace."""
        for node in self.nodes:
            _signal_group(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(node.poll() is None for node in self.nodes):
            time.sleep(0.2)
        for node in self.nodes:
            _signal_group(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def cluster():
    folder = Path(tempfile.mkdtemp(prefix="ac"))  # short: Ray's socket paths must stay under 108 bytes
    nodes = Cluster(folder)
    try:
        nodes.start_node(head=True)
        nodes.start_node(head=False)
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(folder, ignore_errors=True)


def heads(corpus: Path, out: Path, *options: str, env: dict[str, str] | None = None,
          timeout: float = JOB_TIMEOUT) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "attnscope", "heads", str(corpus), "-o", str(out), "--batch-size", BATCH_SIZE,
               *options]
    return subprocess.Popen(command, env=env or cluster_env(out.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=out.parent)


def findings(stdout: str) -> list[str]:
    """The report's summary lines (stable heads, findings), without timings and paths."""
    return [line for line in stdout.splitlines() if line.startswith(("stable heads", "  "))]


def second_node_actor(cluster: Cluster, raylet: int) -> int | None:
    """The pid of an actor of the job on the second node (a child of its raylet), if one runs."""
    for pid in cluster.processes():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == raylet and ACTOR_TITLE in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except (OSError, IndexError):
            continue
    return None


def environment_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def head_stats(database: Path) -> pd.DataFrame:
    from attnscope.analysis.store import HeadStore

    with HeadStore(database) as store:
        return store.query("SELECT * FROM head_stats ORDER BY input_id, layer, head")


def test_a_node_killed_mid_job_leaves_exactly_once_rows_and_the_same_report_or_one_clear_line(cluster, tmp_path):
    from attnscope.analysis.store import HeadStore
    from attnscope.data import brown_sentences

    corpus = cluster.folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in brown_sentences(N_SENTENCES)))
    out = cluster.folder / "out"
    job_variable = f"ATTNSCOPE_TEST_JOB={cluster.folder}"  # given by --runtime-env: it must reach the actors
    job = heads(corpus, out, "--engine", "ray", "--address", cluster.address, "--num-actors", "2",
                "--stall-timeout", "150", "--runtime-env", json.dumps({"env_vars": dict([job_variable.split("=")])}))
    start = time.monotonic()
    try:
        raylet = cluster.raylet_of(cluster.nodes[1])
        while not ((out / "parquet" / "head_stats").is_dir() and any((out / "parquet" / "head_stats").iterdir())
                   and (actor := second_node_actor(cluster, raylet))):
            assert job.poll() is None, f"the job ended before the node was killed:\n{job.stderr.read()[-3000:]}"
            assert time.monotonic() - start < JOB_TIMEOUT, "the job never got under way on both nodes"
            time.sleep(0.2)
        assert job_variable.encode() in environment_of(actor), "the runtime environment did not reach the actor"
        os.kill(raylet, signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=JOB_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    local_out = tmp_path / "local"
    local = subprocess.run([sys.executable, "-m", "attnscope", "heads", str(corpus), "-o", str(local_out), "--batch-size",
                            BATCH_SIZE], check=False, env=cluster_env(tmp_path), capture_output=True, text=True,
                           timeout=JOB_TIMEOUT)
    assert local.returncode == 0, local.stderr
    lines = [line for line in stderr.replace("\r", "\n").splitlines()
             if line.strip() and not line.startswith("analysing heads (ray)")]  # the progress bar
    if job.returncode != 0:  # failed: one line that names the lost node, and nothing reported as complete
        # exactly one lost node, by the address Ray reports for it: the --node-ip-address it started with (127.0.0.1),
        # or, seen on one machine, the host's own address (192.0.2.2)
        assert len(lines) == 1 and re.search(r"after losing node [0-9.]+ \(node id [0-9a-f]{12}\):", lines[0]), \
            stderr[-3000:]
        assert not (out / "report.html").exists() and not (out / "heads.duckdb").exists()
        return
    assert not lines, f"Ray's own lines on stderr:\n{stderr}"
    with HeadStore(out / "heads.duckdb") as store:
        counts = store.query("SELECT input_id, layer, head, count(*) AS n FROM head_stats GROUP BY ALL")
        ids = store.query("SELECT input_id FROM inputs ORDER BY input_id")["input_id"].tolist()
    assert len(counts) == N_SENTENCES * 72 and (counts["n"] == 1).all() and ids == list(range(N_SENTENCES))
    assert findings(stdout) == findings(local.stdout) and findings(stdout)
    pd.testing.assert_frame_equal(head_stats(out / "heads.duckdb"), head_stats(local_out / "heads.duckdb"),
                                  check_exact=True)


def test_an_address_where_no_cluster_listens_fails_with_one_line(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\n")
    job = heads(corpus, tmp_path / "out", "--engine", "ray", "--address", f"127.0.0.1:{free_port()}")
    try:
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
        job.wait()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert job.returncode != 0 and len(lines) == 1, stderr[-3000:]
    assert "cannot connect to the Ray cluster at 127.0.0.1" in lines[0] and "connection refused" in lines[0]
