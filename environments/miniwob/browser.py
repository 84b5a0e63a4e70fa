"""One headless Chromium driven through Selenium and Debian's chromedriver, as a resource whose
processes never outlive it.

- Found, not downloaded: `chromium` and `chromedriver` on PATH (Debian's `chromium` and
  `chromium-driver` packages), or the paths in MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER
  (the `miniwob` package's variables). Selenium Manager, which would download a driver and send
  usage statistics, is never run: the driver's path is given, and SE_AVOID_STATS is set.
- Contained: chromedriver starts in a process group of its own, which Chromium's processes
  join; `close()` kills the group, and the process's reaper (`agentrl/process_reaper.py`) kills
  it if this process dies first, even by SIGKILL. Chromium's crash handlers leave the group
  but follow their browser out; any still running when `close()` ends are killed too, found by
  the browser's private profile folder (its HOME), which `close()` then removes (the next
  browser removes those of processes that died without closing theirs).
- Offline: Chromium resolves no host name and has a dead proxy, so a page reaches nothing but
  its own files (MiniWoB++ tasks are local files). As root, Chromium runs without its sandbox
  (it refuses to start as root with it); as another user, with it.
- Bounded: every WebDriver command, page loads included, gets `timeout_s`; the start gets
  `START_TIMEOUT_S` (a loaded machine starts Chromium in seconds).
  A command past it (a hung page), or a browser that died, raises `BrowserError`; the browser
  is then closed and its user starts another.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from agentrl import process_reaper

if TYPE_CHECKING:
    from selenium.webdriver.chrome.service import Service  # type: ignore[import-not-found, unused-ignore]
    from selenium.webdriver.remote.webdriver import WebDriver  # type: ignore[import-not-found, unused-ignore]

T = TypeVar("T")

APT_PACKAGES = "chromium chromium-driver"
_PROFILE_PREFIX = "agentrl-chromium-"
"""Profiles are `<tmp>/agentrl-chromium-<pid>-<random>`: `<pid>` is the process that made it."""
START_TIMEOUT_S = 60.0
"""How long starting Chromium may take before it counts as hung."""
WINDOW = (500, 400)
"""The window's size: its page area must hold a MiniWoB++ task (160 x 210) and its score pane."""


class BrowserUnavailableError(RuntimeError):
    """Chromium, its driver or the Python packages that drive it are not installed."""


