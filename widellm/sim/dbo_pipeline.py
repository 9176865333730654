"""The schedule of two DBO micro-batches through a stack of MoE layers, event by event.

A micro-batch's MoE layer is a chain of four stages, two on the compute stream and two on the
communication resource (the NIC / copy engines, one transfer at a time):

    pre (attention, projections, router, shared experts)  -> compute
    dispatch                                              -> communication
    experts                                               -> compute
    combine                                               -> communication

and the next layer's ``pre`` needs this layer's combine. The two micro-batches ping-pong at the
yield points (the engine's DBO, SGLang's TBO, DeepSeek's two micro-batches): the compute stream
runs ``pre0, pre1, experts0, experts1`` per layer and the communication resource ``dispatch0,
dispatch1, combine0, combine1``; every stage starts when its resource is free and its
predecessor in the chain has finished.

The ideal overlap, ``layers * max(sum of compute, sum of communication)``, is the lower bound
this schedule reaches only when the chain of one micro-batch is short next to the busier
resource. With few rows per micro-batch the chain (``pre + dispatch + experts + combine``) is
latency-bound and two micro-batches cannot keep either resource busy: the pipeline bubbles
that make DBO lose on small decode batches (SGLang measured -27% at 32 tokens per GPU). The
last layer's combine is never hidden (the drain).

Hand-checkable example (one layer, ``pre=2, dispatch=1, experts=2, combine=1``)::

    compute: pre0 [0, 2]  pre1 [2, 4]  experts0 [4, 6]  experts1 [6, 8]
    comm:    dispatch0 [2, 3]  dispatch1 [4, 5]  combine0 [6, 7]  combine1 [8, 9]

    -> total 9, compute busy 8, communication busy 4 (the ideal bound says 8).

A second layer starts ``pre0`` at 8 (the stream is free at 8, combine0 ended at 7) and ends at
17.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PipelineTimes:
    """Seconds of ``num_layers`` MoE layers of two micro-batches.

    Attributes:
        total_s: from the first ``pre`` to the last ``combine``.
        compute_s: the compute stream's busy time (both micro-batches).
        comm_s: the communication resource's busy time.
    """

    total_s: float
    compute_s: float
    comm_s: float

    @property
    def exposed_comm_s(self) -> float:
        """Time the compute stream waited on communication (``total - compute``)."""
        return max(0.0, self.total_s - self.compute_s)


def two_batch_pipeline(pre: float, dispatch: float, experts: float, combine: float,
                       num_layers: int) -> PipelineTimes:
    """Schedule two equal micro-batches (each stage's seconds for one micro-batch) through
    ``num_layers`` MoE layers; see the module docstring for the order and an example."""
    for name, value in (("pre", pre), ("dispatch", dispatch), ("experts", experts),
                        ("combine", combine)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if num_layers <= 0:
        return PipelineTimes(0.0, 0.0, 0.0)
    compute_free = comm_free = 0.0
    combined = [0.0, 0.0]  # each micro-batch's last combine end
    for _ in range(num_layers):
        pre_done = []
        for mb in (0, 1):
            compute_free = max(compute_free, combined[mb]) + pre
            pre_done.append(compute_free)
        dispatched = []
        for mb in (0, 1):
            comm_free = max(comm_free, pre_done[mb]) + dispatch
            dispatched.append(comm_free)
        experts_done = []
        for mb in (0, 1):
            compute_free = max(compute_free, dispatched[mb]) + experts
            experts_done.append(compute_free)
        for mb in (0, 1):
            comm_free = max(comm_free, experts_done[mb]) + combine
            combined[mb] = comm_free
    return PipelineTimes(total_s=max(compute_free, comm_free),
                         compute_s=2 * num_layers * (pre + experts),
                         comm_s=2 * num_layers * (dispatch + combine))
