"""What the JSON grammar cannot enforce, and the full check of a finished JSON output.

llguidance compiles a large part of JSON Schema into a grammar, but refuses some keywords (``not``,
``if``/``then``/``else``, ``contains``, ``uniqueItems``, ``propertyNames``, ``dependentRequired``,
``dependentSchemas``, ``unevaluated*``, ``$dynamicRef``, ...), ``oneOf`` (exclusivity), formats it does not know,
overlapping ``patternProperties`` and some ``multipleOf`` values; and its objects may repeat a key that no
``properties`` entry declares, so ``{"b":1,"b":2}`` passes ``minProperties: 2``.

The compile side (stdlib only: the grammar worker process imports this file on its own, without the package) in
two steps, then the serving side:

* :func:`close_objects` gives each object schema that declares its keys and says nothing of others
  ``additionalProperties: false`` where that is sound, so the grammar generates only declared keys (as xgrammar's
  strict mode and OpenAI's function calling do): the one change that narrows what the grammar accepts, always to
  outputs valid under the schema as written.
* :func:`relax_schema` turns a schema into the closest one the grammar library compiles: it removes or weakens
  only what cannot be enforced (every removal makes the set of accepted documents larger, never smaller) and
  says what it changed, one note per keyword and place (``not at #/properties/a``). A schema that needed no note
  is enforced exactly by its grammar, apart from repeated undeclared keys.
* :class:`OutputValidator` (the serving side, ``jsonschema``) checks a finished output against the original
  schema: strict JSON (a repeated key in any object, ``NaN`` and ``Infinity`` are invalid), then every keyword,
  formats included. The model replica regenerates an output that fails (``deployments/replica/model_replica.py``).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable

__all__ = [
    "OutputValidator",
    "RELAX_ROUNDS",
    "admits_repeated_keys",
    "UNENFORCEABLE_KEYWORDS",
    "close_objects",
    "compile_relaxed",
    "grammar_schema",
    "parse_json_strict",
    "relax_schema",
    "validator_for_schema",
]

#: keywords llguidance refuses; the grammar is built without them and the validator checks them
UNENFORCEABLE_KEYWORDS = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "uniqueItems", "propertyNames",
    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
)
#: counts llguidance wants as integers (JSON Schema allows 2.0 for 2): rewritten exactly, no note
_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
#: keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
#: how many compile-and-relax rounds :func:`compile_relaxed` tries before giving up
RELAX_ROUNDS = 16


# ------------------------------------------------------------------------------------------------ compile side


def _subschemas(node: dict, path: str):
    """The (subschema, path) pairs directly under a schema object (never values such as ``const`` or ``enum``)."""
    for key in _ONE:
        if key in node and isinstance(node[key], (dict, bool)):
            yield node[key], f"{path}/{key}"
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, f"{path}/{key}/{i}"
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, f"{path}/{key}/{_escape(name)}"
    items = node.get("items")
    if isinstance(items, (dict, bool)):
        yield items, f"{path}/items"
    elif isinstance(items, list):  # draft 7 tuple form
        for i, sub in enumerate(items):
            yield sub, f"{path}/items/{i}"
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                yield sub, f"{path}/dependencies/{_escape(name)}"


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _walk(schema: Any, visit: Callable[[dict, str], None], path: str = "#") -> None:
    """Call ``visit(node, path)`` on every schema object, parents before children (``visit`` may change the
    node; the walk then follows the changed node)."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        visit(node, where)
        stack.extend(reversed(list(_subschemas(node, where))))


def _admits_undeclared_keys(node: dict) -> bool:
    """Whether the grammar may give this object a key that no ``properties`` entry declares (such keys may
    repeat)."""
    return node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))


