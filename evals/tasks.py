"""Task accuracy: chat-template prompts, greedy generation, answer extraction and scoring."""
from __future__ import annotations

import re
from typing import Optional

from diffkv_serve.engine import SamplingParams
from evals.memory import memory_fraction
from evals.runner import Request

# Word problems get room to reason; the arithmetic drills (small models) ask for the answer only.
INSTRUCTIONS = {
    "gsm_symbolic": "\n\nSolve the problem step by step. Finish with a final line of the form 'Answer: <number>'.",
    "basic_arithmetic": "\n\nReply with the final answer only, in the form 'Answer: <number>'.",
    "chain_sum": "\n\nReply with the final answer only, in the form 'Answer: <number>'.",
}
NUMBER = r"[-−]?\d[\d,]*(?:\.\d+)?|[-−]?\.\d+"
_ANSWER = re.compile(r"answer\s*(?:is|:)?\s*\**\s*\$?\s*(" + NUMBER + ")", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(" + NUMBER + r")\s*\}")
_ANY = re.compile(NUMBER)


def task_prompt(task: str, question: str) -> str:
    return question.strip() + INSTRUCTIONS[task]


def extract_answer(text: str) -> Optional[str]:
    """The final number: the last 'Answer: x' / 'answer is x', else the last \\boxed{x}, else the last number."""
    for pattern in (_ANSWER, _BOXED, _ANY):
        hits = pattern.findall(text)
        if hits:
            return hits[-1].replace(",", "").replace("−", "-")
    return None


def is_correct(predicted: Optional[str], answer: str) -> bool:
    if predicted is None:
        return False
    try:
        p, a = float(predicted), float(answer.replace(",", ""))
    except ValueError:
        return predicted.strip() == answer.strip()
    return abs(p - a) <= 1e-6 * max(1.0, abs(a))


def task_requests(model, problems, max_tokens: dict[str, int], kv_compression: dict | None = None) -> list[Request]:
    return [Request(model.chat_ids(task_prompt(p.task, p.question)),
                    SamplingParams(temperature=0, max_tokens=max_tokens[p.task]), kv_compression) for p in problems]


def score_tasks(cache, head_dim: int, problems, outs) -> dict:
    """Accuracy per task with each problem's correctness (for paired comparisons) and KV usage."""
    by_task: dict[str, dict] = {}
    for p, o in zip(problems, outs):
        t = by_task.setdefault(p.task, {"ids": [], "correct": [], "output_tokens": 0, "truncated": 0,
                                        "high": 0, "low": 0, "pruned": 0})
        t["ids"].append(p.id)
        t["correct"].append(int(is_correct(extract_answer(o.text), p.answer)))
        t["output_tokens"] += len(o.token_ids)
        t["truncated"] += o.finish_reason == "length"
        u = o.kv_usage or {}
        t["high"] += u.get("tokens_high", 0)
        t["low"] += u.get("tokens_low", 0)
        t["pruned"] += u.get("tokens_pruned", 0)
    result = {}
    for task, t in by_task.items():
        n = len(t["correct"])
        total = t["high"] + t["low"] + t["pruned"]
        result[task] = {
            "n": n, "accuracy": sum(t["correct"]) / n, "ids": t["ids"], "correct": t["correct"],
            "mean_output_tokens": t["output_tokens"] / n, "truncated": t["truncated"],
            "memory_fraction": memory_fraction(cache, head_dim, t["high"], t["low"], t["pruned"]),
            "token_fractions": {k: t[k] / total for k in ("high", "low", "pruned")},
        }
    return result
