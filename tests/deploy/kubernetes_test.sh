#!/usr/bin/env bash
# The Kubernetes manifests (deploy/kubernetes), offline: no cluster.
#   1. `kubectl kustomize` of the base and the overlays cpu and gpu with kubectl 1.20 (Debian 12's
#      kubernetes-client: kustomize v2.0.3, the oldest these must render with), and with the
#      kubectl on PATH when it is another version: the same objects;
#   2. every rendered object, and examples/trainer-pod.yaml, against the Kubernetes 1.30 API's
#      JSON schemas, strict (unknown fields refused): kubernetes-validate 1.30.0 in .venv
#      (./setup.sh). The ServiceMonitor (a CRD, not in those schemas): its required fields and the
#      CRD's patterns, checked here;
#   3. what the deployment relies on: priority class, one node at a time, hostNetwork, the gRPC
#      probes on --health_port, the securityContext (non-root, the image's uid, no capability),
#      the token Secret's mode (the daemon refuses one "others" may read), the flagfile from the
#      ConfigMap, the socket's hostPath, the Service and ServiceMonitor on --metrics_port; GPU
#      tolerations, runtime class, hostPID in gpu only;
#   4. the checks refuse a broken manifest (a strict-schema error, a missing probe).
# kubectl 1.20: $KUBECTL, else Debian's kubernetes-client when installed, else its .deb fetched
# with apt-get download once into $GRADSYNC_CACHE (~/.cache/gradsync) and unpacked there.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
start=$SECONDS
venv=${GRADSYNC_VENV:-$PWD/.venv}
cache=${GRADSYNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gradsync}
k8s_version=1.30.0

fail() { echo "FAIL: kubernetes_test: $*" >&2; exit 1; }
step() { echo "--- kubernetes_test: $*"; }

if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import kubernetes_validate' 2>/dev/null; then
  fail "kubernetes-validate missing from $venv (./setup.sh installs it)"
fi
work=$(mktemp -d /tmp/gradsync-kubernetes-test-XXXXXX)
trap 'rm -rf "$work"' EXIT

