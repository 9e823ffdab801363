"""Look at the built docs site in headless chromium (``make docs-check``).

    python tests/docs_check.py --site site --out docs-check [--config mkdocs.yml]

Serves the built site on 127.0.0.1 (Material's search needs http, not file://) and drives one
headless chromium over the DevTools protocol on a pipe (``--remote-debugging-pipe``, stdlib
only). Every page in mkdocs.yml's ``nav`` must render with an ``<h1>``, an ``<article>`` with
real text, Material's stylesheet applied, no uncaught JavaScript error, and a sidebar that
links to every nav page under its nav title. The search index must hold every nav page, and
opening ``/?q=QUERY`` (Material's ``search.share``) must show results in the browser.
Screenshots of the start page, the PyTorch guide and the search results go to ``--out``.

Prints one ``PASS``/``FAIL`` line per check and a summary; exits 0 when all pass, 1 when any
fails, 2 when it cannot run (no chromium, no site).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

STEP_TIMEOUT = 60.0
"""Seconds any one browser step (start, load, query, screenshot) may take."""

WIDTH, HEIGHT = 1280, 1000
MIN_ARTICLE_CHARS = 100
SCREENSHOTS = {"index.md": "index.png", "guides/pytorch.md": "guides-pytorch.png"}
SEARCH_SCREENSHOT = "search.png"

CHROMIUM_FLAGS = [
    "--headless=new",
    # Root cannot use chromium's sandbox.
    "--no-sandbox",
    "--disable-gpu",
    # Containers often give /dev/shm 64 MiB, too little for the renderer.
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--no-first-run",
    "--no-default-browser-check",
    f"--window-size={WIDTH},{HEIGHT}",
    "--remote-debugging-pipe",
]

OFFLINE_FLAG = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
"""Fails every other host at once. Unreachable, Google Fonts held up each page's load by 5 s."""

PAGE_FACTS_JS = """(() => {
  const norm = (s) => s.replace(/\\s+/g, ' ').trim();
  const h1 = document.querySelector('article h1') || document.querySelector('h1');
  const article = document.querySelector('article');
  const header = document.querySelector('.md-header');
  const links = [...document.querySelectorAll(
    '.md-sidebar--primary .md-nav--primary a.md-nav__link')];
  return {
    h1: h1 ? norm(h1.textContent).replace(/\\s*¶$/, '') : null,
    article: article ? norm(article.innerText).length : null,
    headerColor: header ? getComputedStyle(header).backgroundColor : null,
    links: links.map((a) => [norm(a.textContent), a.href]),
  };
})()"""

SEARCH_DONE_JS = """document.querySelector('.md-search-result__item') !== null
  || document.querySelector('.md-search-result__meta')?.textContent.trim()
     === JSON.parse(document.getElementById('__config').textContent)
       .translations['search.result.none']"""
"""Results, or Material's "No matching documents"; until then it says "Initializing search"."""

SEARCH_FACTS_JS = """(() => {
  const items = [...document.querySelectorAll('.md-search-result__item')];
  const meta = document.querySelector('.md-search-result__meta');
  const toggle = document.getElementById('__search');
  return {
    count: items.length,
    meta: meta ? meta.textContent.trim() : null,
    open: Boolean(toggle && toggle.checked),
    first: items.length ? items[0].querySelector('h1, h2')?.textContent.trim() : null,
    hrefs: items.map((li) => li.querySelector('a')?.href || ''),
  };
})()"""


class CheckError(Exception):
    """A browser step failed: chromium answered with an error, exited, or took too long."""


@dataclass(frozen=True)
class NavPage:
    title: str | None
    src: str
    url: str
    """Site-relative URL, as in the search index: '' for index.md, 'guides/pytorch/'."""


def page_url(src: str, directory_urls: bool) -> str:
    """MkDocs' URL for a docs source file."""
    stem = src.removesuffix(".md")
    parent, _, name = stem.rpartition("/")
    if name in {"index", "README"}:
        if directory_urls:
            return f"{parent}/" if parent else ""
        stem = f"{parent}/index" if parent else "index"
    return f"{stem}/" if directory_urls else f"{stem}.html"


def built_file(site: Path, url: str) -> Path:
    return site / url / "index.html" if url == "" or url.endswith("/") else site / url


def _walk_nav(items: list[Any], directory_urls: bool) -> Iterator[NavPage]:
    for item in items:
        if isinstance(item, str):
            title, target = None, item
        else:
            ((title, target),) = item.items()
        if isinstance(target, list):
            yield from _walk_nav(target, directory_urls)
        elif "://" not in target:
            yield NavPage(title, target, page_url(target, directory_urls))


