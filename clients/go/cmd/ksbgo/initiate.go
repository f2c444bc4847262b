package main

import (
	"context"
	"encoding/json"
	"flag"
	"sync"
	"time"

	"ksb/clients/go/ksb"
)

type initiateSummary struct {
	Dialogs   []string `json:"dialogs"`
	Sent      int      `json:"sent"`
	ElapsedMS int64    `json:"elapsed_ms"`
}

// initiate BEGINs dialogs and SENDs requests on each, bodies {"conv": i, "n": j}: every request
// a record on the principal's requests topic, keyed by the dialog's group (its handle).
func initiate(ctx context.Context, cfg ksb.Config, args []string) (any, error) {
	fs := flag.NewFlagSet("initiate", flag.ExitOnError)
	from := fs.String("from", "//t/Initiator", "the initiating service")
	to := fs.String("to", "//t/Target", "the target service")
	contract := fs.String("contract", "//t/Contract", "the contract")
	messageType := fs.String("message-type", "//t/Request", "the requests' message type")
	dialogs := fs.Int("dialogs", 4, "dialogs to BEGIN")
	messages := fs.Int("messages", 5, "requests to SEND on each dialog")
	_ = fs.Parse(args)

	client, err := ksb.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	summary := initiateSummary{}
	var mu sync.Mutex
	var failed error
	done := func(err error) {
		if err != nil {
			mu.Lock()
			failed = err
			mu.Unlock()
		}
	}
	for i := range *dialogs {
		handle, err := client.BeginDialog(ctx, *from, *to, *contract)
		if err != nil {
			client.Close(ctx)
			return nil, err
		}
		summary.Dialogs = append(summary.Dialogs, handle)
		for j := range *messages {
			body, _ := json.Marshal(map[string]int{"conv": i, "n": j})
			if err := client.SendAsync(ctx, handle, *messageType, body, done); err != nil {
				client.Close(ctx)
				return nil, err
			}
			summary.Sent++
		}
	}
	if err := client.Close(ctx); err != nil {
		return nil, err
	}
	if failed != nil {
		return nil, failed
	}
	summary.ElapsedMS = ms(time.Since(start))
	return summary, nil
}
