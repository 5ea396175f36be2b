"""What keeps other web pages and oversized requests away from the explorer (serve/guard.py):
the Host check against DNS rebinding, model-running endpoints that take only JSON POSTs (so a
cross-site <img> or <form> cannot run a model), the body size limit enforced before the body is
read, and the security headers on every answer. Sizes and streaming are checked on a real
uvicorn server through raw sockets, since a test client always sends the whole body."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest

fastapi_testclient = pytest.importorskip("fastapi.testclient")
uvicorn = pytest.importorskip("uvicorn")
from attnscope.serve.app import create_app
from attnscope.serve.guard import MAX_BODY_BYTES, AllowedHosts

from .test_cli import assert_one_line_error, run

LOCAL = "http://127.0.0.1:8765"


@pytest.fixture
def app(minilm, tiny_model_dir):
    """A fresh explorer offering minilm (loaded) and a tiny BERT (not loaded yet)."""
    return create_app([str(tiny_model_dir("bert"))], loaded=[minilm], installed_aliases=False, preload=False)


@pytest.fixture
def client(app):
    return fastapi_testclient.TestClient(app, base_url=LOCAL, raise_server_exceptions=False)


def unloaded_model(app) -> str:
    pool = app.state.pool
    name = next(name for name in pool.choices if not pool.loaded(name))
    return name


def one_line_detail(response, status: int, *fragments: str) -> str:
    assert response.status_code == status, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and all(f in detail for f in fragments), detail
    return detail


# ---- Host ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8765", "127.0.0.1.attacker.example:8765",
                                  "localhost:9999", "127.0.0.1", "localhost.:8765", "user@localhost:8765",
                                  "localhost:8765/x", ""])
def test_a_host_the_server_does_not_listen_as_gets_400(client, host):
    response = client.get("/api/models", headers={"host": host})
    one_line_detail(response, 400, "does not answer as host", "--allow-host")
    assert client.get("/", headers={"host": host}).status_code == 400, "the page is refused too"


@pytest.mark.parametrize("host", ["127.0.0.1:8765", "localhost:8765", "LocalHost:8765", "[::1]:8765"])
def test_the_loopback_names_on_the_servers_port_are_answered(client, host):
    assert client.get("/api/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_by_listening_address():
    local = AllowedHosts.listening_on("127.0.0.1")
    assert local.allows("localhost:8765", 8765) and local.allows("[::1]:8765", 8765)
    assert not local.allows("localhost:8766", 8765) and not local.allows("10.0.0.7:8765", 8765)
    assert not local.allows("attacker.example:8765", 8765)
    named = AllowedHosts.listening_on("192.168.1.20", ["box.lan", "proxy.example:443"])
    assert named.allows("192.168.1.20:8765", 8765) and named.allows("box.lan:8765", 8765)
    assert named.allows("proxy.example:443", 8765) and not named.allows("proxy.example:8765", 8765)
    assert not named.allows("192.168.1.21:8765", 8765)
    everywhere = AllowedHosts.listening_on("0.0.0.0")
    assert everywhere.allows("10.0.0.7:8765", 8765) and everywhere.allows("[fe80::1]:8765", 8765)
    assert everywhere.allows(f"{socket.gethostname()}:8765", 8765)
    assert not everywhere.allows("attacker.example:8765", 8765), "a name could be rebound: only IPs are free"
    assert not everywhere.allows("10.0.0.7:1234", 8765)


# ---- model-running endpoints take only JSON POSTs --------------------------------------------
def test_no_get_and_no_cross_site_post_loads_or_runs_a_model(client, app):
    name = unloaded_model(app)
    image = client.get("/api/record", params={"model": name, "text": "hi"})  # what an <img src=...> sends
    assert image.status_code == 405
    body = json.dumps({"model": name, "text": "hi"})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        for path in ("/api/record", "/api/analyze", "/api/intervene"):
            headers = {"content-type": content_type} if content_type else {}
            response = client.post(path, content=body, headers=headers)
            one_line_detail(response, 415, "Content-Type: application/json")
    assert client.post("/api/models", content=b"{}", headers={"content-type": "text/plain"}).status_code == 405
    assert not app.state.pool.loaded(name), "a request a cross-site page can send loaded the model"
    assert client.post("/api/record", json={"model": name, "text": "hi"}).status_code == 200
    assert app.state.pool.loaded(name), "the JSON POST a script sends loads it"


# ---- headers -------------------------------------------------------------------------------
def test_every_api_answer_says_nosniff_and_forbids_running_anything(client):
    answers = [client.get("/api/models"), client.post("/api/analyze", json={"text": ""}),
               client.post("/api/analyze", json={"text": "hi", "model": "nope"}), client.get("/static/nothing.js"),
               client.get("/api/models", headers={"host": "attacker.example"}),
               client.post("/api/analyze", content=b"{}", headers={"content-type": "text/plain"}),
               client.post("/api/analyze", json={"text": "x" * (MAX_BODY_BYTES + 1)}), client.get("/openapi.json")]
    assert [a.status_code for a in answers] == [200, 422, 404, 404, 400, 415, 413, 200]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff"
        policy = answer.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "script-src" not in policy
    page = client.get("/")
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in page.headers["content-security-policy"], "the page keeps its own policy"


# ---- body size, on a real server -------------------------------------------------------------
@contextmanager
def serving(app) -> Iterator[int]:
    """``app`` served by uvicorn in a thread on a free loopback port, as `attnscope serve` does; the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def live(minilm):
    """The port of the explorer (minilm) served in a thread."""
    with serving(create_app(loaded=[minilm])) as port:
        yield port


