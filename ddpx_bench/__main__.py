from ddpx_bench.cli import main

if __name__ == "__main__":  # not in the ranks that torch.multiprocessing spawns
    main()
