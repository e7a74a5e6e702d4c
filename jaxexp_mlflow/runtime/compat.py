"""Compatibility verdict of an archived model against the running environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Verdict:
    """ok / warn / incompatible, with one reason (and what to do) per finding."""

    status: str = "ok"
    reasons: tuple[str, ...] = field(default_factory=tuple)


def assess(meta: dict[str, Any]) -> Verdict:
    """Judge whether the model described by ``meta`` (MLmodel ``jaxexp`` section) runs here."""
    return Verdict()
