"""The chat page at / (static/chat.html: one file, its script and style inline) and the
headers it is served with: a Content-Security-Policy that runs only that script and style
(by their SHA-256), talks only to this origin, and may not be framed."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

CHAT_PAGE = (Path(__file__).parent / "static" / "chat.html").read_text()


def _sources(tag: str) -> str:
    """The CSP hash sources of the page's inline <tag> blocks."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", CHAT_PAGE, re.DOTALL)
    if not blocks:
        raise ValueError(f"the chat page has no <{tag}> block")
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks
    )


PAGE_HEADERS = {
    "Content-Security-Policy": "; ".join(
        [
            "default-src 'none'",
            f"script-src {_sources('script')}",
            f"style-src {_sources('style')}",
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    ),
    "X-Frame-Options": "DENY",  # (frame-ancestors, for browsers before CSP 2)
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
