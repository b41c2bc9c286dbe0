"""The counters of one data set's loading (:class:`DatasetStats`): rows read, malformed rows skipped,
duplicates removed, prompts dropped or truncated for length, and the final size. The loader, the
tokenization and the data set share one instance, and the trainer logs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_megatron.data.errors import DatasetError

__all__ = ["DatasetStats"]


_MAX_KEPT_ERRORS = 5  # malformed-row messages kept in the stats, enough to see the pattern


@dataclass
class DatasetStats:
    """What loading did to the rows, for the trainer to log."""

    files: list[str] = field(default_factory=list)
    rows_read: int = 0
    malformed_skipped: int = 0
    duplicates_removed: int = 0
    conflicting_duplicates: int = 0
    """Removed duplicates whose ground truth differed from the kept row's (a data quality warning)."""
    too_long_dropped: int = 0
    too_long_truncated: int = 0
    longest_prompt_tokens: int = 0
    """Longest prompt seen before truncation; helps to choose max_prompt_length."""
    final_size: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' error messages."""

    def record_malformed(self, error: DatasetError) -> None:
        self.malformed_skipped += 1
        if len(self.malformed_examples) < _MAX_KEPT_ERRORS:
            self.malformed_examples.append(str(error))

    def as_metrics(self) -> dict[str, int]:
        """The counters, for TensorBoard or a JSON summary."""
        names = (
            "rows_read",
            "malformed_skipped",
            "duplicates_removed",
            "conflicting_duplicates",
            "too_long_dropped",
            "too_long_truncated",
            "longest_prompt_tokens",
            "final_size",
        )
        return {name: getattr(self, name) for name in names}

    def summary(self) -> str:
        """One log line, e.g. ``960 rows read, 930 duplicates removed, ... -> 30 prompts``."""
        parts = [f"{self.rows_read} rows read from {len(self.files)} file(s)"]
        optional = (
            ("malformed rows skipped", self.malformed_skipped),
            ("duplicates removed", self.duplicates_removed),
            ("duplicates with a different ground truth", self.conflicting_duplicates),
            ("too long and dropped", self.too_long_dropped),
            ("too long and left-truncated", self.too_long_truncated),
        )
        parts += [f"{count} {label}" for label, count in optional if count]
        if self.longest_prompt_tokens:
            parts.append(f"longest prompt {self.longest_prompt_tokens} tokens")
        return ", ".join(parts) + f" -> {self.final_size} prompts"
