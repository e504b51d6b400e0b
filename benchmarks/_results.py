"""Where benchmark scripts write their JSON: --out, else benchmarks/results/<name>_<device>.json."""
from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path
from typing import Optional

import torch

RESULTS = Path(__file__).parent / "results"


def gpu_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100' (file names)."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    return m[1] if m else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def write_result(result: dict, name: str, device: str, out: Optional[str], smoke: bool) -> Path:
    path = Path(out) if out else RESULTS / f"{name}_{'smoke' if smoke else gpu_tag(device)}.json"
    result.setdefault("date", datetime.date.today().isoformat())  # docs/PERFORMANCE.md dates each table
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def record_sweep(name: str, argv: Optional[list[str]], args, rows: list, cuda: bool) -> None:
    """The JSON of a kernel sweep (decode_merge.py, decode_splits.py): device, torch, the command line, the flags
    and the rows; written where --out says, or under results/ when it ran on a GPU."""
    device = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"benchmark": name, "device": device, "torch": torch.__version__,
              "command": f"python benchmarks/{name}.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": vars(args), "rows": rows}
    if args.out or cuda:
        write_result(result, name, device, args.out, args.smoke)
