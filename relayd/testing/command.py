"""`relayd emulator` and `relayd receiver`: the commands that serve the in-memory OJS emulator
(relayd/testing/emulator/) and a verifying Standard Webhooks receiver (relayd/testing/
webhook_receiver.py), for trials, demos and tests; each is imported only when its command
runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relayd.core.errors import EXIT_OK, ConfigError

if TYPE_CHECKING:
    from relayd.operator.command import Commands


def add_commands(commands: Commands, common: argparse.ArgumentParser) -> None:
    """`relayd emulator`, beside its handler."""
    emulator = commands.add_parser(
        "emulator", help="serve the in-memory OJS emulator (for demos and tests)"
    )
    emulator.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT")
    emulator.add_argument(
        "--duplicate-mode",
        choices=("spec409", "overwrite", "pk500"),
        default="spec409",
        help="a reused job id: 409 (conformance), silent overwrite (redis, lite), 500 (postgres)",
    )
    emulator.add_argument(
        "--queue-source",
        choices=("options", "top_level", "either"),
        default="options",
        help="where the job's queue is read (OJS binding, the top-level-queue gateway, or both)",
    )
    emulator.add_argument("--batch-atomic", action=argparse.BooleanOptionalAction, default=True)
    emulator.add_argument(
        "--batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve POST /ojs/v1/jobs/batch and advertise it in the manifest",
    )
    emulator.add_argument("--auth-token-file", metavar="PATH")
    emulator.add_argument("--retention-s", type=float, metavar="SECONDS")
    emulator.add_argument(
        "--tls-cert", metavar="PATH", help="serve HTTPS with this PEM certificate (chain)"
    )
    emulator.add_argument("--tls-key", metavar="PATH", help="the PEM private key of --tls-cert")
    emulator.set_defaults(handler=run)
    receiver = commands.add_parser(
        "receiver",
        help="serve a Standard Webhooks receiver that verifies every delivery and prints a "
        "line for each (for trials; needs the relayd[demo] extra)",
    )
    receiver.add_argument("--listen", default="127.0.0.1:8081", metavar="HOST:PORT")
    receiver.add_argument(
        "--secret-file",
        required=True,
        metavar="PATH",
        help="the secrets to verify with, one whsec_<base64> per line (relayd's sink.secret_file)",
    )
    receiver.set_defaults(handler=run_receiver)


def run(args: argparse.Namespace) -> int:
    """Serve the emulator until interrupted."""
    from relayd.config.sections import parse_listen  # noqa: PLC0415
    from relayd.testing.emulator import config_from_options, serve  # noqa: PLC0415
    from relayd.testing.emulator.app import tls_context  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise ConfigError("--listen", str(exc)) from None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert", "give --tls-cert and --tls-key together")
    ssl_context = None
    if args.tls_cert is not None:
        try:
            ssl_context = tls_context(args.tls_cert, args.tls_key)
        except OSError as exc:  # ssl.SSLError is an OSError too
            raise ConfigError("--tls-cert", f"cannot load the certificate and key: {exc}") from None
    try:
        config = config_from_options(
            duplicate_mode=args.duplicate_mode,
            queue_source=args.queue_source,
            batch_atomic=args.batch_atomic,
            batch_enqueue=args.batch,
            auth_token_file=args.auth_token_file,
            retention_s=args.retention_s,
        )
    except ValueError as exc:
        raise ConfigError("emulator", str(exc)) from None
    serve(host, port, config, ssl_context=ssl_context)
    return EXIT_OK


def run_receiver(args: argparse.Namespace) -> int:
    """Serve the receiver until interrupted: every delivery answered 204 when a secret of
    the file verifies it (401 otherwise), and a JSON line for each on stdout."""
    from relayd.config.sections import parse_listen  # noqa: PLC0415
    from relayd.sinks.webhook.signing import SecretsError, parse_secrets  # noqa: PLC0415

    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        raise ConfigError("--listen", str(exc)) from None
    try:
        text = Path(args.secret_file).read_text(encoding="utf-8")
        parse_secrets(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--secret-file", f"cannot read {args.secret_file}: {exc}") from None
    except SecretsError as exc:
        raise ConfigError("--secret-file", f"{args.secret_file} {exc}") from None
    try:
        import standardwebhooks  # noqa: F401, PLC0415 - the independent verifier
    except ImportError:
        raise ConfigError(
            "receiver",
            "needs the standardwebhooks package: the 'demo' extra, pip install '.[demo]'",
        ) from None
    secrets = [line.strip() for line in text.splitlines() if line.strip().startswith("whsec_")]
    asyncio.run(_receive(host, port, secrets))
    return EXIT_OK


async def _receive(host: str, port: int, secrets: list[str]) -> None:
    from relayd.testing.webhook_receiver import receiving  # noqa: PLC0415

    def announce(line: dict[str, Any]) -> None:
        print(json.dumps(line), flush=True)  # noqa: T201 - the command's output

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with receiving(secrets, port=port, host=host, announce=announce) as receiver:
        print(f"webhook-receiver listening on {receiver.url}", file=sys.stderr, flush=True)  # noqa: T201
        await stop.wait()
