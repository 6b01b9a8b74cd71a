"""Twenty JSON schemas (nested objects, enums, arrays, $defs, anyOf, patterns, bounds) with one valid
instance each: what the structured-output tests generate against and the mask benchmark walks.

Every string, array and number is bounded, so that even a random-weight model, whose next token is
anything the grammar allows, finishes a document well within a few hundred tokens.
"""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    ("person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
     {"name": "Ada", "age": 36}),
    ("enum_color", obj({"color": {"enum": ["red", "green", "blue"]}}), {"color": "green"}),
    ("booleans", obj({"active": {"type": "boolean"}, "admin": {"type": "boolean"}}),
     {"active": True, "admin": False}),
    ("tags_array", obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}}),
     {"tags": ["a", "c"]}),
    ("nested_address", obj({"name": S, "address": obj({"city": S, "zip": {"type": "string",
                                                                           "pattern": "^[0-9]{5}$"}})}),
     {"name": "Bo", "address": {"city": "Paris", "zip": "75001"}}),
    ("array_of_objects", obj({"items": {"type": "array", "maxItems": 3, "items": obj({"id": INT, "ok": {
        "type": "boolean"}})}}), {"items": [{"id": 1, "ok": True}, {"id": 2, "ok": False}]}),
    # a free `number` has no bound on its fraction digits (a random model never stops writing them)
    ("number_enum", obj({"price": {"enum": [0.5, 9.75, 100]}}), {"price": 9.75}),
    ("optional_fields", obj({"title": S, "note": S}, required=["title"]), {"title": "x"}),
    ("const_version", obj({"version": {"const": "v1"}, "n": INT}), {"version": "v1", "n": 3}),
    ("any_of", obj({"value": {"anyOf": [INT, {"type": "boolean"}, {"enum": ["none"]}]}}), {"value": "none"}),
    ("defs_ref", {"$defs": {"point": obj({"x": INT, "y": INT})}, **obj({"a": {"$ref": "#/$defs/point"},
                                                                       "b": {"$ref": "#/$defs/point"}})},
     {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}),
    ("matrix", obj({"rows": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 3,
                                                                       "items": INT}}}),
     {"rows": [[1, 2], [3]]}),
    ("nullable", obj({"middle": {"type": ["string", "null"], "maxLength": 6}}), {"middle": None}),
    ("pattern_code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}), {"code": "ABC-12"}),
    ("tuple", obj({"pair": {"type": "array", "prefixItems": [S, INT], "items": False, "minItems": 2}}),
     {"pair": ["k", 7]}),
    ("enum_ints", obj({"level": {"enum": [1, 2, 3, 5, 8]}}), {"level": 5}),
    ("deep_nesting", obj({"a": obj({"b": obj({"c": obj({"d": {"enum": ["x", "y"]}})})})}),
     {"a": {"b": {"c": {"d": "y"}}}}),
    ("order", obj({"id": INT, "status": {"enum": ["new", "paid", "sent"]},
                   "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                             "items": obj({"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
     {"id": 7, "status": "paid", "lines": [{"sku": "ab1", "qty": 2}]}),
    ("weather", obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]},
                     "days": {"type": "integer", "minimum": 1, "maximum": 7}}),
     {"city": "Oslo", "unit": "celsius", "days": 3}),
    ("one_of_shapes", obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": INT}),
                                               obj({"kind": {"const": "square"}, "side": INT})]}}),
     {"shape": {"kind": "square", "side": 4}}),
]
