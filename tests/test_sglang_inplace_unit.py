"""The in-place refresh's CPU-side plumbing (engines/sglang_internals): the
copy plan's strided blocks, the status reply each scheduler rank writes and the trainer reads, the
command protocol around a mapped adapter, and the layout as it crosses to the engine. The pool
writes themselves run inside SGLang's scheduler and are tested on the GPU (test_sglang_gpu.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lorabench.adapters import AdapterLayout
from lorabench.engines import sglang_internals as pool


# --- the copy plan: index maps -> strided blocks of the staging buffer ---------------------------------
def _plan(idx: torch.Tensor, staging: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run the plan for one pool block whose elements come from staging[idx]; (block, number of copies)."""
    dst = torch.zeros(idx.shape, dtype=staging.dtype)
    dsts, srcs = [], []
    pool._add_blocks(idx, dst, staging, dsts, srcs)
    torch._foreach_copy_(dsts, srcs)
    return dst, len(dsts)


@pytest.mark.parametrize("idx, blocks", [
    (torch.arange(24).view(4, 6), 1),                                         # a whole tensor, row-major
    (torch.arange(48).view(8, 6)[2:6], 1),                                    # a contiguous slice of rows
    (torch.arange(48).view(8, 6)[::2], 1),                                    # every other row: one strided view
    (torch.cat([torch.arange(12).view(2, 6), torch.arange(30, 48).view(3, 6)]), 2),   # stacked q/k pieces
    (torch.arange(40).view(4, 10)[:, 3:7], 1),                                # a column slice (tensor parallel, A)
    (torch.tensor([[7, 8, 9]]), 1),                                           # one row
    (torch.tensor([[5], [9], [13], [30]]), 2),                                # single column, then a jump
])
def test_blocks_copy_exactly_what_the_index_map_says(idx, blocks):
    staging = torch.randn(64)
    dst, n = _plan(idx, staging)
    assert torch.equal(dst, staging[idx])
    assert n == blocks                                                        # as few copies as the map allows


def test_blocks_refuse_a_shape_mismatch_and_gathers():
    staging = torch.randn(64)
    with pytest.raises(pool.Refused, match="max_lora_rank"):
        pool._add_blocks(torch.arange(12).view(3, 4), torch.zeros(4, 3), staging, [], [])
    gather = torch.tensor([[0, 2, 3], [4, 5, 6]])                             # a row that skips an element
    with pytest.raises(pool.Refused, match="non-adjacent"):
        pool._add_blocks(gather, torch.zeros(2, 3), staging, [], [])


def test_plan_of_a_real_layout_round_trips_every_tensor():
    """Index maps made from an AdapterLayout's views (as _build_plan makes them) copy each tensor back."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{h}.weight": torch.randn(
        (4, 16) if h == "A" else (8, 4), generator=gen) for i in range(2) for m in ("q_proj", "v_proj") for h in "AB"}
    layout = AdapterLayout.of(tensors)
    staging = layout.flatten(tensors)
    index = layout.views(torch.arange(layout.numel))
    for name, idx in index.items():
        dst, n = _plan(idx, staging)
        assert torch.equal(dst, tensors[name]) and n == 1


# --- the layout as it travels to the engine --------------------------------------------------------
def test_layout_crosses_as_uint8_and_back():
    layout = AdapterLayout(("a.lora_A.weight", "a.lora_B.weight"), ((2, 3), (4, 2)))
    sent = torch.frombuffer(bytearray(layout.to_json().encode()), dtype=torch.uint8)   # as PoolWriter._map sends it
    received = AdapterLayout.from_json(sent.cpu().numpy().tobytes().decode())           # as pool._map reads it
    assert received == layout and received.numel == 14


# --- status replies and the command protocol ------------------------------------------------------
@pytest.fixture
def on_rank0(monkeypatch):
    """handle() runs inside a scheduler process on its GPU: here device 0 is the CPU, and the stream
    it synchronises before returning has nothing to wait for."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(synchronize=lambda: None))
    saved = dict(pool._plans)
    pool._plans.clear()
    yield
    pool._plans.clear()
    pool._plans.update(saved)


def _send(command: str, lora_id: str = "id7") -> dict:
    status = torch.zeros(pool.STATUS_BYTES, dtype=torch.uint8)
    pool.handle(None, [(f"{pool.PREFIX}{command}/{lora_id}/status/0", status)])
    return pool.read_status(status)


def test_empty_status_means_no_reply():
    assert pool.read_status(torch.zeros(pool.STATUS_BYTES, dtype=torch.uint8)) == {}


