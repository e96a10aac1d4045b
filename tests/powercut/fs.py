"""`python -m tests.powercut.fs BACKING MOUNTPOINT STATE`: the power-cut file system.

A FUSE pass-through (mfusepy over libfuse3) of BACKING at MOUNTPOINT that keeps, in disk.py's
model, what a real disk would hold after a power cut. It runs in the foreground until unmounted
(`fusermount3 -u`). A test speaks to it on the Unix socket STATE/control.sock, one JSON line a
request: {"cut": "drop" | "torn", "seed": n} cuts the power (from then on every operation fails
with EIO, and BACKING is rebuilt as the disk held it), {"stats": true} says what it has seen.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import mfusepy as fuse

from tests.powercut.disk import Disk, Op, parent

STAT_FIELDS = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime", "st_ctime",
               "st_blocks", "st_blksize")


class PowerCut(fuse.Operations):
    use_ns = True

    def __init__(self, disk: Disk) -> None:
        self.disk = disk
        self.mutex = threading.RLock()
        self.files: dict[int, int] = {}  # fh (a backing fd) -> inode id
        self.off = False

    def __getattribute__(self, name: str) -> Any:
        # After the cut, every operation of the file system fails, as a dead disk's would.
        if name in FS_OPS and object.__getattribute__(self, "off"):
            raise fuse.FuseOSError(errno.EIO)
        return object.__getattribute__(self, name)

    def _real(self, path: str) -> str:
        return self.disk.real(path)

    # -- reading ---------------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        found = {key: getattr(st, key) for key in STAT_FIELDS}
        found.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return found

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        # With their inode numbers: an entry whose number is 0 is skipped by readdir(3).
        with os.scandir(self._real(path)) as entries:
            listed = [(e.name, e.stat(follow_symlinks=False)) for e in entries]
        here = os.lstat(self._real(path))
        return [(name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0)
                for name, st in [(".", here), ("..", here), *listed]]

    def readlink(self, path: str) -> str:
        return os.readlink(self._real(path))

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        return {key: getattr(sv, key) for key in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                   "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    # -- files -----------------------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        with self.mutex:
            # Always readable (disk.keep copies through it); appends come with their offsets.
            plain = (flags & ~(os.O_ACCMODE | os.O_APPEND | os.O_TRUNC | os.O_CREAT | os.O_EXCL)) | os.O_RDWR
            if flags & os.O_ACCMODE == os.O_RDONLY:
                plain = (plain & ~os.O_ACCMODE) | os.O_RDONLY
            fd = os.open(self._real(path), plain)
            ino = self.disk.id_of(path)
            assert ino is not None, path
            self.files[fd] = ino
            if flags & os.O_TRUNC:
                self.disk.keep(ino, fd)
                os.ftruncate(fd, 0)
                self.disk.truncated(ino, 0)
            return fd

    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        with self.mutex:
            fd = os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            self.files[fd] = self.disk.born(path, "create")
            return fd

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        with self.mutex:
            ino = self.files[fh]
            self.disk.keep(ino, fh, below=offset)
            self.disk.wrote(ino, offset, len(data))
            return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        with self.mutex:
            ino = self.files[fh] if fh is not None else self.disk.id_of(path)
            self.disk.keep(ino, fh, path, below=length)
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._real(path), length)
            if ino is not None:
                self.disk.truncated(ino, length)
            return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        with self.mutex:
            self.disk.sync_file(self.files[fh], fh)
            return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        with self.mutex:
            self.files.pop(fh, None)
            os.close(fh)
            return 0

    # -- names -----------------------------------------------------------------------------------

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self.mutex:
            self.disk.sync_dir(path)
            return 0

    def mkdir(self, path: str, mode: int) -> int:
        with self.mutex:
            os.mkdir(self._real(path), mode)
            self.disk.born(path, "mkdir")
            return 0

    def symlink(self, target: str, source: str) -> int:
        with self.mutex:
            os.symlink(source, self._real(target))
            self.disk.born(target, "symlink")
            return 0

    def link(self, target: str, source: str) -> int:
        with self.mutex:
            os.link(self._real(source), self._real(target))
            self.disk.log(Op("link", target, ino=self.disk.id_of(source) or 0, dirs=(parent(target),)))
            return 0

    def unlink(self, path: str) -> int:
        with self.mutex:
            self.disk.keep(self.disk.id_of(path), path=path)
            os.unlink(self._real(path))
            self.disk.log(Op("unlink", path, dirs=(parent(path),)))
            return 0

    def rmdir(self, path: str) -> int:
        with self.mutex:
            os.rmdir(self._real(path))
            self.disk.log(Op("rmdir", path, dirs=(parent(path),)))
            return 0

    def rename(self, old: str, new: str) -> int:
        with self.mutex:
            self.disk.keep(self.disk.id_of(new), path=new)
            os.rename(self._real(old), self._real(new))
            self.disk.log(Op("rename", old, other=new, dirs=(parent(old), parent(new))))
            return 0

    def chmod(self, path: str, mode: int) -> int:
        with self.mutex:
            os.chmod(self._real(path), mode)
            self.disk.log(Op("chmod", path, ino=mode & 0o7777, dirs=(parent(path),)))
            return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._real(path), ns=times, follow_symlinks=False) if times else os.utime(self._real(path))
        return 0

    # -- the control socket ----------------------------------------------------------------------

    def serve(self, sock: socket.socket) -> None:
        while True:
            conn, _ = sock.accept()
            with conn, conn.makefile("rw") as stream:
                for line in stream:
                    stream.write(json.dumps(self.command(json.loads(line))) + "\n")
                    stream.flush()

    def command(self, ask: dict[str, Any]) -> dict[str, Any]:
        with self.mutex:
            if "cut" in ask:
                self.off = True
                return self.disk.cut(ask["cut"], int(ask.get("seed", 0)))
            return {**self.disk.stats, "pending_ops": len(self.disk.pending), "dirty_files": len(self.disk.dirty)}


FS_OPS = {name for name, value in vars(PowerCut).items() if callable(value) and not name.startswith("_")
          and name not in ("serve", "command")}


def main(backing: str, mountpoint: str, state: str) -> None:
    disk = Disk(Path(backing), Path(state))
    ops = PowerCut(disk)
    control = Path(state) / "control.sock"
    control.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(control))
    sock.listen()
    threading.Thread(target=ops.serve, args=(sock,), daemon=True).start()
    # hard_remove: an open file unlinked is gone at once (no .fuse_hidden rename in the names).
    fuse.FUSE(ops, mountpoint, foreground=True, hard_remove=True, use_ino=True, fsname="powercut")


if __name__ == "__main__":
    main(*sys.argv[1:4])
