"""`python -m llminfer.serve` as a real process: it binds 127.0.0.1, answers the openai client, stops cleanly."""
from __future__ import annotations

import openai
import pytest

import llminfer
from llminfer.serve.__main__ import parse_args
from llminfer.serve.process import ServerProcess

pytestmark = pytest.mark.timeout(180)


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of sockets listening on port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":          # 0A: LISTEN
                found.append(address)
    return found


def test_the_module_serves_the_bundled_model_on_loopback_and_stops():
    model, tokenizer = llminfer.load_pretrained("tiny-capitals")
    expected = tokenizer.decode(llminfer.generate(model, tokenizer.encode("The capital of France"), max_new_tokens=8,
                                                  eos_token_id=tokenizer.eos_token_id).token_ids)
    server = ServerProcess(["--model", "tiny-capitals", "--threads", "1", "--num-blocks", "64"])
    with server:
        assert listening_addresses(server.port) == ["0100007F"]          # 127.0.0.1 and nothing else
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
        response = client.completions.create(model="tiny-capitals", prompt="The capital of France", max_tokens=8,
                                             temperature=0)
        assert response.choices[0].text == expected
        assert [m.id for m in client.models.list().data] == ["tiny-capitals"]
    assert server.process.returncode == 0                                 # SIGINT: a graceful exit
    assert "127.0.0.1" in server.log() and listening_addresses(server.port) == []
    assert "KV pool 2.0 MiB = 64 blocks (given)" in server.log()          # the pool's size, said at start


@pytest.mark.parametrize("argv,words", [
    (["--host", "example.com"], "IP address"),
    (["--port", "70000"], "--port"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--default-temperature", "nan"], "--default-temperature"),
    (["--default-temperature", "1e-300"], "--default-temperature"),
    (["--default-temperature", "3"], "--default-temperature"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--num-blocks", "-1"], "--num-blocks"),
    (["--max-request-bytes", "10"], "--max-request-bytes"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--body-timeout", "inf"], "--body-timeout"),
    (["--max-connections", "0"], "--max-connections"),
    (["--port", "-1"], "--port"),
])
def test_bad_command_lines_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert words in capsys.readouterr().err


def test_the_default_host_is_loopback():
    assert parse_args([]).host == "127.0.0.1"


def test_the_servers_kv_pool_is_capped_at_a_small_share_of_free_memory(monkeypatch):
    from llminfer.costs import kv_cache_bytes
    from llminfer.serve.__main__ import SERVE_KV_MEMORY_FRACTION, build_server
    free = 20 << 20
    monkeypatch.setattr("llminfer.engine.llm_engine.free_memory_bytes", lambda device: free)
    engine = build_server(parse_args(["--model", "tiny-capitals", "--max-num-seqs", "64"])).state.server.engine
    per_block = kv_cache_bytes(engine.config, 16, 4)
    assert engine.num_blocks == int(SERVE_KV_MEMORY_FRACTION * free) // per_block < 64 * 128 // 16    # the cap
    assert f"{SERVE_KV_MEMORY_FRACTION:.0%} of the" in engine.pool_sizing
    monkeypatch.setattr("llminfer.engine.llm_engine.free_memory_bytes", lambda device: 1 << 40)
    engine = build_server(parse_args(["--model", "tiny-capitals", "--max-num-seqs", "3"])).state.server.engine
    assert engine.num_blocks == 3 * (128 // 16)                          # no more than max_num_seqs requests need
    engine = build_server(parse_args(["--model", "tiny-capitals", "--kv-cache-memory", "1MiB"])).state.server.engine
    assert engine.num_blocks == 2**20 // per_block and "kv_cache_memory" in engine.pool_sizing
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-memory", "1GiB", "--num-blocks", "8"])


def test_wait_until_healthy_polls_until_200_and_reports_an_exit_or_a_timeout():
    import http.server
    import subprocess
    import sys
    import threading
    import time

    from llminfer.serve.process import LOOPBACK, ServerExited, free_port, wait_until_healthy
    answers = iter([503, 503, 200])                       # unhealthy twice, then healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers, 200) if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer((LOOPBACK, 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        url = f"http://{LOOPBACK}:{httpd.server_address[1]}"
        assert wait_until_healthy(url, alive, timeout_s=30, interval_s=0.01) >= 0
        assert next(answers, "spent") == "spent"           # it asked until the 200, and no more
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer 200 within 0.3 s"):
            wait_until_healthy(f"http://{LOOPBACK}:{free_port()}", alive, timeout_s=0.3, interval_s=0.05)
        assert time.monotonic() - started < 10
        assert alive.poll() is None                        # it stops nothing
    finally:
        alive.kill()
        alive.wait()
        httpd.shutdown()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(ServerExited, match="exited with code 3") as caught:
        wait_until_healthy(f"http://{LOOPBACK}:1", dead, timeout_s=30)
    assert caught.value.returncode == 3 and isinstance(caught.value, RuntimeError)



# --- a child that is never ready: reported with its log, nothing left running ------------------------------------

HELPER = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"started helper {helper.pid}", flush=True)
print("loading weights, slowly", flush=True)
"""


def ended(pid: int, timeout_s: float = 10.0) -> bool:
    """True once pid is no process, or a zombie (dead, waiting to be reaped by its new parent)."""
    import time
    from pathlib import Path
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("ending,error,words", [
    ("raise SystemExit(3)", "ChildNotReady", "exited with code 3 before it was ready"),
    ("time.sleep(120)", "ChildTimedOut", "did not answer /health within 1.5 s"),
])
def test_a_child_that_is_never_ready_is_reported_with_its_log_and_leaves_nothing_behind(ending, error, words):
    import re
    import signal
    import sys

    from llminfer.serve import process
    child = process.ChildProcess([sys.executable, "-c", HELPER + ending], process.free_port(), startup_timeout_s=1.5,
                                 stop_steps=((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)))
    with pytest.raises(getattr(process, error), match=rf"(?s){words}.*loading weights, slowly") as caught:
        child.start()
    assert isinstance(caught.value, RuntimeError)
    assert isinstance(caught.value, TimeoutError) == (error == "ChildTimedOut")
    helper = int(re.search(r"started helper (\d+)", child.log()).group(1))      # the log outlives its file
    assert not child.alive() and ended(child.process.pid)
    assert ended(helper)                                 # what the child started went with it
    assert child.stop() == child.process.returncode     # stopping again changes nothing


def test_a_server_that_cannot_start_says_why():
    server = ServerProcess(["--max-num-seqs", "0"], startup_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"(?s)the server exited with code 2 before it was ready.*--max-num-seqs"):
        server.start()
    assert not server.alive() and "--max-num-seqs" in server.log()
