"""widellm's cluster simulator: the engine's own scheduler, KV manager, load balancer, EPLB
and DBO policy driven in virtual time, with a cost model per operation in place of the
forward (issue 26)."""
