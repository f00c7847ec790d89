"""ddpx's benchmark, the command `ddpx-bench` (or `python -m ddpx.bench`): ddpx against gloo and
the other CPU all-reduces on this machine. Its command line: ddpx.bench.cli; its modes, a file
each: ddpx.bench.mode."""
