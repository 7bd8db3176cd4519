"""The OpenAI-compatible server, spoken to over real HTTP on 127.0.0.1 with the official openai client."""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.server import IncrementalText, OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
PROMPTS = ["The capital of France", "The capital of Japan", "I love", "What is the capital of Peru?",
           "The sky is", "The capital of Spain", "The capital of Kenya", "The capital of Chile"]


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    return model, tokenizer


def reference(bundled, text: str, max_tokens: int = 16) -> tuple[str, int]:
    """llminfer.generate's greedy text for a prompt, and how many tokens it made (eos included)."""
    model, tokenizer = bundled
    result = llminfer.generate(model, tokenizer.encode(text), max_new_tokens=max_tokens,
                               eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(result.token_ids), len(result.token_ids)


def make_server(bundled, **config) -> tuple[ServerThread, OpenAIServer]:
    model, tokenizer = bundled
    engine_kwargs = dict(num_blocks=160, max_num_seqs=16, max_num_batched_tokens=512)
    engine_kwargs.update(config.pop("engine_kwargs", {}))
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL, **config),
                         engine=LLMEngine(model, **engine_kwargs))
    return ServerThread(build_app(server=state), drain_timeout_s=config.get("drain_timeout_s", 5.0)), state


@pytest.fixture(scope="module")
def server(bundled):
    thread, state = make_server(bundled)
    with thread:
        yield thread, state


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="none", max_retries=0, timeout=60)


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


class slow_steps:
    """Within the block, every engine step takes at least `seconds` longer: a heavier model, for timing-bound tests."""

    def __init__(self, state: OpenAIServer, seconds: float = 0.01):
        self.engine, self.seconds = state.engine, seconds

    def __enter__(self):
        original = type(self.engine).step

        def step(engine_self=self.engine):
            time.sleep(self.seconds)
            return original(engine_self)
        self.engine.step = step
        return self

    def __exit__(self, *exc):
        del self.engine.step


def pool_is_empty(state: OpenAIServer) -> bool:
    stats = state.loop.stats
    return stats.blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


# --- the same text as llminfer.generate ---------------------------------------------------------------------

@pytest.mark.parametrize("text", PROMPTS[:5])
def test_greedy_completion_equals_generate(bundled, client, text):
    expected, n_tokens = reference(bundled, text)
    response = client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == n_tokens
    assert response.usage.prompt_tokens == len(bundled[1].encode(text))

    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == n_tokens


def test_token_id_prompts_and_length_limit(bundled, client):
    model, tokenizer = bundled
    ids = tokenizer.encode("The capital of Japan")
    full, n_tokens = reference(bundled, "The capital of Japan")
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 2
    assert full.startswith(response.choices[0].text) and response.choices[0].text != full
    # several prompts in one request: one choice each, in order
    response = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=16, temperature=0)
    assert [c.text for c in response.choices] == [reference(bundled, p)[0] for p in PROMPTS[:3]]
    assert [c.index for c in response.choices] == [0, 1, 2]


def test_chat_uses_the_plain_template_and_streams(bundled, client):
    expected, _ = reference(bundled, "The capital of Spain")
    messages = [{"role": "user", "content": "The capital of Spain"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_strings_cut_the_text(bundled, client):
    expected, _ = reference(bundled, "The capital of France")           # ' is Paris.'
    assert "Paris" in expected
    cut = expected[:expected.index("Paris")]
    response = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=16,
                                         temperature=0, stop=["Paris"])
    assert response.choices[0].text == cut and response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=16,
                                         temperature=0, stop="Paris", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_incremental_text_holds_back_split_characters_and_stop_prefixes(bundled):
    tokenizer = bundled[1]
    text = "The capital of Côte d'Ivoire is Yamoussoukro."
    ids = tokenizer.encode(text)
    pieces = IncrementalText(tokenizer)
    deltas = [pieces.add([i]) for i in ids]
    assert "".join(deltas) + pieces.add([], final=True) == text
    assert all("\ufffd" not in d for d in deltas)                        # a split 'ô' is never sent half
    stopper = IncrementalText(tokenizer, stop=["is Yam"])
    sent = "".join(stopper.add([i]) for i in ids)
    assert sent == text[:text.index("is Yam")] and stopper.stopped


def test_models_health_and_seeded_sampling(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server[0].url + "/health").status_code == 200
    a = client.completions.create(model=MODEL, prompt="The", max_tokens=12, temperature=1.0, seed=7)
    b = client.completions.create(model=MODEL, prompt="The", max_tokens=12, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


# --- concurrency, disconnects, the pool -----------------------------------------------------------------

def test_32_concurrent_streams_complete_and_free_the_pool(bundled, server):
    thread, state = server
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    expected = {p: reference(bundled, p)[0] for p in set(prompts)}
    steps_before = state.loop.stats.steps

    async def main():
        client = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def one(prompt):
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream])
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert texts == [expected[p] for p in prompts]
    assert wait_until(lambda: pool_is_empty(state))
    state.engine.block_manager.check_consistency([])        # ref counts all zero, every block in the free queue
    # they were batched: far fewer engine steps than 32 requests one after another would take
    assert state.loop.stats.steps - steps_before < 32 * 3


