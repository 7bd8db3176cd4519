"""A server one request cannot take down: faults, limits, types, keys and errors, over real HTTP on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

import llminfer
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.engine import model_runner as model_runner_module
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
GOOD = ["The capital of France", "The capital of Japan", "The capital of Spain", "The capital of Chile"]
POISON = "The capital of Peru"


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained(MODEL)


def reference(bundled, text: str, max_tokens: int = 16) -> str:
    """llminfer.generate's greedy text for a prompt."""
    model, tokenizer = bundled
    result = llminfer.generate(model, tokenizer.encode(text), max_new_tokens=max_tokens,
                               eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(result.token_ids)


def make_server(bundled, engine_kwargs=None, **config) -> tuple[ServerThread, OpenAIServer]:
    model, tokenizer = bundled
    kwargs = dict(num_blocks=160, max_num_seqs=16, max_num_batched_tokens=512)
    kwargs.update(engine_kwargs or {})
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL, **config), engine=LLMEngine(model, **kwargs))
    return ServerThread(build_app(server=state), drain_timeout_s=2.0), state


@pytest.fixture(scope="module")
def server(bundled):
    thread, state = make_server(bundled)
    with thread:
        yield thread, state


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def assert_clean_error(response: httpx.Response, status: int) -> dict:
    """The response is an OpenAI error body with this status, carrying no traceback and no file path."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and ".py" not in response.text and "/work" not in response.text
    return body["error"]


# --- 1. one request's fault fails that request alone -----------------------------------------------------

class poisoned:
    """Within the block, any engine step that holds a request with `prompt_ids` raises (a fault in its step),
    and sampling at top_k=13 raises (a fault in its sampling); every step is slowed a little so streams overlap."""

    def __init__(self, state: OpenAIServer, prompt_ids: list[int]):
        self.runner, self.prompt_ids = state.engine.runner, list(prompt_ids)

    def __enter__(self):
        original, poison = self.runner.execute, self.prompt_ids
        real_sample = model_runner_module.sample

        def execute(metadata):
            time.sleep(0.01)
            if any(seq.prompt_token_ids == poison for seq in metadata.seqs):
                raise RuntimeError("injected fault in /some/secret/path.py")
            return original(metadata)

        def sample(logits, params, *args, **kwargs):
            if any(p.top_k == 13 for p in params):
                raise FloatingPointError("injected sampling fault in /some/secret/path.py")
            return real_sample(logits, params, *args, **kwargs)

        self.runner.execute = execute
        model_runner_module.sample = sample
        self._real_sample = real_sample
        return self

    def __exit__(self, *exc):
        del self.runner.execute
        model_runner_module.sample = self._real_sample


def test_a_fault_in_one_requests_step_fails_it_alone_while_others_stream(bundled, server):
    thread, state = server
    expected = {p: reference(bundled, p) for p in GOOD}
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)
    errors_before = state.metrics.requests.labels("error")._value.get()
    texts: dict[str, str] = {}
    started = threading.Barrier(len(GOOD) + 1)

    def stream(prompt):
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        started.wait()
        texts[prompt] = "".join(c.choices[0].text for c in chunks)

    with poisoned(state, bundled[1].encode(POISON)):
        workers = [threading.Thread(target=stream, args=(p,)) for p in GOOD]
        for w in workers:
            w.start()
        started.wait()                               # every good stream is open
        plain = httpx.post(thread.url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": POISON, "max_tokens": 16, "temperature": 0})
        sampled = httpx.post(thread.url + "/v1/completions", timeout=60,
                             json={"model": MODEL, "prompt": "I love", "max_tokens": 8, "temperature": 0.7,
                                   "top_k": 13})
        with pytest.raises(openai.APIError) as streamed:
            for _ in client.completions.create(model=MODEL, prompt=POISON, max_tokens=16, temperature=0,
                                               stream=True):
                pass
        for w in workers:
            w.join(60)
    for response in (plain, sampled):
        error = assert_clean_error(response, 500)
        assert error["type"] == "server_error" and "secret" not in error["message"]
    assert "secret" not in str(streamed.value) and "Traceback" not in str(streamed.value)
    assert texts == expected                         # the others streamed to their correct end
    assert httpx.get(thread.url + "/health").status_code == 200
    assert state.loop.state == "running"
    again = client.completions.create(model=MODEL, prompt=POISON, max_tokens=16, temperature=0)
    assert again.choices[0].text == reference(bundled, POISON)
    assert state.metrics.requests.labels("error")._value.get() == errors_before + 3
    assert wait_until(lambda: state.loop.stats.blocks_used == 0)
    state.engine.block_manager.check_consistency([])


SEEDED = [dict(temperature=1.0, seed=42), dict(temperature=0.8, seed=7, top_p=0.9), dict(temperature=0),
          dict(temperature=1.2, seed=1234, extra_body={"top_k": 20})]


def test_a_failed_batch_step_leaves_seeded_samples_as_they_are_alone(bundled, server):
    """A request whose sampling fails in a batch, after the rows before it drew from their generators, leaves
    every other request's tokens as they are when it runs alone: greedy and seeded, through the openai client."""
    thread, state = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def complete(options):
        options = dict(options)
        extra = {"ignore_eos": True, **options.pop("extra_body", {})}
        return client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=24,
                                         extra_body=extra, **options).choices[0].text

    alone = [complete(options) for options in SEEDED]
    assert len(set(alone)) > 1                           # the seeds draw different texts
    batch_sizes: list[int] = []
    with poisoned(state, [-1]) as fault:                 # sampling at top_k=13 raises; steps are slowed
        poisoned_execute = fault.runner.execute

        def execute(metadata):
            if any(seq.params.top_k == 13 for seq in metadata.seqs):
                batch_sizes.append(metadata.num_seqs)
            return poisoned_execute(metadata)

        fault.runner.execute = execute
        for _ in range(3):
            texts: dict[int, str] = {}
            workers = [threading.Thread(target=lambda i=i: texts.__setitem__(i, complete(SEEDED[i])))
                       for i in range(len(SEEDED))]
            for w in workers:
                w.start()
            time.sleep(0.05)                             # the good requests first in the batch, then the bad
            bad = httpx.post(thread.url + "/v1/completions", timeout=60,
                             json={"model": MODEL, "prompt": "I love", "max_tokens": 8, "temperature": 1.0,
                                   "seed": 3, "top_k": 13})
            for w in workers:
                w.join(60)
            assert_clean_error(bad, 500)
            assert [texts[i] for i in range(len(SEEDED))] == alone
    assert max(batch_sizes) > 1                          # the fault happened inside a batch
    assert wait_until(lambda: state.loop.stats.blocks_used == 0)


