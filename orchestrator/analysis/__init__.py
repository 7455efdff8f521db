"""What stored rows say: medians with bootstrap intervals, comparisons of arms, runs, commits and
devices, acceptance criteria and nightly history. Pure functions over Arrow tables, never I/O
beyond reading the store. Start with `compare.py` (`compare_results`, what `orchestrate compare`
shows), then `stats.py` (the statistics every view shares) and `criteria.py` (the criterion
kinds and their registry, `KINDS`)."""
