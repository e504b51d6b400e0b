"""SM clock and power of the GPU while a benchmark runs, so that a result says whether the GPU ran at its power
cap: run back to back on an H200, the quantized decode-attention kernels hold it at its 700 W cap (SM clock
1.4-1.8 GHz instead of 1.98), while a 2 GiB device copy draws ~490 W at the full clock.

`PowerMonitor` polls `nvidia-smi` every `period_ms` in a background process; `window(t0, t1)` summarises the samples
taken between two `time.monotonic()` readings. Where there is no `nvidia-smi` (CPU, CI) it records nothing and every
window is None.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons bit: clocks lowered to stay under the power limit
FIELDS = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active"
OLD_FIELDS = "clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"  # drivers before 535


def parse_sample(line: str) -> tuple[float, float, float, int] | None:
    """(SM MHz, power W, power limit W, reasons bitmask) of one `--format=csv,noheader,nounits` line, or None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float, float, int]]) -> dict | None:
    """Median SM clock, median and peak power, the power limit and the share of samples at the power cap."""
    if not samples:
        return None
    mhz = [s[0] for s in samples]
    watts = [s[1] for s in samples]
    return {"samples": len(samples), "sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w": statistics.median(watts), "power_w_max": max(watts), "power_limit_w": samples[-1][2],
            "power_capped": sum(1 for s in samples if s[3] & SW_POWER_CAP) / len(samples)}


class PowerMonitor:
    """with PowerMonitor() as mon: t0 = time.monotonic(); work(); mon.window(t0, time.monotonic())"""

    def __init__(self, period_ms: int = 20, gpu: int = 0):
        self.period_ms, self.gpu = period_ms, gpu
        self.samples: list[tuple[float, tuple[float, float, float, int]]] = []  # (monotonic time, sample)
        self._proc = None
        self._thread = None

    def __enter__(self) -> "PowerMonitor":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        for fields in (FIELDS, OLD_FIELDS):
            probe = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                                    str(self.gpu)], capture_output=True, text=True)
            if probe.returncode == 0 and parse_sample(probe.stdout.strip().splitlines()[0]) is not None:
                break
        else:
            return self  # this driver answers neither field list: no samples
        self._proc = subprocess.Popen([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                                       str(self.gpu), f"-lms={self.period_ms}"], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            s = parse_sample(line)
            if s is not None:
                self.samples.append((time.monotonic(), s))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> dict | None:
        """The samples taken in [t0, t1] (time.monotonic()), summarised; None where none were taken."""
        return summarize([s for t, s in self.samples if t0 <= t <= t1])
