"""Starting the processes of a parallel run: from a notebook or script (`launch`), or under torchrun. Chapter 10.

    results = launch(worker, args=(...), world_size=2)     # one list entry per rank: what worker returned there

`worker(ctx, *args)` runs in each of world_size fresh processes (the 'spawn' start method), with the process
group initialised and `ctx` saying its rank, world size, backend and device. Spawned processes import the worker
by name, so it must live in an importable module (not in a notebook cell); see `llminfer.parallel.workers`.

Everything is checked before a process starts: the worker, the arguments, the world size, the backend (NCCL
needs one GPU per process) and the port. The rendezvous store listens on 127.0.0.1 only, on a socket the
launcher binds itself (port None: a free one), and gloo's own connections are kept on the loopback interface.
The process group is destroyed and every process ended on the way out, failures and timeouts included.

Under torchrun, a script calls `with distributed_worker() as ctx:` instead and torchrun starts the processes.
"""
from __future__ import annotations

import datetime
import importlib
import os
import pickle
import queue as queue_module
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checks import check_int
from .plan import LOOPBACK, check_backend, check_port, check_world_size, loopback_interface

__all__ = ["WorkerContext", "WorkerError", "launch", "check_worker", "distributed_worker", "join_group",
           "rendezvous_store"]

DEFAULT_TIMEOUT_S = 120.0
# What a rank reports when it was not the cause: its peer failed and closed the connection.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Broken pipe")


@dataclass(frozen=True)
class WorkerContext:
    """One process's place in a parallel run. Chapter 10."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    def barrier(self) -> None:
        """Waits until every rank reaches this point."""
        dist.barrier()


class WorkerError(RuntimeError):
    """A rank of a parallel run raised; the message holds its traceback. Chapter 10."""


def check_worker(worker) -> None:
    """ValueError unless worker can be imported by name in a fresh process. Chapter 10."""
    if not callable(worker):
        raise ValueError(f"worker must be a function, got {type(worker).__name__}")
    module, qualname = getattr(worker, "__module__", None), getattr(worker, "__qualname__", "")
    where = ("in a notebook or in the script being run (__main__)" if module == "__main__"
             else "as a lambda" if "<lambda>" in qualname else "inside another function" if "<locals>" in qualname
             else None)
    if where is None and module:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if found is not worker:
            where = f"where `import {module}` cannot find it"
    if where is not None:
        raise ValueError(f"the worker {qualname or worker!r} is defined {where}; spawned processes import the worker "
                         "by its module and name, so define it at the top level of an importable module (as "
                         "llminfer.parallel.workers does) and pass that function")


def _set_loopback_env() -> None:
    """Keeps gloo's (and NCCL's bootstrap) sockets on the loopback interface."""
    interface = loopback_interface()
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        os.environ["NCCL_SOCKET_IFNAME"] = interface


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def rendezvous_store(port: int | None, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The rendezvous store every rank joins, listening on 127.0.0.1 (port None: a free one); (store, port).
    Chapters 10 and 12."""
    sock = check_port(port)                    # bound to 127.0.0.1 here; refused here if taken
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno(),
                              use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()                              # the store owns the listening socket now, and closes it
    return store, port


def join_group(rank: int, world_size: int, backend: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S,
               threads: int | None = 1) -> WorkerContext:
    """In a started process: sets its threads, keeps gloo on the loopback, joins the group at the store on
    127.0.0.1:port; returns its WorkerContext. Chapters 10 and 12."""
    if threads is not None:
        torch.set_num_threads(threads)
    _set_loopback_env()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
    # the device first: NCCL binds its communicator to the current CUDA device, and device_id makes it do so
    # eagerly, on this rank's own GPU, instead of guessing one at the first collective
    device = _device_for(backend, rank)
    device_id = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **device_id)
    return WorkerContext(rank, world_size, backend, device)


def _worker_entry(rank: int, world_size: int, backend: str, port: int, payload: bytes, results, threads: int | None,
                  timeout_s: float) -> None:
    """The body of each started process: join the group, run the worker, leave the group, report, exit."""
    status, body = "error", ""
    try:
        ctx = join_group(rank, world_size, backend, port, timeout_s, threads)
        worker, args = pickle.loads(payload)
        result = worker(ctx, *args)
        dist.barrier()                         # nobody leaves while another rank still talks to it
        status, body = "ok", pickle.dumps(result)
    except BaseException:                      # reported at once (before the group goes), raised by the launcher
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if status == "ok":
        results.put((rank, status, body))
    results.close()
    results.join_thread()                      # the report is on its way before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)                                # skip the interpreter's slow teardown: nothing is left to do


