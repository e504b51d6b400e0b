"""The soak test, short: loadtest/soak.py for 90 s against its own Ray + Serve (2 engine replicas, embedded
model, CPU, loopback), one replica killed at 40%. Nothing lost, no 5xx but 503, bad requests all 400, every KV
page free at the end (read from the metrics endpoint), and Serve replaced the killed replica."""
import json
import subprocess
import sys

from _ops import REPO, load

report_mod = load("loadtest/soak_report.py", "soak_report")

DURATION_S = 90


def test_soak_90s_loses_nothing_and_replaces_the_killed_replica(tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    cmd = [sys.executable, str(REPO / "loadtest/soak.py"), "--duration", str(DURATION_S), "--capacity-s", "10",
           "--max-tokens", "16", "--sample-period", "2", "--request-timeout", "60", "--drain-timeout", "30",
           "--out", str(out), "--png", str(png)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-5000:]
    report = json.loads(out.read_text())
    inv, s = report["invariants"], report["summary"]
    assert p.returncode == (0 if inv["ok"] else 1), p.stderr[-3000:]

    # every request has exactly one outcome, and nothing was lost
    requests = report_mod.requests_of(report)
    assert len(requests) == s["sent"] == sum(s["outcomes"].values()) == sum(s["status_counts"].values())
    assert all(r["outcome"] is not None and r["t_end"] >= r["t_send"] for r in requests)
    assert s["outcomes"]["lost"] == 0, s["lost"]
    assert inv["nothing_lost"] is True
    # the only 5xx is 503 (a replica that died under a request)
    assert s["status_counts"]["other_5xx"] == 0 and s["status_counts"]["none"] == sum(
        r["outcome"] == "disconnected" and r["status"] == 0 for r in requests)
    assert inv["no_other_5xx"] is True
    # bad requests: all 400 with OpenAI's error body; no valid request got a 400
    assert s["bad_requests"]["sent"] > 0 and s["bad_requests"]["answered_400"] == s["bad_requests"]["sent"]
    assert inv["bad_requests_all_400"] is True and inv["valid_requests_never_400"] is True
    # the mix really ran: completions, and the client's own disconnects
    assert s["outcomes"]["completed"] >= 10 and s["outcomes"]["disconnected"] >= 1
    assert s["outcomes_by_kind"]["disconnect"]["disconnected"] >= 1
    # the pages gauge of every live engine replica reads 0 used of > 0 after the load, nothing in flight
    end = report["pages_at_end"]
    assert end["all_free"] is True and inv["pages_all_free_at_end"] is True
    assert len(end["replicas"]) == 2 and end["in_flight"] == 0
    assert all(p["used"] == 0 and p["total"] > 0 for p in end["replicas"].values())
    # the killed replica: gone, and a new one serving in its place
    kill = report["kill"]
    assert kill is not None and 0 < kill["t"] < DURATION_S
    assert kill["replaced_by"] not in (None, kill["replica"]) and kill["replica"] not in end["replicas"]
    assert kill["replaced_by"] in end["replicas"] and inv["killed_replica_replaced"] is True
    # RSS was sampled for both engine replicas, their replacement and the ingress
    procs = {(p["deployment"], p["replica"]) for p in report["rss"]["processes"]}
    assert {r for d, r in procs if d == "EngineReplica"} >= set(kill["replicas_before"]) | {kill["replaced_by"]}
    assert any(d == "OpenAIIngress" for d, _ in procs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
