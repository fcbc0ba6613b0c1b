"""The notebooks in a real browser, as a learner meets them: JupyterLab served on 127.0.0.1
(random port, random token) and driven in headless Chromium (Playwright, Debian's /usr/bin/chromium)
at 1400 px wide. Each notebook, with the tests' small parameters injected, is run from the Run
menu (Run All Cells); after notebook 01's Run All its panel must still work: Step, then Run N
stopped by Stop, then its "Close the session" button, which must disable the panel and show the
resume command. Fails on any visible stderr box (a warning, a log line, a traceback)
or widget error, and on figure text under 8 px as rendered: the tests' kernel records in each
figure's PNG its smallest text in pixels at the PNG's own size (figure_text_size), scaled here by the
width the browser gave it.
Each figure is saved as a screenshot. With LORABENCH_RECORD=1 the notebooks run at their learner
defaults instead (what a learner sees; ~4 minutes on 2 cores with the tiny model cached) and the
screenshots are copied to benchmarks/results/browser_<notebook>_<figure>.png. Each notebook is saved by
JupyterLab once it ran (its outputs: what the run showed); LB_BROWSER_KEEP_DIR=DIR keeps a copy there.
The markdown outputs each notebook rendered (sentences a lesson computes from its run) are printed,
and each claim/number pairing in them is checked (tests/lesson_claims.py: a verdict agrees with the
numbers it quotes; the reveal after each prediction names what the numbers show).
The server and its kernels are shut down in the fixture's teardown."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import lesson_claims
import nbformat
import papermill
import pytest
from notebook_helpers import MIN_TEXT_PX, NOTEBOOKS, ROOT, SMALL, describe_png, parameterized, write_kernelspec

CHROMIUM = "/usr/bin/chromium"
RECORD_DIR = ROOT / "benchmarks" / "results"
RECORD = bool(os.environ.get("LORABENCH_RECORD"))
PARAMETERS = {p.stem: {} if RECORD else SMALL[p.stem] for p in NOTEBOOKS}   # injected; {} = the learner's
REWARD_BLUE = (0x4C, 0x72, 0xB0)   # viz.plot_rewards' line colour
VIEWPORT = {"width": 1400, "height": 1800}   # tall enough for notebook 01's whole panel in one screenshot
RUN_TIMEOUT_MS = int(os.environ.get("LB_BROWSER_RUN_TIMEOUT_MS", 300_000))
STDERR = "[data-mime-type='application/vnd.jupyter.stderr']"   # stderr streams and tracebacks
MARKDOWN = "[data-mime-type='text/markdown']"   # a lesson's computed sentences

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (`make test` installs it: "
                                                              "pip install -r tests/browser_requirements.txt)")
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


def lab_settings(settings_dir) -> None:
    """Every cell in the DOM (no virtual scrolling), the default kernel started, no news fetched."""
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = settings_dir / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a random token, serving a temp dir holding the notebooks
    with the small parameters injected (01's runs go to the temp dir); isolated config."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    for path in NOTEBOOKS:
        # 03 reads the run dir 01 leaves there (only reads it)
        extra = {"01_step_through": {"RUN_ROOT": str(tmp / "runs")},
                 "03_how_hotswap_works": {"RUN_ROOT": str(tmp / "runs")}}.get(path.stem, {})
        nbformat.write(parameterized(path, **PARAMETERS[path.stem], **extra), root / path.name)
    lab_settings(tmp / "lab-settings")
    env = {**os.environ, "JUPYTER_PATH": str(write_kernelspec(tmp / "jupyter")),
           "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces")}
    port, token = free_port(), secrets.token_hex(24)
    log = open(tmp / "jupyter.log", "w")
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
                assert server.poll() is None, (tmp / "jupyter.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "jupyter lab did not answer within 90 s"
                time.sleep(0.5)
        yield {"base": base, "token": token, "pid": server.pid, "log": tmp / "jupyter.log", "runs": tmp / "runs",
               "tmp": tmp}
    finally:
        shutdown_kernels(base, token)
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()


def shutdown_kernels(base: str, token: str) -> None:
    try:
        for kernel in api(f"{base}/api/kernels", token) or []:
            api(f"{base}/api/kernels/{kernel['id']}", token, method="DELETE")
    except OSError:
        pass


@pytest.fixture(scope="module")
def browser(lab):
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(lab["tmp"] / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()


def listening_addresses(pid: int) -> set[str]:
    """Where the server and its children listen; a child that ends while it is looked at (the
    server starts short-lived ones) listens nowhere."""
    import psutil
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    found = set()
    for proc in procs:
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return found


# --- driving JupyterLab ---------------------------------------------------------------------------
def open_notebook(browser, lab, name: str):
    page = browser.new_page()
    # a workspace of its own, reset: only this notebook is open
    page.goto(f"{lab['base']}/lab/workspaces/{name.split('.')[0]}/tree/{name}?reset&token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=120_000)
    select_kernel = page.locator(".jp-Dialog button", has_text="Select")
    try:  # JupyterLab may still ask which kernel to start; the notebook's own is preselected
        select_kernel.wait_for(timeout=5_000)
        select_kernel.click()
    except sync_api.TimeoutError:
        pass
    page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=120_000)
    return page


def run_menu(page, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def wait_for_self_check(page) -> None:
    page.get_by_text("self-check: all").or_(page.locator(STDERR)).first.wait_for(timeout=RUN_TIMEOUT_MS)


def visible_problems(page) -> list[str]:
    """Stderr boxes (warnings, logs, tracebacks) and widget errors on the page."""
    problems = [f"stderr box: {t[:500]!r}" for t in page.locator(STDERR).all_inner_texts()]
    for text in ("Error displaying widget", "Error rendering output item", "model not found"):
        if page.get_by_text(text).count():
            problems.append(f"widget error: {text}")
    return problems


# the PNG bytes behind an <img> (a data: URL for inline figures, a blob: URL for an image widget)
PNG_OF_IMG = """async (img) => {
    const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
    let text = "";
    for (const b of bytes) text += String.fromCharCode(b);
    return [btoa(text), img.naturalWidth, img.getBoundingClientRect().width];
}"""


def check_figures(page, stem: str, shots_dir) -> list[dict]:
    """Every figure on the page: its text size as rendered (>= 8 px asserted by the caller), and a
    screenshot named after the notebook and the figure."""
    seen: dict[str, int] = {}
    found = []
    for img in page.locator(".jp-RenderedImage img, .lorabench-step-panel img").all():
        img.scroll_into_view_if_needed()
        page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=img.element_handle())
        png, natural, shown = img.evaluate(PNG_OF_IMG)
        info = describe_png(base64.b64decode(png))
        name = info["figure"] or "unnamed"
        seen[name] = seen.get(name, 0) + 1
        shot = shots_dir / f"browser_{stem}_{name}{'' if seen[name] == 1 else f'_{seen[name]}'}.png"
        panel = img.locator("xpath=ancestor::div[contains(@class, 'lorabench-step-panel')]")
        (panel if panel.count() else img).screenshot(path=str(shot))   # the whole panel: buttons, lines, tables
        scale = shown / natural
        found.append({**info, "shot": shot, "scale": scale,
                      "text_px": info["min_text_px"] * scale if info["min_text_px"] is not None else None})
    return found


def blue_pixels(png: bytes) -> tuple[int, float]:
    """Pixels close to the reward line's colour, and the grey-level spread of the image."""
    import numpy as np
    from PIL import Image
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)        # [H, W, 3]
    near = int((np.abs(rgb - np.array(REWARD_BLUE)).sum(-1) < 60).sum())
    return near, float(rgb.mean(-1).std())


