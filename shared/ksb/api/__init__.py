"""The queue service's API: the generated gRPC code of proto/ (`make proto`), version by version,
and the conversion of its messages to and from the wire records (`ksb.api.messages`)."""
