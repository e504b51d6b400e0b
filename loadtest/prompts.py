"""Prompts for load tests: grade-school math questions from reasoning-gym's `gsm_symbolic` generator (ships
in the package, generated offline from a seed), or a JSONL file of your own.

    load_prompts("gsm_symbolic", n=200, seed=0)   # -> list of chat message lists
    load_prompts("requests.jsonl")                # lines: {"prompt": str} | {"messages": [...]} | {"question": str}
"""
from __future__ import annotations

import json
from pathlib import Path

Messages = list[dict]
GENERATORS = ("gsm_symbolic",)


def _from_generator(name: str, n: int, seed: int) -> list[Messages]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(name, size=n, seed=seed)
    return [[{"role": "user", "content": item["question"]}] for item in ds]


def _from_jsonl(path: Path) -> list[Messages]:
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            out.append(obj["messages"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt") or obj.get("question"), str):
            out.append([{"role": "user", "content": obj.get("prompt") or obj["question"]}])
        else:
            raise ValueError(f"{path}:{lineno}: expected an object with 'messages' (list), 'prompt' or "
                             f"'question' (string)")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def load_prompts(source: str = "gsm_symbolic", n: int = 200, seed: int = 0) -> list[Messages]:
    """`n` chat prompts from a generator name, or from a JSONL path (its prompts in order, cycled)."""
    if source in GENERATORS:
        return _from_generator(source, n, seed)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"prompts: {source!r} is neither a generator ({', '.join(GENERATORS)}) nor a file")
    prompts = _from_jsonl(path)
    return [prompts[i % len(prompts)] for i in range(max(n, 1))]
