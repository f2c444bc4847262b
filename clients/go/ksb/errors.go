package ksb

import (
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ServiceError is a call the queue service refused. Its details are "<kind>: <reason>", kind
// being KSB's error code (bad_lease, not_authorized, unauthenticated, lock_lost, ...).
type ServiceError struct {
	Code   codes.Code
	Kind   string
	Reason string
}

func (e *ServiceError) Error() string {
	return fmt.Sprintf("queue service: %s: %s: %s", e.Code, e.Kind, e.Reason)
}

// serviceError turns a gRPC error into a *ServiceError (any other error is returned as is).
func serviceError(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	kind, reason, found := strings.Cut(st.Message(), ": ")
	if !found {
		kind, reason = "", st.Message()
	}
	return &ServiceError{Code: st.Code(), Kind: kind, Reason: reason}
}

// CodeOf is the gRPC status code of a queue service refusal (codes.OK when err is none).
func CodeOf(err error) codes.Code {
	var se *ServiceError
	if errors.As(err, &se) {
		return se.Code
	}
	if err == nil {
		return codes.OK
	}
	return codes.Unknown
}

// CommitRefused is a commit the dispatcher did not apply; Reason says why ("stale_token: ...",
// "already_received: ...", "bad_lease: ...").
type CommitRefused struct{ Reason string }

func (e *CommitRefused) Error() string { return "commit refused: " + e.Reason }

// LockLost is a transaction whose group lock is no longer held: its commit must not go ahead.
type LockLost struct{ Group string }

func (e *LockLost) Error() string { return "lost the lock on group " + e.Group + " before commit" }
