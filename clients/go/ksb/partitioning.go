package ksb

import (
	"crypto/rand"
	"crypto/sha1"
	"fmt"
	"hash/crc32"
)

// Partition is where a record keyed by key goes among n partitions: zlib's CRC-32 of the key,
// modulo n (librdkafka's default partitioner, and shared/ksb/wire/partitioning.py). A request
// keyed by its conversation group then reaches the dispatcher that owns the group's shard
// without a relay hop; a group's messages live in that partition of its queue topic.
func Partition(key string, n int) int {
	return int(crc32.ChecksumIEEE([]byte(key)) % uint32(n))
}

// targetNamespace is the UUID namespace of target handles (docs/protocol.md, Conversation
// handles).
var targetNamespace = [16]byte{0x6b, 0x7a, 0x1c, 0x2e, 0x5f, 0x44, 0x4f, 0x0e, 0x9a, 0x51, 0x0c, 0x1b, 0x7d, 0x1e, 0x3a, 0x10}

// TargetHandle is the handle of a conversation's target endpoint, derived from the
// conversation id (the initiator's handle): uuid5(namespace, conversation id), RFC 4122.
func TargetHandle(conversationID string) string {
	h := sha1.New()
	h.Write(targetNamespace[:])
	h.Write([]byte(conversationID))
	var u [16]byte
	copy(u[:], h.Sum(nil))
	u[6] = (u[6] & 0x0f) | 0x50 // version 5
	u[8] = (u[8] & 0x3f) | 0x80 // RFC 4122 variant
	return format(u)
}

// NewUUID is a random (version 4) UUID: handles and request ids.
func NewUUID() string {
	var u [16]byte
	if _, err := rand.Read(u[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	u[6] = (u[6] & 0x0f) | 0x40
	u[8] = (u[8] & 0x3f) | 0x80
	return format(u)
}

func format(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}
