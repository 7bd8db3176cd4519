"""llama.cpp, the decode benchmarks' peer: built at its best for the CPU in front of it, and run in a process of
its own. Chapter 08.

A comparison is only as fair as the peer's build. llama-cpp-python compiles llama.cpp when it is installed, and
its defaults are not always its best:

    python -m llminfer.bench llama-cpp build      # what `make peer-llama-cpp` runs
    python -m llminfer.bench llama-cpp flags      # the CMake options it would use here, and why

- On most CPUs the best build is the native one (`GGML_NATIVE=ON`): every instruction set the CPU has, and the
  "extra buffer types" that repack Q4_0 and Q8_0 weights into the layouts its fastest loops read.
- On a CPU with AMX tiles, llama-cpp-python 0.3.36's AMX buffers crash the process in its first Q8_0 or Q4_0
  decode. Switching the extra buffer types off avoids the crash but also turns off the repacked layouts, which
  handicaps the peer. The fair build compiles AMX out and keeps everything else: `GGML_NATIVE=OFF`, each
  AVX-512 / VNNI / BF16 option the CPU has turned on, the `GGML_AMX_*` options off. The repacked loops then run.

`build` installs from source with pip (no cached wheel: one built for another CPU would be reused) and writes
the options it used to BUILD_RECORD in the environment, so every report names the peer's build.

`LlamaCppProcess` runs the peer in a child process that holds the model and answers one request at a time over
a pipe. The child times its own tokens, so the pipe is outside every timing; and the peer does not share a
process (its threads, allocator and caches) with torch, which cost llama.cpp about a tenth of its speed when
both lived in one process.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ..generate import GenerationResult

__all__ = ["VERSION", "BUILD_RECORD", "cmake_args", "build_record", "build_note", "extra_buffers", "LlamaCppProcess",
           "SUMMARY", "add_arguments", "command"]

SUMMARY = "build the llama.cpp peer at its best for this CPU (make peer-llama-cpp), or print its options"

VERSION = "0.3.36"
BUILD_RECORD = Path(sys.prefix) / "llama-cpp-build.json"

# CMake option -> the /proc/cpuinfo flags it needs, for the non-native build on a CPU with AMX tiles
_OPTIONS = {"GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",),
            "GGML_AVX_VNNI": ("avx_vnni",), "GGML_AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
            "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",),
            "GGML_AVX512_BF16": ("avx512_bf16",)}
_AMX_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(flags) -> list[str]:
    """The CMake options of llama.cpp's best build for a CPU with these /proc/cpuinfo flags. Chapter 08.

    Native everywhere but on a CPU with AMX tiles; there, every vector option the CPU has, and AMX compiled out
    (so that the repacked Q4_0/Q8_0 buffers can stay on)."""
    flags = set(flags)
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    chosen = [f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}" for option, needs in _OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", *chosen, *(f"-D{option}=OFF" for option in _AMX_OFF)]


def build_record() -> dict | None:
    """What `build` wrote: the version, the CMake options and the CPU they were chosen for; None if the peer was
    installed some other way (its build options are then unknown)."""
    try:
        return json.loads(BUILD_RECORD.read_text())
    except (OSError, ValueError):
        return None


def build_note() -> str | None:
    """'llama-cpp-python 0.3.36, built with -DGGML_NATIVE=ON' for the reports; None where it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    record = build_record()
    how = (f"built with {' '.join(record['cmake_args'])} for {record['cpu']}" if record else
           "installed without `make peer-llama-cpp`: build options unknown")
    extra = "" if extra_buffers() else "; extra buffer types off (its AMX buffers would crash): plain CPU loops"
    return f"llama-cpp-python {llama_cpp.__version__}, {how}{extra}"


def extra_buffers(flags=None, record: dict | None = None) -> bool:
    """Whether llama.cpp may keep weights in its extra CPU buffer types (the repacked layouts, and AMX tiles where
    compiled in): yes unless the CPU has AMX tiles and the build (`record`) did not compile them out. flags and
    record default to this machine's and this environment's."""
    if flags is None:
        from ..device import cpu_capabilities

        flags, record = cpu_capabilities().flags, build_record()
    amx_out = record is not None and all(f"-D{option}=OFF" in record["cmake_args"] for option in _AMX_OFF)
    return amx_out or "amx_tile" not in flags


