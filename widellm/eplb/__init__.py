"""Expert-parallel load balancing (EPLB).

``planner`` turns measured per-expert load into a placement of logical experts on physical
expert slots (pure functions on CPU tensors); ``routing`` maps the router's logical expert ids
onto those physical slots, spreading a replicated expert's tokens over its replicas.
"""
