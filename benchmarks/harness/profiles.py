"""Network profiles for the emulated cluster: a name -> (rate, one-way delay) table.

What a profile means
--------------------
``rate`` is the line rate of ONE worker's link to a switch, full duplex, like a NIC on a
non-blocking switch: each worker can send at ``rate`` and, at the same time, receive at ``rate``.
``delay`` is the one-way latency that a packet sees from one worker to another (the cluster
splits it evenly over the sender's and the receiver's link), so a ping between two workers
takes ``2 * delay`` round trip.

The table is plain data that users extend: ``load_profiles(path)`` reads a YAML or JSON mapping
such as ``{"wan": {"rate": "200mbit", "delay": "20ms"}}``, and ``parse_profile`` also accepts an
ad-hoc spec ``"rate=500mbit,delay=1ms"`` or a bare rate ``"500mbit"``.

Units follow ``tc``: ``bit kbit mbit gbit tbit`` are bits per second and ``bps kbps mbps gbps
tbps`` are BYTES per second (``16gbps`` = 16 GB/s = 128 Gbit/s); prefixes are decimal.
Delays take ``s ms us ns`` (a bare number is seconds).

The PCIe and NVLink profiles describe GPU interconnects.  They stay in the table with their
nominal rates so that GPU sweeps can name them, but a CPU machine cannot push that many bytes
through a virtual Ethernet pair: the host's memory copies become the bottleneck, not the link.
They are marked ``cpu_emulable=False`` and the cluster warns when one is used.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

_RATE_UNITS = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_DELAY_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


@dataclass(frozen=True)
class Profile:
    """One network profile.

    ``rate_bps`` is bits per second per worker link and direction; ``None`` means unshaped
    (the ``loopback`` profile: all workers in the host namespace over 127.0.0.1).
    ``delay_s`` is the one-way worker-to-worker latency in seconds.
    """

    name: str
    rate_bps: Optional[float]
    delay_s: float = 0.0
    cpu_emulable: bool = True
    note: str = ""

    @property
    def shaped(self) -> bool:
        return self.rate_bps is not None

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bps is None else format_rate(self.rate_bps)
        text = f"{self.name:<10} {rate:>12}  delay {format_delay(self.delay_s):>7}"
        if not self.cpu_emulable:
            text += "  [too fast to emulate faithfully on a CPU host]"
        return text + (f"  {self.note}" if self.note else "")


PROFILES: Dict[str, Profile] = {p.name: p for p in [
    Profile("loopback", None, 0.0, note="all workers on 127.0.0.1, no namespaces, no shaping"),
    Profile("10mbit", 10e6, 1e-3, note="slow office link"),
    Profile("100mbit", 100e6, 500e-6, note="Fast Ethernet"),
    Profile("1gbit", 1e9, 100e-6, note="Gigabit Ethernet"),
    Profile("10gbit", 10e9, 50e-6, note="10 GbE (may be CPU-bound on small hosts)"),
    Profile("25gbit", 25e9, 25e-6, note="25 GbE (likely CPU-bound on small hosts)"),
    Profile("100gbit", 100e9, 10e-6, cpu_emulable=False, note="100 GbE / EDR InfiniBand"),
    Profile("pcie", 16 * 8e9, 1e-6, cpu_emulable=False, note="PCIe 4.0 x16, 16 GB/s"),
    Profile("nvlink", 300 * 8e9, 1e-6, cpu_emulable=False, note="NVLink (V100), 300 GB/s"),
]}


def parse_rate(text: str) -> float:
    """``"500mbit"`` -> 5e8 bits per second.  Units as in ``tc`` (see module docstring)."""
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]+)", str(text).strip())
    unit = match.group(2).lower() if match else None
    if not match or unit not in _RATE_UNITS:
        raise ValueError(f"bad rate {text!r}: write a number and one of "
                         f"{', '.join(_RATE_UNITS)} (e.g. '500mbit', or '16gbps' for 16 GB/s)")
    value = float(match.group(1)) * _RATE_UNITS[unit]
    if value <= 0 or not math.isfinite(value):
        raise ValueError(f"bad rate {text!r}: it must be positive and finite")
    return value


def parse_delay(text: str) -> float:
    """``"1ms"`` -> 0.001 seconds; a bare number is seconds."""
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    unit = match.group(2).lower() if match else None
    if not match or unit not in _DELAY_UNITS:
        raise ValueError(f"bad delay {text!r}: write a number and one of s, ms, us, ns "
                         f"(e.g. '1ms')")
    value = float(match.group(1)) * _DELAY_UNITS[unit]
    if not math.isfinite(value) or value > 60:
        raise ValueError(f"bad delay {text!r}: it must be finite and at most 60 s")
    return value


def format_rate(bps: float) -> str:
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g}{unit}"
    return f"{bps:.4g}bit"


def format_delay(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g}{unit}"
    return f"{seconds / 1e-9:g}ns"


def _adhoc(spec: str) -> Profile:
    """Parse ``rate=500mbit,delay=1ms`` (delay optional) or a bare ``500mbit``."""
    if "=" not in spec:
        return Profile(spec, parse_rate(spec), 0.0, note="ad-hoc")
    fields = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("rate", "delay") or key in fields:
            raise ValueError(f"bad profile spec {spec!r}: item {item.strip()!r} is not one of "
                             f"rate=<rate>, delay=<delay> (each at most once), "
                             f"e.g. 'rate=500mbit,delay=1ms'")
        fields[key] = value
    if "rate" not in fields:
        raise ValueError(f"bad profile spec {spec!r}: it needs rate=<rate>, "
                         f"e.g. 'rate=500mbit,delay=1ms'")
    return Profile(spec, parse_rate(fields["rate"]), parse_delay(fields.get("delay", "0")),
                   note="ad-hoc")


def parse_profile(spec, table: Optional[Mapping[str, Profile]] = None) -> Profile:
    """Resolve a profile name from ``table`` (default ``PROFILES``), an ad-hoc spec, or a Profile.

    Raises ValueError naming the spec and the known profiles when it is neither.
    """
    if isinstance(spec, Profile):
        return spec
    table = PROFILES if table is None else table
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"bad profile {spec!r}: give a name ({', '.join(table)}) "
                         f"or a spec like 'rate=500mbit,delay=1ms'")
    spec = spec.strip()
    if spec in table:
        return table[spec]
    try:
        return _adhoc(spec)
    except ValueError as err:
        if "=" in spec or re.match(r"[0-9.]", spec):
            raise
        raise ValueError(f"unknown profile {spec!r}: known profiles are {', '.join(table)}; "
                         f"or give a spec like 'rate=500mbit,delay=1ms'") from err


def load_profiles(path: str, base: Optional[Mapping[str, Profile]] = None) -> Dict[str, Profile]:
    """Return ``base`` (default ``PROFILES``) extended by the profiles in a YAML or JSON file.

    The file maps names to ``{rate: "200mbit", delay: "20ms", note: "...", cpu_emulable: true}``;
    ``rate: null`` (or ``"unshaped"``) makes an unshaped loopback-style profile.
    """
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if os.path.splitext(path)[1].lower() == ".json":
        data = json.loads(text)
    else:
        import yaml
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"profiles file {path}: expected a mapping of name -> "
                         f"{{rate, delay}}, got {type(data).__name__}")
    table = dict(PROFILES if base is None else base)
    for name, entry in data.items():
        if not isinstance(entry, dict) or "rate" not in entry:
            raise ValueError(f"profiles file {path}: entry {name!r} = {entry!r} needs a 'rate' "
                             f"(e.g. {{rate: 200mbit, delay: 20ms}})")
        unknown = set(entry) - {"rate", "delay", "note", "cpu_emulable"}
        if unknown:
            raise ValueError(f"profiles file {path}: entry {name!r} has unknown keys "
                             f"{sorted(unknown)}; allowed: rate, delay, note, cpu_emulable")
        rate = entry["rate"]
        rate_bps = None if rate in (None, "unshaped") else parse_rate(rate)
        table[str(name)] = Profile(str(name), rate_bps, parse_delay(entry.get("delay", 0)),
                                   bool(entry.get("cpu_emulable", True)),
                                   str(entry.get("note", "")))
    return table
