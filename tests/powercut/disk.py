"""The simulated disk under the power-cut file system (fs.py): what a power cut keeps.

Two layers. The live tree (`backing`) holds everything the programs on the mount see, as a page
cache does. The durable model is what the platter holds: the names (`names`: path -> inode id,
with each inode's kind and mode) and each inode's content: its `shadow/<id>` file, or, while nothing
below its durable size `base` has changed since the mount (a file only appended to, as a log or a
download is), the first `base` bytes of its live file. Writes and truncates mark pages dirty;
`fsync` of a file copies its dirty pages into its shadow (or, with none, moves `base` to its end).
Names change in the live tree at once and are logged (`pending`) in order, as a journaling file
system logs them; `fsync` of a directory commits the log up to the last entry that touched that
directory (a journal commits in order, so earlier entries go with it). A file's fsync commits no
name: a file created, written and synced whose directory never was is lost, as POSIX allows.

`cut("drop")` keeps only the durable model. `cut("torn")` keeps, as a real disk may, a random
prefix of the pending names and, for each dirty file, a random subset of its dirty pages and
either its old or its new size (so a later write may survive an earlier one's loss, and a page
beyond the old end reads as zeros). Then the live tree is rebuilt from the model.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

PAGE = 4096


@dataclass
class Inode:
    kind: str  # "file", "dir" or "symlink"
    mode: int
    target: str = ""  # a symlink's


@dataclass
class Dirty:
    """A file's changes since its last fsync: pages written, the smallest size it was cut to."""
    pages: set[int] = field(default_factory=set)
    cut_to: int | None = None


@dataclass
class Op:
    """One pending change of names: `what` is create, mkdir, symlink, link, unlink, rmdir, rename, chmod."""
    what: str
    path: str
    other: str = ""   # rename: the new path
    ino: int = 0      # create, mkdir, symlink, link: the inode named
    dirs: tuple[str, ...] = ()


def parent(path: str) -> str:
    return os.path.dirname(path) or "/"


