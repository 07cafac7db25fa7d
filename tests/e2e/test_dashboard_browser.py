"""The operator dashboard in headless Chromium (Debian's package, driven by Playwright) against the real
stack: an operator signs in, the dashboard renders live, and the hit rate it shows rises after a burst of
requests that share a long prefix, whose KV handoffs and engine steps it shows too. The screenshot is
left in tests/artifacts/ (gitignored), or where SLUICE_DASHBOARD_SCREENSHOT says: `make screenshots`
writes the README's picture with it."""

import os
import re
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import Frame, Page, expect, sync_playwright

from tests.e2e.conftest import MODEL, ROOT, Stack, manage

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
# This machine's network is closed: Chromium's own background traffic would only fail, noisily.
CHROMIUM_ARGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic"]
SCREENSHOT = Path(os.environ.get("SLUICE_DASHBOARD_SCREENSHOT") or ROOT / "tests" / "artifacts" / "dashboard.png")
USERNAME, PASSWORD = "dash-operator", "dash-operator-pw"
CREATE_OPERATOR = (
    "from django.contrib.auth.models import Group, User; "
    f"user = User.objects.create_user({USERNAME!r}, password={PASSWORD!r}); "
    "user.groups.add(Group.objects.get(name='operator'))"
)
# Generous: the first render loads plotly.js, and the burst runs the real model on the CPU.
RENDER_TIMEOUT_MS = 120_000
RISE_TIMEOUT_MS = 300_000
BURST = 8


def _dash_frame(page: Page) -> Frame:
    return next(frame for frame in page.frames if "/django_plotly_dash/app/" in frame.url)


def _shown_hit_rate(frame: Frame) -> float:
    """The hit rate the page shows, in percent; "no data" (nothing served in the window) counts as 0."""
    text = frame.locator("#hit-rate-value").inner_text()
    return float(text.rstrip("%")) if text.endswith("%") else 0.0


def _burst_sharing_a_prefix(stack: Stack) -> None:
    # A prefix no earlier test sent: the first request stores its blocks, the others hit them.
    prefix = f"Reference notes {uuid.uuid4()}. " + " ".join(
        f"Item {n} is filed under shelf {n % 17}." for n in range(250)
    )
    client = stack.openai(timeout=120)
    for n in range(BURST):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"Where is item {n}?"}],
            max_tokens=4,
        )


def test_operator_watches_the_hit_rate_rise_after_a_shared_prefix_burst(stack: Stack):
    manage(stack.env, "shell", "-c", CREATE_OPERATOR)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 2500})
            page.goto(f"{stack.base_url}/dashboard/")
            page.fill("#id_username", USERNAME)
            page.fill("#id_password", PASSWORD)
            page.click("button[type=submit]")
            page.wait_for_url("**/dashboard/")
            app = page.frame_locator("iframe")
            # Rendered and live: the websocket is open and the workers' heartbeats fill the instance table.
            expect(app.locator("#socket-status")).to_have_text("live", timeout=RENDER_TIMEOUT_MS)
            expect(app.locator("#instances-table")).to_be_visible(timeout=RENDER_TIMEOUT_MS)
            expect(app.locator("#hit-rate-graph .main-svg").first).to_be_visible(timeout=RENDER_TIMEOUT_MS)
            frame = _dash_frame(page)
            before = _shown_hit_rate(frame)

            _burst_sharing_a_prefix(stack)

            frame.wait_for_function(
                """before => {
                    const text = document.getElementById("hit-rate-value").textContent;
                    return text.endsWith("%") && parseFloat(text) > before;
                }""",
                arg=before,
                timeout=RISE_TIMEOUT_MS,
            )
            # The burst went from the prefill worker to the decode worker page to page (one host: shared
            # memory), in timed steps.
            handoffs = app.locator("#kv-handoff-table")
            expect(handoffs).to_contain_text(re.compile(r"host_memory\s*received\s*[1-9]"), timeout=RENDER_TIMEOUT_MS)
            expect(app.locator("#instances-table")).to_contain_text(re.compile(r"\d ms"), timeout=RENDER_TIMEOUT_MS)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 0
