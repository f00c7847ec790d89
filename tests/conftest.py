"""Fixtures shared by the test modules, and the checks that CI runs after the default suite."""

import pytest

from distributed import RankPool

# Checks left out of the default suite (what every change runs, in minutes) that CI runs after it
# (`pytest -m ci`, in .ci/run): each guards something a change seldom touches, or is a larger
# variant of a check the default suite makes, and costs several seconds of a core, mostly
# importing torch in the processes it launches. Each entry is a file, a test (all its
# parameters), or, with "[", the parameters that start so; beside each, what still covers the
# behaviour in the default suite.
CI_ONLY = (
    # The build: the CUDA glue parsed against torch's headers, the kernels compiled with nvcc, a
    # second build that compiles nothing, the kernels for aarch64 under qemu (tools/arm_check.sh,
    # also in .ci/run, does the same).
    "tests/test_cuda.py::test_cuda_glue_has_no_compile_errors_of_its_own",
    "tests/test_cuda.py::test_cuda_source_compiles",
    "tests/tooling/test_build.py::"
    "test_a_second_build_compiles_nothing_and_leaves_the_loaded_extension",
    "tests/test_arm.py",
    # PyTorch's own distributed tests on ddpx (the default suite runs the backend's collectives
    # against gloo in tests/test_backend.py).
    "tests/test_torch_suite.py::test_representative_part_at_2_ranks",
    # More ranks than the default's 2: 8 ranks, and the 3- and 4-rank variants of checks the
    # default suite makes at 2.
    "tests/test_many_ranks.py::test_8_ranks_run_every_collective_exactly",
    "tests/test_engine.py::test_narrow_wide_timed_and_shared_steps_give_the_same_bits_and_agree[3]",
    "tests/test_arena.py::test_arena_all_reduces[4-",
    # Two network-namespace hosts running the docs' multi-node lines under torchrun and
    # Accelerate (test_multinode.py runs two nodes side by side, each rank forked with the
    # environment torchrun gives it).
    "tests/tooling/test_docs.py::test_a_multinode_command_of_the_docs_runs_on_two_hosts",
    # A second entry point or setting of a behaviour the default suite checks on another: the
    # stopped peer in the shared blocks (the script's launch stays), /dev/shm capped by a setting
    # (the tmpfs mount stays), mp.spawn with 2 threads (without OMP_NUM_THREADS stays),
    # accelerate launch with no config (the README's launch lines stay); the stopped peer under
    # the scripts' --backend ddpx (a rank that never calls, in tests/test_backend.py, and a silent
    # peer, in tests/test_engine.py, stay).
    "tests/test_timeouts.py::test_a_stopped_peer_raises_within_the_groups_timeout[shared-blocks]",
    "tests/test_timeouts.py::test_a_stopped_peer_raises_within_the_groups_timeout[script]",
    "tests/test_faults.py::test_a_dev_shm_too_small_falls_back_or_fails_strictly[cap-False]",
    "tests/test_threads.py::test_mp_spawn_without_omp_num_threads_gets_the_share[2]",
    "tests/test_scripts.py::"
    "test_accelerate_launch_without_a_config_says_at_once_that_it_runs_one_process",
    # basic.py on DDP's default all-reduce under accelerate launch (the README's line, on ddpx's
    # hook, and DDP's default on the ddpx backend stay); the help printed once under accelerate
    # launch, with checkpoint.py's docstring (a flag error printed once, and the other scripts'
    # docstrings in their help, stay).
    "tests/test_scripts.py::test_basic_two_processes[default]",
    "tests/test_scripts.py::test_help_is_printed_once",
    # basic.py under torchrun (under accelerate launch, and tests/distributed.py's torchrun
    # jobs, stay), the other scripts in one process (basic.py's stays), resuming a missing
    # checkpoint of the plain kind (Accelerate's state stays), the README's example under
    # TORCH_DISTRIBUTED_DEBUG (tests/test_backend_debug.py stays), a rank that never makes its
    # first call (a silent peer, in the same file, stays).
    "tests/test_scripts.py::test_basic_torchrun",
    "tests/test_scripts.py::test_single_process[checkpoint.py]",
    "tests/test_scripts.py::test_single_process[model_parallel.py]",
    "tests/test_scripts.py::test_resuming_a_missing_checkpoint_says_so_once[latest-plain]",
    "tests/tooling/test_readme.py::"
    "test_the_readme_example_runs_under_debug_detail_on_the_ddpx_backend",
    "tests/test_engine.py::test_a_rank_that_never_makes_its_first_call_is_named_within_the_timeout",
    # The Hugging Face Trainer on the ddpx backend and with the fused hook, one pair of launches,
    # and Lightning on the ddpx backend (Lightning with the fused hook's callback, and the
    # scripts on the backend, stay); a second job on the node at once (every test's own job shows
    # a segment per job).
    "tests/test_trainers.py::test_hf_trainer_on_the_ddpx_backend",
    "tests/test_trainers.py::test_lightning_on_the_ddpx_backend",
    "tests/test_trainers.py::test_hf_trainer_with_the_fused_hook",
    "tests/test_faults.py::test_two_jobs_at_once_each_get_their_own_sums",
    # torchft's replicas through a killed replica and its healing, and torchrun restarting killed
    # ranks (the engine's survivors going on in a smaller group, and a fresh group after an
    # abort, tests/test_recovery.py, stay).
    "tests/test_torchft.py::test_replicas_on_ddpx_train_through_a_killed_replica_and_heal_it",
    "tests/test_elastic.py::test_killed_ranks_restart_and_resume_to_the_same_parameters",
    # The benchmark's launches beside the peers, under load, several fresh launches, a killed
    # bench (on this machine and on the testbed), its collectives and train modes, and its
    # --quick run, as test_bench runs it and as the README's line does (test_bench's allreduce
    # run, and --quick's options checked without a launch, stay).
    "tests/tooling/test_bench.py::test_collectives",
    "tests/tooling/test_bench.py::test_train",
    "tests/tooling/test_bench.py::test_runs_are_fresh_launches_summed_up_by_median_and_worst",
    "tests/tooling/test_bench.py::test_allreduce_beside_the_peers_mpi_and_deepspeed",
    "tests/tooling/test_bench.py::"
    "test_allreduce_quick_measures_what_it_promises_and_says_it_was_quick",
    "tests/tooling/test_bench.py::test_load_runs_one_process_per_core_and_ends_with_the_run",
    "tests/tooling/test_bench.py::test_load_and_ranks_die_with_a_killed_bench",
    "tests/tooling/test_bench.py::"
    "test_a_killed_bench_on_the_testbed_takes_its_torchruns_and_ranks_with_it",
    "tests/tooling/test_readme.py::test_a_readme_command_runs_as_written"
    "[ddpx-bench allreduce --quick]",
)


def _ci_only(nodeid: str) -> bool:
    return any(nodeid.startswith(entry) if "[" in entry
               else nodeid == entry or nodeid.startswith((entry + "[", entry + "::"))
               for entry in CI_ONLY)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ci_only(item.nodeid):
            item.add_marker(pytest.mark.ci)


@pytest.fixture(scope="module")
def rank_pool():
    """``rank_pool(world_size, backend=..., env=..., group_timeout=...)``: a RankPool with those
    settings, started once and shared by the module's tests that ask for the same ones (spawning
    ranks and their group costs seconds per rank on 2 cores). One pool lives at a time: asking
    for other settings closes the last one, and the module's end closes it, so no idle ranks
    share the cores with the next module's processes."""
    live = {}

    def pool(world_size: int, backend: str = "gloo", env: dict | None = None,
             group_timeout: float | None = None) -> RankPool:
        key = (world_size, backend, tuple(sorted((env or {}).items())), group_timeout)
        if key not in live:
            for other in live.values():
                other.close()
            live.clear()
            live[key] = RankPool(world_size, backend, env, group_timeout)
        return live[key]

    yield pool
    for other in live.values():
        other.close()
