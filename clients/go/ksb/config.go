// Package ksb is a small Go client of KSB (docs/protocol.md): BEGIN, SEND, END and the commit
// record are JSON requests it produces to its principal's requests topic over Kafka; RECEIVE,
// GET CONVERSATION GROUP, a commit's outcome, ROLLBACK and lock renewal are calls to the queue
// service's replicas over gRPC (proto/ksb/api/queue/v1/queue.proto). It mirrors the Python SDK
// (shared/ksb/sdk/client.py and queue_service.py) and exists to prove that the protocol works
// from a language other than Python.
package ksb

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Config is how a client reaches one broker instance. ConfigFromEnv reads it from the same
// KSB_* variables a Python client reads, so one deployment's variables serve both.
type Config struct {
	Instance         string        // KSB_INSTANCE
	Bootstrap        []string      // KSB_KAFKA_BOOTSTRAP, comma-separated host:port
	SecurityProtocol string        // KSB_KAFKA_SECURITY_PROTOCOL: SASL_PLAINTEXT, SASL_SSL or PLAINTEXT
	SASLMechanism    string        // KSB_KAFKA_SASL_MECHANISM: SCRAM-SHA-512 or SCRAM-SHA-256
	Username         string        // KSB_KAFKA_USERNAME: the principal's SCRAM user
	Password         string        // KSB_KAFKA_PASSWORD (a password file is preferred)
	PasswordFile     string        // KSB_KAFKA_PASSWORD_FILE: re-read whenever a login is needed
	SSLCA            string        // KSB_KAFKA_SSL_CA: PEM of the brokers' CA (SASL_SSL)
	Principal        string        // KSB_PRINCIPAL: who this client is to KSB (default: Username)
	QueueAddresses   []string      // KSB_QUEUE_ADDRESSES: the queue service's replicas, host:port
	QueueTimeout     time.Duration // KSB_QUEUE_TIMEOUT_MS: a call's time beyond its own wait
	LockRenew        time.Duration // KSB_LOCK_RENEW_MS: how often held locks are renewed
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ConfigFromEnv reads the KSB_* variables a client needs; the defaults are the Python SDK's.
func ConfigFromEnv() (Config, error) {
	get := func(name, def string) string {
		if v, ok := os.LookupEnv("KSB_" + name); ok {
			return v
		}
		return def
	}
	ms := func(name string, def int) (time.Duration, error) {
		raw := get(name, strconv.Itoa(def))
		n, err := strconv.Atoi(raw)
		if err != nil || n < 100 {
			return 0, fmt.Errorf("KSB_%s must be a whole number of milliseconds >= 100, not %q", name, raw)
		}
		return time.Duration(n) * time.Millisecond, nil
	}
	c := Config{
		Instance:         get("INSTANCE", "local"),
		Bootstrap:        splitList(get("KAFKA_BOOTSTRAP", "127.0.0.1:9092")),
		SecurityProtocol: get("KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT"),
		SASLMechanism:    get("KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
		Username:         get("KAFKA_USERNAME", ""),
		Password:         get("KAFKA_PASSWORD", ""),
		PasswordFile:     get("KAFKA_PASSWORD_FILE", ""),
		SSLCA:            get("KAFKA_SSL_CA", ""),
		Principal:        get("PRINCIPAL", ""),
		QueueAddresses:   splitList(get("QUEUE_ADDRESSES", "127.0.0.1:7070")),
	}
	var err error
	if c.QueueTimeout, err = ms("QUEUE_TIMEOUT_MS", 10_000); err != nil {
		return c, err
	}
	if c.LockRenew, err = ms("LOCK_RENEW_MS", 5_000); err != nil {
		return c, err
	}
	return c, c.Check()
}

// Check refuses a configuration that cannot work, naming the variable at fault.
func (c Config) Check() error {
	if !nameRE.MatchString(c.Instance) {
		return fmt.Errorf("KSB_INSTANCE %q: letters, digits, _ and - only", c.Instance)
	}
	if len(c.Bootstrap) == 0 {
		return fmt.Errorf("KSB_KAFKA_BOOTSTRAP names no broker")
	}
	if len(c.QueueAddresses) == 0 {
		return fmt.Errorf("KSB_QUEUE_ADDRESSES names no queue service replica")
	}
	switch c.SecurityProtocol {
	case "PLAINTEXT":
	case "SASL_PLAINTEXT", "SASL_SSL":
		if c.SASLMechanism != "SCRAM-SHA-512" && c.SASLMechanism != "SCRAM-SHA-256" {
			return fmt.Errorf("KSB_KAFKA_SASL_MECHANISM %q: SCRAM-SHA-512 or SCRAM-SHA-256", c.SASLMechanism)
		}
		if c.Username == "" || (c.Password == "" && c.PasswordFile == "") {
			return fmt.Errorf("security protocol %s needs KSB_KAFKA_USERNAME and KSB_KAFKA_PASSWORD(_FILE)", c.SecurityProtocol)
		}
	default:
		return fmt.Errorf("KSB_KAFKA_SECURITY_PROTOCOL %q: SASL_PLAINTEXT, SASL_SSL or PLAINTEXT", c.SecurityProtocol)
	}
	if p := c.ActingPrincipal(); p != "" && !nameRE.MatchString(p) {
		return fmt.Errorf("principal %q: 1-64 letters, digits, _ or -", p)
	}
	return nil
}

// Secured says whether the stack checks who the client is (anything but PLAINTEXT).
func (c Config) Secured() bool { return c.SecurityProtocol != "PLAINTEXT" }

// ActingPrincipal is who this client is to KSB: Principal, or its Kafka username.
func (c Config) ActingPrincipal() string {
	if c.Principal != "" {
		return c.Principal
	}
	return c.Username
}

// Secret is the Kafka password: the file's first line when a file is named (read now, so a
// rotated password is taken), else Password.
func (c Config) Secret() (string, error) {
	if c.Password != "" || c.PasswordFile == "" {
		return c.Password, nil
	}
	raw, err := os.ReadFile(c.PasswordFile)
	if err != nil {
		return "", fmt.Errorf("KSB_KAFKA_PASSWORD_FILE: %w", err)
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	if line == "" {
		return "", fmt.Errorf("KSB_KAFKA_PASSWORD_FILE: %s is empty", c.PasswordFile)
	}
	return line, nil
}

// RequestsTopic is the topic this client's requests go to: its principal's own on a secured
// stack (only it may write there, which is how the dispatcher knows the sender), the shared one
// on a stack without security.
func (c Config) RequestsTopic() string {
	if !c.Secured() {
		return fmt.Sprintf("ksb.%s.requests", c.Instance)
	}
	return fmt.Sprintf("ksb.%s.requests.%s", c.Instance, c.ActingPrincipal())
}

// ErrorsTopic is where the dispatcher puts the refusals of this client's requests.
func (c Config) ErrorsTopic() string {
	if !c.Secured() {
		return fmt.Sprintf("ksb.%s.errors", c.Instance)
	}
	return fmt.Sprintf("ksb.%s.errors.%s", c.Instance, c.ActingPrincipal())
}

func splitList(s string) []string {
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}
