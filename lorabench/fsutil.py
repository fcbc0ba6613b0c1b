"""Atomic writes: the one place where lorabench makes files and directories appear whole or not at all.

A run directory holds someone's GPU hours, and a model cache holds minutes of warm-start, so every
write goes to a hidden temp sibling that is fsynced and then renamed onto its final name. A process
killed mid-write leaves only such a temp, named after its pid (`.<name>.tmp-<pid>-...`); the next
write next to it removes temps whose writer is dead and never touches a live writer's.

    atomic_write(path, b"...")                     # a file
    atomic_write(path, writer=lambda tmp: torch.save(state, tmp))
    with atomic_dir(path, replace=True) as tmp:    # a directory, swapped in whole
        (tmp / "a.json").write_text("...")
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove_dead(parent: Path, writer_pid, dirs_only: bool = False) -> list[Path]:
    """Remove the entries of `parent` for which `writer_pid(name)` names a dead process (never this
    one's or a live one's temps). Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        is_dir = entry.is_dir(follow_symlinks=False)
        pid = writer_pid(entry.name)
        if pid is None or (dirs_only and not is_dir) or pid == os.getpid() or pid_alive(pid):
            continue
        target = Path(entry.path)
        if is_dir:
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        removed.append(target)
    return removed


def remove_stale_temps(parent: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Remove entries of `parent` named `<prefix><pid>-...` (or `<prefix><pid>.`) whose writer
    process `pid` is dead: the garbage a killed atomic write leaves. A live writer's temps (this
    process's included) are never touched. Returns what was removed."""
    def writer_pid(name: str) -> int | None:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        head = name[len(prefix):].replace(".", "-").split("-", 1)[0] if prefix is not None else ""
        return int(head) if head.isdigit() else None
    return _remove_dead(parent, writer_pid)


# `.NAME.tmp-PID-xxxx` / `.NAME.old-PID-xxxx`: the temp dirs atomic_dir makes (any NAME)
_DIR_TEMP = re.compile(r"^\..+\.(?:tmp|old)-(\d+)-")


def remove_dead_dir_temps(parent: Path) -> list[Path]:
    """Remove every atomic_dir temp under `parent` whose writer is dead, whatever final name it was
    for. A cache needs this: a writer killed while building one entry leaves a temp that the next
    build of *that* entry would remove, but that build may never come (another process finished
    the entry, or the recipe changed)."""
    def writer_pid(name: str) -> int | None:
        match = _DIR_TEMP.match(name)
        return int(match.group(1)) if match else None
    return _remove_dead(parent, writer_pid, dirs_only=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path | str, *chunks, mode: int = 0o600, dir_fd: int | None = None) -> None:
    """Create `path` (it must not exist; relative to `dir_fd` when given) with `mode` whatever the
    umask, write `chunks` (bytes-like) and fsync it. O_EXCL never follows a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as fh:
        for chunk in chunks:
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
        os.fchmod(fh.fileno(), mode)


def atomic_write(path: Path, data: bytes | None = None, mode: int = 0o600,
                 writer: Callable[[Path], None] | None = None) -> None:
    """Make `path` hold `data` (or what `writer(tmp_path)` writes) whole: a fsynced temp file in the
    same directory is renamed onto it. Temps a killed writer left next to it are removed first."""
    path = Path(path)
    if (data is None) == (writer is None):
        raise TypeError("atomic_write needs exactly one of data= or writer=")
    remove_stale_temps(path.parent, (f".{path.name}.",))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if data is not None:
                fh.write(data)
        if writer is not None:
            writer(Path(tmp))
        fsync_path(Path(tmp))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(final: Path, replace: bool = False, mode: int = 0o700) -> Iterator[Path]:
    """Yield a temp directory next to `final`; on success it becomes `final` in one rename.

    replace=False (caches): if `final` appeared meanwhile (another process built the same thing),
    theirs is kept and ours dropped. replace=True (adapter dirs): an existing `final` is swapped
    out and removed only after the new one is in place; if the swap fails it is put back. Either
    way a crash leaves the old directory, the new one, or nothing, never a torn one; the hidden
    temps it may leave (`.<name>.tmp-<pid>-*`, `.<name>.old-<pid>-*`) are removed by the next
    atomic_dir for the same name once their process is gone."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, (f".{final.name}.tmp-", f".{final.name}.old-"))
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
            _swap_in(tmp, final, pid)
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


def _swap_in(tmp: Path, final: Path, pid: int) -> None:
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-{pid}-", dir=final.parent))
    os.rename(final, old / "dir")
    try:
        os.rename(tmp, final)
    except OSError:
        os.rename(old / "dir", final)  # put the previous directory back
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
