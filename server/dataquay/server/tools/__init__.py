"""What no daemon runs: a local cluster, fake trainers, the demo, benchmarks,
the load generator, the simulator and synthetic datasets."""
