"""A real HTTP server that answers only what an OpenAI-compatible server's ``GET /v1/models``
answers (vLLM's model cards, with its ``max_model_len`` field) and, if asked, an idle server's
``/metrics``; every other path is 404, as on a ``vllm serve`` whose dev endpoints are off. For
tests of the ``http`` backend that need no engine behind the URL."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# what a vllm serve with nothing running says on /metrics, in the least that the backend reads
IDLE_METRICS = (
    'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
)


@contextmanager
def models_server(
    cards: list[dict[str, Any]], *, metrics: bool = False, state: dict[str, bool] | None = None
) -> Iterator[str]:
    """Serve ``cards`` as ``GET /v1/models``' ``data`` on a free loopback port; yields the
    base URL. ``cards`` is read at each request (a test may change it: a server restarted
    with other flags). ``metrics``: answer ``/metrics`` too, as an idle server.
    ``state["down"]``: answer 503 to everything meanwhile (a server that stopped)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if state is not None and state.get("down"):
                self.send_error(503)
                return
            if self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": cards}).encode()
                kind = "application/json"
            elif self.path == "/metrics" and metrics:
                body, kind = IDLE_METRICS.encode(), "text/plain; version=0.0.4"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # quiet: no line per request on stderr
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