def test_commands_on_an_unmapped_adapter_are_refused_with_reasons(on_rank0):
    reply = _send("apply")
    assert reply["refused"].startswith("remap:")          # the trainer maps again: a full write
    assert "not mapped" in _send("version")["refused"]
    forget = _send("forget")                               # forgetting nothing is fine (before an unload)
    assert forget["version"] == -1 and set(forget["ms"]) == {"forget"}


def test_commands_on_a_mapped_adapter(on_rank0):
    version = torch.tensor([5])
    pool._plans["id7"] = pool._Plan(slot=1, buffers=[], dsts=[], srcs=[], version=version,
                                    version_src=torch.tensor([6]), staging=torch.zeros(4))
    reply = _send("version")
    assert reply["version"] == 5 and set(reply["ms"]) == {"version"} and reply["ms"]["version"] >= 0
    assert "id7" in pool._plans
    assert _send("forget")["version"] == 5
    assert "id7" not in pool._plans and _send("version")["refused"]


def test_a_long_refusal_still_reads_as_a_refusal(on_rank0):
    """The reply buffer is fixed-size: a refusal longer than it must still reach the trainer as a
    refusal (cut short), not as unparseable bytes."""
    reply = _send("version", lora_id="x" * (2 * pool.STATUS_BYTES))
    assert reply["refused"].startswith("adapter id xxx")


def test_foreign_tensor_names_are_refused(on_rank0):
    with pytest.raises(ValueError, match="only takes"):
        pool.handle(None, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))])


def test_a_refusal_without_a_status_buffer_fails_loudly(on_rank0):
    """No status buffer: nobody would read the reply, so the refusal becomes an exception in the engine."""
    with pytest.raises(RuntimeError, match="not mapped"):
        pool.handle(None, [(f"{pool.PREFIX}version/id9/status/3", torch.zeros(pool.STATUS_BYTES, dtype=torch.uint8))])


def test_status_reply_is_json_of_known_shape(on_rank0):
    status = torch.zeros(pool.STATUS_BYTES, dtype=torch.uint8)
    pool.handle(None, [(f"{pool.PREFIX}apply/id1/status/0", status)])
    text = bytes(status.numpy()).rstrip(b"\0").decode()
    assert json.loads(text) == pool.read_status(status) and set(json.loads(text)) == {"refused"}


# --- engine.sglang.log_file: where the engine's own processes write ---------------------------------------------
def test_engine_processes_write_to_the_log_file_and_this_process_gets_its_output_back(tmp_path, capfd):
    """What a child started inside the block writes (stdout and stderr, for its whole life) goes to the
    file; this process's own descriptors are restored after it."""
    import subprocess
    import sys

    from lorabench.engines.sglang import child_output_to
    log = tmp_path / "engine.log"
    script = ("import sys, time; print('child out', flush=True); time.sleep(0.3); "
              "print('child err late', file=sys.stderr)")
    with child_output_to(str(log)):
        child = subprocess.Popen([sys.executable, "-c", script])      # inherits descriptors 1 and 2
    print("parent after", flush=True)
    child.wait(timeout=30)
    written = log.read_text()
    assert "child out" in written and "child err late" in written      # also after the block ended
    captured = capfd.readouterr()
    assert "parent after" in captured.out and "child" not in captured.out + captured.err


def test_engine_log_file_in_a_missing_dir_is_refused_with_the_fix(tmp_path):
    from lorabench.engines.base import EngineError
    from lorabench.engines.sglang import child_output_to
    path = tmp_path / "no-such-dir" / "engine.log"
    with pytest.raises(EngineError, match=r"engine.sglang.log_file=.*no-such-dir.*existing, writable directory"):
        with child_output_to(str(path)):
            pass
    assert not path.parent.exists()


def test_empty_log_file_changes_nothing(capfd):
    from lorabench.engines.sglang import child_output_to
    with child_output_to(""):
        print("here", flush=True)
    assert "here" in capfd.readouterr().out


# --- the SGLang releases the in-place writer was verified on ------------------------------------------
def test_inplace_on_an_untested_sglang_names_the_tested_release_and_the_fallback(monkeypatch):
    from lorabench.engines.base import EngineError
    monkeypatch.setattr(pool, "installed", lambda: "0.5.17")
    pool.check_version()
    monkeypatch.setattr(pool, "installed", lambda: "0.5.23")
    with pytest.raises(EngineError) as refused:
        pool.check_version()
    message = str(refused.value)
    assert "\n" not in message and "sglang 0.5.23" in message and "0.5.17" in message
    assert "refresh.mode=tensor" in message and "lorabench[sglang]" in message


def fake_sglang(site, version: str):
    """A site dir where `import sglang` finds an empty package of the given release: only its
    version is read before anything else (the engine itself is never started here)."""
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    dist = site / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")