def test_the_engine_fails_one_request_and_finishes_the_rest(bundled):
    model, tokenizer = bundled
    engine = LLMEngine(model, num_blocks=64)
    poison = tokenizer.encode(POISON)
    original = engine.runner.execute

    def execute(metadata):
        if any(seq.prompt_token_ids == poison for seq in metadata.seqs):
            raise RuntimeError("injected")
        return original(metadata)

    engine.runner.execute = execute
    params = SamplingParams(max_new_tokens=16, eos_token_id=tokenizer.eos_token_id)
    outputs = engine.generate([tokenizer.encode(GOOD[0]), poison, tokenizer.encode(GOOD[1])], params)
    assert [o.finish_reason for o in outputs] == ["stop", "error", "stop"]
    assert outputs[1].error == "RuntimeError: injected" and outputs[1].token_ids == []
    assert [tokenizer.decode(o.token_ids) for o in (outputs[0], outputs[2])] == [reference(bundled, GOOD[0]),
                                                                                reference(bundled, GOOD[1])]
    assert engine.stats.blocks_used == 0
    engine.block_manager.check_consistency([])


def test_a_step_that_raises_fails_the_requests_in_it_and_the_loop_goes_on(bundled, server):
    thread, state = server
    engine, calls = state.engine, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a scheduler bug at /some/secret/path.py")
        return type(engine).step(engine)

    engine.step = step
    try:
        failed = httpx.post(thread.url + "/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": GOOD[0], "max_tokens": 8, "temperature": 0})
    finally:
        del engine.step
    error = assert_clean_error(failed, 500)
    assert "secret" not in error["message"] and "RuntimeError" in error["message"]
    assert httpx.get(thread.url + "/health").status_code == 200
    ok = httpx.post(thread.url + "/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": GOOD[0], "max_tokens": 16, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == reference(bundled, GOOD[0])


# --- 4. strict types ----------------------------------------------------------------------------------------

LAX = [  # (field, value): each is the wrong type for its field
    ("max_tokens", "8"), ("max_tokens", True), ("max_tokens", 2.0), ("temperature", True), ("temperature", "0.5"),
    ("top_k", "3"), ("top_k", 3.0), ("stream", "yes"), ("stream", 1), ("seed", "7"), ("seed", 7.5),
    ("top_p", False), ("ignore_eos", "true"), ("prompt", [True, False]), ("prompt", 5), ("stop", 3),
]


@pytest.mark.parametrize("field,value", LAX, ids=[f"{f}={v!r}" for f, v in LAX])
def test_wrong_types_are_refused_naming_the_field(server, field, value):
    thread, state = server
    steps = state.loop.stats.steps
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    error = assert_clean_error(httpx.post(thread.url + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == field or error["param"].startswith(field + "."), error
    assert repr(value) in error["message"] or field in error["message"]
    assert state.loop.stats.steps == steps                        # refused before the engine saw it


def test_wrong_types_in_chat_messages_are_refused(server):
    thread, _ = server
    for messages, param in (([{"role": "user", "content": 5}], "messages.0.content"),
                            ([{"role": True, "content": "hi"}], "messages.0.role")):
        response = httpx.post(thread.url + "/v1/chat/completions", timeout=30,
                              json={"model": MODEL, "messages": messages})
        assert assert_clean_error(response, 400)["param"] == param


def test_integer_valued_numbers_still_work(server):
    thread, _ = server
    response = httpx.post(thread.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1})
    assert response.status_code == 200, response.text


def test_library_options_are_strict(bundled):
    from llminfer.quant import quantize
    model, _ = bundled
    for kwargs, words in ((dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
                          (dict(chunked_prefill=1), "chunked_prefill must be True or False"),
                          (dict(kv_memory_fraction=True), "kv_memory_fraction")):
        with pytest.raises(ValueError, match=words):
            LLMEngine(model, num_blocks=64, **kwargs)
    weight = model.layers[0].attention.wq.weight.clone() if hasattr(model.layers[0], "attention") else None
    with pytest.raises(ValueError, match="include_head must be True or False, got 'no'"):
        quantize(model, "int8", include_head="no")
    with pytest.raises(ValueError, match=r"group_size=32\.0 is not supported"):
        quantize(model, "int4", group_size=32.0)
    assert not getattr(model, "quantization", None)               # refused before any layer changed
    if weight is not None:
        assert model.layers[0].attention.wq.weight.equal(weight)


# --- 5. OpenAI-style errors everywhere ----------------------------------------------------------------------

def post_raw(url: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30)


def test_malformed_nested_and_badly_encoded_bodies_get_400(server):
    thread, _ = server
    deep = b'{"model": "tiny-capitals", "prompt": "hi", "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = {"model": MODEL, "prompt": "hi", "metadata": None}
    inner: dict = {}
    nested["response_format"] = inner
    for _ in range(40):
        inner["x"] = {}
        inner = inner["x"]
    cases = [
        (b'{"model": "tiny-capitals", "prompt": ', "parse"),
        (deep, "arrays and objects"),                # refused by its count of lists before it is parsed
        (json.dumps(nested).encode(), "nests deeper"),
        (b'{"model": "tiny-capitals", "prompt": "\\ud800 lone"}', "not valid Unicode"),
        (b'{"model": "tiny-capitals", "prompt": "\xff\xfe bad bytes"}', "parse"),
        (b'{"model": "tiny-capitals", "\\udc80": 1}', "not valid Unicode"),
    ]
    for raw, words in cases:
        error = assert_clean_error(post_raw(thread.url, raw), 400)
        assert words in error["message"], error
    chat = httpx.post(thread.url + "/v1/chat/completions", timeout=30, headers={"Content-Type": "application/json"},
                      content=b'{"model": "tiny-capitals", "messages": [{"role": "user", "content": "\\ud83d"}]}')
    assert assert_clean_error(chat, 400)["param"] == "messages.0.content"
    assert httpx.get(thread.url + "/health").status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(server):
    thread, _ = server
    assert assert_clean_error(httpx.get(thread.url + "/v1/nothing"), 404)["code"] == "not_found"
    assert assert_clean_error(httpx.post(thread.url + "/v2/completions", json={}), 404)["code"] == "not_found"
    assert assert_clean_error(httpx.get(thread.url + "/v1/completions"), 405)["code"] == "method_not_allowed"


def test_get_one_model_by_id(server):
    thread, state = server
    client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=30)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert assert_clean_error(httpx.get(thread.url + "/v1/models/gpt-9"), 404)["code"] == "model_not_found"


# --- 2. limits ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tight(bundled):
    """A server with small limits: 8 KiB bodies, 0.5 s for headers, 1 s for a body, 1 s idle, 4 connections."""
    thread, state = make_server(bundled, max_request_bytes=8192, header_timeout_s=0.5, body_timeout_s=1.0,
                                keep_alive_timeout_s=1.0, max_connections=4, max_queued_requests=4)
    with thread:
        yield thread, state


def test_a_body_over_the_limit_gets_413(tight):
    thread, state = tight
    big = {"model": MODEL, "prompt": "x" * 10_000, "max_tokens": 2}
    assert assert_clean_error(httpx.post(thread.url + "/v1/completions", json=big, timeout=30), 413)["code"] == \
        "request_too_large"

    def chunks():                         # no Content-Length: the limit is found while reading
        yield b'{"model": "tiny-capitals", "prompt": "hi", "user": "'
        for _ in range(20):
            yield b"y" * 1000
        yield b'"}'
    response = httpx.post(thread.url + "/v1/completions", content=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert_clean_error(response, 413)
    assert httpx.get(thread.url + "/health").status_code == 200


def test_a_declared_body_over_the_limit_is_refused_from_its_headers(tight):
    """Content-Length above the limit: the 413 comes from the headers alone, before one byte of the body is sent
    (the app never reads it), and the body the client then sends is dropped unparsed until the connection closes."""
    thread, _ = tight
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n")
    for declared in (8193, 10_000_000, 10**15):                 # just over, over the old drain, absurd
        with socket.create_connection((thread.host, thread.port)) as sock:
            sock.sendall(head % (thread.port, declared))
            sock.settimeout(5.0)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_too_large" and "8192" in error["message"], error
            assert b"connection: close" in answer.lower()
            try:
                sock.sendall(b"x" * min(declared, 200_000))     # the body arrives anyway: dropped, not parsed
            except OSError:
                pass
            assert closed_within(sock, 5.0)
    assert httpx.get(thread.url + "/health").status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server, monkeypatch):
    thread, state = server
    calls = []
    encode = state.tokenizer.encode
    monkeypatch.setattr(state.tokenizer, "encode", lambda *a, **k: calls.append(threading.current_thread().name)
                        or encode(*a, **k))
    text = "a" * (state.max_prompt_chars + 1)
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": text}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]})):
        error = assert_clean_error(httpx.post(thread.url + path, json=body, timeout=30), 400)
        assert error["code"] == "context_length_exceeded" and str(state.max_prompt_chars) in error["message"]
    assert calls == []                    # never tokenized
    ok = httpx.post(thread.url + "/v1/completions", json={"model": MODEL, "prompt": GOOD[0], "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200
    assert calls and all(name != "llminfer-http" for name in calls)      # tokenized off the event loop's thread
    model, tokenizer = llminfer.load_pretrained(MODEL)
    longest = max(len(t) for t in tokenizer.backend.get_vocab(with_added_tokens=True))
    assert state.max_prompt_chars == 2 * state.max_model_len * longest


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes the connection (recv gives b'' or a reset) within seconds."""
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_headers_slow_bodies_and_idle_connections_are_closed(tight):
    thread, _ = tight
    host = f"127.0.0.1:{thread.port}".encode()
    with socket.create_connection((thread.host, thread.port)) as slow_headers:
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\n" % host)       # and never the rest
        assert closed_within(slow_headers, 5.0)
    with socket.create_connection((thread.host, thread.port)) as dripping:
        dripping.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(4):                                     # a header byte every 0.25 s: slower than 0.5 s total
            time.sleep(0.25)
            try:
                dripping.sendall(b"X")
            except OSError:
                break
        assert closed_within(dripping, 5.0)
    with socket.create_connection((thread.host, thread.port)) as slow_body:
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\"" % host)
        assert closed_within(slow_body, 6.0)
    with socket.create_connection((thread.host, thread.port)) as idle:
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: %s\r\n\r\n" % host)
        idle.settimeout(5.0)
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_within(idle, 5.0)                        # keep-alive, then idle past 1 s
    assert httpx.get(thread.url + "/health").status_code == 200


def test_connections_beyond_the_limit_get_503(tight):
    thread, _ = tight
    host = f"127.0.0.1:{thread.port}".encode()
    held = [socket.create_connection((thread.host, thread.port)) for _ in range(4)]
    try:
        time.sleep(0.1)
        with socket.create_connection((thread.host, thread.port)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: %s\r\n\r\n" % host)
            extra.settimeout(5.0)
            assert extra.recv(65536).startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: httpx.get(thread.url + "/health").status_code == 200)


def test_more_prompts_than_the_queue_holds_is_400_not_429(tight):
    thread, state = tight
    response = httpx.post(thread.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": ["hi"] * 5, "max_tokens": 2})
    error = assert_clean_error(response, 400)
    assert error["code"] == "too_many_prompts" and "at most 4" in error["message"]
    ok = httpx.post(thread.url + "/v1/completions", timeout=30,
                    json={"model": MODEL, "prompt": ["hi"] * 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


# --- 3. API keys --------------------------------------------------------------------------------------------

def test_an_api_key_guards_every_v1_route_and_leaves_health_open(bundled):
    thread, state = make_server(bundled, api_key="sk-test-123")
    with thread:
        url = thread.url
        good = openai.OpenAI(base_url=url + "/v1", api_key="sk-test-123", max_retries=0, timeout=30)
        bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        assert good.completions.create(model=MODEL, prompt=GOOD[0], max_tokens=16, temperature=0).choices[0].text \
            == reference(bundled, GOOD[0])
        assert good.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt=GOOD[0], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        for path in ("/v1/models", "/v1/models/" + MODEL, "/v1/anything"):
            error = assert_clean_error(httpx.get(url + path), 401)
            assert error["code"] == "invalid_api_key"
        assert_clean_error(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                                      headers={"Authorization": "Bearer sk-test-1234"}), 401)
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        assert state.metrics.rejected.labels("unauthorized")._value.get() >= 7
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig(api_key="")


def test_the_prefill_cap_is_a_checked_server_option(capsys):
    from llminfer.serve.__main__ import SERVE_MAX_PREFILL_TOKENS, parse_args
    assert parse_args([]).max_prefill_tokens == SERVE_MAX_PREFILL_TOKENS
    assert parse_args(["--max-prefill-tokens", "0"]).max_prefill_tokens == 0          # 0: no cap
    with pytest.raises(SystemExit):
        parse_args(["--max-prefill-tokens", "-1"])
    assert "--max-prefill-tokens must be >= 0, got -1" in capsys.readouterr().err


def test_a_network_host_needs_a_key_or_an_explicit_opt_out(monkeypatch, capsys):
    from llminfer.serve.__main__ import parse_args
    monkeypatch.delenv("LLMINFER_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--host", "0.0.0.0"])
    assert "--allow-unauthenticated" in capsys.readouterr().err
    assert parse_args(["--host", "0.0.0.0", "--api-key", "k"]).api_key == "k"
    assert parse_args(["--host", "0.0.0.0", "--allow-unauthenticated"]).api_key is None
    assert parse_args(["--host", "127.0.0.2"]).api_key is None                 # loopback needs no key
    monkeypatch.setenv("LLMINFER_API_KEY", "from-env")
    assert parse_args(["--host", "0.0.0.0"]).api_key == "from-env"
    with pytest.raises(SystemExit):
        parse_args(["--api-key", " "])


# --- 8. smaller fixes ---------------------------------------------------------------------------------------

def test_aborts_are_counted_in_metrics(server):
    thread, state = server
    aborts = state.metrics.requests.labels("abort")._value.get()
    runner = state.engine.runner
    original = runner.execute
    runner.execute = lambda metadata: (time.sleep(0.01), original(metadata))[1]
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", thread.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "I love", "max_tokens": 100, "temperature": 0,
                                   "stream": True, "ignore_eos": True}) as response:
                lines = response.iter_lines()
                assert sum(1 for line, _ in zip(lines, range(4)) if line.startswith("data:")) >= 2
        assert wait_until(lambda: state.metrics.requests.labels("abort")._value.get() == aborts + 1)
    finally:
        del runner.execute
    text = httpx.get(thread.url + "/metrics").text
    assert f'llminfer_requests_total{{finish_reason="abort"}} {aborts + 1:.1f}' in text


@pytest.mark.parametrize("changes,words", [
    (dict(default_temperature=float("nan")), "default_temperature"),
    (dict(default_temperature=1e-300), "default_temperature"),
    (dict(default_temperature=5.0), "default_temperature must lie in 0..2"),
    (dict(max_queued_requests=0), "max_queued_requests must be an integer >= 1"),
    (dict(max_request_bytes=2.5e6), "max_request_bytes must be an integer"),
    (dict(header_timeout_s=0), "header_timeout_s must be a finite number"),
    (dict(body_timeout_s=float("inf")), "body_timeout_s"),
    (dict(max_connections=True), "max_connections must be an integer"),
    (dict(add_bos="yes"), "add_bos must be True or False"),
])
def test_server_options_are_checked_when_made(changes, words):
    with pytest.raises(ValueError, match=words):
        ServeConfig(**changes)