def exchange(port: int, head: str, parts: Iterable[bytes], timeout: float = 10.0) -> tuple[int, dict, float]:
    """Send ``head`` (request line and headers) and the body ``parts`` on one connection without
    ending it, then read the answer: (status, JSON body, seconds from the last byte sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for part in parts:
            connection.sendall(part)
        sent = time.monotonic()
        answer = http.client.HTTPResponse(connection)
        try:
            answer.begin()
        except TimeoutError:
            pytest.fail(f"no answer within {timeout} s: the server is waiting for the rest of the body")
        return answer.status, json.loads(answer.read()), time.monotonic() - sent


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_declared_100_mb_body_is_refused_before_it_is_read(live):
    head = (f"POST /api/analyze HTTP/1.1\nHost: 127.0.0.1:{live}\nContent-Type: application/json\n"
            f"Content-Length: {100_000_000}\n")
    status, body, seconds = exchange(live, head, [b'{"text": "'])  # 10 bytes of the 100 MB
    assert status == 413 and body["detail"] == f"the request body is larger than {MAX_BODY_BYTES:,} bytes"
    assert seconds < 2


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(live):
    head = f"POST /api/analyze HTTP/1.1\nHost: 127.0.0.1:{live}\nContent-Type: application/json\nTransfer-Encoding: chunked\n"
    block = b" " * 65536
    parts = [chunk(b'{"text": "hi"')] + [chunk(block)] * (MAX_BODY_BYTES // len(block) + 1)  # never ended
    status, body, seconds = exchange(live, head, parts)
    assert status == 413 and "larger than" in body["detail"] and seconds < 2


def test_a_chunked_body_within_the_limit_is_served(live):
    head = f"POST /api/analyze HTTP/1.1\nHost: 127.0.0.1:{live}\nContent-Type: application/json\nTransfer-Encoding: chunked\n"
    status, body, _ = exchange(live, head, [chunk(b'{"text": '), chunk(b'"The cat sat."'), chunk(b"}"), b"0\r\n\r\n"])
    assert status == 200 and body["tokens"] == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]


def test_a_real_server_checks_the_host_against_its_own_port(live):
    for host, status in ((f"127.0.0.1:{live}", 200), (f"localhost:{live}", 200), (f"attacker.example:{live}", 400),
                         (f"localhost:{live + 1}", 400)):
        connection = http.client.HTTPConnection("127.0.0.1", live, timeout=10)
        connection.request("GET", "/api/models", headers={"Host": host})
        assert connection.getresponse().status == status, host
        connection.close()


# ---- the command ---------------------------------------------------------------------------
def test_serve_on_every_address_answers_by_ip_and_host_name_but_not_other_names():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "attnscope", "serve", "--model", "minilm", "--host", "0.0.0.0",
                                "--port", str(port), "--allow-host", "explorer.lan"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses = {}
        deadline = time.monotonic() + 120
        for host in ("localhost", "127.0.0.1", "10.1.2.3", socket.gethostname(), "explorer.lan", "attacker.example"):
            while True:
                try:
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                    connection.request("GET", "/api/models", headers={"Host": f"{host}:{port}"})
                    statuses[host] = connection.getresponse().status
                    connection.close()
                    break
                except OSError:
                    assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
                    time.sleep(0.5)
        assert statuses == {"localhost": 200, "127.0.0.1": 200, "10.1.2.3": 200, socket.gethostname(): 200,
                            "explorer.lan": 200, "attacker.example": 400}
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert f"http://localhost:{port}/" in output and "any IP address" in output and "explorer.lan" in output


def test_serve_rejects_a_bad_allow_host_in_one_line():
    assert_one_line_error(run("serve", "--allow-host", "a b"), "--allow-host takes a host name")
