"""The status page in a real headless Chromium (issue 17): two replicas with traffic and a
poisoned run behind a hostile id. The figures shown match `relay status --json`, the blocked
run shows with its status and excerpt, its run page lists the events in seq order, no hostile
value runs as script, the page keeps updating without a reload, and ui_token is enforced.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` client (the `dev` extra);
skips with the reason otherwise. Selenium Manager never runs: the driver and browser paths are
given. With RELAY_UI_SCREENSHOT=PATH the first test also writes a screenshot there
(docs/ui-blocked.png is made so: `RELAY_UI_SCREENSHOT=docs/ui-blocked.png pytest
tests/test_ui_browser.py`; docs/ui.png is scripts/ui_screenshot.py's, of `relay demo`).

Selenium is synchronous: its calls run in a worker thread (`anyio.to_thread`) so the relays'
event loop keeps serving the page meanwhile.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import psycopg
import pytest

from relay.ops.format import clean
from relay.runner import Relay
from relay.tools.sink import Sink
from tests.support import count, q, settings, wait_for
from tests.test_ui import EXCERPT, HOSTILE, TOKEN, enqueue, report_now, status_cli

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,1100",
)

pytestmark = pytest.mark.anyio
T = TypeVar("T")


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


async def off(fn: Callable[..., T], *args: Any) -> T:
    """A blocking Selenium call, off the event loop."""
    return await anyio.to_thread.run_sync(fn, *args)


def fresh(read: Callable[[], T]) -> T:
    """`read()`, done again from the start when the page replaced an element it found
    meanwhile (the page re-renders its tables on each refresh)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            return read()
        except StaleElementReferenceException:
            continue
    return read()


def texts(driver: Any, css: str) -> list[str]:
    """The texts of every element `css` matches."""
    from selenium.webdriver.common.by import By

    return fresh(lambda: [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)])


def click(driver: Any, css: str) -> None:
    """Click the first element `css` matches."""
    from selenium.webdriver.common.by import By

    fresh(lambda: driver.find_element(By.CSS_SELECTOR, css).click())


def figure(driver: Any, key: str) -> str:
    return str(
        driver.execute_script(f"return document.querySelector('[data-k=\"{key}\"]').textContent")
    )


def delivered(driver: Any) -> int:
    """The fleet table's "delivered (reported)" column, summed over the replicas."""
    cells = texts(driver, "#fleet-rows td:nth-child(6)")
    return sum(int(c.replace(",", "")) for c in cells if c.strip() not in ("", "-"))


async def wait_page(driver: Any, predicate: Callable[[Any], bool], what: str) -> None:
    async def check() -> bool:
        return await off(predicate, driver)

    await wait_for(check, what=what, interval=0.2)


async def traffic(conn: psycopg.Connection[Any], schema: str, tag: str, runs: int) -> None:
    for i in range(runs):
        await off(enqueue, conn, schema, f"{tag}{i}", 3, "t")
        await anyio.sleep(0.05)


