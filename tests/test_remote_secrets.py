"""An upstream's secrets stay out of sight (LMSP §11): an upstream that quotes the API key back
(as some proxies and debug servers quote the Authorization header in their errors), a password
in a base URL, and the HTTP client's own log lines."""

from __future__ import annotations

import contextlib
import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.conftest import Headless, wait_until
from tests.helpers import http, pair_sync, upstream

KEY = "sk-upstream-N11-0123456789abcdef"
PASSWORD = "pw-N11-in-the-url"
SCOPES = ["responses:write", "responses:read", "tasks:read", "models:read"]


class Quoting(BaseHTTPRequestHandler):
    """A stand-in for a third party's server, the one part no user touches. It serves the models
    `refuse` (an error answer, 400) and `break` (an error inside the stream), both quoting the
    request's Authorization header."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, json.dumps({"object": "list", "data": [{"id": "refuse"}, {"id": "break"}]}).encode())

    def do_POST(self) -> None:
        model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
        said = json.dumps({"error": {"message": f"Bad request. Debug: Authorization: {self.headers['Authorization']}"}})
        if model == "refuse":
            self._send(400, said.encode())
        else:
            self._send(200, f"data: {said}\n\n".encode(), "text/event-stream")


def quoting_upstream() -> contextlib.AbstractContextManager[str]:
    return upstream(Quoting)


def test_an_upstream_that_quotes_the_key_has_it_neither_shown_stored_nor_logged(headless: Headless) -> None:
    shown: list[Any] = []  # every answer an app got
    with quoting_upstream() as base_url:
        headless.start()
        for name in ("refuse", "break"):
            status, body = headless.post("/v1/models", {"id": name, "remote": {"endpoints": [
                {"base_url": base_url, "model": name, "api_key": KEY}]}})
            assert status == 201, body
        _, token = pair_sync(headless.url, headless.token, SCOPES, "Writer")
        for name in ("refuse", "break"):
            status, body = http(f"{headless.url}/v1/responses", "POST",
                                {"model": name, "input": "hi", "max_output_tokens": 5}, token=token)
            assert status == 502 and body["error"]["code"] == "upstream_error", body
            assert "Bad request" in body["error"]["message"] and "[redacted]" in body["error"]["message"], body
            shown.append(body)
            status, created = http(f"{headless.url}/v1/responses", "POST",
                                   {"model": name, "input": "hi", "max_output_tokens": 5, "background": True},
                                   token=token)
            assert status == 202, created
            task_url = f"{headless.url}/v1/tasks/{created['task']['id']}"
            shown.append(wait_until(lambda: (t := http(task_url, token=token)[1])["status"] == "failed" and t))  # noqa: B023 (called before the loop goes on)
            shown += [http(task_url + "/events", token=token)[1],
                      http(f"{headless.url}/v1/responses/{created['id']}", token=token)[1]]
        # A password in the URL is refused without being repeated: the key goes in `api_key`.
        with_password = base_url.replace("http://", f"http://alice:{PASSWORD}@")
        status, body = headless.post("/v1/models", {"id": "userinfo", "remote": {"endpoints": [
            {"base_url": with_password, "model": "refuse"}]}})
        assert status == 400 and body["error"]["code"] == "invalid_url", body
        assert body["error"]["param"] == "remote.endpoints[0].base_url" and "api_key" in body["error"]["message"]
        shown += [body, headless.get("/v1/models")[1], http(f"{headless.url}/v1/models", token=token)[1]]
        database = b"".join(p.read_bytes() for p in headless.data_dir.glob("lmsp.sqlite3*"))  # with its WAL
        assert headless.terminate() == 0
    database += b"".join(p.read_bytes() for p in headless.data_dir.glob("lmsp.sqlite3*"))
    log = "".join(p.read_text(errors="replace") for p in (headless.log, *headless.data_dir.rglob("*.log*")))
    for secret in (KEY, PASSWORD):
        assert secret not in json.dumps(shown), secret
        assert secret.encode() not in database, secret
        assert secret not in log, secret
    # The HTTP client's INFO line for every request (the hub's signed links, probes every 30 s).
    assert "HTTP Request" not in log
