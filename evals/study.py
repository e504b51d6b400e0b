"""The whole accuracy study of one model, one command:

    python3 -m evals.study --model qwen2.5-coder-1.5b --device cuda --out evals/results/qwen2.5-coder-1.5b

1. fp16 reference generations (EOS ignored) for the fidelity prompts of the `fidelity` and `calib` splits;
2. calibration of alpha_high / alpha_low on the `calib` split (`--no-calibrate`: the model's settings file);
3. every configuration (fp16, DiffKV, uniform and mirror quantization, KIVI-like, equal-budget pruning at
   50% and at DiffKV's measured memory) on fidelity and task accuracy (`eval` split);
4. summary.json: per configuration fidelity vs fp16 with paired intervals, accuracy with the paired
   difference to fp16, memory and token fractions, and the checks of the issue's claims.

Each configuration's result is written as soon as it is done (configs/<name>.json); `--resume` reuses them.
`python3 -m evals.report` turns every summary under evals/results/ into docs/ACCURACY.md and its plot.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from diffkv_serve.engine import key_centering
from evals.calibrate import calibrate, measured_points, write_settings
from evals.configs import baseline_configs, diffkv_config, parse_config, prune_config
from evals.fidelity import compare_to_fp16, fidelity_prompts, reference_generations
from evals.harness import DEFAULT_MAX_TOKENS, evaluate_config
from evals.key_center import center_summary, measure_key_centers
from evals.memory import fp16_token_bytes, token_bytes
from evals.problems import TASKS, load_problems
from evals.runner import EvalModel
from evals.stats import paired_diff
from evals.task_calibration import MIN_AGREEMENT, calib_pairs, calibrate_on_tasks
from diffkv_serve.engine.flags import add_engine_flags

SMOKE = dict(fidelity_n=2, gen_len=24, calib_n=2, calib_gen_len=24, task_n=3, calib_task_n=3,
             max_tokens={"gsm_symbolic": 24, "basic_arithmetic": 16, "chain_sum": 16})


def _dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def summarize(results: dict, fp16_name: str = "fp16") -> dict:
    """Each configuration against fp16: fidelity deltas, accuracy and paired accuracy differences (points)."""
    base = results[fp16_name]
    rows = {}
    for name, r in results.items():
        row = {"label": r["label"], "family": r["family"], "cache": r["cache"]}
        if "fidelity" in r:
            f = r["fidelity"]
            row["fidelity"] = {k: f[k] for k in ("n_generations", "gen_tokens", "top1_agreement", "nll",
                                                 "memory_fraction", "token_fractions")}
            row["fidelity"].update(compare_to_fp16(f, base["fidelity"]))
        if "tasks" in r:
            row["tasks"] = {}
            for task, t in r["tasks"].items():
                b = base["tasks"][task]
                if t["ids"] != b["ids"]:
                    raise ValueError(f"{name}/{task}: not the same problems as fp16")
                d = paired_diff(b["correct"], t["correct"])
                row["tasks"][task] = {
                    "n": t["n"], "accuracy": t["accuracy"], "memory_fraction": t["memory_fraction"],
                    "token_fractions": t["token_fractions"], "mean_output_tokens": t["mean_output_tokens"],
                    "truncated": t["truncated"],
                    "diff_vs_fp16_points": 100 * d["mean"], "diff_ci95_points": [100 * d["ci_low"], 100 * d["ci_high"]]}
        rows[name] = row
    return rows


def check_claims(rows: dict, memory_cap: float = 0.30) -> dict:
    """The issue's claims, evaluated on the data (True / False; None when a configuration is missing)."""
    def fid(name):
        return rows.get(name, {}).get("fidelity")

    out = {}
    d = fid("diffkv")
    if d:
        out["diffkv_memory_fraction"] = d["memory_fraction"]
        out["diffkv_within_memory_cap"] = d["memory_fraction"] <= memory_cap
        for other in ("k4v4", "prune_eq", "prune50"):
            o = fid(other)
            if o:
                out[f"diffkv_better_than_{other}"] = {
                    "other_memory_fraction": o["memory_fraction"],
                    "agreement": d["top1_agreement"] > o["top1_agreement"],
                    "nll_increase": d["nll_increase"] < o["nll_increase"]}
    for better, worse in (("k8v4", "k4v8"), ("k4v2", "k2v4")):
        b, w = fid(better), fid(worse)
        if b and w:
            out[f"{better}_beats_{worse}"] = {"agreement": b["top1_agreement"] > w["top1_agreement"],
                                             "nll": b["nll"] < w["nll"]}
    acc = rows.get("diffkv", {}).get("tasks", {})
    out["diffkv_accuracy_ci_within_2_points"] = {
        t: v["diff_ci95_points"][0] >= -2 and v["diff_ci95_points"][1] <= 2 and v["diff_ci95_points"][0] <= 0
        <= v["diff_ci95_points"][1] for t, v in acc.items()}
    return out


