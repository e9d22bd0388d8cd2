"""What a scan found: the drift it named, decided or reported, and what it skipped and why."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ScanReport"]


@dataclass
class ScanReport:
    adopted: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    conflicts: dict[str, list[str]] = field(default_factory=dict)
    unchanged: int = 0
    skipped: list[str] = field(default_factory=list)
    #: Why each skipped file was: moving, or damaged (and quarantined) with the reason.
    reasons: dict[str, str] = field(default_factory=dict)
    #: Tiers that could not be listed (a bucket that failed or refused): why. Their files
    #: were left as they are.
    failed: dict[str, str] = field(default_factory=dict)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    check_only: bool = False
    finished_at: float = 0.0

    @property
    def drift(self) -> int:
        return len(self.adopted) + len(self.changed) + len(self.moved) + len(self.missing)

    def summary(self) -> dict[str, object]:
        """Counts only: safe to show for a scan of millions of files."""
        return {
            "adopted": len(self.adopted),
            "changed": len(self.changed),
            "moved": len(self.moved),
            "missing": len(self.missing),
            "conflicts": len(self.conflicts),
            "failed": len(self.failed),
            "renamed": len(self.renamed),
            "unchanged": self.unchanged,
            "finished_at": self.finished_at,
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "adopted": self.adopted,
            "changed": self.changed,
            "moved": self.moved,
            "missing": self.missing,
            "conflicts": self.conflicts,
            "unchanged": self.unchanged,
            "skipped": self.skipped,
            "reasons": self.reasons,
            "failed": self.failed,
            "renamed": self.renamed,
            "check_only": self.check_only,
            "finished_at": self.finished_at,
        }