class BrowserError(RuntimeError):
    """The browser failed, not the policy: it would not start, a page would not load, it
    crashed, or a command hung past the timeout. `kind` is "start" | "load" | "timeout" |
    "crashed"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ActionError(Exception):
    """A command the browser refused because of what the policy asked (an element that cannot
    be clicked or typed into): feedback for the policy; the browser is fine."""


def find_browser() -> tuple[str, str]:
    """The paths of Chromium and chromedriver, or a one-line `BrowserUnavailableError` naming
    what to install."""
    for module, package in (("selenium", "selenium"), ("miniwob", "miniwob")):
        try:
            __import__(module)
        except ImportError:
            raise BrowserUnavailableError(
                f"MiniWoB-v0 needs the {package} package: pip install 'agentrl[browser]' "
                f"(miniwob==1.1.0, which brings selenium)"
            ) from None
    chromium = os.environ.get("MINIWOB_CHROME_BINARY") or shutil.which("chromium")
    driver = os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver))
               if not path or not os.access(path, os.X_OK)]
    if missing or chromium is None or driver is None:
        raise BrowserUnavailableError(
            f"MiniWoB-v0 needs Chromium and its WebDriver, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: apt-get install -y "
            f"{APT_PACKAGES} (or set MINIWOB_CHROME_BINARY and MINIWOB_CHROMEDRIVER)")
    return chromium, driver


class Browser:
    """A headless Chromium with its chromedriver (module docstring). `driver` is Selenium's
    WebDriver; call it through `run`, which bounds and classifies failures."""

    def __init__(self, *, timeout_s: float = 20.0) -> None:
        from selenium.webdriver.remote.client_config import ClientConfig  # type: ignore[import-not-found, unused-ignore]

        chromium, driver_path = find_browser()
        # Selenium Manager is not run (the driver's path is given); should anything start it,
        # it would try to send usage statistics, which cannot leave this machine.
        os.environ.setdefault("SE_AVOID_STATS", "true")
        self.timeout_s = timeout_s
        _remove_stale_profiles()
        self.profile = tempfile.mkdtemp(prefix=f"{_PROFILE_PREFIX}{os.getpid()}-")
        self.pgid: int | None = None
        self.closed = False
        self._service: Service | None = None
        try:
            service = self._start_service(driver_path)
            self.pgid = service.process.pid
            process_reaper.group_reaper().watch(self.pgid)
            # Selenium types the timeout as an int; urllib3 takes any number of seconds.
            self._config = ClientConfig(remote_server_addr=service.service_url,
                                        timeout=START_TIMEOUT_S)  # type: ignore[arg-type, unused-ignore]
            self.driver: WebDriver = self._start_session(chromium, service.service_url)
            self._config.timeout = timeout_s  # type: ignore[assignment, unused-ignore]
            self.driver.set_page_load_timeout(timeout_s)
            self.driver.set_script_timeout(timeout_s)
        except BaseException:
            self.close()
            raise

    def _start_service(self, driver_path: str) -> Service:
        from selenium.common.exceptions import WebDriverException  # type: ignore[import-not-found, unused-ignore]
        from selenium.webdriver.chrome.service import Service  # type: ignore[import-not-found, unused-ignore]

        # HOME is the private profile, so that the crash handlers' files land there too.
        env = {**os.environ, "HOME": self.profile}
        service = Service(executable_path=driver_path, env=env, log_output=subprocess.DEVNULL,
                          popen_kw={"start_new_session": True})
        self._service = service
        try:
            service.start()
        except WebDriverException as e:
            raise BrowserError("start", f"chromedriver ({driver_path}) did not start: "
                                        f"{_first_line(e)}") from None
        return service

    def _start_session(self, chromium: str, url: str) -> WebDriver:
        from selenium import webdriver  # type: ignore[import-not-found, unused-ignore]
        from selenium.webdriver.chromium.remote_connection import (  # type: ignore[import-not-found, unused-ignore]
            ChromiumRemoteConnection,
        )

        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in chromium_args(self.profile):
            options.add_argument(arg)
        executor = ChromiumRemoteConnection(remote_server_addr=url, vendor_prefix="goog",
                                            browser_name="chrome", client_config=self._config)
        t0 = time.monotonic()
        try:
            return webdriver.Remote(command_executor=executor, options=options)
        except Exception as e:  # noqa: BLE001 (whatever stops the start is the browser's)
            timed_out = time.monotonic() - t0 >= START_TIMEOUT_S
            why = f"did not start within {START_TIMEOUT_S:g} s" if timed_out else "did not start"
            raise BrowserError("start", f"Chromium ({chromium}) {why}: {_first_line(e)}") \
                from None

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later command by `timeout_s` (a pooled browser's next env may differ)."""
        if timeout_s == self.timeout_s or self.closed:
            return
        self.timeout_s = timeout_s
        self._config.timeout = timeout_s  # type: ignore[assignment, unused-ignore]
        with contextlib.suppress(Exception):  # a dead browser shows itself at the next command
            self.driver.set_page_load_timeout(timeout_s)
            self.driver.set_script_timeout(timeout_s)

    def responds(self) -> bool:
        """Whether the browser answers a trivial command within its timeout; one that does not
        is closed (a pool's check before it hands the browser out)."""
        try:
            return self.run("checking the browser",
                            lambda: self.driver.execute_script("return 1;")) == 1
        except (BrowserError, ActionError):
            self.close()
            return False

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`, a call to the driver. Raises `ActionError` for a command refused because of
        what was asked, and `BrowserError` (closing the browser) when the browser failed."""
        from selenium.common.exceptions import (  # type: ignore[import-not-found, unused-ignore]
            ElementClickInterceptedException,
            ElementNotInteractableException,
            InvalidArgumentException,
            JavascriptException,
            MoveTargetOutOfBoundsException,
            StaleElementReferenceException,
        )

        if self.closed:
            raise BrowserError("crashed", f"{what}: the browser is closed")
        try:
            return fn()
        except (ElementClickInterceptedException, ElementNotInteractableException,
                InvalidArgumentException, JavascriptException, MoveTargetOutOfBoundsException,
                StaleElementReferenceException) as e:
            raise ActionError(_first_line(e)) from None
        except Exception as e:  # noqa: BLE001 (anything else means the browser failed)
            timed_out = "timed out" in str(e).lower() or isinstance(e, TimeoutError)
            self.close()
            if timed_out:
                raise BrowserError("timeout", f"{what}: the browser did not answer within "
                                              f"{self.timeout_s:g} s (hung)") from None
            raise BrowserError("crashed", f"{what}: the browser failed ({_first_line(e)})") \
                from None

    def close(self) -> None:
        """Kill every process of the browser and remove its profile. Idempotent."""
        if self.closed:
            return
        self.closed = True
        driver = getattr(self._service, "process", None)  # None until chromedriver started
        if driver is not None:
            self.pgid = driver.pid
            process_reaper.kill_group(driver.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.wait(timeout=5)  # it is our child: reap it
        if self.pgid is not None:
            pgid = self.pgid
            _wait_gone(lambda: _group_members(pgid), within_s=2.0)
            process_reaper.group_reaper().forget(pgid)
        # Chromium's crash handlers left the group; they end with the browser, or here.
        process_reaper.terminate(lambda: _naming(self.profile), _kill, grace_s=1.0)
        shutil.rmtree(self.profile, ignore_errors=True)

    def processes(self) -> set[int]:
        """The browser's live processes: its group, and any process naming its profile."""
        pgid = self.pgid
        group = _group_members(pgid) if pgid is not None else set()
        return group | _naming(self.profile)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def chromium_args(profile: str) -> list[str]:
    """Chromium's flags: headless, offline, in `profile`, at the `WINDOW` size, 1 pixel per CSS
    pixel (so screenshot pixels are the page's coordinates)."""
    args = [
        "--headless=new", f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--force-device-scale-factor=1", "--hide-scrollbars", "--mute-audio", "--disable-gpu",
        "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
    ]
    if os.geteuid() == 0:
        args.append("--no-sandbox")  # Chromium will not start as root with its sandbox
    return args


def _remove_stale_profiles() -> None:
    """Remove the profiles of browsers whose process is gone: close() removes its own, but a
    process killed by SIGKILL never gets to."""
    for path in Path(tempfile.gettempdir()).glob(f"{_PROFILE_PREFIX}*-*"):
        pid = path.name.removeprefix(_PROFILE_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _first_line(e: BaseException) -> str:
    text = (getattr(e, "msg", None) or str(e) or type(e).__name__).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, process group) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def _group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes of a process group."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == pgid and stat[0] != "Z":
            out.add(int(pid))
    return out


def _naming(marker: str) -> set[int]:
    """Live processes whose command line holds `marker`."""
    needle, out = marker.encode(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        stat = _proc_stat(pid)
        if stat is not None and stat[0] != "Z":
            out.add(int(pid))
    return out


def _wait_gone(members: Callable[[], set[int]], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while members() and time.monotonic() < deadline:
        time.sleep(0.02)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signum)

