"""Process memory for the leak tests and tests/device/rss_probe.py (Linux): RSS, glibc's heap in use,
and RSS per mapping, so a drift can be told apart: heap in use (a leak of malloc'ed memory), heap
pages kept by the allocator, or other mappings (a driver's, a library's)."""

from __future__ import annotations

import ctypes
import os
import re


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _Mallinfo2
except (OSError, AttributeError):  # not glibc >= 2.33
    _libc = None


def heap_bytes() -> int:
    """Bytes malloc has handed out and not had back (mallinfo2: uordblks + hblkhd); -1 without glibc."""
    if _libc is None:
        return -1
    mi = _libc.mallinfo2()
    return mi.uordblks + mi.hblkhd


def malloc_trim() -> None:
    if _libc is not None:
        _libc.malloc_trim(0)


_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def smaps_rss_kib() -> dict[str, int]:
    """RSS (KiB) by mapping: the mapped file's name, [heap], [stack], or [anon]."""
    out: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                parts = line.split(maxsplit=5)
                name = os.path.basename(parts[5].strip()) if len(parts) > 5 and parts[5].strip() else "[anon]"
            elif line.startswith("Rss:"):
                out[name] = out.get(name, 0) + int(line.split()[1])
    return out


def snapshot() -> dict:
    return {"rss_kib": rss_kib(), "heap_bytes": heap_bytes(), "maps": smaps_rss_kib()}


def growth(a: dict, b: dict) -> dict:
    """MB grown from snapshot a to b: RSS, heap in use, and each mapping that moved by >= 0.5 MB."""
    maps = {k: round((b["maps"].get(k, 0) - a["maps"].get(k, 0)) / 1024, 2) for k in set(a["maps"]) | set(b["maps"])}
    return {
        "rss_mb": round((b["rss_kib"] - a["rss_kib"]) / 1024, 2),
        "heap_mb": round((b["heap_bytes"] - a["heap_bytes"]) / 2**20, 2),
        "maps_mb": {k: v for k, v in sorted(maps.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.5},
    }
