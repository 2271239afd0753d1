"""Check a DeepSpeed hostfile before launching: ``ds-bertopt hostfile FILE``.

DeepSpeed's launcher stops on a malformed hostfile with a traceback; node-local batch planning
additionally needs every node to run the same number of ranks. This check says, in one line,
what is wrong (duplicate host, bad line, unequal or zero slots) or prints the job's shape.
"""

from __future__ import annotations

import argparse
import re

from .errors import ConfigError

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"hostfile {path} cannot be read: {exc}") from None
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            raise ConfigError(f"hostfile {path} line {number}: {raw.strip()!r} is not 'HOST slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if any(h == host for h, _ in hosts):
            raise ConfigError(f"hostfile {path} line {number}: host {host} is listed twice")
        if slots == 0:
            raise ConfigError(f"hostfile {path} line {number}: host {host} has slots=0")
        hosts.append((host, slots))
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts")
    slot_counts = {s for _, s in hosts}
    if len(slot_counts) > 1:
        detail = ", ".join(f"{h}={s}" for h, s in hosts)
        raise ConfigError(
            f"hostfile {path}: nodes have different slot counts ({detail}); node-local batch "
            "planning needs the same number of ranks on every node"
        )
    return hosts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds-bertopt hostfile", description=__doc__)
    parser.add_argument("path")
    args = parser.parse_args(argv)
    hosts = parse_hostfile(args.path)
    slots = hosts[0][1]
    print(
        f"{args.path}: {len(hosts)} node(s) × {slots} rank(s) = world size {len(hosts) * slots}: "
        + ", ".join(h for h, _ in hosts)
    )
    return 0
