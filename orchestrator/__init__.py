"""The head of orchestrate: CLI, specs, scheduling, the result store and analysis."""
