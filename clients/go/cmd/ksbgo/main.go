// Command ksbgo runs KSB scenarios from Go, for the integration tests
// (tests/integration/test_go_client.py) and for anyone checking a stack by hand. It reads its
// login from the KSB_* variables (ksb.ConfigFromEnv) and prints one JSON summary on stdout.
//
//	ksbgo initiate --dialogs N --messages M      BEGIN N dialogs, SEND M requests on each
//	ksbgo serve --expect K                       RECEIVE with a lock, reply in the commit, COMMIT;
//	                                             also ROLLBACK, WHERE, GET CONVERSATION GROUP and a
//	                                             transaction that outlives the lock's TTL (renewal)
//	ksbgo attack --stolen-lease L ...            what the queue service and the dispatcher refuse
//	ksbgo receive [--group G]                    RECEIVE once, print the lease, roll back
//	ksbgo commit-record --group G --lease L ...  one commit record with that receipt, and its fate
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"ksb/clients/go/ksb"
)

func main() {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	log.SetPrefix("ksbgo ")
	if len(os.Args) < 2 {
		fail(fmt.Errorf("usage: ksbgo initiate|serve|attack|receive|commit-record [flags] (see the package comment)"))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg, err := ksb.ConfigFromEnv()
	if err != nil {
		fail(err)
	}
	var summary any
	switch os.Args[1] {
	case "initiate":
		summary, err = initiate(ctx, cfg, os.Args[2:])
	case "serve":
		summary, err = serve(ctx, cfg, os.Args[2:])
	case "attack":
		summary, err = attack(ctx, cfg, os.Args[2:])
	case "receive":
		summary, err = receiveOnce(ctx, cfg, os.Args[2:])
	case "commit-record":
		summary, err = commitRecord(ctx, cfg, os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: initiate, serve, attack, receive or commit-record", os.Args[1])
	}
	if err != nil {
		fail(err)
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", " ")
	if err := out.Encode(summary); err != nil {
		fail(err)
	}
}

func fail(err error) {
	log.Printf("error: %v", err)
	os.Exit(1)
}

func ms(d time.Duration) int64 { return d.Milliseconds() }
