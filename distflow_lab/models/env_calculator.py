"""A calculator tool for the arithmetic task.

The model may call the tool by writing an expression in brackets; the turn ends at the
closing bracket, and the environment answers with the value and a ";":

    prompt  "3+4*5="
    model   "[4*5]"           -> observation "20;"   (reward 0, not done)
    model   "23<eos>"         -> reward 1 if "23" is the ground truth, done

A turn without a call is the final answer. A malformed expression is answered "?;" (the
tool's error, not the environment's). Past `max_calls` calls the trajectory ends with reward
0. Each call sleeps a delay drawn from `latency` (none by default).
"""
from __future__ import annotations

import ast
import operator
import random
import time
from typing import Any, Mapping

from pydantic import Field

from distflow_lab.models.environment import EnvOptions, EnvStep, Latency, register_env

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 12  # a tool answer longer than this is an error ("?"): the tiny model's context is short


def calculate(expr: str) -> int | None:
    """The value of an integer expression of + - * and parentheses, or None if it is not one."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(type(node).__name__)

    try:
        out = value(tree)
    except (ValueError, RecursionError):
        return None
    return out if len(str(abs(out))) <= MAX_DIGITS else None


def ground_truth(row: Mapping[str, Any]) -> str:
    """A row's ground truth: verl's `reward_model.ground_truth`, or a flat `ground_truth`."""
    rm = row.get("reward_model")
    if isinstance(rm, Mapping) and "ground_truth" in rm:
        return str(rm["ground_truth"])
    if "ground_truth" in row:
        return str(row["ground_truth"])
    raise KeyError("the row has neither reward_model.ground_truth nor ground_truth")


def question(row: Mapping[str, Any]) -> str:
    """A row's question text: `extra_info.question`, else the prompt's (last message's) text."""
    info, prompt = row.get("extra_info"), row.get("prompt")
    if isinstance(info, Mapping) and info.get("question"):
        return str(info["question"])
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], Mapping):
        return str(prompt[-1].get("content", ""))
    raise KeyError("the row has neither extra_info.question nor a prompt")


@register_env("calculator")
class Calculator:
    class Options(EnvOptions):
        max_calls: int = Field(default=3, ge=0)
        latency: Latency = Latency()
        seed: int = 0

    stop_strings = ("]",)  # a call ends the model's turn (besides eos)

    def __init__(self, tokenizer: Any, options: "Calculator.Options"):
        self.tok, self.opts = tokenizer, options
        self.rng = random.Random(options.seed)
        self.answer, self.calls = "", 0

    @staticmethod
    def demo(row: Mapping[str, Any]) -> list[tuple[str, bool]]:
        """A worked trajectory: the whole expression to the tool, its answer, the answer."""
        expr = question(row).rstrip("=").strip()
        value = calculate(expr)
        return [(f"[{expr}]", True), (("?" if value is None else str(value)) + ";", False),
                (ground_truth(row).strip(), True)]

    def reset(self, row: Mapping[str, Any]) -> list[int]:
        self.answer, self.calls = ground_truth(row).strip(), 0
        return []

    def step(self, tokens: list[int]) -> EnvStep:
        text = self.tok.decode(tokens, skip_special_tokens=True)
        start = text.rfind("[")
        if text.endswith("]") and start >= 0:  # a tool call
            self.calls += 1
            if self.calls > self.opts.max_calls:
                return EnvStep([], 0.0, True, {"calls": self.calls, "over_budget": True})
            time.sleep(self.opts.latency.draw(self.rng))
            value = calculate(text[start + 1:-1])
            reply = ("?" if value is None else str(value)) + ";"
            return EnvStep(self._ids(reply), 0.0, False, {"calls": self.calls, "tool_error": value is None})
        answer = text.strip()
        return EnvStep([], float(answer == self.answer), True, {"calls": self.calls, "answer": answer})

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]
