"""Routes for pairing, clients, models, settings and metrics."""

from __future__ import annotations

from aiohttp import web

from app.core.caller import unless_left
from app.errors import Forbidden, InvalidRequest
from app.server.handlers import caller_left
from app.server.keys import CLIENT, LATENCY, SERVICE
from app.server.middleware import read_json
from app.server.peer import requester


async def request_pairing(request: web.Request) -> web.Response:
    created = await request.app[SERVICE].access.request_pairing(await read_json(request), await requester(request),
                                                                request.headers.get("Origin"))
    return web.json_response(created, status=202)


async def pairing_status(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].access.pairing_status(request.match_info["pairing_id"]))


async def approve_pairing(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].access.approve_pairing(request.match_info["pairing_id"]))


async def deny_pairing(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].access.deny_pairing(request.match_info["pairing_id"]))


async def list_pairings(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": await request.app[SERVICE].access.pending_pairings(),
                              "has_more": False})


async def list_clients(request: web.Request) -> web.Response:
    clients = await request.app[SERVICE].access.list_clients()
    return web.json_response({"object": "list", "data": clients, "has_more": False})


async def revoke_client(request: web.Request) -> web.Response:
    client_id = request.match_info["client_id"]
    await request.app[SERVICE].access.revoke_client(client_id)
    return web.json_response({"id": client_id, "object": "client.deleted", "deleted": True})


async def list_models(request: web.Request) -> web.Response:
    listed = await request.app[SERVICE].models.list_models()
    return web.json_response({"object": "list", "data": listed, "has_more": False})


async def get_model(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].models.model(request.match_info["model_id"]))


async def register_model(request: web.Request) -> web.Response:
    body = await read_json(request)
    if isinstance(body, dict) and "remote" in body:
        # The service will reach out to another server, with a key: the owner's decision.
        require_admin(request, "Registering a remote model")
    try:
        # Validating and hashing can take minutes: if the client leaves, the work stops too.
        registering = request.app[SERVICE].models.register_model(body, client=request[CLIENT])
        registered = await unless_left(caller_left(request), registering)
        return web.json_response(registered, status=201)
    except OSError as exc:  # the path itself is unusable: name too long, a directory we may not read...
        raise InvalidRequest(f"The model path cannot be used: {exc.strerror or exc}.", param="path") from None


async def update_model(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].remotes.update_remote_model(request.match_info["model_id"],
                                                                            await read_json(request)))


async def test_endpoint(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].remotes.test_endpoint(await read_json(request)))


def require_admin(request: web.Request, what: str) -> None:
    if not request[CLIENT].is_admin:
        raise Forbidden("insufficient_scope", f"{what} needs the scope 'admin'.")


async def create_download(request: web.Request) -> web.Response:
    task = await request.app[SERVICE].downloads.create_download(request[CLIENT], await read_json(request))
    return web.json_response(task, status=202, headers={"Location": f"/v1/tasks/{task['id']}"})


async def hub_files(request: web.Request) -> web.Response:
    query = request.query
    files = await request.app[SERVICE].downloads.hub_files(query.get("repo"), query.get("revision", "main"))
    return web.json_response({"object": "list", "data": files, "has_more": False})


async def delete_model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    await request.app[SERVICE].models.remove_model(model_id, request[CLIENT])
    return web.json_response({"id": model_id, "object": "model", "deleted": True})


async def load_model(request: web.Request) -> web.Response:
    options = await read_json(request) if request.can_read_body else None
    return web.json_response(await request.app[SERVICE].models.load_model(request.match_info["model_id"],
                                                                           options=options))


async def unload_model(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].models.unload_model(request.match_info["model_id"]))


async def forget_engine_mode(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].models.forget_engine_mode(request.match_info["model_id"]))


async def get_settings(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].settings.view())


async def patch_settings(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].settings.update(await read_json(request)))


async def get_metrics(request: web.Request) -> web.Response:
    text = await request.app[SERVICE].metrics_text(request.app[LATENCY])
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})
