"""Random JSON schemas for testing and benchmarking structured outputs: nested objects, enums,
arrays, numbers and integers with bounds, strings with lengths and patterns, booleans.

Every string and array is bounded, so that a tiny random model fills the schema well within a
few hundred tokens (an unbounded string is valid JSON only once the model closes it).
"""

from __future__ import annotations

import random

PATTERNS = ("^[a-z]{1,6}$", "^[A-Z][0-9]{2}$", "^(yes|no|maybe)$", "^[0-9]{3}-[0-9]{2}$",
            "^[a-f0-9]{4}$")
WORDS = ("red", "green", "blue", "north", "south", "cat", "dog", "alpha", "beta", "x")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties, about half of them required."""
    names = rng.sample(("id", "name", "size", "kind", "tags", "score", "ok", "meta", "code",
                        "count", "items", "level"), rng.randint(1, 4))
    properties = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "pattern", "integer", "number", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.randint(-100, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = round(rng.uniform(-10, 10), 2)
        return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 50), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(1, 4))
        if rng.random() < 0.3:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    if kind == "array":
        item = _value(rng, 2) if rng.random() < 0.7 else {"type": "integer", "minimum": 0,
                                                            "maximum": 9}
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)
