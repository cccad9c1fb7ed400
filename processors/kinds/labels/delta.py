"""A PATCH of a label set: labels added and removed, order kept."""

from __future__ import annotations

import json
from typing import Any

from ..patch import DeltaReport, check_disjoint, check_unique, refused

__all__ = ["apply_labels_delta"]


def apply_labels_delta(body: dict[str, Any], add: list[Any], remove: list[Any]) -> tuple[dict[str, Any], DeltaReport]:
    """The labels scenario ``body`` with ``add`` appended and ``remove`` taken out (order kept)."""
    for what, values in (("add", add), ("remove", remove)):
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise refused(f"{what}[{i}]: a label is a string, got {json.dumps(value)[:60]}", what)
        check_unique(values, what)
    check_disjoint(add, remove)
    labels = list(body.get("labels") or [])
    present = set(labels)
    report = DeltaReport()
    gone = set()
    for label in remove:
        if label in present:
            gone.add(label)
        else:
            report.not_present.append(label)
    kept = [label for label in labels if label not in gone]
    report.removed = len(gone)
    for label in add:
        if label in present:
            report.already_present.append(label)
        else:
            kept.append(label)
            report.added += 1
    return {**body, "labels": kept}, report
