"""Mixed vs uniform response lengths through the sampler server's HTTP API, with its default flags.

A server subprocess (``python -m pdm_jax.sampler.server`` with only the required flags: a random
init of a d 64 / 2-layer / V 256 Qwen3, and so the defaults a user starting it by hand gets:
``--batching`` continuous, fp8 weights, ``--max_batch_size`` 64) answers `SamplerClient.generate`
requests of ``--prompts`` prompts x n = ``--n`` rows (256 by default), temperature 1, top-20
log-probs:

* **mixed**: 4 stop ids of the 256 (a random init's next-token distribution is near uniform, so a
  row stops with probability ~1/64 per token): geometric lengths, mean ~64, up to ``--max_new`` = 256;
* **uniform**: no stop ids, exactly ``--uniform_len`` = 64 new tokens per row.

Useful tokens/s = completion tokens (the mask's sum) / wall time of the request, the median over
``--rounds`` rounds (each round times mixed and uniform back to back, in alternating order) after
one compile round. Printed: mixed / uniform (the target: >= 0.6) with a distribution-free 95%
interval of its median (order statistics of the per-round ratios), on the quiet machine and then
with ``--busy`` busy processes (a spinning Python loop each) beside the server, in one run. A
request takes under a second here, so single rounds scatter (0.5-0.8); 31 rounds (the default)
give an interval of about +-0.03.

    python bench/bench_server_batching.py [--rounds 31 --busy 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench_stats import median_ci95  # noqa: E402  (bench/ is sys.path[0] when run as a script)
from pdm_jax.rollouts.client import SamplerClient  # noqa: E402

MODEL = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
             intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)


def start_server(tmp: str) -> tuple:
    cfg = os.path.join(tmp, "config.json")
    with open(cfg, "w") as f:
        json.dump(MODEL, f)
    port_file = os.path.join(tmp, "port")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdm_jax.sampler.server", "--model_config", cfg,
                             "--checkpoint_root", tmp, "--port_file", port_file], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(f"the server did not come up; its log: {open(log.name).read()[-3000:]}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{int(open(port_file).read())}"


def measure(client, args, rounds: int) -> list:
    """Per round: (mixed tokens/s, uniform tokens/s)."""
    prompts = [[(7 * i + j) % 200 + 10 for j in range(16)] for i in range(args.prompts)]
    stops = list(range(252, 256))
    runs = {"mixed": dict(max_new_tokens=args.max_new, stop_token_ids=stops),
            "uniform": dict(max_new_tokens=args.uniform_len, stop_token_ids=[])}
    out = []
    for r in range(rounds):
        got = {}
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            t0 = time.perf_counter()
            batch = client.generate(prompts, n=args.n, temperature=1.0, top_k_logprobs=20, seed=r, **runs[name])
            got[name] = float(batch.completion_mask.sum()) / (time.perf_counter() - t0)
        out.append((got["mixed"], got["uniform"]))
    return out


def report(label: str, rounds: list) -> None:
    ratios = [m / u for m, u in rounds]
    mixed, uniform = statistics.median(m for m, _ in rounds), statistics.median(u for _, u in rounds)
    low, high = median_ci95(ratios)
    print(f"{label:>22s}: mixed {mixed:8.0f} tok/s, uniform {uniform:8.0f} tok/s, mixed / uniform "
          f"{statistics.median(ratios):.2f}x (95% interval of the median {low:.2f}-{high:.2f}; "
          f"{len(ratios)} rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max_new", type=int, default=256)
    ap.add_argument("--uniform_len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the server in the second part")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdm_bench_server_") as tmp:
        proc, url = start_server(tmp)
        busy = []
        try:
            client = SamplerClient(url, timeout_s=1800)
            t0 = time.perf_counter()
            measure(client, args, 1)  # compiles both shapes' programs
            print(f"server at {url}: default flags, {args.prompts} prompts x n {args.n} rows; CPU x{os.cpu_count()}; "
                  f"first round (compiles) {time.perf_counter() - t0:.1f} s", flush=True)
            report("quiet", measure(client, args, args.rounds))
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
            report(f"{args.busy} busy process(es)", measure(client, args, args.rounds))
        finally:
            for b in busy:
                b.kill()
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
