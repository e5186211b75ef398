#!/usr/bin/env bash
# The OCI image (deploy/image/build.sh) as a cluster runs it:
#   1. builds it from build/packages/gradsyncd_*.deb into a scratch buildah store (the debootstrap
#      rootfs comes from the cache: fetched once), or takes a built OCI archive;
#   2. its configuration: a numeric non-root user, the entrypoint, the labels (the package's
#      version), no build tools, no apt lists or caches;
#   3. runs the image's entrypoint as its user (buildah run --isolation chroot) with a host folder
#      mounted at /run/gradsync, until `gradsyncctl health` in a second container of the image,
#      through that folder, answers SERVING, and so does its health port (--health_port, no
#      token); the socket's owner and mode; SIGTERM: exit 0, the socket removed;
#   4. the OCI archive (buildah push oci-archive:): oci-layout, index.json, the manifest, its
#      config and layers, each blob's sha256 its name, the labels in the config.
# Every wait is bounded; the store, the containers and the folders are removed whatever happens.
# Needs root. Exit 77 with the reason where it cannot run (no buildah or debootstrap).
#   tests/deploy/image_test.sh                                  build from build/packages, test
#   GRADSYNC_IMAGE_ARCHIVE=FILE tests/deploy/image_test.sh      test a built archive
# The archive is kept: $GRADSYNC_IMAGE_OUTPUT, else build/image/gradsyncd_<version>.oci.tar.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
build_dir=${BUILD_DIR:-build}
start=$SECONDS

skip() { echo "SKIP: image_test: $*"; exit 77; }
fail() { echo "FAIL: image_test: $*" >&2; exit 1; }
step() { echo "--- image_test: $*"; }
ok() { echo "ok: $*"; }

[[ $(id -u) -eq 0 ]] || skip "needs root (buildah's vfs storage without user namespaces)"
for tool in buildah debootstrap python3 timeout; do
  command -v $tool >/dev/null || skip "$tool missing (./setup.sh installs it)"
done
archive_in=${GRADSYNC_IMAGE_ARCHIVE:-}

