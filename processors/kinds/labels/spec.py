"""The ``labels`` kind's spec: one label of a set, or several joined by a separator.

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from config.scenario_base import ScenarioBase

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ['LabelsScenario']


class LabelsScenario(ScenarioBase):
    """Constrain output to one label, or to several joined by a separator."""

    type: Literal["labels"] = Field(description="Scenario kind.")
    labels: list[str] = Field(min_length=1, description="The allowed labels: unique, non-empty, not padded.")
    multi_label: bool = Field(default=False, strict=True, description="Allow several labels joined by separator.")
    separator: str = Field(default=",", min_length=1, description="Joins labels when multi_label is true.")
    max_labels: int | None = Field(default=None, ge=1, strict=True, description="Most labels per answer (multi_label only).")

    union_order: ClassVar[int] = 20
    constraint_field: ClassVar[str | None] = "labels"
    structured_output: ClassVar[str | None] = "choice"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        labels = body.get("labels")
        if isinstance(labels, list):
            limits.check_labels(len(labels), "labels")

    @classmethod
    def check_one_off_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        labels = body.get("labels")
        if isinstance(labels, list):
            limits.check_inline_labels(labels, "labels")

    @model_validator(mode="after")
    def _check_labels(self) -> LabelsScenario:
        seen: set[str] = set()
        for i, label in enumerate(self.labels):
            if not label:
                raise ValueError(f"labels[{i}]: a label must not be empty")
            if label != label.strip():
                raise ValueError(f"labels[{i}]: label {label!r} has leading or trailing whitespace")
            if label in seen:
                raise ValueError(f"labels[{i}]: duplicate label {label!r}")
            if self.multi_label and self.separator in label:
                raise ValueError(
                    f"labels[{i}]: label {label!r} contains the separator {self.separator!r}, "
                    "so a multi-label answer could not be split unambiguously"
                )
            seen.add(label)
        if self.max_labels is not None and not self.multi_label:
            raise ValueError("max_labels is only meaningful with multi_label: true")
        return self
