"""vLLM as a peer (llminfer.serve.peer): its process handling on stand-ins that fail, and the memory of a process
tree. The comparison itself is tested in tests/bench/test_bench_serve.py. Chapter 11."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from llminfer.serve import peer

pytestmark = pytest.mark.timeout(900)


# --- processes -----------------------------------------------------------------------------------------------------

def test_rss_of_a_process_tree_counts_its_children():
    alone = peer.process_tree_rss(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(80 * 2**20); x[::4096] = b'1' * "
                              "len(x[::4096]); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        assert peer.process_tree_rss(os.getpid()) > alone + 70 * 2**20
        with peer.RSSSampler(os.getpid(), interval_s=0.05) as sampler:
            time.sleep(0.2)
        assert sampler.peak > alone + 70 * 2**20
    finally:
        child.kill()
        child.wait()
    assert peer.process_tree_rss(2**22 + 12345) == 0                      # no such process


def test_a_peer_that_dies_at_startup_is_reported_with_its_log(tmp_path):
    # the book's own Python has no vllm: the module fails to import, and the error shows the log's end
    server = peer.VLLMProcess(tmp_path, "m", python=sys.executable, log_path=tmp_path / "vllm.log",
                              startup_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 before it was ready.*No module named"):
        server.start()
    assert "No module named" in (tmp_path / "vllm.log").read_text()


def test_a_peer_that_never_answers_times_out_and_is_stopped(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho loading weights, slowly\nexec sleep 120\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    server = peer.VLLMProcess(tmp_path, "m", python=fake, log_path=tmp_path / "vllm.log", startup_timeout_s=2)
    with pytest.raises(TimeoutError, match=r"(?s)did not answer /health within 2 s.*loading weights, slowly"):
        server.start()
    assert not server.alive()


def test_bad_peer_settings_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16'"):
        peer.VLLMProcess(tmp_path, "m", dtype="float16", python=sys.executable)
    with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
        peer.VLLMProcess(tmp_path, "m", kv_cache_gib=0, python=sys.executable)
    with pytest.raises(FileNotFoundError, match="make peer-vllm"):
        peer.VLLMProcess(tmp_path, "m", python=tmp_path / "no-python")
