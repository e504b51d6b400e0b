"""Where DiffKV's pruning costs task accuracy: which tokens it drops in problems the fp16 cache solves and DiffKV
fails, and an ablation of where pruning is allowed.

    python3 -m evals.pruning_analysis --model qwen2.5-coder-1.5b --device cuda --out /tmp/pout

1. fp16 and DiffKV (the model's calibrated settings, or --alphas) on the `eval` split's gsm_symbolic problems;
   DiffKV's engines record where every token position lives per (layer, KV head) at each request's finish
   (CacheConfig.record_pruning).
2. Each position gets a category: the chat template around the question (`template`), the question's numbers
   (`question_number`: tokens with a digit) and its other text (`question_text`), the task's instruction
   (`instruction`), generated numbers (`generated_number`) and other generated text (`generated_text`).
3. For the problems fp16 solves and DiffKV fails (`fp16_only`), beside those both solve (`both_correct`) and all:
   per category the share of the pruned (layer, head, position) entries it holds, the rate at which its entries
   are pruned (overall and per layer), and the share of its positions that some layer pruned in every KV head
   (no head of that layer sees them any more).
4. The ablation: prune_phase prompt / generation (engine.CacheConfig.prune_phase), other windows and
   significance_queries, each with its accuracy and the paired difference to fp16.

Every configuration is written to configs/<name>.json as soon as it is done; --resume reuses them, and
--time-limit stops before a configuration that would not finish in time (the summary lists the pending ones),
so a long grid runs over several device commands. summary.json holds everything; a table is printed.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from diffkv_serve.engine.kv.policy import KEPT_LOW, PRUNED
from evals.harness import DEFAULT_MAX_TOKENS
from evals.problems import load_problems
from evals.runner import EvalModel, run_requests
from evals.stats import paired_diff
from evals.tasks import INSTRUCTIONS, extract_answer, score_tasks, task_prompt, task_requests
from diffkv_serve.engine.flags import add_engine_flags

TASK = "gsm_symbolic"
CATEGORIES = ("template", "question_number", "question_text", "instruction", "generated_number", "generated_text")
GROUPS = ("fp16_only", "both_correct", "all")
MAX_DETAILED = 40  # failing problems listed one by one (the rest only count in the aggregates)
SMOKE = dict(task_n=3, max_tokens=24, windows=[16], significance_queries=[4], window=8, alphas=[4.0, 1.0])


# ---- token categories ----------------------------------------------------------------------------------------
def prompt_categories(model: EvalModel, question: str) -> tuple[list[int], list[str]]:
    """The task prompt's ids (as evals.tasks sends them) and each token's category, from the tokenizer's offsets
    into the templated text."""
    tok = model.tokenizer
    text = task_prompt(TASK, question)
    chat = bool(getattr(tok, "chat_template", None))
    templated = (tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
                 if chat else text)
    enc = tok.backend.encode(templated, add_special_tokens=not chat)
    ids = model.chat_ids(text)
    if list(enc.ids) != ids:
        raise ValueError("prompt_categories: the tokenizer's offsets do not describe the prompt the task sends")
    q0 = templated.find(question.strip())
    if q0 < 0:
        raise ValueError("prompt_categories: the question is not in the templated prompt")
    q1 = q0 + len(question.strip())
    i0 = templated.find(INSTRUCTIONS[TASK].strip(), q1)
    i1 = i0 + len(INSTRUCTIONS[TASK].strip()) if i0 >= 0 else -1
    cats = []
    for a, b in enc.offsets:
        if b <= a:
            cats.append("template")  # special tokens have no text
        elif a < q1 and b > q0:
            cats.append("question_number" if any(ch.isdigit() for ch in templated[a:b]) else "question_text")
        elif i0 >= 0 and a < i1 and b > i0:
            cats.append("instruction")
        else:
            cats.append("template")
    return ids, cats


def generated_categories(model: EvalModel, token_ids: list[int]) -> list[str]:
    pieces = [model.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
    return ["generated_number" if any(ch.isdigit() for ch in p) else "generated_text" for p in pieces]


# ---- what was pruned ------------------------------------------------------------------------------------------
@dataclass
class PruneTally:
    """Per category and layer: (layer, KV head, position) entries, how many were pruned / kept low, positions,
    and positions some layer pruned in all of its KV heads."""

    num_layers: int

    def __post_init__(self):
        zeros = lambda: torch.zeros(self.num_layers, dtype=torch.float64)  # noqa: E731
        self.entries = {c: zeros() for c in CATEGORIES}
        self.pruned = {c: zeros() for c in CATEGORIES}
        self.low = {c: zeros() for c in CATEGORIES}
        self.positions = dict.fromkeys(CATEGORIES, 0)
        self.lost = dict.fromkeys(CATEGORIES, 0)
        self.problems = 0

    def add(self, classes: torch.Tensor, cats: list[str]) -> None:
        """classes int8 [L, H, N] (engine.kv.policy classes), cats: N categories."""
        L, H, N = classes.shape
        if len(cats) != N:
            raise ValueError(f"PruneTally.add: {len(cats)} categories for {N} positions")
        self.problems += 1
        pruned = classes == PRUNED
        low = classes == KEPT_LOW
        lost = pruned.all(1).any(0)  # [N]: some layer dropped it in every head
        for c in CATEGORIES:
            m = torch.tensor([x == c for x in cats], dtype=torch.bool)
            n = int(m.sum())
            if n == 0:
                continue
            self.entries[c] += H * n
            self.pruned[c] += pruned[:, :, m].sum((1, 2)).double()
            self.low[c] += low[:, :, m].sum((1, 2)).double()
            self.positions[c] += n
            self.lost[c] += int(lost[m].sum())

    def summary(self) -> dict:
        total_pruned = sum(float(p.sum()) for p in self.pruned.values())
        out = {"problems": self.problems, "pruned_entries": total_pruned, "categories": {}}
        for c in CATEGORIES:
            e, p = self.entries[c], self.pruned[c]
            n = float(e.sum())
            out["categories"][c] = {
                "positions": self.positions[c],
                "share_of_pruned": float(p.sum()) / total_pruned if total_pruned else 0.0,
                "pruned_rate": float(p.sum()) / n if n else None,
                "low_rate": float(self.low[c].sum()) / n if n else None,
                "lost_in_a_layer": self.lost[c] / self.positions[c] if self.positions[c] else None,
                "pruned_rate_per_layer": [float(x) / float(y) if y else None for x, y in zip(p, e)],
            }
        return out


def question_number_detail(model: EvalModel, ids: list[int], cats: list[str], classes: torch.Tensor) -> list[dict]:
    """Each question-number token: its text, position, share of (layer, head) entries pruned, layers that lost it."""
    rows = []
    for i, c in enumerate(cats):
        if c != "question_number":
            continue
        col = classes[:, :, i]
        rows.append({"position": i, "text": model.tokenizer.decode([ids[i]], skip_special_tokens=False),
                     "pruned_share": float((col == PRUNED).double().mean()),
                     "layers_lost": [int(x) for x in torch.nonzero((col == PRUNED).all(1)).flatten()]})
    return rows


# ---- configurations --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineRun:
    """One engine (cache settings) and the configurations it runs as one batch: name -> per-request
    kv_compression (None: the engine's settings), so prune_phase variants share their engine."""

    cache: dict
    variants: tuple[tuple[str, Optional[dict]], ...]


def ablation_runs(base: dict, phases: list[str], windows: list[int], queries: list[int]) -> list[EngineRun]:
    """In the order they run (most telling first): fp16; DiffKV as set; its other prune_phase values (per
    request, one batch on one engine); each other window and significance_queries (one change from the base
    each, an engine each)."""
    runs = [EngineRun({"kv_mode": "fp16"}, (("fp16", None),)), EngineRun(dict(base), (("diffkv", None),))]
    other = tuple((f"phase_{p}", {"prune_phase": p}) for p in phases if p != "both")
    if other:
        runs.append(EngineRun(dict(base), other))
    runs += [EngineRun({**base, "window": w}, ((f"window_{w}", None),)) for w in windows]
    runs += [EngineRun({**base, "significance_queries": q}, ((f"queries_{q}", None),)) for q in queries]
    return runs


def group_ids(fp16: dict, ids: list[str], correct: list[int]) -> dict[str, set]:
    """Problem ids per group: fp16 right and this configuration wrong, both right, all."""
    if fp16["ids"] != ids:
        raise ValueError("not the same problems as the fp16 run")
    pairs = list(zip(ids, fp16["correct"], correct))
    return {"fp16_only": {i for i, a, b in pairs if a and not b}, "both_correct": {i for i, a, b in pairs if a and b},
            "all": set(ids)}


def run_engine(model: EvalModel, run: EngineRun, problems, max_tokens: int, fp16: Optional[dict] = None,
               detail: str = "diffkv") -> dict[str, dict]:
    """Every configuration of one engine: accuracy with every problem's answer; for diffkv (fp16's result given)
    the pruning record tallied by category per group, and for the configuration named `detail` the failing
    problems one by one."""
    t0 = time.perf_counter()
    diffkv = run.cache.get("kv_mode") == "diffkv"
    reqs, spans = [], []
    for name, kv in run.variants:
        spans.append((name, len(reqs)))
        reqs += task_requests(model, problems, {TASK: max_tokens}, kv)
    with model.engine({**run.cache, "record_pruning": True} if diffkv else run.cache) as eng:
        used = eng.config.cache
        num_layers = eng.arch.num_layers
        outs = run_requests(eng, reqs, "+".join(n for n, _ in run.variants))
    seconds = time.perf_counter() - t0
    results = {}
    for (name, kv), (_, start) in zip(run.variants, spans):
        mine = outs[start:start + len(problems)]
        results[name] = _result(model, name, used, kv, problems, mine, num_layers, fp16 if diffkv else None,
                                name == detail)
        results[name]["seconds"] = seconds / len(run.variants)
    return results


def _result(model: EvalModel, name: str, used, kv: Optional[dict], problems, outs, num_layers: int,
            fp16: Optional[dict], detail: bool) -> dict:
    scored = score_tasks(used, model.head_dim, problems, outs)[TASK]
    cache = used.model_dump(exclude={"num_pages", "kv_cache_memory_gb", "gpu_memory_utilization", "record_pruning"})
    result = {"name": name, "cache": {**cache, **(kv or {})},
              "ids": scored["ids"], "correct": scored["correct"], "accuracy": scored["accuracy"],
              "memory_fraction": scored["memory_fraction"], "token_fractions": scored["token_fractions"],
              "mean_output_tokens": scored["mean_output_tokens"], "truncated": scored["truncated"],
              "predicted": [extract_answer(o.text) for o in outs]}
    if fp16 is None:
        return result
    groups = group_ids(fp16, result["ids"], result["correct"])
    tallies = {g: PruneTally(num_layers) for g in GROUPS}
    failing = []
    fp16_pred = dict(zip(fp16["ids"], fp16["predicted"]))
    for p, o in zip(problems, outs):
        classes = o.kv_usage.pop("token_classes")  # not kept: [L, H, N] per problem adds up
        ids, cats = prompt_categories(model, p.question)
        cats = (cats + generated_categories(model, o.token_ids))[:classes.shape[-1]]
        for g in GROUPS:
            if p.id in groups[g]:
                tallies[g].add(classes, cats)
        if detail and p.id in groups["fp16_only"] and len(failing) < MAX_DETAILED:
            one = PruneTally(num_layers)
            one.add(classes, cats)
            failing.append({
                "id": p.id, "question": p.question, "answer": p.answer, "fp16_predicted": fp16_pred[p.id],
                "predicted": extract_answer(o.text), "prompt_tokens": len(ids), "output_tokens": len(o.token_ids),
                "categories": {c: {k: v[k] for k in ("positions", "share_of_pruned", "pruned_rate", "lost_in_a_layer")}
                               for c, v in one.summary()["categories"].items()},
                "question_numbers": question_number_detail(model, ids, cats, classes)})
    result["pruning"] = {g: tallies[g].summary() for g in GROUPS}
    if detail:
        result["failing"] = failing
    return result


# ---- the command -----------------------------------------------------------------------------------------------
def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def compare(fp16: dict, results: dict[str, dict]) -> dict[str, dict]:
    """Each configuration's accuracy and paired difference to fp16 (points, 95% interval)."""
    rows = {}
    for name, r in results.items():
        row = {"accuracy": r["accuracy"], "memory_fraction": r["memory_fraction"],
               "token_fractions": r["token_fractions"], "mean_output_tokens": r["mean_output_tokens"],
               "seconds": r["seconds"]}
        if name != "fp16":
            if r["ids"] != fp16["ids"]:
                raise ValueError(f"{name}: not the same problems as fp16")
            d = paired_diff(fp16["correct"], r["correct"])
            row.update(diff_vs_fp16_points=100 * d["mean"], diff_ci95_points=[100 * d["ci_low"], 100 * d["ci_high"]],
                       fp16_only=sum(a and not b for a, b in zip(fp16["correct"], r["correct"])),
                       only_this=sum(b and not a for a, b in zip(fp16["correct"], r["correct"])))
        rows[name] = row
    return rows


def table(rows: dict[str, dict], pruning: Optional[dict]) -> str:
    lines = [f"{'config':<20}{'acc':>7}{'vs fp16 [95% CI] (pts)':>30}{'mem':>7}{'pruned':>8}{'fp16 only':>10}"]
    for name, r in rows.items():
        diff = (f"{r['diff_vs_fp16_points']:+.1f} [{r['diff_ci95_points'][0]:+.1f}, {r['diff_ci95_points'][1]:+.1f}]"
                if "diff_vs_fp16_points" in r else "")
        lost = f"{r['fp16_only']}" if "fp16_only" in r else ""
        lines.append(f"{name:<20}{100 * r['accuracy']:>6.1f}%{diff:>30}{100 * r['memory_fraction']:>6.1f}%"
                     f"{100 * r['token_fractions'].get('pruned', 0):>7.1f}%{lost:>10}")
    if pruning:
        lines += ["", "diffkv: what was pruned, by category (share of pruned entries / pruned rate / positions "
                      "lost in a whole layer)",
                  f"{'category':<18}" + "".join(f"{g:>26}" for g in GROUPS)]
        for c in CATEGORIES:
            cells = []
            for g in GROUPS:
                v = pruning[g]["categories"][c]
                cells.append("-" if v["pruned_rate"] is None else
                             f"{100 * v['share_of_pruned']:.1f}% / {100 * v['pruned_rate']:.1f}% / "
                             f"{100 * v['lost_in_a_layer']:.1f}%")
            lines.append(f"{c:<18}" + "".join(f"{x:>26}" for x in cells))
        lines.append(f"{'problems':<18}" + "".join(f"{pruning[g]['problems']:>26}" for g in GROUPS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_engine_flags(ap, only=("model", "device", "max_num_seqs", "max_model_len", "kv_cache_memory_gb", "threads"),
                     defaults={"device": "auto", "max_num_seqs": 128, "max_model_len": 2048})
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--task-n", type=int, default=500, help="gsm_symbolic problems of the eval split")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS[TASK])
    ap.add_argument("--alphas", type=float, nargs=2, default=None, metavar=("HIGH", "LOW"),
                    help="DiffKV thresholds (default: the model's calibrated settings)")
    ap.add_argument("--window", type=int, default=None, help="DiffKV's window (default: the engine's)")
    ap.add_argument("--significance-queries", type=int, default=None, help="default: the engine's")
    ap.add_argument("--phases", nargs="*", default=["prompt", "generation"], choices=["both", "prompt", "generation"],
                    help="prune_phase values of the ablation besides DiffKV's own 'both'")
    ap.add_argument("--windows", type=int, nargs="*", default=[32, 128], help="other windows of the ablation")
    ap.add_argument("--queries", type=int, nargs="*", default=[16, 256], dest="significance_queries_grid",
                    help="other significance_queries of the ablation")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds: stop before an engine run that the slowest configuration so far says would not "
                         "end in time (rerun with --resume for the rest)")
    ap.add_argument("--resume", action="store_true", help="reuse configs/<name>.json already in --out")
    ap.add_argument("--smoke", action="store_true", help="a few problems, short generations, one of each ablation")
    args = ap.parse_args(argv)
    for name in ("task_n", "max_tokens", "max_num_seqs", "max_model_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.smoke:
        args.task_n, args.max_tokens = SMOKE["task_n"], SMOKE["max_tokens"]
        args.windows, args.significance_queries_grid = SMOKE["windows"], SMOKE["significance_queries"]
        args.window = args.window or SMOKE["window"]
        args.alphas = args.alphas or SMOKE["alphas"]
        args.max_model_len = min(args.max_model_len, 512)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    base = {"kv_mode": "diffkv"}
    if args.alphas:
        base.update(alpha_high=args.alphas[0], alpha_low=args.alphas[1])
    if args.window:
        base["window"] = args.window
    if args.significance_queries:
        base["significance_queries"] = args.significance_queries
    runs = ablation_runs(base, args.phases, args.windows, args.significance_queries_grid)
    model = EvalModel(args.model, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory_gb=args.kv_cache_memory_gb)
    problems = load_problems(split="eval", tasks=(TASK,), limit=args.task_n)
    results: dict[str, dict] = {}
    pending, ran_here = [], False
    for run in runs:
        names = [n for n, _ in run.variants]
        paths = {n: args.out / "configs" / f"{n}.json" for n in names}
        if args.resume and all(p.is_file() for p in paths.values()):
            results.update((n, json.loads(p.read_text())) for n, p in paths.items())
            continue
        spent = time.perf_counter() - t_start
        per_config = max((r["seconds"] for r in results.values()), default=0.0)
        # The first run of a command always starts (else a run longer than the limit would never start).
        if pending or (args.time_limit is not None and ran_here
                       and spent + 1.2 * per_config * len(names) > args.time_limit):
            pending += names  # and every later run: they keep their order for the next --resume
            continue
        done = run_engine(model, run, problems, args.max_tokens, results.get("fp16"))
        ran_here = True
        for n, r in done.items():
            results[n] = r
            _dump(paths[n], r)
            print(f"{n}: accuracy {100 * r['accuracy']:.1f}% ({r['seconds']:.0f} s)", flush=True)
    rows = compare(results["fp16"], results)
    pruning = results.get("diffkv", {}).get("pruning")
    summary = {"model": model.name, "task": TASK, "problems": len(problems), "device": args.device,
               "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "configs": rows, "pending": pending,
               "pruning": {n: r["pruning"] for n, r in results.items() if "pruning" in r},
               "failing": results.get("diffkv", {}).get("failing", []),
               "seconds": time.perf_counter() - t_start}
    _dump(args.out / "summary.json", summary)
    print(table(rows, pruning))
    if pending:
        print(f"pending (time limit): {' '.join(pending)}; rerun with --resume")
    print(f"summary: {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
