"""Headless Chromium for the viewer's tests and bench: find it, let it run a page's JS and dump the DOM, or take a
screenshot. Importable by name (``from browser import ...``), like `helpers`.

Chromium runs with a fresh profile and everything that reaches the network off (the page needs none); flags that work
in a container without a display or D-Bus.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
"""The executables tried, in order."""
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable, None when there is none."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def run_chromium(page: Path, *flags: str, fragment: str = "", timeout: float = 60) -> str:
    """Run Chromium on the file ``page`` (plus ``#fragment``) with ``flags``; its stdout."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="mempo-chromium-") as profile:
        url = Path(page).resolve().as_uri() + (f"#{fragment}" if fragment else "")
        result = subprocess.run(
            [browser, *FLAGS, f"--user-data-dir={profile}", *flags, url],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if result.returncode != 0:
        raise RuntimeError(f"chromium exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


def dump_dom(page: Path, fragment: str = "") -> str:
    """The page's DOM as HTML after its scripts ran (``--dump-dom``)."""
    return run_chromium(page, "--dump-dom", fragment=fragment)


def screenshot(page: Path, out: Path, fragment: str = "", size: tuple[int, int] = (1400, 1000)) -> Path:
    """A PNG screenshot of the page at ``size`` (width, height) into ``out``."""
    run_chromium(page, f"--screenshot={Path(out).resolve()}", f"--window-size={size[0]},{size[1]}", fragment=fragment)
    return Path(out)
