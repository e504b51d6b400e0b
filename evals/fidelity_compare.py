"""Teacher-forced fidelity of a few KV configurations on the study's fidelity set, each against the fp16 cache
and against one baseline configuration (paired over generations): is a setting as accurate as the baseline?
No calibration and no task problems, so it takes minutes where the study takes half an hour.

A configuration is a study name (fp16, k8v8, k4v4, k8v4, ...; `diffkv` = the model's calibrated settings),
`uniform:KxVy`, or `diffkv:alpha_high=A,alpha_low=B[,high=KxVy][,low=KxVy]` (evals.configs.parse_config).
Each configuration's row is written to --out as soon as it is measured, so a run cut short keeps what it did.

Usage: python -m evals.fidelity_compare --configs diffkv diffkv:alpha_high=4,alpha_low=0.06 --baseline k4v4 \
           --out evals/results/smollm2-135m/fidelity_compare.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from evals.configs import baseline_configs, parse_config
from evals.fidelity import compare_to_fp16, fidelity_prompts, reference_generations
from evals.harness import evaluate_config
from evals.problems import load_problems
from evals.runner import EvalModel
from diffkv_serve.engine.flags import add_engine_flags


def _summary(result: dict, fp16: dict, baseline: dict | None) -> dict:
    f = result["fidelity"]
    out = {"label": result["label"], "cache": result["cache"], "memory_fraction": f["memory_fraction"],
           "top1_agreement": f["top1_agreement"], "nll": f["nll"], "token_fractions": f["token_fractions"],
           "vs_fp16": compare_to_fp16(f, fp16["fidelity"]), "seconds": result["seconds"]}
    if baseline is not None:  # the same paired statistics with the baseline in fp16's place
        out["vs_baseline"] = compare_to_fp16(f, baseline["fidelity"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(ap, only=("model", "device", "max_model_len", "max_num_seqs", "kv_cache_memory_gb", "threads"),
                     defaults={"device": "cpu", "max_model_len": 2048, "max_num_seqs": 256, "kv_cache_memory_gb": 3.0})
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--baseline", default="k4v4", help="configuration each one is also compared with")
    ap.add_argument("--fidelity-n", type=int, default=12, help="generations (the recorded study's 12)")
    ap.add_argument("--gen-len", type=int, default=96, help="tokens per generation (the recorded study's 96)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        configs = {c.name: c for c in map(parse_config, [args.baseline] + args.configs)}
    except ValueError as e:
        ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model = EvalModel(args.model, device=args.device, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)
    prompts = fidelity_prompts(model, load_problems(split="fidelity", limit=args.fidelity_n))
    with model.engine({"kv_mode": "fp16"}) as eng:
        refs = reference_generations(eng, prompts, args.gen_len)
    fp16 = evaluate_config(model, baseline_configs()[0], (), prompts, refs)
    base_name = parse_config(args.baseline).name
    out = {"benchmark": "fidelity_compare", "model": model.name, "device": args.device,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "command": "python -m evals.fidelity_compare " + " ".join(sys.argv[1:] if argv is None else argv),
           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "baseline": args.baseline,
           "fp16_nll": fp16["fidelity"]["nll"], "configs": {}, "seconds": None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    print(f"{'config':>44} {'memory':>7} {'top-1':>7} {'NLL':>7} {'vs fp16 pts [95% CI]':>24} "
          f"{'vs ' + args.baseline:>24}")
    for name, kvc in configs.items():  # the baseline first: every later row is compared with it
        results[name] = evaluate_config(model, kvc, (), prompts, refs)
        base = results[base_name]
        r = out["configs"][name] = _summary(results[name], fp16, base if name != base_name else None)
        v, b = r["vs_fp16"], r.get("vs_baseline")
        vb = (f"{100 * b['agreement_change']:+.2f} [{100 * b['agreement_change_ci'][0]:+.2f}, "
              f"{100 * b['agreement_change_ci'][1]:+.2f}]") if b else "-"
        print(f"{name:>44} {100 * r['memory_fraction']:6.1f}% {r['top1_agreement']:7.4f} {r['nll']:7.4f} "
              f"{100 * v['agreement_change']:+7.2f} [{100 * v['agreement_change_ci'][0]:+.2f}, "
              f"{100 * v['agreement_change_ci'][1]:+.2f}] {vb:>24}", flush=True)
        out["seconds"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")  # a cut run keeps what it measured
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
