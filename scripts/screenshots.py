"""Screenshots of every dashboard page, from a run store, into docs/screenshots/ (headless Chromium, Playwright).

    .venv/bin/stratpack compare --runs-dir /tmp/shots            # a real comparison
    .venv/bin/python scripts/screenshots.py /tmp/shots            # docs/screenshots/1-compare.png ...
    .venv/bin/python scripts/screenshots.py /tmp/zb --pipeline-runs --out docs/pipeline  # each pipeline run's page

The dashboard is started as a user starts it (`stratpack dashboard`), on a free local port, and stopped after.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from pathlib import Path

PAGES = ("Compare", "Memory", "Throughput", "Communication", "Loss", "Pipeline", "Planner")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_dir")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "screenshots"))
    parser.add_argument("--pipeline-runs", action="store_true",
                        help="instead of every page: the Pipeline page once per pipeline run, picked in its Run box")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "strategies.cli", "dashboard", "--runs-dir", args.runs_dir,
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(url)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                        headless=True, args=["--no-sandbox", "--disable-gpu"])
            # Tall enough for a whole page: Streamlit scrolls inside its own frame, so full_page adds nothing.
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.goto(url)
            if args.pipeline_runs:
                _pipeline_runs(page, Path(args.out))
            for k, name in enumerate(() if args.pipeline_runs else PAGES, start=1):
                if k > 1:
                    page.get_by_text(name, exact=True).click()
                _settle(page)
                path = Path(args.out) / f"{k}-{name.lower()}.png"
                page.screenshot(path=str(path), full_page=True)
                print(path)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


def _pipeline_runs(page, out: Path) -> None:
    """The Pipeline page once per run its Run box offers, named after the run's label."""
    page.get_by_text("Pipeline", exact=True).click()
    _settle(page)
    box = page.get_by_test_id("stSelectbox")
    box.click()
    labels = [o.inner_text() for o in page.get_by_role("option").all()]
    page.keyboard.press("Escape")
    for label in labels:
        box.click()
        page.get_by_role("option", name=label, exact=True).click()
        _settle(page)
        path = out / f"pipeline-{label.split()[0]}.png"
        page.screenshot(path=str(path), full_page=True)
        print(path)


def _wait_up(url: str) -> None:
    from strategies.cli.dashboard import wait_until_up

    if not wait_until_up(url):
        raise SystemExit("the dashboard did not come up")


def _settle(page) -> None:
    """Until the page's script has run and its charts are drawn."""
    page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=60_000)
    page.wait_for_timeout(4000)  # Plotly and the table draw after Streamlit reports the run done


if __name__ == "__main__":
    sys.exit(main())
