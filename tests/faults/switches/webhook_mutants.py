"""Mutants of the webhook sink: deliberately broken deliveries, the negative controls of its
tests (tests/integration/sinks/webhook/test_mutants.py shows a test catching each). relayd knows
none of them: `install` replaces the functions a mutant breaks, from test code, in the test's
own process, and `Patches.restore` puts them back.

- ``wrong_secret``: deliveries are signed with a key that is not in the secret file;
- ``id_per_attempt``: each attempt gets a fresh `webhook-id`, so a re-sent delivery no
  longer carries its first attempt's id and receivers cannot deduplicate it (C2).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Final

from tests.faults.switches.patches import Patches

WEBHOOK_MUTANTS: Final = ("wrong_secret", "id_per_attempt")


def install(mutant: str, patches: Patches) -> None:
    """Break the webhook sink the way `mutant` does."""
    from relayd.sinks.webhook import sink as webhook  # noqa: PLC0415 - relayd only once a mutant runs
    from relayd.sinks.webhook.answers import HEADER_ID, Delivery  # noqa: PLC0415
    from relayd.sinks.webhook.signing import SigningKeys  # noqa: PLC0415

    if mutant == "wrong_secret":

        def sign(original: Any) -> Any:
            def wrapped(_keys: SigningKeys, *args: Any) -> Any:
                return original(SigningKeys((b"not the configured secret".ljust(32, b"!"),)), *args)

            return wrapped

        patches.wrap(webhook, "signature_header", sign)
    elif mutant == "id_per_attempt":

        def delivery_for(original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                delivery = original(*args, **kwargs)
                if not isinstance(delivery, Delivery):
                    return delivery
                headers = {**delivery.headers, HEADER_ID: str(uuid.uuid4())}
                return dataclasses.replace(delivery, headers=headers)

            return wrapped

        patches.wrap(webhook, "delivery_for", delivery_for)
    else:
        raise ValueError(f"{mutant!r} is not one of {', '.join(WEBHOOK_MUTANTS)}")
