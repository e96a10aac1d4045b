"""Logs go to a rotating file, and no token ever appears in them."""

from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

from app import logs
from tests.conftest import Headless, wait_until


def test_no_token_reaches_the_log(headless: Headless) -> None:
    headless.start()
    owner = headless.token
    status, pairing = headless.request("POST", "/v1/pairings", {"client_name": "Logger", "scopes": ["models:read"]},
                                       headers={"Authorization": ""})
    assert status == 202
    assert headless.post(f"/v1/pairings/{pairing['id']}/approve", {})[0] == 200
    client_token = headless.get(f"/v1/pairings/{pairing['id']}")[1]["token"]
    for token in (client_token, "lmsp_" + "x" * 43):  # a good one, and a wrong one that gets refused
        req = urllib.request.Request(headless.url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
        try:
            urllib.request.urlopen(req, timeout=10).read()
        except urllib.error.HTTPError:
            pass
    headless.post("/v1/responses", {"input": f"my token is {owner}", "max_output_tokens": 2})
    assert headless.terminate() == 0
    log_files = list((headless.data_dir / "logs").glob("lmsp-tray.log*"))
    text = "".join(p.read_text() for p in log_files) + headless.log.read_text()
    assert "serving LMSP on" in text  # the log is really written
    assert owner not in text and client_token not in text


def test_anything_shaped_like_a_token_is_redacted(tmp_path: Path) -> None:
    file = logs.setup(tmp_path / "logs")
    try:
        logging.getLogger("somewhere").warning("oops %s", "lmsp_abcdefghijklmnopqrstuvwxyz0123456789")
        for handler in logging.getLogger().handlers:
            handler.flush()
        text = wait_until(lambda: file.read_text())
        assert "lmsp_[redacted]" in text and "abcdefghijklmnop" not in text
    finally:
        logging.basicConfig(force=True)
