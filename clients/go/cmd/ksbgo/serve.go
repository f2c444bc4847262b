package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"time"

	queuev1 "ksb/clients/go/api/queue/v1"
	"ksb/clients/go/ksb"
)

// received is one request message a committed transaction received.
type received struct {
	ID             string `json:"id"`
	ConversationID string `json:"conversation_id"`
	Handle         string `json:"handle"`
	Group          string `json:"group"`
	Conv           int    `json:"conv"`
	N              int    `json:"n"`
}

type rollbackCheck struct {
	Group           string   `json:"group"`
	Before          []string `json:"before"`
	After           []string `json:"after"`
	DeadLettered    []string `json:"dead_lettered"`
	AfterAllOfGroup bool     `json:"after_all_of_group"`
}

type groupCheck struct {
	Group         string `json:"group"`
	Messages      int    `json:"messages"`
	AllOfGroup    bool   `json:"all_of_group"`
	SecondReceive int    `json:"second_receive_new"`
	Duplicates    int    `json:"second_receive_duplicates"`
}

type lingerCheck struct {
	HeldMS   int64 `json:"held_ms"`
	Messages int   `json:"messages"`
	Applied  bool  `json:"applied"`
}

type serveSummary struct {
	Received  []received     `json:"received"`
	Commits   int            `json:"commits"`
	Refused   []string       `json:"refused"`
	Rollback  *rollbackCheck `json:"rollback"`
	GetGroup  *groupCheck    `json:"get_conversation_group"`
	Linger    *lingerCheck   `json:"linger,omitempty"`
	Replies   int            `json:"replies"`
	ElapsedMS int64          `json:"elapsed_ms"`
}

type server struct {
	client    *ksb.Client
	queue     string
	replyType string
	wait      time.Duration
	summary   serveSummary
}

// serve is a target: it RECEIVEs request messages under a group lock, replies to each inside
// the transaction (a send action of the commit record), and COMMITs, until it has received
// expect messages or nothing came for idle. First it checks ROLLBACK (the messages come back,
// found again WHERE conversation_group_id), GET CONVERSATION GROUP (lock_only, then RECEIVE
// and a second RECEIVE in the same transaction), and, with --linger, a transaction held past
// the lock's TTL while the client renews it.
func serve(ctx context.Context, cfg ksb.Config, args []string) (any, error) {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	queue := fs.String("queue", "TargetQueue", "the queue to RECEIVE from")
	replyType := fs.String("reply-type", "//t/Reply", "the replies' message type ('' for none)")
	expect := fs.Int("expect", 20, "request messages to receive before stopping")
	idle := fs.Duration("idle", 30*time.Second, "stop when nothing came for this long")
	wait := fs.Duration("wait", 2*time.Second, "WAITFOR of each RECEIVE")
	linger := fs.Duration("linger", 0, "hold one transaction this long before its commit (0: none)")
	_ = fs.Parse(args)

	client, err := ksb.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer client.Close(context.Background())
	s := &server{client: client, queue: *queue, replyType: *replyType, wait: *wait,
		summary: serveSummary{Received: []received{}, Refused: []string{}}}
	start := time.Now()
	if err := s.rollbackAndWhere(ctx, *idle); err != nil {
		return nil, fmt.Errorf("rollback check: %w", err)
	}
	if err := s.getConversationGroup(ctx, *idle); err != nil {
		return nil, fmt.Errorf("GET CONVERSATION GROUP check: %w", err)
	}
	if *linger > 0 {
		if err := s.lingering(ctx, *linger, *idle); err != nil {
			return nil, fmt.Errorf("long transaction: %w", err)
		}
	}
	last := time.Now()
	for len(s.summary.Received) < *expect && time.Since(last) < *idle {
		tx := client.Transaction()
		msgs, err := tx.Receive(ctx, s.queue, ksb.ReceiveOptions{WaitFor: s.wait})
		if err != nil {
			return nil, err
		}
		if len(msgs) == 0 {
			continue
		}
		last = time.Now()
		if err := s.replyAndCommit(ctx, tx, msgs); err != nil {
			return nil, err
		}
	}
	s.summary.ElapsedMS = ms(time.Since(start))
	return s.summary, nil
}

// firstReceive waits (up to idle) for a transaction to lock a group with messages.
func (s *server) firstReceive(ctx context.Context, idle time.Duration, o ksb.ReceiveOptions) (*ksb.Transaction, []*queuev1.Message, error) {
	deadline := time.Now().Add(idle)
	o.WaitFor = s.wait
	for time.Now().Before(deadline) {
		tx := s.client.Transaction()
		msgs, err := tx.Receive(ctx, s.queue, o)
		if err != nil {
			return nil, nil, err
		}
		if len(msgs) > 0 {
			return tx, msgs, nil
		}
		if tx.Lease() != "" { // locked a group whose messages went meanwhile
			if _, err := tx.Rollback(ctx); err != nil {
				return nil, nil, err
			}
		}
	}
	return nil, nil, errors.New("no message came in time")
}

