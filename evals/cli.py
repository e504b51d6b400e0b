"""Accuracy evaluation and calibration from the checkout: `python3 -m evals.cli eval | calibrate`. The engine
flags are diffkv_serve.engine.flags' (the serving CLI's); the serving package never imports this one."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from diffkv_serve.engine.flags import HelpFormatter, add_engine_flags, apply_threads, run_command
from evals.problems import TASKS


# The engine flags of an evaluation model (evals.runner.EvalModel); the cache flags are eval's alone, and an
# evaluation's subject is the DiffKV cache, so eval's --kv-mode defaults to diffkv.
MODEL_FLAGS = ("model", "device", "max_model_len", "max_num_seqs", "kv_cache_memory_gb", "threads")
MODEL_DEFAULTS = {"device": "auto", "max_model_len": 2048, "max_num_seqs": 64}
CACHE_FLAGS = ("kv_mode", "alpha_high", "alpha_low", "high", "low")


def add_model_args(p: argparse.ArgumentParser, cache: bool = False) -> None:
    add_engine_flags(p, only=MODEL_FLAGS + (CACHE_FLAGS if cache else ()),
                     defaults={**MODEL_DEFAULTS, **({"kv_mode": "diffkv"} if cache else {})})
    p.add_argument("--seed", type=int, default=0, help="the evaluation engine's seed")


def _eval_model(args):
    from evals.runner import EvalModel

    return EvalModel(args.model, device=args.device, max_model_len=args.max_model_len,
                     max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, cache=True)
    from evals.configs import baseline_configs

    p.add_argument("--config", default=None, choices=[c.name for c in baseline_configs(True)] + ["diffkv"],
                   help="a named configuration of docs/ACCURACY.md (else --kv-mode and the DiffKV options)")
    p.add_argument("--tasks", nargs="*", default=["chain_sum"], choices=TASKS, help="task accuracy on these")
    p.add_argument("--limit", type=int, default=20, help="problems per task (eval split)")
    p.add_argument("--max-tokens", type=int, default=None, help="generation limit per problem")
    p.add_argument("--fidelity", type=int, default=4, help="fidelity generations vs fp16 (0: none)")
    p.add_argument("--gen-len", type=int, default=128, help="tokens per fidelity generation")
    p.add_argument("--compare-fp16", action="store_true", help="also run fp16 on the problems: paired difference")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (else stdout)")


def _kv_config(args):
    from evals.configs import KVConfig, baseline_configs, diffkv_config

    if args.config == "diffkv" or (args.config is None and args.kv_mode == "diffkv"):
        kvc = diffkv_config(args.alpha_high, args.alpha_low)
        extra = {k: v for k, v in (("high", args.high), ("low", args.low)) if v is not None}
        return KVConfig(kvc.name, kvc.label, kvc.family, {**kvc.cache, **extra})
    if args.config is not None:
        return next(c for c in baseline_configs(True) if c.name == args.config)
    return KVConfig(args.kv_mode, args.kv_mode, "fp16" if args.kv_mode == "fp16" else "uniform",
                    {"kv_mode": args.kv_mode})


def cmd_eval(args) -> int:
    from evals.configs import baseline_configs
    from evals.fidelity import compare_to_fp16, fidelity_prompts, reference_generations
    from evals.harness import DEFAULT_MAX_TOKENS, evaluate_config
    from evals.problems import load_problems
    from evals.stats import paired_diff

    for name in ("limit", "fidelity", "gen_len", "max_num_seqs"):
        if getattr(args, name) < (0 if name == "fidelity" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'fidelity' else '>= 1'}")
    kvc = _kv_config(args)
    apply_threads(args)
    model = _eval_model(args)
    problems = load_problems(split="eval", tasks=tuple(args.tasks), limit=args.limit) if args.tasks else []
    max_tokens = {t: args.max_tokens for t in TASKS} if args.max_tokens else dict(DEFAULT_MAX_TOKENS)
    fp16 = baseline_configs()[0]
    prompts, refs, base = [], [], None
    if args.fidelity:
        prompts = fidelity_prompts(model, load_problems(split="fidelity", limit=args.fidelity))
        with model.engine(fp16.cache) as eng:
            refs = reference_generations(eng, prompts, args.gen_len)
    is_fp16 = kvc.cache == fp16.cache
    if refs or args.compare_fp16 or is_fp16:  # fp16's own NLL along its tokens is the base of the NLL increase
        base = evaluate_config(model, fp16, problems if args.compare_fp16 or is_fp16 else (), prompts, refs,
                               max_tokens)
    result = base if is_fp16 else evaluate_config(model, kvc, problems, prompts, refs, max_tokens)
    report = {"model": model.name, "device": args.device, "seed": args.seed, "config": result["cache"],
              "config_name": kvc.name, "seconds": result["seconds"]}
    if "tasks" in result:
        report["tasks"] = result["tasks"]
    if refs:
        report["fidelity"] = {**result["fidelity"], **compare_to_fp16(result["fidelity"], base["fidelity"]),
                              "fp16_nll": base["fidelity"]["nll"]}
    if args.compare_fp16 and problems:
        report["paired_vs_fp16"] = {}
        for task, t in result["tasks"].items():
            d = paired_diff(base["tasks"][task]["correct"], t["correct"])
            report["paired_vs_fp16"][task] = {"fp16_accuracy": base["tasks"][task]["accuracy"],
                                              "diff_points": 100 * d["mean"],
                                              "ci95_points": [100 * d["ci_low"], 100 * d["ci_high"]], "n": d["n"]}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--generations", type=int, default=32, help="calibration generations (calib split)")
    p.add_argument("--gen-len", type=int, default=256, help="tokens per calibration generation")
    p.add_argument("--criterion", choices=("tasks", "agreement"), default="tasks",
                   help="tasks: the most compressive precision pair and thresholds within --tolerance-points of "
                        "fp16's accuracy on the calib problems (evals/task_calibration.py); agreement: thresholds "
                        "by teacher-forced top-1 agreement (evals/calibrate.py)")
    p.add_argument("--tolerance-points", type=float, default=1.0, help="tasks: accuracy a point may lose vs fp16")
    p.add_argument("--min-agreement", type=float, default=None,
                   help="tasks: the chosen point's teacher-forced top-1 agreement floor (default 0.97; 0 turns it off)")
    p.add_argument("--pairs", nargs="+", default=None, metavar="HIGH/LOW",
                   help="tasks: precision pairs to sweep (default: K8V4/K4V2 K8V4/K4V4 K4V4/K4V2)")
    p.add_argument("--tolerance", type=float, default=0.01, help="agreement: top-1 agreement tolerance per stage")
    p.add_argument("--tasks", nargs="*", default=None, choices=TASKS,
                   help="calib-split tasks (default: gsm_symbolic by tasks; none, recorded only, by agreement)")
    p.add_argument("--limit", type=int, default=200, help="calibration problems per task")
    p.add_argument("--settings-dir", type=Path, default=None, help="default: the engine's model_settings package")
    p.add_argument("--dry-run", action="store_true", help="print the result, write no settings file")
    p.add_argument("--per-layer", action="store_true",
                   help="per-layer budgets (XKV): profile the calibration sequences and add per-layer multipliers "
                        "of the alphas to the settings file (the alphas are calibrated first if it has none)")


def cmd_calibrate(args) -> int:
    from evals.calibrate import calibrate, write_settings
    from evals.fidelity import fidelity_prompts, reference_generations
    from evals.problems import load_problems

    if args.generations < 1 or args.gen_len < 1:
        raise ValueError("--generations and --gen-len must be >= 1")
    apply_threads(args)
    model = _eval_model(args)
    prompts = fidelity_prompts(model, load_problems(split="calib", tasks=("gsm_symbolic",), limit=args.generations))
    with model.engine({"kv_mode": "fp16"}) as eng:
        refs = reference_generations(eng, prompts, args.gen_len)
    tasks = args.tasks if args.tasks is not None else (["gsm_symbolic"] if args.criterion == "tasks" else [])
    if args.criterion == "tasks" and not tasks:
        raise ValueError("--criterion tasks needs at least one task (--tasks)")
    problems = load_problems(split="calib", tasks=tuple(tasks), limit=args.limit) if tasks else []
    from diffkv_serve.engine.model_settings import SETTINGS_DIR, load_model_settings

    settings_dir = args.settings_dir or SETTINGS_DIR
    result = load_model_settings(model.name, settings_dir) if args.per_layer else None
    if result is None:
        from diffkv_serve.engine import key_centering
        from evals.key_center import center_summary, measure_key_centers

        # Keys are centered on what the calibration sequences measure, for the sweep and in the settings file.
        model.key_center = measure_key_centers(model, [p + r for p, r in zip(prompts, refs)])
        if args.criterion == "tasks":
            from evals.task_calibration import calibrate_on_tasks

            from evals.task_calibration import MIN_AGREEMENT, calib_pairs

            floor = MIN_AGREEMENT if args.min_agreement is None else (args.min_agreement or None)
            result = calibrate_on_tasks(model, problems, prompts, refs, tolerance_points=args.tolerance_points,
                                        pairs=calib_pairs(args.pairs), min_agreement=floor)
        else:
            result = calibrate(model, prompts, refs, problems, tolerance=args.tolerance)
        result.update({key_centering.SETTINGS_KEY: key_centering.to_settings(model.key_center),
                       "key_center_calibration": center_summary(model.key_center)})
    if args.per_layer:
        from evals.calibrate import calibrate_layers

        result = {**result, **calibrate_layers(model, prompts, refs, result["alpha_high"])}
    print(json.dumps({k: result[k] for k in ("model", "high", "low", "alpha_high", "alpha_low", "layer_alpha_scale")
                      if k in result}))
    if not args.dry_run:
        print(f"wrote {write_settings(result, settings_dir)}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m evals.cli", description="DiffKV accuracy evaluation and "
                                     "calibration (docs/ACCURACY.md)", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("eval", formatter_class=HelpFormatter,
                       help="task accuracy and fidelity vs the fp16 cache of one KV configuration (JSON)")
    add_eval_args(e)
    e.set_defaults(func=cmd_eval)
    c = sub.add_parser("calibrate", formatter_class=HelpFormatter,
                       help="calibrate alpha_high / alpha_low for a model and write its settings file")
    add_calibrate_args(c)
    c.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
