"""The step-through notebook in a real browser: JupyterLab served on 127.0.0.1 (random port, random
token), notebook 01 opened in headless Chromium (Playwright driving Debian's /usr/bin/chromium),
Run All, the widget panel rendered, one Step clicked, a screenshot saved and checked for the
rendered reward plot. The server (and its kernel) are shut down in the fixture's teardown."""
from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from notebook_helpers import NOTEBOOK_DIR, ROOT, inject_parameters, write_kernelspec

CHROMIUM = "/usr/bin/chromium"
RECORD = ROOT / "benchmarks" / "results" / "browser_step_through.png"
REWARD_BLUE = (0x4C, 0x72, 0xB0)   # viz.plot_rewards' line colour
STEPS = 1                          # Run All runs one step; the test clicks Step for the second

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"{CHROMIUM} not found (apt-get install chromium)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, token: str, method: str = "GET"):
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
        return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 with a random token, serving a temp dir that holds notebook 01
    (its runs go to the temp dir too); isolated config, settings and workspaces."""
    root = tmp_path / "root"
    root.mkdir()
    nb = inject_parameters(nbformat.read(NOTEBOOK_DIR / "01_step_through.ipynb", as_version=4),
                           RUN_ROOT=str(tmp_path / "runs"), STEPS=STEPS)
    nbformat.write(nb, root / "01_step_through.ipynb")
    settings = tmp_path / "lab-settings"
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none",    # every cell in the DOM
                                                           "autoStartDefaultKernel": True},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    jupyter_dir = write_kernelspec(tmp_path / "jupyter")
    env = {**os.environ, "JUPYTER_PATH": str(jupyter_dir), "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    port, token = free_port(), secrets.token_hex(24)
    log = open(tmp_path / "jupyter.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],   # CI containers run as root
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                api(f"{base}/api/status", token)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "jupyter.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "jupyter lab did not answer within 90 s"
                time.sleep(0.5)
        yield {"base": base, "token": token, "pid": server.pid, "log": tmp_path / "jupyter.log",
               "runs": tmp_path / "runs", "tmp": tmp_path}
    finally:
        try:
            for kernel in api(f"{base}/api/kernels", token) or []:
                api(f"{base}/api/kernels/{kernel['id']}", token, method="DELETE")
        except OSError:
            pass
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


def listening_addresses(pid: int) -> set[str]:
    import psutil
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return {c.laddr.ip for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def blue_pixels(png: bytes) -> tuple[int, float]:
    """Pixels close to the reward line's colour, and the grey-level spread of the image."""
    import numpy as np
    from PIL import Image
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)        # [H, W, 3]
    near = int((np.abs(rgb - np.array(REWARD_BLUE)).sum(-1) < 60).sum())
    return near, float(rgb.mean(-1).std())


def test_step_through_notebook_in_chromium(lab):
    assert listening_addresses(lab["pid"]) == {"127.0.0.1"}, "the server must listen on loopback only"
    with pytest.raises(urllib.error.HTTPError):   # no token, no access
        urllib.request.urlopen(f"{lab['base']}/api/contents", timeout=10)

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(lab["tmp"] / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            viewport={"width": 1400, "height": 1100})
        try:
            page = browser.new_page()
            page.goto(f"{lab['base']}/lab/tree/01_step_through.ipynb?token={lab['token']}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
            select_kernel = page.locator(".jp-Dialog button", has_text="Select")
            try:  # JupyterLab may still ask which kernel to start; the notebook's own is preselected
                select_kernel.wait_for(timeout=5_000)
                select_kernel.click()
            except sync_api.TimeoutError:
                pass
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            # Run All done: the last code cell printed its check
            page.get_by_text(f"metrics.jsonl has {STEPS} rows").wait_for(timeout=int(os.environ.get("LB_BROWSER_RUN_TIMEOUT_MS", 300_000)))
            panel = page.locator(".lorabench-step-panel")
            panel.wait_for(timeout=30_000)
            label = panel.get_by_text(f"steps done: {STEPS}")
            label.wait_for(timeout=30_000)
            plot = panel.locator("img").first
            before = plot.get_attribute("src")

            panel.locator("button", has_text="Step").first.click()
            panel.get_by_text(f"steps done: {STEPS + 1}").wait_for(timeout=120_000)
            page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=plot.element_handle())
            panel.scroll_into_view_if_needed()
            shot = lab["tmp"] / "browser_step_through.png"
            panel.screenshot(path=str(shot))
            size = plot.evaluate("img => [img.naturalWidth, img.naturalHeight]")
            after = plot.get_attribute("src")
            plot_png = plot.screenshot()
        except Exception:
            failure = lab["tmp"] / "failure.png"
            page.screenshot(path=str(failure), full_page=True)
            print(f"screenshot at failure: {failure}\nserver log tail:\n{lab['log'].read_text()[-2000:]}")
            raise
        finally:
            browser.close()

    assert size[0] > 300 and size[1] > 200, f"reward plot not rendered: natural size {size}"
    assert after != before, "the plot was not redrawn after Step"
    near, spread = blue_pixels(plot_png)
    assert near > 100, f"no reward line in the rendered plot ({near} pixels of its colour)"
    assert spread > 10, "the plot area is blank"
    if os.environ.get("LORABENCH_RECORD"):  # refresh the committed record only on request
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, RECORD)
    rows = [json.loads(line) for line in next(lab["runs"].iterdir()).joinpath("metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 2)), "the clicked step did not reach the run dir"