class Disk:
    def __init__(self, backing: Path, state: Path) -> None:
        self.backing, self.shadow = backing, state / "shadow"
        shutil.rmtree(self.shadow, ignore_errors=True)
        self.shadow.mkdir(parents=True)
        self.names: dict[str, int] = {}
        self.inodes: dict[int, Inode] = {}
        self.ids: dict[int, int] = {}  # live st_ino -> inode id
        self.base: dict[int, int] = {}  # inode id -> its durable size, while it has no shadow
        self.next_id = 1 << 48
        self.pending: list[Op] = []
        self.dirty: dict[int, Dirty] = {}
        self.stats = {"fsync": 0, "fsyncdir": 0, "writes": 0}
        self._scan()

    def real(self, path: str) -> str:
        return str(self.backing) + path

    def _scan(self) -> None:
        """Everything on the disk at the mount is durable."""
        for root, dirs, files in os.walk(self.backing):
            for name in ["", *dirs, *files]:
                full = os.path.join(root, name) if name else root
                st = os.lstat(full)
                rel = os.path.normpath("/" + os.path.relpath(full, self.backing))
                self.ids[st.st_ino] = st.st_ino
                self.names[rel] = st.st_ino
                self.inodes[st.st_ino] = self._inode(full, st)
                if stat.S_ISREG(st.st_mode):
                    self.base[st.st_ino] = st.st_size

    @staticmethod
    def _inode(full: str, st: os.stat_result) -> Inode:
        if stat.S_ISDIR(st.st_mode):
            return Inode("dir", stat.S_IMODE(st.st_mode))
        if stat.S_ISLNK(st.st_mode):
            return Inode("symlink", 0o777, os.readlink(full))
        return Inode("file", stat.S_IMODE(st.st_mode))

    # -- the live side, called by fs.py before or after it changes the live tree -------------

    def id_of(self, path: str) -> int | None:
        try:
            return self.ids.get(os.lstat(self.real(path)).st_ino)
        except FileNotFoundError:
            return None

    def born(self, path: str, what: str) -> int:
        """A name just made in the live tree (create, mkdir, symlink): a new inode, empty on disk."""
        full = self.real(path)
        st = os.lstat(full)
        ino = self.next_id
        self.next_id += 1
        self.ids[st.st_ino] = ino
        self.inodes[ino] = self._inode(full, st)
        if what == "create":
            self.base[ino] = 0
        self.log(Op(what, path, ino=ino, dirs=(parent(path),)))
        return ino

    def log(self, op: Op) -> None:
        self.pending.append(op)

    def keep(self, ino: int | None, fd: int | None = None, path: str | None = None, below: int = 0) -> None:
        """Before the live bytes of `ino` from `below` on change (or all of them go): copy its
        durable content to a shadow, if it has none and the change reaches into it."""
        if ino not in self.base or below >= self.base[ino]:
            return
        base = self.base.pop(ino)
        with (self.shadow / str(ino)).open("wb") as out:
            source = fd if fd is not None else os.open(self.real(path or ""), os.O_RDONLY)
            try:
                for offset in range(0, base, 1 << 20):
                    out.write(os.pread(source, min(1 << 20, base - offset), offset))
            finally:
                if fd is None:
                    os.close(source)

    def wrote(self, ino: int, offset: int, size: int) -> None:
        self.stats["writes"] += 1
        if size:
            self.dirty.setdefault(ino, Dirty()).pages.update(range(offset // PAGE, (offset + size - 1) // PAGE + 1))

    def truncated(self, ino: int, size: int) -> None:
        mark = self.dirty.setdefault(ino, Dirty())
        mark.cut_to = size if mark.cut_to is None else min(mark.cut_to, size)

    # -- making things durable ------------------------------------------------------------------

    def sync_file(self, ino: int, fd: int) -> None:
        self.stats["fsync"] += 1
        mark = self.dirty.pop(ino, None)
        if ino in self.base:  # only appended to: its durable end moves to its live end
            self.base[ino] = os.fstat(fd).st_size
        elif mark is not None:
            self._apply(ino, fd, mark, mark.pages, os.fstat(fd).st_size, cut=True)

    def _apply(self, ino: int, fd: int, mark: Dirty, pages: set[int], size: int, cut: bool) -> None:
        """Copy `pages` of the live file into the shadow, then give the shadow `size` bytes."""
        with (self.shadow / str(ino)).open("r+b") as out:
            if cut and mark.cut_to is not None:
                out.truncate(mark.cut_to)
            for page in sorted(pages):
                out.seek(page * PAGE)
                out.write(os.pread(fd, PAGE, page * PAGE))
            out.truncate(size)

    def sync_dir(self, path: str) -> None:
        self.stats["fsyncdir"] += 1
        last = max((i for i, op in enumerate(self.pending) if path in op.dirs), default=-1)
        self._commit(last + 1)

    def _commit(self, count: int) -> None:
        for op in self.pending[:count]:
            self._replay(op)
        del self.pending[:count]

    def _replay(self, op: Op) -> None:
        if op.what in ("create", "mkdir", "symlink", "link"):
            self.names[op.path] = op.ino
        elif op.what in ("unlink", "rmdir"):
            self.names.pop(op.path, None)
        elif op.what == "rename":
            for gone in [p for p in self.names if p == op.other or p.startswith(op.other + "/")]:
                del self.names[gone]
            for moved in [p for p in self.names if p == op.path or p.startswith(op.path + "/")]:
                self.names[op.other + moved[len(op.path):]] = self.names.pop(moved)
        elif op.what == "chmod" and op.path in self.names:
            self.inodes[self.names[op.path]].mode = op.ino

    # -- the power cut --------------------------------------------------------------------------

    def cut(self, mode: str, seed: int) -> dict[str, int]:
        """Drop (or, "torn", partly keep) what was never synced, and rebuild the live tree as the
        disk now holds it. Returns what was lost, for the log."""
        rng = random.Random(seed)
        live = self._live_paths()
        lost = {"ops": len(self.pending), "files": len(self.dirty), "pages": 0, "kept_ops": 0, "kept_pages": 0}
        if mode == "torn":
            kept = rng.randint(0, len(self.pending))
            lost["kept_ops"] = kept
            self._commit(kept)
            for ino, mark in self.dirty.items():
                if ino not in live:
                    continue
                chosen = {page for page in mark.pages if rng.random() < 0.5}
                lost["kept_pages"] += len(chosen)
                fd = os.open(live[ino], os.O_RDWR)
                try:
                    if ino in self.base:
                        self._append_torn(ino, fd, mark.pages - chosen, rng)
                    else:
                        old = (self.shadow / str(ino)).stat().st_size
                        size = rng.choice([old, os.fstat(fd).st_size])
                        self._apply(ino, fd, mark, chosen, size, cut=rng.random() < 0.5)
                finally:
                    os.close(fd)
        lost["pages"] = sum(len(mark.pages) for mark in self.dirty.values())
        self.pending.clear()
        self.dirty.clear()
        self._rebuild(live)
        return lost

    def _append_torn(self, ino: int, fd: int, lost: set[int], rng: random.Random) -> None:
        """A file only appended to: its new end kept or not; pages of the tail not kept read as zeros."""
        base, end = self.base[ino], os.fstat(fd).st_size
        if rng.random() < 0.5:
            return
        for page in lost:
            start = max(page * PAGE, base)
            if start < end:
                os.pwrite(fd, bytes(min((page + 1) * PAGE, end) - start), start)
        self.base[ino] = end

    def _live_paths(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for root, _dirs, files in os.walk(self.backing):
            for name in files:
                full = os.path.join(root, name)
                ino = self.ids.get(os.lstat(full).st_ino)
                if ino is not None:
                    found.setdefault(ino, full)
        return found

    def _rebuild(self, live: dict[int, str]) -> None:
        fresh = self.backing.with_name(self.backing.name + ".rebuilt")
        shutil.rmtree(fresh, ignore_errors=True)
        for path in sorted(self.names, key=lambda p: (p.count("/"), p) if p != "/" else (0, "")):
            inode = self.inodes[self.names[path]]
            where = fresh / path.lstrip("/") if path != "/" else fresh
            if inode.kind == "dir":
                where.mkdir(parents=True, exist_ok=True)
            elif inode.kind == "symlink":
                os.symlink(inode.target, where)
            else:
                ino = self.names[path]
                if ino in self.base:  # durable: the first `base` bytes of the live file
                    os.link(live[ino], where)
                    os.truncate(where, self.base[ino])
                else:
                    os.link(self.shadow / str(ino), where)
            if inode.kind != "symlink":
                os.chmod(where, inode.mode)
        shutil.rmtree(self.backing)
        os.rename(fresh, self.backing)
