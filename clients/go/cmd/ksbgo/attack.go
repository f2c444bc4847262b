package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/metadata"

	queuev1 "ksb/clients/go/api/queue/v1"
	"ksb/clients/go/ksb"
)

// outcome is what one attempt got: the queue service's answer to a call, and for a commit
// record, the dispatcher's error record on the attacker's own errors topic.
type outcome struct {
	GRPC        string `json:"grpc,omitempty"`
	Kind        string `json:"kind,omitempty"`
	Reason      string `json:"reason,omitempty"`
	RequestID   string `json:"request_id,omitempty"`
	ErrorCode   string `json:"error_code,omitempty"`
	ErrorReason string `json:"error_reason,omitempty"`
}

type attackSummary struct {
	Principal string `json:"principal"`
	// Another principal's lease, in a commit record of ours, and in our calls.
	StolenCommit  outcome `json:"stolen_commit"`
	StolenOutcome outcome `json:"stolen_outcome_call"`
	StolenRenew   outcome `json:"stolen_renew"`
	// Our own lease with its claims changed (a higher token), and with its seal changed.
	OwnGroup       string  `json:"own_group"`
	ForgedClaims   outcome `json:"forged_claims_commit"`
	ForgedClaimsRx outcome `json:"forged_claims_receive"`
	ForgedSeal     outcome `json:"forged_seal_commit"`
	ForgedSealCall outcome `json:"forged_seal_outcome_call"`
	// Logins the queue service must refuse, and a queue we may not RECEIVE from.
	NoPassword    outcome `json:"no_password"`
	WrongPassword outcome `json:"wrong_password"`
	NoPrincipal   outcome `json:"no_principal"`
	NotGranted    outcome `json:"not_granted"`
}

