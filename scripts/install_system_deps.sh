#!/usr/bin/env bash
# Installs the system libraries the Mooncake Transfer Engine loads even for TCP
# (libibverbs.so.1, libnuma.so.1), and the openssl command the TLS tests use. Only acts when root
# and something is missing.
set -euo pipefail
missing=()
ldconfig -p | grep -q 'libibverbs.so.1 ' || missing+=(libibverbs1)
ldconfig -p | grep -q 'libnuma.so.1 ' || missing+=(libnuma1)
# The TLS tests make their certificates with the openssl command.
command -v openssl >/dev/null || missing+=(openssl)
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "warning: missing ${missing[*]} (needed by the mooncake backend / the TLS tests); run as root or install them" >&2
  exit 0
fi
echo "installing ${missing[*]} with apt-get" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
