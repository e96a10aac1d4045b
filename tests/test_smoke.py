async def test_health_and_discovery(api):
    resp = await api.get("/health")
    assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
    body = await (await api.get("/lmsp")).json()
    assert body["protocol"] == "lmsp" and body["api_base"] == "/v1"
