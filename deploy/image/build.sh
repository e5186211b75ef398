#!/usr/bin/env bash
# Builds the OCI image of gradsyncd and gradsyncctl from the project's own Debian package, with no
# registry: a Debian 12 rootfs made by debootstrap (minbase, from the Debian archive; cached as a
# tarball, so a rerun fetches it once), put into a `buildah from scratch` container, the
# gradsyncd .deb installed in it with apt (its Debian dependencies come from the archive), apt's
# lists and caches removed, then committed as an OCI image.
#
#   deploy/image/build.sh [--debs DIR] [--output FILE.tar] [--tag NAME] [--cache DIR]
#                         [--root DIR] [--uid N] [--mirror URL] [--source URL]
#
#   --debs DIR      where gradsyncd_*.deb is (default build/packages: `./setup.sh package`)
#   --output FILE   also write the image as an OCI archive (`buildah push ... oci-archive:FILE`)
#   --tag NAME      image name (default localhost/gradsyncd:<package version>)
#   --cache DIR     the debootstrap tarball's folder (default $GRADSYNC_CACHE, else
#                   ~/.cache/gradsync)
#   --root DIR      buildah's storage (its --root; the run root beside it); default: buildah's own
#   --uid N         uid and gid of the gradsync user and group in the image (default 10001: the
#                   Kubernetes manifests in deploy/kubernetes name it)
#   --mirror URL    Debian archive for debootstrap (default http://deb.debian.org/debian)
#   --source URL    org.opencontainers.image.source (default: the git remote "origin", if any)
#
# The image: the user gradsync (uid:gid 10001), entrypoint `/usr/sbin/gradsyncd --log_sink=stderr
# --socket=/run/gradsync/gradsyncd.sock` (arguments append flags, e.g. --flagfile=...),
# /run/gradsync a volume for the trainers' socket. Libraries the daemon needs that no Debian
# package holds (a CUDA build's libcudart and libnccl) are copied from this machine's linker
# paths into /usr/local/lib/gradsync and named in the label io.gradsync.bundled-libraries.
# Storage driver vfs, isolation chroot: it runs as root on a plain Debian host, without user
# namespaces, fuse or a container runtime. Prints the image's name and id on its last line.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."

debs=build/packages
output=
tag=
cache=${GRADSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gradsync}
root=
uid=10001
mirror=http://deb.debian.org/debian
source_url=$(git remote get-url origin 2>/dev/null || true)
suite=bookworm

