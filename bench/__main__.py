"""`python -m bench [--quick] [SCENARIO ...]`: relayd's performance scenarios (bench/README.md).

Every scenario runs against one embedded PostgreSQL and one OJS emulator process for the
whole run, with relayd as real `relayd run` processes, and compares against a baseline
measured in the same run. Each prints one JSON line (its name, parameters and every
figure) and a short summary. Figures vary with the machine; the ratios are the result.
Never pass/fail. `python -m bench sampler` times the backlog sampler instead
(bench/sampler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench import (
    appends,
    backlog,
    console,
    drain,
    horizon,
    lag,
    memory,
    nats,
    ordered,
    replicas,
    rowcost,
    tracing,
    webhook,
)
from bench.harness import Bench, open_bench
from bench.measure import BenchError, Result

SCENARIOS: dict[str, Callable[[Bench], Awaitable[Result]]] = {
    drain.NAME: drain.run,
    lag.NAME: lag.run,
    backlog.NAME: backlog.run,
    horizon.NAME: horizon.run,
    memory.NAME: memory.run,
    replicas.NAME: replicas.run,
    nats.NAME: nats.run,
    webhook.NAME: webhook.run,
    tracing.NAME: tracing.run,
    appends.NAME: appends.run,
    ordered.NAME: ordered.run,
    console.NAME: console.run,
    rowcost.NAME: rowcost.run,
}


async def _run(names: list[str], args: argparse.Namespace) -> int:
    """Every scenario on a durable server, then (`--both`) again on a scratch one, whose
    headlines are then printed beside the durable ones."""
    durabilities = [False] if args.scratch else [True, False] if args.both else [True]
    failed = 0
    headlines: dict[bool, dict[str, dict[str, float]]] = {}
    for durable in durabilities:
        results = await _run_on(names, args, durable=durable)
        failed += len(names) - len(results)
        headlines[durable] = {name: result.headline for name, result in results.items()}
    if len(headlines) == 2:
        for line in side_by_side(headlines[True], headlines[False]):
            print(f"  {line}")
    return 1 if failed else 0


async def _run_on(
    names: list[str], args: argparse.Namespace, *, durable: bool
) -> dict[str, Result]:
    """The scenarios `names` on one embedded server; the results of those that measured."""
    quick, out = args.quick, args.out
    results: dict[str, Result] = {}
    started = time.perf_counter()
    async with open_bench(quick=quick, keep=args.keep, durable=durable) as bench:
        for name in names:
            load_1m = os.getloadavg()[0]
            began = time.perf_counter()
            try:
                result = await SCENARIOS[name](bench)
            except Exception as exc:
                if args.traceback:
                    raise
                bench.keep = True  # the relays' logs say more than one line can
                said = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
                print(f"bench: {name}: {said}", file=sys.stderr, flush=True)
                continue
            result.elapsed_s = time.perf_counter() - began
            results[name] = result
            line = result.json_line(quick=quick, durable=durable, load_1m=load_1m)
            print(line)
            for text in result.summary:
                print(f"  {text}")
            sys.stdout.flush()
            if out is not None:
                with out.open("a", encoding="utf-8") as sink:
                    sink.write(line + "\n")
    database = "durable database" if durable else "scratch database"
    mode = f"{'quick' if quick else 'full'}, {database}"
    print(
        f"bench: {len(results)} of {len(names)} scenarios ({mode}) "
        f"in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return results


def side_by_side(
    durable: dict[str, dict[str, float]], scratch: dict[str, dict[str, float]]
) -> list[str]:
    """Each headline figure measured on both servers, durable first."""
    lines = [f"{'scenario':<10}{'headline':<36}{'durable':>12}{'scratch':>12}"]
    for name, figures in durable.items():
        for key, value in figures.items():
            other = scratch.get(name, {}).get(key)
            shown = "-" if other is None else f"{other:,.2f}"
            lines.append(f"{name:<10}{key:<36}{value:>12,.2f}{shown:>12}")
    return lines


def main() -> None:
    if sys.argv[1:2] == ["sampler"]:
        from bench.sampler import main as sampler  # noqa: PLC0415 - one benchmark per run

        sampler(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help=f"one or more of {', '.join(SCENARIOS)} (default: all, in that order)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="reduced sizes: everything in about two minutes"
    )
    parser.add_argument(
        "--scratch",
        action="store_true",
        help="PostgreSQL with fsync, synchronous_commit and full_page_writes off (default: on, "
        "as production runs it)",
    )
    parser.add_argument(
        "--both",
        action="store_true",
        help="run the scenarios on a durable server, then on a scratch one, and print their "
        "headlines side by side",
    )
    parser.add_argument("--out", type=Path, help="also append each JSON line to this file")
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (logs); kept on failure"
    )
    parser.add_argument(
        "--traceback", action="store_true", help="stop at the first failure with a traceback"
    )
    args = parser.parse_args()
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(SCENARIOS)}")
    if args.both and args.scratch:
        parser.error("--both already runs on a scratch server: drop --scratch")
    names = args.scenarios or list(SCENARIOS)
    try:
        code = asyncio.run(_run(names, args))
    except BenchError as exc:  # the run's own set-up: PostgreSQL, the emulator
        print(f"bench: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


main()
