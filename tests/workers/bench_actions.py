"""Run the throughput benchmark's stage processes with zero compute cost and write what every
stage executed (its spans) as JSON: the test checks the actions, not the time.

    python tests/workers/bench_actions.py OUT.json P M [M ...]
"""

import json
import sys

from paci_megatron.tools.bench_throughput import Bench, measure


def main(argv) -> int:
    out, num_stages, microbatches = argv[0], int(argv[1]), [int(m) for m in argv[2:]]
    bench = Bench(0.0, 0.0, 0.0, warmup=1, updates=2, tensor_side=4, timeout_s=60)
    runs = measure(num_stages, microbatches, bench)
    with open(out, "w") as f:
        json.dump([{"M": m, "kind": kind, "stages": repeats[0]}
                   for (m, kind), repeats in sorted(runs.items())], f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
