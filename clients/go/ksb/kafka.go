package ksb

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"os"
	"sync"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

// kafkaOptions are the login options of every Kafka client this package makes: SCRAM with the
// principal's password (re-read at each login, so a rotated password file is taken), TLS with
// the stack's CA on SASL_SSL.
func kafkaOptions(c Config) ([]kgo.Opt, error) {
	opts := []kgo.Opt{kgo.SeedBrokers(c.Bootstrap...), kgo.ClientID("ksbgo")}
	if !c.Secured() {
		return opts, nil
	}
	login := func(context.Context) (scram.Auth, error) {
		password, err := c.Secret()
		return scram.Auth{User: c.Username, Pass: password}, err
	}
	var mechanism sasl.Mechanism = scram.Sha512(login)
	if c.SASLMechanism == "SCRAM-SHA-256" {
		mechanism = scram.Sha256(login)
	}
	opts = append(opts, kgo.SASL(mechanism))
	if c.SecurityProtocol == "SASL_SSL" {
		tlsConfig := &tls.Config{MinVersion: tls.VersionTLS12}
		if c.SSLCA != "" {
			pem, err := os.ReadFile(c.SSLCA)
			if err != nil {
				return nil, fmt.Errorf("KSB_KAFKA_SSL_CA: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("KSB_KAFKA_SSL_CA: no certificate in %s", c.SSLCA)
			}
			tlsConfig.RootCAs = pool
		}
		opts = append(opts, kgo.DialTLSConfig(tlsConfig))
	}
	return opts, nil
}

// crc32Partitioner puts a keyed record where librdkafka's default partitioner would: CRC-32
// of the key modulo the partition count (franz-go's own default hashes with murmur2, which
// would send a request to another shard's partition and cost the dispatcher a relay hop).
func crc32Partitioner() kgo.Partitioner {
	return kgo.BasicConsistentPartitioner(func(string) func(*kgo.Record, int) int {
		return func(r *kgo.Record, n int) int {
			return int(crc32.ChecksumIEEE(r.Key) % uint32(n))
		}
	})
}

// Requests writes this client's requests to its principal's requests topic: keyed by the
// conversation group they act on, CRC-32 partitioned, through an idempotent producer (franz-go's
// default), so a retry never duplicates or reorders a request.
type Requests struct {
	client *kgo.Client
	topic  string
}

// NewRequests connects a producer for c's requests topic.
func NewRequests(c Config) (*Requests, error) {
	opts, err := kafkaOptions(c)
	if err != nil {
		return nil, err
	}
	opts = append(opts,
		kgo.DefaultProduceTopic(c.RequestsTopic()),
		kgo.RecordPartitioner(crc32Partitioner()),
		kgo.RequiredAcks(kgo.AllISRAcks()),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	return &Requests{client: cl, topic: c.RequestsTopic()}, nil
}

// Topic is the requests topic this producer writes.
func (r *Requests) Topic() string { return r.topic }

// Produce stores one request keyed by key and waits until Kafka has it.
func (r *Requests) Produce(ctx context.Context, key string, request any) error {
	value, err := json.Marshal(request)
	if err != nil {
		return err
	}
	res := r.client.ProduceSync(ctx, &kgo.Record{Key: []byte(key), Value: value})
	if err := res.FirstErr(); err != nil {
		return fmt.Errorf("request not stored in %s: %w", r.topic, err)
	}
	return nil
}

// ProduceAsync hands one request to the producer; done (may be nil) learns whether Kafka
// stored it. Requests of one key keep their order.
func (r *Requests) ProduceAsync(ctx context.Context, key string, request any, done func(error)) error {
	value, err := json.Marshal(request)
	if err != nil {
		return err
	}
	r.client.Produce(ctx, &kgo.Record{Key: []byte(key), Value: value}, func(_ *kgo.Record, err error) {
		if done != nil {
			done(err)
		}
	})
	return nil
}

// Flush waits until every request handed over is stored (or failed).
func (r *Requests) Flush(ctx context.Context) error { return r.client.Flush(ctx) }

// Close flushes nothing: call Flush first.
func (r *Requests) Close() { r.client.Close() }

// Errors reads the principal's errors topic from its beginning (read_committed: the
// dispatcher writes it in Kafka transactions), so a request's refusal can be found by its
// request id. Only the principal itself and the instance's operators may read it.
type Errors struct {
	client *kgo.Client
	mu     sync.Mutex
	seen   map[string]ErrorRecord
	wake   chan struct{}
	done   chan struct{}
	err    error
}

// NewErrors starts reading c's errors topic.
func NewErrors(c Config) (*Errors, error) {
	opts, err := kafkaOptions(c)
	if err != nil {
		return nil, err
	}
	opts = append(opts,
		kgo.ConsumeTopics(c.ErrorsTopic()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	e := &Errors{client: cl, seen: map[string]ErrorRecord{}, wake: make(chan struct{}), done: make(chan struct{})}
	go e.read()
	return e, nil
}

func (e *Errors) read() {
	defer close(e.done)
	for {
		fetches := e.client.PollFetches(context.Background())
		if fetches.IsClientClosed() {
			return
		}
		var failed error
		fetches.EachError(func(_ string, _ int32, err error) { failed = err })
		e.mu.Lock()
		if failed != nil {
			e.err = failed
		}
		fetches.EachRecord(func(r *kgo.Record) {
			var rec ErrorRecord
			if json.Unmarshal(r.Value, &rec) == nil && rec.RequestID != "" {
				e.seen[rec.RequestID] = rec
			}
		})
		close(e.wake)
		e.wake = make(chan struct{})
		e.mu.Unlock()
	}
}

// Wait returns the error record of requestID once it is read, or ctx's error.
func (e *Errors) Wait(ctx context.Context, requestID string) (ErrorRecord, error) {
	for {
		e.mu.Lock()
		rec, ok := e.seen[requestID]
		wake, failed := e.wake, e.err
		e.mu.Unlock()
		if ok {
			return rec, nil
		}
		select {
		case <-wake:
		case <-ctx.Done():
			if failed != nil {
				return ErrorRecord{}, fmt.Errorf("no error record for %s (reading the errors topic: %v)", requestID, failed)
			}
			return ErrorRecord{}, fmt.Errorf("no error record for %s: %w", requestID, ctx.Err())
		}
	}
}

// Close stops reading.
func (e *Errors) Close() {
	e.client.Close()
	<-e.done
}
