"""CUDA stream ordering where one replica's thread works on another replica's tensors.

Each replica issues its kernels on a stream of its own: replica 0 on the caller's current
stream, the others on their workers' streams (see ``_pool``). In a collective, the last replica
to arrive combines every replica's buffers on *its* stream and hands every replica results
made there. Kernels are asynchronous, so without ordering the combine could read a buffer
whose kernels are still queued on its owner's stream, and a replica could read its result
before the combine has written it: wrong values, silently.

So each replica marks its buffers ready (an event on its current stream) as it enters an
exchange; the combining replica's streams wait for every mark before combining, and mark the
results done; each replica's streams wait for that mark before using them. Memory that one
stream allocated and another uses is recorded on the user (``Tensor.record_stream``), so the
caching allocator never hands it out while that stream may still read it.

On the CPU (and for tensors of other devices) everything here is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["Marks", "mark", "wait", "hand_over"]

# (stream, event recorded on it) for each CUDA device the marked tensors are on.
Marks = tuple[tuple[torch.cuda.Stream, torch.cuda.Event], ...]


def mark(tensors: Iterable[torch.Tensor]) -> Marks | None:
    """The point reached on this thread's current stream of each CUDA device of ``tensors``
    (``None`` when none is on a CUDA device)."""
    devices = {t.device for t in tensors if t.is_cuda}
    if not devices:
        return None
    marks = []
    for device in devices:
        stream = torch.cuda.current_stream(device)
        marks.append((stream, stream.record_event()))
    return tuple(marks)


def wait(marks: Marks | None, tensors: Sequence[torch.Tensor] = ()) -> None:
    """Orders this thread's current streams after ``marks`` made on other streams, and keeps
    ``tensors`` (made on those streams) from being reused before this thread's streams are
    done with them."""
    if marks is None:
        return
    for stream, event in marks:
        current = torch.cuda.current_stream(stream.device)
        if current != stream:
            current.wait_event(event)
            for t in tensors:
                if t.device == stream.device:
                    t.record_stream(current)


def hand_over(results: Sequence[Sequence[torch.Tensor]], marks: Sequence[Marks | None]) -> Marks | None:
    """Marks ``results`` (made on this thread's streams; ``results[r]`` for the replica that
    made ``marks[r]``) done, and records each on its replica's stream, which will use it."""
    done = mark(t for row in results for t in row)
    if done is None:
        return None
    for row, replica_marks in zip(results, marks):
        if replica_marks is None:
            continue
        streams = {stream.device: stream for stream, _ in replica_marks}
        for t in row:
            stream = streams.get(t.device)
            if stream is not None and stream != torch.cuda.current_stream(t.device):
                t.record_stream(stream)
    return done
