"""JSON schemas the structured-output tests generate against: nested objects, arrays, enums,
required fields, numbers with bounds. Every string and array is bounded so that a random-weight
model, which the constraint alone steers, always finishes within the tests' max_tokens."""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0,
                                                              "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": SHORT},
     "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                          "maximum": 9},
                                                   "role": {"enum": ["admin", "guest"]}},
                 "required": ["id", "role"]}},
     "required": ["user"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1,
                                                "maximum": 1}},
     "required": ["score"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"points": {
        "type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
                                                   "maximum": 5},
                                             "y": {"type": "integer", "minimum": -5,
                                                   "maximum": 5}},
            "required": ["x", "y"]}}},
     "required": ["points"]},
    {"type": "object", "properties": {"status": {"const": "done"},
                                      "count": {"type": "integer", "minimum": 10,
                                                "maximum": 20}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"id": SHORT, "kind": {"enum": ["x", "y", "z"]},
                                      "meta": {"type": "object",
                                               "properties": {"v": {"type": "integer",
                                                                    "minimum": 0,
                                                                    "maximum": 3}},
                                               "required": ["v"]}},
     "required": ["id", "kind", "meta"]},
]
