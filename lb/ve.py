"""VE LB: send a request's images to the vision encoder that finishes them first.

Role
    Called by the entrypoint for requests with images, before prefill, with
    a snapshot of every VE instance. Pure; no I/O.

Rule
    An image whose hash is in an instance's ``cached_images`` costs nothing
    there (its encoder output is cached); every other image costs one encode.
    Estimated completion = (queued images + uncached distinct images of this
    request) x ``seconds_per_image`` (an image repeated in one request is
    encoded once). Lowest wins; ties prefer more cache hits (keeps
    the cache warm), then snapshot order. So image-hash affinity wins until
    the affine instance's queue is longer than the encodes it saves.
    ``max_queue_images`` (optional) is admission control: instances at or
    over it take no work; if all are, the decision is a rejection with a
    reason. A request with no images is routed to the shortest queue.

Baseline in the same module: :class:`VELeastQueue` (queue only).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Sequence

from lb.types import Decision, LBInputError, VEInstance, VERequest, check_unique_ids

__all__ = ["KVStackVEPolicy", "VELeastQueue"]


def _live(instances: Sequence[VEInstance]) -> tuple[list[VEInstance], str | None]:
    if not instances:
        return [], "no VE instances in the snapshot"
    check_unique_ids(instances)
    live = [i for i in instances if i.healthy]
    return live, (None if live else f"all {len(instances)} VE instances are unhealthy")


class KVStackVEPolicy:
    """Image-hash affinity traded against queue length, in encode-time units."""

    name = "kvstack"

    def __init__(self, models=None, *, seconds_per_image: float = 0.05, max_queue_images: int | None = None) -> None:
        spi = seconds_per_image
        if isinstance(spi, bool) or not isinstance(spi, Real) or not math.isfinite(spi) or spi <= 0:
            raise LBInputError(f"KVStackVEPolicy.seconds_per_image must be a finite number > 0, got {spi!r}")
        mq = max_queue_images
        if mq is not None and (isinstance(mq, bool) or not isinstance(mq, Integral) or mq <= 0):
            # NaN would compare false with every queue and reject every request; "4" would raise TypeError
            raise LBInputError(f"KVStackVEPolicy.max_queue_images must be None or an integer > 0, got {mq!r}")
        self.spi = seconds_per_image
        self.max_queue = max_queue_images

    def choose(self, req: VERequest, instances: Sequence[VEInstance]) -> Decision:
        live, why = _live(instances)
        if why:
            return Decision(None, why)
        if self.max_queue is not None:
            open_ = [i for i in live if i.queue_images < self.max_queue]
            if not open_:
                return Decision(None, f"all {len(live)} healthy VE instances have >= {self.max_queue} images queued")
            live = open_
        imgs = tuple(dict.fromkeys(req.image_hashes))  # distinct, in order: a repeated image is encoded once
        hits = {i.id: sum(1 for h in imgs if h in i.cached_images) for i in live}
        est = {i.id: (i.queue_images + len(imgs) - hits[i.id]) * self.spi for i in live}
        pick = min(live, key=lambda i: (est[i.id], -hits[i.id]))
        return Decision(pick.id, f"est {est[pick.id] * 1e3:.0f} ms, {hits[pick.id]}/{len(imgs)} images cached", est)


class VELeastQueue:
    """Shortest image queue; ignores the encoder cache."""

    name = "least_queue"

    def __init__(self, models=None) -> None:
        pass

    def choose(self, req: VERequest, instances: Sequence[VEInstance]) -> Decision:
        live, why = _live(instances)
        if why:
            return Decision(None, why)
        est = {i.id: float(i.queue_images) for i in live}
        pick = min(live, key=lambda i: est[i.id])
        return Decision(pick.id, "shortest queue", est)