func (s *server) rollbackAndWhere(ctx context.Context, idle time.Duration) error {
	tx, before, err := s.firstReceive(ctx, idle, ksb.ReceiveOptions{})
	if err != nil {
		return err
	}
	check := &rollbackCheck{Group: tx.Group(), Before: ids(before)}
	if check.DeadLettered, err = tx.Rollback(ctx); err != nil {
		return err
	}
	again, after, err := s.firstReceive(ctx, idle, ksb.ReceiveOptions{Group: check.Group})
	if err != nil {
		return fmt.Errorf("the rolled back group %s: %w", check.Group, err)
	}
	check.After = ids(after)
	check.AfterAllOfGroup = again.Group() == check.Group
	for _, m := range after {
		check.AfterAllOfGroup = check.AfterAllOfGroup && m.GetConversationGroupId() == check.Group
	}
	if check.DeadLettered == nil {
		check.DeadLettered = []string{}
	}
	s.summary.Rollback = check
	return s.replyAndCommit(ctx, again, after)
}

func (s *server) getConversationGroup(ctx context.Context, idle time.Duration) error {
	deadline := time.Now().Add(idle)
	for time.Now().Before(deadline) {
		tx := s.client.Transaction()
		group, err := tx.GetConversationGroup(ctx, s.queue, s.wait)
		if err != nil {
			return err
		}
		if group == "" {
			continue
		}
		check := &groupCheck{Group: group}
		msgs, err := tx.Receive(ctx, s.queue, ksb.ReceiveOptions{Top: 1})
		if err != nil {
			return err
		}
		more, err := tx.Receive(ctx, s.queue, ksb.ReceiveOptions{})
		if err != nil {
			return err
		}
		check.AllOfGroup = len(msgs) > 0
		for _, m := range append(append([]*queuev1.Message{}, msgs...), more...) {
			check.AllOfGroup = check.AllOfGroup && m.GetConversationGroupId() == group
		}
		first := map[string]bool{}
		for _, m := range msgs {
			first[m.GetMessageId()] = true
		}
		for _, m := range more {
			if first[m.GetMessageId()] {
				check.Duplicates++
			}
		}
		check.Messages, check.SecondReceive = len(msgs), len(more)
		s.summary.GetGroup = check
		return s.replyAndCommit(ctx, tx, append(msgs, more...))
	}
	return errors.New("no group ready in time")
}

func (s *server) lingering(ctx context.Context, hold, idle time.Duration) error {
	tx, msgs, err := s.firstReceive(ctx, idle, ksb.ReceiveOptions{})
	if err != nil {
		return err
	}
	start := time.Now()
	select {
	case <-time.After(hold):
	case <-ctx.Done():
		return ctx.Err()
	}
	check := &lingerCheck{HeldMS: ms(time.Since(start)), Messages: len(msgs)}
	s.summary.Linger = check
	commits := s.summary.Commits
	if err := s.replyAndCommit(ctx, tx, msgs); err != nil {
		return err
	}
	check.Applied = s.summary.Commits > commits
	return nil
}

// replyAndCommit replies to each request inside the transaction and commits: the receipt and
// the replies are one commit record, applied all or nothing. Only a committed transaction's
// messages count as received.
func (s *server) replyAndCommit(ctx context.Context, tx *ksb.Transaction, msgs []*queuev1.Message) error {
	var got []received
	replies := 0
	for _, m := range msgs {
		var body struct{ Conv, N int }
		if err := json.Unmarshal(m.GetMessageBody(), &body); err != nil {
			return fmt.Errorf("message %s: body %q: %w", m.GetMessageId(), m.GetMessageBody(), err)
		}
		got = append(got, received{ID: m.GetMessageId(), ConversationID: m.GetConversationId(),
			Handle: m.GetConversationHandle(), Group: m.GetConversationGroupId(), Conv: body.Conv, N: body.N})
		if s.replyType != "" {
			reply, _ := json.Marshal(map[string]int{"conv": body.Conv, "n": body.N})
			tx.Send(m.GetConversationHandle(), s.replyType, reply)
			replies++
		}
	}
	_, err := tx.Commit(ctx, 30*time.Second)
	var refused *ksb.CommitRefused
	if errors.As(err, &refused) {
		log.Printf("commit refused: %s", refused.Reason)
		s.summary.Refused = append(s.summary.Refused, refused.Reason)
		return nil
	}
	if err != nil {
		return err
	}
	s.summary.Commits++
	s.summary.Replies += replies
	s.summary.Received = append(s.summary.Received, got...)
	return nil
}

func ids(msgs []*queuev1.Message) []string {
	out := make([]string, 0, len(msgs))
	for _, m := range msgs {
		out = append(out, m.GetMessageId())
	}
	return out
}
