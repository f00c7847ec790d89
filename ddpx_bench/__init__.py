"""ddpx's benchmark, the command `ddpx-bench` (or `python -m ddpx_bench`): ddpx against gloo and
the other CPU all-reduces on this machine. Its command line: ddpx_bench.cli; its modes, a file
each: ddpx_bench.mode. A package beside ddpx, installed with it, so that the runtime a hook user
imports holds no tool (its network testbed, ddpx_bench.testbed, included)."""
