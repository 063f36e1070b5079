"""`draftwise serve`: the OpenAI-compatible server (app.py routes, protocol.py wire format,
metrics.py Prometheus metrics) over draftwise.scheduler's continuous batching."""

from __future__ import annotations

import sys
import threading
import time

from draftwise.engine import Engine
from draftwise.errors import DraftwiseError
from draftwise.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK, Scheduler, choose_max_batch
from draftwise.server.app import ServerSettings, create_app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_batch: int | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
          settings: ServerSettings = ServerSettings(), log_level: str = "info") -> None:
    """Serve engine over HTTP until interrupted."""
    import uvicorn

    if max_batch is None:
        max_batch = choose_max_batch(engine)
    scheduler = Scheduler(engine, max_batch, max_queue, prefill_chunk)
    app = create_app(engine, scheduler, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))

    def http() -> None:
        try:
            server.run()
        finally:  # however the HTTP side ends (shutdown, a port already in use), the loop ends too
            scheduler.stop()

    # The HTTP side on a thread, the model on this (main) thread: see draftwise.scheduler.
    thread = threading.Thread(target=http, name="draftwise-http", daemon=True)
    thread.start()
    try:
        scheduler.run()
    except KeyboardInterrupt:
        print("draftwise serve: interrupted, shutting down", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    if not server.started:
        raise DraftwiseError(f"could not serve on {host}:{port} (see the error above): pick another --port or --host.")


class ServerThread:
    """A server on a background thread, for tests, benchmarks and notebooks:

        with ServerThread(engine, max_batch=8) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="-")...
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, max_batch: int | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 settings: ServerSettings = ServerSettings()) -> None:
        import socket

        import uvicorn

        if port == 0:  # a free loopback port
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.scheduler = Scheduler(engine, max_batch or choose_max_batch(engine, verbose=False), max_queue, prefill_chunk)
        self.app = create_app(engine, self.scheduler, settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="draftwise-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.scheduler.stop()


__all__ = ["ServerSettings", "ServerThread", "choose_max_batch", "create_app", "serve"]