def launch(worker, args: tuple = (), world_size: int = 2, backend: str | None = None, port: int | None = None,
           timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = 1, start_method: str | None = None) -> list:
    """Runs worker(ctx, *args) in world_size processes; returns each rank's result, in rank order. Chapter 10.

    backend None picks NCCL when there is one GPU per process, else gloo. threads sets torch's CPU threads in
    each process (1 by default, so that two processes on two cores do not fight over them). A rank that raises,
    or a run that outlasts timeout_s, ends every process and raises WorkerError with the traceback.

    start_method None uses 'forkserver' where the platform has it (a server process imports torch once, and
    each run forks from it in a fraction of a second) and 'spawn' elsewhere; both import the worker by name.
    """
    check_worker(worker)
    check_world_size(world_size)
    backend = check_backend(backend, world_size)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if threads is not None:
        check_int("threads", threads, 1)          # before any process is started
    try:
        payload = pickle.dumps((worker, tuple(args)))
    except Exception as exc:
        raise ValueError(f"the worker's arguments cannot be sent to another process ({exc}); pass plain data "
                         "(numbers, strings, lists, tensors) rather than open files, locks or models") from None
    context = process_context(start_method)
    store, port = rendezvous_store(port, world_size, timeout_s)
    results = context.Queue()
    processes = []
    finished = False
    try:
        for rank in range(world_size):
            process = context.Process(target=_worker_entry, daemon=True, name=f"llminfer-rank{rank}",
                                      args=(rank, world_size, backend, port, payload, results, threads, timeout_s))
            process.start()
            processes.append(process)
        results_by_rank = _collect(processes, results, world_size, timeout_s)
        finished = True
        return results_by_rank
    finally:
        end_processes(processes, grace_s=5.0 if finished else 0.5)   # after a failure, nothing is worth waiting for
        del store
        results.close()


def process_context(start_method: str | None, preload: tuple[str, ...] = ("llminfer.parallel.workers",)):
    """The multiprocessing context: forkserver (torch and `preload` imported once) where available, else spawn;
    never fork. Chapters 10 and 12."""
    available = mp.get_all_start_methods()
    if start_method is None:
        start_method = "forkserver" if "forkserver" in available else "spawn"
    if start_method not in ("spawn", "forkserver") or start_method not in available:
        raise ValueError(f"start_method must be 'spawn' or 'forkserver' (available here: "
                         f"{[m for m in available if m != 'fork']}), got {start_method!r}; 'fork' is refused because "
                         "a forked copy of a process that already ran torch can deadlock")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed", *preload])
    return context


def _collect(processes, results, world_size: int, timeout_s: float) -> list:
    """Each rank's result in rank order; WorkerError on the first failure, a silent death or the timeout."""
    done: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    grace_end = None                           # after a failure, the other ranks get a moment to report theirs
    while len(done) + len(errors) < world_size:
        if grace_end is not None and time.monotonic() > grace_end:
            break
        try:
            rank, status, body = results.get(timeout=0.05)
        except queue_module.Empty:
            if errors:
                continue
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                time.sleep(0.2)                # a report may still be in flight
                if results.empty():
                    names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
                    raise WorkerError(f"{names} died without reporting (killed, or out of memory?)")
            elif time.monotonic() > deadline:
                waiting = sorted(set(range(world_size)) - set(done))
                raise WorkerError(f"the parallel run did not finish within timeout_s={timeout_s:g} s (ranks "
                                  f"{waiting} still running); every process was ended. Pass a larger timeout_s if "
                                  "the work needs it")
            continue
        if status == "ok":
            done[rank] = pickle.loads(body)
        else:
            errors[rank] = body
            grace_end = grace_end or time.monotonic() + 2.0
    if errors:
        # the cause: the first report that is not a rank noticing that another one went away
        first = next((r for r, text in errors.items() if not any(p in text for p in _PEER_GONE)), next(iter(errors)))
        others = f" (ranks {sorted(set(errors) - {first})} failed too)" if len(errors) > 1 else ""
        raise WorkerError(f"rank {first} of {world_size} raised{others}:\n{errors[first]}")
    return [done[rank] for rank in range(world_size)]


def end_processes(processes, grace_s: float = 5.0) -> None:
    """Waits up to grace_s in all for the processes to end; terminates, then kills, any still running."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=2)
        if process.is_alive():
            process.kill()
            process.join(timeout=2)


@contextmanager
def distributed_worker(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = 1):
    """Inside a script started by torchrun: joins the group from RANK/WORLD_SIZE/MASTER_ADDR, yields a
    WorkerContext, always destroys the group. Chapter 10."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(f"distributed_worker() runs under torchrun, which sets {missing}; start the script with "
                           "`torchrun --nproc-per-node 2 script.py`, or use llminfer.parallel.launch(...) instead")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = check_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if threads is not None:
        torch.set_num_threads(threads)
    if os.environ["MASTER_ADDR"] in (LOOPBACK, "localhost"):
        _set_loopback_env()
    device = _device_for(backend, local_rank)              # before the group: NCCL binds to this device
    device_id = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **device_id)
    try:
        yield WorkerContext(rank, world_size, backend, device)
    finally:
        dist.destroy_process_group()
