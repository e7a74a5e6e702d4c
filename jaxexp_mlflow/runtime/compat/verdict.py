"""The verdict and its reasons: ``ok`` / ``warn`` / ``incompatible``, one :class:`Reason`
(code, severity, message, action) per finding, gathered in a :class:`Verdict`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

OK, WARN, INCOMPATIBLE = "ok", "warn", "incompatible"


SEVERITY_RANK = {OK: 0, WARN: 1, INCOMPATIBLE: 2}


@dataclass(frozen=True)
class Reason:
    """One finding: what is wrong (``message``), what to do about it (``action``)."""

    code: str
    severity: str  # "warn" or "incompatible"
    message: str
    action: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message} {self.action}"

    def to_dict(self) -> dict[str, str]:
        """JSON-able form."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Verdict:
    """ok / warn / incompatible, with one reason (and what to do) per finding.

    ``environment`` is the snapshot the verdict was made against and ``exporter`` what is known
    or estimated of the exporting jaxlib (version, build date or date bounds).
    """

    status: str = OK
    reasons: tuple[Reason, ...] = field(default_factory=tuple)
    environment: dict[str, Any] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True unless the verdict is ``incompatible``."""
        return self.status != INCOMPATIBLE

    def codes(self) -> list[str]:
        """The reason codes, in order."""
        return [r.code for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``jaxexp check --json`` prints)."""
        return {
            "status": self.status,
            "reasons": [r.to_dict() for r in self.reasons],
            "environment": dict(self.environment),
            "exporter": dict(self.exporter),
        }

    def __str__(self) -> str:
        lines = [f"compatibility: {self.status}"]
        lines += [f"- {r}" for r in self.reasons]
        return "\n".join(lines)
