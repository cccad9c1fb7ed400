"""The ``regex`` kind's spec: the whole output matches a regular expression (field ``pattern``).

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from config.scenario_base import ScenarioBase

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ['RegexScenario']


class RegexScenario(ScenarioBase):
    """Constrain output to full matches of a regular expression."""

    type: Literal["regex"] = Field(description="Scenario kind.")
    pattern: str = Field(min_length=1, description="The regular expression the whole output must match.")

    union_order: ClassVar[int] = 40
    constraint_field: ClassVar[str | None] = "pattern"
    structured_output: ClassVar[str | None] = "regex"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        pattern = body.get("pattern")
        if isinstance(pattern, str):
            limits.check_regex(pattern, "pattern")
