"""Grammars for the structured-output tests, each with an independent validity check.

JSON schemas are checked by ``jsonschema``; regexes by Python's ``re.fullmatch``; each EBNF
grammar by Python's own parsers (``ast``, ``json``, ``int``) or an equivalent Python regex."""
import ast
import json
import re

import jsonschema

INT = {"type": "integer", "minimum": -50, "maximum": 50}
SHORT = {"type": "string", "maxLength": 6}

JSON_SCHEMAS = [
    {"type": "object", "properties": {"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["id", "tags"]}},
     "required": ["user"]},
    {"type": "number", "minimum": -10, "maximum": 10},
    {"const": "fixed"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "array", "items": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]},
     "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": INT, "b": SHORT}},
    {"type": "null"},
    {"type": "boolean"},
    {"type": "integer", "minimum": 100, "maximum": 105},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                                "maxItems": 2}, "maxItems": 2},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}, "p": {"type": "number", "minimum": 0,
                                                                                   "maximum": 1},
                                      "b": {"type": "boolean"}}, "required": ["s", "p", "b"]},
    {"enum": [1, "two", None, True]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"$defs": {"pt": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 3},
                                      "child": {"type": "object", "properties": {"leaf": {"type": "boolean"}},
                                                "required": ["leaf"]}}, "required": ["level", "child"]},
]

REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"[A-Za-z_][A-Za-z0-9_]{0,11}",
    r"([01]\d|2[0-3]):[0-5]\d",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"#[0-9a-f]{6}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\d{1,2}\.\d{1,2}\.\d{1,2}",
    r"[0-9a-f]{8}-[0-9a-f]{4}",
    r"(yes|no)",
    r"-?[1-9]\d{0,5}",
    r"-?\d{1,3}\.\d{1,3}",
    r"\d{5}(-\d{4})?",
    r"[a-z]{1,5}( [a-z]{1,5}){0,3}",
    r"def [a-z_]{1,8}\(\):",
    r"https://[a-z]{1,10}\.(com|io)/[a-z]{0,6}",
    r"[01]{4,8}",
    r"\$\d{1,4}\.\d{2}",
    r"[a-z]{1,6}=[0-9]{1,3}(;[a-z]{1,6}=[0-9]{1,3}){0,2}",
    r"([0-9A-F]{2}:){2}[0-9A-F]{2}",
    r"(Mon|Tue|Wed|Thu|Fri), \d{1,2} (Jan|Feb|Mar) \d{4}",
    r"[A-Z]{2,3}-\d{2,4}",
]


def _python(text: str, mode: str, *nodes) -> bool:
    try:
        tree = ast.parse(text, mode=mode)
    except SyntaxError:
        return False
    return all(isinstance(n, nodes) for n in ast.walk(tree))


def _literal(text: str, kind) -> bool:
    try:
        return isinstance(ast.literal_eval(text), kind)
    except (ValueError, SyntaxError):
        return False


def _balanced(text: str, allowed: str) -> bool:
    depth = 0
    for ch in text:
        if ch not in allowed:
            return False
        depth += 1 if ch == "(" else -1 if ch == ")" else 0
        if depth < 0:
            return False
    return depth == 0


def _json(text: str, kind) -> bool:
    try:
        return isinstance(json.loads(text), kind)
    except ValueError:
        return False


def _int(text: str, base: int) -> bool:
    try:
        int(text, base)
        return True
    except ValueError:
        return False


