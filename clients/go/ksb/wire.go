package ksb

import (
	"encoding/base64"
	"encoding/json"
	"unicode/utf8"
)

// The requests of docs/protocol.md ("Requests"), as the dispatcher parses them: strictly, so
// every field here is one the page lists, and the optional ones are left out when unset.

// Action is a request that may also be one of a commit record's actions.
type Action interface {
	// Group is the conversation group the request acts on: its key (docs/protocol.md, Ordering).
	Group() string
	action()
}

// Begin is BEGIN DIALOG CONVERSATION.
type Begin struct {
	V                   int    `json:"v"`
	Kind                string `json:"kind"`
	RequestID           string `json:"request_id"`
	Handle              string `json:"handle"`
	FromService         string `json:"from_service"`
	ToService           string `json:"to_service"`
	Contract            string `json:"contract,omitempty"`
	LifetimeS           int    `json:"lifetime_s,omitempty"`
	RelatedConversation string `json:"related_conversation,omitempty"`
	ConversationGroupID string `json:"conversation_group_id,omitempty"`
}

// NewBegin is a BEGIN of a new dialog whose initiator handle is a fresh UUID.
func NewBegin(from, to, contract string) *Begin {
	return &Begin{V: 1, Kind: "begin", RequestID: NewUUID(), Handle: NewUUID(),
		FromService: from, ToService: to, Contract: contract}
}

// Group of a BEGIN: the group it names, else its own handle (a new dialog's group). A BEGIN
// related to another conversation is keyed by that conversation's group, which only the
// caller knows: it sets ConversationGroupID too.
func (b *Begin) Group() string {
	if b.ConversationGroupID != "" {
		return b.ConversationGroupID
	}
	return b.Handle
}
func (*Begin) action() {}

// Send is SEND ON CONVERSATION: one message on each of Handles.
type Send struct {
	V           int      `json:"v"`
	Kind        string   `json:"kind"`
	RequestID   string   `json:"request_id"`
	Handles     []string `json:"handles"`
	MessageType string   `json:"message_type,omitempty"`
	Body        *string  `json:"body,omitempty"`
	BodyB64     *string  `json:"body_b64,omitempty"`
	// ConvGroup names the conversation's group when it is not the handle (a commit's action
	// on a conversation begun in a named or related group).
	ConvGroup string `json:"group,omitempty"`
}

// NewSend is a SEND of body on handle; text travels as `body`, anything else as `body_b64`.
func NewSend(handle, messageType string, body []byte) *Send {
	s := &Send{V: 1, Kind: "send", RequestID: NewUUID(), Handles: []string{handle}, MessageType: messageType}
	if utf8.Valid(body) {
		text := string(body)
		s.Body = &text
	} else {
		b64 := base64.StdEncoding.EncodeToString(body)
		s.BodyB64 = &b64
	}
	return s
}

// Group of a SEND: the group it names, else its first handle.
func (s *Send) Group() string {
	if s.ConvGroup != "" {
		return s.ConvGroup
	}
	return s.Handles[0]
}
func (*Send) action() {}

// End is END CONVERSATION (WITH ERROR when ErrorCode is set, WITH CLEANUP when Cleanup).
type End struct {
	V                int    `json:"v"`
	Kind             string `json:"kind"`
	RequestID        string `json:"request_id"`
	Handle           string `json:"handle"`
	ErrorCode        *int   `json:"error_code,omitempty"`
	ErrorDescription string `json:"error_description,omitempty"`
	Cleanup          bool   `json:"cleanup,omitempty"`
	ConvGroup        string `json:"group,omitempty"`
}

// NewEnd ends the conversation of handle.
func NewEnd(handle string) *End {
	return &End{V: 1, Kind: "end", RequestID: NewUUID(), Handle: handle}
}

// Group of an END: the group it names, else its handle.
func (e *End) Group() string {
	if e.ConvGroup != "" {
		return e.ConvGroup
	}
	return e.Handle
}
func (*End) action() {}

// Receipt is what a transaction received under one group lock, and the lease of that lock.
type Receipt struct {
	Queue      string   `json:"queue"`
	Group      string   `json:"group"`
	MessageIDs []string `json:"message_ids"`
	Token      int64    `json:"token"`
	Lease      string   `json:"lease,omitempty"`
}

// Commit is a reader's transaction: its receipt and its actions, applied all or nothing.
type Commit struct {
	V         int      `json:"v"`
	Kind      string   `json:"kind"`
	RequestID string   `json:"request_id"`
	Reader    string   `json:"reader,omitempty"`
	Receipt   *Receipt `json:"receipt,omitempty"`
	Actions   []Action `json:"actions"`
}

// NewCommit is a commit record of receipt (nil: actions only) and actions.
func NewCommit(reader string, receipt *Receipt, actions []Action) *Commit {
	if actions == nil {
		actions = []Action{}
	}
	return &Commit{V: 1, Kind: "commit", RequestID: NewUUID(), Reader: reader, Receipt: receipt, Actions: actions}
}

// Group of a commit: its receipt's group, else its first action's.
func (c *Commit) Group() string {
	if c.Receipt != nil {
		return c.Receipt.Group
	}
	if len(c.Actions) > 0 {
		return c.Actions[0].Group()
	}
	return ""
}

// ErrorRecord is a record of the principal's errors topic: a request that was refused.
type ErrorRecord struct {
	Kind      string `json:"kind"`
	RequestID string `json:"request_id"`
	Code      string `json:"code"`
	Reason    string `json:"reason"`
	Handle    string `json:"handle,omitempty"`
}

// Marshal is the request's JSON value, as it travels.
func Marshal(request any) ([]byte, error) { return json.Marshal(request) }
