#!/usr/bin/env bash
# Builds the Dockerfile for real with podman on a machine with no registry access for base
# images, then runs the image and checks what a platform team would: it starts as uid 10001,
# answers /readyz, sends a write then replays it, stops cleanly within --stop-timeout, keeps
# the record on its volume across a restart, and runs with a read-only root filesystem.
#
# The base images are stand-ins made here and tagged as the Dockerfile names them:
#   debian:bookworm-slim      debootstrap --variant=minbase bookworm, imported
#   rust:1.95-slim-bookworm   that image + ca-certificates gcc libc6-dev + this host's rustup
#                             toolchain (the one `rustc --version` here reports)
# Needs root, Debian's podman + runc (crun refuses this machine's cgroup layout) and debootstrap:
#   apt-get install -y podman runc debootstrap
# Usage: deploy/image-smoke.sh   (docs/decisions/0049 records a run)
set -euo pipefail
cd "$(dirname "$0")/.."
work="${WORK:-/tmp/oncegate-image}"
mkdir -p "$work"
podman() { command podman --runtime runc --cgroup-manager cgroupfs "$@"; }

if ! podman image exists docker.io/library/debian:bookworm-slim; then
  [ -d "$work/rootfs/usr" ] || debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian
  tar -C "$work/rootfs" -c . | podman import - docker.io/library/debian:bookworm-slim
fi
if ! podman image exists docker.io/library/rust:1.95-slim-bookworm; then
  toolchain="$(rustc --print sysroot)"
  rm -rf "$work/rust" && mkdir -p "$work/rust" && cp -a "$toolchain" "$work/rust/toolchain"
  # This host's CA bundle: where TLS to crates.io is intercepted, the builder trusts what the
  # host trusts (the real rust image would need the same on such a network).
  cp /etc/ssl/certs/ca-certificates.crt "$work/rust/host-ca.crt"
  cat > "$work/rust/Containerfile" <<'EOF'
FROM docker.io/library/debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
COPY toolchain /usr/local/rust
ENV PATH=/usr/local/rust/bin:$PATH CARGO_HOME=/usr/local/cargo
EOF
  podman build --network host -t docker.io/library/rust:1.95-slim-bookworm "$work/rust"
fi

start=$(date +%s)
podman build --network host -t oncegate:1.0 .
echo "image built in $(( $(date +%s) - start )) s: $(podman image inspect oncegate:1.0 --format '{{.Size}}') bytes"

# A config as the README's Docker section says, an upstream on the host.
cfg="$work/config.toml"
cat > "$cfg" <<'EOF'
[server]
listen = "127.0.0.1:18180"
[admin]
listen = "127.0.0.1:18181"
token_env = "ONCEGATE_ADMIN_TOKEN"
[store]
path = "/var/lib/oncegate/store"
[[upstreams]]
name = "pay"
prefix = "/pay"
url = "http://127.0.0.1:18182"
EOF
chmod 0644 "$cfg"
python3 -c '
import http.server
class H(http.server.BaseHTTPRequestHandler):
    n = 0
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        H.n += 1
        b = b"{\"id\":\"ch_%d\"}" % H.n
        self.send_response(200); self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 18182), H).serve_forever()' &
upstream=$!
trap 'kill $upstream 2>/dev/null; podman rm -f og-smoke >/dev/null 2>&1 || true' EXIT
podman volume rm -f og-smoke-data >/dev/null 2>&1 || true
run() {
  # runc cannot raise the open-files and process limits past the host's hard limits.
  podman run -d --name og-smoke --network host --read-only --stop-timeout 40 --ulimit nofile=16384:16384 --ulimit nproc=4096:4096 \
    -e ONCEGATE_ADMIN_TOKEN=smoke-token-0123456789 \
    -v "$cfg:/etc/oncegate/config.toml:ro" -v og-smoke-data:/var/lib/oncegate oncegate:1.0 >/dev/null
  for _ in $(seq 1 50); do curl -fs http://127.0.0.1:18181/readyz >/dev/null && return; sleep 0.2; done
  podman logs og-smoke; exit 1
}
run
echo "user: $(podman exec og-smoke id -u):$(podman exec og-smoke id -g)"
write() { curl -s -o /dev/null -D - -X POST -H 'idempotency-key: smoke-1' -d amount=5 http://127.0.0.1:18180/pay/v1/charges | grep -i '^oncegate-outcome' | tr -d '\r'; }
echo "first:  $(write)"
echo "again:  $(write)"
t0=$(date +%s); podman stop og-smoke >/dev/null; echo "stop: $(( $(date +%s) - t0 )) s, exit $(podman inspect og-smoke --format '{{.State.ExitCode}}')"
podman rm og-smoke >/dev/null
run
echo "after a restart: $(write)"
podman exec og-smoke oncegate check --config /etc/oncegate/config.toml >/dev/null && echo "check: ok"
podman stop og-smoke >/dev/null
