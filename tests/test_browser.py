"""Browser test: JupyterLab (headless, loopback) runs notebooks/01_quickstart.ipynb
in Debian's Chromium driven by Playwright; the page must show a rendered plotly
step timeline and the stepper widget (buttons + live FigureWidget timeline).

How it drives JupyterLab:
  * `python -m jupyterlab` on 127.0.0.1:<free port> with a random token, its root
    a temporary copy of notebooks/, its own settings/workspaces/runtime dirs
    (windowing mode "none" so every cell stays in the DOM, no news/update checks)
    and `expose_app_in_browser`, so the test can call JupyterLab commands through
    `window.jupyterapp` (no clicking through menus);
  * Chromium (/usr/bin/chromium, never a browser downloaded by Playwright) opens
    /lab/tree/01_quickstart.ipynb, waits for the kernel, runs
    `notebook:run-all-cells` and waits for the outputs to render;
  * a screenshot of the whole notebook goes to <tmp>/quickstart.png (copied to
    $DISTFLOW_HOME/runs/browser/ when that is set), plus element shots of the
    timeline and the stepper;
  * teardown: POST /api/shutdown, then the JupyterLab process tree and anything
    left of the kernel's Ray cluster (found by its private RAY_TMPDIR) is killed;
    a Ray process still alive after the shutdown fails the test.

Skipped when Chromium or Playwright is missing, unless $CI is set (then it fails:
CI installs Chromium, see .ci/run, and Playwright comes with the `dev` extra).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import REPO, free_port, procs_matching, reap

NOTEBOOK = "01_quickstart.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_S = 420      # run-all-cells on a busy 2-core machine (ci notebook size)
SERVER_TIMEOUT_S = 120   # JupyterLab answering /api/status
KERNEL_TIMEOUT_S = 180   # page loaded, notebook open, kernel idle
RENDER_TIMEOUT_S = 120   # outputs rendered after the last cell finished
VIEWPORT = {"width": 1400, "height": 1000}
MAX_SHOT_HEIGHT = 15000  # Chromium's screenshot limit is ~16k px

pytestmark = [pytest.mark.timeout(900), pytest.mark.full,
              pytest.mark.budget(420, reason="JupyterLab, Chromium and a kernel with its own Ray cluster: the quickstart "
                                             "run as a user runs it, once (tests/test_notebooks.py skips it)")]


def _missing_browser_tools() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found (Debian: apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def browser_tools():
    why = _missing_browser_tools()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {why}")
        pytest.skip(why)


def _api(base: str, token: str, path: str, method: str = "GET", timeout: float = 10.0):
    req = urllib.request.Request(f"{base}{path}", method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
        return r.status, (json.loads(body) if body.strip() else None)


def _write_settings(settings_dir: Path) -> None:
    """User settings of this JupyterLab only: every cell attached (no windowing),
    no news or update checks (closed network), no autosave into the copy."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "scrollPastEnd": False},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    }
    for rel, value in files.items():
        p = settings_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(value))


