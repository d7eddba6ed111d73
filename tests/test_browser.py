"""The quick-start notebook, exported to HTML with its widget state, renders in a real browser.

Steps: execute ``notebooks/01-quickstart.ipynb`` with ``store_widget_state=True``; export it
with nbconvert's lab template pointing RequireJS and the Jupyter widgets HTML manager at
local copies (``tests/browser/setup.sh`` fetches them from the npm registry; the browser
itself has no internet); serve the page from 127.0.0.1; load it in headless Chromium;
check the rendered DOM shows every part of the dashboard with non-zero figures; save a
screenshot to ``test-artifacts/dashboard.png``.

Needs ``chromium`` (Debian: ``apt-get install -y chromium``) and ``npm`` (for the first
``setup.sh``); skips, visibly, without them.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
nbconvert = pytest.importorskip("nbconvert")

ROOT = Path(__file__).resolve().parents[1]
BROWSER_DIR = ROOT / "tests" / "browser"
VENDOR = BROWSER_DIR / "vendor"
ARTIFACTS = ROOT / "test-artifacts"


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def ensure_vendor() -> None:
    """The widget renderer JS in ``tests/browser/vendor``, fetched once with ``setup.sh``."""
    if (VENDOR / "html-manager" / "embed-amd.js").is_file() and (VENDOR / "require.js").is_file():
        return
    if shutil.which("npm") is None:
        pytest.skip("tests/browser/vendor is missing and npm is not installed: apt-get install -y npm, "
                    "then bash tests/browser/setup.sh")
    done = subprocess.run(["bash", str(BROWSER_DIR / "setup.sh")], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"bash tests/browser/setup.sh failed (npm registry unreachable?): {done.stderr[-2000:]}")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("headless Chromium is not installed: apt-get update && apt-get install -y chromium")
    ensure_vendor()
    return path


# ----------------------------------------------------------------------------- notebook -> HTML

def execute_with_widget_state(path: Path):
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


# Once the widgets have rendered: mark the page (so a DOM dump can tell), and with
# ``#dashboard`` in the URL show only the cells holding the dashboard and the progress bar,
# so a screenshot of the viewport shows them.
FOCUS_SCRIPT = """
<script>
(function () {
  var tries = 0;
  var timer = setInterval(function () {
    var dash = document.querySelector('.gpulazy-dashboard');
    tries += 1;
    if (!dash && tries < 400) { return; }
    clearInterval(timer);
    if (!dash) { return; }
    if (window.location.hash === '#dashboard') {
      document.querySelectorAll('.jp-Cell').forEach(function (cell) {
        var keep = cell.querySelector('.gpulazy-dashboard, .gpulazy-progress');
        if (!keep) { cell.style.display = 'none'; }
      });
      window.scrollTo(0, 0);
    }
    document.body.setAttribute('data-gpulazy-rendered', 'yes');
  }, 50);
})();
</script>
"""


def export_html(nb, out: Path) -> None:
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    exporter.require_js_url = "vendor/require.js"
    exporter.widget_renderer_url = "vendor/html-manager/embed-amd.js"
    exporter.mathjax_url = "vendor/no-mathjax.js"  # nothing to typeset; never reach for a CDN
    body, _ = exporter.from_notebook_node(nb)
    assert "application/vnd.jupyter.widget-state+json" in body, "widget state was not embedded"
    out.write_text(body.replace("</body>", FOCUS_SCRIPT + "</body>"), encoding="utf-8")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


def serve(directory: Path):
    """An HTTP server on 127.0.0.1 (a free port) serving ``directory``, in a daemon thread."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run_chromium(chromium: str, url: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="gpulazy-chromium-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               # offline by construction: every host name but the local server fails at once
               "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
               "--virtual-time-budget=20000", *args, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- DOM checks

