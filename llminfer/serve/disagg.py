"""Prefill–decode disaggregation: a prefill worker and a decode worker in separate processes. Chapter 12.

    spec = ModelSpec(name="tiny-capitals")
    with DisaggregatedEngine(spec, decode_engine_kwargs=dict(num_blocks=128)) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16))    # RequestOutput per prompt

Three processes, the way DistServe, Splitwise and Mooncake lay a deployment out (one machine here):

- the **router** (this process) takes requests, sends each prompt to the prefill worker, and merges the
  tokens coming back: the first from the prefill worker, the rest from the decode worker;
- the **prefill worker** runs each prompt through the model's one forward. Its cache (`ShippingCache`)
  keeps nothing: as each layer writes its keys (after RoPE) and values, it sends them to the decode
  worker at once (`isend`), so the transfer of layer i overlaps the compute of layers i+1...; then it
  samples the first token and sends it, with the sampler's state, behind the last layer;
- the **decode worker** runs an `LLMEngine` that only ever decodes. A receiver thread takes each
  request's K/V off the wire; between engine steps the loop hands them to `LLMEngine.add_prefilled`, which
  writes them into blocks of the paged pool, and the request joins the running batch as if it had been
  prefilled there.

K/V travel over torch.distributed point to point: gloo over TCP on 127.0.0.1, with both workers on
the CPU. (Between GPUs the same sends would go through NCCL on device tensors, with a device per
worker, which this module does not place; production systems use NVLink or RDMA through libraries
such as NIXL or Mooncake's transfer engine.) Control messages (requests, tokens, aborts) go over multiprocessing queues. Every timestamp
is time.perf_counter(), which on Linux reads CLOCK_MONOTONIC and so agrees across processes.

What this buys (chapter 12 measures it): a long prompt's prefill no longer stalls the running decodes,
so their inter-token latency stays flat; what it costs is a second worker, the K/V bytes on the wire,
and batching that is split between two machines' worth of compute.

The decode side hands requests to its engine through the engine protocol's `add_prefilled`, which is what
a KV connector does in vLLM. The router speaks the same protocol (`llminfer.engine.protocol.Engine`), so the
OpenAI server of chapter 11 fronts it like a single engine: `python -m llminfer.serve --disaggregated`.
"""
from __future__ import annotations

import dataclasses
import os
import queue as queue_module
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import asdict, dataclass

import torch

from ..engine import EngineStats, LLMEngine, RequestOutput, SamplingParams
from ..engine.requests import PromptIds, RequestTable, check_pool_fits
from ..engine.sequence import SequenceStatus, StepOutput
from ..kv_cache import CacheBase
from ..parallel.launch import end_processes, join_group, process_context, rendezvous_store

__all__ = ["ModelSpec", "ShippingCache", "DisaggregatedEngine", "TransferRecord", "WorkerError"]

PREFILL_RANK, DECODE_RANK = 0, 1
_STOP = -1


class WorkerError(RuntimeError):
    """A worker of the disaggregated setup failed; the message holds its traceback. Chapter 12."""


