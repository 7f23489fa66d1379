"""One measured figure, as benchmark modules report it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Result:
    benchmark: str  # e.g. "loop overhead", "ResNet-50 training throughput"
    setting: str  # what varies within the benchmark, e.g. "bf16, channels_last, compile"
    value: float
    unit: str  # e.g. "ms/step", "images/s", "%"
    note: str = ""  # how to read it, or the comparison it belongs to
