"""Screenshot of the status page of a running `relay demo` into docs/ui.png (README).

    PYTHONPATH=. .venv/bin/python scripts/ui_screenshot.py [OUT.png] [--runs N]

Starts `relay demo --linger 60` (its own embedded PostgreSQL, sink and two replicas), waits for
the demo's live phase to end, opens the first replica's page in headless Chromium (Debian
`chromium` + `chromium-driver`, through selenium), and saves a screenshot of the whole page.
The demo is stopped with SIGINT afterwards. (docs/ui-blocked.png is tests/test_ui_browser.py's,
with RELAY_UI_SCREENSHOT.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    args = sys.argv[1:]
    out = Path(args[0]) if args and not args[0].startswith("-") else ROOT / "docs" / "ui.png"
    runs = args[args.index("--runs") + 1] if "--runs" in args else "3000"
    demo = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "demo", "--runs", runs, "--linger", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={"COLUMNS": "200", **os.environ},
    )
    assert demo.stdout is not None
    url = None
    try:
        for line in demo.stdout:
            print(line, end="")
            if m := re.search(r"status page: (http://\S+/)", line):
                url = m.group(1)
            if "stays up" in line:
                break
        if url is None:
            print("no status page URL in the demo's output", file=sys.stderr)
            return 1
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in (
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--window-size=1280,1000", f"--user-data-dir={tempfile.mkdtemp()}",
        ):  # fmt: skip
            options.add_argument(flag)
        driver = webdriver.Chrome(
            service=Service(executable_path="/usr/bin/chromedriver"), options=options
        )
        try:
            driver.get(url)
            time.sleep(4)  # a refresh or two
            # the whole page, not its first screen (the rate chart and the tables below it)
            whole = "return document.documentElement.scrollHeight + outerHeight - innerHeight"
            driver.set_window_size(1280, int(driver.execute_script(whole)))
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
        print(f"wrote {out}")
        return 0
    finally:
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=120)


if __name__ == "__main__":
    sys.exit(main())
