"""HTTP details over raw sockets on 127.0.0.1: the header limit however the bytes arrive (431), one Authorization,
Host and length per request, HEAD on the read-only routes, Transfer-Encoding with Content-Length refused, and
--max-connections N serving N connections."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.limits import MAX_HEADER_BYTES
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
BODY = json.dumps({"model": MODEL, "prompt": "The capital of France", "max_tokens": 2, "temperature": 0}).encode()


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained(MODEL)


def serve(bundled, **config) -> ServerThread:
    model, tokenizer = bundled
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL, **config),
                         engine=LLMEngine(model, num_blocks=32, max_num_seqs=4))
    return ServerThread(build_app(server=state))


@pytest.fixture(scope="module")
def server(bundled):
    with serve(bundled) as thread:
        yield thread


def exchange(port: int, *pieces: bytes, pause_s: float = 0.0) -> tuple[int, bytes]:
    """Sends the pieces (pause_s apart) on one connection; returns the status and all the server sent."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        try:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(pause_s)
        except (BrokenPipeError, ConnectionResetError):      # the server answered and closed before the rest
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return int(data.split(b" ", 2)[1]), data


def request(port: int, headers: bytes = b"", method: bytes = b"GET", path: bytes = b"/health",
            body: bytes = b"") -> bytes:
    length = b"Content-Length: %d\r\nContent-Type: application/json\r\n" % len(body) if body else b""
    return (method + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port + length + headers
            + b"Connection: close\r\n\r\n" + body)


def filler(size: int) -> bytes:
    """Header lines of about size bytes."""
    line = b"X-Filler: " + b"a" * 990 + b"\r\n"
    return line * (size // len(line) + 1)


@pytest.mark.parametrize("size", [100_000, 250_000])
@pytest.mark.parametrize("reads", [1, 2, 8])
def test_headers_over_the_limit_get_431_however_they_arrive(server, size, reads):
    whole = request(server.port, filler(size))
    step = -(-len(whole) // reads)
    status, data = exchange(server.port, *[whole[i:i + step] for i in range(0, len(whole), step)], pause_s=0.02)
    assert status == 431, data[:200]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def test_headers_under_the_limit_are_served(server):
    status, data = exchange(server.port, request(server.port, filler(MAX_HEADER_BYTES - 4000), b"POST",
                                                 b"/v1/completions", BODY))
    assert status == 200, data[:300]
    # and a keep-alive connection's second request is counted afresh
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(30)
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s\r\n" % (server.port, filler(40_000)))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_second_authorization_header_is_refused(bundled):
    with serve(bundled, api_key="secret") as thread:
        good = b"Authorization: Bearer secret\r\n"
        assert exchange(thread.port, request(thread.port, good, path=b"/v1/models"))[0] == 200
        for twice in (good + b"Authorization: Bearer wrong\r\n", b"Authorization: Bearer wrong\r\n" + good,
                      good + good):
            status, data = exchange(thread.port, request(thread.port, twice, path=b"/v1/models"))
            assert status == 400 and b"authorization" in data, data


def test_two_lengths_or_a_length_beside_chunked_are_refused(server):
    port = server.port
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\nConnection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
               % (port, len(BODY), BODY))
    status, data = exchange(port, chunked)
    assert status == 400 and b"Transfer-Encoding" in data, data
    alone = chunked.replace(b"Content-Length: 5\r\n", b"")
    assert exchange(port, alone)[0] == 200                          # chunked on its own is fine
    assert exchange(port, request(port, b"Content-Type: text/plain\r\n", b"POST", b"/v1/completions", BODY))[0] == 400


@pytest.mark.parametrize("path", [b"/health", b"/v1/models", b"/v1/models/tiny-capitals"])
def test_head_is_answered_on_the_read_only_routes(server, path):
    status, data = exchange(server.port, request(server.port, method=b"HEAD", path=path))
    assert status == 200 and data.endswith(b"\r\n\r\n"), data            # headers, no body
    assert httpx.head(server.url + path.decode()).status_code == 200


def test_max_connections_n_serves_n(bundled):
    with serve(bundled, max_connections=4) as thread:
        held = [socket.create_connection(("127.0.0.1", thread.port)) for _ in range(3)]
        try:
            time.sleep(0.1)
            assert exchange(thread.port, request(thread.port))[0] == 200          # the 4th
            held.append(socket.create_connection(("127.0.0.1", thread.port)))
            time.sleep(0.1)
            assert exchange(thread.port, request(thread.port))[0] == 503          # the 5th
        finally:
            for sock in held:
                sock.close()
