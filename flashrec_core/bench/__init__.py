"""`flashrec bench`: synthetic-workload throughput benchmark with roofline and HF baseline."""

from flashrec_core.bench.run import BenchConfig, main_bench, run_bench

__all__ = ["BenchConfig", "main_bench", "run_bench"]
