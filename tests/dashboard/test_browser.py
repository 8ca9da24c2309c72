"""The dashboard in a real browser: `stratpack dashboard` on 127.0.0.1, headless Chromium, charts drawn."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from strategies.cli.dashboard import wait_until_up
from tests import ports, python

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def server(store, tmp_path):
    port = ports.take()  # (below the ephemeral range: see tests/ports.py)
    proc = subprocess.Popen([python.core(), "-m", "strategies.cli", "dashboard", "--runs-dir", str(store),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_until_up(url):
        proc.kill()
        pytest.fail(f"the dashboard did not come up: {proc.stdout.read()[-2000:]}")
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    # `stratpack dashboard` becomes the server: stopping it leaves no streamlit behind.
    left = subprocess.run(["pgrep", "-f", f"server.port {port}"], capture_output=True, text=True).stdout.split()
    assert not left, f"streamlit still running after the dashboard was stopped: {left}"


def test_pages_render_charts_in_chromium(server, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api",
                                     reason="playwright is not installed (pip install playwright)")
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium here (apt-get install chromium, as scripts/setup.sh --dev does where it can)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        start = time.monotonic()
        page.goto(server)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
        first_render = time.monotonic() - start
        page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=60_000)
        # The answer comes first, then where each run's step time goes, then each run's loss difference from
        # single: the fixture's runs match it exactly, drawn at the log axis' floor.
        assert page.get_by_text("The answer", exact=True).is_visible()
        assert "fastest" in page.inner_text("body") and "least memory" in page.inner_text("body")
        plots = "() => [...document.querySelectorAll('.js-plotly-plot')]"
        titles = page.evaluate(plots + ".map(e => e._fullLayout.title.text)")
        assert "Where the step time goes" in titles[0] and "Loss: relative difference" in titles[1]
        other = page.evaluate(plots + ".map(e => e._fullData.filter(t => t.name == 'other').map(t => [...t.y]))")
        assert round(other[0][0][0], 6) == 200.0  # ms: what the fixture's 1 s step leaves beyond its parts
        ys = page.evaluate(plots + ".map(e => e._fullData.map(t => [...t.y]))")
        assert [1e-10] * 3 in ys[1]  # dashboard.charts.FLOOR
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
        for name in ("Memory", "Pipeline"):
            page.get_by_text(name, exact=True).click()
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=60_000)
            page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=60_000)
            page.screenshot(path=str(tmp_path / f"{name.lower()}.png"), full_page=True)
        browser.close()
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    print(f"first chart after {first_render:.1f}s")  # shown with pytest -s