def build(options: list[str], version: str = VERSION, cpu: str = "") -> int:
    """Installs llama-cpp-python from source with these CMake options, and records them. Chapter 08."""
    import os

    print(f"building llama-cpp-python {version} for {cpu} with {' '.join(options)} (minutes)", flush=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(options), "FORCE_CMAKE": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                           "--force-reinstall", "--no-deps", f"llama-cpp-python=={version}"], env=env)
    if done.returncode == 0:
        BUILD_RECORD.write_text(json.dumps({"version": version, "cmake_args": options, "cpu": cpu}, indent=1))
        print(f"recorded the build in {BUILD_RECORD}")
    return done.returncode


class LlamaCppProcess:
    """llama.cpp on one GGUF file, in a child process: `generate(ids, new_tokens)` decodes greedily and returns
    the child's own per-token timings; `logits(ids)` returns the logits after a forward over ids. Chapter 08.

        with LlamaCppProcess("model.gguf", n_ctx=256, threads=2) as peer:
            result = peer.generate(ids, 64)            # a GenerationResult, as llminfer.generate gives
    """

    def __init__(self, path, n_ctx: int, threads: int):
        self.path, self.n_ctx, self.threads = str(path), int(n_ctx), int(threads)
        self._child = subprocess.Popen([sys.executable, "-m", "llminfer.bench.llama_peer", self.path,
                                        str(self.n_ctx), str(self.threads)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._ask({"op": "ready"})

    def _ask(self, request: dict) -> dict:
        if self._child.poll() is not None:
            raise RuntimeError(f"the llama.cpp process for {self.path} has exited (code {self._child.returncode})")
        self._child.stdin.write(json.dumps(request) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        if not line:
            code = self._child.wait(10)
            raise RuntimeError(f"the llama.cpp process for {self.path} exited (code {code}) during {request['op']}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp on {self.path}: {answer['error']}")
        return answer

    def generate(self, ids: list[int], new_tokens: int) -> GenerationResult:
        found = self._ask({"op": "generate", "ids": [int(i) for i in ids], "new_tokens": int(new_tokens)})
        return GenerationResult(found["token_ids"], found["ttft_s"], found["itl_s"], found["e2e_s"], len(ids))

    def logits(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(self._ask({"op": "logits", "ids": [int(i) for i in ids]})["logits"])

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.stdin.close()
            try:
                self._child.wait(10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:           # interpreter shutdown: the pipes may be gone already
            pass


def _serve(path: str, n_ctx: int, threads: int) -> None:
    """The child: loads the model, then answers one JSON request per line on stdin until it closes."""
    from ..quant.gguf_export import first_logits, llama_cpp_generate, load_llama_cpp

    out = sys.stdout
    sys.stdout = sys.stderr                  # nothing but answers on the pipe
    llm = load_llama_cpp(path, n_ctx, threads, extra_buffers=extra_buffers())
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "generate":
                r = llama_cpp_generate(llm, request["ids"], request["new_tokens"])
                answer = {"token_ids": r.token_ids, "ttft_s": r.ttft_s, "itl_s": r.itl_s, "e2e_s": r.e2e_s}
            elif request["op"] == "logits":
                answer = {"logits": first_logits(llm, request["ids"]).tolist()}
            else:
                answer = {"ready": True}
        except Exception as exc:             # reported to the parent, which raises it there
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def add_arguments(parser) -> None:
    """`python -m llminfer.bench llama-cpp build | flags [--version V] [--cmake-arg -DX=Y ...]`."""
    parser.add_argument("action", choices=("build", "flags"),
                        help="build: install llama-cpp-python from source with these options (minutes); flags: print them")
    parser.add_argument("--version", default=VERSION, help="the llama-cpp-python release to build")
    parser.add_argument("--cmake-arg", action="append", default=[], metavar="-DOPTION=VALUE",
                        help="an option added after the chosen ones (it wins over them), recorded with them; repeatable, written --cmake-arg=-DX=Y")


def command(args, parser=None) -> int:
    from ..device import cpu_capabilities

    caps = cpu_capabilities()
    options = cmake_args(caps.flags) + list(args.cmake_arg)
    if args.action == "build":
        return build(options, args.version, caps.model)
    why = ("AMX tiles present: a non-native build, AMX compiled out, the repacked buffers on"
           if "amx_tile" in caps.flags else "a native build, the repacked buffers on")
    print(f"{' '.join(options)}\n# for {caps.model}: {why}")
    return 0


if __name__ == "__main__":          # the child of LlamaCppProcess: python -m llminfer.bench.llama_peer PATH N_CTX THREADS
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
