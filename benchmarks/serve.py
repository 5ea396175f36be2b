"""Latency and throughput of the explorer's main analysis endpoint under concurrent load.

Run from the repository root (``make bench-serve`` runs the default)::

    .venv/bin/python benchmarks/serve.py                    # 200 requests at concurrency 8
    .venv/bin/python benchmarks/serve.py --requests 40      # a quick look

What it does, in one run:

1. starts ``attnscope serve --model minilm`` on a free loopback port as a separate process, as a
   user would, and waits until ``GET /api/models`` answers;
2. builds the inputs: real English from the shipped Brown sample, adjacent sentences joined until
   the text is 32-64 tokens long for the default model's tokenizer (cycled if fewer than asked);
3. sends 8 untimed warm-up requests, then ``--requests`` ``POST /api/analyze`` requests, exactly as
   the page sends them (views payload with queries and keys, patterns, statistics), from
   ``--concurrency`` client threads over loopback; a request counts as an error unless it
   answers 200 with a JSON body that holds a payload;
4. stops the server.

Latency is wall-clock time from sending a request to having read its whole answer, so it includes
the time a request waits for the model: the server computes one request per model at a time (see
``attnscope.serve.pool``), and with 8 clients each request queues behind the others. Throughput is
requests answered per second of the timed phase.

The last line printed is one JSON object: ``requests``, ``concurrency``, ``errors``, ``p50_ms``,
``p95_ms``, ``throughput_per_s`` and, for reading them, ``p95_over_p50``, ``tokens_min``,
``tokens_max``, ``mean_answer_kb``, ``load_average_1min``. Targets: errors = 0, p95 < 5 x p50.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from bench_json import add_smoke_flag, emit

MIN_TOKENS, MAX_TOKENS = 32, 64


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(port: int) -> subprocess.Popen[str]:
    """``attnscope serve`` in its own process; returns once it answers (or raises with its output)."""
    process = subprocess.Popen([sys.executable, "-m", "attnscope", "serve", "--model", "minilm", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/models", timeout=5).read()
            return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the server did not start:\n{process.stdout.read() if process.stdout else ''}")
            time.sleep(0.5)


def build_inputs(count: int) -> list[tuple[str, int]]:
    """Texts of 32-64 tokens (default model's tokenizer) made of adjacent Brown sentences: (text, tokens)."""
    from transformers import AutoTokenizer

    from attnscope.data import brown_sentences
    from attnscope.models.loading import resolve_source

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_source("minilm")))
    texts: list[tuple[str, int]] = []
    current: list[str] = []
    for sentence in brown_sentences(2000):
        current.append(sentence)
        length = len(tokenizer(" ".join(current))["input_ids"])
        if length > MAX_TOKENS:
            current = [sentence] if len(tokenizer(sentence)["input_ids"]) <= MAX_TOKENS else []
        elif length >= MIN_TOKENS:
            texts.append((" ".join(current), length))
            current = []
        if len(texts) == count:
            break
    return [texts[i % len(texts)] for i in range(count)]


def analyze(address: str, text: str) -> tuple[float, bool, int]:
    """One request as the page sends it: (seconds, ok, answer bytes)."""
    body = json.dumps({"model": "minilm", "text": text, "pair": None}).encode()
    request = urllib.request.Request(f"{address}/api/analyze", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = response.read()
            ok = response.status == 200 and "payload" in json.loads(answer)
    except (urllib.error.URLError, OSError, ValueError):
        return time.perf_counter() - start, False, 0
    return time.perf_counter() - start, ok, len(answer)


def run_load(address: str, texts: list[str], concurrency: int) -> tuple[float, list[tuple[float, bool, int]]]:
    """Send every text from ``concurrency`` threads; (wall seconds, per-request results)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda text: analyze(address, text), texts))
    return time.perf_counter() - start, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="timed requests (default: 200)")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads (default: 8)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency = 4, 2

    inputs = build_inputs(args.requests)
    tokens = [length for _, length in inputs]
    log(f"{len(inputs)} inputs of {min(tokens)}-{max(tokens)} tokens; starting the server")
    port = free_port()
    server = start_server(port)
    address = f"http://127.0.0.1:{port}"
    try:
        run_load(address, [text for text, _ in inputs[: args.concurrency]], args.concurrency)  # warm-up
        log(f"sending {len(inputs)} requests at concurrency {args.concurrency}")
        wall, results = run_load(address, [text for text, _ in inputs], args.concurrency)
    finally:
        server.terminate()
        server.wait(timeout=30)
    latencies = np.array([seconds for seconds, _, _ in results]) * 1000
    ok = [result for result in results if result[1]]
    p50, p95 = np.percentile(latencies, [50, 95])
    figures: dict[str, Any] = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "errors": len(results) - len(ok),
        "p50_ms": round(float(p50), 1),
        "p95_ms": round(float(p95), 1),
        "throughput_per_s": round(len(results) / wall, 2),
        "p95_over_p50": round(float(p95 / p50), 3),
        "tokens_min": min(tokens),
        "tokens_max": max(tokens),
        "mean_answer_kb": round(float(np.mean([size for _, _, size in ok])) / 1024, 1) if ok else None,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    log(f"p50 {figures['p50_ms']} ms, p95 {figures['p95_ms']} ms, {figures['throughput_per_s']} requests/s, "
        f"{figures['errors']} errors (targets: errors = 0, p95 < 5 x p50)")
    emit("serve", figures)
    return 1 if args.smoke and figures["errors"] else 0  # a smoke run checks the server answers


if __name__ == "__main__":
    sys.exit(main())
