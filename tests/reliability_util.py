"""Helpers shared by the reliability tests (crash, errors catalogue, soak, security): a small
filesystem that really fills up, RSS readings, and the run settings of the tiny CLI runs."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the tiny CLI run of the crash and security tests (seconds on 2 cores)
TINY_RUN = ["grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_new_tokens=8", "data.eval_size=4",
            "grpo.steps=6", "refresh.mode=file", "run.threads=1"]
# the smallest CLI run (a second or two of work once the model is loaded), for the process tests
QUICK_RUN = ["grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=4",
             "warmstart.steps=0", "data.eval_size=4", "run.threads=1"]


def tens_problems(folder: Path) -> Path:
    """A problem file whose every answer is 10: the tiny random model's completions end with that number
    often enough (about 1 in 8) for groups of unequal rewards, so its adapter learns, and what it learns
    depends on which completions were sampled."""
    path = Path(folder) / "tens.jsonl"
    rows = [{"question": f"Sam has {a} {item} and gets {10 - a} more. How many {item} does Sam have?",
             "answer": f"{a} + {10 - a} = 10\n#### 10"} for a in range(1, 10) for item in ("pens", "cards")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stale_run(problems: Path) -> list[str]:
    """One-step-stale overrides of the tiny runs, learning on `tens_problems`, every completion in rollouts.jsonl."""
    return ["grpo.max_staleness=1", f"data.source={problems}", "grpo.reward_mode=flexible", "grpo.max_new_tokens=16",
            "run.sample_completions=8"]


def rss_mb() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2**20


@contextlib.contextmanager
def mounted_disk(path: Path, size_kb: int):
    """A FullDisk of `size_kb` mounted at `path` while the block runs; the test skips (with the
    reason) where a tmpfs cannot be mounted."""
    disk = FullDisk(path, size_kb=size_kb)
    if not disk.mount():
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        yield disk
    finally:
        disk.unmount()


class FullDisk:
    """A tiny tmpfs mounted at `path` (needs root and CAP_SYS_ADMIN), filled on demand with a filler
    file until the kernel answers ENOSPC: a real 'disk full', not a simulated one."""

    def __init__(self, path: Path, size_kb: int = 2048):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.size_kb = size_kb
        self.mounted = False

    def mount(self) -> bool:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_kb}k,mode=0700", "tmpfs",
                               str(self.path)], capture_output=True, text=True)
        self.mounted = done.returncode == 0
        return self.mounted

    def fill(self) -> int:
        """Write zeros until ENOSPC; returns the bytes written."""
        written = 0
        chunk = b"\0" * 4096
        fd = os.open(self.path / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:  # unbuffered: nothing is left to flush (and fail) on close
                try:
                    written += os.write(fd, chunk)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
                if written > 2 * self.size_kb * 1024:  # not a size-limited filesystem after all
                    raise RuntimeError(f"{self.path} never filled up; is it mounted?")
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        (self.path / ".filler").unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(*args, cwd=None, env_extra=None, **popen) -> subprocess.Popen:
    """`python -m lorabench.cli ARGS` as a child process (its own session, so a kill reaches only it),
    with SIGINT at its default as in a terminal's foreground: a pytest started as a background job
    ignores SIGINT, a child would inherit that, and Python keeps an inherited SIG_IGN (no Ctrl-C)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT), **(env_extra or {}))
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        popen.setdefault("preexec_fn", _sigint_default)
    return subprocess.Popen([sys.executable, "-m", "lorabench.cli", *args], cwd=cwd or ROOT, env=env,
                            start_new_session=True, **popen)


def one_line_error(err: str) -> str:
    """The CLI's refusal: exactly one 'lorabench: ...' line on stderr (library warnings aside), and
    no traceback."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("lorabench: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def refused(capsys, *argv) -> str:
    """`lorabench ARGV` (cli.main, in this process) exits 2 with one line and no traceback; returns the line."""
    from lorabench.cli import main
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 2, captured
    return one_line_error(captured.err)


def dir_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (and every dir, as None): equal before and after
    means nothing was written, truncated, added or removed."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (root itself included) without following links: a file's bytes and
    mode, a link's target, a dir's mode, another kind's type. Equal before and after means nothing
    under `root` was written, truncated, chmod'ed, added or removed, and no link was replaced."""
    root = Path(root)
    state = {}

    def record(path: Path, rel: str) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            state[rel] = ("link", os.readlink(path))
        elif stat.S_ISREG(st.st_mode):   # a huge (sparse) file by size and time: reading it is not possible
            content = path.read_bytes() if st.st_size < 64 << 20 else (st.st_size, st.st_mtime_ns)
            state[rel] = ("file", content, stat.S_IMODE(st.st_mode), st.st_nlink)
        elif stat.S_ISDIR(st.st_mode):
            state[rel] = ("dir", stat.S_IMODE(st.st_mode))
        else:
            state[rel] = ("other", stat.S_IFMT(st.st_mode))

    record(root, ".")
    if os.path.isdir(root) and not os.path.islink(root):
        for folder, dirs, files in os.walk(root, followlinks=False):
            for name in sorted(dirs + files):
                path = Path(folder, name)
                record(path, str(path.relative_to(root)))
    return state


@pytest.fixture
def make_trainer(tiny_model_dir, tokenizer, tmp_path):
    """Factory: a GRPOTrainer on a real HFEngine, logging to `run_dir` (None: no run dir), with the
    tiny run's settings (3 steps, file refresh into tmp_path) plus `extra` overrides. The divergence
    bound is off (grpo.max_delta_ratio=0): these tests perturb adapters and use a learning rate far
    beyond a real update's size so that every change shows; the bound has its own tests
    (test_run_dir_trust.py), which set it."""
    from lorabench.runlog import RunLog
    from lorabench.session import build_trainer, start_engine
    from lorabench.session.config import Config
    made = []

    def make(run_dir, *extra, log=lambda *a: None):
        cfg = Config.load(overrides=[o for o in TINY_RUN if not o.startswith("run.threads")] +
                          ["engine.hf.device=cpu", "grpo.steps=3", "grpo.lr=5e-2", "grpo.max_delta_ratio=0",
                           f"refresh.file.tmp_dir={tmp_path}", *extra])
        engine = start_engine(cfg, str(tiny_model_dir))
        made.append(engine)
        runlog = RunLog(run_dir, log, settings=cfg.run) if run_dir else None
        trainer = build_trainer(cfg, str(tiny_model_dir), engine, runlog, tokenizer=tokenizer, log=log)
        trainer.config = cfg     # what it was built from, for the tests' checks
        made.append(trainer)
        return trainer
    yield make
    for obj in reversed(made):
        obj.close()
