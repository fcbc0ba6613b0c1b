"""A run directory entered only through itself: `SafeDir` opens every entry relative to the dir's fd with
O_NOFOLLOW, refusing (`RunDirError`) links, FIFOs, sockets, devices and hard-linked files changed in place.
Writes are fsynced hidden temps renamed into place (`RunDirWriteError` names file and cause); `atomic_dir`
does the same by path outside a run dir.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC   # O_EXCL never follows a link
# the end of a temp's name, after its writer's PID: SafeDir's (secrets.token_hex(4)), tempfile.mkdtemp's
_HEX8, _MKDTEMP8 = "[0-9a-f]{8}", "[a-z0-9_]{8}"
_CAUSES = {errno.ENOSPC: "no space left on its filesystem", errno.EDQUOT: "the disk quota is exceeded",
           errno.EROFS: "its filesystem is read-only", errno.EACCES: "it is not writable by this user",
           errno.EPERM: "it is not writable by this user", errno.EIO: "an I/O error (a failing disk?)",
           errno.ENOENT: "its directory vanished"}


class RunDirError(ValueError):
    """A run dir cannot be used as it is; the message says what and how to recover."""


class RunDirWriteError(OSError):
    """A write into a run dir failed (disk full, read-only, ...); what the run dir held is intact."""

    def __str__(self) -> str:   # the message alone: it names the cause itself
        return str(self.strerror)


_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFREG: "a file",
          stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def refusal(path: Path, st: os.stat_result, wanted: str, dir_fd: int | None = None,
            is_root: bool = False) -> RunDirError:
    """The one-line refusal of an entry that is not a `wanted` ('file' or 'dir'), naming a link's target."""
    wanted = "directory" if wanted == "dir" else wanted
    if stat.S_ISLNK(st.st_mode):
        target = "?"
        with contextlib.suppress(OSError):
            target = os.readlink(path if dir_fd is None else path.name, dir_fd=dir_fd) or "?"
        if is_root:
            return RunDirError(f"{path} is a symbolic link (to {target}), not a run directory; a run dir is entered "
                               f"only through itself, so lorabench did not follow it. If the directory it points to is "
                               f"yours, pass that directory itself (its real path: realpath {path})")
        return RunDirError(f"{path} is a symbolic link (to {target}) where lorabench expects a {wanted}; a run dir is "
                           f"entered only through itself, so nothing a link in it points to is read or written, and "
                           f"lorabench did not open it. If the link and its target are yours, replace the link with a "
                           f"copy of the target; otherwise delete the link")
    return RunDirError(f"{path} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'a device')} where lorabench expects a "
                       f"{wanted}; lorabench did not open it. Put the run's {wanted} back (from a backup) or remove "
                       f"it, then run the command again")


def write_failure(path: Path, err: OSError, root: Path | None = None) -> RunDirWriteError:
    cause = _CAUSES.get(err.errno, err.strerror or str(err))
    if err.errno == errno.ENOSPC:
        with contextlib.suppress(OSError):
            cause += f" ({shutil.disk_usage(path.parent).free:,} bytes free)"
    where = root or path.parent
    fix = {errno.ENOSPC: "there is space again", errno.EDQUOT: "there is quota again",
           errno.EROFS: "the filesystem is writable again"}.get(err.errno, "that is fixed")
    failed = f"cannot write {path}: {cause} ({errno.errorcode.get(err.errno, err.errno)})"
    failure = RunDirWriteError(err.errno or errno.EIO, f"{failed}; what {where} held before is intact: once {fix}, "
                               f"`lorabench resume {where}` continues from its last checkpoint")
    failure.cause, failure.fix = failed, fix   # for a run not started yet
    return failure


class _Sink:
    """The temp file a writer fills; keeps the OSError of a failed write (torch.save rewords it)."""

    def __init__(self, fh):
        self._fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name):
        return getattr(self._fh, name)