def test_client_disconnect_mid_stream_frees_blocks_within_one_step(bundled, server):
    thread, state = server
    finished_before = state.metrics.requests.labels("length")._value.get()
    aborts_before = len(state.loop.abort_log)
    with slow_steps(state), httpx.Client(timeout=30) as http:
        with http.stream("POST", thread.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "I love", "max_tokens": 120, "temperature": 0,
                               "stream": True, "ignore_eos": True}) as response:
            lines = response.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert len(received) >= 3
            assert state.loop.stats.blocks_used > 0                      # the request holds KV blocks now
        # leaving the block closes the connection mid-stream
    assert wait_until(lambda: len(state.loop.abort_log) > aborts_before), "the disconnect was never noticed"
    record = state.loop.abort_log[-1]
    assert record.was_running
    assert record.done_at_step - record.requested_at_step <= 1
    assert record.blocks_used_after == 0
    assert wait_until(lambda: pool_is_empty(state))
    assert state.metrics.requests.labels("length")._value.get() == finished_before   # it never ran to the end


def test_client_timeout_on_a_plain_request_aborts_it(server):
    thread, state = server
    aborts_before = len(state.loop.abort_log)
    with slow_steps(state), pytest.raises(httpx.ReadTimeout):
        httpx.post(thread.url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL, "prompt": "I love", "max_tokens": 120, "temperature": 0,
                         "ignore_eos": True})
    assert wait_until(lambda: len(state.loop.abort_log) > aborts_before), "the disconnect was never noticed"
    assert state.loop.abort_log[-1].blocks_used_after == 0
    assert wait_until(lambda: pool_is_empty(state))


# --- bad requests ---------------------------------------------------------------------------------------

