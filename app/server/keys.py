"""Typed keys for what the aiohttp application carries."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from aiohttp import web

from app.core.auth import Client
from app.core.metrics import LatencyHistogram
from app.core.service import AppService

SERVICE = web.AppKey("service", AppService)
# (method, route pattern) -> the scope it needs, or None for the open routes
SCOPES = web.AppKey("scopes", dict)
LATENCY = web.AppKey("latency", LatencyHistogram)
# The connections whose request is inside a handler: the gate never closes those to make room.
BUSY = web.AppKey("busy", set)
# The names a request's Host may give (besides the setting allowed_hosts): localhost, and the
# address the service is bound to, which its own service.json names.
HOSTS = web.AppKey("hosts", set)
# Requests being answered, by paired client (`gate.fair_share`).
IN_FLIGHT = web.AppKey("in_flight", Counter)
# And by party of a client (`Client.party`): (client id, party) -> requests being answered.
IN_FLIGHT_PARTIES = web.AppKey("in_flight_parties", Counter)
# What the request carries once `authorize` has let it through.
CLIENT = web.RequestKey("client", Client)
# On the Ollama listener (LMSP §15): the client a request without a token acts as (None: refused).
Tokenless = Callable[[], Client | None]
TOKENLESS: web.AppKey[Tokenless] = web.AppKey("tokenless")
