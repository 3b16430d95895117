"""A tiny, safe evaluator of numpy expressions such as ``"sqrt(x * x + y * y)"``.

Expressions are parsed with :mod:`ast` and only whitelisted nodes are
accepted: input names, numbers, ``+ - * / **``, unary minus, and calls of a
few numpy functions. Nothing is ever passed to ``eval``, so a package cannot
run code of its own.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from neuropod.errors import PackageError

Evaluator = Callable[[Mapping[str, np.ndarray]], Any]

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
#: The numpy functions an expression may call.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": np.abs, "sqrt": np.sqrt, "exp": np.exp, "log": np.log, "tanh": np.tanh,
    "sin": np.sin, "cos": np.cos, "maximum": np.maximum, "minimum": np.minimum,
}  # fmt: skip


def compile_expression(text: str, names: set[str], where: str) -> Evaluator:
    """Turn ``text`` into a function of the inputs; refuse anything not whitelisted.

    :param names: the input names the expression may use.
    :param where: what to name in errors, e.g. ``"output 'out' of model 'm'"``.
    """
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise PackageError(f"{where}: {text!r} is not an expression: {e.msg}") from None
    return _compile(tree.body, names, where, text)


def _compile(node: ast.AST, names: set[str], where: str, text: str) -> Evaluator:
    if isinstance(node, ast.Name):
        name = node.id
        if name not in names:
            raise PackageError(f"{where}: {text!r} uses {name!r}, which is not an input ({', '.join(sorted(names))})")
        return lambda env: env[name]
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
        return lambda env: value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        op = _BINARY[type(node.op)]
        left, right = _compile(node.left, names, where, text), _compile(node.right, names, where, text)
        return lambda env: op(left(env), right(env))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        uop, operand = _UNARY[type(node.op)], _compile(node.operand, names, where, text)
        return lambda env: uop(operand(env))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords:
        func = FUNCTIONS[node.func.id]
        args = [_compile(a, names, where, text) for a in node.args]
        return lambda env: func(*(a(env) for a in args))
    snippet = ast.get_source_segment(text, node) or type(node).__name__
    allowed = ", ".join(sorted(FUNCTIONS))
    raise PackageError(
        f"{where}: {text!r} contains {snippet!r}, which is not allowed; expressions may use input names, numbers, "
        f"+ - * / ** and the functions {allowed}"
    )


__all__ = ["FUNCTIONS", "compile_expression"]
