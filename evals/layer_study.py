"""Per-layer budgets (XKV multipliers) against one global alpha at equal KV memory, on fidelity:

    python3 -m evals.layer_study --device cpu --threads 1 --out evals/results/smollm2-135m

1. the multipliers from the calibration split (`python3 -m evals.cli calibrate --per-layer`'s procedure) at the model's
   calibrated alphas;
2. DiffKV with them on the fidelity set (teacher forced against the fp16 generations of evals.study's
   references.json when they match, else new ones): its KV memory M;
3. one global alpha_high over a grid (one batch, per-request thresholds), then the global alpha that uses M
   (log-interpolated between the grid points around M, measured) as the equal-memory baseline;
4. per_layer.json (per_layer_ah<x>.json for --alpha-high x): both with the paired difference over generations; `python3 -m evals.report` renders it.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from evals.calibrate import calibrate_layers
from evals.fidelity import compare_to_fp16, fidelity_prompts, reference_generations, score_fidelity, \
    teacher_forced_requests
from evals.problems import load_problems
from evals.runner import EvalModel, run_requests
from evals.stats import paired_diff
from diffkv_serve.engine.flags import add_engine_flags

GLOBAL_GRID = (3.0, 4.0, 5.0, 6.0)


def _fidelity(model, eng, prompts, refs, points: list[dict], desc: str) -> list[dict]:
    """Fidelity of each point ({"alpha_high", "alpha_low"} per request) in one batch of one engine."""
    reqs = [r for kv in points for r in teacher_forced_requests(prompts, refs, kv)]
    outs = run_requests(eng, reqs, desc)
    n = len(refs)
    res = []
    for i, kv in enumerate(points):
        cache = eng.config.cache.model_copy(update=kv)
        res.append({**kv, **score_fidelity(cache, model.head_dim, refs, outs[i * n:(i + 1) * n], desc)})
    return res


def _alpha_at_memory(points: list[dict], memory: float) -> float:
    """The alpha_high whose memory is `memory`, log-linear between the two grid points around it."""
    pts = sorted(points, key=lambda p: p["alpha_high"])
    for a, b in zip(pts, pts[1:]):
        hi, lo = a["memory_fraction"], b["memory_fraction"]  # memory falls as alpha grows
        if lo <= memory <= hi and hi > lo:
            t = (hi - memory) / (hi - lo)
            return math.exp(math.log(a["alpha_high"]) + t * (math.log(b["alpha_high"]) - math.log(a["alpha_high"])))
    raise ValueError(f"memory {memory:.4f} is outside the global grid's range "
                     f"{[round(p['memory_fraction'], 4) for p in pts]}: widen --global-grid")


def _row(f: dict, base: dict) -> dict:
    keep = ("alpha_high", "alpha_low", "n_generations", "gen_tokens", "top1_agreement", "nll", "memory_fraction",
            "token_fractions", "per_generation")
    return {**{k: f[k] for k in keep if k in f}, **compare_to_fp16(f, base)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # --alpha-high: another operating point than the calibrated one (writes per_layer_ah<value>.json)
    add_engine_flags(ap, only=("model", "device", "max_num_seqs", "kv_cache_memory_gb", "max_model_len", "threads",
                               "alpha_high"),
                     defaults={"device": "auto", "max_num_seqs": 128, "kv_cache_memory_gb": 3.0, "max_model_len": 2048})
    ap.add_argument("--out", type=Path, required=True, help="the model's results folder (evals.study's --out)")
    ap.add_argument("--fidelity-n", type=int, default=12)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--calib-n", type=int, default=16, help="calibration sequences profiled")
    ap.add_argument("--calib-gen-len", type=int, default=64, help="fp16 continuation of each, profiled too")
    ap.add_argument("--global-grid", type=float, nargs="+", default=list(GLOBAL_GRID))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = EvalModel(args.model, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      kv_cache_memory_gb=args.kv_cache_memory_gb, seed=args.seed)
    from diffkv_serve.engine.model_settings import load_model_settings

    settings = load_model_settings(model.name)
    if settings is None:
        raise SystemExit(f"{model.name} has no settings file: run `python3 -m evals.cli calibrate` first")
    ah, al = settings["alpha_high"], settings["alpha_low"]
    if args.alpha_high is not None:
        if args.alpha_high < al:
            raise ValueError(f"--alpha-high {args.alpha_high} is below the calibrated alpha_low {al}")
        ah = args.alpha_high
    fid = fidelity_prompts(model, load_problems(split="fidelity", limit=args.fidelity_n))
    cal = fidelity_prompts(model, load_problems(split="calib", tasks=("gsm_symbolic",), limit=args.calib_n))
    ref_path = args.out / "references.json"
    recorded = json.loads(ref_path.read_text()) if ref_path.is_file() else {}
    refs = recorded.get("fidelity")
    reused = bool(refs) and len(refs) == len(fid) and all(len(r) == args.gen_len for r in refs)
    with model.engine({"kv_mode": "fp16"}) as eng:
        if not reused:
            refs = reference_generations(eng, fid, args.gen_len)
        cal_refs = reference_generations(eng, cal, args.calib_gen_len)
        base = _fidelity(model, eng, fid, refs, [{}], "fp16")[0]

    layers = calibrate_layers(model, cal, cal_refs, ah)
    print("multipliers:", [round(s, 3) for s in layers["layer_alpha_scale"]])
    point = {"alpha_high": ah, "alpha_low": al}
    with model.engine({"kv_mode": "diffkv", "layer_alpha_scale": layers["layer_alpha_scale"]}) as eng:
        per_layer = _fidelity(model, eng, fid, refs, [point], "per-layer")[0]
    mem = per_layer["memory_fraction"]
    print(f"per-layer: memory {mem:.4f}, top-1 {per_layer['top1_agreement']:.4f}, NLL {per_layer['nll']:.4f}")
    with model.engine({"kv_mode": "diffkv", "layer_alpha_scale": None}) as eng:
        grid = _fidelity(model, eng, fid, refs, [{"alpha_high": a, "alpha_low": al} for a in args.global_grid],
                         "global grid")
        a_eq = round(_alpha_at_memory(grid, mem), 3)
        equal = _fidelity(model, eng, fid, refs, [{"alpha_high": a_eq, "alpha_low": al}], "global equal memory")[0]
    print(f"global alpha_high={a_eq}: memory {equal['memory_fraction']:.4f}, top-1 {equal['top1_agreement']:.4f}, "
          f"NLL {equal['nll']:.4f}")
    pl, eq = per_layer["per_generation"], equal["per_generation"]
    agree = paired_diff([g["agree"] for g in eq], [g["agree"] for g in pl])
    nll = paired_diff([g["nll"] for g in eq], [g["nll"] for g in pl])
    result = {
        "model": model.name, "device": str(args.device), "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "references_reused": reused, "alpha_high": ah, "alpha_low": al, **layers,
        "fp16_nll": base["nll"], "per_layer": _row(per_layer, base), "global_equal_memory": _row(equal, base),
        "global_grid": [_row(g, base) for g in grid],
        "per_layer_minus_global": {"agreement": agree["mean"], "agreement_ci": [agree["ci_low"], agree["ci_high"]],
                                   "nll": nll["mean"], "nll_ci": [nll["ci_low"], nll["ci_high"]],
                                   "memory": mem - equal["memory_fraction"]},
        "seconds": time.perf_counter() - t0,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("per_layer.json" if args.alpha_high is None else f"per_layer_ah{args.alpha_high:g}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["per_layer_minus_global"], indent=1))
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