def admits_repeated_keys(schema: Any) -> bool:
    """Whether the grammar of ``schema`` may write an object with a repeated key: somewhere an object may have
    keys no ``properties`` entry declares. Conservative: a schema object that names no type and combines no
    other schemas (``anyOf``, ``allOf``, ``oneOf``, ``$ref``) and lists no values (``enum``, ``const``) counts, as
    does any JSON value (``None``, ``{}``, a subschema ``true``)."""
    if not isinstance(schema, dict) or not schema:
        return schema is not False
    # (subschema, path, whether an enclosing schema already rules objects out: its type, seen through combinators)
    stack: list[tuple[Any, str, bool]] = [(schema, "#", False)]
    while stack:
        node, path, no_objects = stack.pop()
        if node is True and not no_objects:
            return True
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind is not None and "object" not in (kind if isinstance(kind, list) else [kind]):
            no_objects = True
        if kind is None:
            opens = not any(k in node for k in ("anyOf", "allOf", "oneOf", "$ref", "enum", "const"))
        else:
            opens = not no_objects
        if opens and not no_objects and _admits_undeclared_keys(node):
            return True
        for sub, where in _subschemas(node, path):
            combined = re.search(r"/(allOf|anyOf|oneOf)/\d+$|/(if|then|else|not)$", where[len(path):]) is not None
            stack.append((sub, where, no_objects and combined))
    return False


_APPLICATORS = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
                "dependentSchemas", "dependencies", "contains")


def _exact_rewrites(node: dict) -> None:
    """Rewrite keywords llguidance refuses into ones it enforces, where the two mean the same here (no note)."""
    plain = not any(k in node for k in _APPLICATORS)
    # without applicators nothing else evaluates properties/items: unevaluated* is additional*/items
    if plain and "unevaluatedProperties" in node and "additionalProperties" not in node:
        node["additionalProperties"] = node.pop("unevaluatedProperties")
    if plain and "unevaluatedItems" in node and "items" not in node and not isinstance(node.get("items"), list):
        node["items"] = node.pop("unevaluatedItems")
    # propertyNames {pattern | enum | const}: the undeclared keys become patternProperties matching it
    names = node.get("propertyNames")
    if isinstance(names, dict) and not node.get("patternProperties"):
        pattern = _names_pattern(names)
        properties = node.get("properties")
        declared: dict = properties if isinstance(properties, dict) else {}
        if pattern is not None and all(_search(pattern, name) for name in declared):
            rest = node.get("additionalProperties", True)
            del node["propertyNames"]
            if rest is not False:
                node["patternProperties"] = {pattern: rest}
            node["additionalProperties"] = False


def _names_pattern(names: dict) -> str | None:
    """A regex (search semantics) for the key names a ``propertyNames`` schema allows, when it is that simple."""
    keys = set(names) - {"type"}
    if names.get("type", "string") != "string":
        return None
    if keys == {"pattern"} and isinstance(names["pattern"], str):
        return names["pattern"]
    values = [names["const"]] if keys == {"const"} else names.get("enum") if keys == {"enum"} else None
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return "^(?:" + "|".join(re.escape(v) for v in values) + ")$"
    return None