class _Elements(html.parser.HTMLParser):
    """Collects rendered elements (outside <script>) with their classes, attributes and text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict] = []
        self._stack: list[dict] = []

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "classes": set((dict(attrs).get("class") or "").split()),
              "text": []}
        self.elements.append(el)
        if tag not in ("br", "img", "input", "meta", "link", "hr", "source", "path", "rect", "polyline"):
            self._stack.append(el)

    def handle_endtag(self, tag):
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i]["tag"] == tag:
                del self._stack[i:]
                break

    def handle_data(self, data):
        if self._stack and self._stack[-1]["tag"] in ("script", "style"):
            return
        for el in self._stack:
            el["text"].append(data)

    def with_class(self, cls: str) -> list[dict]:
        return [e for e in self.elements if cls in e["classes"] and e["tag"] not in ("script",)]


def text_of(el: dict) -> str:
    return " ".join("".join(el["text"]).split())


@pytest.mark.slow
def test_dashboard_renders_in_headless_chromium(chromium, tmp_path):
    nb = execute_with_widget_state(ROOT / "notebooks" / "01-quickstart.ipynb")
    site = tmp_path / "site"
    site.mkdir()
    (site / "vendor").symlink_to(VENDOR, target_is_directory=True)
    export_html(nb, site / "index.html")
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(site / "index.html", ARTIFACTS / "01-quickstart.html")

    server = serve(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        dom = run_chromium(chromium, url, "--dump-dom", "--window-size=1100,1300")
        assert dom.returncode == 0, dom.stderr[-3000:]
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        png = run_chromium(chromium, url + "#dashboard", f"--screenshot={shot}", "--window-size=1000,760")
        assert png.returncode == 0, png.stderr[-3000:]
    finally:
        server.shutdown()
    (ARTIFACTS / "01-quickstart.dom.html").write_text(dom.stdout, encoding="utf-8")

    page = _Elements()
    page.feed(dom.stdout)
    assert 'data-gpulazy-rendered="yes"' in dom.stdout, "the widgets never rendered (see 01-quickstart.dom.html)"
    # Every part of the dashboard is a rendered element (not just JSON in a <script>).
    for part in ("dashboard", "title", "throughput-plot", "throughput", "cache-bar", "cache", "queue",
                 "memory-bar", "memory", "backend", "modes"):
        assert page.with_class(f"gpulazy-{part}"), f"no rendered .gpulazy-{part}"

    (throughput,) = page.with_class("gpulazy-throughput-text")
    # the volume once, and a quarter of it again uncached (every fourth slice's MIP, its files alone)
    assert int(throughput["attrs"]["data-bytes-read"]) == 80 << 20
    assert re.search(r"80\.0 MiB read in \d+ reads \((\d+\.\d+) GB/s per read\)", text_of(throughput))
    assert float(re.search(r"\((\d+\.\d+) GB/s per read", text_of(throughput)).group(1)) > 0

    polylines = [e for e in page.elements if e["tag"] == "polyline"]
    assert polylines and polylines[0]["attrs"]["data-backend"] in ("posix", "kvikio")
    assert "peak" in " ".join(text_of(e) for e in page.with_class("gpulazy-sparkline"))

    (cache,) = page.with_class("gpulazy-cache-text")
    # 16 misses (the MIP), 16 hits (the sum), 4 (the slice 16:48), 5 (the MIP over 3:40), 16 (the
    # preview ::4), 4 (the list of 4 planes), 4 (their MIP), 1 (the plane 40), 1 (its max), 16 (np.max),
    # 16 (argmax), 16 (min and max computed together: one read), 16 (the histogram), 16 (the map), 16 (two
    # arrays, the halves of the volume) and 16 (four arrays, its quarters)
    assert re.search(r"cache 64\.0 MiB / .* hit rate 91% \(163 hits, 16 misses\)", text_of(cache))
    (memory,) = page.with_class("gpulazy-memory-text")
    assert "no GPU found:" in text_of(memory) or text_of(memory).startswith("GPU ")
    (backend,) = page.with_class("gpulazy-backend-text")
    assert text_of(backend).startswith("backend ")
    assert "no reads yet" not in text_of(backend)
    assert page.with_class("gpulazy-queue-text")

    # The cache bar is drawn with a non-zero width (64 MiB held).
    bars = [e for e in page.elements if "progress-bar" in e["classes"]]
    styles = [e["attrs"].get("style") or "" for e in bars]
    widths = [float(m.group(1)) for m in (re.search(r"width:\s*([\d.]+)%", st) for st in styles) if m]
    assert any(w > 0 for w in widths), f"no progress bar drawn with a width: {widths}"
    # The compute progress bar finished: 16 of 16 chunks.
    assert any("16/16 chunks" in text_of(e) for e in page.elements if e["tag"] == "div")

    assert shot.is_file() and shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
