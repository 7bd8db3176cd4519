"""The book's link check: every link inside the site must resolve; external links are listed, not fetched."""
from __future__ import annotations

import html.parser
import posixpath
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

EXTERNAL_SCHEMES = ("http", "https")
IGNORED_SCHEMES = ("mailto", "javascript", "data", "tel")


class _Links(html.parser.HTMLParser):
    """Collects the ids and the href/src targets of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ("href", "src"):
            if attrs.get(key) and not (tag == "link" and attrs.get("rel") in ("preconnect", "dns-prefetch")):
                self.targets.append(attrs[key])


def _parse(page: Path) -> _Links:
    """Returns the parsed links of one page."""
    parser = _Links()
    parser.feed(page.read_text(errors="replace"))
    return parser


def check_site(site: Path) -> tuple[list[str], list[str]]:
    """Returns (broken internal links as 'page: target (why)', sorted unique external URLs) for the site."""
    site = site.resolve()
    pages = {page: _parse(page) for page in sorted(site.rglob("*.html"))
             if "_static" not in page.relative_to(site).parts}  # the theme's template fragments
    broken, external = [], set()
    for page, links in pages.items():
        for target in links.targets:
            parts = urlsplit(target)
            if parts.scheme in EXTERNAL_SCHEMES or target.startswith("//"):
                external.add(target)
                continue
            if parts.scheme in IGNORED_SCHEMES or parts.scheme:
                continue
            if not parts.path:  # a link within this page
                if parts.fragment and parts.fragment not in links.ids:
                    broken.append(f"{page.relative_to(site)}: {target} (no such anchor)")
                continue
            resolved = Path(posixpath.normpath(str(page.parent / unquote(parts.path))))
            if resolved.is_dir():
                resolved = resolved / "index.html"
            if site not in resolved.parents and resolved != site or not resolved.is_file():
                broken.append(f"{page.relative_to(site)}: {target} (no such file)")
            elif parts.fragment and resolved in pages and parts.fragment not in pages[resolved].ids:
                broken.append(f"{page.relative_to(site)}: {target} (no such anchor)")
    return broken, sorted(external)


if __name__ == "__main__":
    broken_links, external_links = check_site(Path(sys.argv[1] if len(sys.argv) > 1 else "build/book"))
    print("\n".join(external_links))
    print("\n".join(f"broken: {item}" for item in broken_links), file=sys.stderr)
    raise SystemExit(1 if broken_links else 0)
