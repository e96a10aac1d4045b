"""Web pages as clients (LMSP §16), in a real browser: headless Chromium (tests/cdp.py) opens
README.md's page, as written but for the service's address, served from another local origin with
the `openai` npm package beside it (tests/browser: `npm ci` there, as `make test` does). The page
pairs, the test allows it as the person would, and the page streams an answer; a page of another
origin holding the same token is refused by the browser's CORS check."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.cdp import CHROMIUM, Page, chromium
from tests.conftest import ROOT, Headless, Processes

pytestmark = pytest.mark.scripted
BROWSER = ROOT / "tests" / "browser"
SECTION = "## Web pages and browser extensions"
README_URL = "http://127.0.0.1:11535"


def readme_page() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(SECTION):].split("\n## ", 1)[0]
    [page] = re.findall(r"```html\n(.*?)```", section, flags=re.S)
    return page


@contextlib.asynccontextmanager
async def static(folder: Path, sites: int) -> AsyncIterator[list[str]]:
    """`folder` served on `sites` loopback ports: as many web origins."""
    runner = web.AppRunner(web.Application())
    runner.app.router.add_static("/", folder, follow_symlinks=True)
    await runner.setup()
    try:
        for _ in range(sites):
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield [f"http://127.0.0.1:{port}" for _, port in runner.addresses]
    finally:
        await runner.cleanup()


def text_of(element: str) -> str:
    return f"document.getElementById({element!r})?.textContent"


def troubles(page: Page) -> list[Any]:
    """What went wrong in the page, but the browser asking for a /favicon.ico the page does not have."""
    errors = [line for line in [*page.console, *page.log] if line.startswith("error") and "favicon.ico" not in line]
    return [*page.exceptions, *page.failed, *errors]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    if not Path(CHROMIUM).exists() or not (BROWSER / "node_modules" / "openai").is_dir():
        pytest.fail("needs the chromium package and tests/browser/node_modules: `make test` installs both")
    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy(BROWSER / "refused.html", folder)
    (folder / "node_modules").symlink_to(BROWSER / "node_modules")
    return folder


async def test_a_page_pairs_streams_and_a_page_of_another_origin_is_refused(
        headless: Headless, procs: Processes, site: Path, tmp_path: Path) -> None:
    await asyncio.to_thread(headless.start)
    (site / "index.html").write_text(readme_page().replace(README_URL, headless.url), encoding="utf-8")
    async with static(site, 2) as (allowed, other), chromium(procs, tmp_path / "profile") as browser:
        page = await browser.open(f"{allowed}/index.html")
        status = await page.wait_for(f"{text_of('status')}.includes('code is') && {text_of('status')}")
        # The person sees the page's origin, and the code the page shows.
        [waiting] = (await asyncio.to_thread(headless.get, "/v1/pairings"))[1]["data"]
        assert waiting["origin"] == allowed and status.endswith(waiting["code"]), (waiting, status)
        await asyncio.to_thread(headless.post, f"/v1/pairings/{waiting['id']}/approve", {})

        await page.wait_for(f"{text_of('status')} === 'Done.'")
        assert (await page.evaluate(text_of("answer"))).startswith("1, 2, 3")  # the scripted engine's count
        assert not troubles(page), troubles(page)
        [sent] = [r for r in page.sent.values() if r["method"] == "POST" and r["url"].endswith("/v1/responses")]
        names = {name.lower() for name in sent["headers"]}  # the preflight let them all through
        assert "authorization" in names and {"x-stainless-lang", "x-stainless-retry-count"} <= names, names
        [client] = [c for c in (await asyncio.to_thread(headless.get, "/v1/clients"))[1]["data"] if not c["owner"]]
        assert client["name"] == "My notes page" and client["origins"] == [allowed]

        # The same token, from a page of another origin: the preflight is refused, nothing runs.
        token = await page.evaluate("localStorage.getItem('lmsp-token')")
        refused = await browser.open(f"{other}/refused.html#{headless.url}%20{token}")
        error = await refused.wait_for(text_of("error"))
        assert error.startswith("APIConnectionError"), error
        assert [(f.method, f.cors) for f in refused.failed if f.url.endswith("/v1/responses")] == [
            ("POST", "PreflightMissingAllowOriginHeader")], refused.failed
        assert any("blocked by CORS policy" in line for line in refused.log), refused.log

        # Removing the app removes its origin: the first page, opened again with its token, is refused too.
        await asyncio.to_thread(headless.request, "DELETE", f"/v1/clients/{client['id']}")
        again = await browser.open(f"{allowed}/index.html")
        await until(lambda: again.exceptions, again)  # the SDK gave up (after its retries): uncaught
        assert "Connection error" in again.exceptions[0], again.exceptions
        assert {f.cors for f in again.failed if f.url.endswith("/v1/responses")} - {None}, again.failed
    tasks = (await asyncio.to_thread(headless.get, "/v1/tasks"))[1]["data"]
    assert len(tasks) == 1  # the first page's answer only


async def until(condition: Callable[[], Any], page: Page, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"exceptions: {page.exceptions}, failed: {page.failed}, log: {page.log}")