class SafeDir:
    """A directory held open by fd; every entry is reached relative to it without following links."""

    def __init__(self, path: Path, fd: int, root: Path | None = None):
        self.path, self._fd, self.root = Path(path), fd, root or Path(path)

    @property
    def fd(self) -> int:
        """The dir's fd; once closed a RunDirError, never None: os.*(dir_fd=None) would reach the working directory."""
        if self._fd is None:
            raise RunDirError(f"{self.path} was closed: lorabench reads and writes it only through its open handle, "
                              f"so it refused to (nothing was written, there or anywhere else). A step still being "
                              f"written when its session closed does this; {self.root} keeps its last whole "
                              f"checkpoint, and `lorabench resume {self.root}` continues from it")
        return self._fd

    @classmethod
    def open(cls, path: str | Path, create: bool = False, mode: int | None = None) -> SafeDir:
        """The run dir itself, not a link (its parents are followed); create=True makes it. `mode` is set
        whatever the umask, with create=True only on a dir this call made."""
        return cls._opened(Path(path), Path(path), None, Path(path), create, mode)

    def sub(self, name: str, create: bool = False, mode: int | None = None) -> SafeDir:
        return self._opened(self.path / name, name, self.fd, self.root, create, mode)

    @classmethod
    def _opened(cls, path: Path, where, dir_fd: int | None, root: Path, create: bool, mode: int | None):
        made = False
        try:
            if create and dir_fd is None:
                path.parent.mkdir(parents=True, exist_ok=True)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(where, mode or 0o750, dir_fd=dir_fd)
                    made = True
        except OSError as err:
            raise write_failure(path, err, root) from None
        try:
            fd = os.open(where, _DIR, dir_fd=dir_fd)
        except PermissionError:
            raise _unreadable(path) from None
        except OSError as err:   # ELOOP (a link), ENOTDIR (not a dir): say which; ENOENT is raised as it is
            if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            st = os.stat(where, dir_fd=dir_fd, follow_symlinks=False)
            raise refusal(path, st, "dir", dir_fd, is_root=dir_fd is None) from None
        opened = cls(path, fd, root)
        if mode is not None and (made or not create):
            try:
                os.fchmod(fd, mode)
            except OSError as err:
                opened.close()
                raise write_failure(path, err, root) from None
        return opened

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(OSError, AttributeError, TypeError):
            self.close()

    def entry(self, name: str) -> os.stat_result | None:
        """lstat of `name`, None when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def expect(self, name: str, wanted: str, single: bool = False) -> bool:
        """Whether `name` exists, refusing it if it is not a `wanted` ('file' | 'dir'), or (single=True: a file
        changed in place) a file with a second name."""
        st = self.entry(name)
        if st is not None:
            self._check(name, st, wanted, single)
        return st is not None

    def _check(self, name: str, st: os.stat_result, wanted: str, single: bool) -> None:
        if not (stat.S_ISDIR(st.st_mode) if wanted == "dir" else stat.S_ISREG(st.st_mode)):
            raise refusal(self.path / name, st, wanted, self.fd)
        if single and st.st_nlink > 1:
            path = self.path / name
            raise RunDirError(f"{path} has {st.st_nlink} names (hard links): appending to it or truncating it would "
                              f"change the file under its other names too, which may be outside the run dir; "
                              f"lorabench did not change it. Give it a name of its own (cp -p {path} {path}.copy && "
                              f"mv {path}.copy {path}), then run the command again")

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def open_file(self, name: str, flags: int, mode: int = 0o640, single: bool = False) -> int | None:
        """An fd of the regular file `name` (None when absent), never through a link (O_NONBLOCK: nor a FIFO)."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except PermissionError:
            if flags & os.O_ACCMODE == os.O_RDONLY:
                raise _unreadable(self.path / name) from None
            raise
        except OSError as err:
            st = self.entry(name)
            if st is not None and err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EWOULDBLOCK):
                raise refusal(self.path / name, st, "file", self.fd) from None
            raise
        try:
            self._check(name, os.fstat(fd), "file", single)
        except RunDirError:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str) -> bytes | None:
        fd = self.open_file(name, os.O_RDONLY)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def last_byte(self, name: str) -> bytes:
        fd = self.open_file(name, os.O_RDONLY)
        if fd is None:
            return b""
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, 1, size - 1) if size else b""
        finally:
            os.close(fd)

    def open_own(self, name: str, flags: int, mode: int = 0o640) -> int:
        """An fd for changing `name` in place: a regular file of one name."""
        try:
            return self.open_file(name, flags, mode, single=True)
        except OSError as err:   # a RunDirError (a link, ...) is a ValueError: raised as it is
            raise write_failure(self.path / name, err, self.root) from None

    @contextlib.contextmanager
    def editing(self, name: str, flags: int, mode: int = 0o640) -> Iterator[int]:
        """An fd of `name` to change in place (open_own), fsynced after the block."""
        fd = self.open_own(name, flags, mode)
        try:
            yield fd
            os.fsync(fd)
        except OSError as err:
            raise write_failure(self.path / name, err, self.root) from None
        finally:
            os.close(fd)

    def append(self, name: str, data: bytes, mode: int = 0o640) -> None:
        with self.editing(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode) as fd:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

    def truncate(self, name: str, size: int) -> None:
        with self.editing(name, os.O_WRONLY) as fd:
            os.ftruncate(fd, size)

    def write_atomic(self, name: str, data: bytes | None = None, *, writer: Callable | None = None,
                     mode: int = 0o640, exclusive: bool = False) -> None:
        """Make `name` hold `data` (or what `writer(binary_file)` writes) whole: a fsynced temp renamed onto it
        (exclusive=True: linked, refusing an existing `name`)."""
        self.expect(name, "file")
        remove_stale_temps(self.fd, (re.escape(f".{name}."),), sep=".", token=_HEX8, dirs=False)
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, _NEW, 0o600, dir_fd=self.fd)
            sink = _Sink(os.fdopen(fd, "wb"))
            try:
                sink.write(data) if writer is None else writer(sink)
                sink.flush()
                os.fsync(fd)
                os.fchmod(fd, mode)
            except RuntimeError:
                if sink.error is None:
                    raise
                raise sink.error from None   # the disk's own error, not the library's rewording of it
            finally:
                sink.close()
            if exclusive:
                try:
                    os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                except FileExistsError:
                    raise RunDirError(f"{self.path / name} exists: it is written once and never rewritten") from None
                os.unlink(tmp, dir_fd=self.fd)
            else:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            os.fsync(self.fd)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            if isinstance(err, OSError):
                raise write_failure(self.path / name, err, self.root) from None
            raise

    @contextlib.contextmanager
    def atomic_subdir(self, name: str) -> Iterator[SafeDir]:
        """Yield a fresh hidden temp dir that replaces the dir `name` in one rename on success."""
        self.expect(name, "dir")
        remove_stale_temps(self.fd, (re.escape(f".{name}.") + "(?:tmp|old)-",), token=_HEX8)
        pid, fds = os.getpid(), {"src_dir_fd": self.fd, "dst_dir_fd": self.fd}
        tmp = f".{name}.tmp-{pid}-{secrets.token_hex(4)}"
        os.mkdir(tmp, 0o700, dir_fd=self.fd)
        try:
            with self.sub(tmp, mode=0o700) as inner:
                yield inner
                os.fsync(inner.fd)
            if self.entry(name) is None:
                os.rename(tmp, name, **fds)
            else:
                old = f".{name}.old-{pid}-{secrets.token_hex(4)}"
                os.rename(name, old, **fds)
                try:
                    os.rename(tmp, name, **fds)
                except OSError:
                    os.rename(old, name, **fds)   # put the previous dir back
                    raise
                shutil.rmtree(old, dir_fd=self.fd, ignore_errors=True)   # rmtree never follows a link inside it
            os.fsync(self.fd)
        except BaseException:
            shutil.rmtree(tmp, dir_fd=self.fd, ignore_errors=True)
            raise


