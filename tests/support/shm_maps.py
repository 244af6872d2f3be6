"""Which same-host transfer segments a process other than their maker has mapped.

A decode worker makes its first segment when it starts, so a segment's existence no
longer says a transfer went through shared memory; a prefill worker's mapping of it does
(it maps a decode worker's segment only to write a transfer's runs into it)."""

from __future__ import annotations

import os
import re

_MAPPED = re.compile(r"/dev/shm/(kvserve-pd-(\d+)-[0-9a-f]{16})")


def segments_mapped_by_a_peer() -> set[str]:
    """Names of segments mapped by some process that is not the one that made them."""
    found: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = [line for line in maps if "/dev/shm/kvserve-pd-" in line]
        except OSError:  # gone, or not ours to read
            continue
        for line in lines:
            match = _MAPPED.search(line)
            if match is not None and match.group(2) != pid:
                found.add(match.group(1))
    return found
