#!/bin/busybox sh
# /init of the kernel smoke test's VM (`cargo xtask kernel-smoke`): a distribution's own
# kernel (Debian 12's 6.1, Ubuntu 22.04's 5.15), svc-agent from manifests with `--tc-attach
# auto`, a ClusterIP from the agent's cgroup, a Service without endpoints refused with the
# errno the host expects of this kernel, and NodePorts from another network namespace to a
# local backend and to another node's (SNATed). Everything happens inside the VM; the host
# reads the verdict line from the serial console.
/bin/busybox --install -s /bin
export PATH=/usr/bin:/bin
# iproute2's, not busybox's applets of the same names (Debian's busybox-static runs its own
# applets before anything on PATH).
ip() { /usr/bin/ip "$@"; }
tc() { /usr/bin/tc "$@"; }
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
mkdir -p /sys/fs/bpf /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup

verdict() {
    echo "svc-kernel-smoke: $*"
    sync
    poweroff -f
}
fail() {
    sleep 1 # the agent log's last lines through tail
    verdict "FAIL $*"
}
step() { echo "svc-kernel-smoke: step: $*"; }

echo "svc-kernel-smoke: kernel $(uname -r)"
for m in $(cat /etc/svc-smoke/modules); do
    insmod "$m" || fail "insmod $m"
done

# The node is the VM's own namespace: its uplink eth0 (10.0.0.1) leads to an outside client
# (namespace client, 10.0.0.2), podh (10.1.0.1) to a backend pod (namespace pod, 10.1.0.2),
# remh (10.2.0.1) to a backend on another node (namespace remote, 10.2.0.2), which a NodePort
# reaches SNATed to the node's address.
step network
ip link set lo up
ip netns add client || fail "ip netns add client"
ip netns add pod || fail "ip netns add pod"
ip link add eth0 type veth peer name eth0 netns client || fail "veth eth0"
ip link add podh type veth peer name eth0 netns pod || fail "veth podh"
ip addr add 10.0.0.1/24 dev eth0
ip addr add 10.1.0.1/24 dev podh
ip link set eth0 up
ip link set podh up
echo 1 > /proc/sys/net/ipv4/ip_forward
ip -n client link set lo up
ip -n client addr add 10.0.0.2/24 dev eth0
ip -n client link set eth0 up
ip -n client route add default via 10.0.0.1
ip -n pod link set lo up
ip -n pod addr add 10.1.0.2/24 dev eth0
ip -n pod link set eth0 up
ip -n pod route add default via 10.1.0.1
ip netns add remote || fail "ip netns add remote"
ip link add remh type veth peer name eth0 netns remote || fail "veth remh"
ip addr add 10.2.0.1/24 dev remh
ip link set remh up
ip -n remote link set lo up
ip -n remote addr add 10.2.0.2/24 dev eth0
ip -n remote link set eth0 up
ip -n remote route add default via 10.2.0.1

step backend
ip netns exec pod svc-probe serve --name pod1 --listen 10.1.0.2:8080 --tcp > /tmp/backend.log 2>&1 &
for i in $(seq 50); do grep -q ready /tmp/backend.log && break; sleep 0.2; done
grep -q ready /tmp/backend.log || fail "backend did not start: $(cat /tmp/backend.log)"
ip netns exec remote svc-probe serve --name remote1 --listen 10.2.0.2:8080 --tcp > /tmp/remote.log 2>&1 &
for i in $(seq 50); do grep -q ready /tmp/remote.log && break; sleep 0.2; done
grep -q ready /tmp/remote.log || fail "remote backend did not start: $(cat /tmp/remote.log)"

