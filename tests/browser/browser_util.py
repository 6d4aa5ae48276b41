"""A headless Chromium driven by Selenium for the console's browser tests.

Imported only by tests/browser's fixtures, so plain `make test` (which has no Selenium)
never imports it. Debian's chromium and its chromedriver are used as installed
(tests/browser/setup.sh); Selenium is given both paths and downloads nothing.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("QUEUED_CHROMIUM") or "/usr/bin/chromium"
CHROMEDRIVER = os.environ.get("QUEUED_CHROMEDRIVER") or "/usr/bin/chromedriver"
#: Every wait for the page is bounded by this (the page polls every 1.5 s).
WAIT = 15.0

T = TypeVar("T")


def available() -> str | None:
    """Why the browser cannot run here (None: it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} missing: run tests/browser/setup.sh (make test-browser does)"
    return None


class Browser:
    """One headless Chromium window; `login` sets the HTTP Basic credentials it sends."""

    def __init__(self, profile: Path) -> None:
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: never download
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                    "--disable-gpu", "--window-size=1280,720", "--no-first-run",
                    "--disable-extensions", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}"):
            opts.add_argument(arg)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER),
                                       options=opts)
        self.driver.set_page_load_timeout(WAIT)
        self.driver.execute_cdp_cmd("Network.enable", {})
        self.logs: list[dict[str, Any]] = []

    def close(self) -> None:
        self.driver.quit()

    def login(self, user: str, password: str) -> None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.driver.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                                    {"headers": {"Authorization": f"Basic {token}"}})

    def open(self, url: str) -> None:
        self.driver.get(url)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def wait(self, what: str, check: Callable[[], T | None], timeout: float = WAIT) -> T:
        """check()'s first truthy value, polled until `timeout` (then fails naming `what`)."""
        def attempt(_: object) -> T | None:
            try:
                return check()
            except StaleElementReferenceException:
                return None  # redrawn meanwhile: try again
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(attempt)
        except TimeoutException:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None

    def cell(self, table: str, name: str, col: str) -> str:
        """The text of column `col` in the row of `name` ("" while there is no such row)."""
        cells = self.all(f'#{table} tr[data-name="{name}"] td[data-col="{col}"]')
        return cells[0].text if cells else ""

    def console_log(self) -> list[dict[str, Any]]:
        """Every browser console entry so far (Chromium hands each out once; kept here)."""
        self.logs += self.driver.get_log("browser")
        return self.logs

    def csp_violations(self) -> list[str]:
        return [e["message"] for e in self.console_log()
                if "Content Security Policy" in e["message"]]

    def settle(self, seconds: float) -> None:
        """Let the page run its polls (for checks that something did NOT happen)."""
        time.sleep(seconds)
