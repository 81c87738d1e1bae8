"""An endpoint's URL as relayd shows it: without the secrets a URL may carry.

Hosted receivers often put a token in the URL itself (`/hooks/<token>`, `?key=<token>`), so
every text relayd writes about an endpoint (a log event, a row's `last_error`, a pause's
reason, `relayd status`, `relayd check`) shows it through `redact_url`, the one function
that decides what is hidden:

- the query string, whole (`?***`), and a fragment, whole (`#***`);
- user information, whole (`***@host`);
- each path segment that looks like a secret (`looks_secret`): at least 16 characters of
  letters, digits and `-._~+=%`, mixing at least two of lower case, upper case and digits
  (a token, a UUID, a long hex or base64 string; not a word, a slug or a number);
- each path segment one of the operator's patterns matches in full (`sink.secret_path_patterns`).

The scheme, host, port and the other segments stay: they are what an operator needs to
tell endpoints apart. Pure, tested as a table (tests/unit/sinks/http/test_urls.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

REDACTED = "***"
# A secret-looking segment is at least this long...
MIN_SECRET_CHARS = 16
# ...made of these characters only (what a token, a UUID or base64url is written with)...
_TOKEN = re.compile(r"[A-Za-z0-9._~+=%-]+")
# ...and mixing at least two of these classes.
_CLASSES = (re.compile(r"[a-z]"), re.compile(r"[A-Z]"), re.compile(r"[0-9]"))


def looks_secret(segment: str) -> bool:
    """Whether a path segment looks like a secret by the default rule (module docstring)."""
    if len(segment) < MIN_SECRET_CHARS or not _TOKEN.fullmatch(segment):
        return False
    return sum(1 for chars in _CLASSES if chars.search(segment)) >= 2


def redact_url(url: str, patterns: Sequence[re.Pattern[str]] = ()) -> str:
    """`url` with its query, fragment and user information replaced by `***`, and each path
    segment that looks like a secret or that one of `patterns` matches in full. A text that
    does not parse as a URL is hidden whole."""
    return _redaction(url, patterns)[0]


def hidden_parts(url: str, patterns: Sequence[re.Pattern[str]] = ()) -> tuple[str, ...]:
    """What `redact_url` hides of `url`, longest first: the texts that must not appear
    anywhere else either (a receiver's answer that echoes the URL it was called on)."""
    return tuple(sorted(set(_redaction(url, patterns)[1]), key=len, reverse=True))


def _redaction(url: str, patterns: Sequence[re.Pattern[str]]) -> tuple[str, list[str]]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED, [url]
    hidden: list[str] = []
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        hidden.append(userinfo)
        netloc = f"{REDACTED}@{host}"
    segments = []
    for segment in parts.path.split("/"):
        if segment and (looks_secret(segment) or any(p.fullmatch(segment) for p in patterns)):
            hidden.append(segment)
            segments.append(REDACTED)
        else:
            segments.append(segment)
    shown = f"{parts.scheme}://{netloc}" if parts.scheme or netloc else ""
    shown += "/".join(segments)
    if parts.query:
        hidden.append(parts.query)
        shown += f"?{REDACTED}"
    if parts.fragment:
        hidden.append(parts.fragment)
        shown += f"#{REDACTED}"
    return shown, hidden
