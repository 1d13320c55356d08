"""A small expression language: tokenizer, Pratt parser and evaluator.

Supports numbers, names, + - * / % ** and unary minus, comparisons, parentheses,
function calls and ``let name = expr`` bindings. Run this file to check it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KEYWORDS = {"let", "and", "or", "not"}
SYMBOLS = ("**", "<=", ">=", "==", "!=", "+", "-", "*", "/", "%", "<", ">", "(", ")", ",", "=")


class ParseError(Exception):
    """Raised with the column where the input stopped making sense."""

    def __init__(self, message: str, column: int) -> None:
        super().__init__(f"{message} at column {column}")
        self.column = column


@dataclass(frozen=True)
class Token:
    kind: str  # "num", "name", "kw", "sym", "end"
    text: str
    column: int


def tokenize(source: str) -> list[Token]:
    """Split the source into tokens; whitespace separates, symbols match longest first."""
    tokens: list[Token] = []
    i = 0
    while i < len(source):
        ch = source[i]
        if ch.isspace():
            i += 1
            continue
        if ch.isdigit() or (ch == "." and i + 1 < len(source) and source[i + 1].isdigit()):
            start = i
            seen_dot = False
            while i < len(source) and (source[i].isdigit() or (source[i] == "." and not seen_dot)):
                seen_dot = seen_dot or source[i] == "."
                i += 1
            tokens.append(Token("num", source[start:i], start))
            continue
        if ch.isalpha() or ch == "_":
            start = i
            while i < len(source) and (source[i].isalnum() or source[i] == "_"):
                i += 1
            word = source[start:i]
            tokens.append(Token("kw" if word in KEYWORDS else "name", word, start))
            continue
        for sym in SYMBOLS:
            if source.startswith(sym, i):
                tokens.append(Token("sym", sym, i))
                i += len(sym)
                break
        else:
            raise ParseError(f"unexpected character {ch!r}", i)
    tokens.append(Token("end", "", len(source)))
    return tokens


@dataclass
class Node:
    op: str
    args: list = field(default_factory=list)
    value: object = None


# binding powers: higher binds tighter; ** is right-associative
INFIX = {
    "or": (1, 2), "and": (3, 4),
    "==": (5, 6), "!=": (5, 6), "<": (5, 6), ">": (5, 6), "<=": (5, 6), ">=": (5, 6),
    "+": (7, 8), "-": (7, 8),
    "*": (9, 10), "/": (9, 10), "%": (9, 10),
    "**": (14, 13),
}
PREFIX_POWER = 11


class Parser:
    """Pratt parser over a token list; ``parse`` returns one statement node."""

    def __init__(self, tokens: list[Token]) -> None:
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> Token:
        return self.tokens[self.pos]

    def advance(self) -> Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expect(self, text: str) -> Token:
        token = self.advance()
        if token.text != text:
            raise ParseError(f"expected {text!r}, found {token.text or 'end of input'!r}", token.column)
        return token

    def parse(self) -> Node:
        if self.peek().text == "let":
            self.advance()
            name = self.advance()
            if name.kind != "name":
                raise ParseError("expected a name after 'let'", name.column)
            self.expect("=")
            node = Node("let", [self.expression(0)], name.text)
        else:
            node = self.expression(0)
        end = self.peek()
        if end.kind != "end":
            raise ParseError(f"unexpected {end.text!r}", end.column)
        return node

    def expression(self, min_power: int) -> Node:
        left = self.prefix()
        while True:
            token = self.peek()
            powers = INFIX.get(token.text) if token.kind in ("sym", "kw") else None
            if powers is None or powers[0] < min_power:
                return left
            self.advance()
            left = Node(token.text, [left, self.expression(powers[1])])

    def prefix(self) -> Node:
        token = self.advance()
        if token.kind == "num":
            return Node("num", value=float(token.text))
        if token.kind == "name":
            if self.peek().text == "(":
                return self.call(token.text)
            return Node("var", value=token.text)
        if token.text in ("-", "not"):
            return Node("neg" if token.text == "-" else "not", [self.expression(PREFIX_POWER)])
        if token.text == "(":
            inner = self.expression(0)
            self.expect(")")
            return inner
        raise ParseError(f"unexpected {token.text or 'end of input'!r}", token.column)

    def call(self, name: str) -> Node:
        self.expect("(")
        args: list[Node] = []
        if self.peek().text != ")":
            args.append(self.expression(0))
            while self.peek().text == ",":
                self.advance()
                args.append(self.expression(0))
        self.expect(")")
        return Node("call", args, name)


FUNCTIONS = {
    "sqrt": math.sqrt, "abs": abs, "min": min, "max": max,
    "floor": math.floor, "ceil": math.ceil, "log": math.log,
}


class Interpreter:
    """Evaluates statements, keeping ``let`` bindings between calls."""

    def __init__(self) -> None:
        self.variables: dict[str, float] = {"pi": math.pi, "e": math.e}

    def run(self, source: str) -> float:
        node = Parser(tokenize(source)).parse()
        if node.op == "let":
            value = self.evaluate(node.args[0])
            self.variables[node.value] = value
            return value
        return self.evaluate(node)

    def evaluate(self, node: Node) -> float:
        if node.op == "num":
            return node.value
        if node.op == "var":
            if node.value not in self.variables:
                raise NameError(f"unknown variable {node.value!r}")
            return self.variables[node.value]
        if node.op == "neg":
            return -self.evaluate(node.args[0])
        if node.op == "not":
            return float(not self.evaluate(node.args[0]))
        if node.op == "call":
            if node.value not in FUNCTIONS:
                raise NameError(f"unknown function {node.value!r}")
            return FUNCTIONS[node.value](*[self.evaluate(a) for a in node.args])
        if node.op == "and":
            return self.evaluate(node.args[1]) if self.evaluate(node.args[0]) else 0.0
        if node.op == "or":
            left = self.evaluate(node.args[0])
            return left if left else self.evaluate(node.args[1])
        a, b = (self.evaluate(arg) for arg in node.args)
        return binary(node.op, a, b)


def binary(op: str, a: float, b: float) -> float:
    """Apply an arithmetic or comparison operator; comparisons return 1.0 or 0.0."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return a / b
    if op == "%":
        return a % b
    if op == "**":
        return a**b
    comparisons = {"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b, "==": a == b, "!=": a != b}
    return float(comparisons[op])


def to_text(node: Node) -> str:
    """Fully parenthesised form, handy for checking precedence."""
    if node.op == "num":
        return f"{node.value:g}"
    if node.op == "var":
        return node.value
    if node.op in ("neg", "not"):
        return f"({'-' if node.op == 'neg' else 'not '}{to_text(node.args[0])})"
    if node.op == "call":
        return f"{node.value}({', '.join(to_text(a) for a in node.args)})"
    if node.op == "let":
        return f"let {node.value} = {to_text(node.args[0])}"
    return f"({to_text(node.args[0])} {node.op} {to_text(node.args[1])})"


def _self_check() -> None:
    interp = Interpreter()
    assert interp.run("1 + 2 * 3") == 7
    assert interp.run("2 ** 3 ** 2") == 512
    assert interp.run("-2 ** 2") == -4
    assert interp.run("let x = 4") == 4
    assert interp.run("sqrt(x) + max(1, x, 3)") == 6
    assert interp.run("x > 3 and x < 5") == 1.0
    assert interp.run("(1 + 2) * (3 - 1) % 4") == 2
    assert to_text(Parser(tokenize("a - b - c")).parse()) == "((a - b) - c)"
    for bad, column in (("1 +", 3), ("2 $ 3", 2), ("(1", 2)):
        try:
            interp.run(bad)
        except ParseError as exc:
            assert exc.column == column, (bad, exc.column)
        else:
            raise AssertionError(f"{bad!r} should not parse")


if __name__ == "__main__":
    _self_check()
    print("expr_parser: all checks passed")
