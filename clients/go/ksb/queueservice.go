package ksb

import (
	"context"
	"fmt"
	"log"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	queuev1 "ksb/clients/go/api/queue/v1"
)

// retryRounds is how many rounds over every replica a call makes before it gives up.
const retryRounds = 2

// QueueService calls the queue service's replicas: the first that answers, moving to the next
// when one is UNAVAILABLE or does not answer in time (every call carries all it needs: the
// lease, what the transaction received, so a transaction goes on on another replica). Every
// call carries the principal's login as metadata. The locks of open transactions are renewed
// from a goroutine every LockRenew.
type QueueService struct {
	cfg       Config
	addresses []string

	mu      sync.Mutex
	current int
	conn    *grpc.ClientConn
	stub    queuev1.QueueServiceClient
	leases  map[string]bool // the leases of open transactions -> still held, as last renewed

	stop    chan struct{}
	stopped chan struct{}
}

// NewQueueService connects lazily to c's replicas and starts renewing held locks.
func NewQueueService(c Config) *QueueService {
	q := &QueueService{cfg: c, addresses: c.QueueAddresses, leases: map[string]bool{},
		stop: make(chan struct{}), stopped: make(chan struct{})}
	go q.renewLoop()
	return q
}

// Login is the metadata every call carries: ksb-principal, and ksb-password on a secured
// stack (the principal's Kafka password: the service checks it with a Kafka login).
func (q *QueueService) Login() (metadata.MD, error) {
	if !q.cfg.Secured() {
		if p := q.cfg.ActingPrincipal(); p != "" {
			return metadata.Pairs("ksb-principal", p), nil
		}
		return metadata.MD{}, nil
	}
	password, err := q.cfg.Secret()
	if err != nil {
		return nil, err
	}
	return metadata.Pairs("ksb-principal", q.cfg.Username, "ksb-password", password), nil
}

// Call runs one call on a replica, moving past those that fail; wait is how long the call
// itself may wait (WAITFOR, a commit's outcome), on top of QueueTimeout. A refusal comes back
// as a *ServiceError.
func (q *QueueService) Call(ctx context.Context, wait time.Duration,
	call func(context.Context, queuev1.QueueServiceClient) error) error {
	md, err := q.Login()
	if err != nil {
		return err
	}
	return q.CallAs(ctx, md, wait, call)
}

// CallAs is Call with the given login metadata (a test of what the service refuses).
func (q *QueueService) CallAs(ctx context.Context, md metadata.MD, wait time.Duration,
	call func(context.Context, queuev1.QueueServiceClient) error) error {
	var last error
	for range retryRounds * len(q.addresses) {
		stub, at, err := q.stubNow()
		if err != nil {
			return err
		}
		callCtx, cancel := context.WithTimeout(metadata.NewOutgoingContext(ctx, md), wait+q.cfg.QueueTimeout)
		err = call(callCtx, stub)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		code := status.Code(err)
		if code != codes.Unavailable && code != codes.DeadlineExceeded {
			return serviceError(err)
		}
		last = err
		q.moveOn(at, code)
	}
	return fmt.Errorf("no queue service replica answered (%v): %w", q.addresses, serviceError(last))
}

func (q *QueueService) stubNow() (queuev1.QueueServiceClient, int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.stub == nil {
		conn, err := grpc.NewClient(q.addresses[q.current],
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, 0, err
		}
		q.conn, q.stub = conn, queuev1.NewQueueServiceClient(conn)
	}
	return q.stub, q.current, nil
}

// moveOn leaves replica at for the next (once, however many calls saw it fail).
func (q *QueueService) moveOn(at int, code codes.Code) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.current != at {
		return
	}
	next := (at + 1) % len(q.addresses)
	log.Printf("queue service %s: %s; trying %s", q.addresses[at], code, q.addresses[next])
	q.current = next
	if q.conn != nil {
		q.conn.Close()
	}
	q.conn, q.stub = nil, nil
}

// Current is the replica calls go to now.
func (q *QueueService) Current() string {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.addresses[q.current]
}

// Hold renews lease from now until LetGo.
func (q *QueueService) Hold(lease string) {
	q.mu.Lock()
	q.leases[lease] = true
	q.mu.Unlock()
}

// LetGo stops renewing lease.
func (q *QueueService) LetGo(lease string) {
	q.mu.Lock()
	delete(q.leases, lease)
	q.mu.Unlock()
}

// StillHeld is what the last renewal said of lease (true until one said otherwise).
func (q *QueueService) StillHeld(lease string) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.leases[lease]
}

// Renew renews leases now; one answer each: false when the lock is no longer held.
func (q *QueueService) Renew(ctx context.Context, leases ...string) ([]bool, error) {
	var reply *queuev1.RenewLocksReply
	err := q.Call(ctx, 0, func(ctx context.Context, s queuev1.QueueServiceClient) error {
		var err error
		reply, err = s.RenewLocks(ctx, &queuev1.RenewLocksRequest{Leases: leases})
		return err
	})
	if err != nil {
		return nil, err
	}
	return reply.GetHeld(), nil
}

func (q *QueueService) renewLoop() {
	defer close(q.stopped)
	tick := time.NewTicker(q.cfg.LockRenew)
	defer tick.Stop()
	for {
		select {
		case <-q.stop:
			return
		case <-tick.C:
		}
		q.mu.Lock()
		leases := make([]string, 0, len(q.leases))
		for l := range q.leases {
			leases = append(leases, l)
		}
		q.mu.Unlock()
		if len(leases) == 0 {
			continue
		}
		held, err := q.Renew(context.Background(), leases...)
		if err != nil {
			log.Printf("%d locks not renewed this time: %v", len(leases), err)
			continue
		}
		q.mu.Lock()
		for i, lease := range leases {
			if _, open := q.leases[lease]; open && i < len(held) {
				q.leases[lease] = held[i]
			}
		}
		q.mu.Unlock()
	}
}

// Close stops renewing and closes the connection.
func (q *QueueService) Close() {
	close(q.stop)
	<-q.stopped
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.conn != nil {
		q.conn.Close()
	}
	q.conn, q.stub = nil, nil
}