async def test_status_page_in_chromium(
    pg_url: str, schema: str, conn: psycopg.Connection[Any], sink: tuple[Sink, str], browser: Any
) -> None:
    s, url = sink
    s.faults.fail(422, times=1000, run_id=HOSTILE, body=EXCERPT.encode())
    enqueue(conn, schema, HOSTILE, 3, "h")
    async with AsyncExitStack() as stack:
        relays = [
            await stack.enter_async_context(
                Relay(
                    settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", replica_id=name)
                ).running()
            )
            for name in ("replica-a", "replica-b")
        ]
        a = relays[0]
        assert a.endpoints is not None
        base = f"http://127.0.0.1:{a.endpoints.port}"
        await traffic(conn, schema, "warm", 20)
        await wait_for(
            lambda: (
                count(conn, schema, "state = 'failed'") == 1
                and count(conn, schema, "state = 'pending'") == 2
            ),
            what="traffic delivered and the hostile run blocked",
        )
        for r in relays:
            await report_now(r)
        assert a.endpoints is not None
        await a.endpoints.probe(refresh=True)  # the lanes' totals are the backlog refresh's

        await off(browser.get, base + "/")
        await wait_page(browser, lambda d: d.execute_script(
            "return Number(document.body.dataset.updates)") >= 1, "the first refresh")  # fmt: skip

        # The figures match `relay status --json` (the traffic is done: they hold still).
        cli = await off(status_cli, pg_url, schema)
        shown = await off(lambda: {k: figure(browser, k) for k in (
            "blocked.runs", "blocked.events", "blocked.held", "due.events",
            "finished.events", "expired_leases")})  # fmt: skip
        lanes = {x["lane"]: x for x in cli["lanes"]}
        assert shown == {
            "blocked.runs": str(cli["blocked"]["runs"]),
            "blocked.events": str(cli["blocked"]["events"]),
            "blocked.held": str(cli["blocked"]["held_events"]),
            "due.events": str(lanes.get("ordinary", {}).get("events", 0)),
            "finished.events": str(lanes.get("critical", {}).get("events", 0)),
            "expired_leases": str(cli["expired_leases"]),
        }
        assert shown["blocked.runs"] == "1" and shown["blocked.held"] == "2"

        # The blocked run: its id as text, status, excerpt; no hostile value ran.
        [row] = await off(texts, browser, "#blocked-rows tr")
        assert clean(HOSTILE) in row and "422" in row and clean(EXCERPT) in row
        assert await off(browser.execute_script, "return typeof window.pwned") == "undefined"
        fleet = await off(texts, browser, "#fleet-rows tr")
        assert any(r.startswith("replica-a (this page)") for r in fleet), fleet
        assert any(r.startswith("replica-b") and "alive" in r for r in fleet), fleet

        # A hostile report already stored (issue 32) refreshes in as text, never as a link.
        conn.execute(
            q(schema, "insert into {s}.replicas (owner, reported_at, report)"
                      " values ('forged', clock_timestamp(), %s::jsonb)"),
            ('{"ingress": ["https://evil.example/sso", "sign in again"]}',),
        )  # fmt: skip
        await wait_page(
            browser,
            lambda d: any(r.startswith("forged") for r in texts(d, "#fleet-rows tr")),
            "the forged row, refreshed in",
        )
        links = "return document.querySelectorAll('#fleet-rows a').length"
        assert await off(browser.execute_script, links) == 0
        [forged] = [
            r for r in await off(texts, browser, "#fleet-rows tr") if r.startswith("forged")
        ]
        assert "report rejected: ingress must be one of" in forged, forged

        # It keeps updating: more traffic, and the replicas' delivered counts (the fleet table:
        # cumulative, so they only grow) change without a reload. (Until schema version 7 this
        # watched a "delivered in the last minute" card, which the cursor can no longer count.)
        await off(browser.execute_script, "window.notReloaded = true")
        before = await off(delivered, browser)
        await traffic(conn, schema, "more", 10)
        await wait_for(lambda: count(conn, schema, "state = 'pending'") == 2, what="delivered")
        for r in relays:
            await report_now(r)
        await wait_page(browser, lambda d: delivered(d) >= before + 30, "the new deliveries")
        assert await off(browser.execute_script, "return window.notReloaded") is True
        points = await off(
            browser.execute_script,
            "return document.getElementById('line-ordinary').getAttribute('points')",
        )
        assert points.strip(), "the ordinary lane's rate chart has points"

        # A producer names a hostile fairness key (issue 50 item 4): the table by key refreshes
        # it in as text at the next backlog refresh, without a reload, and nothing runs.
        with conn.transaction():  # due in an hour before any relay hears of it
            conn.execute(
                q(schema, "select {s}.enqueue('keyed', 'keyed-e', 'step', %s::jsonb,"
                          " p_fairness_key => %s)"),
                ("{}", HOSTILE),
            )  # fmt: skip
            conn.execute(
                q(schema, "update {s}.runs set next_attempt_at = now() + interval '1 hour'"
                          " where run_id = 'keyed'"),
            )  # fmt: skip
        await a.endpoints.probe(refresh=True)
        await wait_page(
            browser,
            lambda d: any(r.startswith(clean(HOSTILE)) for r in texts(d, "#key-rows tr")),
            "the hostile key, refreshed in",
        )
        assert await off(browser.execute_script, "return window.notReloaded") is True
        assert await off(browser.execute_script, "return typeof window.pwned") == "undefined"
        links = "return document.querySelectorAll('#key-rows a').length"
        assert await off(browser.execute_script, links) == 0

        shot = os.environ.get("RELAY_UI_SCREENSHOT")
        if shot:
            await anyio.sleep(3)  # a few more refreshes: more of the rate chart
            # the whole page: the blocked runs' table is below the first screen since the
            # backlog and fairness-key tables came (issue 50)
            whole = "return document.documentElement.scrollHeight + outerHeight - innerHeight"
            await off(browser.set_window_size, 1280, int(await off(browser.execute_script, whole)))
            await off(browser.save_screenshot, shot)

        # The run page, through the page's own link: events in seq order, the commands.
        from selenium.webdriver.common.by import By

        await off(click, browser, "#blocked-rows a")
        await wait_page(browser, lambda d: d.find_elements(By.ID, "run-events"), "the run page")
        rows = await off(texts, browser, "#run-events tr")
        assert [r.split()[0] for r in rows] == ["1", "2", "3"]
        assert "step" in rows[0] and "failed" in rows[0] and "pending" in rows[1]
        commands = await off(lambda: browser.find_element(By.ID, "commands").text)
        assert "relay retry $'" in commands and "relay retry --run" in commands
        assert await off(lambda: browser.find_element(By.ID, "run-id").text) == clean(HOSTILE)
        assert await off(browser.execute_script, "return typeof window.pwned") == "undefined"

        # A run id that is itself an attack renders as text on its own page too.
        await off(browser.get, base + "/runs/%3Cimg%20src%3Dx%20onerror%3Dwindow.pwned%3D1%3E")
        assert "No such run" in await off(lambda: browser.find_element(By.TAG_NAME, "body").text)
        assert await off(browser.execute_script, "return typeof window.pwned") == "undefined"


