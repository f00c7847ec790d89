"""What ddpx's hierarchical all-reduce costs across nodes, on paper: the link's time for the
bytes each node must send, against the node's own work (reduce-scatter, casts, sums, all-gather),
which the chunked pipeline overlaps with the link except for the first chunk's trip.

Every time is in milliseconds and every rate in bits per second. ``node_ms`` is measured, not
modelled: the time the same all-reduce takes with nothing limiting the link (ddpx-bench's
``--link none`` row of the same engine and size), which on one machine includes every node's
work and the TCP copies on the same cores. The model is checked against the testbed in the
docs/benchmarks.md ("Across a network"), and predicts larger jobs there.
"""

from __future__ import annotations

__all__ = ["bytes_per_node", "flat_ring_ms", "hierarchical_ms"]


def bytes_per_node(size_bytes: float, nodes: int, wire_bytes: int = 4) -> float:
    """Bytes each node sends in one hierarchical all-reduce of a float32 message of
    ``size_bytes``: 2(N-1)/N of it, in the wire dtype (2 bytes for bf16/fp16)."""
    return 2 * (nodes - 1) / nodes * size_bytes * wire_bytes / 4


def hierarchical_ms(size_bytes: float, nodes: int, link_bits_per_s: float, node_ms: float,
                    chunks: int, wire_bytes: int = 4, latency_ms: float = 0.0,
                    steps: int | None = None) -> float:
    """The all-reduce's time as a pipeline of ``chunks`` chunks through two resources, the node
    (its share of ``node_ms`` per chunk: reduce-scatter before the chunk crosses, all-gather
    after) and the link (its share of the bytes): the first chunk's trip through both, then one
    chunk per step of the slower. ``latency_ms`` is the link's one-way delay, paid once per step
    of the cross-node exchange (1 between two nodes; 2(N-1) for the ring of N nodes), with every
    chunk in flight at once."""
    link_ms = bytes_per_node(size_bytes, nodes, wire_bytes) * 8 / link_bits_per_s * 1e3
    steps = steps if steps is not None else (1 if nodes == 2 else 2 * (nodes - 1))
    pipeline = (node_ms + link_ms) / chunks + (chunks - 1) / chunks * max(node_ms, link_ms)
    return pipeline + steps * latency_ms


def flat_ring_ms(size_bytes: float, nodes: int, local_ranks: int, link_bits_per_s: float,
                 latency_ms: float = 0.0) -> float:
    """A flat ring all-reduce of every rank (gloo's, across N nodes of L ranks, in node order),
    on the link alone: each rank sends 2(R-1)/R of the message to the next, for R = N L ranks,
    and one of a node's L ranks sends to the next node; 2(R-1) steps each pay the delay."""
    ranks = nodes * local_ranks
    sent = 2 * (ranks - 1) / ranks * size_bytes
    return sent * 8 / link_bits_per_s * 1e3 + 2 * (ranks - 1) * latency_ms
