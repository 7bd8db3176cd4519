"""A body's values counted while it streams in (`jsonscan.BodyScanner`): the same counts however the body is cut, a
refusal only where the parse would refuse too, and over raw sockets on 127.0.0.1 a 400 answered before the rest of
a body past a limit is even sent, that body then dropped unread and never parsed."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.jsonscan import BodyScanner, TooMany
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
LIMITS = dict(max_containers=100, max_values=1000, max_prompts=4, max_prompt_chars=50)


def scan(body: bytes, size: int, **limits):
    """(containers, values, prompts, last field) of body fed in pieces of size bytes, or the TooMany it raised."""
    scanner = BodyScanner(**{**LIMITS, **limits})
    try:
        for start in range(0, len(body), size):
            scanner.feed(body[start:start + size])
    except TooMany as exc:
        return exc.what, exc.count, exc.field
    return scanner.containers, scanner.values, scanner.prompts, scanner.field


def containers(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(containers(v) for v in value.values())
    return 1 + sum(containers(v) for v in value) if isinstance(value, list) else 0


TRICKY = [   # brackets, commas, quotes, colons, escapes, field names and multi-byte text inside strings are text
    {"model": 'm", "prompt": [[[', "prompt": ["[[{,,", '\\"]', "é" * 20], "stop": ["\\", '"']},
    {"user": "prompt", "prompt": [[1, 2], [3]], "metadata": {"prompt": "x" * 60}},
    {"prompt": "\u2028 😀 \\u0041", "max_tokens": 3},
    {"messages": [{"role": "user", "content": "[" * 200}], "prompt": []},
]


@pytest.mark.parametrize("body", TRICKY, ids=range(len(TRICKY)))
@pytest.mark.parametrize("ascii_only", [True, False])
def test_the_counts_do_not_depend_on_how_the_body_is_cut(body, ascii_only):
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    counts = {scan(raw, size) for size in (1, 2, 3, 5, 7, 64, len(raw))}
    assert len(counts) == 1, counts
    found, values, prompts, _ = counts.pop()
    assert found == containers(body) and values == raw.count(b",") - _string_commas(body)
    prompt = body.get("prompt")
    assert prompts == (1 if isinstance(prompt, str) else len(prompt or []))


def _string_commas(value) -> int:
    """Commas inside the strings of a JSON value (the scanner counts only those outside)."""
    if isinstance(value, str):
        return value.count(",")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return sum(_string_commas(k) + _string_commas(v) for k, v in items)


def test_a_limit_is_passed_by_one_not_before():
    many = dict(max_prompts=1000)
    for body, what, field, limits in [
            ({"prompt": [[5]] * 98}, None, None, many),            # 100 with the outer list and the object
            ({"prompt": [[5]] * 99}, "containers", "prompt", many),
            ({"model": "m", "stop": [1] * 999}, None, None, {}),
            ({"model": "m", "stop": [1] * 1000}, "values", "stop", {}),
            ({"prompt": ["a"] * 4}, None, None, {}), ({"prompt": ["a"] * 5}, "prompts", "prompt", {}),
            ({"prompt": [[1]] * 4}, None, None, {}), ({"prompt": [[1]] * 5}, "prompts", "prompt", {}),
            ({"prompt": "x" * 50}, None, None, {}), ({"prompt": "x" * 51}, "prompt_chars", "the prompt", {}),
            ({"prompt": ["hi", "é" * 51]}, "prompt_chars", "prompt[1]", {}),
            ({"suffix": "x" * 500}, None, None, {})]:                  # only the prompt's length is counted
        for size in (1, 3, 4096):
            got = scan(json.dumps(body, ensure_ascii=False).encode(), size, **limits)
            assert ((got[0], got[2]) == (what, field)) if what else isinstance(got[0], int), (body, size, got)


def test_a_prompt_is_never_counted_longer_than_it_is():
    """Escapes and multi-byte characters make more bytes than characters: the count stays a lower bound."""
    for text in ["é" * 50, "😀" * 50, "\n" * 50, "\\" * 50, "😀" * 25 + "a" * 25, '"' * 50, "\u0000" * 50]:
        for ascii_only in (True, False):
            raw = json.dumps({"prompt": text}, ensure_ascii=ascii_only).encode()
            assert all(isinstance(scan(raw, size)[0], int) for size in (1, 2, 5, 6, 4096)), (text, ascii_only)


# --- over HTTP ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL),
                         engine=LLMEngine(model, num_blocks=64, max_num_seqs=8))
    with ServerThread(build_app(server=state)) as thread:
        yield thread, state


@pytest.fixture
def parses(server, monkeypatch):
    """Every body the server parses or tokenizes while the test runs."""
    _, state = server
    seen = []
    parse, encode = state.parse_body, state.tokenizer.encode
    monkeypatch.setattr(state, "parse_body", lambda raw, *a, **k: seen.append("parse") or parse(raw, *a, **k))
    monkeypatch.setattr(state.tokenizer, "encode", lambda *a, **k: seen.append("encode") or encode(*a, **k))
    return seen


def head(thread, size: int, chunked: bool = False) -> bytes:
    length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
    return (b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n%s\r\n\r\n"
            % (thread.host.encode(), thread.port, length))


def response_of(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, JSON error, lower-cased headers) of the response on sock."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, data
        data += more
    headers, body = data.split(b"\r\n\r\n", 1)
    headers = headers.lower()
    length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        more = sock.recv(65536)
        assert more, body
        body += more
    return int(headers.split()[1]), json.loads(body)["error"], headers


@pytest.mark.parametrize("kind", ["many values", "long prompt"])
def test_a_body_past_a_limit_is_answered_before_the_rest_is_sent_and_dropped_unread(server, parses, kind):
    thread, state = server
    prompt = [[5]] * 800_000 if kind == "many values" else "x" * 4_000_000
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8}).encode()
    with socket.create_connection((thread.host, thread.port), timeout=30) as sock:
        sock.sendall(head(thread, len(body)) + body[:65536])     # the first 64 KiB of a 4 MB body, then wait
        status, error, headers = response_of(sock)
        assert status == 400 and b"connection: close" in headers
        if kind == "many values":
            assert error["code"] == "too_many_values" and error["param"] == "prompt"
            assert str(state.max_json_containers) in error["message"] and "send fewer" in error["message"]
        else:
            assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
            assert "the prompt has at least" in error["message"] and str(state.max_prompt_chars) in error["message"]
        sock.sendall(body[65536:])                               # the rest is read and dropped, then the server closes
        assert sock.recv(65536) == b""
    assert parses == []                                           # never joined into one body, parsed or tokenized
    ok = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France",
                                                          "max_tokens": 4, "temperature": 0}, timeout=60)
    assert ok.status_code == 200


def test_a_chunked_body_past_a_limit_is_refused_by_the_app(server, parses):
    """Without a declared length the protocol cannot drop the rest by counting: the app refuses it, uvicorn reads
    the rest of the chunks, and the connection stays usable."""
    thread, _ = server
    body = json.dumps({"model": MODEL, "prompt": [[5]] * 20_000}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 8192]), body[i:i + 8192]) for i in range(0, len(body), 8192))
    with socket.create_connection((thread.host, thread.port), timeout=30) as sock:
        sock.sendall(head(thread, 0, chunked=True) + chunks + b"0\r\n\r\n")
        status, error, _ = response_of(sock)
        assert status == 400 and error["code"] == "too_many_values"
    assert parses == []


def test_bodies_within_the_limits_still_parse_once(server, parses):
    thread, state = server
    prompts = ["[{\\\"," * 10, "é" * 40]
    response = httpx.post(thread.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompts, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2
    assert parses.count("parse") == 1
