"""Standard Webhooks signing, without I/O: reading a secret file's `whsec_` lines and the
`webhook-signature` header of one delivery.

A signature is `v1,<base64 of HMAC-SHA256(key, "<id>.<timestamp>.<body>")>`; a delivery
carries one per active secret, separated by spaces, so that a receiver that knows any one of
them verifies it: an operator rotates a secret by adding the new line, moving the receiver
over, then removing the old line (docs/webhooks.md#secrets-and-rotation). Any Standard Webhooks
library verifies these headers (the tests use the `standardwebhooks` package).

No function here puts a secret, or a piece of one, in the text of an error.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass, field

SECRET_PREFIX = "whsec_"  # noqa: S105 - the format's prefix, not a secret
SIGNATURE_VERSION = "v1"
# The specification's bounds on a key: at least 24 bytes of randomness, at most 64.
MIN_KEY_BYTES = 24
MAX_KEY_BYTES = 64
# A rotation needs two lines; a handful allows overlapping ones. More is a wrong file.
MAX_SECRETS = 8


class SecretsError(ValueError):
    """A secret file's content that cannot be used; the text names lines, never content."""


@dataclass(frozen=True, slots=True)
class SigningKeys:
    """The active keys, in the file's order. `repr` shows how many, never one."""

    keys: tuple[bytes, ...] = field(repr=False)

    def __repr__(self) -> str:
        return f"SigningKeys({len(self.keys)} keys)"


def parse_secrets(text: str) -> SigningKeys:
    """The keys a secret file holds: one `whsec_<base64>` per line; blank lines and lines
    starting with `#` are skipped. `SecretsError` names the first bad line by number."""
    keys: list[bytes] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keys.append(_key(line, number))
    if not keys:
        raise SecretsError("holds no whsec_ line (one secret per line)")
    if len(keys) > MAX_SECRETS:
        raise SecretsError(f"holds {len(keys)} secrets; at most {MAX_SECRETS} may be active")
    return SigningKeys(tuple(keys))


def _key(line: str, number: int) -> bytes:
    if not line.startswith(SECRET_PREFIX):
        raise SecretsError(f"line {number} does not start with {SECRET_PREFIX}")
    encoded = line.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SecretsError(f"line {number}: the text after {SECRET_PREFIX} is not base64") from None
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise SecretsError(
            f"line {number}: the key is {len(key)} bytes; a key is {MIN_KEY_BYTES} to "
            f"{MAX_KEY_BYTES} random bytes"
        )
    return key


def checked_secrets(text: str) -> str:
    """`text` if it holds usable secrets (`parse_secrets`); what a file watcher checks."""
    parse_secrets(text)
    return text


def signed_content(msg_id: str, timestamp_s: int, body: bytes) -> bytes:
    """What is signed: `<id>.<timestamp>.<body>`."""
    return f"{msg_id}.{timestamp_s}.".encode() + body


def signature_header(keys: SigningKeys, msg_id: str, timestamp_s: int, body: bytes) -> str:
    """`webhook-signature`: one `v1,<base64>` per key, space-separated, in the keys' order."""
    content = signed_content(msg_id, timestamp_s, body)
    # `hmac.digest` is OpenSSL's one-shot HMAC: the same bytes as `hmac.new(...).digest()`
    # without building an HMAC object per delivery (asked for every row).
    return " ".join([_signature(key, content) for key in keys.keys])


def _signature(key: bytes, content: bytes) -> str:
    return f"{SIGNATURE_VERSION},{base64.b64encode(hmac.digest(key, content, 'sha256')).decode()}"
