"""One-off investigations: scripts written to find the cause of one benchmark miss (BENCHMARKS.md,
"One-off investigations"). They import the harnesses in `benchmarks/`."""
