"""The service bound to another address than localhost answers at the URL its service.json
gives, which is where the CLI and apps find it; a Host naming anything else is still refused."""

from __future__ import annotations

import sys
from pathlib import Path

from app.engine.registry.models import DEFAULT_MODEL_ID
from app.server.app import advertised
from tests.conftest import Headless, Processes
from tests.helpers import http
from tests.test_pairing import cli


def test_a_service_bound_to_another_loopback_address_is_found_by_the_cli(tmp_path: Path, procs: Processes) -> None:
    service = Headless(tmp_path / "data", procs, command=[sys.executable, "-m", "app", "--host", "127.0.0.2"])
    service.start(timeout=30)  # it waits for /health at the URL of service.json: a 421 there never ends
    assert service.url.startswith("http://127.0.0.2:"), service.url
    done = cli(service.data_dir, "status")
    assert done.returncode == 0 and service.url in done.stdout, (done.stdout, done.stderr)
    done = cli(service.data_dir, "models")
    assert done.returncode == 0 and DEFAULT_MODEL_ID in done.stdout, (done.stdout, done.stderr)
    # The bound address joins localhost, nothing more: a rebound DNS name is still refused.
    status, body = http(service.url + "/lmsp", headers={"Host": "evil.example"})
    assert status == 421 and body["error"]["code"] == "misdirected_request", body
    assert service.terminate() == 0


def test_a_service_bound_to_every_address_is_advertised_on_loopback() -> None:
    # Not bound here: the tests stay on loopback. 0.0.0.0 in service.json would be a URL a client
    # may not reach, and one the Host check refused.
    assert [advertised(h) for h in ("0.0.0.0", "", "::", "127.0.0.2", "::1", "localhost")] == [
        "127.0.0.1", "127.0.0.1", "[::1]", "127.0.0.2", "[::1]", "localhost"]
