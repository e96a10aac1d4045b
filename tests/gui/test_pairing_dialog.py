"""The pairing dialog: who asks, for what (in words), the code, a countdown; Allow / Deny."""

from __future__ import annotations

import time

import pytest
from gui_helpers import Until
from PySide6.QtWidgets import QLabel
from shiboken6 import isValid

from app.errors import InvalidRequest
from app.gui.pairing_dialog import PairingDialog, countdown, scope_sentence
from app.gui.session import Session

pytestmark = pytest.mark.gui


async def request(session: Session, name: str = "Notes", scopes: list[str] | None = None,
                  origin: str | None = None) -> dict:
    return await session.service.access.request_pairing({"client_name": name,
                                                  "scopes": scopes or ["responses:write", "models:read"]},
                                                 origin=origin)


def texts(dialog: PairingDialog) -> str:
    return "\n".join(label.text() for label in dialog.findChildren(QLabel))


async def test_allow_creates_the_client(session: Session, until: Until) -> None:
    pairing = await request(session)
    dialog = PairingDialog(session, pairing)
    dialog.show()
    shown = texts(dialog)
    assert "Notes" in shown and pairing["code"] in shown
    assert scope_sentence("responses:write") in shown and scope_sentence("models:read") in shown
    assert "expires in 4:" in dialog.expiry.text() or "expires in 5:" in dialog.expiry.text()
    assert dialog.deny_button.isDefault() and not dialog.allow_button.isDefault()
    dialog.allow_button.click()
    await until(lambda: not _alive(dialog) or not dialog.isVisible(), 10, "dialog closed")
    status = await session.service.access.pairing_status(pairing["id"])
    assert status["status"] == "approved" and status["token"].startswith("lmsp_")
    assert any(c["name"] == "Notes" for c in await session.service.access.list_clients())


async def test_a_web_page_is_named_by_its_origin_and_allowing_it_allows_that_origin(
        session: Session, until: Until) -> None:
    pairing = await request(session, "Notes", origin="http://localhost:5173")
    dialog = PairingDialog(session, pairing)
    dialog.show()
    assert dialog.origin is not None and "web page at <b>http://localhost:5173</b>" in dialog.origin.text()
    local = PairingDialog(session, await request(session, "Editor"))
    assert local.origin is None  # a local app: no page
    local.close()
    dialog.allow_button.click()
    await until(lambda: not _alive(dialog) or not dialog.isVisible(), 10, "dialog closed")
    [client] = [c for c in await session.service.access.list_clients() if c["name"] == "Notes"]
    assert client["origins"] == ["http://localhost:5173"]
    assert session.service.access.origin_known("http://localhost:5173")


async def test_the_origin_shown_is_the_one_the_page_has(session: Session) -> None:
    """The red team's P8: an international name shows in its punycode form, as browsers send it;
    an origin that would read as another site's (bidi controls, look-alike letters) never gets
    to the window."""
    pairing = await request(session, "Notes", origin="https://xn--gthub-2ve.com:8443")
    dialog = PairingDialog(session, pairing)
    dialog.show()
    assert dialog.origin is not None and "web page at <b>https://xn--gthub-2ve.com:8443</b>." in dialog.origin.text()
    dialog.close()
    for spoof in ("https://\u202emoc.elgoog\u202c", "https://g\u0456thub.com"):
        with pytest.raises(InvalidRequest, match="not one a browser sends"):
            await request(session, "Docs helper", origin=spoof)
    assert [p["origin"] for p in await session.service.access.pending_pairings()] == ["https://xn--gthub-2ve.com:8443"]


async def test_deny_refuses_the_request(session: Session, until: Until) -> None:
    pairing = await request(session, "Spy", ["admin"])
    dialog = PairingDialog(session, pairing)
    dialog.show()
    assert "trust completely" in texts(dialog)
    dialog.deny_button.click()
    await until(lambda: not _alive(dialog) or not dialog.isVisible(), 10, "dialog closed")
    assert (await session.service.access.pairing_status(pairing["id"]))["status"] == "denied"
    assert [c["name"] for c in await session.service.access.list_clients()] == ["Owner"]


async def test_countdown_runs_and_expiry_disables_allow(session: Session, until: Until) -> None:
    assert countdown(272) == "This request expires in 4:32."
    pairing = dict(await request(session), expires_at=time.time() + 1.5)  # as if it were almost over
    dialog = PairingDialog(session, pairing)
    dialog.show()
    assert dialog.allow_button.isEnabled() and "expires in 0:01" in dialog.expiry.text()
    await until(lambda: not dialog.allow_button.isEnabled(), 10, "expired")
    assert "expired" in dialog.expiry.text() and dialog.deny_button.text() == "Close"


async def test_a_decision_made_elsewhere_closes_the_dialog(session: Session, until: Until) -> None:
    pairing = await request(session)
    dialog = PairingDialog(session, pairing)
    dialog.show()
    await session.service.access.deny_pairing(pairing["id"])  # e.g. from the tray menu or the HTTP API
    await until(lambda: not _alive(dialog) or not dialog.isVisible(), 10, "dialog closed")


def _alive(widget: object) -> bool:
    return isValid(widget)  # the dialog deletes itself once closed