def read_nav(config: Path) -> list[NavPage]:
    settings = yaml.safe_load(config.read_text())
    return list(_walk_nav(settings.get("nav") or [], settings.get("use_directory_urls", True)))


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on a free port of 127.0.0.1; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _pipe() -> tuple[int, int]:
    """A pipe whose ends are above 9, so that moving them onto 3 and 4 cannot clobber them."""
    ends = os.pipe()
    above = tuple(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10) for end in ends)
    for end in ends:
        os.close(end)
    return above[0], above[1]


class Browser:
    """Headless chromium driven over --remote-debugging-pipe: NUL-terminated JSON, fds 3 and 4.

    A pipe rather than a websocket keeps this stdlib-only. Plain ``--dump-dom`` runs cannot
    wait for Material's search: its web worker runs in real time while
    ``--virtual-time-budget`` races ahead, so results appeared in only some runs on a busy
    machine.
    """

    def __init__(self, chromium: str, profile: Path, log: Path, network: bool) -> None:
        to_browser, self._to_browser = _pipe()
        self._from_browser, from_browser = _pipe()
        # subprocess cannot renumber fds, so bash puts the pipe ends on 3 and 4.
        script = (
            f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-'
        )
        flags = [
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            *([] if network else [OFFLINE_FLAG]),
        ]
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, chromium, *flags],
                pass_fds=(to_browser, from_browser),
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                start_new_session=True,
            )
        os.close(to_browser)
        os.close(from_browser)
        self._writer = os.fdopen(self._to_browser, "wb")
        self._buffer = b""
        self._last_id = 0
        self.errors: dict[str, list[str]] = {}
        """Uncaught JavaScript errors, by session."""

    def call(self, method: str, params: dict[str, Any] | None = None, session: str = "") -> Any:
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            self._writer.write(json.dumps(message).encode() + b"\0")
            self._writer.flush()
        except BrokenPipeError as e:
            raise CheckError(f"{method}: chromium has exited") from e
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            reply = self._receive(method, deadline)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise CheckError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                first_line = str(text).splitlines()[0] if text else "(no message)"
                self.errors.setdefault(reply.get("sessionId", ""), []).append(first_line)

    def _receive(self, method: str, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise CheckError(f"{method}: no answer from chromium in {STEP_TIMEOUT:.0f} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise CheckError(f"{method}: chromium has exited (see chromium.log)")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("Browser.close")
            except (CheckError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._writer.close()
        os.close(self._from_browser)


class Tab:
    """One page of the browser, at a fixed desktop viewport."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session: str = attached["sessionId"]
        self.call("Runtime.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return self.browser.call(method, params, self.session)

    def evaluate(self, expression: str, await_promise: bool = False) -> Any:
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": await_promise},
        )
        if "exceptionDetails" in result:
            raise CheckError(f"script failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = STEP_TIMEOUT) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Between a navigation's commit and its new document the context can vanish.
            try:
                if self.evaluate(expression):
                    return True
            except CheckError:
                pass
            time.sleep(0.05)
        return False

    def open(self, url: str) -> list[str]:
        """Load ``url`` up to its load event; returns the uncaught JavaScript errors."""
        errors = self.browser.errors.setdefault(self.session, [])
        errors.clear()
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CheckError(f"cannot load {url}: {result['errorText']}")
        path = json.dumps(urllib.parse.urlsplit(url).path)
        loaded = f"location.pathname === {path} && document.readyState === 'complete'"
        if not self.wait_for(loaded):
            raise CheckError(f"{url} did not finish loading in {STEP_TIMEOUT:.0f} s")
        return errors

    def screenshot(self, path: Path) -> str:
        # Material swaps in its web fonts late; wait for them so the image shows the real page.
        self.evaluate("document.fonts.ready.then(() => true)", await_promise=True)
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        path.write_bytes(data)
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        return f"{width}x{height}, {len(data) // 1024} KiB"


class Report:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def record(self, name: str, failures: list[str], detail: str = "") -> None:
        if failures:
            self.failed += 1
            print(f"FAIL {name}: {'; '.join(failures)}", flush=True)
        else:
            self.passed += 1
            print(f"PASS {name}{f' ({detail})' if detail else ''}", flush=True)


def _listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_page(tab: Tab, base: str, page: NavPage, nav: list[NavPage]) -> tuple[list[str], str]:
    """The page's own checks; returns (failures, detail for a pass)."""
    errors = tab.open(base + page.url)
    facts = tab.evaluate(PAGE_FACTS_JS)
    failures = [f"uncaught JavaScript error: {error}" for error in errors]
    if not facts["h1"]:
        failures.append("no <h1>")
    if facts["article"] is None:
        failures.append("no <article>")
    elif facts["article"] < MIN_ARTICLE_CHARS:
        failures.append(f"<article> has only {facts['article']} characters of text")
    if facts["headerColor"] in (None, "rgba(0, 0, 0, 0)", "transparent"):
        failures.append("Material's stylesheet is not applied (header has no background)")
    links = {(text, href) for text, href in facts["links"]}
    hrefs = {href for _, href in facts["links"]}
    missing = [
        other.title or other.src
        for other in nav
        if base + other.url not in hrefs
        or (other.title is not None and (other.title, base + other.url) not in links)
    ]
    if missing:
        failures.append(f"sidebar lacks links to {_listed(missing)}")
    detail = f"h1 {facts['h1']!r}, {facts['article']} chars, {len(nav)} nav links"
    return failures, detail


def check_pages(
    tab: Tab, base: str, site: Path, out: Path, nav: list[NavPage], report: Report
) -> None:
    for page in nav:
        name = f"page /{page.url}"
        if not built_file(site, page.url).is_file():
            report.record(name, [f"not built: {built_file(site, page.url)} is missing"])
            continue
        try:
            failures, detail = check_page(tab, base, page, nav)
        except CheckError as e:
            report.record(name, [str(e)])
            continue
        report.record(name, failures, detail)
        if page.src in SCREENSHOTS:
            check_screenshot(tab, out / SCREENSHOTS[page.src], report)
    for src in sorted(set(SCREENSHOTS) - {page.src for page in nav}):
        report.record(f"screenshot {SCREENSHOTS[src]}", [f"{src} is not in the nav"])


def check_screenshot(tab: Tab, path: Path, report: Report) -> None:
    try:
        report.record(f"screenshot {path.name}", [], tab.screenshot(path))
    except CheckError as e:
        report.record(f"screenshot {path.name}", [str(e)])


def check_index(site: Path, nav: list[NavPage], report: Report) -> None:
    index = site / "search" / "search_index.json"
    try:
        docs = json.loads(index.read_text())["docs"]
    except (OSError, ValueError, KeyError) as e:
        report.record("search index", [f"cannot read {index}: {e}"])
        return
    locations = {doc["location"] for doc in docs}
    missing = [f"/{page.url}" for page in nav if page.url not in locations]
    failures = [f"no entry for {_listed(missing)}"] if missing else []
    report.record("search index", failures, f"{len(docs)} entries, every nav page")


def check_search(tab: Tab, base: str, query: str, out: Path, report: Report) -> None:
    name = f"search ?q={query} in the browser"
    try:
        errors = tab.open(f"{base}?q={urllib.parse.quote(query)}")
        # Results come from Material's web worker once it has built the index.
        tab.wait_for(SEARCH_DONE_JS)
        facts = tab.evaluate(SEARCH_FACTS_JS)
    except CheckError as e:
        report.record(name, [str(e)])
        return
    failures = [f"uncaught JavaScript error: {error}" for error in errors]
    if not facts["open"]:
        failures.append("the search dialog did not open")
    if not facts["count"]:
        failures.append(f"no results (search says {facts['meta']!r})")
    elsewhere = [href for href in facts["hrefs"] if not href.startswith(base)]
    if elsewhere:
        failures.append(f"results link off the site: {_listed(elsewhere)}")
    report.record(name, failures, f"{facts['meta']}, first {facts['first']!r}")
    if facts["count"]:
        check_screenshot(tab, out / SEARCH_SCREENSHOT, report)


def run_checks(args: argparse.Namespace, chromium: str, nav: list[NavPage]) -> Report:
    site, out = args.site.resolve(), args.out.resolve()
    report = Report()
    check_index(site, nav, report)
    with serve(site) as base, tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = Browser(chromium, Path(profile), out / "chromium.log", args.network)
        try:
            tab = Tab(browser)
            check_pages(tab, base, site, out, nav, report)
            check_search(tab, base, args.query, out, report)
        except CheckError as e:
            report.record("browser", [str(e)])
        finally:
            browser.close()
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, required=True, help="the built site (site_dir)")
    parser.add_argument("--out", type=Path, required=True, help="where screenshots go")
    parser.add_argument("--config", type=Path, default=Path("mkdocs.yml"))
    parser.add_argument("--query", default="allreduce", help="a word the docs must find")
    parser.add_argument(
        "--network",
        action="store_true",
        help="let the browser reach other hosts (Google Fonts); by default only the site",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ending on SIGTERM through SystemExit runs the cleanup that stops chromium and the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    chromium = find_chromium()
    if chromium is None:
        print(
            "docs_check: chromium not found; install it: apt-get install chromium", file=sys.stderr
        )
        return 2
    if not (args.site / "index.html").is_file():
        print(
            f"docs_check: {args.site}/index.html is missing; build the site first", file=sys.stderr
        )
        return 2
    nav = read_nav(args.config)
    if not nav:
        print(f"docs_check: {args.config} has no nav pages to check", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = run_checks(args, chromium, nav)
    elapsed = time.monotonic() - started
    print(f"docs check: {report.passed} passed, {report.failed} failed in {elapsed:.0f} s")
    print(f"screenshots: {args.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
