"""Load test: `mcore-rl serve` against the seed's FastAPI + transformers server, same model,
same requests, one server at a time, measured with locust (headless) in one run.

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/serve_load.py \
        [--model runs/quickstart/grpo/hf/step_60] [--users 1,10,50] [--spawn-rate 5] \
        [--seconds 60] [--max-tokens 16] [--dtype float32] [--plot docs/serving_latency.png]

MODEL defaults to the quickstart's newest export (run scripts/quickstart.sh first); prompts are
its held-out questions. Both servers answer greedily and only with the new tokens, so they do
the same work per request. For each user count (the seed's 50 users at 5 per second last) it
prints requests/s, p50/p95/p99 latency and the failure rate of both sides and the ratio of
requests/s, then draws latency and throughput against users (PNG).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _newest_export() -> Path | None:
    exports = sorted((REPO / "runs/quickstart/grpo/hf").glob("step_*"))
    return exports[-1] if exports else None


def _prompts(limit: int = 64) -> list[str]:
    path = REPO / "runs/quickstart/data/rl_val.jsonl"
    if not path.exists():
        return ["max 3 8 1"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["prompt"] for row in rows[:limit]]


def _start(command: list[str], port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{command[:4]} exited while starting; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.kill()
    sys.exit(f"{command[:4]} did not answer /health within 300 s; see {log}")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def _locust(port: int, users: int, args, prompts: list[str], prefix: Path) -> dict:
    """One headless locust run; its aggregated row."""
    env = dict(os.environ, SERVE_LOAD_PROMPTS=json.dumps(prompts),
               SERVE_LOAD_MAX_TOKENS=str(args.max_tokens))
    subprocess.run(["locust", "-f", str(REPO / "bench/locustfile.py"), "--headless",
                    "-u", str(users), "-r", str(args.spawn_rate), "-t", f"{args.seconds}s",
                    "-H", f"http://127.0.0.1:{port}", "--csv", str(prefix), "--only-summary",
                    "--loglevel", "WARNING"],
                   env=env, check=False, capture_output=True)
    with open(f"{prefix}_stats.csv") as handle:
        row = next(r for r in csv.DictReader(handle) if r["Name"] == "Aggregated")
    requests = int(row["Request Count"])
    return {"users": users, "rps": float(row["Requests/s"]), "p50": float(row["50%"]),
            "p95": float(row["95%"]), "p99": float(row["99%"]),
            "failures": int(row["Failure Count"]) / max(requests, 1), "requests": requests}


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(10, 4))
    for side, rows in results.items():
        users = [row["users"] for row in rows]
        latency.plot(users, [row["p50"] for row in rows], "o-", label=f"{side} p50")
        latency.plot(users, [row["p99"] for row in rows], "s--", label=f"{side} p99")
        throughput.plot(users, [row["rps"] for row in rows], "o-", label=side)
    latency.set(xlabel="concurrent users", ylabel="latency (ms)", yscale="log",
                title="latency vs users")
    throughput.set(xlabel="concurrent users", ylabel="requests/s", title="throughput vs users")
    for axes in (latency, throughput):
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=_newest_export(), help="HF folder to serve")
    parser.add_argument("--users", default="1,10,50", help="user counts, the last is the target")
    parser.add_argument("--spawn-rate", type=float, default=5, help="users started per second")
    parser.add_argument("--seconds", type=int, default=60, help="duration of each locust run")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per request")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights on both sides (bfloat16 on GPUs)")
    parser.add_argument("--plot", default="serve_latency.png", help="latency/throughput PNG")
    args = parser.parse_args()
    if args.model is None:
        sys.exit("no --model and no quickstart export: run bash scripts/quickstart.sh first")
    prompts = _prompts()
    user_counts = [int(value) for value in args.users.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="serve_load_"))
    sides = {
        "mcore-rl serve": (8600, [PYTHON, "-m", "mcore_rl", "serve", str(args.model), "--port",
                                  "8600", "--dtype", args.dtype, "--disable-uvicorn-access-log"]),
        "FastAPI+transformers": (8601, [PYTHON, str(REPO / "bench/transformers_server.py"),
                                        str(args.model), "--port", "8601", "--dtype",
                                        args.dtype]),
    }
    results = {}
    for side, (port, command) in sides.items():
        server = _start(command, port, scratch / f"{port}.log")
        try:
            results[side] = [_locust(port, users, args, prompts, scratch / f"{port}_{users}")
                             for users in user_counts]
        finally:
            _stop(server)
    print(f"model {args.model} ({args.dtype}), {args.max_tokens} new tokens at most, greedy, "
          f"{args.seconds} s per run, spawn rate {args.spawn_rate}/s; logs in {scratch}")
    print("| server | users | requests/s | p50 ms | p95 ms | p99 ms | failures | requests |")
    print("|---|---|---|---|---|---|---|---|")
    for side, rows in results.items():
        for row in rows:
            print(f"| {side} | {row['users']} | {row['rps']:.2f} | {row['p50']:.0f} | "
                  f"{row['p95']:.0f} | {row['p99']:.0f} | {row['failures']:.1%} | "
                  f"{row['requests']} |")
    ours, baseline = (results[side] for side in sides)
    for mine, theirs in zip(ours, baseline):
        print(f"{mine['users']} users: requests/s ratio (ours/baseline) "
              f"{mine['rps'] / max(theirs['rps'], 1e-9):.1f}x, p99 {mine['p99']:.0f} vs "
              f"{theirs['p99']:.0f} ms")
    _plot(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
