"""Development tools, not part of the installed package: the local stack, the process runner, a
local Prometheus and the `make run` demo."""