def _search(pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def _static_pass(node: dict, path: str, notes: list[str]) -> None:
    _exact_rewrites(node)
    if "then" in node and "else" in node and "if" in node:
        # whichever way the condition goes, the instance satisfies one of the branches
        node.setdefault("allOf", []).append({"anyOf": [node["then"], node["else"]]})
    for key in UNENFORCEABLE_KEYWORDS:
        if key in node:
            del node[key]
            notes.append(f"{key} at {path}")
    one_of = node.get("oneOf")
    if isinstance(one_of, list):
        del node["oneOf"]
        if len(one_of) == 1:  # exactly one of one subschema: that subschema
            node.setdefault("allOf", []).append(one_of[0])
        else:  # at least one of them: the grammar cannot require that the others fail
            notes.append(f"oneOf (exclusivity) at {path}")
            if "anyOf" in node:
                node.setdefault("allOf", []).append({"anyOf": one_of})
            else:
                node["anyOf"] = one_of
    for key in _COUNT_KEYWORDS:
        value = node.get(key)
        if isinstance(value, float) and value.is_integer():
            node[key] = int(value)
    if "minProperties" in node and node.get("minProperties", 0) > 0 and _admits_undeclared_keys(node):
        notes.append(f"minProperties (a repeated undeclared key counts twice in the grammar) at {path}")


def relax_schema(schema: Any) -> tuple[Any, list[str]]:
    """The schema without the keywords the grammar library refuses, and one note per change.

    Removed: :data:`UNENFORCEABLE_KEYWORDS`; ``oneOf`` becomes ``anyOf`` (at least one instead of exactly one);
    a count written as ``2.0`` becomes ``2`` (no note: the same schema). Noted but kept: ``minProperties`` on an
    object that admits undeclared keys. The input is not changed. What only a compile attempt reveals (unknown
    formats, overlapping ``patternProperties``, ``multipleOf`` values it cannot represent) is
    :func:`relax_for_error`'s job.
    """
    relaxed = copy.deepcopy(schema)
    notes: list[str] = []
    _walk(relaxed, lambda node, path: _static_pass(node, path, notes))
    return relaxed, notes


_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_NOT_DISJOINT = re.compile(r"patternProperty regexes /(.*)/ and /(.*)/ are not disjoint")


def relax_for_error(schema: Any, message: str) -> list[str]:
    """Change ``schema`` in place so that the compile error ``message`` goes away by relaxing it; the notes
    (empty: the error is not one a relaxation fixes, such as a remote ``$ref`` or an unsatisfiable schema)."""
    notes: list[str] = []
    if m := _UNIMPLEMENTED.search(message):
        keys = set(re.findall(r'"([^"]+)"', m.group(1)))

        def drop(node: dict, path: str) -> None:
            for key in sorted(keys & node.keys()):
                del node[key]
                notes.append(f"{key} at {path}")
        _walk(schema, drop)
    elif m := _UNKNOWN_FORMAT.search(message):
        name = m.group(1).strip("'\"`")

        def drop_format(node: dict, path: str) -> None:
            if node.get("format") == name:
                del node["format"]
                notes.append(f"format {name!r} at {path}")
        _walk(schema, drop_format)
    elif "multipleOf" in message:

        def drop_multiple(node: dict, path: str) -> None:
            value = node.get("multipleOf")
            if isinstance(value, float) and not value.is_integer():
                del node["multipleOf"]
                notes.append(f"multipleOf {value!r} at {path}")
        _walk(schema, drop_multiple)
    elif m := _NOT_DISJOINT.search(message):
        pair = {m.group(1), m.group(2)}

        def merge(node: dict, path: str) -> None:
            patterns = node.get("patternProperties")
            if isinstance(patterns, dict) and pair <= patterns.keys():
                # a key matching several patterns must satisfy each of their schemas; here it satisfies one
                node["patternProperties"] = {"|".join(f"(?:{p})" for p in patterns): {"anyOf": list(patterns.values())}}
                notes.append(f"patternProperties (overlapping patterns merged) at {path}")
        _walk(schema, merge)
    return notes


def compile_relaxed(schema: Any, build: Callable[[str], str]) -> tuple[str, list[str]]:
    """Build a grammar for ``schema`` with ``build`` (schema JSON text -> grammar, ``ValueError`` on failure),
    closing its objects and relaxing it first (:func:`grammar_schema`) and then once per compile error a
    relaxation can fix. Returns the
    grammar and the notes (what it does not enforce). Raises the first error no relaxation fixes."""
    relaxed, notes = grammar_schema(schema)
    for _ in range(RELAX_ROUNDS):
        try:
            return build(json.dumps(relaxed)), notes
        except ValueError as exc:
            more = relax_for_error(relaxed, str(exc))
            if not more:
                raise
            notes.extend(more)
    return build(json.dumps(relaxed)), notes


# ------------------------------------------------------------------------------------------------ closed objects

#: where a subschema applies to a value inside the instance (a property's, an item's): evaluated there alone when its
#: parent is evaluated alone
_INSIDE_ONE = ("additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "contains",
               "propertyNames", "contentSchema")
_INSIDE_MAP = ("properties", "patternProperties")
#: keywords that evaluate the instance itself with other schemas (in place)
_IN_PLACE = ("allOf", "anyOf", "oneOf", "$ref", "not", "if", "then", "else", "dependentSchemas", "dependencies")
#: keywords by which a schema object says which keys its object has: where they sit beside an in-place applicator,
#: closing the applicator's subschemas could contradict them
_ABOUT_KEYS = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required",
               "minProperties", "dependentRequired", "propertyNames", "const", "enum")