@pytest.mark.parametrize("mode, refusal", [("inplace", "verified on sglang 0.5.17"), ("tensor", "needs a CUDA GPU")])
def test_the_cli_checks_the_sglang_release_before_anything_exists(tmp_path, mode, refusal):
    """On sglang 0.5.23 (faked), `lorabench run` with in-place refresh stops at once with the one-line
    error; tensor refresh (public API) passes the release check and stops at the next one (no GPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if mode == "tensor" and torch.cuda.is_available():
        pytest.skip("with a GPU, tensor refresh passes every check and the run starts")
    fake_sglang(tmp_path / "site", "0.5.23")
    runs = tmp_path / "runs"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "lorabench.cli", "run", "engine.backend=sglang",
                           f"refresh.mode={mode}", f"run.out_dir={runs}"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(root)])})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and refusal in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not runs.exists()


# --- what an engine that is never written in place sets up, and the notes on another release -----------
def test_the_in_place_writer_is_registered_only_when_the_engine_may_be_written_in_place():
    """A run's engine sets it up for refresh.mode=inplace only; a scratch engine (a benchmark, notebook 02's,
    which switches modes) for any; engine.sglang.in_place=false never."""
    from lorabench.engines.base import EngineNeeds
    from lorabench.engines.sglang import SGLangSettings
    from lorabench.session.config import Config, engine_needs
    assert SGLangSettings().engine_kwargs("/m", EngineNeeds())["custom_weight_loader"] == [pool.LOADER]
    assert "custom_weight_loader" not in SGLangSettings(in_place=False).engine_kwargs("/m", EngineNeeds())
    for mode in ("tensor", "file", "merged", "none", "inplace"):
        cfg = Config.load(None, ["engine.backend=sglang", f"refresh.mode={mode}"])
        run = cfg.engine.sglang.engine_kwargs("/m", engine_needs(cfg, run=True))
        scratch = cfg.engine.sglang.engine_kwargs("/m", engine_needs(cfg, run=False))
        assert ("custom_weight_loader" in run) == (mode == "inplace"), mode
        assert scratch["custom_weight_loader"] == [pool.LOADER], mode


def test_inplace_on_an_engine_without_the_writer_is_refused_before_it_starts(monkeypatch):
    import importlib.util

    from lorabench.engines.base import EngineError, UpdatesAdapterInPlace
    from lorabench.engines.sglang import SGLangEngine, SGLangSettings
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())   # "sglang is installed"
    monkeypatch.setattr(pool, "installed", lambda: "0.5.17")
    with pytest.raises(EngineError, match="engine.sglang.in_place=false"):
        SGLangEngine.check_available(SGLangSettings(in_place=False), (UpdatesAdapterInPlace,))


def test_the_one_pass_sampler_reaches_sglang_as_a_plugin_of_the_installed_package(monkeypatch):
    """engine.sglang.sampling_backend=lorabench reaches SGLang's processes only through the entry point that
    pyproject.toml declares: installed, it loads `register_sampler`; where it cannot be found the setting is
    refused with the fix before anything starts (SGLang would stop its scheduler on the unknown backend)."""
    from importlib.metadata import entry_points

    from lorabench.engines.base import EngineNeeds
    from lorabench.session.config import Config, ConfigError
    (plugin,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "lorabench"]
    assert plugin.load() is pool.register_sampler and plugin.value == pool.SAMPLER_ENTRY
    asked = ["engine.backend=sglang", f"engine.sglang.sampling_backend={pool.SAMPLER}"]
    assert Config.load(None, asked).engine.sglang.engine_kwargs("/m", EngineNeeds())["sampling_backend"] == pool.SAMPLER
    monkeypatch.setattr(pool, "sampler_plugin_found", lambda: False)
    with pytest.raises(ConfigError, match=r"sampling_backend=lorabench.*pip install -e \."):
        Config.load(None, asked)
    Config.load(None, ["engine.backend=sglang", "engine.sglang.sampling_backend=pytorch"])   # SGLang's own: no check
    monkeypatch.setattr(pool, "sampler_plugin_found", lambda: True)
    monkeypatch.setattr(pool, "installed", lambda: "0.5.23")   # its Sampler's internals are unverified there
    with pytest.raises(ConfigError, match=r"sampling_backend=lorabench.*0\.5\.17.*sglang 0\.5\.23; use ''"):
        Config.load(None, asked)


def test_auto_samples_with_the_one_pass_sampler_where_sglang_can_load_it_and_says_why_not_elsewhere(monkeypatch):
    """The default, sampling_backend=auto: the plugin where its entry point is installed on a verified release;
    elsewhere SGLang's own sampler (never a refusal) and one line saying why and what the one pass buys."""
    from lorabench.engines.base import EngineNeeds
    from lorabench.engines.sglang import sampler_note
    from lorabench.session.config import Config
    settings = Config.load(None, ["engine.backend=sglang"]).engine.sglang
    monkeypatch.setattr(pool, "installed", lambda: "0.5.17")
    assert settings.sampling_backend == "auto" and settings.sampler() == pool.SAMPLER
    assert settings.engine_kwargs("/m", EngineNeeds())["sampling_backend"] == pool.SAMPLER
    assert not sampler_note(settings)
    for problem, fix in ((lambda: monkeypatch.setattr(pool, "sampler_plugin_found", lambda: False), "pip install -e ."),
                         (lambda: monkeypatch.setattr(pool, "installed", lambda: "0.5.23"), "sglang 0.5.23")):
        problem()
        assert "sampling_backend" not in settings.engine_kwargs("/m", EngineNeeds())   # SGLang's default
        assert not settings.problems() and fix in sampler_note(settings) and "section 2" in sampler_note(settings)
    pinned = Config.load(None, ["engine.backend=sglang", "engine.sglang.sampling_backend=pytorch"]).engine.sglang
    assert pinned.engine_kwargs("/m", EngineNeeds())["sampling_backend"] == "pytorch" and not sampler_note(pinned)


