"""A real HTTP server that answers only what an OpenAI-compatible server's ``GET /v1/models``
answers (vLLM's model cards, with its ``max_model_len`` field); every other path is 404, as on
a ``vllm serve`` whose metrics and dev endpoints are off. For tests of the ``http`` backend
that need no engine behind the URL."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def models_server(cards: list[dict[str, Any]]) -> Iterator[str]:
    """Serve ``cards`` as ``GET /v1/models``' ``data`` on a free loopback port; yields the
    base URL."""
    body = json.dumps({"object": "list", "data": cards}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/v1/models":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
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
