#!/bin/busybox sh
# /init of the SoftRoCE test guest: modules, two rxe devices on a veth pair,
# then /test.sh; prints MC_GUEST_EXIT=<rc> and powers off.
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /tmp /run
while read -r m; do insmod "$m" || echo "insmod $m failed"; done < /modules.order
# IPv6 duplicate-address detection would keep GID 0 tentative for ~2 s.
echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad
echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad
echo 100000 > /proc/sys/net/core/netdev_max_backlog
# busybox's own `ip` mishandles veth: call iproute2's by path.
IP=/usr/sbin/ip
$IP link set lo up
$IP link add v0 type veth peer name v1
$IP addr add 10.99.0.1/24 dev v0
$IP addr add 10.99.0.2/24 dev v1
$IP link set v0 up
$IP link set v1 up
i=0
while $IP -6 addr | grep -q tentative && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
rdma link add rxe0 type rxe netdev v0
rdma link add rxe1 type rxe netdev v1
echo MC_GUEST_START
sh /test.sh
echo "MC_GUEST_EXIT=$?"
poweroff -f
