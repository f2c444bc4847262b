package ksb

import (
	"context"
	"errors"
	"fmt"
	"time"

	queuev1 "ksb/clients/go/api/queue/v1"
)

// ReceiveOptions are RECEIVE's options: TOP, WAITFOR and WHERE.
type ReceiveOptions struct {
	Top     uint32        // at most this many messages (0: every ready message of the group)
	WaitFor time.Duration // how long to wait for a group with ready messages
	Group   string        // WHERE conversation_group_id = Group
	Handle  string        // WHERE conversation_handle = Handle
}

// Transaction is RECEIVE under one conversation-group lock, the actions taken, then COMMIT (one
// commit record, and the dispatcher's outcome through the queue service) or ROLLBACK.
type Transaction struct {
	client   *Client
	queue    string
	lease    string
	group    string
	token    int64
	received []string
	seen     map[string]bool
	actions  []Action
	done     bool
}

// Lease is the lock's lease ("" before a RECEIVE locked a group): the commit record carries it.
func (t *Transaction) Lease() string { return t.lease }

// Group is the locked conversation group ("" before a RECEIVE locked one).
func (t *Transaction) Group() string { return t.group }

// Token is the lock's fencing token (also inside the lease).
func (t *Transaction) Token() int64 { return t.token }

// Received are the ids of the messages this transaction received, in order.
func (t *Transaction) Received() []string { return append([]string(nil), t.received...) }

// Receive returns ready messages of exactly one conversation group, locked to this transaction
// until it ends; a later Receive continues with that group (it passes the lease and what was
// received). No messages and no error: nothing was ready in time.
func (t *Transaction) Receive(ctx context.Context, queue string, o ReceiveOptions) ([]*queuev1.Message, error) {
	reply, err := t.receive(ctx, queue, o, false)
	if err != nil || reply == nil {
		return nil, err
	}
	for _, m := range reply.GetMessages() {
		if !t.seen[m.GetMessageId()] {
			t.seen[m.GetMessageId()] = true
			t.received = append(t.received, m.GetMessageId())
		}
		t.client.learn(m.GetConversationHandle(), m.GetConversationGroupId())
	}
	return reply.GetMessages(), nil
}

// GetConversationGroup locks the highest-priority unlocked group with ready messages and
// returns its id ("" when none was ready in time); a later Receive returns its messages.
func (t *Transaction) GetConversationGroup(ctx context.Context, queue string, waitFor time.Duration) (string, error) {
	if _, err := t.receive(ctx, queue, ReceiveOptions{WaitFor: waitFor}, true); err != nil {
		return "", err
	}
	return t.group, nil
}

func (t *Transaction) receive(ctx context.Context, queue string, o ReceiveOptions, lockOnly bool) (*queuev1.ReceiveReply, error) {
	if t.done {
		return nil, errors.New("this transaction has already ended")
	}
	if t.queue != "" && t.queue != queue {
		return nil, errors.New("a transaction receives from one queue")
	}
	request := &queuev1.ReceiveRequest{
		Queue: queue, Top: o.Top, WaitforMs: uint32(o.WaitFor / time.Millisecond),
		ConversationGroupId: o.Group, ConversationHandle: o.Handle,
		Lease: t.lease, Received: t.received, LockOnly: lockOnly,
	}
	var reply *queuev1.ReceiveReply
	err := t.client.Queues.Call(ctx, o.WaitFor, func(ctx context.Context, s queuev1.QueueServiceClient) error {
		var err error
		reply, err = s.Receive(ctx, request)
		return err
	})
	if err != nil {
		return nil, err
	}
	if reply.GetLease() == "" {
		return nil, nil
	}
	if t.lease == "" {
		t.queue, t.lease = queue, reply.GetLease()
		t.group, t.token = reply.GetConversationGroupId(), reply.GetToken()
		t.client.Queues.Hold(t.lease)
	}
	return reply, nil
}

// Send adds a SEND on handle to the commit (a reply, typically).
func (t *Transaction) Send(handle, messageType string, body []byte) {
	s := NewSend(handle, messageType, body)
	s.ConvGroup = t.client.groupHint(handle)
	t.actions = append(t.actions, s)
}

// EndConversation adds an END on handle to the commit.
func (t *Transaction) EndConversation(handle string) {
	e := NewEnd(handle)
	e.ConvGroup = t.client.groupHint(handle)
	t.actions = append(t.actions, e)
}

