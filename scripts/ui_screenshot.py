"""Screenshot a Prefect UI page in headless Chromium (proof that the UI renders a run).

    .venv/bin/python scripts/ui_screenshot.py --out run.png                 # newest flow run
    .venv/bin/python scripts/ui_screenshot.py --page /artifacts --out a.png

Needs Debian's `chromium` (apt-get install -y chromium) and a running server (eagle3 server start).
The image is for looking at, not for the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
    "--virtual-time-budget=15000",
]


def newest_flow_run(api_url: str) -> str:
    """Id of the most recently started flow run."""
    resp = httpx.post(f"{api_url}/flow_runs/filter", json={"limit": 1, "sort": "START_TIME_DESC"}, timeout=30)
    resp.raise_for_status()
    runs = resp.json()
    if not runs:
        raise SystemExit("no flow runs on this server yet")
    return runs[0]["id"]


def screenshot(url: str, out: Path) -> None:
    """Render ``url`` headless and write a PNG to ``out``."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out.resolve()}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ui", default=os.environ.get("EAGLE3_UI_URL", "http://127.0.0.1:4200"))
    parser.add_argument("--page", help="UI path such as /artifacts; default: the newest flow run's page")
    parser.add_argument("--out", type=Path, default=Path("prefect-ui.png"))
    args = parser.parse_args()
    page = args.page or f"/runs/flow-run/{newest_flow_run(args.ui + '/api')}"
    screenshot(args.ui + page, args.out)
    print(f"screenshot of {args.ui + page}: {args.out}")


if __name__ == "__main__":
    main()
