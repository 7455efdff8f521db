"""The files users write, read and checked before anything starts: sweeps (cases, arms, parameter
axes, criteria) and host inventories, each problem one `InputError` line naming the file and the
field. Start with `sweep.py` (`SweepSpec`, `load_sweep`); `case.py` and `criterion.py` hold its
parts, `checks.py` what a sweep must satisfy on an inventory, `inventory.py` the hosts."""
