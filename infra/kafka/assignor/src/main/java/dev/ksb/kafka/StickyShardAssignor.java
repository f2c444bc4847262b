package dev.ksb.kafka;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

import org.apache.kafka.common.Uuid;
import org.apache.kafka.coordinator.group.api.assignor.ConsumerGroupPartitionAssignor;
import org.apache.kafka.coordinator.group.api.assignor.GroupAssignment;
import org.apache.kafka.coordinator.group.api.assignor.GroupSpec;
import org.apache.kafka.coordinator.group.api.assignor.MemberAssignment;
import org.apache.kafka.coordinator.group.api.assignor.MemberSubscription;
import org.apache.kafka.coordinator.group.api.assignor.SubscribedTopicDescriber;

/**
 * The KSB dispatchers' server-side assignor (KIP-848): partition {@code p} of every subscribed
 * topic goes to the owner of shard {@code p}, and a shard stays with its owner while the members
 * come and go.
 *
 * <p>Why: a dispatcher owns a shard whole (partition {@code p} of the requests, relay and inbound
 * topics and of each queue's topic), so every topic must be split the same way. Kafka's own
 * {@code range} assignor does split them alike, but in Kafka 4.2 it hands out contiguous ranges
 * over the members sorted by id, so when one of three dispatchers dies the survivors' shards move
 * between them too, and every shard that moves stands still while its new owner rebuilds it
 * (the failover bench saw a survivor's shard silent 3 to 13 s). Here each member keeps its shards
 * up to its fair share (the shard count over the member count, one more for the first few), and
 * only shards without an owner, or over a share, are handed out, each to the member with the
 * fewest.
 */
public final class StickyShardAssignor implements ConsumerGroupPartitionAssignor {
    /** What a member asks for in {@code group.remote.assignor}. */
    public static final String NAME = "ksb-sticky-shards";

    @Override
    public String name() {
        return NAME;
    }

    @Override
    public GroupAssignment assign(GroupSpec group, SubscribedTopicDescriber topics) {
        List<String> members = sortedMembers(group);
        Map<Uuid, Integer> partitions = new HashMap<>();
        for (String member : members) {
            for (Uuid topic : group.memberSubscription(member).subscribedTopicIds()) {
                int count = topics.numPartitions(topic);
                if (count > 0) {
                    partitions.put(topic, count);
                }
            }
        }
        int shards = partitions.values().stream().mapToInt(Integer::intValue).max().orElse(0);
        int[] owner = place(currentOwners(group, members, shards), members.size());
        Map<String, MemberAssignment> out = new HashMap<>();
        for (int m = 0; m < members.size(); m++) {
            String member = members.get(m);
            Set<Uuid> subscribed = group.memberSubscription(member).subscribedTopicIds();
            Map<Uuid, Set<Integer>> mine = new HashMap<>();
            for (Map.Entry<Uuid, Integer> topic : partitions.entrySet()) {
                if (!subscribed.contains(topic.getKey())) {
                    continue;
                }
                Set<Integer> taken = new HashSet<>();
                for (int p = 0; p < topic.getValue(); p++) {
                    if (owner[p] == m) {
                        taken.add(p);
                    }
                }
                if (!taken.isEmpty()) {
                    mine.put(topic.getKey(), taken);
                }
            }
            out.put(member, new Assignment(mine));
        }
        return new GroupAssignment(out);
    }

    /**
     * Shard to member index, given each shard's current owner ({@code -1}: none).
     *
     * <p>Members keep their shards, lowest first, up to {@code base = shards / members}, then one
     * more each while {@code shards % members} places for one more remain; every other shard goes
     * to the member with the fewest (the first in order on a tie). Pure, so it is tested alone.
     */
    static int[] place(int[] current, int members) {
        int shards = current.length;
        int[] owner = new int[shards];
        Arrays.fill(owner, -1);
        if (members == 0) {
            return owner;
        }
        int base = shards / members;
        int extra = shards % members;
        int[] count = new int[members];
        for (int s = 0; s < shards; s++) {
            int m = current[s];
            if (m >= 0 && m < members && count[m] < base) {
                owner[s] = m;
                count[m]++;
            }
        }
        for (int s = 0; s < shards && extra > 0; s++) {
            int m = current[s];
            if (owner[s] == -1 && m >= 0 && m < members && count[m] == base) {
                owner[s] = m;
                count[m]++;
                extra--;
            }
        }
        for (int s = 0; s < shards; s++) {
            if (owner[s] != -1) {
                continue;
            }
            int best = 0;
            for (int m = 1; m < members; m++) {
                if (count[m] < count[best]) {
                    best = m;
                }
            }
            if (count[best] == base) {
                extra--;
            }
            owner[s] = best;
            count[best]++;
        }
        return owner;
    }

    /** Each shard's member index now: a member that holds partition {@code s} of any topic. */
    private static int[] currentOwners(GroupSpec group, List<String> members, int shards) {
        int[] current = new int[shards];
        Arrays.fill(current, -1);
        for (int m = 0; m < members.size(); m++) {
            MemberAssignment held = group.memberAssignment(members.get(m));
            if (held == null) {
                continue;
            }
            for (Set<Integer> partitions : held.partitions().values()) {
                for (int p : partitions) {
                    if (p < shards && current[p] == -1) {
                        current[p] = m;
                    }
                }
            }
        }
        return current;
    }

    /** By static instance id where there is one, else by member id: the same order every time. */
    private static List<String> sortedMembers(GroupSpec group) {
        List<String> members = new ArrayList<>(group.memberIds());
        members.sort(Comparator.comparing((String id) -> key(group.memberSubscription(id), id)));
        return members;
    }

    private static String key(MemberSubscription subscription, String memberId) {
        return subscription.instanceId().map(i -> "0" + i).orElse("1" + memberId);
    }

    /** A member's target: topic id to partition numbers. */
    record Assignment(Map<Uuid, Set<Integer>> partitions) implements MemberAssignment {}

    /** {@code java -cp ... dev.ksb.kafka.StickyShardAssignor 0,0,1,1,2,2 2}: the placement. */
    public static void main(String[] args) {
        int[] current =
                args[0].isEmpty()
                        ? new int[0]
                        : Arrays.stream(args[0].split(",")).mapToInt(Integer::parseInt).toArray();
        int[] owner = place(current, Integer.parseInt(args[1]));
        System.out.println(String.join(",", Arrays.stream(owner).mapToObj(Integer::toString).toList()));
    }
}
