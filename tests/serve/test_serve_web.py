"""A keyless server on 127.0.0.1 kept from web pages: JSON bodies only, its own Host names only, CORS closed unless
opened; over real HTTP (httpx, raw sockets, the openai client)."""
from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.__main__ import parse_args
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
BODY = {"model": MODEL, "prompt": "The capital of France", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained(MODEL)


def serve(bundled, host: str = "127.0.0.1", **config) -> ServerThread:
    model, tokenizer = bundled
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL, **config),
                         engine=LLMEngine(model, num_blocks=32, max_num_seqs=4))
    return ServerThread(build_app(server=state), host=host)


@pytest.fixture(scope="module")
def keyless(bundled):
    with serve(bundled) as thread:
        yield thread


def raw_request(port: int, request: bytes, family=socket.AF_INET, address: str = "127.0.0.1") -> tuple[int, bytes]:
    """Sends one HTTP/1.1 request over a socket; returns the status and the whole response."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect((address, port))
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def post_request(host: bytes, content_type: bytes | None, body: bytes, path: bytes = b"/v1/completions") -> bytes:
    kind = b"Content-Type: " + content_type + b"\r\n" if content_type is not None else b""
    return (b"POST " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + kind
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("content_type", [None, b"text/plain", b"text/plain;charset=UTF-8",
                                          b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
                                          b"application/xml", b"application/jsonx"])
def test_a_post_body_must_be_sent_as_json(keyless, content_type):
    host = b"127.0.0.1:%d" % keyless.port
    for path in (b"/v1/completions", b"/v1/chat/completions"):
        body = BODY if path == b"/v1/completions" else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, response = raw_request(keyless.port, post_request(host, content_type, json.dumps(body).encode(), path))
        assert status == 415, response
        error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


def test_json_with_a_charset_and_the_openai_client_still_work(keyless):
    host = b"127.0.0.1:%d" % keyless.port
    for kind in (b"application/json", b"application/json; charset=utf-8", b"Application/JSON"):
        status, response = raw_request(keyless.port, post_request(host, kind, json.dumps(BODY).encode()))
        assert status == 200, response
    client = openai.OpenAI(base_url=keyless.url + "/v1", api_key="none", max_retries=0)
    assert client.completions.create(**BODY).choices[0].text


@pytest.mark.parametrize("host", [b"evil.example.com", b"evil.example.com:%d", b"127.0.0.1:1", b"localhost",
                                  b"127.0.0.1.evil.example.com:%d", b""])
def test_a_keyless_server_refuses_hosts_that_do_not_name_it(keyless, host):
    host = host.replace(b"%d", b"%d" % keyless.port)
    for request in (post_request(host, b"application/json", json.dumps(BODY).encode()),
                    b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"):
        status, response = raw_request(keyless.port, request)
        assert status == 421, response
        assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "misdirected_request"


def test_a_keyless_server_answers_the_names_of_its_address(keyless):
    for host in (b"127.0.0.1:%d", b"localhost:%d", b"LOCALHOST:%d", b"[::1]:%d"):
        status, response = raw_request(keyless.port, post_request(host % keyless.port, b"application/json",
                                                                   json.dumps(BODY).encode()))
        assert status == 200, response


def test_two_host_headers_are_refused(keyless):
    request = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nHost: evil.example.com\r\nConnection: close\r\n\r\n"
               % keyless.port)
    assert raw_request(keyless.port, request)[0] in (400, 421)


def test_allowed_hosts_add_names_and_a_key_lifts_the_check(bundled):
    with serve(bundled, allowed_hosts=("myhost.example", "other.example:9")) as thread:
        for host, status in ((b"myhost.example", 200), (b"myhost.example:%d" % thread.port, 200),
                             (b"other.example:9", 200), (b"other.example:10", 421), (b"evil.example.com", 421),
                             (b"127.0.0.1:%d" % thread.port, 200)):
            request = b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
            assert raw_request(thread.port, request)[0] == status, host
    with serve(bundled, api_key="secret") as thread:          # with a key a page cannot use it: any Host is served
        request = (b"GET /v1/models HTTP/1.1\r\nHost: evil.example.com\r\nAuthorization: Bearer secret\r\n"
                   b"Connection: close\r\n\r\n")
        assert raw_request(thread.port, request)[0] == 200


def test_an_ipv6_loopback_server_answers_its_own_names(bundled):
    if not socket.has_ipv6:
        pytest.skip("this machine has no IPv6")
    try:
        thread = serve(bundled, host="::1")
    except OSError:
        pytest.skip("this machine cannot bind ::1")
    with thread:
        for host, status in ((b"[::1]:%d", 200), (b"localhost:%d", 200), (b"evil.example:%d", 421)):
            request = b"GET /health HTTP/1.1\r\nHost: " + host % thread.port + b"\r\nConnection: close\r\n\r\n"
            assert raw_request(thread.port, request, socket.AF_INET6, "::1")[0] == status, host


def test_cors_stays_closed_unless_origins_are_given(keyless, bundled):
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    closed = httpx.options(keyless.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in closed.headers
    read = httpx.post(keyless.url + "/v1/completions", json=BODY, headers={"Origin": "http://evil.example"})
    assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
    with serve(bundled, allowed_origins=("http://app.example",)) as thread:
        opened = httpx.options(thread.url + "/v1/completions", headers={**preflight, "Origin": "http://app.example"})
        assert opened.status_code == 200 and opened.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(thread.url + "/v1/completions", headers=preflight)
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        read = httpx.post(thread.url + "/v1/completions", json=BODY, headers={"Origin": "http://app.example"})
        assert read.status_code == 200 and read.headers["access-control-allow-origin"] == "http://app.example"


def test_the_command_line_takes_hosts_and_origins():
    args = parse_args(["--allowed-hosts", "a.example", "b.example:8000", "--allowed-origins", "https://app.example"])
    assert args.allowed_hosts == ["a.example", "b.example:8000"] and args.allowed_origins == ["https://app.example"]
    assert parse_args([]).allowed_hosts == () and parse_args([]).allowed_origins == ()
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServeConfig(allowed_hosts="a.example")
    with pytest.raises(ValueError, match="allowed_origins"):
        ServeConfig(allowed_origins=("has space",))
