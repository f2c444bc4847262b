"""The chaos harness (`make chaos`, issue #14): exactly-once, in-order delivery and fenced commits
across two broker instances and a forwarder while a seeded schedule of faults hits every process.

Modules, one concept each: `workload` (the dialogs and the readers' rules), `schedule` (the faults
drawn from a seed), `stack` (Kafka and Redis that can be killed and restarted), `topology` (the
instances and their processes, supervised), `faults` (injecting and healing), `zombie` (a
commit that comes back after its lease), `reader` (a reader process), `facts` and `invariants`
(what Kafka recorded, and the checks), `round` (one round), `report` (the table).
"""