die() { echo "build.sh: $*" >&2; exit 1; }
say() { echo "build.sh: $*"; }
while (($#)); do
  case $1 in
    --debs) debs=${2:?--debs needs a folder}; shift 2 ;;
    --output) output=${2:?--output needs a file}; shift 2 ;;
    --tag) tag=${2:?--tag needs a name}; shift 2 ;;
    --cache) cache=${2:?--cache needs a folder}; shift 2 ;;
    --root) root=${2:?--root needs a folder}; shift 2 ;;
    --uid) uid=${2:?--uid needs a number}; shift 2 ;;
    --mirror) mirror=${2:?--mirror needs a URL}; shift 2 ;;
    --source) source_url=${2:?--source needs a URL}; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/{/^set/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (--help lists them)" ;;
  esac
done
[[ $uid =~ ^[1-9][0-9]*$ ]] || die "--uid $uid: want a number above 0"
[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, and buildah's vfs storage without user namespaces)"
for tool in debootstrap buildah dpkg-deb ldconfig timeout; do
  command -v $tool >/dev/null || die "$tool missing (./setup.sh installs debootstrap and buildah)"
done
found=("$debs"/gradsyncd_*.deb)
[[ ${#found[@]} -eq 1 && -f ${found[0]} ]] ||
  die "want one gradsyncd_*.deb in $debs (./setup.sh package), found: ${found[*]}"
deb=$(readlink -f "${found[0]}")
version=$(dpkg-deb -f "$deb" Version)
arch=$(dpkg-deb -f "$deb" Architecture)
[[ $arch == "$(dpkg --print-architecture)" ]] ||
  die "$deb is for $arch; this machine builds $(dpkg --print-architecture) images only"
tag=${tag:-localhost/gradsyncd:$version}
bah=(buildah --storage-driver vfs)
[[ -z $root ]] || bah+=(--root "$root" --runroot "$root-run")
run=("${bah[@]}" run --isolation chroot)

work=$(mktemp -d /tmp/gradsync-image-XXXXXX)
ctr=
cleanup() {
  local rc=$?
  if [[ -n $ctr ]]; then
    timeout 120 "${bah[@]}" rm "$ctr" >/dev/null 2>&1 || echo "build.sh: buildah rm $ctr failed" >&2
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# 1. The base: a minbase Debian 12 rootfs, cached as a tarball. Only the first build fetches it.
base=$cache/debian-$suite-minbase-$arch.tar
if [[ -f $base ]]; then
  say "base rootfs: $base (cached; delete it to fetch a new one)"
else
  say "base rootfs: debootstrap --variant=minbase $suite from $mirror (once; cached in $cache)"
  mkdir -p "$cache"
  rootfs=$work/rootfs
  timeout 900 debootstrap --variant=minbase --arch="$arch" "$suite" "$rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 ||
    { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed or took over 15 minutes"; }
  # What debootstrap leaves of this machine and of its own download.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/log/bootstrap.log "$rootfs"/etc/resolv.conf "$rootfs"/etc/hostname
  timeout 300 tar -C "$rootfs" --numeric-owner -cf "$base.partial" . || die "tar of the rootfs"
  mv "$base.partial" "$base"
  rm -rf "$rootfs"
  say "base rootfs cached: $base ($(du -h "$base" | cut -f1))"
fi

# 2. The container: the rootfs copied in.
ctr=$(timeout 120 "${bah[@]}" from --name "gradsync-build-$$" scratch) || die "buildah from scratch"
mnt=$(timeout 60 "${bah[@]}" mount "$ctr") || die "buildah mount $ctr"
timeout 300 tar -C "$mnt" --numeric-owner -xpf "$base" || die "unpacking $base into the container"
mkdir -p "$mnt/tmp/gradsync-debs"
cp "$deb" "$mnt/tmp/gradsync-debs/"

# 3. The gradsync user and group at a fixed id before the package: its postinst keeps an existing
# user (getent), so the id is the one the Kubernetes manifests name, not the next free one.
say "gradsync user and group: $uid:$uid"
timeout 60 "${run[@]}" "$ctr" -- groupadd --gid "$uid" gradsync
timeout 60 "${run[@]}" "$ctr" -- useradd --uid "$uid" --gid gradsync \
  --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin --comment "gradsync daemon" \
  gradsync

# 4. The package, its dependencies from the archive; then no apt lists, caches or logs.
say "apt-get install ${deb##*/} (its dependencies from $mirror)"
printf 'deb %s %s main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
  "$mirror" "$suite" "$suite" >"$mnt/etc/apt/sources.list"
timeout 600 "${run[@]}" --env DEBIAN_FRONTEND=noninteractive "$ctr" -- sh -ec '
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends /tmp/gradsync-debs/*.deb
' >"$work/apt.log" 2>&1 || { tail -n 40 "$work/apt.log" >&2; die "apt-get install in the image"; }
grep -E '^(E:|W:)' "$work/apt.log" || true
rm -rf "$mnt"/tmp/gradsync-debs "$mnt"/var/lib/apt/lists/* "$mnt"/var/cache/apt/* \
  "$mnt"/var/cache/debconf/*-old "$mnt"/var/log/apt "$mnt"/var/log/dpkg.log \
  "$mnt"/var/log/alternatives.log
# The package enables its unit for systemd; no systemd runs in the image.
rm -f "$mnt"/etc/systemd/system/multi-user.target.wants/gradsyncd.service
[[ $(stat -c %u "$mnt/usr/sbin/gradsyncd") == 0 ]] || die "/usr/sbin/gradsyncd is not root's"
got=$(timeout 60 "${run[@]}" "$ctr" -- id -u gradsync) || die "no user gradsync after the install"
[[ $got == "$uid" ]] || die "user gradsync has uid $got, not $uid"

# 5. Libraries the binaries need that no Debian package provides (a CUDA build's libcudart,
# libnccl): copied from this machine's linker paths, a few rounds for what they need in turn.
bundled=()
for round in 1 2 3 4; do
  missing=$(timeout 60 "${run[@]}" "$ctr" -- sh -c \
    'for f in /usr/sbin/gradsyncd /usr/bin/gradsyncctl /usr/local/lib/gradsync/*.so*; do
       if [ -e "$f" ]; then ldd "$f"; fi; done' | awk '/=> not found/ {print $1}' | sort -u)
  [[ -n $missing ]] || break
  ((round < 4)) || die "libraries still missing after 3 rounds: $missing"
  mkdir -p "$mnt/usr/local/lib/gradsync"
  for lib in $missing; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ && !p {p = $NF} END {print p}')
    [[ -n $path && -f $path ]] ||
      die "the daemon needs $lib, which neither Debian nor this machine's linker paths provide"
    cp -L "$path" "$mnt/usr/local/lib/gradsync/$lib"
    bundled+=("$lib")
    say "bundled $lib from $(readlink -f "$path")"
  done
  echo /usr/local/lib/gradsync >"$mnt/etc/ld.so.conf.d/gradsync.conf"
  timeout 60 "${run[@]}" "$ctr" -- ldconfig
done

# The socket's folder (a volume where the trainers' pods mount it), owned as systemd makes it.
install -d -o "$uid" -g "$uid" -m 0750 "$mnt/run/gradsync"
daemon_version=$(timeout 60 "${run[@]}" "$ctr" -- /usr/sbin/gradsyncd --version 2>&1) ||
  die "gradsyncd --version in the image: $daemon_version"
say "in the image: ${daemon_version%%$'\n'*}"
timeout 60 "${bah[@]}" umount "$ctr" >/dev/null

# 6. Configuration and labels, then the commit.
revision=$(git rev-parse HEAD 2>/dev/null || true)
timeout 60 "${bah[@]}" config \
  --user "$uid:$uid" \
  --workingdir / \
  --entrypoint '["/usr/sbin/gradsyncd", "--log_sink=stderr", "--socket=/run/gradsync/gradsyncd.sock"]' \
  --cmd '' \
  --volume /run/gradsync \
  --stop-signal SIGTERM \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --label org.opencontainers.image.title=gradsyncd \
  --label "org.opencontainers.image.description=gradsync per-node gradient-synchronisation daemon and gradsyncctl (Debian 12, package gradsyncd $version)" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.source=${source_url:-unknown (no git remote; build.sh --source URL)}" \
  --label "org.opencontainers.image.revision=${revision:-unknown}" \
  --label "org.opencontainers.image.licenses=LicenseRef-gradsync" \
  --label "org.opencontainers.image.base.name=debian:$suite (debootstrap --variant=minbase)" \
  --label "io.gradsync.uid=$uid" \
  --label "io.gradsync.bundled-libraries=${bundled[*]:-none}" \
  "$ctr"
id=$(timeout 600 "${bah[@]}" commit --quiet --format oci --rm "$ctr" "$tag") || die "buildah commit"
ctr=
if [[ -n $output ]]; then
  rm -f "$output"
  timeout 600 "${bah[@]}" push --quiet "$tag" "oci-archive:$output:$tag" || die "buildah push to $output"
  say "OCI archive: $output ($(du -h "$output" | cut -f1))"
fi
say "image $tag $id"
