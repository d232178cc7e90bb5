"""The base of every config section: pydantic, every field documented, unknown keys an
error (never silently dropped), assignments validated."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