def steps_done(panel) -> int:
    return int(panel.get_by_text("steps done:").inner_text().split(":")[1])


def step_through(page, lab) -> dict:
    """Notebook 01: Run All; then the panel, still live: Step (the plot redrawn), Run N with a large N
    stopped at once by Stop, and last the "Close the session" button."""
    defaults = papermill.inspect_notebook(str(ROOT / "notebooks" / "01_step_through.ipynb"))

    def parameter(name: str) -> int:
        return PARAMETERS["01_step_through"].get(name) or int(defaults[name]["default"])
    steps = parameter("STEPS") + parameter("EXERCISE_STEPS")   # the panel's run, then the steps with your reward
    load, t0 = os.getloadavg(), time.perf_counter()
    run_menu(page, "Run All Cells")
    wait_for_self_check(page)
    print(f"01_step_through Run All: {time.perf_counter() - t0:.0f} s (1-minute load average {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after)")
    assert visible_problems(page) == []
    for computed in ("What this run learned", "What breaking it showed"):   # the lesson's own verdicts, for the log
        print(page.locator(".jp-RenderedMarkdown", has_text=computed).first.inner_text())
    panel = page.locator(".lorabench-step-panel")
    panel.get_by_text(f"steps done: {steps}").wait_for(timeout=30_000)
    step_button = panel.locator("button", has_text="Step").first
    assert step_button.is_enabled(), "Run All left the panel dead: closing the session is the learner's step"
    plot = panel.locator("img").first
    before = plot.get_attribute("src")
    step_button.click()
    panel.get_by_text(f"steps done: {steps + 1}").wait_for(timeout=120_000)
    page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=plot.element_handle())
    assert plot.get_attribute("src") != before, "the plot was not redrawn after Step"
    near, spread = blue_pixels(plot.screenshot())
    assert near > 100 and spread > 10, f"no reward line in the rendered plot ({near} pixels of its colour)"
    panel.locator("input").first.fill("50")
    panel.locator("input").first.press("Enter")
    panel.locator("button", has_text="Run N").first.click()
    panel.locator("button", has_text="Stop").first.click()
    stopped = panel.get_by_text(re.compile(r"stopped after \d+ of 50 step"))
    stopped.wait_for(timeout=RUN_TIMEOUT_MS)
    ran = int(re.search(r"stopped after (\d+) of 50", stopped.inner_text()).group(1))
    page.wait_for_function("(b) => !b.disabled", arg=step_button.element_handle(), timeout=120_000)
    assert ran < 50 and steps_done(panel) == steps + 1 + ran, (ran, steps_done(panel))
    page.locator(".lorabench-session-closer button", has_text="Close the session").click()
    page.locator(".lorabench-session-closer").get_by_text("lorabench resume").wait_for(timeout=120_000)
    assert step_button.is_disabled(), "the closed session's panel still steps"
    rows = [json.loads(line) for line in next(lab["runs"].iterdir()).joinpath("metrics.jsonl").read_text().splitlines()]
    return {"steps": [r["step"] for r in rows], "expected": list(range(1, steps + 2 + ran))}