#: keywords that leave an object open to keys its ``properties`` do not name (or name keys it needs beyond them)
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames",
            "dependentRequired")


class _Unresolved(Exception):
    """A reference :func:`close_objects` cannot follow (not a local JSON pointer, or a base URI that moves)."""


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local reference (``#`` or ``#/a/b``, ``~0``/``~1`` and percent escapes) names."""
    from urllib.parse import unquote

    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise _Unresolved(ref)
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _Unresolved(ref)
    return node


def _placed(node: dict, root: Any, alone: bool):
    """The (subschema, evaluated alone) pairs of a schema object evaluated alone (``alone``) or not: a value inside
    the instance inherits ``alone``; an in-place subschema is alone only as the single ``anyOf``/``oneOf`` branch
    taken, the one schema of an ``allOf`` or the target of a ``$ref``, and only when its parent says nothing of
    its object's keys (:data:`_ABOUT_KEYS`) and applies nothing else in place."""
    for key in _INSIDE_ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key], alone
    for key in ("items", "prefixItems"):
        value = node.get(key)
        for sub in value if isinstance(value, list) else [value]:
            yield sub, alone
    for key in _INSIDE_MAP:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                yield sub, alone
    only = alone and sum(key in node for key in _IN_PLACE) == 1 and not any(key in node for key in _ABOUT_KEYS)
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            for sub in node[key]:
                yield sub, only and (key != "allOf" or len(node[key]) == 1)
    if isinstance(node.get("$ref"), str):
        yield _pointer(root, node["$ref"]), only
    for key in ("not", "if", "then", "else"):
        if key in node:
            yield node[key], False
    for key in ("dependentSchemas", "dependencies"):
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                yield sub, False


def _closable(node: dict) -> bool:
    """Whether a schema object evaluated alone is an object schema that declares its keys and can be closed without
    refusing every object it accepted: it has ``properties``, no keyword that allows (or requires) other keys
    (:data:`_OPENERS`), no in-place applicator, its ``type`` allows an object, its ``required`` names are declared
    and its ``minProperties`` can be met by declared keys."""
    properties = node.get("properties")
    if not isinstance(properties, dict) or any(key in node for key in _OPENERS + _IN_PLACE):
        return False
    kind = node.get("type", "object")
    if "object" not in (kind if isinstance(kind, list) else [kind]):
        return False
    required = node.get("required", [])
    if not isinstance(required, list) or not set(required) <= properties.keys():
        return False
    least = node.get("minProperties", 0)
    return not isinstance(least, (int, float)) or least <= sum(sub is not False for sub in properties.values())


