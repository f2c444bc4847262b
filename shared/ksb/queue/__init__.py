"""The queue service's rules: each queue's index, the store of its bodies, lock leases given out,
commit outcomes awaited, logins checked. `services.queue` is the shell around them."""