// attack does, as its own principal, what KSB must refuse: commit under another principal's
// lease, under a lease whose claims or seal it changed, RECEIVE without a password or with a
// wrong one, and RECEIVE on a queue it has no RECEIVE grant on. It prints what each got.
func attack(ctx context.Context, cfg ksb.Config, args []string) (any, error) {
	fs := flag.NewFlagSet("attack", flag.ExitOnError)
	stolen := fs.String("stolen-lease", "", "a lease another principal's RECEIVE got")
	stolenIDs := fs.String("stolen-ids", "", "the ids of the messages it locked, comma-separated")
	queue := fs.String("queue", "TargetQueue", "a queue this principal may RECEIVE from")
	notGranted := fs.String("not-granted", "InitiatorQueue", "a queue this principal may not RECEIVE from")
	wait := fs.Duration("wait", 20*time.Second, "how long to wait for a refusal to be written")
	_ = fs.Parse(args)
	if *stolen == "" {
		return nil, errors.New("--stolen-lease is required")
	}
	client, err := ksb.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	defer client.Close(context.Background())
	refusals, err := ksb.NewErrors(cfg)
	if err != nil {
		return nil, err
	}
	defer refusals.Close()
	a := &attacker{client: client, errors: refusals, wait: *wait}
	s := attackSummary{Principal: cfg.ActingPrincipal()}

	// 1. Our own lease, changed (first: the group we lock is then surely not the stolen one): a higher token in its claims, then one byte of its seal.
	tx := client.Transaction()
	msgs, err := tx.Receive(ctx, *queue, ksb.ReceiveOptions{WaitFor: 10 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("RECEIVE for a lease of our own: %w", err)
	}
	if len(msgs) == 0 {
		return nil, fmt.Errorf("nothing to RECEIVE in %s for a lease of our own", *queue)
	}
	s.OwnGroup = tx.Group()
	own := tx.CommitRecord().Receipt
	raised, err := withClaims(own.Lease, func(c map[string]any) { c["token"] = float64(own.Token + 1_000_000) })
	if err != nil {
		return nil, err
	}
	forgedClaims := *own
	forgedClaims.Lease, forgedClaims.Token = raised, own.Token+1_000_000
	s.ForgedClaims = a.commitRecord(ctx, &forgedClaims)
	s.ForgedClaimsRx = a.call(ctx, func(ctx context.Context, q queuev1.QueueServiceClient) error {
		_, err := q.Receive(ctx, &queuev1.ReceiveRequest{Queue: *queue, Lease: raised})
		return err
	})
	forgedSeal := *own
	forgedSeal.Lease = flipSealChar(own.Lease)
	s.ForgedSeal = a.commitRecord(ctx, &forgedSeal)
	s.ForgedSealCall = a.outcomeCall(ctx, forgedSeal.Lease)
	if _, err := tx.Rollback(ctx); err != nil {
		return nil, fmt.Errorf("rolling back our own transaction: %w", err)
	}

	// 2. Another principal's lease: its claims are readable (not secret, only sealed), so the
	// commit record names its queue, group, token and messages exactly as its holder would.
	claims, err := readClaims(*stolen)
	if err != nil {
		return nil, fmt.Errorf("the stolen lease: %w", err)
	}
	receipt := &ksb.Receipt{Queue: claims.Queue, Group: claims.Group, Token: claims.Token,
		Lease: *stolen, MessageIDs: splitIDs(*stolenIDs)}
	s.StolenCommit = a.commitRecord(ctx, receipt)
	s.StolenOutcome = a.outcomeCall(ctx, *stolen)
	s.StolenRenew = a.call(ctx, func(ctx context.Context, q queuev1.QueueServiceClient) error {
		_, err := q.RenewLocks(ctx, &queuev1.RenewLocksRequest{Leases: []string{*stolen}})
		return err
	})

	// 3. Logins the service must refuse, and a queue without a RECEIVE grant.
	receive := func(queue string) func(context.Context, queuev1.QueueServiceClient) error {
		return func(ctx context.Context, q queuev1.QueueServiceClient) error {
			_, err := q.Receive(ctx, &queuev1.ReceiveRequest{Queue: queue})
			return err
		}
	}
	principal := cfg.ActingPrincipal()
	s.NoPassword = a.callAs(ctx, metadata.Pairs("ksb-principal", principal), receive(*queue))
	s.WrongPassword = a.callAs(ctx, metadata.Pairs("ksb-principal", principal, "ksb-password", "not-the-password"), receive(*queue))
	s.NoPrincipal = a.callAs(ctx, metadata.MD{}, receive(*queue))
	s.NotGranted = a.call(ctx, receive(*notGranted))
	return s, nil
}

type attacker struct {
	client *ksb.Client
	errors *ksb.Errors
	wait   time.Duration
}

// commitRecord produces a commit record with receipt and waits for its error record.
func (a *attacker) commitRecord(ctx context.Context, receipt *ksb.Receipt) outcome {
	record := ksb.NewCommit(a.client.Reader, receipt, nil)
	out := outcome{RequestID: record.RequestID}
	if err := a.client.Requests.Produce(ctx, receipt.Group, record); err != nil {
		out.ErrorReason = "not produced: " + err.Error()
		return out
	}
	waitCtx, cancel := context.WithTimeout(ctx, a.wait)
	defer cancel()
	rec, err := a.errors.Wait(waitCtx, record.RequestID)
	if err != nil {
		out.ErrorReason = err.Error()
		return out
	}
	out.ErrorCode, out.ErrorReason = rec.Code, rec.Reason
	return out
}

func (a *attacker) outcomeCall(ctx context.Context, lease string) outcome {
	return a.call(ctx, func(ctx context.Context, q queuev1.QueueServiceClient) error {
		_, err := q.Commit(ctx, &queuev1.CommitRequest{Lease: lease, RequestId: ksb.NewUUID(), TimeoutMs: 2000})
		return err
	})
}

func (a *attacker) call(ctx context.Context, call func(context.Context, queuev1.QueueServiceClient) error) outcome {
	return refusal(a.client.Queues.Call(ctx, 0, call))
}

func (a *attacker) callAs(ctx context.Context, md metadata.MD, call func(context.Context, queuev1.QueueServiceClient) error) outcome {
	return refusal(a.client.Queues.CallAs(ctx, md, 0, call))
}

func refusal(err error) outcome {
	var se *ksb.ServiceError
	if errors.As(err, &se) {
		return outcome{GRPC: se.Code.String(), Kind: se.Kind, Reason: se.Reason}
	}
	if err != nil {
		return outcome{GRPC: "?", Reason: err.Error()}
	}
	return outcome{GRPC: "OK"}
}

type leaseClaims struct {
	Queue string `json:"queue"`
	Group string `json:"group"`
	Token int64  `json:"token"`
}

// A lease is base64url(claims JSON) "." base64url(HMAC), unpadded (ksb.security.leases).
func readClaims(lease string) (leaseClaims, error) {
	var c leaseClaims
	head, _, _ := strings.Cut(lease, ".")
	raw, err := base64.RawURLEncoding.DecodeString(head)
	if err != nil {
		return c, err
	}
	return c, json.Unmarshal(raw, &c)
}

func withClaims(lease string, change func(map[string]any)) (string, error) {
	head, seal, _ := strings.Cut(lease, ".")
	raw, err := base64.RawURLEncoding.DecodeString(head)
	if err != nil {
		return "", err
	}
	var claims map[string]any
	if err := json.Unmarshal(raw, &claims); err != nil {
		return "", err
	}
	change(claims)
	changed, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(changed) + "." + seal, nil
}

// flipSealChar changes the seal's first character (its first six bits: a last character
// may carry padding bits that decode to the same bytes).
func flipSealChar(lease string) string {
	head, seal, _ := strings.Cut(lease, ".")
	c := byte('A')
	if seal[0] == 'A' {
		c = 'B'
	}
	return head + "." + string(c) + seal[1:]
}

func splitIDs(s string) []string {
	out := []string{}
	for _, id := range strings.Split(s, ",") {
		if id = strings.TrimSpace(id); id != "" {
			out = append(out, id)
		}
	}
	return out
}