@dataclass(frozen=True)
class ModelSpec:
    """How each worker builds the same model: a checkpoint (a bundled name or a folder), or a random config. Chapter 12."""
    name: str | None = None
    config: dict | None = None            # ModelConfig fields, for random weights (load_random)
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        if (self.name is None) == (self.config is None):
            raise ValueError("ModelSpec needs exactly one of name= (a checkpoint) or config= (ModelConfig fields "
                             "for random weights)")
        if not hasattr(torch, self.dtype) or not isinstance(getattr(torch, self.dtype), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype such as 'float32' or 'bfloat16', got {self.dtype!r}")

    def build(self):
        """The model, on the CPU, in eval mode."""
        import llminfer
        from llminfer.config import ModelConfig
        dtype = getattr(torch, self.dtype)
        if self.name is not None:
            model, _ = llminfer.load_pretrained(self.name, device="cpu", dtype=dtype, load_tokenizer=False)
            return model
        return llminfer.load_random(ModelConfig(**self.config), device="cpu", dtype=dtype, seed=self.seed)


class ShippingCache(CacheBase):
    """The prefill worker's cache: attends within the prompt and ships each layer's K/V as it is made. Chapter 12.

    It speaks the cache protocol, so the model's one forward runs on it unchanged; nothing is kept, so its
    length stays 0 and every forward is a whole prompt from position 0.
    """

    kind = "prefill worker's cache"
    device = torch.device("cpu")

    def __init__(self, n_layers: int, max_seq_len: int, dst: int = DECODE_RANK, send=None):
        super().__init__(batch_size=1)
        self.n_layers = n_layers
        self.max_seq_len = max_seq_len
        self.dst = dst
        self._send = send                     # send(tensor) -> work with .wait(); torch.distributed.isend by default
        self._works = []
        self._keep = []
        self.sent_bytes = 0
        self.layer_sent_s: list[float] = []   # when each layer's K/V were handed to the transport

    @property
    def capacity(self) -> int:
        return self.max_seq_len

    @property
    def nbytes(self) -> int:
        return 0

    def check_write(self, start: int, n_tokens: int, batch_size: int) -> None:
        if batch_size != 1:
            raise ValueError(f"the prefill worker ships one request at a time; got a batch of {batch_size}")
        super().check_write(start, n_tokens, batch_size)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend) -> torch.Tensor:
        out = backend(q, k, v, causal=True)                               # (1, H, T, D)
        for tensor in (k, v):                                             # (1, H_kv, T, D), keys after RoPE
            payload = tensor.contiguous()
            self._keep.append(payload)
            self._works.append(self._isend(payload))
            self.sent_bytes += payload.numel() * payload.element_size()
        self.layer_sent_s.append(time.perf_counter())
        return out

    def _isend(self, tensor):
        if self._send is not None:
            return self._send(tensor)
        import torch.distributed as dist
        return dist.isend(tensor, self.dst)

    def end(self) -> None:
        """Nothing is kept: the K/V have left, and the next forward starts at position 0 again."""
        self._start, self._n_new = None, 0

    def wait(self) -> None:
        """Blocks until every layer's K/V have left (the buffers may then be freed)."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works, self._keep = [], []

    def reset(self) -> None:
        self.wait()
        super().reset()


@dataclass
class TransferRecord:
    """One request's K/V transfer: how many tokens and bytes, and how long each side took. Chapter 12."""
    request_id: int
    num_tokens: int
    nbytes: int
    prefill_start_s: float          # the prefill worker began the forward
    prefill_end_s: float            # the first token was sampled
    send_done_s: float              # the last layer's send completed
    recv_done_s: float = float("nan")      # the decode worker held every layer
    installed_s: float = float("nan")      # its blocks were written and it joined the batch

    @property
    def prefill_s(self) -> float:
        return self.prefill_end_s - self.prefill_start_s

    @property
    def transfer_s(self) -> float:
        """From the end of the prefill to the last byte at the decode worker (what the overlap left over)."""
        return self.recv_done_s - self.prefill_end_s


# --- the workers ------------------------------------------------------------------------------------------

def _generator_state_size() -> int:
    return torch.Generator().get_state().numel()


def _prefill_worker(port: int, spec: ModelSpec, inbox, outbox, threads: int | None, timeout_s: float) -> None:
    """Prompts in; each layer's K/V out to the decode worker as it is computed; the first token back."""
    import torch.distributed as dist

    from ..sampling import History, is_penalised, sample
    try:
        torch.set_grad_enabled(False)
        model = spec.build()
        join_group(PREFILL_RANK, 2, "gloo", port, timeout_s, threads)
        outbox.put(("ready", "prefill", os.getpid()))
        cfg = model.config
        while True:
            message = inbox.get()
            if message[0] == "stop":
                dist.send(torch.tensor([_STOP, 0], dtype=torch.long), DECODE_RANK)
                break
            _, request_id, prompt, params_fields = message
            params = SamplingParams(**params_fields)
            start = time.perf_counter()
            dist.send(torch.tensor([request_id, len(prompt)], dtype=torch.long), DECODE_RANK)   # the header
            cache = ShippingCache(cfg.n_layers, cfg.max_seq_len)
            logits = model(torch.tensor([prompt]), cache=cache, last_only=True)[:, -1]   # (1, vocab)
            generator = torch.Generator()
            if not params.greedy:
                generator.manual_seed(params.seed if params.seed is not None else torch.seed())
            history = History.of([prompt], None, logits.shape[-1]) if is_penalised(params) else None
            token = int(sample(logits, [params], [generator if not params.greedy else None], history,
                               names=[f"request {request_id}"])[0])
            first_time = time.perf_counter()
            finished = (params.eos_token_id is not None and token == params.eos_token_id) or params.max_new_tokens == 1
            trailer = torch.tensor([token, int(finished)], dtype=torch.long)
            state = generator.get_state()
            cache.wait()
            dist.send(trailer, DECODE_RANK)
            dist.send(state, DECODE_RANK)
            sent = time.perf_counter()
            outbox.put(("first", request_id, token, first_time, finished,
                        (len(prompt), cache.sent_bytes, start, first_time, sent)))
    except BaseException:
        outbox.put(("error", "prefill", traceback.format_exc()))
    finally:
        _leave(outbox)