// BeginDialog adds a BEGIN to the commit and returns the new conversation's handle.
func (t *Transaction) BeginDialog(from, to, contract string) string {
	b := NewBegin(from, to, contract)
	t.actions = append(t.actions, b)
	return b.Handle
}

// CommitRecord is the commit record this transaction would produce now (its request id is
// fresh each time). Exposed for tests of what the dispatcher refuses.
func (t *Transaction) CommitRecord() *Commit {
	var receipt *Receipt
	if t.lease != "" {
		receipt = &Receipt{Queue: t.queue, Group: t.group, MessageIDs: t.Received(), Token: t.token, Lease: t.lease}
		if receipt.MessageIDs == nil {
			receipt.MessageIDs = []string{}
		}
	}
	return NewCommit(t.client.Reader, receipt, t.actions)
}

// Commit confirms the lock is still held (renewing it), produces the commit record to the
// principal's requests topic keyed by the group, then asks the queue service for the
// dispatcher's outcome, waiting up to wait. A refused commit is a *CommitRefused; a lock no
// longer held, *LockLost (nothing was produced then).
func (t *Transaction) Commit(ctx context.Context, wait time.Duration) (*queuev1.CommitReply, error) {
	if t.done {
		return nil, errors.New("this transaction has already ended")
	}
	t.done = true
	q := t.client.Queues
	record := t.CommitRecord()
	if t.lease == "" {
		if len(t.actions) == 0 {
			return nil, nil
		}
		return nil, t.client.Requests.Produce(ctx, record.Group(), record)
	}
	defer q.LetGo(t.lease)
	if err := t.confirmLock(ctx); err != nil {
		return nil, err
	}
	if err := t.client.Requests.Produce(ctx, record.Group(), record); err != nil {
		// Not stored, so no outcome will come: let the group go now.
		_ = q.Call(ctx, 0, func(ctx context.Context, s queuev1.QueueServiceClient) error {
			_, err := s.Rollback(ctx, &queuev1.RollbackRequest{Lease: t.lease})
			return err
		})
		return nil, err
	}
	return Outcome(ctx, q, t.lease, record.RequestID, wait)
}

// Outcome asks the queue service for the outcome of the commit record requestID produced
// under lease, waiting up to wait for the dispatcher to apply or refuse it.
func Outcome(ctx context.Context, q *QueueService, lease, requestID string, wait time.Duration) (*queuev1.CommitReply, error) {
	var reply *queuev1.CommitReply
	err := q.Call(ctx, wait, func(ctx context.Context, s queuev1.QueueServiceClient) error {
		var err error
		reply, err = s.Commit(ctx, &queuev1.CommitRequest{
			Lease: lease, RequestId: requestID, TimeoutMs: uint32(wait / time.Millisecond)})
		return err
	})
	if err != nil {
		return nil, err
	}
	if !reply.GetApplied() {
		return reply, &CommitRefused{Reason: reply.GetReason()}
	}
	return reply, nil
}

func (t *Transaction) confirmLock(ctx context.Context) error {
	q := t.client.Queues
	if !q.StillHeld(t.lease) {
		return &LockLost{Group: t.group}
	}
	held, err := q.Renew(ctx, t.lease)
	if err != nil {
		return fmt.Errorf("could not confirm the lock on group %s: %w", t.group, err)
	}
	if len(held) != 1 || !held[0] {
		return &LockLost{Group: t.group}
	}
	return nil
}

// Rollback releases the lock: the messages are ready again, untouched. It returns the ids a
// dead-letter policy moved aside.
func (t *Transaction) Rollback(ctx context.Context) ([]string, error) {
	if t.done {
		return nil, errors.New("this transaction has already ended")
	}
	t.done = true
	if t.lease == "" {
		return nil, nil
	}
	defer t.client.Queues.LetGo(t.lease)
	var reply *queuev1.RollbackReply
	err := t.client.Queues.Call(ctx, 0, func(ctx context.Context, s queuev1.QueueServiceClient) error {
		var err error
		reply, err = s.Rollback(ctx, &queuev1.RollbackRequest{Lease: t.lease, MessageIds: t.received})
		return err
	})
	if err != nil {
		return nil, err
	}
	return reply.GetDeadLettered(), nil
}