def close_objects(schema: Any) -> Any:
    """The schema its grammar generates: each object schema that declares its keys (``properties``, even empty)
    and says nothing of others gets ``additionalProperties: false``, as xgrammar's strict mode and OpenAI's
    function calling generate only the declared keys.

    Left open: an object with ``additionalProperties`` (``true`` or a schema), ``patternProperties``,
    ``unevaluatedProperties``, ``propertyNames`` or ``dependentRequired``; one without ``properties`` (``{"type":
    "object"}`` asks for any object); and, where closing could contradict another schema evaluated on the same
    object, one that applies others in place (``allOf``, ``anyOf``, ``oneOf``, ``$ref``, ``not``,
    ``if``/``then``/``else``, ``dependentSchemas``), one that is a branch of an ``allOf`` of several schemas, or
    of a combinator whose schema object also has keywords about keys (``required``, ``properties``, ...), with all
    below them; one whose ``required`` names an undeclared key or whose ``minProperties`` the declared keys cannot
    meet. A ``$ref`` target is closed when every reference to it is evaluated alone. A schema whose references
    are not all local JSON pointers, or with an ``$id`` or anchor below its root, is generated as written. Every
    output of the closed schema is valid under the schema as written: outputs are still validated against that
    one. The input is not changed.
    """
    closed = copy.deepcopy(schema)
    if not isinstance(closed, dict):
        return closed
    alone: dict[int, bool] = {}
    nodes: dict[int, dict] = {}
    seen: set[tuple[int, bool]] = set()
    stack: list[tuple[Any, bool]] = [(closed, True)]
    try:
        while stack:
            node, whole = stack.pop()
            if not isinstance(node, dict) or (id(node), whole) in seen:
                continue
            seen.add((id(node), whole))
            if node is not closed and any(key in node for key in ("$id", "$anchor", "$dynamicAnchor")) \
                    or any(key in node for key in ("$dynamicRef", "$recursiveRef")):
                return copy.deepcopy(schema)
            alone[id(node)] = alone.get(id(node), True) and whole
            nodes[id(node)] = node
            stack.extend(_placed(node, closed, whole))
    except _Unresolved:
        return copy.deepcopy(schema)
    for key, node in nodes.items():
        if alone[key] and _closable(node):
            node["additionalProperties"] = False
    return closed


def grammar_schema(schema: Any) -> tuple[Any, list[str]]:
    """The schema a grammar is built from and its notes: :func:`close_objects`, then :func:`relax_schema`."""
    return relax_schema(close_objects(schema))


# ------------------------------------------------------------------------------------------------ serving side


class DuplicateKey(ValueError):
    """A JSON object with the same key twice."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json_strict(text: str) -> Any:
    """``json.loads`` that refuses a repeated key in any object (:class:`DuplicateKey`), ``NaN``,
    ``Infinity`` and trailing text (``ValueError``)."""
    return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant)


class OutputValidator:
    """Checks finished outputs against one schema (``None``: any JSON value), formats included.

    Args:
        schema: the original (not relaxed) schema.
    """

    def __init__(self, schema: Any = None):
        self.schema = schema
        self._validator = None
        if schema not in (None, {}, True):
            from jsonschema.validators import validator_for

            cls = validator_for(schema)
            self._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)

    def error(self, text: str) -> str | None:
        """Why ``text`` is not a valid output (``None``: it is)."""
        try:
            value = parse_json_strict(text)
        except DuplicateKey as exc:
            return f"not valid JSON for the schema: {exc}"
        except ValueError as exc:
            return f"not valid JSON: {str(exc).splitlines()[0][:200]}"
        if self._validator is None:
            return None
        from jsonschema.exceptions import best_match

        try:
            found = best_match(self._validator.iter_errors(value))
        except Exception as exc:  # e.g. a $ref the validator cannot resolve: nothing unchecked is passed
            return f"could not be validated against the schema ({type(exc).__name__}: {str(exc)[:200]})"
        if found is None:
            return None
        where = "/".join(_escape(p) for p in found.absolute_path)
        return f"fails the schema at #/{where} ({'/'.join(map(str, found.absolute_schema_path))}): " \
               f"{found.message[:300]}"


_VALIDATORS: OrderedDict[str, OutputValidator] = OrderedDict()
_VALIDATORS_SIZE = 256
_VALIDATORS_LOCK = threading.Lock()


def validator_for_schema(schema_json: str | None) -> OutputValidator:
    """The :class:`OutputValidator` of a schema given as JSON text (``None``: any JSON value), kept for the
    last :data:`_VALIDATORS_SIZE` schemas."""
    key = schema_json or ""
    with _VALIDATORS_LOCK:
        found = _VALIDATORS.get(key)
        if found is not None:
            _VALIDATORS.move_to_end(key)
            return found
    found = OutputValidator(json.loads(schema_json) if schema_json else None)
    with _VALIDATORS_LOCK:
        _VALIDATORS[key] = found
        while len(_VALIDATORS) > _VALIDATORS_SIZE:
            _VALIDATORS.popitem(last=False)
    return found
