#!/usr/bin/env bash
# Installs a real OpenSSH server/client for the test suite. Safe to re-run:
# each step is skipped when its result is already present.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

if [ ! -x /usr/sbin/sshd ]; then
    $SUDO apt-get update
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y openssh-server openssh-client
fi

# sshd refuses to start without its privilege-separation directory, which
# containers usually lack because nothing ran the systemd tmpfiles setup.
if [ ! -d /run/sshd ]; then
    $SUDO mkdir -p /run/sshd
    $SUDO chmod 0755 /run/sshd
fi

/usr/sbin/sshd -V 2>&1 || true
