"""A loopback HTTP server standing in for the API server: records requests, replays answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterator

import pytest
from kubernetes import client

from kubeinfer.server.kube.client import Kube


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []
    answers: dict[str, tuple[int, dict[str, Any] | bytes]] = {}  # bytes: sent as they are

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append({"method": self.command, "path": self.path, "body": body,
                          "content_type": self.headers.get("Content-Type")})
        code, payload = self.answers.get(self.path.split("?")[0], (200, body or {}))
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_DELETE = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def kube() -> Iterator[Kube]:
    server = HTTPServer(("127.0.0.1", 0), Recorder)
    Recorder.seen, Recorder.answers = [], {}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    yield Kube(client.ApiClient(config))
    server.shutdown()