def _receiver(cfg, dtype, arrived: queue_module.Queue) -> None:
    """The decode worker's receiving thread: header, every layer's K and V, trailer, sampler state."""
    import torch.distributed as dist
    state_size = _generator_state_size()
    while True:
        header = torch.empty(2, dtype=torch.long)
        dist.recv(header, PREFILL_RANK)
        request_id, num_tokens = (int(x) for x in header)
        if request_id == _STOP:
            arrived.put(None)
            return
        kv = []
        for _ in range(cfg.n_layers):
            k = torch.empty(1, cfg.n_kv_heads, num_tokens, cfg.head_dim, dtype=dtype)
            v = torch.empty_like(k)
            dist.recv(k, PREFILL_RANK)
            dist.recv(v, PREFILL_RANK)
            kv.append((k, v))
        trailer = torch.empty(2, dtype=torch.long)
        dist.recv(trailer, PREFILL_RANK)
        state = torch.empty(state_size, dtype=torch.uint8)
        dist.recv(state, PREFILL_RANK)
        arrived.put((request_id, kv, int(trailer[0]), bool(trailer[1]), state, time.perf_counter()))


def _decode_worker(port: int, spec: ModelSpec, engine_kwargs: dict, inbox, outbox, threads: int | None,
                   timeout_s: float) -> None:
    """K/V in (receiver thread), handed to the engine's add_prefilled between steps; an LLMEngine that only
    decodes. What it sends the router: tokens, when each request joined the batch, and the engine's stats."""
    try:
        torch.set_grad_enabled(False)
        model = spec.build()
        engine = LLMEngine(model, **engine_kwargs)
        join_group(DECODE_RANK, 2, "gloo", port, timeout_s, threads)
        arrived: queue_module.Queue = queue_module.Queue()
        receiver = threading.Thread(target=_receiver, args=(model.config, model.dtype, arrived), daemon=True)
        receiver.start()
        outbox.put(("ready", "decode", os.getpid(), engine.stats))
        requests: dict[int, tuple] = {}          # router id -> (prompt, params, arrival, first token time)
        ready: deque = deque()                   # K/V that are here, waiting for room: (router id, kv, token, ...)
        to_router: dict[int, int] = {}           # engine id -> router id
        to_engine: dict[int, int] = {}
        aborted: set[int] = set()
        stopping = False
        receiver_done = False
        while True:
            block = not engine.has_unfinished() and not ready
            try:
                message = inbox.get(timeout=0.002) if block else inbox.get_nowait()
            except queue_module.Empty:
                message = None
            changed = False
            while message is not None:
                if message[0] == "request":
                    _, router_id, prompt, params_fields, arrival, first_time = message
                    requests[router_id] = (prompt, SamplingParams(**params_fields), arrival, first_time)
                elif message[0] == "prefilled":          # the router's own add_prefilled: K/V came with it
                    _, router_id, prompt, params_fields, token, kv, arrival, first_time, state = message
                    requests[router_id] = (prompt, SamplingParams(**params_fields), arrival, first_time)
                    ready.append((router_id, kv, token, False, state, time.perf_counter()))
                elif message[0] == "abort":
                    router_id = message[1]
                    aborted.add(router_id)
                    if router_id in to_engine:
                        engine_id = to_engine.pop(router_id)
                        to_router.pop(engine_id, None)
                        if engine.abort(engine_id):
                            engine.pop_output(engine_id)
                        aborted.discard(router_id)
                        changed = True
                elif message[0] == "stop":
                    stopping = True
                try:
                    message = inbox.get_nowait()
                except queue_module.Empty:
                    message = None
            while True:
                try:
                    item = arrived.get_nowait()
                except queue_module.Empty:
                    break
                if item is None:
                    receiver_done = True
                else:
                    ready.append(item)
            installed = []
            for item in list(ready):
                router_id, kv, token, finished, state, recv_time = item
                if finished or router_id in aborted:   # nothing to decode: the K/V are dropped
                    ready.remove(item)
                    requests.pop(router_id, None)
                    aborted.discard(router_id)
                    continue
                if router_id not in requests:
                    continue                       # the router's message is still on its way
                prompt, params, arrival, first_time = requests[router_id]
                engine_id = engine.add_prefilled(prompt, params, token, kv, arrival_time=arrival,
                                                 first_token_time=first_time, generator_state=state)
                if engine_id is None:
                    break                          # no room now; first come, first served
                ready.remove(item)
                requests.pop(router_id)
                to_router[engine_id] = router_id
                to_engine[router_id] = engine_id
                installed.append((router_id, recv_time, time.perf_counter()))
            if installed or changed:
                outbox.put(("installed", installed, engine.stats))
            if engine.has_unfinished():
                events = engine.step()
                now = time.perf_counter()
                tokens = []
                for event in events:
                    router_id = to_router.get(event.request_id)
                    if router_id is None:
                        continue
                    preemptions = None
                    if event.finished:
                        preemptions = engine.pop_output(event.request_id).preemptions
                        del to_router[event.request_id]
                        del to_engine[router_id]
                    tokens.append((router_id, event.token_id, event.finished, preemptions))
                if tokens:
                    record = engine.trace[-1]
                    prefill_tokens = sum(n for _, kind, n in record.entries if kind == "prefill")
                    outbox.put(("tokens", now, tokens, engine.stats,
                                (record.end_s - record.start_s, len(record.entries), prefill_tokens)))
            elif stopping and receiver_done and not ready:
                break
    except BaseException:
        outbox.put(("error", "decode", traceback.format_exc()))
    finally:
        _leave(outbox)


