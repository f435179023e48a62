"""JSON that strict readers take: JSON has no word for NaN or infinity, which `json.dumps` writes
as the bare tokens NaN and Infinity (JavaScript's JSON.parse, Go and older jq refuse them)."""

from __future__ import annotations

import json
import math
from typing import Any


def json_ready(value: Any) -> Any:
    """`value` with every NaN or infinity (a tier whose requests were all refused, the bound of a
    policy that does not age) as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `value` made ready, refusing anything else JSON cannot hold."""
    return json.dumps(json_ready(value), allow_nan=False, **kwargs)
