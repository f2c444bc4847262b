package ksb

import (
	"context"
	"sync"
)

// Client is a connection to one broker instance: a producer of requests, and the queue service.
type Client struct {
	Config   Config
	Requests *Requests
	Queues   *QueueService
	// Reader names this client in the commit records it sends (diagnostics only).
	Reader string

	mu     sync.Mutex
	groups map[string]string // handle -> group, for handles whose group is not the handle
}

// NewClient connects to the instance c names.
func NewClient(c Config) (*Client, error) {
	if err := c.Check(); err != nil {
		return nil, err
	}
	requests, err := NewRequests(c)
	if err != nil {
		return nil, err
	}
	return &Client{Config: c, Requests: requests, Queues: NewQueueService(c),
		Reader: "ksbgo-" + NewUUID()[:12], groups: map[string]string{}}, nil
}

// Close flushes the requests handed over and closes both connections.
func (c *Client) Close(ctx context.Context) error {
	err := c.Requests.Flush(ctx)
	c.Requests.Close()
	c.Queues.Close()
	return err
}

// BeginDialog produces a BEGIN and returns the new conversation's handle.
func (c *Client) BeginDialog(ctx context.Context, from, to, contract string) (string, error) {
	b := NewBegin(from, to, contract)
	return b.Handle, c.Requests.Produce(ctx, b.Group(), b)
}

// Send produces a SEND on handle, keyed by the conversation's group as far as this client
// knows it (the handle itself unless it was begun in, or received from, another group).
func (c *Client) Send(ctx context.Context, handle, messageType string, body []byte) error {
	return c.Requests.Produce(ctx, c.GroupOf(handle), NewSend(handle, messageType, body))
}

// SendAsync is Send without waiting for Kafka; Requests.Flush waits for them all.
func (c *Client) SendAsync(ctx context.Context, handle, messageType string, body []byte, done func(error)) error {
	return c.Requests.ProduceAsync(ctx, c.GroupOf(handle), NewSend(handle, messageType, body), done)
}

// EndConversation produces an END on handle.
func (c *Client) EndConversation(ctx context.Context, handle string) error {
	return c.Requests.Produce(ctx, c.GroupOf(handle), NewEnd(handle))
}

// Transaction starts a transaction: RECEIVE under a group lock, act, then Commit or Rollback.
func (c *Client) Transaction() *Transaction {
	return &Transaction{client: c, seen: map[string]bool{}}
}

// GroupOf is the conversation group of handle as far as this client has seen.
func (c *Client) GroupOf(handle string) string {
	if g := c.groupHint(handle); g != "" {
		return g
	}
	return handle
}

// groupHint is the group to name in a commit's action on handle, when it is not the handle.
func (c *Client) groupHint(handle string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.groups[handle]
}

func (c *Client) learn(handle, group string) {
	if handle == group || handle == "" {
		return
	}
	c.mu.Lock()
	c.groups[handle] = group
	c.mu.Unlock()
}
