"""The result store: hive-partitioned Parquet that any reader opens directly, written atomically
one fragment per job, read through DuckDB, compacted per partition. Start with `fragments.py`
(`ResultStore`: the layout, writes and listing), then `dataset.py` (`read_rows`, how every
reader gets its rows) and `scan.py` (the DuckDB view over the files)."""