def _leave(outbox) -> None:
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    outbox.close()
    outbox.join_thread()
    os._exit(0)


# --- the router -------------------------------------------------------------------------------------------

def _end_processes(processes, inboxes) -> None:
    for box in inboxes:
        try:
            box.put(("stop",))
        except Exception:
            pass
    end_processes(processes, grace_s=10.0)


class DisaggregatedEngine:
    """The router: prompts to the prefill worker, decodes on the decode worker, tokens merged back. Chapter 12.

    It speaks the engine protocol (`llminfer.engine.protocol.Engine`: add_request, add_prefilled, step,
    abort, has_unfinished, pop_output, stats, clock), so `llminfer.engine.workload.replay` drives it like a
    colocated engine and the OpenAI server of chapter 11 fronts it. Each request is an engine `Sequence`
    here too, so its RequestOutput is the engine's own. `stats` is an `EngineStats`: the decode worker's
    pool and counters, with the queues as the router sees them (waiting: not yet decoding).
    """

    policy = "disaggregated"

    def __init__(self, spec: ModelSpec, decode_engine_kwargs: dict | None = None, prefill_threads: int | None = 1,
                 decode_threads: int | None = 1, timeout_s: float = 120.0, start_method: str | None = None):
        from ..config import ModelConfig
        import llminfer
        self.spec = spec
        self.decode_engine_kwargs = dict(decode_engine_kwargs or {})
        self.prefill_threads, self.decode_threads = prefill_threads, decode_threads
        self.timeout_s = timeout_s
        self.start_method = start_method
        if spec.config is not None:
            self.config = ModelConfig(**spec.config)
        else:
            from ..checkpoint import model_folder
            import json
            self.config = ModelConfig.from_hf(json.loads((model_folder(spec.name) / "config.json").read_text()))
        self.max_model_len = self.decode_engine_kwargs.get("max_model_len") or self.config.max_seq_len
        self.clock = time.perf_counter
        self.trace: deque = deque()
        self.transfers: dict[int, TransferRecord] = {}
        self.decode_steps: list[tuple[float, float, int, int]] = []   # (end time, seconds, sequences, prompt tokens)
        self._decode_stats: EngineStats | None = None      # the decode worker's, as of its latest message
        self._prefill_tokens = 0                             # prompt positions the prefill worker ran
        self.requests = RequestTable(self.config, self.max_model_len, self.clock)
        self._processes = []
        self._inboxes = []
        self._outbox = None
        self._finalizer = None
        self.started = False

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> "DisaggregatedEngine":
        if self.started:
            raise RuntimeError("this DisaggregatedEngine was already started; make a new one")
        context = process_context(self.start_method, preload=("llminfer.serve.disagg",))
        self._store, port = rendezvous_store(None, 2, self.timeout_s)
        self._outbox = context.Queue()
        prefill_in, decode_in = context.Queue(), context.Queue()
        self._inboxes = [prefill_in, decode_in]
        self._prefill_in, self._decode_in = prefill_in, decode_in
        self._processes = [
            context.Process(target=_prefill_worker, name="llminfer-prefill", daemon=True,
                            args=(port, self.spec, prefill_in, self._outbox, self.prefill_threads, self.timeout_s)),
            context.Process(target=_decode_worker, name="llminfer-decode", daemon=True,
                            args=(port, self.spec, self.decode_engine_kwargs, decode_in, self._outbox,
                                  self.decode_threads, self.timeout_s)),
        ]
        for process in self._processes:
            process.start()
        self._finalizer = weakref.finalize(self, _end_processes, list(self._processes), list(self._inboxes))
        self.started = True
        ready = set()
        deadline = time.monotonic() + self.timeout_s
        while len(ready) < 2:
            try:
                message = self._outbox.get(timeout=0.2)
            except queue_module.Empty:
                dead = [p.name for p in self._processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise WorkerError(f"the workers did not start ({'died: ' + ', '.join(dead) if dead else 'timeout'})")
                continue
            if message[0] == "error":
                self.close()
                raise WorkerError(f"the {message[1]} worker failed while starting:\n{message[2]}")
            if message[0] == "ready":
                ready.add(message[1])
                if message[1] == "decode":
                    self._decode_stats = message[3]
        return self

    def close(self) -> None:
        """Stops both workers (they finish what they hold first) and ends their processes."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._processes:
            _end_processes(self._processes, self._inboxes)
        self._processes = []
        self._store = None

    def __enter__(self) -> "DisaggregatedEngine":
        return self.start() if not self.started else self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- requests ------------------------------------------------------------------------------------------

    def _require_workers(self) -> None:
        if not self.started or not self._processes:
            raise RuntimeError("the workers are not running; call start() (or use `with DisaggregatedEngine(...)`)")

    def _check_limits(self, prompt: PromptIds, params: SamplingParams) -> None:
        """ValueError unless the request fits the decode worker's KV pool alone (it could never be installed)."""
        check_pool_fits(prompt, params, self._decode_stats.num_blocks, self._decode_stats.block_size)

    def add_request(self, prompt_ids, params: SamplingParams | None = None, arrival_time: float | None = None) -> int:
        """Queues one request at the prefill worker; returns its id."""
        self._require_workers()
        prompt, params = self.requests.check(prompt_ids, params, arrival_time, self._check_limits)
        seq = self.requests.track(prompt, params, arrival_time)
        self._prefill_in.put(("prefill", seq.request_id, list(prompt), asdict(params)))
        return seq.request_id

    def add_prefilled(self, prompt_ids, params: SamplingParams | None, first_token: int,
                      kv: list[tuple[torch.Tensor, torch.Tensor]], arrival_time: float | None = None,
                      first_token_time: float | None = None, generator_state: torch.Tensor | None = None) -> int:
        """Sends a request prefilled elsewhere straight to the decode worker; returns its id. Chapter 12.

        kv: per layer (k, v), each (1, n_kv_heads, P, head_dim). The decode worker installs it with its
        engine's add_prefilled as soon as its pool has room (it waits there, in order), so this never
        returns None."""
        self._require_workers()
        prompt, params = self.requests.check(prompt_ids, params, arrival_time, self._check_limits)
        self.requests.check_prefilled(prompt, params, first_token, kv, first_token_time)
        seq = self.requests.track(prompt, params, arrival_time)
        self.requests.start_decoding(seq, first_token, first_token_time)
        payload = [(k.detach().to("cpu").contiguous(), v.detach().to("cpu").contiguous()) for k, v in kv]
        self._decode_in.put(("prefilled", seq.request_id, list(prompt), asdict(params), int(first_token), payload,
                             seq.arrival_time, seq.first_scheduled_time, generator_state))
        return seq.request_id

    def has_unfinished(self) -> bool:
        """True while any request is at a worker or on its way between them."""
        return self.requests.has_unfinished()

    def abort(self, request_id: int) -> bool:
        """Stops a request (the decode worker frees its blocks); True if it was unfinished, False if finished."""
        if self.requests.abort(request_id) is None:
            return False
        self._decode_in.put(("abort", request_id))
        return True

    def _record(self, request_id: int, token: int | None, when: float, finished: bool, events: list) -> None:
        seq = self.requests.unfinished.get(request_id)
        if seq is None:
            return                                  # aborted meanwhile
        if token is None:                           # its step failed in the decode worker: it alone finishes
            self.requests.fail(seq, "the decode worker's step failed on it")
            events.append(StepOutput(request_id, None, True))
            return
        done = seq.append_token(token, when)
        if done != finished:                        # pragma: no cover - the workers decide as the engine does
            raise WorkerError(f"request {request_id}: the worker says finished={finished}, its sequence {done}")
        if done:
            self.requests.finish(seq)
        events.append(StepOutput(request_id, token, done))

    def step(self, timeout_s: float = 0.002) -> list[StepOutput]:
        """Takes what the workers have sent (waiting up to timeout_s for the first message); returns new tokens."""
        events: list[StepOutput] = []
        try:
            message = self._outbox.get(timeout=timeout_s)
        except queue_module.Empty:
            dead = [p.name for p in self._processes if not p.is_alive()]
            if dead:
                raise WorkerError(f"worker process(es) {dead} ended unexpectedly")
            return events
        while message is not None:
            kind = message[0]
            if kind == "error":
                raise WorkerError(f"the {message[1]} worker failed:\n{message[2]}")
            if kind == "first":
                _, request_id, token, first_time, finished, (n_tokens, nbytes, start, end, sent) = message
                self.transfers[request_id] = TransferRecord(request_id, n_tokens, nbytes, start, end, sent)
                self._prefill_tokens += n_tokens
                seq = self.requests.unfinished.get(request_id)
                if seq is not None:
                    seq.first_scheduled_time = start
                    if not finished:
                        self._decode_in.put(("request", request_id, seq.prompt_token_ids, asdict(seq.params),
                                             seq.arrival_time, first_time))
                self._record(request_id, token, first_time, finished, events)
            elif kind == "installed":
                _, installed, self._decode_stats = message
                for request_id, recv_time, install_time in installed:
                    record = self.transfers.get(request_id)
                    if record is not None:
                        record.recv_done_s, record.installed_s = recv_time, install_time
                    seq = self.requests.unfinished.get(request_id)
                    if seq is not None:
                        seq.status = SequenceStatus.RUNNING
            elif kind == "tokens":
                _, when, tokens, self._decode_stats, (step_s, n_seqs, prefill_tokens) = message
                self.decode_steps.append((when, step_s, n_seqs, prefill_tokens))
                for request_id, token, finished, preemptions in tokens:
                    seq = self.requests.unfinished.get(request_id)
                    if seq is not None and preemptions is not None:
                        seq.preemptions = preemptions
                    self._record(request_id, token, when, finished, events)
            try:
                message = self._outbox.get_nowait()
            except queue_module.Empty:
                message = None
        return events

    def pop_output(self, request_id: int) -> RequestOutput:
        """The finished request's RequestOutput (times from its arrival, on the shared monotonic clock)."""
        return self.requests.pop_output(request_id)

    def output(self, request_id: int) -> RequestOutput:
        """A snapshot of a request's RequestOutput as the router has it, running or finished (not yet popped)."""
        return self.requests.output(request_id)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 timeout_s: float | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; one RequestOutput per prompt, in order (WorkerError past timeout_s)."""
        limit_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit_s

        def step() -> None:
            if time.monotonic() > deadline:
                raise WorkerError(f"the requests did not finish within {limit_s} s")
            self.step(timeout_s=0.05)

        self._require_workers()
        return self.requests.run(prompts, params, self.add_request, step, self._check_limits)

    @property
    def stats(self) -> EngineStats:
        """The decode worker's pool and counters (as of its latest message), with the router's queues:
        waiting = at the prefill worker or in transfer, running = decoding; tokens_computed counts both workers."""
        decode = self._decode_stats
        if decode is None:                          # not started yet: an empty pool of the size asked for
            kwargs = self.decode_engine_kwargs
            decode = EngineStats(steps=0, num_blocks=kwargs.get("num_blocks") or 0,
                                 block_size=kwargs.get("block_size", 16), blocks_used=0,
                                 blocks_free=kwargs.get("num_blocks") or 0, blocks_cached_free=0, kv_pool_bytes=0,
                                 num_waiting=0, num_running=0, num_finished=0, preemptions=0, prefix_hit_tokens=0,
                                 prefix_query_tokens=0, tokens_computed=0, evictions=0)
        return dataclasses.replace(decode, **self.requests.counts(),
                                   tokens_computed=self._prefill_tokens + decode.tokens_computed)

    def __repr__(self) -> str:
        return (f"DisaggregatedEngine(prefill worker: 1 process × {self.prefill_threads} thread(s), decode worker: "
                f"LLMEngine({self.decode_engine_kwargs}) × {self.decode_threads} thread(s), K/V over gloo)")
