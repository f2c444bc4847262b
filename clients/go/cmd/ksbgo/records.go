package main

import (
	"context"
	"flag"
	"strconv"
	"time"

	"ksb/clients/go/ksb"
)

type heldSummary struct {
	Lease        string   `json:"lease"`
	Token        int64    `json:"token"`
	Group        string   `json:"group"`
	IDs          []string `json:"ids"`
	DeadLettered []string `json:"dead_lettered"`
}

// receiveOnce RECEIVEs once (WHERE --group, when given), prints the lease it got, and rolls
// back: a lease whose lock is let go, for tests of what a released lease still does.
func receiveOnce(ctx context.Context, cfg ksb.Config, args []string) (any, error) {
	fs := flag.NewFlagSet("receive", flag.ExitOnError)
	queue := fs.String("queue", "TargetQueue", "the queue to RECEIVE from")
	group := fs.String("group", "", "WHERE conversation_group_id = this")
	wait := fs.Duration("wait", 10*time.Second, "WAITFOR")
	_ = fs.Parse(args)
	client, err := ksb.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer client.Close(context.Background())
	tx := client.Transaction()
	msgs, err := tx.Receive(ctx, *queue, ksb.ReceiveOptions{WaitFor: *wait, Group: *group})
	if err != nil {
		return nil, err
	}
	out := heldSummary{Lease: tx.Lease(), Token: tx.Token(), Group: tx.Group(), IDs: ids(msgs)}
	if out.DeadLettered, err = tx.Rollback(ctx); err != nil {
		return nil, err
	}
	return out, nil
}

type recordSummary struct {
	outcome
	Applied *bool `json:"applied,omitempty"`
	// The Commit call's answer, when --outcome asked for it (the lease is this principal's).
	Call *outcome `json:"call,omitempty"`
}

// commitRecord produces one commit record with the receipt the flags describe, whatever its
// lease, and reports what came of it: the Commit call's outcome (--outcome: the lease is our
// own) or the error record on our errors topic.
func commitRecord(ctx context.Context, cfg ksb.Config, args []string) (any, error) {
	fs := flag.NewFlagSet("commit-record", flag.ExitOnError)
	queue := fs.String("queue", "TargetQueue", "the receipt's queue")
	group := fs.String("group", "", "the receipt's group")
	token := fs.String("token", "0", "the receipt's token")
	lease := fs.String("lease", "", "the receipt's lease")
	idList := fs.String("ids", "", "the receipt's message ids, comma-separated")
	askOutcome := fs.Bool("outcome", false, "ask the queue service for the outcome under --lease")
	wait := fs.Duration("wait", 20*time.Second, "how long to wait for the outcome or refusal")
	_ = fs.Parse(args)
	tok, err := strconv.ParseInt(*token, 10, 64)
	if err != nil {
		return nil, err
	}
	client, err := ksb.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer client.Close(context.Background())
	receipt := &ksb.Receipt{Queue: *queue, Group: *group, Token: tok, Lease: *lease, MessageIDs: splitIDs(*idList)}
	if !*askOutcome {
		refusals, err := ksb.NewErrors(cfg)
		if err != nil {
			return nil, err
		}
		defer refusals.Close()
		a := &attacker{client: client, errors: refusals, wait: *wait}
		return recordSummary{outcome: a.commitRecord(ctx, receipt)}, nil
	}
	record := ksb.NewCommit(client.Reader, receipt, nil)
	if err := client.Requests.Produce(ctx, *group, record); err != nil {
		return nil, err
	}
	reply, err := ksb.Outcome(ctx, client.Queues, *lease, record.RequestID, *wait)
	out := recordSummary{outcome: outcome{RequestID: record.RequestID}}
	call := refusal(err)
	if reply != nil {
		applied := reply.GetApplied()
		out.Applied, call = &applied, outcome{GRPC: "OK", Reason: reply.GetReason()}
	}
	out.Call = &call
	return out, nil
}