async def test_ui_token_in_chromium(
    pg_url: str, schema: str, sink: tuple[Sink, str], browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    _, url = sink
    cfg = settings(pg_url, schema, url, metrics_addr="127.0.0.1:0", ui_token=TOKEN)
    async with Relay(cfg).running() as r:
        assert r.endpoints is not None
        base = f"http://127.0.0.1:{r.endpoints.port}"
        await off(browser.get, base + "/")
        body = await off(lambda: browser.find_element(By.TAG_NAME, "body").text)
        assert body.startswith("unauthorized")
        await off(browser.get, f"{base}/?token={TOKEN}")
        await wait_page(browser, lambda d: d.find_elements(By.ID, "lanes"), "the page")
        assert TOKEN not in await off(lambda: browser.current_url)  # redirected without it
        [cookie] = await off(browser.get_cookies)
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
        assert await off(browser.execute_script, "return document.cookie") == ""
        # The script's refreshes carry the cookie.
        await wait_page(browser, lambda d: d.execute_script(
            "return Number(document.body.dataset.updates)") >= 2, "refreshes")  # fmt: skip
        assert await off(lambda: browser.find_element(By.ID, "updated").text) == "live"
        # Probes stay open.
        await off(browser.delete_all_cookies)
        await off(browser.get, base + "/healthz")
        assert await off(lambda: browser.find_element(By.TAG_NAME, "body").text) == "ok"
        await off(browser.get, base + "/api/status")
        assert "unauthorized" in await off(lambda: browser.find_element(By.TAG_NAME, "body").text)
