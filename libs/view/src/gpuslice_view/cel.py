"""The subset of CEL that DRA device selectors use, evaluated against one device.

Why our own: ``why`` has to say *which clause* of a selector rules every device out and what
the devices have instead, which needs the expression's structure, not only a verdict; and the
Kubernetes extensions (``quantity()``, ``semver()``, ``compareTo``) are not in the Python CEL
libraries. Supported: literals (int, double, string, bool, null, lists), ``device.driver``,
``device.attributes[domain].name`` and ``device.capacity[domain].name`` (index or field form),
``! && || == != < <= > >= in``, ``? :``, ``has()``, ``size()``, ``quantity()``, ``semver()``,
and the methods ``compareTo isGreaterThan isLessThan startsWith endsWith contains matches
lowerAscii upperAscii``. Anything else raises ``Unsupported``: the caller then says it cannot
judge that selector, and the scheduler stays the judge. A runtime error (a missing attribute)
makes the device not match, as the scheduler treats it.

Selectors are written by tenants, and the API server takes some that a naive evaluator cannot
afford: 5,000 ``!`` in a row, or a regular expression that backtracks for hours in Python's
``re`` (the scheduler's RE2 never backtracks). So an expression nested deeper than
``MAX_NESTING`` levels is ``Unsupported`` (the parser and evaluator recurse once per level),
and so is ``matches()`` with a pattern that could backtrack without bound (a repeat inside a
repeat, an alternation inside a repeat, a back-reference, more than ``MAX_REPEATS`` repeats) or
on a string longer than ``MAX_MATCH_TEXT`` (a device attribute's limit): ``why`` then says it
cannot judge that selector instead of stalling the view.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpuslice_api.quantity import parse_quantity
from gpuslice_core.errors import InvalidArgumentError

MAX_NESTING = 50
"""Levels of nesting (parentheses, ``!``, ``&&`` chains, calls) an expression may have here."""
MAX_REPEATS = 2
"""Repeats (``*``, ``+``, ``{m,n}``) a ``matches()`` pattern may have here."""
MAX_MATCH_TEXT = 64
"""Characters of a string ``matches()`` is judged on here (a device attribute has at most 64)."""
# the stdlib's pattern parser (no stubs); sre_parse before 3.11 (kubectl gpuslice runs on 3.10)
_SRE: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")


class Unsupported(Exception):  # noqa: N818 - a verdict, not a failure of ours
    """The expression uses CEL this evaluator does not know."""


class EvalError(Exception):
    """The expression failed on this device (no such key, wrong types): no match."""


@dataclass(frozen=True)
class Semver:
    parts: tuple[int, int, int]


@dataclass(frozen=True)
class Quantity:
    value: Fraction


Node = tuple[Any, ...]
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<str>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*')"
    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>&&|\|\||==|!=|<=|>=|[!<>()\[\].,?:]))"
)
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'"}


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise Unsupported(f"cannot read {text[pos : pos + 20]!r}")
        kind = match.lastgroup or ""
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise Unsupported(f"the expression nests deeper than {MAX_NESTING} levels")

    def peek(self) -> str:
        return self.toks[self.i][1] if self.i < len(self.toks) else ""

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.toks):
            raise Unsupported("unexpected end of expression")
        tok = self.toks[self.i]
        if expected is not None and tok[1] != expected:
            raise Unsupported(f"expected {expected!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.ternary()
        if self.i != len(self.toks):
            raise Unsupported(f"unexpected {self.peek()!r}")
        return node

    def ternary(self) -> Node:
        self.deeper()
        cond = self.binary(0)
        if self.peek() == "?":
            self.take()
            yes = self.ternary()
            self.take(":")
            cond = ("?", cond, yes, self.ternary())
        self.depth -= 1
        return cond

    _LEVELS = (("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">=", "in"))

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        node = self.binary(level + 1)
        while self.peek() in self._LEVELS[level]:
            op = self.take()[1]
            node = (op, node, self.binary(level + 1))
        return node

    def unary(self) -> Node:
        if self.peek() == "!":
            self.take()
            self.deeper()
            node = ("!", self.unary())
            self.depth -= 1
            return node
        return self.postfix(self.primary())

    def postfix(self, node: Node) -> Node:
        while self.peek() in (".", "["):
            if self.take()[1] == ".":
                name = self.take()[1]
                if self.peek() == "(":
                    node = ("call", name, node, self.args())
                else:
                    node = ("get", node, ("lit", name))
            else:
                key = self.ternary()
                self.take("]")
                node = ("get", node, key)
        return node

    def args(self) -> list[Node]:
        self.take("(")
        args: list[Node] = []
        while self.peek() != ")":
            args.append(self.ternary())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return args

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "num":
            return ("lit", float(text) if "." in text else int(text))
        if kind == "str":
            return ("lit", re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[1]), text[1:-1]))
        if text == "(":
            node = self.ternary()
            self.take(")")
            return node
        if text == "[":
            items: list[Node] = []
            while self.peek() != "]":
                items.append(self.ternary())
                if self.peek() == ",":
                    self.take()
            self.take("]")
            return ("list", items)
        if kind == "id":
            if text in ("true", "false"):
                return ("lit", text == "true")
            if text == "null":
                return ("lit", None)
            if self.peek() == "(":
                return ("call", text, None, self.args())
            return ("var", text)
        raise Unsupported(f"unexpected {text!r}")


def parse(expression: str) -> Node:
    """The expression's syntax tree; ``Unsupported`` when it is not in our subset or nests
    deeper than ``MAX_NESTING`` (a chain of 1,000 ``&&`` parses flat but nests as deep)."""
    node = _Parser(expression).parse()
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise Unsupported(f"the expression nests deeper than {MAX_NESTING} levels")
        children = item[1:] if isinstance(item, tuple) else item
        for child in children:
            if isinstance(child, tuple | list):
                stack.append((child, depth + 1))
    return node


def _check_pattern(pattern: str, text: str) -> None:
    """``Unsupported`` unless ``re`` matches ``pattern`` on ``text`` in bounded time."""
    if len(text) > MAX_MATCH_TEXT:
        raise Unsupported(f"matches() on a string longer than {MAX_MATCH_TEXT} characters")
    try:
        tree = _SRE.parse(pattern)
    except re.error:
        return  # re.search raises it again: an evaluation error
    repeats = 0
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        items, repeated = stack.pop()
        for op, arg in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                if arg[1] > 1:
                    if repeated:
                        raise Unsupported(f"matches({pattern!r:.64}): a repeat inside a repeat")
                    repeats += 1
                stack.append((arg[2], repeated or arg[1] > 1))
            elif name == "BRANCH":
                if repeated:
                    raise Unsupported(f"matches({pattern!r:.64}): an alternation in a repeat")
                stack.extend((alternative, False) for alternative in arg[1])
            elif name == "SUBPATTERN":
                stack.append((arg[3], repeated))
            elif name in ("ASSERT", "ASSERT_NOT"):
                stack.append((arg[1], repeated))
            elif name == "ATOMIC_GROUP":
                stack.append((arg, repeated))
            elif name in ("GROUPREF", "GROUPREF_EXISTS"):
                raise Unsupported(f"matches({pattern!r:.64}): a back-reference")
    if repeats > MAX_REPEATS:
        raise Unsupported(f"matches({pattern!r:.64}): more than {MAX_REPEATS} repeats")


def _matches(text: Any, pattern: Any) -> bool:
    _check_pattern(str(pattern), str(text))
    return re.search(pattern, str(text)) is not None


def clauses(node: Node) -> list[Node]:
    """The top-level ``&&`` operands of an expression, in order."""
    if node[0] == "&&":
        return clauses(node[1]) + clauses(node[2])
    return [node]


def unparse(node: Node) -> str:
    """A readable form of a syntax tree (for messages)."""
    op = node[0]
    if op == "lit":
        return repr(node[1]) if isinstance(node[1], str) else str(node[1]).lower()
    if op == "var":
        return str(node[1])
    if op == "list":
        return "[" + ", ".join(unparse(n) for n in node[1]) + "]"
    if op == "get":
        key = node[2]
        if key[0] == "lit" and isinstance(key[1], str) and key[1].isidentifier():
            return f"{unparse(node[1])}.{key[1]}"
        return f"{unparse(node[1])}[{unparse(key)}]"
    if op == "call":
        target = f"{unparse(node[2])}." if node[2] is not None else ""
        return f"{target}{node[1]}({', '.join(unparse(a) for a in node[3])})"
    if op == "!":
        return f"!{unparse(node[1])}"
    if op == "?":
        return f"{unparse(node[1])} ? {unparse(node[2])} : {unparse(node[3])}"
    return f"{unparse(node[1])} {op} {unparse(node[2])}"


def attribute_refs(node: Node) -> list[tuple[str, str, str]]:
    """``(field, domain, name)`` of every ``device.attributes``/``device.capacity`` read."""
    found: list[tuple[str, str, str]] = []
    if node[0] == "get" and node[1][0] == "get" and node[2][0] == "lit":
        inner = node[1]
        if inner[1][0] == "get" and inner[1][1] == ("var", "device") and inner[2][0] == "lit":
            field = inner[1][2][1]
            if field in ("attributes", "capacity"):
                found.append((str(field), str(inner[2][1]), str(node[2][1])))
    for child in node[1:]:
        if isinstance(child, tuple) and child and isinstance(child[0], str):
            found += attribute_refs(child)
        elif isinstance(child, list):
            for item in child:
                found += attribute_refs(item)
    return list(dict.fromkeys(found))


def _compare(a: Any, b: Any) -> int:
    if isinstance(a, Semver) and isinstance(b, Semver):
        x, y = a.parts, b.parts
    elif isinstance(a, Quantity) and isinstance(b, Quantity):
        x, y = a.value, b.value  # type: ignore[assignment]
    elif isinstance(a, bool) or isinstance(b, bool):
        raise EvalError("booleans are not ordered")
    elif (isinstance(a, int | float) and isinstance(b, int | float)) or (
        isinstance(a, str) and isinstance(b, str)
    ):
        x, y = a, b  # type: ignore[assignment]
    else:
        raise EvalError(f"cannot compare {type(a).__name__} with {type(b).__name__}")
    return (x > y) - (x < y)


def _semver(text: Any) -> Semver:
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:[-+].*)?", str(text))
    if match is None:
        raise EvalError(f"{text!r} is not a semantic version")
    return Semver((int(match[1]), int(match[2]), int(match[3])))


def _quantity(text: Any) -> Quantity:
    try:
        return Quantity(parse_quantity(str(text)))
    except InvalidArgumentError as exc:
        raise EvalError(str(exc)) from exc


_METHODS: dict[str, Callable[..., Any]] = {
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: _compare(a, b) > 0,
    "isLessThan": lambda a, b: _compare(a, b) < 0,
    "startsWith": lambda a, b: str(a).startswith(b),
    "endsWith": lambda a, b: str(a).endswith(b),
    "contains": lambda a, b: b in str(a),
    "matches": _matches,
    "lowerAscii": lambda a: str(a).lower(),
    "upperAscii": lambda a: str(a).upper(),
    "size": len,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "semver": _semver,
    "size": len,
    "string": str,
    "int": int,
}


def _has(node: Node, env: Mapping[str, Any]) -> bool:
    if node[0] != "get":
        raise Unsupported("has() takes a field selection")
    container = evaluate(node[1], env)
    key = evaluate(node[2], env)
    return isinstance(container, Mapping) and bool(key in container)


def evaluate(node: Node, env: Mapping[str, Any]) -> Any:
    """The value of ``node`` with the variables of ``env`` (``device``)."""
    op = node[0]
    if op == "lit":
        return node[1]
    if op == "var":
        if node[1] not in env:
            raise Unsupported(f"unknown variable {node[1]!r}")
        return env[node[1]]
    if op == "list":
        return [evaluate(n, env) for n in node[1]]
    if op == "get":
        container, key = evaluate(node[1], env), evaluate(node[2], env)
        if not isinstance(container, Mapping) or key not in container:
            raise EvalError(f"no such key: {key}")
        return container[key]
    if op == "!":
        value = evaluate(node[1], env)
        if not isinstance(value, bool):
            raise EvalError("! needs a bool")
        return not value
    if op in ("&&", "||"):
        return _logic(op, node, env)
    if op == "?":
        return evaluate(node[2] if evaluate(node[1], env) is True else node[3], env)
    if op == "call":
        return _call(node, env)
    left, right = evaluate(node[1], env), evaluate(node[2], env)
    if op == "==":
        return bool(left == right)
    if op == "!=":
        return bool(left != right)
    if op == "in":
        if not isinstance(right, list | Mapping):
            raise EvalError("in needs a list or map")
        return left in right
    result = _compare(left, right)
    return {"<": result < 0, "<=": result <= 0, ">": result > 0, ">=": result >= 0}[op]


def _logic(op: str, node: Node, env: Mapping[str, Any]) -> bool:
    # CEL's commutative && and ||: an error on one side is absorbed by a deciding other side.
    decisive = op == "||"
    error: EvalError | None = None
    for side in (node[1], node[2]):
        try:
            value = evaluate(side, env)
        except EvalError as exc:
            error = exc
            continue
        if value is decisive:
            return op == "||"
        if not isinstance(value, bool):
            error = EvalError(f"{op} needs bools")
    if error is not None:
        raise error
    return not decisive


def _call(node: Node, env: Mapping[str, Any]) -> Any:
    _, name, target, args = node
    if target is None and name == "has":
        return _has(args[0], env)
    values = [evaluate(a, env) for a in args]
    if target is None:
        if name not in _FUNCTIONS:
            raise Unsupported(f"unknown function {name}()")
        try:
            return _FUNCTIONS[name](*values)
        except (TypeError, ValueError) as exc:
            raise EvalError(str(exc)) from exc
    if name not in _METHODS:
        raise Unsupported(f"unknown method .{name}()")
    try:
        return _METHODS[name](evaluate(target, env), *values)
    except (TypeError, ValueError, re.error) as exc:
        raise EvalError(str(exc)) from exc


def matches(node: Node, env: Mapping[str, Any]) -> bool:
    """Whether a selector selects the device of ``env``; an evaluation error is no match."""
    try:
        return evaluate(node, env) is True
    except EvalError:
        return False


def device_env(
    driver: str, attributes: Mapping[str, Any], capacity: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``device`` variable: ``attributes``/``capacity`` are the slice's maps (values like
    ``{"string": "x"}`` / ``{"value": "80Gi"}``); unqualified names are in the driver's domain."""
    attrs: dict[str, dict[str, Any]] = {}
    for name, value in attributes.items():
        domain, _, short = name.rpartition("/")
        plain = next((value[k] for k in ("string", "int", "bool", "version") if k in value), None)
        if "version" in value:
            try:
                plain = _semver(plain)
            except EvalError:
                continue
        attrs.setdefault(domain or driver, {})[short] = plain
    caps: dict[str, dict[str, Any]] = {}
    for name, value in capacity.items():
        domain, _, short = name.rpartition("/")
        try:
            caps.setdefault(domain or driver, {})[short] = _quantity(value.get("value", "0"))
        except EvalError:
            continue
    return {"device": {"driver": driver, "attributes": attrs, "capacity": caps}}
