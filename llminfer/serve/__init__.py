"""Serving: an OpenAI-compatible server on the engine, its load generator, disaggregated workers. Chapters 11–12.

    python -m llminfer.serve --model tiny-capitals --port 8000       # the server (127.0.0.1 unless told)
    python -m llminfer.serve --disaggregated                         # the same, on a prefill and a decode worker
    python -m llminfer.serve.bench --base-url http://127.0.0.1:8000/v1 --request-rate 4

    protocol.py      the OpenAI request shapes, their checks, the error body
    chat.py          chat templates (a checkpoint's own, or the plain one the bundled model uses)
    async_engine.py  the engine on one background loop that request handlers feed
    metrics.py       /metrics in the Prometheus text format
    server.py        the FastAPI app, streaming, ServerThread (the server in a background thread)
    process.py       the server as a child process (notebooks, tests), always stopped
    bench.py         the load generator (the official openai client; Poisson arrivals or fixed concurrency)
    disagg.py        prefill and decode workers in separate processes, KV shipped layer by layer (chapter 12)
"""
from .async_engine import EngineLoop, EngineUnavailable, QueueFull, RequestHandle, Update
from .chat import PLAIN_TEMPLATE, ChatTemplate, load_chat_template
from .protocol import APIError, error_body

__all__ = ["EngineLoop", "EngineUnavailable", "QueueFull", "RequestHandle", "Update", "PLAIN_TEMPLATE",
           "ChatTemplate", "load_chat_template", "APIError", "error_body", "build_app", "OpenAIServer",
           "ServeConfig", "ServerThread"]


def __getattr__(name):
    # the HTTP side needs fastapi and uvicorn; import it only when asked for
    if name in ("build_app", "OpenAIServer", "ServeConfig", "ServerThread", "IncrementalText"):
        from . import server
        return getattr(server, name)
    raise AttributeError(f"module 'llminfer.serve' has no attribute {name!r}")
