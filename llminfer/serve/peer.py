"""vLLM's CPU build as a peer of llminfer's server: its environment, the checkpoint both load, its process. Chapter 11.

    make peer-vllm                                             # vLLM's CPU build in .venv-vllm, once
    python -m llminfer.bench serve --compare vllm              # the comparison (llminfer.bench.serve)

vLLM's CPU build reads no GGUF file, so both servers load the real model (SmolLM2-135M-Instruct) from one
safetensors folder that llminfer writes from the GGUF (`peer_checkpoint`, through `llminfer.save_pretrained`).
`VLLMProcess` runs vLLM's OpenAI server from that environment as a child process; `RSSSampler` follows the peak
resident memory of a server's processes (vLLM runs three).
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from .process import LOOPBACK, ChildProcess, free_port

__all__ = ["ROOT", "REAL_MODEL", "vllm_python", "peer_checkpoint", "process_tree_rss", "RSSSampler", "VLLMProcess"]

ROOT = Path(__file__).resolve().parents[2]          # the repository: .venv-vllm and build/ live here
REAL_MODEL = "smollm2-135m-instruct"


def vllm_python(root: str | Path | None = None) -> Path | None:
    """The Python of `make peer-vllm`'s environment (.venv-vllm), or None where it was not built. Chapter 11."""
    python = Path(root or ROOT) / ".venv-vllm" / "bin" / "python"
    return python if python.is_file() else None


def peer_checkpoint(folder: str | Path | None = None, name: str = REAL_MODEL) -> Path:
    """The real model as a Hugging Face safetensors folder (config, weights, tokenizer files), written once from
    the GGUF file by `llminfer.save_pretrained`; returns the folder. Chapter 11."""
    import torch

    import llminfer
    folder = Path(folder) if folder is not None else ROOT / "build" / "peer" / name
    done = folder / ".complete"
    if done.is_file():
        return folder
    model, tokenizer = llminfer.load_pretrained(name, device="cpu", dtype=torch.float32)
    llminfer.save_pretrained(model, folder, tokenizer=tokenizer)
    done.write_text(name + "\n")
    return folder


# --- memory of a server's processes ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc; 0 where it cannot be read). Chapter 11."""
    total, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):
            continue
        stack += _children(current)
    return total


class RSSSampler:
    """The peak of `process_tree_rss(pid)`, sampled on a thread every interval_s while the block runs."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llminfer-rss", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, process_tree_rss(self.pid))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_tree_rss(self.pid))


# --- vLLM as a child process ----------------------------------------------------------------------------------

class VLLMProcess(ChildProcess):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) from .venv-vllm on 127.0.0.1, as a
    child process with its own log file; start() waits for /health, stop() ends its process group. Chapter 11.

    start() raises RuntimeError, with the tail of the log, if the process exits before it is ready, and
    TimeoutError, with the tail, if /health has not answered 200 within startup_timeout_s; either way nothing it
    started is left running. stop() sends SIGINT to its process group, then SIGTERM, then SIGKILL.
    """

    name = "vLLM"
    health_interval_s = 1.0

    def __init__(self, model_dir: str | Path, served_model_name: str, dtype: str = "float32",
                 max_model_len: int = 2048, max_num_seqs: int = 16, kv_cache_gib: float = 1.0,
                 python: str | Path | None = None, port: int | None = None, startup_timeout_s: float = 600.0,
                 log_path: str | Path | None = None, extra_args: list[str] | None = None):
        python = Path(python) if python is not None else vllm_python()
        if python is None or not Path(python).is_file():
            raise FileNotFoundError("no vLLM environment: build it with `make peer-vllm` (.venv-vllm, 3.4 GB)")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16' (what both servers run on a CPU), got {dtype!r}")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 GiB, got {kv_cache_gib!r}")
        port = port or free_port()
        log_path = Path(log_path) if log_path is not None else ROOT / "build" / "peer" / f"vllm-{port}.log"
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", served_model_name, "--host", LOOPBACK, "--port", str(port),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                   *(extra_args or [])]
        # VLLM_HOST_IP: vLLM otherwise looks up this host's network address, which fails without a network
        env = {**os.environ, "VLLM_HOST_IP": LOOPBACK, "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        stop_steps = ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0))
        super().__init__(command, port, startup_timeout_s, stop_steps, env=env, log_path=log_path, signal_group=True)