step agent
# What the host chose and expects for this kernel (kernel_smoke.rs, `Guest::append`).
arg() { tr ' ' '\n' < /proc/cmdline | sed -n "s/^svc\.$1=//p"; }
xdp=$(arg xdp)
xdp_off=$(arg xdp_off)
want=$(arg errno)
[ -n "$xdp" ] && [ -n "$want" ] || fail "no svc.xdp or svc.errno on the kernel command line"
mkdir /sys/fs/cgroup/svc-smoke
svc-agent run --manifests /etc/svc-smoke/manifests --cgroup /sys/fs/cgroup/svc-smoke \
    --bpffs /sys/fs/bpf/svc --node-name smoke --devices eth0,remh --tc-attach auto --xdp-mode "${xdp:-off}" \
    > /tmp/agent.log 2>&1 &
agent=$!
# The agent's log on the console as it comes, each line marked.
tail -f /tmp/agent.log | sed 's/^/agent| /' &
ready=
for i in $(seq 600); do
    grep -qx 'svc-agent: ready' /tmp/agent.log && { ready=1; break; }
    if ! kill -0 $agent 2>/dev/null; then
        # The start check's error, or the kernel's refusal with the verifier's last words.
        why=$(grep -m 1 '^Error:' /tmp/agent.log | cut -c 1-300)
        last=$(grep -m 1 -B 1 'verification time' /tmp/agent.log | head -n 1 | sed 's/.*[;:] //' | cut -c 1-200)
        fail "the agent exited before it was ready: $why${last:+ (verifier: $last)}"
    fi
    sleep 0.5
done
[ -n "$ready" ] || fail "the agent was not ready in 300 s"
echo "--- tc filter show dev eth0 ingress ---"
tc filter show dev eth0 ingress
tc filter show dev eth0 ingress | grep -q tc_ext_ingress || fail "no classic filter of svc on eth0"

step clusterip
# A process of the agent's cgroup (a pod's), as the socket hooks serve.
out=$(sh -c 'echo $$ > /sys/fs/cgroup/svc-smoke/cgroup.procs; exec svc-probe tcp --to 10.96.0.10:80' 2>&1)
echo "ClusterIP 10.96.0.10:80 from the cgroup: $out"
echo "$out" | grep -q '"backend":"pod1"' || fail "ClusterIP: $out"

step refused
# A Service without endpoints: connect() fails at once, with ECONNREFUSED (111), or with
# EPERM (1) on a kernel without bpf_set_retval (before 5.18), as the host expects.
out=$(sh -c 'echo $$ > /sys/fs/cgroup/svc-smoke/cgroup.procs; exec svc-probe tcp --to 10.96.0.11:80' 2>&1)
echo "ClusterIP 10.96.0.11:80 without endpoints, from the cgroup: $out (errno $want expected)"
echo "$out" | grep -q "\"errno\":$want[,}]" || fail "refused: $out, not errno $want"

step nodeport
out=$(ip netns exec client svc-probe tcp --to 10.0.0.1:30080 2>&1)
echo "NodePort 10.0.0.1:30080 from namespace client: $out"
echo "$out" | grep -q '"backend":"pod1"' || fail "NodePort: $out"

step snat
# To the other node's backend: DNAT and SNAT on eth0's ingress, reverse NAT on remh's. The
# backend sees the node address the route to it prefers (remh's, as MASQUERADE would pick),
# not the client's.
out=$(ip netns exec client svc-probe tcp --to 10.0.0.1:30081 --who 2>&1)
echo "NodePort 10.0.0.1:30081 (remote backend) from namespace client: $out"
echo "$out" | grep -q '"backend":"remote1"' || fail "NodePort to a remote backend: $out"
echo "$out" | grep -q '"source":"10\.2\.0\.1:' || fail "NodePort to a remote backend not SNATed to 10.2.0.1: $out"

kill $agent
# A kernel without what the XDP program needs runs `native` as `off`, and says so.
if [ "$xdp_off" = 1 ]; then
    grep -q "xdp-mode $xdp: this kernel cannot load the XDP program" /tmp/agent.log ||
        fail "--xdp-mode $xdp on a kernel that cannot load the XDP program: no word of running as off"
    xdp="$xdp, run as off"
fi
verdict "PASS kernel $(uname -r), $(grep -o 'tc_mode=[a-z]*' /tmp/agent.log | head -n 1), xdp ${xdp:-off}, refused with errno $want"
