"""Standard Webhooks signatures, verified by an independent implementation (the
`standardwebhooks` package): one per active secret, so a rotation loses no delivery."""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from relayd.sinks.webhook.signing import SecretsError, parse_secrets, signature_header

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 24).decode()
OTHER = "whsec_" + base64.b64encode(b"x" * 32).decode()
BODY = b'{"data":{"n":1},"timestamp":"2024-05-01T12:00:00Z","type":"order.paid"}'
MSG_ID = "0190a8f2-5c5e-7e4a-9d6b-6f1d8c3b2a10"


def _headers(signature: str, timestamp_s: int) -> dict[str, str]:
    return {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": signature,
    }


@pytest.mark.parametrize(
    ("file_text", "verifiers", "refusers"),
    [
        (OLD, [OLD], [NEW, OTHER]),
        (f"{OLD}\n{NEW}\n", [OLD, NEW], [OTHER]),  # mid-rotation: either secret verifies
        (f"# rotated\n{NEW}\n", [NEW], [OLD, OTHER]),  # after it: the old one no longer
    ],
)
def test_the_reference_library_verifies_every_active_secret(
    file_text: str, verifiers: list[str], refusers: list[str]
) -> None:
    """Each receiver holding one active secret verifies; one holding another refuses."""
    now = int(time.time())
    signature = signature_header(parse_secrets(file_text), MSG_ID, now, BODY)
    assert len(signature.split(" ")) == len(verifiers)
    for secret in verifiers:
        assert Webhook(secret).verify(BODY, _headers(signature, now)) == {
            "data": {"n": 1},
            "timestamp": "2024-05-01T12:00:00Z",
            "type": "order.paid",
        }
    for secret in refusers:
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(BODY, _headers(signature, now))


def test_the_signature_covers_id_timestamp_and_body() -> None:
    """Changing the id, the timestamp or a byte of the body fails verification."""
    now = int(time.time())
    keys = parse_secrets(OLD)
    signature = signature_header(keys, MSG_ID, now, BODY)
    assert signature == Webhook(OLD).sign(MSG_ID, datetime.fromtimestamp(now, UTC), BODY.decode())
    for headers, body in [
        ({**_headers(signature, now), "webhook-id": MSG_ID[:-1] + "1"}, BODY),
        (_headers(signature, now - 1), BODY),
        (_headers(signature, now), BODY.replace(b"1", b"2")),
    ]:
        with pytest.raises(WebhookVerificationError):
            Webhook(OLD).verify(body, headers)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "holds no whsec_ line"),
        ("whsec_", "line 1: the key is 0 bytes"),
        (f"{OLD}\nwhsek_abc", "line 2 does not start with whsec_"),
        ("whsec_ab$c", "line 1: the text after whsec_ is not base64"),
        ("whsec_" + base64.b64encode(b"k" * 65).decode(), "line 1: the key is 65 bytes"),
        ("\n".join([OLD] * 9), "holds 9 secrets; at most 8"),
    ],
)
def test_unusable_secret_text_is_named_without_content(text: str, error: str) -> None:
    """A bad file's error names the line and the problem, never the secret."""
    with pytest.raises(SecretsError) as refused:
        parse_secrets(text)
    assert str(refused.value) == error or str(refused.value).startswith(error)
    assert OLD.removeprefix("whsec_") not in str(refused.value)
