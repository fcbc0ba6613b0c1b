"""No open doors: no socket listens (nor any network socket is opened) during a run, adapter
files are private (0700 dirs, 0600 files, also on tmpfs, whatever the umask), run dirs are never
world-writable, and no credential from the environment reaches the run dir or the logs."""
from __future__ import annotations

import ipaddress
import os
import socket
import stat
import threading
from pathlib import Path

import psutil
import pytest
from conftest import load_checkpoint
from reliability_util import TINY_RUN, make_trainer  # noqa: F401 (fixture)


# --- sockets -------------------------------------------------------------------------------------
def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (a dual-stack socket's view of 127.0.0.1)
    return (mapped or addr).is_loopback


def open_sockets(proc: psutil.Process | None = None) -> list:
    """Every inet socket (TCP and UDP, v4 and v6) of this process and its children."""
    proc = proc or psutil.Process()
    found = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            found += p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
    return found


def listening(conns) -> list:
    """Sockets that accept traffic: TCP in LISTEN, UDP bound without a peer."""
    return [c for c in conns if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)]


class SocketWatch:
    """Samples this process's sockets every few ms in a thread while a block runs."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.samples, self.seen = interval, 0, []
        self._stop = threading.Event()

    def _loop(self):
        while not self._stop.is_set():
            self.seen += open_sockets()
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_socket_check_sees_a_listener():
    """The check below can fail: a loopback listener opened here is seen, and told loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with SocketWatch() as watch:
            while watch.samples < 3:
                threading.Event().wait(0.005)
        port = srv.getsockname()[1]
        found = [c for c in listening(watch.seen) if c.laddr.port == port]
        assert found and all(is_loopback(c.laddr.ip) for c in found)
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.7")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("::ffff:10.0.0.1")


def test_no_socket_during_grpo_steps(make_trainer, tmp_path):
    """Trainer + in-process HF engine, file refresh, run dir: nothing listens on any address,
    loopback included, and no network socket is opened at all (no HTTP server, no hub call)."""
    trainer = make_trainer(tmp_path / "run")
    with SocketWatch() as watch:
        trainer.run(2, progress=False)
        trainer.evaluate()
    assert watch.samples > 10
    assert listening(watch.seen) == []
    assert [c for c in watch.seen if not is_loopback(c.laddr.ip)] == []
    assert watch.seen == []
    assert psutil.Process().children(recursive=True) == []     # no server process either


