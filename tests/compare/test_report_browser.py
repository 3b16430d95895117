"""The HTML report of ``neuropod compare`` in a real headless Chromium (Debian's, driven by Playwright).

It renders offline: the title, the verdicts, every candidate's label, SVG charts of nonzero size;
no console error, no page error, no request but the file itself. A full-page screenshot goes to
the test's tmp_path; with NEUROPOD_UPDATE_SCREENSHOT=1 the five-framework report's also to
docs/_static/compare/report.png (the docs page "Comparing models" shows it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compare_support import FRAMEWORKS, Report

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "_static" / "compare" / "report.png"
# No sandbox (CI runs as root in a container), no GPU, nothing that talks to the network on its own.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 900}

if importlib.util.find_spec("playwright") is None:
    pytest.skip("playwright is not installed (nox -s tests_compare installs it)", allow_module_level=True)
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; nox -s tests_compare installs it)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, ConsoleMessage, Request, Route, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _open(browser: Browser, report: Report, screenshot: Path) -> dict[str, Any]:
    """Open the report, wait for it to settle, take a full-page screenshot; what was seen on the way."""
    url = report.html.resolve().as_uri()
    seen: dict[str, Any] = {"console": [], "errors": [], "requests": [], "refused": []}
    page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)

    def route(r: Route) -> None:
        if r.request.url == url:
            r.continue_()
        else:
            seen["refused"].append(r.request.url)
            r.abort()

    def console(message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            seen["console"].append(f"{message.type}: {message.text}")

    def request(r: Request) -> None:
        seen["requests"].append(r.url)

    page.route("**/*", route)
    page.on("console", console)
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    page.on("request", request)
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    seen["title"] = page.title()
    seen["text"] = page.inner_text("body")
    seen["svgs"] = [svg.bounding_box() for svg in page.locator("svg").all()]
    seen["verdict_visible"] = {
        word: page.get_by_text(re.compile(rf"\b{word}\b", re.IGNORECASE)).first.is_visible()
        for word in ("agrees", "disagrees")
        if re.search(rf"\b{word}\b", seen["text"], re.IGNORECASE)
    }
    page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return seen


@pytest.mark.parametrize("which", ["frameworks_report", "perturbed_report"])
def test_the_report_renders_offline(
    which: str, browser: Browser, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    report: Report = request.getfixturevalue(which)
    assert report.html.is_file()
    screenshot = tmp_path / "report.png"
    seen = _open(browser, report, screenshot)

    assert "compare" in seen["title"].lower(), seen["title"]
    assert seen["console"] == [] and seen["errors"] == [], (seen["console"], seen["errors"])
    # Self-contained: the page asked for nothing but itself (no fonts, scripts, styles, images).
    assert seen["refused"] == [], seen["refused"]
    assert seen["requests"] == [report.html.resolve().as_uri()], seen["requests"]
    # Every candidate is named on the page, with the verdict shown.
    labels = [c["label"] for c in report.data["candidates"]]
    for label in labels:
        assert label in seen["text"], (label, seen["text"][:2000])
    verdict = "disagrees" if which == "perturbed_report" else "agrees"
    assert seen["verdict_visible"].get(verdict), (verdict, seen["verdict_visible"], seen["text"][:2000])
    # The charts are drawn, each with an area on the page.
    assert seen["svgs"], "the report has no SVG chart"
    for box in seen["svgs"]:
        assert box is not None and box["width"] > 0 and box["height"] > 0, seen["svgs"]
    assert screenshot.stat().st_size > 10_000
    if which == "frameworks_report":
        assert labels == [label for label, _, _ in FRAMEWORKS.values()]
        if os.environ.get("NEUROPOD_UPDATE_SCREENSHOT") == "1":
            _save_for_the_docs(screenshot, SCREENSHOT)


def _save_for_the_docs(screenshot: Path, target: Path) -> None:
    """The screenshot in 256 colours (flat colours and text: it looks the same at well under half the bytes)."""
    from PIL import Image  # lazy: only when the docs' screenshot is updated (pillow; nox -s tests_compare has it)

    target.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(screenshot) as image:
        image.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE).save(target, optimize=True)
    assert target.stat().st_size < 400_000, f"{target} is {target.stat().st_size} bytes: crop the page"
