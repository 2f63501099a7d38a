"""Screenshots of the docs site's pages, to look at them as a reader does.

    python docs/screenshots.py [--out DIR] [--height 4000] [PAGE ...]

Builds the site (`mkdocs build --strict` into a temporary folder, or `--site DIR`),
serves it with `python -m http.server` on a free port of 127.0.0.1, and takes one
screenshot of each page with headless Chromium, 1280 pixels wide (a desktop browser
window) and `--height` pixels high, into DIR/<page>.png. A page is named by its path
in the site without `index.html` (`guides/mpi4jax`), `home` for the home page. A page
the site does not have is skipped with a message. The server is stopped by its process
id at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["home", "getting-started", "guides/sharp-bits", "guides/mpi4jax", "guides/layers",
         "guides/training", "guides/checkpoints", "api/nn", "api/compat", "performance"]
BROWSERS = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]


def build(site: Path) -> None:
    """`mkdocs build --strict -d site`, with this Python's mkdocs."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"mkdocs build failed:\n{done.stdout}{done.stderr}")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(site: Path, port: int) -> subprocess.Popen:
    """`python -m http.server` on `port`, serving `site`; returns once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
         "--directory", str(site)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return server
        except (urllib.error.URLError, ConnectionError, OSError):
            if server.poll() is not None:
                sys.exit(f"the http server exited with code {server.returncode}")
            time.sleep(0.1)
    stop(server)
    sys.exit(f"the http server did not answer on port {port}")


def stop(server: subprocess.Popen) -> None:
    """Stop the server this script started, by its process id."""
    if server.poll() is None:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()


def shoot(browser: str, url: str, png: Path, width: int, height: int, profile: Path) -> bool:
    """One screenshot of `url` into `png` with headless Chromium; whether it was written."""
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
           f"--window-size={width},{height}", f"--screenshot={png}", url]
    try:
        subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    except subprocess.TimeoutExpired:
        print(f"{url}: Chromium took more than 180 s", file=sys.stderr)
    return png.exists()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", default=PAGES,
                        help="pages by their path in the site, `home` for the home page "
                             f"(default: {' '.join(PAGES)})")
    parser.add_argument("--out", default="screenshots", help="folder for the PNGs")
    parser.add_argument("--site", default=None,
                        help="an already built site to serve (default: build one)")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=4000)
    parser.add_argument("--browser", default=None,
                        help=f"the Chromium binary (default: the first of {BROWSERS} found)")
    args = parser.parse_args()

    browser = args.browser or next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        sys.exit(f"no Chromium found (tried {', '.join(BROWSERS)}); name it with --browser")
    out = Path(args.out).resolve()
    with tempfile.TemporaryDirectory(prefix="vjpmpi-screenshots-") as tmp:
        site = Path(args.site).resolve() if args.site else Path(tmp) / "site"
        if not args.site:
            build(site)
        port = free_port()
        server = serve(site, port)
        failed = []
        try:
            for page in args.pages:
                path = "" if page in ("home", "index", "") else page.strip("/") + "/"
                if not (site / path / "index.html").exists():
                    print(f"{page}: no such page in the site, skipped")
                    continue
                png = out / f"{page.strip('/').replace('/', '-') or 'home'}.png"
                if shoot(browser, f"http://127.0.0.1:{port}/{path}", png, args.width,
                         args.height, Path(tmp) / "profile"):
                    print(f"{page}: {png}")
                else:
                    print(f"{page}: no screenshot written", file=sys.stderr)
                    failed.append(page)
        finally:
            stop(server)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
