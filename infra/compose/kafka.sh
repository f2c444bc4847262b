#!/bin/bash
# Kafka (KRaft, one node) secured as the local stack is (devtools/kafka_node.py): SASL/SCRAM-SHA-512
# on the client listeners, SASL/PLAIN on the controller's, the StandardAuthorizer denying what no
# ACL allows, and only `broker` and `admin` as super users, both bootstrapped by the storage format.
# Their passwords are compose secrets (files under /run/secrets, 0600 as the host has them), so
# this starts as root (compose's `user: "0"`): it reads them into the properties files, written
# 0600 for the image's user (appuser) on a tmpfs (/run/kafka), then runs the broker as appuser.
set -euo pipefail
: "${CLUSTER_ID:?}"
secret() { local v; v=$(cat "/run/secrets/$1"); [ -n "$v" ] || { echo "kafka.sh: /run/secrets/$1 is empty" >&2; exit 1; }; printf %s "$v"; }
PASSWORD_BROKER=$(secret broker-password)
PASSWORD_ADMIN=$(secret admin-kafka-password)
# As appuser: setpriv where the image has it (Debian's util-linux: the stand-in the compose test
# runs), else su (busybox's in the Alpine-based apache/kafka), -p keeping PATH and CLASSPATH.
if command -v setpriv > /dev/null; then
  as_appuser=(setpriv --reuid=appuser --regid=appuser --init-groups --)
else
  as_appuser=(su -p -s /bin/bash appuser -c 'exec "$0" "$@"')
fi
umask 077
conf=/run/kafka
props=$conf/server.properties
scram='org.apache.kafka.common.security.scram.ScramLoginModule required username="broker" password="'"$PASSWORD_BROKER"'";'
cat > "$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@kafka:9093
listeners=INTERNAL://:9092,HOST://:29092,CONTROLLER://:9093
advertised.listeners=INTERNAL://kafka:9092,HOST://localhost:29092
listener.security.protocol.map=INTERNAL:SASL_PLAINTEXT,HOST:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
log.dirs=/var/lib/kafka/data
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.internal.scram-sha-512.sasl.jaas.config=$scram
listener.name.host.scram-sha-512.sasl.jaas.config=$scram
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="broker" password="$PASSWORD_BROKER" user_broker="$PASSWORD_BROKER";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:broker;User:admin
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
# As the local stack's broker has them (devtools/kafka_node.py KAFKA_BROKER_SETTINGS,
# tests/unit/test_compose.py keeps them equal): above all, a dispatcher that dies loses its
# shards after 6 s (group.consumer.session.timeout.ms), not Kafka's 45 s, in which its shards
# stood still and a reader's commit waited past its own timeout.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
min.insync.replicas=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=500
auto.create.topics.enable=false
message.max.bytes=8388608
transaction.abort.timed.out.transaction.cleanup.interval.ms=2000
group.consumer.session.timeout.ms=6000
group.consumer.min.session.timeout.ms=1000
group.consumer.heartbeat.interval.ms=500
group.consumer.min.heartbeat.interval.ms=100
group.consumer.assignors=uniform,range,dev.ksb.kafka.StickyShardAssignor
PROPS
# The health check's login (the admin's).
cat > "$conf/admin.properties" <<PROPS
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$PASSWORD_ADMIN";
PROPS
# KSB's assignor (built into the image, infra/kafka/Dockerfile); kafka-run-class.sh adds its own jars
# after. The storage format needs it too: it checks the properties, which name the assignor.
export CLASSPATH=/opt/ksb/assignor/ksb-kafka-assignor.jar
chown appuser "$conf" "$conf"/*.properties
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
  # The format prints the SCRAM salts and keys: not into the container's log.
  "${as_appuser[@]}" /opt/kafka/bin/kafka-storage.sh format -t "$CLUSTER_ID" -c "$props" \
    --add-scram "SCRAM-SHA-512=[name=broker,password=$PASSWORD_BROKER]" \
    --add-scram "SCRAM-SHA-512=[name=admin,password=$PASSWORD_ADMIN]" > /dev/null
fi
exec "${as_appuser[@]}" /opt/kafka/bin/kafka-server-start.sh "$props"
