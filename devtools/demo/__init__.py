"""`python -m devtools.demo` (`make run`): the whole system on this machine, end to end."""
