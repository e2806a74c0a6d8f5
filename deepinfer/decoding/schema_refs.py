"""``$ref`` resolution for the grammar's JSON schemas (:mod:`deepinfer.decoding.schema_rewrite`).

The grammar compilers follow only local JSON pointers (``#/...``) and read neither the keywords
beside a ``$ref`` nor ``$id`` / ``$anchor`` bases. :func:`resolve_refs` resolves each ``$ref``
with ``referencing`` under the schema's draft (``$schema``; 2020-12 when it names none): through
``$id`` bases, anchors, URNs and JSON pointers. A reference that does not lead back into itself
is replaced by its target (from 2019-09 on, keywords beside it stay, with ``allOf: [target]``;
before, they are ignored); a recursive one becomes a local pointer into a ``$defs`` section added
at the root (``#`` for the root itself). A reference that cannot be resolved (a remote document)
stays as written. ``$defs`` / ``definitions`` sections, ``$id``, ``$anchor`` and ``$schema`` are
left out of the result: every reference into them is resolved.

:class:`Provenance` keeps, through the resolution and the rewrites after it, where each keyword of
a node stands in the schema as written, and which of them the grammar ends up enforcing."""
from __future__ import annotations

from typing import Any

DRAFT_URIS = {3: "http://json-schema.org/draft-03/schema#", 4: "http://json-schema.org/draft-04/schema#",
              6: "http://json-schema.org/draft-06/schema#", 7: "http://json-schema.org/draft-07/schema#",
              2019: "https://json-schema.org/draft/2019-09/schema",
              2020: "https://json-schema.org/draft/2020-12/schema"}
"""Each draft, by the number the rewrite compares, and its metaschema URI."""
SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
             "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
"""Keywords holding subschemas in some draft: one, a map of them, a list of them."""
INLINED_NODES = 20_000
"""Schema nodes the inlined result may hold; past it every resolved reference becomes a local pointer."""
NOWHERE = object()
"""What :func:`pointed` answers for a pointer that leads nowhere."""
_LEFT_OUT = ("$defs", "definitions", "$id", "$anchor", "$schema")


class _TooLarge(Exception):
    pass


def draft_of(document: Any) -> int:
    """The draft ``document`` is read under (a key of :data:`DRAFT_URIS`), as its validation reads it."""
    import jsonschema

    cls = jsonschema.Draft202012Validator
    if isinstance(document, dict):
        cls = jsonschema.validators.validator_for(document, default=cls)
    return next(number for number, uri in DRAFT_URIS.items() if uri == cls.META_SCHEMA["$schema"])


def resolve_refs(document: Any, draft: int) -> tuple[Any, Provenance]:
    """``document`` with its references resolved (see the module docstring), and where its nodes
    stand in ``document`` (those reached through subschema keywords), each non-pointer reference
    it resolved recorded as ``"$ref at #/path"``."""
    if not isinstance(document, dict):
        return document, Provenance()
    resolution = _Resolution(document, draft)
    while True:
        known = set(resolution.recursive)
        try:
            resolved = resolution.run()
        except _TooLarge:
            resolution.inline = False
            continue
        if resolution.recursive == known:
            return resolved, resolution.provenance


class _Resolution:
    def __init__(self, document: dict, draft: int):
        from referencing import Registry
        from referencing.jsonschema import specification_with

        self.spec = specification_with(DRAFT_URIS[draft])
        root = self.spec.create_resource(document)
        self.resolver = Registry().with_resource(root.id() or "", root).crawl().resolver(root.id() or "")
        self.document, self.draft = document, draft
        self.paths: dict[int, tuple] = {}
        _record_paths(document, (), self.paths)
        self.recursive: set[int] = set()
        self.inline = True

    def run(self) -> Any:
        self.provenance = Provenance()
        self.pointers: dict[int, str] = {}
        self.defs: dict[str, Any] = {}
        self.budget = INLINED_NODES
        root = self.node(self.document, self.resolver, (), (id(self.document),), entered=True)
        if self.defs and isinstance(root, dict):
            root["$defs"] = self.defs
        return root

    def node(self, node: Any, resolver, path: tuple | None, stack: tuple, entered: bool = False) -> Any:
        if not isinstance(node, dict):
            return node
        if not entered:
            resolver = resolver.in_subresource(self.spec.create_resource(node))
        ref = node.get("$ref")
        target = self.target(ref, resolver, stack) if isinstance(ref, str) else None
        if target is None:
            return self.children(node, resolver, path, stack)
        siblings = {k: v for k, v in node.items() if k != "$ref" and k not in _LEFT_OUT}
        out = target
        if self.draft > 7 and siblings:
            out = self.children(siblings, resolver, path, stack)
            out["allOf"] = [*out.get("allOf", []), target]
        if path is not None and not (ref == "#" or ref.startswith("#/")) and isinstance(out, dict):
            self.provenance.record(out, f"$ref at {pointer((*path, '$ref'))}")
        return out

    def target(self, ref: str, resolver, stack: tuple) -> Any:
        from referencing.exceptions import Unresolvable

        try:
            found = resolver.lookup(ref)
        except Unresolvable:
            return None
        contents, key = found.contents, id(found.contents)
        if not isinstance(contents, (dict, bool)):
            return None
        if key in stack:
            self.recursive.add(key)
        if key in self.recursive or not self.inline:
            return {"$ref": self.pointer_to(key, found, stack)}
        return self.node(contents, found.resolver, self.paths.get(key), (*stack, key), entered=True)

    def pointer_to(self, key: int, found, stack: tuple) -> str:
        if found.contents is self.document:
            return "#"
        if key not in self.pointers:
            name = f"ref{len(self.pointers)}"
            self.pointers[key] = f"#/$defs/{name}"
            self.defs[name] = self.node(found.contents, found.resolver, self.paths.get(key), (*stack, key),
                                        entered=True)
        return self.pointers[key]

    def children(self, node: dict, resolver, path: tuple | None, stack: tuple) -> dict:
        self.budget -= 1
        if self.budget < 0 and self.inline:
            raise _TooLarge
        at = (lambda *keys: (*path, *keys)) if path is not None else (lambda *keys: None)
        out = {}
        for key, value in node.items():
            if key in _LEFT_OUT or (key == "id" and self.draft <= 4 and isinstance(value, str)):
                continue
            if key in SUBSCHEMA and isinstance(value, (dict, bool)):
                value = self.node(value, resolver, at(key), stack)
            elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
                value = {name: self.node(child, resolver, at(key, name), stack) for name, child in value.items()}
            elif key in SUBSCHEMA_LISTS and isinstance(value, list):
                value = [self.node(child, resolver, at(key, index), stack) for index, child in enumerate(value)]
            out[key] = value
        if path is not None:
            self.provenance.place(out, path)
        return out