BAD = [
    # (name, body or raw bytes, status, param, words in the message)
    ("invalid json", b'{"model": "tiny-capitals", "prompt": ', 400, None, "JSON"),
    ("not an object", b'["tiny-capitals"]', 400, None, "object"),
    ("unknown field", {"prompt": "hi", "colour": "red"}, 400, "colour", "Unrecognized"),
    ("max_tokens beyond context", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", "context length"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", "0 to 2"),
    ("NaN temperature", b'{"model": "tiny-capitals", "prompt": "hi", "temperature": NaN}', 400, "temperature",
     "nan"),
    ("temperature above 2", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "0 to 2"),
    ("empty prompt", {"prompt": ""}, 400, "prompt", "empty"),
    ("empty token list", {"prompt": []}, 400, "prompt", "empty"),
    ("token outside vocabulary", {"prompt": [5, 4096]}, 400, "prompt", "vocabulary"),
    ("missing prompt", {}, 400, "prompt", "Missing"),
    ("n above one", {"prompt": "hi", "n": 3}, 400, "n", "n=1"),
    ("top_p zero", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("unknown model", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("name,body,status,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests(server, name, body, status, param, words):
    thread, state = server
    steps = state.loop.stats.steps
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body}).encode()
    response = httpx.post(thread.url + "/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    assert state.loop.stats.steps == steps                    # refused before the engine ran anything


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format"),
])
def test_bad_chat_requests(server, body, param):
    response = httpx.post(server[0].url + "/v1/chat/completions", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    assert caught.value.status_code == 400 and "temperature" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=4)


def test_a_full_queue_is_refused_with_429(bundled):
    thread, state = make_server(bundled, max_queued_requests=2, engine_kwargs=dict(max_num_seqs=1))
    body = {"model": MODEL, "prompt": "I love", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            async def one():                      # a stream answers 200 as soon as the engine has the request
                response = await http.send(http.build_request("POST", thread.url + "/v1/completions", json=body),
                                           stream=True)
                if response.status_code != 200:
                    await response.aread()
                return response
            responses = await asyncio.gather(*(one() for _ in range(8)))
            for response in responses:            # hang up: the accepted ones are aborted
                await response.aclose()
            return responses

    with thread, slow_steps(state):
        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        refused = [r for r in responses if r.status_code == 429]
        assert refused and 200 in codes and set(codes) <= {200, 429}
        assert codes.count(200) <= 1 + 2                      # one running, two queued
        assert refused[0].json()["error"]["code"] == "queue_full"
        assert refused[0].headers["Retry-After"] == "1"
        assert wait_until(lambda: pool_is_empty(state))


# --- metrics --------------------------------------------------------------------------------------------

def scrape(url: str) -> dict:
    """{(name, labels): value} of every sample at /metrics, parsed as Prometheus text."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_as_prometheus_text_and_move(bundled, client, server):
    before = scrape(server[0].url)
    for name in ("llminfer_num_requests_waiting", "llminfer_num_requests_running", "llminfer_kv_blocks_used",
                 "llminfer_prefix_cache_hit_rate", "llminfer_kv_cache_usage_ratio"):
        assert (name, ()) in before, name
    texts = ["The capital of France", "The capital of France", "The sky is"]
    made = 0
    for text in texts:
        made += client.completions.create(model=MODEL, prompt=text, max_tokens=16, temperature=0).usage.completion_tokens
    after = scrape(server[0].url)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("llminfer_generation_tokens_total") == made
    assert moved("llminfer_requests_total", (("finish_reason", "stop"),)) == 3
    assert moved("llminfer_time_to_first_token_seconds_count") == 3
    assert moved("llminfer_inter_token_latency_seconds_count") == made - 3
    assert moved("llminfer_prompt_tokens_total") == sum(len(bundled[1].encode(t)) for t in texts)
    assert moved("llminfer_engine_steps_total") >= max(3, made / 3)
    assert moved("llminfer_prefix_cache_queries_total") > 0
    assert after[("llminfer_num_requests_running", ())] == 0
    httpx.post(server[0].url + "/v1/completions", json={"model": MODEL, "prompt": ""})
    assert moved("llminfer_requests_rejected_total", (("reason", "invalid"),)) == 0
    assert scrape(server[0].url)[("llminfer_requests_rejected_total", (("reason", "invalid"),))] == \
        after[("llminfer_requests_rejected_total", (("reason", "invalid"),))] + 1


# --- shutdown -------------------------------------------------------------------------------------------

def _stream_text(url: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    try:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url + "/v1/completions",
                             json={"model": MODEL, "prompt": "I love", "max_tokens": max_tokens, "temperature": 0,
                                   "stream": True, "ignore_eos": True}) as response:
                chunks = []
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        started.set()
                    elif line == "data: [DONE]":
                        out["done"] = True
                out["chunks"] = chunks
    except httpx.HTTPError as exc:
        out["error"] = exc
    finally:
        started.set()


def test_shutdown_drains_in_flight_requests(bundled):
    thread, state = make_server(bundled, drain_timeout_s=20.0)
    thread.start()
    started, out = threading.Event(), {}
    client_thread = threading.Thread(target=_stream_text, args=(thread.url, 40, started, out))
    client_thread.start()
    assert started.wait(30)
    thread.stop()                                              # while the stream is running
    client_thread.join(30)
    assert out.get("done"), out
    assert len(out["chunks"]) == 40 and out["chunks"][-1]["choices"][0]["finish_reason"] == "length"
    assert state.loop.state == "stopped" and pool_is_empty(state)
    with pytest.raises(httpx.ConnectError):
        httpx.get(thread.url + "/health", timeout=2)


def test_shutdown_past_the_drain_timeout_ends_streams_cleanly(bundled):
    thread, state = make_server(bundled, drain_timeout_s=0.0)
    slow_steps(state, 0.02).__enter__()                       # 120 tokens take > 2.4 s: past uvicorn's 1 s
    thread.start()
    started, out = threading.Event(), {}
    client_thread = threading.Thread(target=_stream_text, args=(thread.url, 120, started, out))
    client_thread.start()
    assert started.wait(30)
    t0 = time.monotonic()
    thread.stop()
    client_thread.join(30)
    assert not client_thread.is_alive() and time.monotonic() - t0 < 20
    assert len(out.get("chunks", [])) < 120                   # cut short, not run to the end
    assert state.loop.state == "stopped" and pool_is_empty(state)
    assert not state.engine.has_unfinished()


def test_metrics_poller_records_series(server):
    from llminfer.serve.metrics import MetricsPoller, parse_metrics
    with MetricsPoller(server[0].url, interval_s=0.02) as poller:          # waits for 3 scrapes, not for a time
        assert wait_until(lambda: len(poller.series("llminfer_engine_steps_total")[0]) >= 3, timeout_s=30)
    times, steps = poller.series("llminfer_engine_steps_total")
    assert len(times) >= 3 and times == sorted(times) and poller.errors == 0
    assert steps[0] == parse_metrics(httpx.get(server[0].url + "/metrics").text)["llminfer_engine_steps_total"]
    with pytest.raises(ValueError):
        MetricsPoller(server[0].url, interval_s=0)
