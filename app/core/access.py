"""Who may use the service (LMSP §3): the owner token, pairing, clients, and each request's
token checked."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from app.core import auth, pairing
from app.core.auth import OLLAMA_ID, OLLAMA_NAME, Client
from app.core.settings import Settings
from app.errors import Conflict, Forbidden, InvalidRequest, NotFound
from app.events import EventBus
from app.secrets import Vault
from app.store.config import ORIGIN
from app.store.store import Store

log = logging.getLogger(__name__)
VERIFIED_SECONDS = 60.0  # a verified token is trusted from memory this long, unless revoked


class Access:
    """The plaintext token of an approved pairing lives only in memory, until the requester
    collects it (once); the owner's, in the vault (the OS keyring)."""

    def __init__(self, store: Store, bus: EventBus, vault: Vault, settings: Settings) -> None:
        self.store = store
        self.bus = bus
        self.vault = vault
        self.settings = settings
        self.ollama: Client | None = None  # the built-in client of the Ollama listener, while it is open
        self._pairing_tokens: dict[str, tuple[str, float]] = {}  # pairing id -> (token, collect it before this time)
        self._requesters: dict[str, tuple[str, float]] = {}  # pending pairing id -> (who asked, when it expires)
        self._announced: dict[str, float] = {}  # requester -> when a notification last announced one of theirs
        self._touched: dict[str, float] = {}  # client -> when its "last used" was last written
        self._verified: dict[str, tuple[float, Client]] = {}  # token hash -> (when verified, its client)
        self._revocations = 0
        self._origins: dict[str, frozenset[str]] = {}  # client -> the web origins it was allowed from

    async def load_origins(self) -> None:
        """Before the port opens: which web origins each client has (`origin_known`)."""
        self._origins = await self.store.read(pairing.client_origins)

    def origin_known(self, origin: str) -> bool:
        """Whether some client may be used from pages of `origin` (LMSP §16): its preflights are
        answered; a request from it still needs that client's token (app/server/middleware.py)."""
        return any(origin in origins for origins in self._origins.values())

    async def ensure_owner_token(self) -> None:
        token = await asyncio.to_thread(self.vault.get)
        if token:
            if await self.store.read(auth.owner_matches, token):
                return
        token = token or auth.new_token()
        await asyncio.to_thread(self.vault.put, token)
        await self.store.write(auth.install_owner, token)
        log.info("owner token created (kept in the %s)", self.vault.where)

    async def owner_token(self) -> str:
        token = await asyncio.to_thread(self.vault.get)
        assert token is not None
        return token

    async def authenticate(self, token: str) -> Client | None:
        """The client of a bearer token. A token verified in the last minute is answered from memory,
        so no client's heavy reads can hold up everyone's authentication; revoking drops it at once."""
        digest = auth.token_hash(token)
        known = self._verified.get(digest)
        if known is not None and time.monotonic() - known[0] < VERIFIED_SECONDS:
            client: Client | None = known[1]
        else:
            revocations = self._revocations
            client = await self.store.read(auth.authenticate, token)
            if client is not None and revocations == self._revocations:  # no revoke raced the read
                if len(self._verified) > 10_000:  # only real tokens get here; forget the stale ones
                    self._verified = {k: v for k, v in self._verified.items()
                                      if time.monotonic() - v[0] < VERIFIED_SECONDS}
                self._verified[digest] = (time.monotonic(), client)
        if client is not None:
            self._touch(client)
        return client

    def tokenless(self) -> Client | None:
        """The client a request without a token acts as on the Ollama listener (LMSP §15), while open."""
        if self.ollama is not None:
            self._touch(self.ollama)
        return self.ollama

    def _touch(self, client: Client) -> None:
        if time.monotonic() - self._touched.get(client.id, -1e9) > 60:
            # "Last used" for the Clients tab, written at most once a minute per client and
            # off the request's path: a request never waits for this fsync.
            self._touched[client.id] = time.monotonic()
            asyncio.create_task(self.store.write(auth.touch, client.id))

    async def request_pairing(self, body: Any, requester: str = "local", origin: str | None = None) -> dict[str, Any]:
        """`requester`: who asks, as far as the connection tells (app/server/peer.py); `origin`: the
        web page asking, if a page asks. Each page is a requester of its own: one site filling its
        share of waiting requests leaves the local apps of the same user theirs."""
        name, scopes = pairing.parse(body)
        if origin is not None:
            if not (origin.isascii() and origin.isprintable()):  # never sent by a browser: a local process
                raise InvalidRequest(f"The Origin header {origin!r} is not one a browser sends: an origin is "
                                     "ASCII (an international domain name in its punycode form, xn--...), with no "
                                     "control or direction characters.")
            if not ORIGIN.match(origin):  # "null": a file, or a sandboxed frame; any page could claim it
                raise Forbidden("origin_not_allowed", f"A page asking to pair must have a web origin "
                                f"(scheme://host[:port]); {origin!r} is not one.")
            requester = f"{requester} {origin}"
        now = time.time()
        self._requesters = {pid: (who, until) for pid, (who, until) in self._requesters.items() if until > now}
        theirs = {pid for pid, (who, _) in self._requesters.items() if who == requester}
        row = await self.store.write(pairing.create, name, scopes, theirs, origin)
        self._requesters[row["id"]] = (requester, row["expires_at"])
        notify = now - self._announced.get(requester, 0.0) >= pairing.NOTIFY_EVERY_SECONDS
        if notify:
            self._announced[requester] = now
        shown = pairing.pairing_object(row)
        self.bus.publish([{"type": "pairing.requested", "pairing": shown, "notify": notify}])
        return shown

    async def pairing_status(self, pairing_id: str) -> dict[str, Any]:
        """What the requester sees; the token is in it exactly once, after approval."""
        row = await self.store.read(pairing.get, pairing_id)
        shown = pairing.pairing_object(row)
        if shown["status"] == "approved" and pairing_id in self._pairing_tokens:
            if await self.store.write(pairing.hand_over, pairing_id):
                shown["token"] = self._pairing_tokens.pop(pairing_id)[0]
        return shown

    def forget_uncollected(self, now: float) -> int:
        """Approved tokens their app never came for: a token must not wait in memory forever."""
        late = [pid for pid, (_, until) in self._pairing_tokens.items() if until < now]
        for pairing_id in late:
            del self._pairing_tokens[pairing_id]
        return len(late)

    async def pending_pairings(self) -> list[dict[str, Any]]:
        return [pairing.pairing_object(r) for r in await self.store.read(pairing.pending)]

    async def approve_pairing(self, pairing_id: str) -> dict[str, Any]:
        return await self._decide(pairing_id, True)

    async def deny_pairing(self, pairing_id: str) -> dict[str, Any]:
        return await self._decide(pairing_id, False)

    async def _decide(self, pairing_id: str, approve: bool) -> dict[str, Any]:
        row, token = await self.store.write(pairing.decide, pairing_id, approve)
        if token is not None:
            # To be collected within a pairing's lifetime; `forget_uncollected` drops it after that.
            self._pairing_tokens[pairing_id] = (token, time.time() + pairing.LIFETIME_SECONDS)
            if row["origin"] is not None:
                self._origins[row["client_id"]] = frozenset({row["origin"]})
        self.bus.publish([{"type": "pairing.resolved", "id": pairing_id, "status": row["status"]}])
        return pairing.pairing_object(row)

    async def list_clients(self) -> list[dict[str, Any]]:
        rows = await self.store.read(lambda c: c.execute(
            "SELECT * FROM clients WHERE revoked_at IS NULL ORDER BY created_at").fetchall())
        return [{"id": r["id"], "object": "client", "name": r["name"], "scopes": json.loads(r["scopes"]),
                 "owner": bool(r["is_owner"]), "created_at": r["created_at"], "last_used_at": r["last_used_at"],
                 "origins": sorted(self._origins.get(r["id"], ()))}
                for r in rows]

    async def open_ollama(self) -> None:
        """The built-in client "Apps using the Ollama API" as the settings say (LMSP §15): there,
        with `ollama_scopes`, while `ollama_api` is `open`; revoked otherwise."""
        scopes = list(self.settings["ollama_scopes"]) if self.settings["ollama_api"] == "open" else None
        self.ollama = None if scopes is None else Client(OLLAMA_ID, OLLAMA_NAME, frozenset(scopes))
        await self.store.write(auth.install_ollama, scopes)
        self.bus.publish([{"type": "clients.changed"}])

    async def revoke_client(self, client_id: str) -> None:
        if client_id == auth.OWNER_ID:
            raise Conflict("cannot_revoke_owner", "The owner token cannot be revoked.")
        if client_id == OLLAMA_ID and self.ollama is not None:
            # One click turns the open listener off; apps with their own token keep /api/ here.
            await self.settings.update({"ollama_api": "token"})
            # The change revokes the client in the background (service._apply_settings); here the
            # answer waits for it: a listing right after the DELETE must not show it.
            await self.open_ollama()
            return
        if not await self.store.write(pairing.revoke, client_id):
            raise NotFound("client", client_id)
        self._origins.pop(client_id, None)  # its pages are refused from the next request
        self._revocations += 1  # a lookup that read the row before this must not be remembered
        self._verified = {k: v for k, v in self._verified.items() if v[1].id != client_id}  # refused from now on
        self.bus.publish([{"type": "clients.changed"}])