ARITH_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)
EBNF = [
    ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
     'factor ::= num | "(" expr ")"\nnum ::= "0" | [1-9] [0-9]*', lambda t: _python(t, "eval", *ARITH_NODES)),
    ('root ::= expr\nexpr ::= term ((" + " | " - ") term)*\nterm ::= "-"? ([0-9] | "(" expr ")")',
     lambda t: _python(t, "eval", *ARITH_NODES)),
    ('root ::= bexpr\nbexpr ::= bterm (" or " bterm)*\nbterm ::= bfactor (" and " bfactor)*\n'
     'bfactor ::= "not "? ("True" | "False" | "(" [a-z] " or " [a-z] ")")',
     lambda t: _python(t, "eval", ast.Expression, ast.BoolOp, ast.UnaryOp, ast.Constant, ast.And, ast.Or, ast.Not,
                       ast.Name, ast.Load)),
    ('root ::= "[" (int (", " int)*)? "]"\nint ::= "-"? [1-9] [0-9]*',
     lambda t: _literal(t, list) and all(isinstance(x, int) for x in ast.literal_eval(t))),
    ("root ::= \"(\" str \", \" str (\", \" str)* \")\"\nstr ::= \"'\" [a-z]? [a-z]? [a-z]? \"'\"",
     lambda t: _literal(t, tuple) and all(isinstance(x, str) for x in ast.literal_eval(t))),
    ('root ::= list\nlist ::= "[" (item (", " item)*)? "]"\nitem ::= [0-9] | list', lambda t: _literal(t, list)),
    ('root ::= pair*\npair ::= "(" pair* ")"', lambda t: _balanced(t, "()")),
    ('root ::= sexp\nsexp ::= atom | "(" sexp (" " sexp)* ")"\natom ::= [a-z]+',
     lambda t: _balanced(t, "() abcdefghijklmnopqrstuvwxyz") and "()" not in t and "  " not in t),
    ('root ::= line ("\\n" line)*\nline ::= [a-z]+ "=" [0-9]+',
     lambda t: re.fullmatch(r"[a-z]+=[0-9]+(\n[a-z]+=[0-9]+)*", t) is not None),
    ('root ::= ("hello" | "hi") " " name\nname ::= [A-Z] [a-z]*',
     lambda t: re.fullmatch(r"(hello|hi) [A-Z][a-z]*", t) is not None),
    ('root ::= field ("," field)+\nfield ::= [a-z0-9]+', lambda t: re.fullmatch(r"[a-z0-9]+(,[a-z0-9]+)+", t) is not None),
    ('root ::= name " = " num\nname ::= [a-z] [0-9_]*\nnum ::= [1-9] [0-9]*',
     lambda t: _python(t, "exec", ast.Module, ast.Assign, ast.Name, ast.Constant, ast.Store)),
    ('root ::= name "(" (arg (", " arg)*)? ")"\nname ::= [a-z] [0-9]*\narg ::= [0-9] | name',
     lambda t: _python(t, "eval", ast.Expression, ast.Call, ast.Name, ast.Constant, ast.Load)),
    ('root ::= num (" < " | " > " | " == ") num\nnum ::= [1-9] [0-9]*',
     lambda t: _python(t, "eval", ast.Expression, ast.Compare, ast.Constant, ast.Lt, ast.Gt, ast.Eq)),
    ('root ::= "[" (num (", " num)*)? "]"\nnum ::= "0" | [1-9] [0-9]*',
     lambda t: _json(t, list) and all(isinstance(x, int) for x in json.loads(t))),
    ('root ::= "{" pair (", " pair)* "}"\npair ::= "\\"" [a-z]+ "\\": " [0-9]', lambda t: _json(t, dict)),
    ('root ::= [0-9] [0-9] [0-9] [0-9] "-" ("0" [1-9] | "1" [0-2])',
     lambda t: re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])", t) is not None),
    ('root ::= "0b" [01]+', lambda t: _int(t, 0) and t.startswith("0b")),
    ('root ::= "0x" [0-9a-f]+', lambda t: _int(t, 0) and t.startswith("0x")),
    ('root ::= [0-9]+ "." [0-9]+', lambda t: _python(t, "eval", ast.Expression, ast.Constant)
     and isinstance(ast.literal_eval(t), float)),
    ('root ::= elem+\nelem ::= [A-Z] [a-z]? [2-9]?', lambda t: re.fullmatch(r"([A-Z][a-z]?[2-9]?)+", t) is not None),
    ('root ::= "if " cond ": " stmt\ncond ::= [a-z] (" < " | " > ") [0-9]\nstmt ::= "pass" | "return " [0-9]',
     lambda t: _python(t, "exec", ast.Module, ast.If, ast.Compare, ast.Name, ast.Constant, ast.Lt, ast.Gt, ast.Pass,
                       ast.Return, ast.Load)),
]


def valid_json(text: str, schema) -> bool:
    """``text`` parses as JSON and validates against ``schema`` (a dict or a JSON string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validate(value, json.loads(schema) if isinstance(schema, str) else schema)
    except jsonschema.ValidationError:
        return False
    return True
