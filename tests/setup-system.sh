#!/usr/bin/env bash
# Installs the Debian packages the test suite needs (real sshd, headless Chromium), once.
# Idempotent: does nothing when everything is already there. Needs root or passwordless sudo.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [[ -x /usr/sbin/sshd ]] || need+=(openssh-server)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v flock >/dev/null 2>&1 || need+=(util-linux)
command -v setsid >/dev/null 2>&1 || need+=(util-linux)
command -v ps >/dev/null 2>&1 || need+=(procps)  # tests/workers/probe_head.py lists processes as a user would
if ((${#need[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo -n"
  echo "setup-system: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