def _unreadable(path: Path) -> RunDirError:
    return RunDirError(f"{path} is not readable by this user (another user's run dir?); continue it as its owner, "
                       f"or copy it and continue the copy")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def remove_stale_temps(parent: Path | int, prefixes: tuple[str, ...], sep: str = "-", token: str = _MKDTEMP8,
                       dirs: bool = True) -> None:
    """Remove what killed atomic writes left in `parent` (a path or dir fd): entries named exactly
    `<prefix><pid><sep><token>` (prefixes: regular expressions) of a dead pid, and only of the kind its writer
    makes: a dir (dirs=False: a regular file). Anything else (a link, a user's `.evals.jsonl.20240101`) is not a
    temp of ours and is left as it is. The defaults are mkdtemp's `<prefix><pid>-` dirs."""
    temp = re.compile(f"(?:{'|'.join(prefixes)})(\\d+){re.escape(sep)}{token}")
    dir_fd = parent if isinstance(parent, int) else None
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return
    for entry in entries:   # by an fd, entry.path is the name, relative to dir_fd
        match = temp.fullmatch(entry.name)
        ours = entry.is_dir(follow_symlinks=False) if dirs else entry.is_file(follow_symlinks=False)
        pid = int(match.group(1)) if match and ours else None
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        if dirs:
            shutil.rmtree(entry.path, dir_fd=dir_fd, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path, dir_fd=dir_fd)


def killed_write_temp(name: str, file: str) -> bool:
    """`name` is the temp of a `SafeDir.write` of `file` (`.FILE.PID.HEX8`) whose writer is dead."""
    temp = re.fullmatch(re.escape(f".{file}.") + f"(\\d+)\\.{_HEX8}", name)
    return temp is not None and not pid_alive(int(temp.group(1)))


def remove_dead_dir_temps(parent: Path) -> None:
    """Remove every atomic_dir temp (`.NAME.tmp-PID-x`, `.NAME.old-PID-x`) in `parent` whose writer is dead."""
    remove_stale_temps(parent, (r"\..+\.(?:tmp|old)-",))


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path | str, *chunks, mode: int = 0o600, dir_fd: int | None = None) -> None:
    """Create `path` (it must not exist) with `mode` whatever the umask, write `chunks` and fsync it."""
    fd = os.open(path, _NEW, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as fh:
        for chunk in chunks:
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
        os.fchmod(fh.fileno(), mode)


@contextlib.contextmanager
def atomic_dir(final: Path, replace: bool = False, mode: int = 0o700) -> Iterator[Path]:
    """Yield a temp dir that becomes `final` in one rename on success. replace=False: a `final` that appeared
    meanwhile is kept; replace=True: an existing one is swapped out (put back if the swap fails)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, (re.escape(f".{final.name}.") + "(?:tmp|old)-",))
    pid = os.getpid()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{pid}-", dir=final.parent))
    os.chmod(tmp, mode)
    try:
        yield tmp
        for child in tmp.iterdir():
            if child.is_file():
                fsync_path(child)
        fsync_path(tmp)
        if replace and final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-{pid}-", dir=final.parent))
            os.rename(final, old / "dir")
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old / "dir", final)  # put the previous directory back
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, final)
            except OSError:  # `final` appeared meanwhile: keep theirs
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