def test_the_one_pass_sampler_takes_batches_only_where_every_token_has_its_own_random():
    """Each row takes a quarter of its padded length in int32 Philox counters; past 2**31 two rows would share
    randoms (correlated draws), so such a batch goes to SGLang's own sampler. A 64-token vocabulary is padded to
    a 2,048-token block: 5M rows need 2.56e9 counters although 5M x 64 tokens are 3.2e8."""
    from lorabench.engines.one_pass_sampler import fits
    assert fits(torch.empty(1, 151936).expand(2048, 151936))
    assert fits(torch.empty(1, 64).expand(2_000_000, 64))
    assert not fits(torch.empty(1, 64).expand(5_000_000, 64))
    assert not fits(torch.empty(1, 151936).expand(60_000, 151936))
    assert not fits(torch.empty(151936, 4).t())   # a strided vocabulary


def test_another_release_is_noted_for_every_mode_and_its_lora_backends_are_sglangs_to_check(monkeypatch):
    engine = SimpleNamespace(tokenizer_manager=SimpleNamespace(abort_request=lambda **k: None), send_to_rpc=None)
    monkeypatch.setattr(pool, "installed", lambda: "0.5.17")
    assert pool.release_notes(engine) == [] and not pool.lora_backend_known("cutlass")
    monkeypatch.setattr(pool, "installed", lambda: "0.5.23")
    (note,) = pool.release_notes(engine)
    assert "sglang 0.5.23" in note and "0.5.17" in note and "refresh.mode=inplace and" in note
    assert f"sampling_backend={pool.SAMPLER} are refused" in note
    assert "tokenizer_manager._subprocess_watchdog" in note and "Engine._weight_cache_daemon_procs" in note
    assert "abort_request" not in note and pool.lora_backend_known("cutlass")


class _Count:
    """The shape of SGLang's ConcurrentCounter that release_leaked_lora_counts reads (its unload waits for == 0)."""

    def __init__(self, value: int):
        self.count = value

    def value(self) -> int:
        return self.count

    async def decrement(self, n: int = 1) -> None:
        self.count -= n


def test_leaked_adapter_counts_wait_for_outputs_in_transit_and_scheduled_releases():
    """After an abort SGLang's scheduler is idle, but an aborted request's last output may still be on its way
    through the detokenizer (its state not yet gone) and a finished request's release may be a task yet to run.
    Counting before either gave a count back twice (below 0: an unload then waits forever) or not at all."""
    import asyncio
    import time

    from lorabench.engines.base import EngineError
    loop = asyncio.new_event_loop()
    try:
        count = _Count(3)   # 1 leaked by a request aborted in the queue, 1 to be released, 1 in transit
        registry = SimpleNamespace(_counters={"a": count})
        manager = SimpleNamespace(rid_to_state={"late": object()}, lora_registry=registry)
        engine = SimpleNamespace(tokenizer_manager=manager, loop=loop)
        loop.create_task(count.decrement(1))   # a release scheduled while the last call's loop ran

        def arrives():   # the in-transit output: its state goes and its release is scheduled
            manager.rid_to_state.clear()
            loop.create_task(count.decrement(1))
        loop.call_later(0.12, arrives)
        pool.release_leaked_lora_counts(engine, time.monotonic() + 5)
        assert count.value() == 0 and not manager.rid_to_state
        manager.rid_to_state["stuck"] = object()   # never leaves: a clear error instead of a later endless unload
        with pytest.raises(EngineError, match="still tracks 1 request.*interrupted call"):
            pool.release_leaked_lora_counts(engine, time.monotonic() + 0.2)
    finally:
        loop.close()
