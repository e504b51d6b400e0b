"""Problem sets: generated once with reasoning-gym into evals/data/problems.jsonl (committed), read by
everything else, so evaluation machines need no reasoning-gym.

Splits (disjoint by question text): `eval` (task accuracy), `calib` (calibration, `python3 -m evals.cli calibrate`) and
`fidelity` (prompts for long teacher-forced generations). Regenerate with `python3 -m evals.problems`.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data" / "problems.jsonl"
TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum")
SPLITS = ("eval", "calib", "fidelity")
# Each (split, task) has its own generator seed. reasoning-gym seeds item i with seed + i, so the splits'
# seeds lie far apart (overlapping ranges would repeat items); sizes are what the study draws from.
SEEDS = {"eval": 1_000_000, "calib": 2_000_000, "fidelity": 3_000_000}
SIZES = {"eval": {"gsm_symbolic": 2500, "basic_arithmetic": 300, "chain_sum": 300},
         "calib": {"gsm_symbolic": 200, "basic_arithmetic": 100, "chain_sum": 100},
         "fidelity": {"gsm_symbolic": 128}}


@dataclass(frozen=True)
class Problem:
    id: str
    task: str  # reasoning-gym generator name
    split: str
    seed: int  # generator seed; `index` is the item within that generator
    index: int
    question: str
    answer: str


def load_problems(path: Path = DATA, split: str | None = None, tasks: tuple[str, ...] | None = None,
                  limit: int | None = None) -> list[Problem]:
    """Problems of one split (and tasks), in file order; `limit` per task."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split={split!r}: choose from {SPLITS}")
    if tasks is not None and set(tasks) - set(TASKS):
        raise ValueError(f"tasks={tasks!r}: choose from {TASKS}")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; generate it with: python3 -m evals.problems")
    out, per_task = [], {}
    for line in path.read_text().splitlines():
        p = Problem(**json.loads(line))
        if (split and p.split != split) or (tasks and p.task not in tasks):
            continue
        if limit is not None and per_task.get(p.task, 0) >= limit:
            continue
        per_task[p.task] = per_task.get(p.task, 0) + 1
        out.append(p)
    return out


def generate(sizes: dict = SIZES) -> list[Problem]:
    """Draw every split from reasoning-gym; later splits drop questions an earlier split already has."""
    import reasoning_gym

    seen: set[str] = set()
    problems = []
    for split in SPLITS:
        for t, task in enumerate(TASKS):
            n = sizes[split].get(task, 0)
            if not n:
                continue
            seed = SEEDS[split] + 100_000 * t
            ds = reasoning_gym.create_dataset(task, size=2 * n, seed=seed)  # spares replace duplicates
            kept = 0
            for i in range(len(ds)):
                q = ds[i]["question"]
                if q in seen:
                    continue
                seen.add(q)
                problems.append(Problem(f"{split}-{task}-{i}", task, split, seed, i, q, str(ds[i]["answer"])))
                kept += 1
                if kept == n:
                    break
            if kept < n:
                raise ValueError(f"{task}: only {kept} distinct questions for split {split} (wanted {n})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="regenerate evals/data/problems.jsonl with reasoning-gym")
    ap.add_argument("--out", type=Path, default=DATA)
    args = ap.parse_args(argv)
    problems = generate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(asdict(p)) + "\n" for p in problems))
    print(f"wrote {len(problems)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
