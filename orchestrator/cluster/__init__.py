"""The machines a sweep runs on: hosts reached over SSH, made Ray worker nodes of a head, checked,
installed and probed, and their spooled results collected. Start with `lifecycle.py`
(`orchestrate cluster up|down|status`); `ssh.py` is the one interface to a host (`RemoteShell`),
`target.py` says where a host is."""
