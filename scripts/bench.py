"""The benchmark in a checkout: `python scripts/bench.py MODE ...` is `ddpx-bench MODE ...`
(ddpx.bench; `--help` says what it measures)."""

from ddpx.bench.cli import main

if __name__ == "__main__":
    main()
