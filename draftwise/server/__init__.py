"""`draftwise serve`: the OpenAI-compatible server (app.py routes, protocol.py wire format,
metrics.py Prometheus metrics) over draftwise.scheduler's continuous batching."""

from __future__ import annotations

import sys

from draftwise.engine import Engine
from draftwise.scheduler import DEFAULT_MAX_QUEUE, DEFAULT_PREFILL_CHUNK, Scheduler, max_batch_from_costs, measure_batch_costs
from draftwise.server.app import ServerSettings, create_app


def choose_max_batch(engine: Engine, verbose: bool = True) -> int:
    """The batch limit from this machine's measured forward costs (scheduler.max_batch_from_costs)."""
    costs = measure_batch_costs(engine.target.model)
    best = max_batch_from_costs(costs)
    if verbose:
        curve = ", ".join(f"{size}: {1000 * seconds:.0f} ms" for size, seconds in costs.items())
        print(f"draftwise serve: one decoding forward per batch size: {curve} -> --max-batch {best}", file=sys.stderr)
    return best


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, max_batch: int | None = None,
          max_queue: int = DEFAULT_MAX_QUEUE, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
          settings: ServerSettings = ServerSettings(), log_level: str = "info") -> None:
    """Serve engine over HTTP until interrupted."""
    import uvicorn

    if max_batch is None:
        max_batch = choose_max_batch(engine)
    scheduler = Scheduler(engine, max_batch, max_queue, prefill_chunk).start()
    app = create_app(engine, scheduler, settings)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        scheduler.stop()


__all__ = ["ServerSettings", "choose_max_batch", "create_app", "serve"]
