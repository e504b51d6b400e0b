"""Accuracy evaluation of DiffKV Serve: task accuracy and fidelity against the fp16 cache, compression
baselines through the same engine and pages, per-model calibration of alpha_high / alpha_low, and the
report (docs/ACCURACY.md). See `python3 -m evals.study --help` and `python3 -m evals.cli eval --help`."""
