"""Where secrets are kept (the owner token, upstream API keys, the hub token): the OS keyring,
or a user-only file where none exists; never the database.

Tests select a backend with the `keyring` library's own mechanism (PYTHON_KEYRING_BACKEND or
keyring.set_keyring), so they never touch a real keychain.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import keyring
from keyring.errors import KeyringError, PasswordDeleteError

from app import durable

log = logging.getLogger(__name__)
SERVICE = "lmsp-tray"
TOKEN_FILE = "owner_token"


def make_private(folder: Path) -> None:
    """Create `folder` if needed, and make it and everything in it private to this user (folders
    0700, files 0600): its database and WAL hold pending pairing ids and prompts, its logs what
    happened. Also fixes a folder left readable by an older version or made by hand. Links are
    left alone (their target may not be ours)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700 if name in dirs else 0o600)


class Vault:
    """One secret of one data directory (the owner token, an upstream's API key): the OS keyring,
    else a file readable only by this user. `where` says which backend holds it."""

    def __init__(self, data_dir: Path, name: str, file_name: str | None = None) -> None:
        self.data_dir = data_dir
        self.account = f"{name}:{data_dir}"
        self.file = data_dir / (file_name or name)
        self.where = "keyring"

    def get(self) -> str | None:
        try:
            secret = keyring.get_password(SERVICE, self.account)
            if secret:
                self.where = "keyring"
                return secret
        except (KeyringError, RuntimeError) as exc:
            log.info("no usable keyring backend (%s); using the file %s", type(exc).__name__, self.file.name)
        if self.file.exists():
            self.where = "file"
            return self.file.read_text(encoding="utf-8").strip() or None
        return None

    def put(self, secret: str) -> str:
        """Store the secret; returns where it went ("keyring" or "file")."""
        try:
            keyring.set_password(SERVICE, self.account, secret)
            if keyring.get_password(SERVICE, self.account) == secret:
                self.where = "keyring"
                return self.where
        except (KeyringError, RuntimeError) as exc:
            log.warning("no keyring backend available (%s): a secret is kept in %s, "
                        "readable only by you", type(exc).__name__, self.file)
        durable.write(self.file, secret, 0o600)  # a power cut must not lose a token already handed out
        self.where = "file"
        return self.where

    def delete(self) -> None:
        with contextlib.suppress(KeyringError, RuntimeError):
            keyring.delete_password(SERVICE, self.account)
        durable.remove(self.file)


def owner_vault(data_dir: Path) -> Vault:
    """The owner token of one data directory."""
    return Vault(data_dir, "owner-token", TOKEN_FILE)


def api_key_vault(data_dir: Path, key_ref: str) -> Vault:
    """The API key of one remote endpoint, named by the `key_ref` its database row keeps."""
    return Vault(data_dir, f"api-key-{key_ref}", f"api_key_{key_ref}")


HUB_TOKEN_ACCOUNT = "huggingface-token"


def hub_token() -> str | None:
    """The Hugging Face token saved in the keyring (`lmsp-tray hub-token`), if any. None lets
    huggingface_hub use its own: HF_TOKEN, or the login `hf auth login` saved."""
    try:
        return keyring.get_password(SERVICE, HUB_TOKEN_ACCOUNT) or None
    except (KeyringError, RuntimeError):
        return None


def set_hub_token(token: str | None) -> None:
    """Save (or, with None, forget) the Hugging Face token in the keyring; never in a file of ours."""
    if token:
        keyring.set_password(SERVICE, HUB_TOKEN_ACCOUNT, token)
    else:
        try:
            keyring.delete_password(SERVICE, HUB_TOKEN_ACCOUNT)
        except PasswordDeleteError:
            pass
