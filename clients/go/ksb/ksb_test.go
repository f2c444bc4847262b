package ksb

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
)

// The figures below are shared/ksb/wire/partitioning.py's answers (zlib.crc32, uuid.uuid5).
func TestPartitionIsZlibCRC32(t *testing.T) {
	cases := map[string][]int{
		"5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10": {0, 1, 2, 4, 3},
		"a":                                    {0, 1, 0, 4, 3},
		"group-7":                              {0, 1, 2, 6, 13},
		"":                                     {0, 0, 0, 0, 0},
	}
	for key, want := range cases {
		for i, n := range []int{1, 2, 3, 7, 16} {
			if got := Partition(key, n); got != want[i] {
				t.Errorf("Partition(%q, %d) = %d, Python says %d", key, n, got, want[i])
			}
		}
	}
}

func TestTargetHandleIsTheDocumentedUUID5(t *testing.T) {
	for conv, want := range map[string]string{
		"5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10": "8b8bfa2e-5442-578f-96b6-3d3d0b4162f7",
		"x":                                    "f43a5ab1-17a3-5a5f-b7fd-dcbc1c17d16c",
	} {
		if got := TargetHandle(conv); got != want {
			t.Errorf("TargetHandle(%q) = %s, want %s", conv, got, want)
		}
	}
}

func TestNewUUIDIsVersion4(t *testing.T) {
	re := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	a, b := NewUUID(), NewUUID()
	if !re.MatchString(a) || a == b {
		t.Fatalf("NewUUID: %s, %s", a, b)
	}
}

// A commit record carries exactly the fields of docs/protocol.md: the dispatcher refuses any
// other (and a null where an array is required).
func TestCommitRecordFields(t *testing.T) {
	send := NewSend("h1", "//t/Reply", []byte("reply"))
	send.ConvGroup = "g1"
	end := NewEnd("h2")
	c := NewCommit("r", &Receipt{Queue: "Q", Group: "g1", MessageIDs: []string{"h1:0"}, Token: 7, Lease: "a.b"},
		[]Action{send, end})
	raw, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	if got["v"] != 1.0 || got["kind"] != "commit" || got["reader"] != "r" {
		t.Fatalf("head: %s", raw)
	}
	receipt := got["receipt"].(map[string]any)
	if receipt["lease"] != "a.b" || receipt["token"] != 7.0 || receipt["group"] != "g1" {
		t.Fatalf("receipt: %s", raw)
	}
	actions := got["actions"].([]any)
	first, second := actions[0].(map[string]any), actions[1].(map[string]any)
	if first["kind"] != "send" || first["body"] != "reply" || first["group"] != "g1" {
		t.Fatalf("send action: %s", raw)
	}
	if _, has := first["body_b64"]; has {
		t.Fatalf("a text body travels as body only: %s", raw)
	}
	if second["kind"] != "end" || second["handle"] != "h2" || len(second) != 4 {
		t.Fatalf("end action (v, kind, request_id, handle only): %s", raw)
	}
	empty, _ := json.Marshal(NewCommit("", nil, nil))
	if !strings.Contains(string(empty), `"actions":[]`) || strings.Contains(string(empty), "receipt") {
		t.Fatalf("an empty commit: %s", empty)
	}
}

func TestBinaryBodiesTravelAsBase64(t *testing.T) {
	raw, _ := json.Marshal(NewSend("h", "DEFAULT", []byte{0xff, 0x00}))
	if !strings.Contains(string(raw), `"body_b64":"/wA="`) || strings.Contains(string(raw), `"body":`) {
		t.Fatalf("binary body: %s", raw)
	}
}

func TestTopicsFollowTheStacksSecurity(t *testing.T) {
	c := Config{Instance: "i", SecurityProtocol: "SASL_PLAINTEXT", Username: "app"}
	if c.RequestsTopic() != "ksb.i.requests.app" || c.ErrorsTopic() != "ksb.i.errors.app" {
		t.Fatal(c.RequestsTopic(), c.ErrorsTopic())
	}
	c.SecurityProtocol = "PLAINTEXT"
	if c.RequestsTopic() != "ksb.i.requests" || c.ErrorsTopic() != "ksb.i.errors" {
		t.Fatal(c.RequestsTopic(), c.ErrorsTopic())
	}
}

func TestConfigRefusesAnIncompleteLogin(t *testing.T) {
	c := Config{Instance: "i", Bootstrap: []string{"b:1"}, QueueAddresses: []string{"q:1"},
		SecurityProtocol: "SASL_PLAINTEXT", SASLMechanism: "SCRAM-SHA-512", Username: "app"}
	if err := c.Check(); err == nil || !strings.Contains(err.Error(), "KSB_KAFKA_PASSWORD") {
		t.Fatalf("no password: %v", err)
	}
	c.Password = "p"
	if err := c.Check(); err != nil {
		t.Fatal(err)
	}
}
