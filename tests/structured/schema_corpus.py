"""JSON Schemas for the structured-output tests: nested objects, arrays with item bounds, enums,
anyOf, string patterns and formats, bounded numbers, required and optional properties. Strings carry
a maxLength so that even a small model looping inside one ends within the token budget. Numbers
have no such bound (a fraction may go on for ever), so only bounded-range ones are used where a
small model tends to ramble (a `number` inside anyOf, the seconds of a `time`)."""
from __future__ import annotations

S = {"type": "string", "maxLength": 24}  # a short free string


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": S, "country": S, "population": {"type": "integer", "minimum": 0}})),
    ("a yes/no answer", obj({"answer": {"type": "boolean"}})),
    ("a colour", obj({"colour": {"enum": ["red", "green", "blue"]}})),
    ("a priority", {"enum": ["low", "medium", "high"]}),
    ("a temperature in Celsius", obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("a rating", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S})),
    ("a shopping list", obj({"items": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}})),
    ("three lucky numbers", obj({"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 100},
                                             "minItems": 3, "maxItems": 3}})),
    ("a book", obj({"title": S, "author": obj({"first": S, "last": S}),
                    "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a user with an optional nickname", obj({"name": S, "nickname": S}, required=["name"])),
    ("a date", obj({"date": {"type": "string", "format": "date"}})),
    ("an email contact", obj({"name": S, "email": {"type": "string", "format": "email", "maxLength": 40}})),
    ("a server address", obj({"ip": {"type": "string", "format": "ipv4"},
                              "port": {"type": "integer", "minimum": 1, "maximum": 65535}})),
    ("a product code", obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}})),
    ("a phone number", obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    ("an id", obj({"id": {"type": "string", "format": "uuid"}})),
    ("a value that is a whole number or text", obj({"value": {"anyOf": [{"type": "integer"}, S]}})),
    ("a shape", {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0,
                                                                          "maximum": 100}}),
                           obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0,
                                                                        "maximum": 100}})]}),
    ("a nullable middle name", obj({"first": S, "middle": {"anyOf": [S, {"type": "null"}]}, "last": S})),
    ("a team", obj({"team": S, "members": {"type": "array", "items": obj({"name": S, "role": {
        "enum": ["lead", "dev", "qa"]}}), "minItems": 1, "maxItems": 3}})),
    ("a point", obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                     "y": {"type": "number", "minimum": -10, "maximum": 10}})),
    ("a list of tags", {"type": "array", "items": {"enum": ["news", "sport", "tech", "art"]}, "minItems": 1,
                        "maxItems": 3}),
    ("a word", {"type": "string", "pattern": "^[a-z]{2,10}$"}),
    ("a count", {"type": "integer", "minimum": 0, "maximum": 1000}),
    ("a weather report", obj({"city": S, "forecast": {"type": "array", "items": obj({
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
        "high": {"type": "integer", "minimum": -30, "maximum": 50}}), "minItems": 2, "maxItems": 3}})),
    ("an order", obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                      "paid": {"type": "boolean"},
                      "lines": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[A-Z0-9]{4}$"},
                                                               "qty": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}}),
                                "minItems": 1, "maxItems": 2}})),
    ("a settings object", obj({"theme": {"enum": ["dark", "light"]}, "font_size": {"type": "integer",
                                                                                   "minimum": 8, "maximum": 32},
                               "beta": {"type": "boolean"}}, required=["theme"])),
    ("a price", obj({"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                     "currency": {"enum": ["EUR", "USD", "GBP"]}})),
    ("a recipe", obj({"name": S, "ingredients": {"type": "array", "items": S, "minItems": 2, "maxItems": 4},
                      "minutes": {"type": "integer", "minimum": 1, "maximum": 300}})),
    ("a nested config", obj({"db": obj({"host": S, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}),
                             "cache": obj({"enabled": {"type": "boolean"}, "ttl": {"type": "integer",
                                                                                  "minimum": 0, "maximum": 3600}})})),
    ("a matrix", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                             "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}),
    ("an event with a start time", obj({"event": S, "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})),
    ("a language", obj({"language": {"type": "string", "enum": ["English", "French", "German"]},
                        "speakers_millions": {"type": "number", "minimum": 0, "maximum": 2000}})),
]
