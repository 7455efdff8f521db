"""The host side of orchestrate: runs one job and returns typed rows.

Imports nothing from `orchestrator/`, typer or paramiko, so a worker host needs only this package,
`kernels/`, MLX, pyarrow, pydantic and NumPy.
"""