def save_executed(page, lab, name: str):
    """The notebook as the browser ran it, saved by JupyterLab (File > Save Notebook) over its copy in
    the lab's root dir, once its last code cell (the self-check) has outputs there: what this run
    showed, the numbers its sentences quote included."""
    path = lab["tmp"] / "root" / name

    def last_cell_saved() -> bool:
        try:
            notebook = nbformat.read(path, as_version=4)
        except nbformat.reader.NotJSONError:   # read while JupyterLab was writing it: not saved yet
            return False
        code = [c for c in notebook.cells if c.cell_type == "code"]
        return bool(code and code[-1].get("outputs"))
    page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Save Notebook$")).first.click()
    deadline = time.monotonic() + 60
    while not last_cell_saved():
        assert time.monotonic() < deadline, f"JupyterLab did not save {name} within 60 s"
        time.sleep(0.5)
    return path


def test_server_listens_on_loopback_with_a_token(lab):
    assert listening_addresses(lab["pid"]) == {"127.0.0.1"}, "the server must listen on loopback only"
    with pytest.raises(urllib.error.HTTPError):   # no token, no access
        urllib.request.urlopen(f"{lab['base']}/api/contents", timeout=10)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_in_chromium(lab, browser, path):
    page = open_notebook(browser, lab, path.name)
    try:
        if path.stem == "01_step_through":
            run = step_through(page, lab)
            assert run["steps"] == run["expected"], "the clicked step did not reach the run dir"
        else:
            run_menu(page, "Run All Cells")
            wait_for_self_check(page)
        assert visible_problems(page) == []
        executed = save_executed(page, lab, path.name)
        if os.environ.get("LB_BROWSER_KEEP_DIR"):   # a copy of what this run showed, kept past pytest's tmp dirs
            shutil.copyfile(executed, os.path.join(os.environ["LB_BROWSER_KEEP_DIR"], path.name))
        shots = lab["tmp"] / "shots"
        shots.mkdir(exist_ok=True)
        shown = check_figures(page, path.stem, shots)
        # what the lesson's text said on this run (its sentences computed from the run): `-s` shows it
        said = page.locator(f".jp-OutputArea-output{MARKDOWN}").all_inner_texts()
        print(f"{path.stem} said, as rendered:\n" + "\n".join(said))
        # each verdict sentence agrees with the numbers it quotes, as the learner reads them
        assert lesson_claims.problems(path.stem, "\n".join(said)) == []
    except Exception:
        failure = lab["tmp"] / f"failure_{path.stem}.png"
        page.screenshot(path=str(failure), full_page=True)
        print(f"screenshot at failure: {failure}\nserver log tail:\n{lab['log'].read_text()[-2000:]}")
        raise
    finally:
        page.close()
        shutdown_kernels(lab["base"], lab["token"])
    assert shown, f"{path.name}: no figure rendered"
    small = [(f["figure"], f["text_px"]) for f in shown if f["text_px"] is None or f["text_px"] < MIN_TEXT_PX]
    assert small == [], f"figure text under {MIN_TEXT_PX} px at {VIEWPORT['width']} px: {small}"
    print({f["shot"].name: f"text >= {f['text_px']:.1f} px (scale {f['scale']:.2f})" for f in shown})
    if RECORD:  # refresh the committed screenshots only on request
        for f in shown:
            shutil.copyfile(f["shot"], RECORD_DIR / f["shot"].name)
