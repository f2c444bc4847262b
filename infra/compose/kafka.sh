#!/bin/bash
# Kafka (KRaft, one node) secured as the local stack is (devtools/kafka_node.py): SASL/SCRAM-SHA-512
# on the client listeners, SASL/PLAIN on the controller's, the StandardAuthorizer denying what no
# ACL allows, and only `broker` and `admin` as super users, both bootstrapped by the storage format.
# Passwords come from the environment (compose's git-ignored .env); the properties file that holds
# the broker's is written 0600 inside the container.
set -euo pipefail
: "${PASSWORD_BROKER:?}" "${PASSWORD_ADMIN:?}" "${CLUSTER_ID:?}"
umask 077
props=/tmp/server.properties
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
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
default.replication.factor=1
min.insync.replicas=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
group.consumer.assignors=uniform,range,dev.ksb.kafka.StickyShardAssignor
PROPS
# The health check's login (the admin's).
cat > /tmp/admin.properties <<PROPS
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$PASSWORD_ADMIN";
PROPS
# KSB's assignor (built into the image, infra/kafka/Dockerfile); kafka-run-class.sh adds its own jars
# after. The storage format needs it too: it checks the properties, which name the assignor.
export CLASSPATH=/opt/ksb/assignor/ksb-kafka-assignor.jar
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
  # The format prints the SCRAM salts and keys: not into the container's log.
  /opt/kafka/bin/kafka-storage.sh format -t "$CLUSTER_ID" -c "$props" \
    --add-scram "SCRAM-SHA-512=[name=broker,password=$PASSWORD_BROKER]" \
    --add-scram "SCRAM-SHA-512=[name=admin,password=$PASSWORD_ADMIN]" > /dev/null
fi
exec /opt/kafka/bin/kafka-server-start.sh "$props"
