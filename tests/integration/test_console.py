"""The fleet console (fedgate/console) as an operator sees it, in a real headless Chromium.

Tried: the console served against the session federation; a region `local-cs` added with
three devices that find it nearest by DNS; its gateway SIGKILLed; a command sent to one of the
devices.  Seen in the page: it loads without a console error, shows every region up; the
killed region turns red within the scrape interval and its devices show in the next region
(local-eu) once they failed over; the command shows with its outcome.  Nothing is served
without the admin credentials.

The screenshot it takes is docs/images/console.png when run with FEDGATE_UPDATE_SCREENSHOT=1.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from backend import contract as c
from backend.amqp import send_command
from backend.polling import wait_until
from fedgate.console.server import Console
from fedgate.devices import SimDevice
from infra.local.driver import gateway_node_name
from tests.helpers import devices_in_network, wait_present

pytestmark = [pytest.mark.integration, pytest.mark.kafka, pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
REGION = "local-cs"
FALLBACK = "local-eu"
DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "console.png"
#: the flags a machine without the internet needs (no background connections, no sandbox as root)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def devices_shown(page: Page, region: str) -> int:
    """The devices the page shows connected in `region` (read as a person reads it; the page's
    own Content-Security-Policy keeps Playwright from evaluating script there)."""
    return int(page.text_content(f'[data-region="{region}"] .devices', timeout=5_000) or -1)


def test_the_console_shows_a_region_going_down_its_devices_moving_and_a_commands_outcome(
    federation, uid, tmp_path
):
    federation.add_region(REGION)
    ids = [f"cs-{uid}-{i}" for i in range(3)]
    devices: list[SimDevice] = []
    errors: list[str] = []
    served: Console | None = None
    try:
        ep = federation.endpoints()
        devices = devices_in_network(federation, ep, REGION, ids)
        served = Console(ep, ep["admin"]["user"], ep["admin"]["password"], "127.0.0.1", 0).start()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(served.url + "/api/fleet", timeout=5)
        assert refused.value.code == 401, "the console answers only with the admin credentials"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(
                http_credentials={"username": ep["admin"]["user"], "password": ep["admin"]["password"]},
                viewport={"width": 1280, "height": 900},
            ).new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(served.url + "/")
            shot = tmp_path / "console.png"
            try:
                # every region up (within a scrape or two of the new region's; the suite's other
                # lanes may keep Prometheus slow to answer)
                for region in ("local-eu", "local-us", REGION):
                    page.wait_for_selector(f'[data-region="{region}"][data-state="up"]', timeout=60_000)
            except Exception:
                page.screenshot(path=str(shot), full_page=True)
                print(f"the page as it was: {shot}; its view: {served.view.get()}")
                raise
            assert wait_until(lambda: devices_shown(page, REGION) == len(ids), 20, 0.5)
            fallback_before = devices_shown(page, FALLBACK)

            federation.node(gateway_node_name(REGION)).kill()
            killed = time.monotonic()
            # red within a scrape interval (and the page's 2 s refresh)
            page.wait_for_selector(f'[data-region="{REGION}"][data-state="down"]', timeout=30_000)
            red_s = time.monotonic() - killed
            # its devices found the next region by DNS and show there
            assert wait_until(lambda: devices_shown(page, FALLBACK) >= fallback_before + len(ids), 60, 0.5)
            assert wait_until(lambda: devices_shown(page, REGION) == 0, 30, 0.5)
            for d in devices:
                wait_present(ep, d.device_id, FALLBACK, timeout=30)
            send_command(
                ep["backend"]["url"], ids[0], c.device_command_topic(ids[0], "reboot"), '{"now": true}'
            )
            command_id = c.message_id(c.device_command_topic(ids[0], "reboot"), b'{"now": true}')
            page.wait_for_selector(f'[data-command="{command_id}"] td.outcome:text("routed")', timeout=30_000)
            assert devices[0].wait_for(1, timeout=15), "the command reached its device"
            # and Prometheus pages for it
            page.wait_for_selector('tr.firing[data-alert="FedgateRegionDown"]', timeout=45_000)
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        if os.environ.get("FEDGATE_UPDATE_SCREENSHOT") == "1":
            DOCS_SHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, DOCS_SHOT)
        print(f"region red {red_s:.1f} s after its gateway was killed; screenshot {shot}")
        assert errors == [], f"the page logged errors: {errors}"
    finally:
        for d in devices:
            d.close()
        if served is not None:
            served.stop()
        federation.start_node(gateway_node_name(REGION))
        federation.remove_region(REGION)
