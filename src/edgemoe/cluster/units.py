"""Quantities with units in cluster files: "6GiB", "5ms", "100Mbit/s", "989TFLOPS", "10MHz".

Every parser accepts a plain number (already in the base unit: bytes, seconds, bytes/s, FLOP/s, Hz),
the same number written as a string (PyYAML reads `4e6` as the string "4e6": YAML 1.1 wants `4.0e+6`),
or a string of a number followed by a unit. Decimal prefixes are powers of 1000, binary ones (Ki, Mi,
Gi, Ti) powers of 1024. Rates in bits ("Mbit/s", "Mbps") are converted to bytes/s.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*$")

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}

_BYTE_UNITS = {f"{p}B": m for p, m in (_DECIMAL | _BINARY).items()} | {"bytes": 1.0, "byte": 1.0}
_SECOND_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60.0}
_RATE_UNITS = (
    {f"{p}B/s": m for p, m in (_DECIMAL | _BINARY).items()}
    | {f"{p}bit/s": m / 8 for p, m in _DECIMAL.items()}
    | {f"{p}bps": m / 8 for p, m in _DECIMAL.items()}
)
_FLOPS_UNITS = {f"{p}FLOPS": m for p, m in _DECIMAL.items()} | {f"{p}FLOP/s": m for p, m in _DECIMAL.items()}
_HZ_UNITS = {f"{p}Hz": m for p, m in _DECIMAL.items()}


class UnitError(ValueError):
    """A quantity string that does not parse; the message lists the accepted units."""


def _parse(value: object, units: dict[str, float], what: str) -> float:
    if isinstance(value, bool):
        raise UnitError(f"expected {what}, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise UnitError(f"expected {what} as a number or a string like '10{next(iter(units))}', got {value!r}")
    match = _NUMBER.match(value)
    if match is not None and match.group(2) == "":  # a bare number in a string: YAML reads 4e6 as "4e6"
        return float(match.group(1))
    if match is None or match.group(2) not in units:
        examples = ", ".join(sorted(units)[:8])
        raise UnitError(f"cannot read {value!r} as {what}; use a number or one of the units {examples}, ...")
    return float(match.group(1)) * units[match.group(2)]


def parse_bytes(value: object) -> float:
    """Bytes from 123, '500MB', '6GiB'."""
    return _parse(value, _BYTE_UNITS, "bytes")


def parse_seconds(value: object) -> float:
    """Seconds from 0.005, '5ms', '80us'."""
    return _parse(value, _SECOND_UNITS, "seconds")


def parse_rate(value: object) -> float:
    """Bytes per second from 1.25e7, '100Mbit/s', '100Mbps', '12.5MB/s'."""
    return _parse(value, _RATE_UNITS, "a data rate in bytes/s")


def parse_flops(value: object) -> float:
    """FLOP/s from 1e12, '989TFLOPS', '42.5TFLOP/s'."""
    return _parse(value, _FLOPS_UNITS, "FLOP/s")


def parse_hz(value: object) -> float:
    """Hertz from 1e7, '10MHz'."""
    return _parse(value, _HZ_UNITS, "a bandwidth in Hz")


def format_bytes(n: float) -> str:
    """'12.8 MB'-style text (decimal prefixes) for tables."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}B"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """'100 Mbit/s'-style text for tables."""
    bits = 8 * bytes_per_s
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {prefix}bit/s"
    return f"{bits:.3g} bit/s"