step "1. kubectl kustomize"
kubectl_120=${KUBECTL:-}
if [[ -z $kubectl_120 ]]; then
  if dpkg-query -W -f='${Status}' kubernetes-client 2>/dev/null | grep -q "install ok installed"; then
    kubectl_120=/usr/bin/kubectl
  else
    # Not installed: its kubectl would clash with another package's /usr/bin/kubectl.
    dir=$cache/kubernetes-client
    if [[ ! -x $dir/root/usr/bin/kubectl ]]; then
      mkdir -p "$dir"
      rm -rf "$dir/root" "$dir"/*.deb
      (cd "$dir" && timeout 300 apt-get download kubernetes-client >"$work/apt.log" 2>&1) ||
        { cat "$work/apt.log"; fail "apt-get download kubernetes-client (Debian 12's kubectl)"; }
      dpkg-deb -x "$dir"/kubernetes-client_*.deb "$dir/root"
    fi
    kubectl_120=$dir/root/usr/bin/kubectl
  fi
fi
v120=$(timeout 30 "$kubectl_120" version --client --short 2>/dev/null || true)
[[ $v120 == *v1.20.* ]] || fail "$kubectl_120 is not kubectl 1.20 ('$v120'); set KUBECTL"
echo "kubectl: $kubectl_120 ($v120)"
kubectls=("$kubectl_120")
other=$(command -v kubectl || true)
if [[ -n $other && $(readlink -f "$other") != "$(readlink -f "$kubectl_120")" ]]; then
  kubectls+=("$other")
  echo "kubectl: $other ($(timeout 30 "$other" version --client 2>/dev/null | head -n 1)) as well"
fi
renders=(base overlays/cpu overlays/gpu)
for k in "${!kubectls[@]}"; do
  for r in "${renders[@]}"; do
    out=$work/$k-${r//\//-}.yaml
    timeout 60 "${kubectls[$k]}" kustomize "deploy/kubernetes/$r" >"$out" 2>"$work/err" ||
      { cat "$work/err"; fail "${kubectls[$k]} kustomize deploy/kubernetes/$r"; }
    echo "rendered deploy/kubernetes/$r with ${kubectls[$k]}: $(grep -c '^kind:' "$out") objects"
  done
done

# The image's uid and gid: the manifests must name the ones deploy/image/build.sh gives gradsync.
image_uid=$(sed -n 's/^uid=\([0-9][0-9]*\)$/\1/p' deploy/image/build.sh)
[[ -n $image_uid ]] || fail "no uid=N line in deploy/image/build.sh"

checker=$work/check.py
cat >"$checker" <<'EOF'
"""Checks rendered manifests: schemas (kubernetes-validate, strict) and what the deployment
relies on. argv: k8s version, image uid, then one or more NAME=FILE (NAME base, cpu, gpu,
example). Prints one line per check; exits 1 naming the first failure."""
import copy
import re
import sys

import kubernetes_validate
import yaml

version, image_uid = sys.argv[1], int(sys.argv[2])


class Failed(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failed(what)


def schema(obj, where):
    if obj["kind"] == "ServiceMonitor":
        return service_monitor(obj, where)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        raise Failed(f"{where}: {obj['kind']}/{obj['metadata'].get('name')}: {path}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        raise Failed(f"{where}: {e.message}")


# prometheus-operator's ServiceMonitor CRD (monitoring.coreos.com/v1): spec is required, with
# spec.selector; endpoint interval and scrapeTimeout follow the CRD's duration pattern. Only the
# fields used here are allowed, so a typo cannot pass.
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                      r"(([0-9]+)s)?(([0-9]+)ms)?)$")


def service_monitor(obj, where):
    what = f"{where}: ServiceMonitor/{obj['metadata'].get('name')}"
    check(obj["apiVersion"] == "monitoring.coreos.com/v1", f"{what}: apiVersion")
    check(set(obj) <= {"apiVersion", "kind", "metadata", "spec"}, f"{what}: top-level fields")
    spec = obj.get("spec")
    check(isinstance(spec, dict), f"{what}: spec is required")
    check(set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"},
          f"{what}: unknown spec fields {sorted(set(spec))}")
    sel = spec.get("selector")
    check(isinstance(sel, dict) and set(sel) <= {"matchLabels", "matchExpressions"} and sel,
          f"{what}: spec.selector is required (matchLabels/matchExpressions)")
    for ep in spec.get("endpoints", []):
        check(set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"},
              f"{what}: unknown endpoint fields {sorted(ep)}")
        check(isinstance(ep.get("port"), str) and ep["port"], f"{what}: endpoint port (name)")
        for d in ("interval", "scrapeTimeout"):
            check(d not in ep or DURATION.match(ep[d]), f"{what}: endpoint {d} {ep.get(d)!r}")
        check(ep.get("scheme", "http") in ("http", "https"), f"{what}: endpoint scheme")


def flags(text):
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("--") and "=" in line:
            k, v = line[2:].split("=", 1)
            out[k] = v
    return out


def deployment(objs, name):
    """The checks of one rendering (base, cpu or gpu); returns a list of what passed."""
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    for kind in ("Namespace", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"):
        check(len(by_kind.get(kind, [])) == 1, f"{name}: want one {kind}, got {len(by_kind.get(kind, []))}")
    ns = by_kind["Namespace"][0]["metadata"]["name"]
    check(ns == "gradsync", f"{name}: namespace {ns}")
    check(by_kind["Namespace"][0]["metadata"].get("labels", {}).get(
        "pod-security.kubernetes.io/enforce") == "privileged",
          f"{name}: the namespace's Pod Security level would refuse hostNetwork and hostPath")
    for o in objs:
        if o["kind"] != "Namespace":
            check(o["metadata"].get("namespace") == ns, f"{name}: {o['kind']} not in {ns}")
    ds = by_kind["DaemonSet"][0]
    cm = by_kind["ConfigMap"][0]
    svc = by_kind["Service"][0]
    sm = by_kind["ServiceMonitor"][0]
    pod = ds["spec"]["template"]["spec"]
    check(pod.get("priorityClassName") == "system-node-critical", f"{name}: priorityClassName")
    us = ds["spec"].get("updateStrategy", {})
    check(us.get("type") == "RollingUpdate" and
          us.get("rollingUpdate", {}).get("maxUnavailable") == 1, f"{name}: updateStrategy {us}")
    check(pod.get("hostNetwork") is True, f"{name}: hostNetwork")
    check(pod.get("dnsPolicy") == "ClusterFirstWithHostNet", f"{name}: dnsPolicy under hostNetwork")
    check(ds["spec"]["selector"]["matchLabels"].items() <=
          ds["spec"]["template"]["metadata"]["labels"].items(), f"{name}: selector/labels")
    (c,) = [c for c in pod["containers"] if c["name"] == "gradsyncd"]
    args = {a[2:].split("=", 1)[0]: a.split("=", 1)[1] for a in c["args"] if a.startswith("--")}
    env = {e["name"]: e for e in c.get("env", [])}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}

    def volume_at(path):
        """(volume, file in it) of the container path `path`."""
        best = max((m for m in mounts if path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        check(best is not None, f"{name}: nothing mounted at {path}")
        return volumes[mounts[best]["name"]], path[len(best.rstrip("/")) + 1:]

    # The flagfile: the ConfigMap's key, at the path --flagfile names.
    vol, key = volume_at(args["flagfile"])
    check(vol.get("configMap", {}).get("name") == cm["metadata"]["name"] and key in cm["data"],
          f"{name}: --flagfile={args['flagfile']} is not the ConfigMap {cm['metadata']['name']}")
    ff = flags(cm["data"][key])
    allf = {**ff, **args}
    # The token: the Secret's key at --token_file, a mode the daemon accepts (no "others" bits),
    # readable by the daemon through fsGroup.
    vol, key = volume_at(allf["token_file"])
    sec = vol.get("secret")
    check(sec is not None and key == "token", f"{name}: --token_file is not the Secret's key token")
    mode = sec.get("defaultMode", 0o644)
    check(mode & 0o007 == 0, f"{name}: token mode {mode:o} lets others read (the daemon refuses)")
    psc = pod.get("securityContext", {})
    check(mode & 0o040 and psc.get("fsGroup") == image_uid,
          f"{name}: token not group-readable by fsGroup {image_uid}")
    check(all(m.get("readOnly") for m in mounts.values() if volumes[m["name"]] is vol),
          f"{name}: token mount not read-only")
    # The socket: a hostPath folder holding --socket.
    sock = allf.get("socket", "/run/gradsync/gradsyncd.sock")
    vol, _ = volume_at(sock)
    hp = vol.get("hostPath", {})
    check(hp.get("path") == "/run/gradsync" and hp.get("type") == "DirectoryOrCreate",
          f"{name}: socket {sock} not in the hostPath /run/gradsync (DirectoryOrCreate)")
    init = pod.get("initContainers", [])
    check(any(any(m["mountPath"] == "/run/gradsync" for m in i["volumeMounts"]) and
              f"{image_uid}:{image_uid}" in " ".join(i["command"]) for i in init),
          f"{name}: no init container hands /run/gradsync to {image_uid}")
    # Probes: gRPC on --health_port, which listens on the pod's (the node's) address.
    hport = int(args["health_port"])
    check(hport > 0, f"{name}: --health_port {hport}")
    for p in ("readinessProbe", "livenessProbe", "startupProbe"):
        check(c.get(p, {}).get("grpc", {}).get("port") == hport, f"{name}: {p} not gRPC on {hport}")
    check(args.get("health_address") == "$(NODE_IP)" and
          env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP",
          f"{name}: --health_address is not the node's address")
    check(args.get("bind_address") == "$(NODE_IP)", f"{name}: --bind_address")
    check(int(allf["port"]) > 0 and allf["token_file"], f"{name}: TCP for other daemons")
    # securityContext: non-root as the image's user, no capability, nothing writable but volumes.
    check(psc.get("runAsNonRoot") is True and psc.get("runAsUser") == image_uid and
          psc.get("runAsGroup") == image_uid, f"{name}: pod securityContext {psc}")
    sc = c.get("securityContext", {})
    check(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True,
          f"{name}: container securityContext {sc}")
    check(sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"),
          f"{name}: capabilities {sc.get('capabilities')}")
    for i in init:
        isc = i.get("securityContext", {})
        check(isc.get("capabilities", {}).get("drop") == ["ALL"] and
              set(isc["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER"} and
              isc.get("allowPrivilegeEscalation") is False, f"{name}: init {i['name']} {isc}")
    res = c.get("resources", {})
    check(res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory") and
          res.get("limits", {}).get("memory"), f"{name}: resources {res}")
    # Metrics: the Service and the ServiceMonitor on --metrics_port.
    mport = int(args["metrics_port"])
    ports = {p["name"]: p for p in c["ports"]}
    check(ports.get("metrics", {}).get("containerPort") == mport, f"{name}: containerPort metrics")
    check(ports.get("health", {}).get("containerPort") == hport, f"{name}: containerPort health")
    check(svc["spec"].get("internalTrafficPolicy") == "Local", f"{name}: internalTrafficPolicy")
    check(svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items(),
          f"{name}: the Service selects no daemon pod")
    (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == "metrics"]
    check(sp["targetPort"] in ("metrics", mport), f"{name}: Service targetPort")
    check(sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items(),
          f"{name}: the ServiceMonitor selects no Service")
    check([e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"], f"{name}: SM endpoints")
    # GPU: only in the gpu overlay.
    tol = pod.get("tolerations", [])
    gpu_tol = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    requests_gpus = any("nvidia.com/gpu" in str(x.get("resources", {})) for x in pod["containers"])
    check(not requests_gpus, f"{name}: the daemon requests nvidia.com/gpu (taken from trainers)")
    if name == "gpu":
        check(gpu_tol in tol, f"{name}: no nvidia.com/gpu NoSchedule toleration")
        check(pod.get("nodeSelector") == {"nvidia.com/gpu.present": "true"}, f"{name}: nodeSelector")
        check(pod.get("runtimeClassName") == "nvidia", f"{name}: runtimeClassName")
        check(pod.get("hostPID") is True, f"{name}: hostPID (CUDA IPC)")
        check(env.get("NVIDIA_VISIBLE_DEVICES", {}).get("value") == "all", f"{name}: all GPUs")
    else:
        check(not tol and "runtimeClassName" not in pod and not pod.get("hostPID") and
              "NVIDIA_VISIBLE_DEVICES" not in env, f"{name}: GPU settings outside the gpu overlay")
    check(not pod.get("hostIPC"), f"{name}: hostIPC")
    return (f"{name}: priority class, maxUnavailable 1, hostNetwork, gRPC probes on {hport}, "
            f"non-root {image_uid} without capabilities, token 0{mode:o} via fsGroup, flagfile "
            f"from {cm['metadata']['name']}, socket hostPath, metrics {mport} (Service Local, "
            f"ServiceMonitor)" + (", GPU: toleration, nodeSelector, runtime nvidia, hostPID"
                                  if name == "gpu" else ", no GPU settings"))


def example(objs):
    (pod,) = objs
    spec = pod["spec"]
    check(pod["kind"] == "Pod" and spec.get("hostPID") is True, "example: hostPID (GPU trainer)")
    check(image_uid in spec["securityContext"].get("supplementalGroups", []),
          f"example: supplementalGroups lacks the socket's group {image_uid}")
    vols = {v["name"]: v for v in spec["volumes"]}
    (c,) = spec["containers"]
    (m,) = [m for m in c["volumeMounts"] if vols[m["name"]].get("hostPath", {}).get("path") ==
            "/run/gradsync"]
    sock = {e["name"]: e.get("value") for e in c.get("env", [])}.get("GRADSYNC_SOCKET",
                                                                      "/run/gradsync/gradsyncd.sock")
    check(sock.startswith(m["mountPath"].rstrip("/") + "/"), "example: socket outside the mount")
    return "example: trainer pod with the socket's hostPath, group and hostPID"


def main():
    rendered = {}
    for arg in sys.argv[3:]:
        name, path = arg.split("=", 1)
        with open(path) as f:
            rendered.setdefault(name, []).append([o for o in yaml.safe_load_all(f) if o])
    try:
        for name, variants in rendered.items():
            first = variants[0]
            for other in variants[1:]:
                check(same(first, other), f"{name}: the kubectl versions render different objects")
            for o in first:
                schema(o, name)
            print(f"ok: {name}: {len(first)} objects valid against Kubernetes {version} (strict)")
            print("ok: " + (example(first) if name == "example" else deployment(first, name)))
        # The checks refuse a broken manifest: an unknown field (strict schema), a lost probe.
        if "gpu" in rendered:
            def refused(breaks, check, said, passed):
                """The gpu overlay's objects with `breaks` done to its DaemonSet's container:
                `check` must refuse them."""
                broken = copy.deepcopy(rendered["gpu"][0])
                ds = [o for o in broken if o["kind"] == "DaemonSet"][0]
                breaks(ds["spec"]["template"]["spec"]["containers"][0])
                try:
                    check(broken, ds)
                except Failed as e:
                    print(f"ok: {said}: {e}")
                else:
                    raise Failed(passed)
            refused(lambda c: c["livenessProbe"].update(grpcc={}),
                    lambda objs, ds: schema(ds, "broken"), "a broken manifest is refused",
                    "an unknown field passed the strict schema")
            refused(lambda c: c.pop("readinessProbe"),
                    lambda objs, ds: deployment(objs, "gpu"),
                    "a manifest without its readiness probe is refused",
                    "a DaemonSet without readinessProbe passed")
    except Failed as e:
        print(f"FAIL: kubernetes_test: {e}", file=sys.stderr)
        sys.exit(1)


def same(a, b):
    """The same objects, but for the ConfigMap's name hash (each kustomize hashes its own way)."""
    def norm(objs):
        text = yaml.safe_dump(sorted(objs, key=lambda o: (o["kind"], o["metadata"]["name"])))
        for o in objs:
            if o["kind"] == "ConfigMap":
                text = text.replace(o["metadata"]["name"], "gradsyncd-flags-HASH")
        return text
    return norm(a) == norm(b)


main()
EOF

step "2-4. schemas (Kubernetes $k8s_version, strict) and the deployment's checks"
args=()
for k in "${!kubectls[@]}"; do
  for r in "${renders[@]}"; do
    args+=("${r#overlays/}=$work/$k-${r//\//-}.yaml")
  done
done
args+=("example=deploy/kubernetes/examples/trainer-pod.yaml")
timeout 300 "$venv/bin/python" "$checker" "$k8s_version" "$image_uid" "${args[@]}"

step "5. the daemon knows every flag the DaemonSet passes (flagfile and args)"
daemon=${GRADSYNCD:-$PWD/${BUILD_DIR:-build}/daemon/gradsyncd}
if [[ -x $daemon ]]; then
  # The gpu rendering's ConfigMap as the flagfile, its args with the node's address substituted.
  cat >"$work/args.py" <<'PY'
import sys, yaml
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
(cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
(ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
(c,) = ds["spec"]["template"]["spec"]["containers"]
open(sys.argv[2], "w").write(cm["data"]["gradsyncd.flags"])
for a in c["args"]:
    a = a.replace("$(NODE_IP)", "127.0.0.1")
    print(f"--flagfile={sys.argv[2]}" if a.startswith("--flagfile=") else a)
PY
  mapfile -t dargs < <("$venv/bin/python" "$work/args.py" "$work/0-overlays-gpu.yaml" "$work/flags")
  ((${#dargs[@]} > 0)) || fail "no args read from the gpu rendering"
  out=$(timeout 30 "$daemon" "${dargs[@]}" --print_config=flagfile 2>&1 >/dev/null) ||
    fail "$daemon refuses the DaemonSet's flags (${dargs[*]} and its flagfile): $out"
  echo "ok: $daemon parses the DaemonSet's args and flagfile (${dargs[*]})"
else
  echo "not checked: no daemon at $daemon (./setup.sh build, or set GRADSYNCD)"
fi
echo "kubernetes_test: OK ($((SECONDS - start)) s)"