class Lab:
    """A JupyterLab server in a subprocess, isolated in `work`."""

    def __init__(self, root: Path, work: Path, ray_tmp: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.ray_tmp = ray_tmp
        settings = work / "lab-settings"
        _write_settings(settings)
        for d in ("lab-workspaces", "jupyter-config", "jupyter-data", "jupyter-runtime", "ipython", "home"):
            (work / d).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            DISTFLOW_NOTEBOOK_SIZE="ci", DISTFLOW_HOME=str(work / "home"),
            RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false", RAY_TMPDIR=str(ray_tmp),
            JUPYTER_CONFIG_DIR=str(work / "jupyter-config"), JUPYTER_DATA_DIR=str(work / "jupyter-data"),
            JUPYTER_RUNTIME_DIR=str(work / "jupyter-runtime"), IPYTHONDIR=str(work / "ipython"),
            PYTHONUNBUFFERED="1",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        env.pop("RAY_ADDRESS", None)  # the notebook must start its own loopback cluster
        cmd = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
            "--ServerApp.open_browser=False",
            f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={work / 'lab-workspaces'}",
            "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
        ] + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])
        self.log_path = work / "jupyterlab.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = SERVER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _ = _api(self.base, self.token, "/api/status")
                if status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise AssertionError(f"JupyterLab did not answer /api/status within {timeout}s:\n{self.log_tail()}")

    def ray_processes(self) -> list:
        return procs_matching(str(self.ray_tmp))

    def shutdown(self) -> list[str]:
        """Stop the server (API, then signals) and everything it started. Returns
        descriptions of Ray processes that outlived the server's own shutdown."""
        import psutil

        try:
            tree = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        try:
            _api(self.base, self.token, "/api/shutdown", method="POST")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        # Ray's processes leave with the kernel; give them a moment.
        deadline = time.monotonic() + 30
        while self.ray_processes() and time.monotonic() < deadline:
            time.sleep(1.0)
        leftover = []
        for p in self.ray_processes():
            try:
                leftover.append(f"pid {p.pid}: {' '.join(p.cmdline())[:160]}")
            except psutil.NoSuchProcess:
                pass
        reap(list({p.pid: p for p in tree + self.ray_processes()}.values()), grace_s=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()
        return leftover


# --- page side -------------------------------------------------------------------------------------

_OPEN_JS = """async () => {
  const app = window.jupyterapp;
  if (!app) return 'no window.jupyterapp';
  await app.started; await app.restored;
  const w = app.shell.currentWidget;
  if (!w || !w.sessionContext || !w.context) return 'no notebook panel';
  await w.context.ready;
  return 'ok';
}"""

# 'idle' once the kernel is up; a kernel dialog (e.g. "Select Kernel" when the notebook's
# kernelspec is unknown here) is accepted with its default choice.
_KERNEL_STATE_JS = """() => {
  const accept = document.querySelector('.jp-Dialog .jp-Dialog-button.jp-mod-accept');
  if (accept) { accept.click(); return 'dialog accepted'; }
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  if (!k) return 'no kernel';
  return k.connectionStatus === 'connected' ? k.status : k.connectionStatus;
}"""

_RUN_ALL_JS = """() => {
  const app = window.jupyterapp;
  app.shell.collapseLeft();
  window.__runAll = {done: false, result: null, error: null};
  app.commands.execute('notebook:run-all-cells').then(
    r => { window.__runAll.done = true; window.__runAll.result = r; },
    e => { window.__runAll.done = true; window.__runAll.error = String(e); });
  return true;
}"""

# After run-all: per code cell, its execution count and any error outputs (from the model).
_CELLS_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const cells = w.content.model.cells;
  const out = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    const outputs = c.outputs ? c.outputs.toJSON() : [];
    out.push({index: i, count: c.executionCount,
              source: c.sharedModel.getSource().slice(0, 200),
              errors: outputs.filter(o => o.output_type === 'error')
                             .map(o => o.ename + ': ' + o.evalue)});
  }
  return out;
}"""

# What is rendered: plotly figures (title, trace names, drawn bars) and the stepper.
_RENDERED_JS = """() => {
  const text = el => (el.textContent || '').trim();
  const plots = Array.from(document.querySelectorAll('.jp-OutputArea .js-plotly-plot')).map((el, i) => {
    el.setAttribute('data-dfl-plot', String(i));  // for element screenshots
    const lay = el.layout || {};
    const title = typeof lay.title === 'string' ? lay.title : ((lay.title && lay.title.text) || '');
    const svgTitle = el.querySelector('.gtitle');
    return {
      title: title || (svgTitle ? text(svgTitle) : ''),
      traces: (el.data || []).map(t => (t.type || '') + ':' + (t.name || '')),
      bars: el.querySelectorAll('.barlayer .point path').length,
      svg: !!el.querySelector('svg.main-svg'),
      height: el.getBoundingClientRect().height,
      inWidget: !!el.closest('.jupyter-widgets, .widget-vbox, .jp-LinkedOutputView, .widget-subarea'),
    };
  });
  const steppers = [];
  for (const box of document.querySelectorAll('.jp-OutputArea-output .widget-vbox')) {
    if (box.parentElement && box.parentElement.closest('.widget-vbox')) continue;  // outermost only
    const buttons = Array.from(box.querySelectorAll('button')).map(text);
    if (!buttons.includes('step stage')) continue;
    const plot = box.querySelector('.js-plotly-plot');
    box.setAttribute('data-dfl-stepper', String(steppers.length));
    steppers.push({
      buttons,
      plot: !!(plot && plot.querySelector('svg.main-svg')),
      plotBars: plot ? plot.querySelectorAll('.barlayer .point path').length : 0,
      plotTitle: plot && plot.layout && plot.layout.title ? (plot.layout.title.text || '') : '',
      height: box.getBoundingClientRect().height,
    });
  }
  const body = document.body.innerText;
  return {
    plots, steppers,
    widgetErrors: ['Error displaying widget', 'Error rendering output', 'Failed to display'].filter(s => body.includes(s)),
    loadingWidgets: document.querySelectorAll('.jupyter-widgets-view-loading, .jp-OutputArea-output .lm-Widget .fa-spinner').length,
  };
}"""

# Height the viewport needs to show the whole notebook (it scrolls inside its panel).
_NOTEBOOK_HEIGHT_JS = """() => {
  const n = window.jupyterapp.shell.currentWidget.content.node;
  const els = [n, ...n.querySelectorAll('.jp-WindowedPanel-outer, .jp-WindowedPanel-inner, .jp-WindowedPanel-viewport')];
  const hidden = Math.max(0, ...els.map(e => e.scrollHeight - e.clientHeight));
  return Math.ceil(window.innerHeight + hidden + 40);
}"""


def _timeline_ok(p: dict) -> bool:
    title = (p["title"] or "").lower()
    return (p["svg"] and p["bars"] > 0 and ("timeline" in title or "batch" in title)
            and any(t.endswith(":compute") for t in p["traces"]))


def _rendered_ok(r: dict) -> bool:
    timeline = any(_timeline_ok(p) and not p["inWidget"] for p in r["plots"])
    stepper = any({"step stage", "step", "run N"} <= set(s["buttons"]) and s["plot"] for s in r["steppers"])
    return timeline and stepper and not r["widgetErrors"]


def _png_check(path: Path) -> tuple[int, int]:
    """A real, non-blank PNG: signature, size, and more than a handful of distinct
    byte values in the inflated IDAT chunks (zlib: no Pillow needed)."""
    import zlib

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert len(data) > 20_000, f"{path} is only {len(data)} bytes"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 800 and height >= 600, f"{path} is only {width}x{height}"
    idat, pos = bytearray(), 8
    while pos < len(data):
        n, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    distinct = len(set(zlib.decompress(bytes(idat))))
    assert distinct > 32, f"{path} looks blank ({distinct} distinct byte values)"
    return width, height


def run_notebook_in_browser(notebook: Path, tmp: Path) -> dict:
    """Open `notebook` in JupyterLab in headless Chromium, run all cells, check
    the timeline and the stepper are rendered and take screenshots. Returns
    what the page showed and where the screenshots are."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    root, work = tmp / "notebooks", tmp / "work"
    shutil.copytree(notebook.parent, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    work.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="dfl-br-", dir="/tmp"))  # short: Ray's socket paths max 107 chars
    shot = tmp / "quickstart.png"
    t0 = time.monotonic()
    lab = Lab(root, work, ray_tmp)
    result: dict = {"screenshot": shot}
    leftover: list[str] = []
    page = None
    try:
        lab.wait_ready()
        result["server_s"] = time.monotonic() - t0
        with sync_playwright() as pw:
            profile = tmp / "chromium-profile"
            ctx = pw.chromium.launch_persistent_context(
                str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                viewport=VIEWPORT, device_scale_factor=1)
            try:
                page = ctx.new_page()
                console: list[str] = []
                page.on("console", lambda m: console.append(f"{m.type}: {m.text}"[:300])
                        if m.type in ("error", "warning") else None)
                page.on("pageerror", lambda e: console.append(f"pageerror: {e}"[:300]))
                page.set_default_timeout(KERNEL_TIMEOUT_S * 1000)
                page.goto(f"{lab.base}/lab/tree/{notebook.name}?token={lab.token}",
                          wait_until="domcontentloaded", timeout=KERNEL_TIMEOUT_S * 1000)
                page.wait_for_function("() => !!window.jupyterapp", timeout=KERNEL_TIMEOUT_S * 1000)
                page.wait_for_function(
                    "() => { const w = window.jupyterapp.shell.currentWidget;"
                    " return !!(w && w.sessionContext && w.content && w.content.model); }",
                    timeout=KERNEL_TIMEOUT_S * 1000)
                opened = page.evaluate(_OPEN_JS)
                assert opened == "ok", f"notebook did not open: {opened}"
                deadline, state, seen = time.monotonic() + KERNEL_TIMEOUT_S, "", []
                while time.monotonic() < deadline:
                    state = page.evaluate(_KERNEL_STATE_JS)
                    if not seen or seen[-1] != state:
                        seen.append(state)
                    if state == "idle":
                        break
                    page.wait_for_timeout(500)
                assert state == "idle", f"kernel not idle after {KERNEL_TIMEOUT_S}s: {seen}\n{lab.log_tail()}"
                result["kernel_s"] = time.monotonic() - t0

                t_run = time.monotonic()
                page.evaluate(_RUN_ALL_JS)
                try:
                    page.wait_for_function("() => window.__runAll.done", timeout=RUN_TIMEOUT_S * 1000,
                                           polling=1000)
                except PlaywrightTimeout:
                    cells = page.evaluate(_CELLS_JS)
                    pending = [f"cell {c['index']}: {c['source'][:80]!r}" for c in cells if c["count"] is None]
                    raise AssertionError(f"run-all did not finish within {RUN_TIMEOUT_S}s; not executed (yet):\n"
                                         + "\n".join(pending)) from None
                result["run_s"] = time.monotonic() - t_run
                run_all = page.evaluate("() => window.__runAll")
                cells = page.evaluate(_CELLS_JS)
                errors = [f"cell {c['index']}: {e}\n    {c['source']}" for c in cells for e in c["errors"]]
                assert not errors, "cells raised:\n" + "\n".join(errors)
                assert run_all["error"] is None and run_all["result"] is not False, f"run-all failed: {run_all}"
                unrun = [c["index"] for c in cells if c["count"] is None and c["source"].strip()]
                assert not unrun, f"code cells not executed: {unrun}"
                result["cells"] = len(cells)

                try:
                    page.wait_for_function(f"() => ({_RENDERED_JS})().plots.length > 0",
                                           timeout=RENDER_TIMEOUT_S * 1000, polling=1000)
                    deadline = time.monotonic() + RENDER_TIMEOUT_S
                    rendered = page.evaluate(_RENDERED_JS)
                    while not _rendered_ok(rendered) and time.monotonic() < deadline:
                        page.wait_for_timeout(1000)
                        rendered = page.evaluate(_RENDERED_JS)
                except Exception:
                    rendered = page.evaluate(_RENDERED_JS)
                result["rendered"] = rendered
                page.wait_for_timeout(1500)  # let plotly finish transitions before the shot

                # Grow the viewport to the whole notebook (JupyterLab scrolls inside the panel, so a
                # plain full-page shot would only show the first screen), then shoot.
                for _ in range(3):  # re-measure: outputs reflow when the viewport grows
                    height = min(page.evaluate(_NOTEBOOK_HEIGHT_JS), MAX_SHOT_HEIGHT)
                    if height <= page.viewport_size["height"]:
                        break
                    page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
                    page.wait_for_timeout(2000)
                page.screenshot(path=str(shot), full_page=True)
                rendered = page.evaluate(_RENDERED_JS)  # (re)marks the elements
                timeline_ix = next((i for i, p in enumerate(rendered["plots"])
                                    if _timeline_ok(p) and not p["inWidget"]), 0)
                for name, sel in (("timeline", f"[data-dfl-plot='{timeline_ix}']"),
                                  ("stepper", "[data-dfl-stepper='0']")):
                    try:
                        page.locator(sel).first.screenshot(path=str(tmp / f"{name}.png"), timeout=10_000)
                        result[f"{name}_png"] = tmp / f"{name}.png"
                    except Exception as e:  # the element shots are for humans; the check is above
                        result[f"{name}_png"] = f"not taken: {type(e).__name__}"
                result["console"] = console[-20:]
                saved = page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')"
                                      ".then(() => 'saved', e => String(e))")
                result["saved"] = root / notebook.name if saved == "saved" else f"not saved: {saved}"
                assert _rendered_ok(rendered), (
                    "timeline and stepper not rendered:\n" + json.dumps(rendered, indent=1)[:4000]
                    + "\nconsole:\n" + "\n".join(console[-20:]))
            finally:
                if page is not None and not shot.exists():
                    try:
                        page.screenshot(path=str(shot), full_page=True)
                    except Exception:
                        pass
                ctx.close()
    finally:
        leftover = lab.shutdown()
        result["total_s"] = time.monotonic() - t0
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if shot.exists() and os.environ.get("DISTFLOW_HOME"):
            dest = Path(os.environ["DISTFLOW_HOME"]) / "runs" / "browser"
            dest.mkdir(parents=True, exist_ok=True)
            for f in tmp.glob("*.png"):
                shutil.copy2(f, dest / f.name)
    assert not leftover, "the kernel's Ray processes outlived JupyterLab's shutdown:\n" + "\n".join(leftover)
    result["png_size"] = _png_check(shot)
    return result


