"""What an assign reports and plans: the report every adapter returns, each target's
description, the plan the skeleton runs, and the warning a partial assign gives."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from types import FrameType

import numpy as np

from weightstore.errors import named

LISTED = 20  # names shown per category in an error; the rest are counted


SHOWN = 3  # names shown per category in a report's one-paragraph summary


TYPO = 0.8  # how alike two variable names must be for one to be offered as the other misspelt


class AssignWarning(UserWarning):
    """A non-strict assign left most of the selected variables as they were."""


@dataclass(frozen=True)
class Mismatch:
    key: str
    target: str  # "float32[3, 4]"
    value: str
    reason: str

    def __str__(self) -> str:
        if not self.target:  # refused before pairing (no layout rule converts it): no variable to name
            return f"{self.key}: value is {self.value} ({self.reason})"
        return f"{self.key}: variable is {self.target}, value is {self.value} ({self.reason})"


@dataclass(repr=False)
class Report:
    """What an assign did. ``skipped`` holds keys left alone because their bytes had not changed.

    ``str(report)`` is a one-paragraph summary (counts and the first few keys of each kind)
    and ``repr`` only counts, so printing the report of a 500-variable model stays readable;
    the lists themselves hold everything.
    """

    assigned: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[Mismatch] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # values not assigned as training state (optimizer slots, step)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        parts = [f"assigned {len(self.assigned)} variable{'s' * (len(self.assigned) != 1)}"]
        for title, items in (("skipped as unchanged", self.skipped),
                             ("left out as training state (tf1 and tf2 assign them with optimizer=True)", self.left_out),
                             ("missing (no value)", self.missing),
                             ("unexpected (no variable)", self.unexpected),
                             ("mismatched", [m.key for m in self.mismatched])):
            if items:
                parts.append(f"{len(items)} {title}: {named(items, shown=SHOWN)}")
        return "; ".join(parts) + "."

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}={len(getattr(self, name))}"
                           for name in ("assigned", "missing", "unexpected", "mismatched", "skipped", "left_out"))
        return f"Report({counts})"


@dataclass(frozen=True)
class TargetInfo:
    """A variable as the planner sees it: its key, numpy dtype, shape and trainability."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool = True


@dataclass
class Plan:
    pairs: dict[str, str]  # target key -> value (source) key
    report: Report
    #: why most variables stay as they were (``strict=False``): warned by :meth:`warn` once the
    #: assign has succeeded, not before an error that changes nothing
    warning: str = ""

    def warn(self) -> None:
        """Issue :attr:`warning`, if any, as an :class:`AssignWarning` at the user's call."""
        if self.warning:
            warnings.warn(self.warning, AssignWarning, stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside weightstore: the user's call of ``assign``,
    however many adapter frames lie between."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("weightstore."):
        frame, level = frame.f_back, level + 1
    return level
