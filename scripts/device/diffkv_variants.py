"""DiffKV precision / threshold variants on the accuracy study's references (run after accuracy_study.sh on the
box): fidelity and gsm_symbolic accuracy for each `name:high:low:alpha_high:alpha_low`, written to $OUT."""
import json
import os
import sys
import time
from pathlib import Path

import torch

from evals.configs import KVConfig
from evals.fidelity import fidelity_prompts
from evals.harness import DEFAULT_MAX_TOKENS, evaluate_config
from evals.problems import load_problems
from evals.runner import EvalModel

out = Path("/tmp/qout")
refs = json.loads((out / "references.json").read_text())
model = EvalModel("qwen2.5-coder-1.5b", device="cuda", max_model_len=2048, max_num_seqs=256)
model.key_center = torch.tensor(json.loads((out / "key_center.json").read_text())["key_center"])
problems = load_problems(split="eval", tasks=("gsm_symbolic",), limit=300)
fid = fidelity_prompts(model, load_problems(split="fidelity", limit=64))
for spec in sys.argv[1:]:
    name, high, low, ah, al = spec.split(":")
    t0 = time.time()
    kvc = KVConfig(name, f"DiffKV {high}/{low} a_h={ah} a_l={al}", "diffkv",
                   {"kv_mode": "diffkv", "high": high, "low": low, "alpha_high": float(ah), "alpha_low": float(al)})
    r = evaluate_config(model, kvc, problems, fid, refs["fidelity"], {**DEFAULT_MAX_TOKENS, "gsm_symbolic": 512})
    (out / "configs" / f"{name}.json").write_text(json.dumps(r, indent=1))
    f, t = r["fidelity"], r["tasks"]["gsm_symbolic"]
    print(f"{name}: mem {f['memory_fraction']:.3f} top1 {f['top1_agreement']:.4f} acc {t['accuracy']:.4f} "
          f"tokens {f['token_fractions']} ({time.time() - t0:.0f} s)", flush=True)
os.system(f"tar czf {os.environ['OUT']}/variants.tgz -C /tmp qout/configs")