def test_quickstart_in_browser(browser_tools, tmp_path):
    notebook = REPO / "notebooks" / NOTEBOOK
    assert notebook.exists(), f"{notebook.relative_to(REPO)} is missing: the browser test runs the real quickstart"
    result = run_notebook_in_browser(notebook, tmp_path)
    r = result["rendered"]
    # the notebook as the browser saved it, read as a static viewer would (nbconvert): every figure there,
    # no progress bar stuck at 0 (the notebooks' own nbclient test runs every other notebook)
    assert isinstance(result["saved"], Path), result["saved"]
    import nbformat

    from .test_notebooks import check_static_export

    saved = nbformat.read(result["saved"], as_version=4)
    assert all(c.get("execution_count") for c in saved.cells if c.cell_type == "code" and c.source.strip())
    export = check_static_export(saved, NOTEBOOK)
    assert export["figures"] > 0, export
    print(f"\nbrowser test: {result['cells']} code cells, server {result['server_s']:.0f}s, "
          f"kernel ready {result['kernel_s']:.0f}s, run-all {result['run_s']:.0f}s, "
          f"total {result['total_s']:.0f}s; {len(r['plots'])} plotly figures, {len(r['steppers'])} stepper(s); "
          f"screenshot {result['screenshot']} {result['png_size']}")