class OptionError(ValueError, argparse.ArgumentTypeError):
    """A bad option value: a ValueError to callers, a usage error with this message to argparse."""


def parse_max_tokens(text: str) -> dict:
    """--max-tokens: an integer (every task) or a JSON object of task -> integer."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--max-tokens {text!r}: not an integer or a JSON object ({e})") from None
    if isinstance(v, int) and not isinstance(v, bool):
        v = {task: v for task in DEFAULT_MAX_TOKENS}
    if not isinstance(v, dict) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                          for n in v.values()):
        raise OptionError(f"--max-tokens {text!r}: expected a positive integer or {{\"task\": n}} with n > 0")
    unknown = set(v) - set(DEFAULT_MAX_TOKENS)
    if unknown:
        raise OptionError(f"--max-tokens: unknown task(s) {sorted(unknown)}; tasks: {sorted(DEFAULT_MAX_TOKENS)}")
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_engine_flags(ap, only=("model", "device", "max_num_seqs", "kv_cache_memory_gb", "max_model_len", "threads"),
                     defaults={"device": "auto", "max_num_seqs": 128, "max_model_len": 2048})
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tasks", nargs="+", default=["gsm_symbolic"], choices=TASKS)
    ap.add_argument("--task-n", type=int, default=250, help="eval problems per task")
    ap.add_argument("--fidelity-n", type=int, default=64, help="fidelity generations")
    ap.add_argument("--gen-len", type=int, default=512, help="tokens per fidelity generation")
    ap.add_argument("--calib-n", type=int, default=32, help="calibration generations")
    ap.add_argument("--calib-gen-len", type=int, default=512)
    ap.add_argument("--calib-task-n", type=int, default=None,
                    help="calibration problems per task (default: 200 by tasks, none by agreement)")
    ap.add_argument("--calib-pairs", nargs="+", default=None, metavar="HIGH/LOW",
                    help="calibration by tasks: only these precision pairs (default: all of task_calibration's)")
    ap.add_argument("--max-tokens", type=parse_max_tokens, default={},
                    help='generation limit: N for every task, or per task as JSON {"task": n}')
    ap.add_argument("--criterion", choices=("tasks", "agreement"), default="tasks",
                    help="calibration: paired task accuracy on the calib problems (evals.task_calibration), or "
                         "teacher-forced top-1 agreement (evals.calibrate)")
    ap.add_argument("--tolerance-points", type=float, default=1.0,
                    help="calibration by tasks: accuracy a point may lose against fp16 (points)")
    ap.add_argument("--min-agreement", type=float, default=MIN_AGREEMENT,
                    help="calibration by tasks: the chosen point's top-1 agreement floor (0 turns it off)")
    ap.add_argument("--tolerance", type=float, default=0.01, help="calibration by agreement: tolerance per stage")
    ap.add_argument("--no-calibrate", action="store_true", help="use the model's settings file instead")
    ap.add_argument("--write-settings", action="store_true", help="write the calibrated alphas to diffkv_serve/engine/model_settings")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="only these configurations (fp16 always runs); besides the built-in names, uniform:KxVy and "
                         "diffkv:alpha_high=A,alpha_low=B[,high=KxVy][,low=KxVy] (evals.configs.parse_config)")
    ap.add_argument("--task-configs", nargs="+", default=None,
                    help="configurations that also run task accuracy (default: all; fp16 always does)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="reuse configs/<name>.json already in --out")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline end to end in minutes")
    args = ap.parse_args(argv)
    builtin = {c.name for c in baseline_configs(attention_bias=True)} | {"diffkv", "prune_eq"}
    for name in set(args.configs or ()) - builtin:
        try:
            parse_config(name)  # a misspelled configuration fails here, not after the references are made
        except ValueError as e:
            ap.error(str(e))
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v if k != "max_tokens" else {**v, **args.max_tokens})
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model = EvalModel(args.model, device=args.device, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)
    out = args.out
    tasks = tuple(args.tasks)
    problems = load_problems(split="eval", tasks=tasks, limit=args.task_n)
    calib_task_n = args.calib_task_n if args.calib_task_n is not None else (200 if args.criterion == "tasks" else 0)
    calib_problems = load_problems(split="calib", tasks=tasks, limit=calib_task_n) if calib_task_n else []
    fid = fidelity_prompts(model, load_problems(split="fidelity", limit=args.fidelity_n))
    cal = fidelity_prompts(model, load_problems(split="calib", tasks=("gsm_symbolic",), limit=args.calib_n))
    max_tokens = {**DEFAULT_MAX_TOKENS, **args.max_tokens}

    ref_path = out / "references.json"
    refs = json.loads(ref_path.read_text()) if args.resume and ref_path.is_file() else None
    # --no-calibrate needs no calibration references: recorded ones are kept, missing ones are not made.
    if (refs is None or len(refs["fidelity"]) != len(fid)
            or (not args.no_calibrate and len(refs["calib"]) != len(cal))):
        with model.engine({"kv_mode": "fp16"}) as eng:
            refs = {"fidelity": reference_generations(eng, fid, args.gen_len),
                    "calib": reference_generations(eng, cal, args.calib_gen_len) if not args.no_calibrate else []}
        _dump(ref_path, refs)

    if args.no_calibrate:
        from diffkv_serve.engine.model_settings import load_model_settings

        settings = load_model_settings(model.name)
        if settings is None:
            raise SystemExit(f"--no-calibrate: {model.name} has no settings file; run without it to calibrate")
        calib = {"model": model.name, "alpha_high": settings["alpha_high"], "alpha_low": settings["alpha_low"],
                 "low": settings.get("low"), "high": settings.get("high"),
                 "calibration": {"from_settings_file": True, **settings.get("calibration", {})}}
    else:
        # Key centers first (evals.key_center): the sweep and every quantized configuration use them.
        kc_path = out / "key_center.json"
        if args.resume and kc_path.is_file():
            model.key_center = torch.tensor(json.loads(kc_path.read_text())["key_center"])
        else:
            model.key_center = measure_key_centers(model, [p + r for p, r in zip(cal, refs["calib"])])
            _dump(kc_path, {"key_center": key_centering.to_settings(model.key_center)})
        cal_path = out / "calibration.json"
        recorded = json.loads(cal_path.read_text()) if args.resume and cal_path.is_file() else None
        if args.criterion == "tasks":
            if recorded and recorded["calibration"].get("by") == "task accuracy":
                calib = recorded  # --resume: a finished task calibration is reused whole
            else:
                calib = calibrate_on_tasks(model, calib_problems, cal, refs["calib"], max_tokens,
                                           tolerance_points=args.tolerance_points, pairs=calib_pairs(args.calib_pairs),
                                           min_agreement=args.min_agreement or None,
                                           progress=out / "task_calibration_progress.json")
        else:
            # --resume re-picks from the recorded sweep points and measures only the missing ones.
            calib = calibrate(model, cal, refs["calib"], calib_problems, max_tokens, tolerance=args.tolerance,
                              measured=measured_points(recorded) if recorded else None)
        calib.update({key_centering.SETTINGS_KEY: key_centering.to_settings(model.key_center),
                      "key_center_calibration": center_summary(model.key_center)})
        _dump(cal_path, calib)
        if args.write_settings:
            print(f"wrote {write_settings(calib)}")

    results = {}
    wanted = set(args.configs) if args.configs else None

    def run(kvc):
        # --resume: reuse a recorded result, and keep those of configurations not asked for this time, so
        # a study split over several commands (--configs subsets) ends with one complete summary.
        path = out / "configs" / f"{kvc.name}.json"
        if args.resume and path.is_file():
            results[kvc.name] = json.loads(path.read_text())
        elif wanted is None or kvc.name in wanted or kvc.name == "fp16":
            with_tasks = args.task_configs is None or kvc.name in args.task_configs or kvc.name == "fp16"
            results[kvc.name] = evaluate_config(model, kvc, problems if with_tasks else (), fid, refs["fidelity"],
                                                max_tokens)
            _dump(path, results[kvc.name])
            f = results[kvc.name].get("fidelity")
            if f:
                print(f"{kvc.name}: top-1 agreement {f['top1_agreement']:.4f}, NLL {f['nll']:.4f}, "
                      f"memory {100 * f['memory_fraction']:.1f}% of fp16")

    run(baseline_configs()[0])
    run(diffkv_config(calib["alpha_high"], calib["alpha_low"], low=calib.get("low"), high=calib.get("high")))
    for kvc in baseline_configs(model.ckpt.arch.attention_bias)[1:]:
        run(kvc)
    for name in sorted((wanted or set()) - set(results) - {"prune_eq"}):  # frontier points named on the command line
        run(parse_config(name))
    if "diffkv" in results:
        # Equal-budget pruning at DiffKV's own memory: keep the share of 16-bit tokens that costs as much.
        fp16_share = token_bytes(16, 16, model.head_dim) / fp16_token_bytes(model.head_dim)
        run(prune_config(min(1.0, results["diffkv"]["fidelity"]["memory_fraction"] / fp16_share), "prune_eq"))
    rows = summarize(results)
    summary = {
        "model": model.name, "device": str(args.device), "torch": torch.__version__, "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "calibration": calib, "configs": rows, "claims": check_claims(rows),
        "seconds": time.perf_counter() - t_start,
    }
    _dump(out / "summary.json", summary)
    print(json.dumps(summary["claims"], indent=1))
    print(f"summary: {out / 'summary.json'} ({summary['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
