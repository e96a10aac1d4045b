"""The owner token (LMSP §3): kept in the keyring or a user-only file, only its hash in the database."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import keyring
import pytest
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

from app.core.auth import OWNER_ID
from app.core.service import AppService
from app.secrets import SERVICE, TOKEN_FILE, owner_vault
from app.server.app import make_app


class MemoryKeyring(KeyringBackend):
    """A keyring that lives in a dict: the keyring library's own backend interface, no real keychain."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.passwords.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.passwords[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.passwords.pop((service, username), None) is None:
            raise PasswordDeleteError(username)


@pytest.fixture
def memory_keyring() -> Iterator[MemoryKeyring]:
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    try:
        yield backend
    finally:
        keyring.set_keyring(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def database_files(data_dir: Path) -> list[Path]:
    return [p for p in data_dir.iterdir() if p.name.startswith("lmsp.sqlite3")]


async def started(data_dir: Path) -> AppService:
    svc = AppService(data_dir)
    await svc.start()
    return svc


# -- the vault -----------------------------------------------------------------------------

def test_without_a_keyring_the_token_goes_to_a_file_only_the_user_can_read(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    vault = owner_vault(data_dir)

    assert vault.put("lmsp_secret-one") == "file"

    assert vault.where == "file"
    token_file = data_dir / TOKEN_FILE
    assert token_file.read_text() == "lmsp_secret-one"
    assert mode(token_file) == 0o600
    again = owner_vault(data_dir)
    assert again.get() == "lmsp_secret-one" and again.where == "file"


def test_token_file_is_made_user_only_even_if_it_was_readable_by_others(tmp_path: Path) -> None:
    token_file = tmp_path / TOKEN_FILE
    token_file.write_text("lmsp_old")
    os.chmod(token_file, 0o644)

    owner_vault(tmp_path).put("lmsp_new")

    assert token_file.read_text() == "lmsp_new"
    assert mode(token_file) == 0o600


def test_with_a_keyring_the_token_goes_there_and_no_file_is_written(
        tmp_path: Path, memory_keyring: MemoryKeyring) -> None:
    data_dir = tmp_path / "data"
    vault = owner_vault(data_dir)

    assert vault.put("lmsp_secret-two") == "keyring"

    assert vault.where == "keyring"
    assert list(memory_keyring.passwords.values()) == ["lmsp_secret-two"]
    assert [service for service, _ in memory_keyring.passwords] == [SERVICE]
    assert not (data_dir / TOKEN_FILE).exists()
    assert owner_vault(data_dir).get() == "lmsp_secret-two"


def test_each_data_directory_has_its_own_token_in_the_keyring(tmp_path: Path, memory_keyring: MemoryKeyring) -> None:
    owner_vault(tmp_path / "one").put("lmsp_one")
    owner_vault(tmp_path / "two").put("lmsp_two")
    assert owner_vault(tmp_path / "one").get() == "lmsp_one"
    assert owner_vault(tmp_path / "two").get() == "lmsp_two"


# -- through the service -------------------------------------------------------------------

async def test_owner_token_is_accepted_as_a_bearer_token(api: Any) -> None:
    found = await api.get("/v1/tasks/nope")
    assert found.status == 404  # authenticated: the task is merely missing
    assert (await found.json())["error"]["code"] == "not_found"
    wrong = await api.get("/v1/tasks/nope", headers={"Authorization": "Bearer lmsp_not-the-owner"})
    assert wrong.status == 401


async def test_owner_token_is_created_in_the_user_only_file_without_a_keyring(service: AppService) -> None:
    token = await service.access.owner_token()
    assert token.startswith("lmsp_") and len(token) >= 40
    assert service.access.vault.where == "file"
    token_file = service.data_dir / TOKEN_FILE
    assert token_file.read_text() == token and mode(token_file) == 0o600


async def test_only_the_hash_of_the_owner_token_is_in_the_database(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    svc = await started(data_dir)
    token = await svc.access.owner_token()
    try:
        stored = await svc.store.read(
            lambda c: c.execute("SELECT token_hash FROM clients WHERE id = ?", (OWNER_ID,)).fetchone()[0])
        assert stored == hashlib.sha256(token.encode()).hexdigest()
        running = database_files(data_dir)
        assert any(p.name.endswith("-wal") for p in running)
        for path in running:  # the file and its -wal while the service runs
            assert token.encode() not in path.read_bytes(), path.name
    finally:
        await svc.stop()
    for path in data_dir.rglob("*"):  # and every file it leaves behind, but the token file itself
        if path.is_file() and path.name != TOKEN_FILE:
            assert token.encode() not in path.read_bytes(), path.name


async def test_restart_keeps_the_same_owner_token(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = await started(data_dir)
    token = await first.access.owner_token()
    await first.stop()

    second = await started(data_dir)
    try:
        assert await second.access.owner_token() == token
        owner = await second.access.authenticate(token)
        assert owner is not None and owner.id == OWNER_ID and owner.is_admin
    finally:
        await second.stop()


async def test_service_with_a_keyring_keeps_the_token_out_of_the_data_directory(
        tmp_path: Path, memory_keyring: MemoryKeyring, aiohttp_client: Any) -> None:
    data_dir = tmp_path / "data"
    first = await started(data_dir)
    try:
        token = await first.access.owner_token()
        assert first.access.vault.where == "keyring"
        assert list(memory_keyring.passwords.values()) == [token]
        assert not (data_dir / TOKEN_FILE).exists()
        client = await aiohttp_client(make_app(first))
        found = await client.get("/v1/tasks/nope", headers={"Authorization": f"Bearer {token}"})
        assert found.status == 404
    finally:
        await first.stop()

    second = await started(data_dir)
    try:
        assert await second.access.owner_token() == token
        assert await second.access.authenticate(token) is not None
        assert not (data_dir / TOKEN_FILE).exists()
    finally:
        await second.stop()


async def test_owner_token_still_works_after_the_database_was_recovered_from_corruption(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = await started(data_dir)
    token = await first.access.owner_token()
    await first.stop()
    for path in database_files(data_dir):
        path.write_bytes(os.urandom(path.stat().st_size or 4096))

    second = await started(data_dir)
    try:
        assert second.describe()["recovered_from_corruption"] is not None
        assert await second.access.owner_token() == token
        owner = await second.access.authenticate(token)
        assert owner is not None and owner.is_admin
    finally:
        await second.stop()


def _modes(folder: Path) -> dict[str, str]:
    """Every folder and file under `folder` (itself included) with its permission bits."""
    found = {".": oct(stat.S_IMODE(folder.stat().st_mode))}
    for path in folder.rglob("*"):
        found[str(path.relative_to(folder))] = oct(stat.S_IMODE(path.lstat().st_mode))
    return found


def test_everything_the_running_service_writes_is_private_to_its_user(headless: Any) -> None:
    """Another local user must read nothing: not the WAL (pending pairing ids, prompts), not the
    logs, not service.json. Also when the folder already existed, open to everyone, from before."""
    data = headless.data_dir
    (data / "logs").mkdir(parents=True)
    os.chmod(data, 0o755)
    os.chmod(data / "logs", 0o755)
    for name in ("logs/lmsp-tray.log.1", "lmsp.sqlite3.corrupt-20260101T000000Z", "lmsp.sqlite3.backup-v1-old"):
        (data / name).write_text("from an older version")
        os.chmod(data / name, 0o644)
    old_umask = os.umask(0o022)  # the service must not rely on the umask it was started with
    try:
        headless.start()
    finally:
        os.umask(old_umask)
    status, pairing = headless.request("POST", "/v1/pairings", {"client_name": "Reader", "scopes": ["tasks:read"]},
                                       headers={"Authorization": ""})
    assert status == 202, pairing
    running = _modes(data)
    for part in ("lmsp.sqlite3", "lmsp.sqlite3-wal", "lmsp.sqlite3-shm", "service.json", "owner_token",
                 "logs/lmsp-tray.log"):
        assert part in running, sorted(running)
    assert headless.terminate() == 0
    for modes in (running, _modes(data)):
        wrong = {path: mode for path, mode in modes.items()
                 if mode != ("0o700" if (data / path).is_dir() or path == "." else "0o600")}
        assert wrong == {}, wrong