class Provenance:
    """Where each keyword of a resolved (then rewritten) schema's nodes stands in the schema as
    written, and the ``"keyword at #/path"`` entries turned into equivalents the grammar enforces,
    each with the node that enforces it (an entry counts once the grammar enforces that node,
    :meth:`enforced`)."""

    def __init__(self):
        self.anywhere: set[str] = set()
        self._where: dict[int, tuple[dict, dict[str, tuple]]] = {}
        self._claims: dict[int, tuple[dict, set[str]]] = {}

    def place(self, node: dict, path: tuple) -> None:
        """Record ``node`` as a copy of the node at ``path``."""
        self._where[id(node)] = (node, {k: (*path, k) for k in node})

    def record(self, node: dict, entry: str) -> None:
        """Record ``entry`` as enforced where ``node`` stands."""
        self._claims_of(node).add(entry)

    def derive(self, new: dict, *parts: Any) -> dict:
        """Record ``new`` as standing for ``parts``: each keyword where the first part holding it
        stands, and the parts' entries."""
        where: dict[str, tuple] = {}
        for part in parts:
            for key, path in self._paths(part).items():
                where.setdefault(key, path)
        self._where[id(new)] = (new, {k: p for k, p in where.items() if k in new})
        claimed = set().union(*(self._claims[id(p)][1] for p in parts if self._held(self._claims, p)))
        if claimed:
            self._claims_of(new).update(claimed)
        return new

    def rename(self, node: dict, old: str, new: str) -> None:
        """Record ``node``'s keyword ``new`` as standing where its keyword ``old`` stands."""
        paths = self._paths(node)
        if old in paths:
            paths[new] = paths[old]

    def claim(self, node: dict, *keys: str, anywhere: bool = False) -> None:
        """Record ``node``'s ``keys`` as enforced (``anywhere``: wherever ``node`` stands)."""
        paths = self._paths(node)
        entries = {f"{paths[k][-1]} at {pointer(paths[k])}" for k in keys if k in paths}
        (self.anywhere if anywhere else self._claims_of(node)).update(entries)

    def enforced(self, root: Any) -> set[str]:
        """The recorded entries of the nodes of ``root`` the grammar enforces: reached from the root
        through properties, items and ``anyOf`` / ``oneOf`` branches, and local ``$ref`` pointers;
        not beside (nor in) an ``allOf`` or beside a ``$ref``, ``anyOf`` or ``oneOf``."""
        found, stack, seen = set(self.anywhere), [root], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            found |= self._claims[id(node)][1] if self._held(self._claims, node) else set()
            if isinstance(node.get("$ref"), str):
                stack.append(pointed(root, node["$ref"]))
            elif any(isinstance(node.get(k), list) for k in ("anyOf", "oneOf")):
                stack += [*(node.get("anyOf") or []), *(node.get("oneOf") or [])]
            elif "allOf" not in node:
                stack += [node.get("additionalProperties"), node.get("items"), *(node.get("prefixItems") or []),
                          *(node.get("properties") or {}).values()]
        return found

    def _claims_of(self, node: dict) -> set[str]:
        if not self._held(self._claims, node):
            self._claims[id(node)] = (node, set())
        return self._claims[id(node)][1]

    def _paths(self, node: Any) -> dict[str, tuple]:
        return self._where[id(node)][1] if self._held(self._where, node) else {}

    @staticmethod
    def _held(table: dict, node: Any) -> bool:
        return id(node) in table and table[id(node)][0] is node


def local_refs(node: Any):
    """The local JSON-pointer references (``#/...``) anywhere in ``node``."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            yield ref
        for value in node.values():
            yield from local_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from local_refs(value)


def pointed(document: Any, ref: str) -> Any:
    """The node the local ``ref`` (``#`` or ``#/...``) points to in ``document``, or :data:`NOWHERE`."""
    if ref == "#":
        return document
    if not ref.startswith("#/"):
        return NOWHERE
    node = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return NOWHERE
    return node


def _record_paths(node: Any, path: tuple, paths: dict[int, tuple]) -> None:
    if not isinstance(node, dict):
        return
    paths.setdefault(id(node), path)
    for key, value in node.items():
        if key in SUBSCHEMA and isinstance(value, dict):
            _record_paths(value, (*path, key), paths)
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, child in value.items():
                _record_paths(child, (*path, key, name), paths)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for index, child in enumerate(value):
                _record_paths(child, (*path, key, index), paths)


def pointer(parts: tuple) -> str:
    """``parts`` written as :mod:`deepinfer.decoding.schema_check` names schema locations."""
    return "#/" + "/".join(str(p) for p in parts)