work=$(mktemp -d /tmp/gradsync-image-test-XXXXXX)
bah=(buildah --storage-driver vfs --root "$work/store" --runroot "$work/store-run")
run=("${bah[@]}" run --isolation chroot)
daemon_runner=
containers=()
cleanup() {
  local rc=$?
  if [[ -n $daemon_runner ]] && kill -0 "$daemon_runner" 2>/dev/null; then
    [[ -n ${daemon_pid:-} ]] && kill -KILL "$daemon_pid" 2>/dev/null
    wait "$daemon_runner" 2>/dev/null || true
  fi
  local c
  for c in "${containers[@]}"; do timeout 120 "${bah[@]}" rm "$c" >/dev/null 2>&1 || true; done
  # vfs layers are plain folders; buildah rmi --all removes them (and their locks) cleanly.
  timeout 300 "${bah[@]}" rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

step "1. the image"
if [[ -n $archive_in ]]; then
  [[ -f $archive_in ]] || fail "GRADSYNC_IMAGE_ARCHIVE=$archive_in: no such file"
  archive=$(readlink -f "$archive_in")
  image=$(timeout 300 "${bah[@]}" pull --quiet "oci-archive:$archive") ||
    fail "buildah pull oci-archive:$archive"
  version=$(timeout 60 "${bah[@]}" inspect --type image --format \
    '{{index .OCIv1.Config.Labels "org.opencontainers.image.version"}}' "$image")
  ok "taken from $archive"
else
  found=("$build_dir"/packages/gradsyncd_*.deb)
  [[ ${#found[@]} -eq 1 && -f ${found[0]} ]] ||
    fail "want one $build_dir/packages/gradsyncd_*.deb (./setup.sh package), found: ${found[*]}"
  version=$(dpkg-deb -f "${found[0]}" Version)
  archive=${GRADSYNC_IMAGE_OUTPUT:-$PWD/$build_dir/image/gradsyncd_$version.oci.tar}
  mkdir -p "$(dirname "$archive")"
  build_start=$SECONDS
  timeout 1200 deploy/image/build.sh --debs "$build_dir/packages" --root "$work/store" \
    --output "$archive" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "build.sh"; }
  sed 's/^/  /' "$work/build.log"
  image=localhost/gradsyncd:$version
  ok "built in $((SECONDS - build_start)) s: $image, archive $archive"
fi

step "2. configuration"
meta=$work/inspect.json
timeout 60 "${bah[@]}" inspect --type image "$image" >"$meta" || fail "buildah inspect $image"
# A field of the image's OCI configuration (User, Entrypoint; Labels KEY), one value a line.
config() {
  python3 -c 'import json, sys
v = json.load(open(sys.argv[1]))["OCIv1"]["config"].get(sys.argv[2]) or ""
if len(sys.argv) > 3:
    v = v.get(sys.argv[3], "") if v else ""
print("\n".join(v) if isinstance(v, list) else v)' "$meta" "$@"
}
user=$(config User)
[[ $user =~ ^([0-9]+):([0-9]+)$ ]] || fail "image user '$user': want numeric uid:gid (runAsNonRoot)"
uid=${BASH_REMATCH[1]}
gid=${BASH_REMATCH[2]}
((uid != 0 && gid != 0)) || fail "image user $user is root"
ok "user $user (not root)"
mapfile -t argv < <(config Entrypoint)
[[ ${argv[0]:-} == /usr/sbin/gradsyncd ]] || fail "entrypoint '${argv[*]}': want /usr/sbin/gradsyncd"
[[ " ${argv[*]} " == *" --log_sink=stderr "* ]] || fail "entrypoint '${argv[*]}' logs not to stderr"
[[ " ${argv[*]} " == *" --socket=/run/gradsync/gradsyncd.sock "* ]] ||
  fail "entrypoint '${argv[*]}': want the socket in /run/gradsync"
ok "entrypoint ${argv[*]}"
for key in title description source licenses; do
  [[ -n $(config Labels "org.opencontainers.image.$key") ]] ||
    fail "no label org.opencontainers.image.$key"
done
label_version=$(config Labels org.opencontainers.image.version)
[[ $label_version == "$version" && -n $version ]] ||
  fail "label org.opencontainers.image.version=$label_version, want the package's $version"
ok "labels: version $label_version, title, description, source, licenses"

ctr=$(timeout 120 "${bah[@]}" from --name gradsync-test-daemon "$image") || fail "buildah from $image"
containers+=("$ctr")
ctl=$(timeout 120 "${bah[@]}" from --name gradsync-test-ctl "$image") || fail "buildah from $image"
containers+=("$ctl")
# Build tools and apt's leftovers: none. (The image's own shell runs the check, as root.)
leftovers=$(timeout 60 "${run[@]}" --user 0:0 "$ctr" -- sh -c '
  for t in gcc cc c++ g++ cpp clang ld as make cmake ninja pkg-config dpkg-buildpackage; do
    command -v "$t" || true
  done
  dpkg-query -W -f "\${db:Status-Abbrev} \${Package}\n" | awk '"'"'$1 == "ii" &&
    $2 ~ /(-dev$|^gcc(-[0-9]+)?$|^g\+\+|^cpp|^binutils|^make$|^cmake|^build-essential$|^clang)/'"'"'
  find /var/lib/apt/lists /var/cache/apt -type f 2>/dev/null
  find / -xdev -name "*.deb" 2>/dev/null') || fail "the leftovers check did not run"
[[ -z $leftovers ]] || fail "build tools or apt caches in the image: $leftovers"
ok "no compiler, linker, make, cmake or -dev package; no apt lists, caches or .deb files"
installed=$(timeout 60 "${run[@]}" "$ctr" -- dpkg-query -W -f '${Version}' gradsyncd)
[[ $installed == "$version" ]] || fail "gradsyncd $installed installed in the image, want $version"
ok "package gradsyncd $installed installed"

step "3. the entrypoint as user $user, /run/gradsync mounted from the host"
sock_dir=$work/run-gradsync
install -d -o "$uid" -g "$gid" -m 0750 "$sock_dir"
mount_opt=(--volume "$sock_dir:/run/gradsync")
# The health port too (--health_port: what a kubelet's gRPC probe reaches), on a free loopback
# port (chroot isolation keeps the host's network).
health_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${run[@]}" --user "$user" "${mount_opt[@]}" "$ctr" -- "${argv[@]}" \
  --health_port="$health_port" --health_address=127.0.0.1 >"$work/daemon.log" 2>&1 &
daemon_runner=$!
# The daemon's pid (chroot isolation shares this PID namespace): its first log line names it.
daemon_pid=
deadline=$((SECONDS + 30))
while [[ -z $daemon_pid ]] && ((SECONDS < deadline)); do
  kill -0 "$daemon_runner" 2>/dev/null || { cat "$work/daemon.log"; fail "the daemon exited early"; }
  daemon_pid=$(sed -n 's/.* daemon: starting .* pid=\([0-9]*\).*/\1/p' "$work/daemon.log" | head -n 1)
  sleep 0.2
done
[[ -n $daemon_pid ]] || { cat "$work/daemon.log"; fail "no 'starting ... pid=' line in 30 s"; }
[[ $(readlink "/proc/$daemon_pid/exe") == */usr/sbin/gradsyncd ]] ||
  fail "pid $daemon_pid is not the image's gradsyncd ($(readlink "/proc/$daemon_pid/exe"))"
[[ $(stat -c %u "/proc/$daemon_pid") == "$uid" ]] || fail "the daemon does not run as uid $uid"
ok "gradsyncd pid $daemon_pid, uid $uid"
health=
deadline=$((SECONDS + 60))
while ((SECONDS < deadline)); do
  kill -0 "$daemon_runner" 2>/dev/null || { cat "$work/daemon.log"; fail "the daemon exited"; }
  health=$(timeout 20 "${run[@]}" --user "$user" "${mount_opt[@]}" "$ctl" -- \
    gradsyncctl --socket=/run/gradsync/gradsyncd.sock --timeout=2s health 2>&1) &&
    [[ ${health%%$'\n'*} == *": SERVING" ]] && break
  health=
  sleep 0.5
done
[[ -n $health ]] || { cat "$work/daemon.log"; fail "gradsyncctl health: no SERVING in 60 s"; }
ok "gradsyncctl health in a second container of the image: ${health%%$'\n'*}"
tcp_health=$(timeout 20 "${run[@]}" --user "$user" "$ctl" -- \
  gradsyncctl --address="127.0.0.1:$health_port" --timeout=2s health 2>&1) ||
  fail "health on the health port 127.0.0.1:$health_port: $tcp_health"
[[ ${tcp_health%%$'\n'*} == *": SERVING" ]] || fail "health on the health port: $tcp_health"
ok "health on the health port (no token): ${tcp_health%%$'\n'*}"
socket_stat=$(stat -c '%F %a %u:%g' "$sock_dir/gradsyncd.sock")
[[ $socket_stat == "socket 660 $uid:$gid" ]] ||
  fail "host's view of the socket: $socket_stat, want socket 660 $uid:$gid"
ok "the host folder holds the socket: $socket_stat"
kill -TERM "$daemon_pid"
deadline=$((SECONDS + 30))
while kill -0 "$daemon_runner" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
kill -0 "$daemon_runner" 2>/dev/null && { cat "$work/daemon.log"; fail "still running 30 s after SIGTERM"; }
daemon_rc=0
wait "$daemon_runner" || daemon_rc=$?
daemon_runner=
((daemon_rc == 0)) || { cat "$work/daemon.log"; fail "SIGTERM: exit $daemon_rc, want 0"; }
[[ ! -e $sock_dir/gradsyncd.sock ]] || fail "the socket is left after the daemon exited"
ok "SIGTERM: exit 0, socket removed"
tail -n 3 "$work/daemon.log" | sed 's/^/  /'

step "4. the OCI archive"
[[ -f $archive ]] || fail "no archive $archive"
python3 - "$archive" "$version" <<'EOF' || fail "the OCI archive $archive (above)"
import hashlib, json, sys, tarfile

path, version = sys.argv[1], sys.argv[2]
with tarfile.open(path) as tar:
    names = set(tar.getnames())
    def blob(digest):
        algo, hexdigest = digest.split(":")
        assert algo == "sha256", digest
        data = tar.extractfile(f"blobs/sha256/{hexdigest}").read()
        assert hashlib.sha256(data).hexdigest() == hexdigest, f"blob {digest}: wrong sha256"
        return data
    layout = json.load(tar.extractfile("oci-layout"))
    assert layout == {"imageLayoutVersion": "1.0.0"}, layout
    index = json.load(tar.extractfile("index.json"))
    assert index["schemaVersion"] == 2 and len(index["manifests"]) == 1, index
    desc = index["manifests"][0]
    assert desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json", desc
    ref = desc.get("annotations", {}).get("org.opencontainers.image.ref.name", "")
    assert ref.endswith(":" + version), f"ref.name {ref!r} does not carry {version}"
    manifest_bytes = blob(desc["digest"])
    assert len(manifest_bytes) == desc["size"], "manifest size"
    manifest = json.loads(manifest_bytes)
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json", manifest
    config = json.loads(blob(manifest["config"]["digest"]))
    assert config["os"] == "linux" and config["architecture"], config
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version, labels
    assert config["config"]["User"] not in ("", "0", "root", "0:0"), config["config"]["User"]
    layers = manifest["layers"]
    assert layers and len(config["rootfs"]["diff_ids"]) == len(layers), (layers, config["rootfs"])
    size = 0
    for layer in layers:
        assert layer["mediaType"].startswith("application/vnd.oci.image.layer.v1.tar"), layer
        size += len(blob(layer["digest"]))
    print(f"ok: {path}: oci-layout 1.0.0, index -> manifest {desc['digest'][:19]} ({ref}), "
          f"config labels version {version}, {len(layers)} layer(s) {size >> 20} MiB, every sha256 right")
EOF
echo "image_test: OK ($((SECONDS - start)) s)"
