"""DiffKV variants on an accuracy study's references and problems (run on the box after accuracy_study.sh):
fidelity and gsm_symbolic accuracy of each `name:high:low:alpha_high:alpha_low[:key=value,...]` (extra CacheConfig
settings, e.g. window=256), written to <out>/variants/<name>.json and carried back as $OUT/variants.tgz.

    python3 scripts/device/diffkv_variants.py --out /tmp/qout --task-n 600 prune_w256:K8V4:K8V4:0.1:0.1:window=256
"""
import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from diffkv_serve.engine.config import parse_settings
from evals.configs import KVConfig
from evals.fidelity import fidelity_prompts
from evals.harness import DEFAULT_MAX_TOKENS, evaluate_config
from evals.problems import load_problems
from evals.runner import EvalModel

EXTRA = {"window": int, "significance_queries": int, "key_centering": str}

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--out", type=Path, default=Path("/tmp/qout"))
ap.add_argument("--task-n", type=int, default=600)
ap.add_argument("--fidelity-n", type=int, default=64)
ap.add_argument("specs", nargs="+")
args = ap.parse_args()
refs = json.loads((args.out / "references.json").read_text())
model = EvalModel("qwen2.5-coder-1.5b", device="cuda", max_model_len=2048, max_num_seqs=256)
model.key_center = torch.tensor(json.loads((args.out / "key_center.json").read_text())["key_center"])
problems = load_problems(split="eval", tasks=("gsm_symbolic",), limit=args.task_n)
fid = fidelity_prompts(model, load_problems(split="fidelity", limit=args.fidelity_n))
(args.out / "variants").mkdir(exist_ok=True)
for spec in args.specs:
    name, high, low, ah, al, *rest = spec.split(":")
    extra = parse_settings("x:" + rest[0], EXTRA, "variant")[1] if rest else {}
    t0 = time.time()
    label = f"DiffKV {high}/{low} a_h={ah} a_l={al}" + "".join(f" {k}={v}" for k, v in extra.items())
    kvc = KVConfig(name, label, "diffkv", {"kv_mode": "diffkv", "high": high, "low": low, "alpha_high": float(ah),
                                           "alpha_low": float(al), **extra})
    r = evaluate_config(model, kvc, problems, fid, refs["fidelity"], {**DEFAULT_MAX_TOKENS, "gsm_symbolic": 512})
    (args.out / "variants" / f"{name}.json").write_text(json.dumps(r, indent=1))
    f, t = r["fidelity"], r["tasks"]["gsm_symbolic"]
    print(f"{name}: mem {t['memory_fraction']:.3f} top1 {f['top1_agreement']:.4f} acc {t['accuracy']:.4f} "
          f"tokens {t['token_fractions']} ({time.time() - t0:.0f} s)", flush=True)
    subprocess.run(["tar", "czf", f"{os.environ['OUT']}/variants.tgz", "-C", str(args.out), "variants"], check=True)