def test_sglang_rendezvous_store_listens_on_loopback_only(monkeypatch):
    """torch's TCPStore server listens on '::' (every interface) whatever host it is given; the
    store SGLangEngine hosts for its scheduler ranks listens on 127.0.0.1 only, serves a rank
    joining as torch would (agent-store client), sets its variables only while the engine starts,
    and stops with the engine. A user's own rendezvous (the override variable) is left alone."""
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.rendezvous import _create_c10d_store

    from lorabench.engines.sglang_internals import LoopbackStore as _LoopbackStore
    monkeypatch.delenv("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    plain = TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))  # the check can fail:
    assert [c for c in listening(open_sockets()) if not is_loopback(c.laddr.ip)]  # torch's own is open
    del plain
    store = _LoopbackStore.for_engine(2)
    try:
        found = listening(open_sockets())
        assert found and all(is_loopback(c.laddr.ip) for c in found), found
        with store.environment():
            url = os.environ["SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"]
            rank0 = _create_c10d_store("127.0.0.1", int(url.rsplit(":", 1)[1]), 0, 2, datetime.timedelta(seconds=10))
            rank0.set("ready", "1")
            assert store.server.get("ready") == b"1"
            del rank0
        assert "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE" not in os.environ
        assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ
    finally:
        store.close()
    assert listening(open_sockets()) == []
    monkeypatch.setenv("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", "env://")
    assert _LoopbackStore.for_engine(2).server is None


# --- file modes ------------------------------------------------------------------------------------
def _fs_type(path: Path) -> str:
    """Filesystem type of `path` from /proc/mounts (longest matching mount point)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if (str(path) + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


@pytest.fixture
def umask_zero():
    """The most permissive umask: every mode checked below must be set explicitly by lorabench."""
    old = os.umask(0)
    yield
    os.umask(old)


def _modes(root: Path):
    return {p: stat.S_IMODE(os.lstat(p).st_mode) for p in [root, *root.rglob("*")]}


def test_file_refresh_dirs_private_on_tmpfs(engine, make_peft_model, umask_zero):
    from lorabench.refresh import FileRefresh
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    refresher = FileRefresh(engine, "policy")                   # the default: /dev/shm when writable
    try:
        assert refresher.root.parent == Path("/dev/shm") and _fs_type(refresher.root) == "tmpfs"
        from synthetic import peft_adapter
        model = make_peft_model()
        for step in (1, 2):
            refresher.refresh(peft_adapter(model, version=step))
            modes = _modes(refresher.root)
            assert len(modes) == 1 + 1 + 2                        # root, one adapter dir, its two files
            for path, mode in modes.items():
                assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    finally:
        refresher.close()
    assert not refresher.root.exists()


def test_run_dir_never_world_writable(make_trainer, tmp_path, umask_zero):
    from lorabench.runlog import RunLog
    trainer = make_trainer(tmp_path / "run", "run.save_adapter_every=1")
    trainer.runlog.write_config(trainer.config.to_dict())
    trainer.run(2, progress=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().splitlines(keepends=True)[0])   # step 2's row lost to a kill
    resumed = RunLog(tmp_path / "run", log=lambda *a: None, lock=True)      # the lock file, and...
    load_checkpoint(resumed)                                       # ...the repair resume makes
    assert [r["step"] for r in resumed.metrics()] == [1, 2]
    modes = _modes(tmp_path / "run")
    assert modes[tmp_path / "run" / "lock"] == 0o640
    resumed.close()
    assert len(modes) > 14                             # files, adapters, checkpoint (no plot: no plots/)
    assert modes[tmp_path / "run"] == 0o750                       # others: no access at all
    bad = {str(p): oct(m) for p, m in modes.items() if m & 0o002}
    assert bad == {}                                              # nothing world-writable...
    adapters = [p for p in modes if "adapters" in p.parts or p.parent.name == "adapter"]
    assert adapters and all(modes[p] == (0o700 if p.is_dir() else 0o600) for p in adapters
                            if p.name not in ("adapters", "checkpoint"))
    assert all(m & 0o007 == 0 for m in modes.values())            # ...nor readable by others


@pytest.mark.parametrize("umask", [0, 0o022, 0o077])
def test_timestamped_run_dir_is_0750_whatever_the_umask(tmp_path, umask):
    """The default run dir (no run.name: a timestamp) used to take the umask's mode (0777 under umask 0);
    it gets 0750 like a named one (the second, made within the same second, is <stamp>-2)."""
    from lorabench.runlog import RunLog
    old = os.umask(umask)
    try:
        logs = [RunLog.create(str(tmp_path / "runs"), log=lambda *a: None, lock=True) for _ in range(2)]
    finally:
        os.umask(old)
    for log in logs:
        log.close()
    assert logs[0].dir != logs[1].dir
    assert [stat.S_IMODE(os.stat(log.dir).st_mode) for log in logs] == [0o750, 0o750]


# --- credentials ------------------------------------------------------------------------------------
SECRETS = {"HF_TOKEN": "hf_SeCrEtToKeN0123456789abcdef", "HUGGING_FACE_HUB_TOKEN": "hf_OtherSecret987654321",
           "WANDB_API_KEY": "wandb-key-5f1e2d3c4b5a", "OPENAI_API_KEY": "sk-test-notreal-abcdef123456"}


def test_no_credentials_in_run_dir_or_logs(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A whole `lorabench run` (in this process) with tokens in the environment: none of them
    appears in any file of the run dir (config, metrics, rollouts, evals, sync, summary,
    checkpoint, adapters, plots) nor in what it prints; and no socket is opened meanwhile."""
    from lorabench.cli import run_experiment
    from lorabench.session.config import Config
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    cfg = Config.load(overrides=[o for o in TINY_RUN if not o.startswith(("run.threads", "grpo.steps"))] + [
        "grpo.steps=2", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=run",
        f"refresh.file.tmp_dir={tmp_path / 'shm'}"])
    (tmp_path / "shm").mkdir()
    with SocketWatch() as watch:
        summary = run_experiment(cfg)
    printed = capsys.readouterr()
    run_dir = Path(summary["run_dir"])
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 10 and any(p.suffix == ".png" for p in files) and any(p.suffix == ".pt" for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in data, (name, path)
    for value in SECRETS.values():
        assert value not in printed.out and value not in printed.err
    assert watch.seen == [] and watch.samples > 10
    assert stat.S_IMODE(os.stat(run_dir).st_mode) & 0o002 == 0
    assert all(stat.S_IMODE(os.stat(p).st_mode) & 0o002 == 0 for p in [*files, *run_dir.rglob("*")])
